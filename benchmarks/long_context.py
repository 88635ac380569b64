"""Time and peak RSS of ``headprobe scan --no-verify`` on long contexts.

Usage: ``OMP_NUM_THREADS=1 .venv/bin/python benchmarks/long_context.py [--lengths 1024,2048,4096,8192]
[--model smollm2-135m] [--streaming auto]``

For each length N one fresh process runs ``headprobe scan --model MODEL --seq-len N --n-natural 1
--n-repeated 1 --period P --no-verify --streaming S`` (``P = (N - 1) // 2 - 48``, at least 3, so that the repeated
sequence ``[BOS] r r`` is about as long as the natural one) into a temporary directory; this script
reads its peak RSS from ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss`` after the child
exits (the children are waited for one at a time, and the counter is the maximum over them, so a
length is measured in a child of its own: ``--one N``, which runs the scan in-process and
reports its own ``RUSAGE_SELF`` peak and the RSS right after loading the model). Prints one row
per length: wall seconds of the scan (load excluded), RSS after load, peak RSS, and peak minus
the RSS after load (what the scan adds over the loaded weights and libraries); the weights of
SmolLM2-135M are 0.54 GB. Times are for the machine as it was (shared CPUs: compare within one
run only).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time


def rss_mb() -> float:
    """Current resident set size of this process (MB, from /proc/self/status)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def one(n: int, model_name: str, streaming: str) -> dict:
    """Run the scan of length ``n`` in this process; its timings and memory."""
    import headprobe
    from headprobe.analyses.vocabulary import MIN_PERIOD

    model = headprobe.load_model(model_name)
    loaded = rss_mb()
    weights = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.model.parameters()}.values()) / 2**20
    period = max(MIN_PERIOD, (n - 1) // 2 - 48)  # the shortest block scan accepts
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as out:
        res = headprobe.scan(
            model,
            n_natural=1,
            seq_len=n,
            n_repeated=1,
            period=period,
            verify=False,
            streaming=streaming,
            progress=False,
        )
        res.save(out, overwrite=True, formats="none")
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "n": n,
        "period": period,
        "scan_s": round(wall, 1),
        "loaded_mb": round(loaded),
        "peak_mb": round(peak),
        "above_load_mb": round(peak - loaded),
        "weights_mb": round(weights),
    }


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="1024,2048,4096,8192")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--streaming", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.model, args.streaming)), flush=True)
        return
    print(
        f"{'tokens':>7} {'scan s':>8} {'RSS after load MB':>18} {'peak RSS MB':>12} {'peak - load MB':>15} "
        f"{'children maxrss MB':>19}"
    )
    for n in (int(x) for x in args.lengths.split(",")):
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(n), "--model", args.model, "--streaming", args.streaming],
            capture_output=True,
            text=True,
            env=os.environ,
        )
        if out.returncode != 0:
            print(f"{n:>7} failed: {out.stderr.strip().splitlines()[-1] if out.stderr.strip() else out.returncode}")
            continue
        row = json.loads(out.stdout.strip().splitlines()[-1])
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # max over the children so far
        print(
            f"{n:>7} {row['scan_s']:>8} {row['loaded_mb']:>18} {row['peak_mb']:>12} {row['above_load_mb']:>15} "
            f"{children:>19.0f}",
            flush=True,
        )
        print("  " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
