"""Load time of a GGUF model (default smollm2-135m) without and with the weights cache.

Usage: ``.venv/bin/python benchmarks/load_time.py [--model smollm2-135m] [--warm-runs 1]``

Each run is a fresh Python process pointed at one new, empty cache directory
(``HEADPROBE_CACHE`` in a temporary directory, removed at the end):

* cold: the first process finds the cache empty, dequantizes the GGUF file and writes the entry;
* warm: the next ones read the entry.

A process imports headprobe's loading module, then calls
:func:`headprobe.probe.backends.loading.load_model` (``backend="auto"``, the self-check included), what
every command does. A warm native load reads the entry's weights straight into headprobe's own
transformer, without building the Hugging Face model. Per run it prints the wall and CPU seconds
of the imports and of the load, and the whole process. The last line reads exactly
``cold=<seconds> warm=<seconds> ratio=<cold/warm>`` (2 decimals): the wall seconds of
``load_model`` in the cold process and the median over the warm ones (imports not included: they
are the same with or without the cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, sys, time
clock = lambda: (time.perf_counter(), time.process_time())
out, t = {}, clock()
def phase(name):
    global t
    now = clock()
    out[name] = [now[0] - t[0], now[1] - t[1]]
    t = now
from headprobe.probe.backends.loading import load_model
phase("imports")
model = load_model(sys.argv[1], quiet=True)
phase("load_model")
out["backend"] = model.spec.backend
print(json.dumps(out))
"""


def run_child(model: str, cache: str) -> dict[str, list[float]]:
    """One fresh process: {phase: [wall s, CPU s]} plus ``process`` (its whole wall time)."""
    env = {**os.environ, "HEADPROBE_CACHE": cache}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"load_time: the child process failed:\n{proc.stderr[-2000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process": [wall, float("nan")]}


def describe(label: str, run: dict) -> str:
    wall, cpu = run["load_model"]
    return (
        f"{label}: load_model {wall:.2f} s (cpu {cpu:.2f}, {run['backend']} backend); imports "
        f"{run['imports'][0]:.2f} s; process {run['process'][0]:.2f} s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF model: smollm2-135m or a .gguf path")
    parser.add_argument("--warm-runs", type=int, default=1, help="warm processes to run (median reported)")
    args = parser.parse_args(argv)
    if args.warm_runs < 1:
        parser.error("--warm-runs must be at least 1")

    with tempfile.TemporaryDirectory(prefix="headprobe-load-time-") as cache:
        cold = run_child(args.model, cache)
        print(describe("cold", cold), flush=True)
        warms = []
        for i in range(args.warm_runs):
            warms.append(run_child(args.model, cache))
            print(describe(f"warm {i + 1}", warms[-1]), flush=True)
    cold_s = cold["load_model"][0]
    warm_s = statistics.median(w["load_model"][0] for w in warms)
    print(f"cold={cold_s:.2f} warm={warm_s:.2f} ratio={cold_s / warm_s:.2f}")


if __name__ == "__main__":
    main()
