"""benchmarks/gpu_check.sh is correct before a GPU exists: its CPU fallback runs every step on the
tiny model -- every headprobe command (the COMMANDS registry: a command added without a step fails
here), the sweep vs the TransformerLens loop with AtP*, 1-rank torchrun vs one process, a
--device-map split vs the whole model, pruned speed -- one line each, and one summary line whose
numbers hold; benchmarks/run_peak.py, which runs the steps, reports exit codes, time-outs and peak
memory as they are."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from headprobe.commands import COMMANDS

ROOT = Path(__file__).resolve().parents[1]


def _fields(line: str) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in line.split()[1:])


def test_gpu_check_cpu_fallback_runs_every_command(tiny_dir, tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            "bash",
            "benchmarks/gpu_check.sh",
            "--device",
            "cpu",
            "--model",
            str(tiny_dir),
            "--quick",
            "--out",
            str(tmp_path / "check"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    log = (tmp_path / "check" / "gpu_check.log").read_text()
    assert proc.returncode == 0, log[-3000:]
    lines = proc.stdout.strip().splitlines()
    steps = [_fields(line) for line in lines if line.startswith("gpu_check_step ")]
    # one line per step, every one passed, with its wall time, CPU time and peak memory
    assert steps and all(s["rc"] == "0" for s in steps), [s for s in steps if s["rc"] != "0"]
    for s in steps:
        assert float(s["wall_s"]) > 0 and float(s["cpu_s"]) >= 0 and float(s["peak_rss_mib"]) > 50, s
        assert s["peak_gpu_mib"] == "n/a"  # the CPU build of torch: no GPU memory to report
    # every registered command was run (and passed); nothing else is called a command
    assert {s["command"] for s in steps} - {"-"} == set(COMMANDS.names())
    names = [s["name"] for s in steps]
    assert len(set(names)) == len(names)
    for name in (
        "scan_f32",
        "scan_bf16",
        "scan_holm",
        "prune",
        "prune_reload",
        "patch_z",
        "patch_q",
        "patch_k",
        "patch_v",
        "patch_resid",
        "export",
        "import",
        "sweep",
        "ablate_torchrun",
        "ablate_device_map",
        "pruned_speed",
    ):
        assert name in names, name
    last = lines[-1]
    fields = _fields(last)
    assert fields["device"] == "cpu" and fields["failed"] == "none"
    assert fields["commands"] == f"{len(COMMANDS.names())}/{len(COMMANDS.names())}" and fields["missing"] == "none"
    assert fields["steps"] == str(len(steps)) and fields["peak_gpu_mib"] == "n/a"
    assert fields["scan_bf16_nan"] == "0" and fields["scan_f32_nan"] == "0"
    assert float(fields["torchrun_max_diff"]) <= 1e-6  # one rank under torchrun = one process
    assert float(fields["device_map_max_diff"]) <= 1e-6  # split over CPU and disk = whole
    assert "on cpu, disk (--device-map)" in log  # and it really was split
    assert float(fields["max_loss_diff"]) < 1e-3  # the engine equals the hook loop
    for key in ("ratio", "spearman", "atp_spearman", "realised_0.25", "realised_0.5", "elapsed_s"):
        float(fields[key])  # a number, not empty
    assert (tmp_path / "check" / "prune" / "pruned_model").is_dir()  # the reload read the saved pruned model
    assert "steps forked" in log  # torch and headprobe imported once, not per step
    assert last in log  # the log ends with the line printed


def test_run_peak_reports_exit_codes_time_outs_and_memory(tmp_path):
    """The runner's numbers against known cases: a script's exit code, one killed at the time-out
    (124, as ``timeout``), one that holds 300 MiB (peak RSS at least that), each in a new process
    (GPU_CHECK_FORK=0, the path taken where CUDA is initialised before the steps)."""
    (tmp_path / "exit3.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "sleep.py").write_text("import time\ntime.sleep(60)\n")
    (tmp_path / "hold.py").write_text("b = bytearray(300 * 2**20)\nb[::4096] = b'x' * len(b[::4096])\n")
    (tmp_path / "plan.txt").write_text("".join(f"{n} - {tmp_path / n}.py\n" for n in ("exit3", "sleep", "hold")))
    env = {**os.environ, "GPU_CHECK_FORK": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [
            sys.executable,
            "benchmarks/run_peak.py",
            "--plan",
            str(tmp_path / "plan.txt"),
            "--log",
            str(tmp_path / "log"),
            "--timeout",
            "10",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr  # a step failed
    steps = {f["name"]: f for f in map(_fields, proc.stdout.strip().splitlines())}
    assert [steps[n]["rc"] for n in ("exit3", "sleep", "hold")] == ["3", "124", "0"]
    assert 10 <= float(steps["sleep"]["wall_s"]) < 30
    assert float(steps["hold"]["peak_rss_mib"]) >= 300
    assert "steps in new processes" in (tmp_path / "log").read_text()


def test_gpu_check_refuses_an_unknown_argument():
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--gpus", "2"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown argument --gpus" in proc.stderr
