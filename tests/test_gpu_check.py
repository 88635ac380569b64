"""benchmarks/gpu_check.sh is correct before a GPU exists: its CPU fallback runs every step
(bfloat16 scan, sweep vs the TransformerLens loop with AtP*, 1-rank torchrun vs one process,
a --device-map split vs the whole model, pruned speed) on the tiny model and prints one summary line whose numbers hold."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_cpu_fallback_runs_every_step(tiny_dir, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--device", "cpu", "--model", str(tiny_dir), "--quick",
                           "--out", str(tmp_path / "check")], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    log = (tmp_path / "check" / "gpu_check.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    fields = dict(kv.split("=", 1) for kv in last.split()[1:])
    assert fields["device"] == "cpu" and fields["failed"] == "none"
    assert fields["scan_bf16_nan"] == "0"
    assert float(fields["torchrun_max_diff"]) <= 1e-6  # one rank under torchrun = one process
    assert float(fields["device_map_max_diff"]) <= 1e-6  # split over CPU and disk = whole
    assert "on cpu, disk (--device-map)" in log  # and it really was split
    assert float(fields["max_loss_diff"]) < 1e-3  # the engine equals the hook loop
    for key in ("ratio", "spearman", "atp_spearman", "realised_0.25", "realised_0.5"):
        float(fields[key])  # a number, not empty
    assert last in log  # the log ends with the line printed


def test_gpu_check_refuses_an_unknown_argument():
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--gpus", "2"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown argument --gpus" in proc.stderr
