"""Run commands as ``python`` would and report each one's exit code, wall time and peak memory.

Two forms:

* ``python benchmarks/run_peak.py -m MODULE ARGS...`` (or ``SCRIPT ARGS...``): runs it in this
  process, as ``python -m MODULE ARGS`` (``python SCRIPT ARGS``) would, then appends
  ``peak_gpu_mib=<x>`` to the file ``$RUN_PEAK_FILE`` where that is set and the run initialised
  CUDA, and exits with its code.
  ``benchmarks/gpu_check.sh`` gives it to torchrun as the worker program, so the worker's GPU
  memory is counted too.
* ``python benchmarks/run_peak.py --plan PLAN --log LOG [--timeout S]``: runs every step of PLAN
  in order and prints one line per step::

      gpu_check_step name=<step> command=<headprobe command or -> rc=<exit code> wall_s=<s>
      cpu_s=<s> peak_gpu_mib=<MiB or n/a> peak_rss_mib=<MiB>

  A PLAN line is ``NAME COMMAND ARGV...``, shell-quoted (``printf %q``), ARGV starting with
  ``-m MODULE`` or a script path. The step's output goes to LOG. The heavy imports (torch,
  transformers, TransformerLens, headprobe) are made once here and each step runs in a forked
  child, so a step costs its own work, not a fresh interpreter's imports (about 12 s of CPU each
  where no bytecode is cached, PYTHONDONTWRITEBYTECODE). Where CUDA is already initialised here (a fork would break it) or
  ``GPU_CHECK_FORK=0``, each step runs in its own interpreter instead (this file's first form).

Memory: ``peak_gpu_mib`` is ``torch.cuda.max_memory_allocated`` summed over the GPUs (tensors
held by PyTorch's allocator; the CUDA context and the allocator's unused cache are not in it), the
largest over the step's process and the processes it started that report to ``$RUN_PEAK_FILE``;
``0`` where a step on a CUDA machine used no GPU, ``n/a`` where there is no CUDA. ``peak_rss_mib``
is the step's peak resident set size (``ru_maxrss`` from ``wait4``: its process or the largest of
the processes it waited for); Linux counts a forked child's pages shared with its parent, so it is
at least the runner's own (its imports: ~0.4 GiB forked, ~0.2 GiB with ``GPU_CHECK_FORK=0``).
``cpu_s`` is the CPU time (user + system) of the step's process and the processes it waited for.
A step past ``--timeout`` seconds is killed (its process group) and reported with rc=124, as
``timeout`` would.
"""

from __future__ import annotations

import os
import runpy
import shlex
import signal
import sys
import time

PEAK_ENV = "RUN_PEAK_FILE"
PRELOAD = (
    "torch",
    "numpy",
    "pandas",
    "scipy.stats",
    "matplotlib.pyplot",
    "transformers",
    "transformer_lens",
    "transformers.modeling_utils",
    "transformers.core_model_loading",
    "transformers.models.auto.modeling_auto",
    "transformers.models.auto.tokenization_auto",
    "transformers.models.llama.modeling_llama",
    "torch.distributed.run",
    "headprobe.cli",
    "headprobe.options",
    "headprobe.probe.backends.loading",
    "headprobe.probe.model.convert",
)


def gpu_peak_mib() -> str | None:
    """This process's peak GPU memory of tensors in MiB; None where it did not initialise CUDA."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    total = sum(torch.cuda.max_memory_allocated(i) for i in range(torch.cuda.device_count()))
    return f"{total / 2**20:.0f}"


def run_in_process(argv: list[str]) -> int:
    """Run ``-m MODULE ARGS`` or ``SCRIPT ARGS`` here as ``python`` would; the exit code."""
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path[0] = os.getcwd()  # as python -m puts the working directory first
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:  # reported as python reports an uncaught exception, exit 1
        import traceback

        traceback.print_exc()
        return 1


def report_peak() -> None:
    """Append this process's GPU peak to ``$RUN_PEAK_FILE`` (where set)."""
    path, peak = os.environ.get(PEAK_ENV), gpu_peak_mib()
    if path and peak is not None:
        with open(path, "a") as f:
            f.write(f"peak_gpu_mib={peak}\n")


def single(argv: list[str]) -> int:
    rc = run_in_process(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    report_peak()
    return rc


def _child(argv: list[str], log: str) -> None:
    """In the forked child: own process group, output to the log, run, report, exit without cleanup."""
    os.setpgid(0, 0)
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    rc = 1
    try:
        rc = single(argv)
    finally:
        os._exit(rc if 0 <= rc < 256 else 1)


def _wait(pid: int, timeout: float):
    """``(rc, rusage)`` of child ``pid``; past ``timeout`` seconds its process group is killed, rc 124."""
    deadline = time.monotonic() + timeout
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status), usage
        if time.monotonic() > deadline:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            _, status, usage = os.wait4(pid, 0)
            return 124, usage
        time.sleep(0.02)


def _start(argv: list[str], log: str, fork: bool) -> int:
    if fork:
        pid = os.fork()
        if pid == 0:
            _child(argv, log)
        return pid
    import subprocess

    with open(log, "a") as out:
        return subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *argv], stdout=out, stderr=out, start_new_session=True
        ).pid


def preload() -> None:
    """Import here, once, what the steps import: :data:`PRELOAD` and every command's run module
    (the model family's transformers modules are lazy: Llama's, the embedded model's, are listed)."""
    import importlib

    names = list(PRELOAD)
    try:
        from headprobe.commands import COMMANDS

        names += [COMMANDS.get(name).run.partition(":")[0] for name in COMMANDS.names()]
    except Exception:  # a broken registry is reported by the steps themselves
        pass
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:  # a missing optional module is imported (or refused) by the step itself
            pass


def run_plan(plan: str, log: str, timeout: float) -> int:
    """Run every step of ``plan``; print one line each; 0 when every step exited 0."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # the imports must not initialise CUDA
    fork = os.environ.get("GPU_CHECK_FORK", "1") != "0"
    if fork:
        preload()
    import torch

    fork = fork and not torch.cuda.is_initialized()
    cuda = torch.cuda.is_available()
    with open(log, "a") as out:
        out.write(f"torch {torch.__version__} cuda {cuda}; steps {'forked' if fork else 'in new processes'}\n")
    failed = 0
    with open(plan) as f:
        steps = [shlex.split(line) for line in f if line.strip()]
    for name, command, *argv in steps:
        peak_file = f"{log}.{name}.peak"
        if os.path.exists(peak_file):
            os.remove(peak_file)
        os.environ[PEAK_ENV] = peak_file
        with open(log, "a") as out:
            out.write(f"## {name}: {shlex.join(argv)}\n")
        sys.stdout.flush()
        start = time.perf_counter()
        rc, usage = _wait(_start(argv, log, fork), timeout)
        wall = time.perf_counter() - start
        gpu = _read_peaks(peak_file, "0" if cuda else "n/a")
        line = (
            f"gpu_check_step name={name} command={command} rc={rc} wall_s={wall:.1f} "
            f"cpu_s={usage.ru_utime + usage.ru_stime:.1f} peak_gpu_mib={gpu} peak_rss_mib={usage.ru_maxrss / 1024:.0f}"
        )
        with open(log, "a") as out:
            out.write(f"## {name} rc={rc}\n{line}\n")
        print(line, flush=True)
        failed += rc != 0
    return 1 if failed else 0


def _read_peaks(path: str, none: str) -> str:
    """The largest ``peak_gpu_mib`` the step's processes wrote to ``path`` (``none`` where none did)."""
    try:
        with open(path) as f:
            values = [line.strip().split("=", 1)[1] for line in f if line.startswith("peak_gpu_mib=")]
        os.remove(path)
    except FileNotFoundError:
        return none
    return f"{max(float(v) for v in values):.0f}" if values else none


def main(argv: list[str]) -> int:
    if argv[:1] == ["--plan"]:
        import argparse

        p = argparse.ArgumentParser(allow_abbrev=False, prog="run_peak.py")
        p.add_argument("--plan", required=True)
        p.add_argument("--log", required=True)
        p.add_argument("--timeout", type=float, default=600)
        a = p.parse_args(argv)
        return run_plan(a.plan, a.log, a.timeout)
    if not argv or (argv[0] == "-m" and len(argv) < 2):
        print("usage: run_peak.py (-m MODULE | SCRIPT) ARGS... | --plan PLAN --log LOG [--timeout S]", file=sys.stderr)
        return 2
    return single(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
