"""Load time of a GGUF model (default smollm2-135m) without and with the weights cache.

Usage: ``.venv/bin/python benchmarks/load_time.py [--model smollm2-135m] [--warm-runs 1]``

Runs ``headprobe.probe.loading.load_model(model, quiet=True)`` (what every command does: find,
load, convert to the native backend, self-check) in fresh Python processes, all pointed at one
new, empty cache directory (``HEADPROBE_CACHE`` in a temporary directory, removed at the end):

* cold: the first process finds the cache empty, dequantizes the GGUF file and writes the entry;
* warm: the next ones read the entry.

For each it prints the seconds spent in the ``load_model`` call and in the whole process
(interpreter start and imports included). The last line reads exactly
``cold=<seconds> warm=<seconds> ratio=<cold/warm>`` (2 decimals): the ``load_model`` seconds of
the cold process and the median of the warm ones.
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
t0 = time.perf_counter()
from headprobe.probe.loading import load_model
t1 = time.perf_counter()
load_model(sys.argv[1], quiet=True)
t2 = time.perf_counter()
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1}))
"""


def run_child(model: str, cache: str) -> dict[str, float]:
    """One fresh process: its ``load_model`` seconds, import seconds and total wall seconds."""
    env = {**os.environ, "HEADPROBE_CACHE": cache}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", CHILD, model], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"load_time: the child process failed:\n{proc.stderr[-2000:]}")
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_s": wall}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF model: smollm2-135m or a .gguf path")
    parser.add_argument("--warm-runs", type=int, default=1, help="warm processes to run (median reported)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="headprobe-load-time-") as cache:
        cold = run_child(args.model, cache)
        print(f"cold: load_model {cold['load_s']:.2f} s; process {cold['process_s']:.2f} s "
              f"(imports {cold['import_s']:.2f} s)", flush=True)
        warms = []
        for i in range(args.warm_runs):
            warm = run_child(args.model, cache)
            warms.append(warm)
            print(f"warm {i + 1}: load_model {warm['load_s']:.2f} s; process {warm['process_s']:.2f} s "
                  f"(imports {warm['import_s']:.2f} s)", flush=True)
    warm_s = statistics.median(w["load_s"] for w in warms)
    print(f"cold={cold['load_s']:.2f} warm={warm_s:.2f} ratio={cold['load_s'] / warm_s:.2f}")


if __name__ == "__main__":
    main()
