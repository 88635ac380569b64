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
            "3",
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
    assert 3 <= float(steps["sleep"]["wall_s"]) < 23  # killed at 3 s, not at its 60
    assert float(steps["hold"]["peak_rss_mib"]) >= 300
    assert "steps in new processes" in (tmp_path / "log").read_text()


def _bench(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH") or str(ROOT)}
    return subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


def test_sweep_and_speed_benchmarks_load_a_model_as_the_commands_do(tmp_path):
    """gpu_check's sweep step (benchmarks/ablation_sweep.py) read --model with transformers alone: a
    headprobe train directory, which every command takes, failed with a traceback and exit 1
    (walk-gpu trip 3). It now loads as the commands do (headprobe.load_model); such a directory has no
    TransformerLens weights and is its own hook-loop reference, which the engine equals. Bad input to
    it and to pruned_speed.py (gpu_check's other benchmark) is one line on stderr and exit 2."""
    from headprobe.cli import main

    m = tmp_path / "m"
    assert main(["train", "--out", str(m), "--steps", "4", "--warmup", "1", "--formats", "none"]) == 0
    proc = _bench("ablation_sweep.py", "--model", str(m), "--device", "cpu", "--n-seqs", "2", "--seq-len", "16")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "(a) the native model's hook loop" in proc.stdout
    last = _fields("sweep " + proc.stdout.strip().splitlines()[-1])
    assert float(last["max_loss_diff"]) < 1e-5 and -1 <= float(last["spearman"]) <= 1, last
    for script, args, said in [
        ("ablation_sweep.py", ["--model", str(tmp_path), "--device", "cpu"], "has no config.json"),
        ("ablation_sweep.py", ["--model", str(m), "--device", "cuda:7"], "--device cuda:7"),
        ("ablation_sweep.py", ["--n-seqs", "0"], "--n-seqs: must be a positive integer, got 0"),
        ("pruned_speed.py", ["--model", str(tmp_path)], "has no config.json"),
        ("pruned_speed.py", ["--fractions", "0.5,2"], "each share must be between 0 and 1"),
    ]:
        proc = _bench(script, *args)
        err = proc.stderr
        assert proc.returncode == 2 and err.count("\n") == 1 and err.startswith(f"{script}: error: "), (args, err)
        assert said in err, (args, err)


def test_gpu_check_refuses_an_unknown_argument():
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--gpus", "2"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown argument --gpus" in proc.stderr
