"""torch's CPU threads on a shared machine: the per-set ablation time at 2 threads against the
default rule (:func:`headprobe.options.choose_threads`), with a busy process on one core.

Usage: ``python benchmarks/threads.py [--model smollm2-135m] [--sets 6] [--seq-len 64] [--n-seqs 8]``

In one process: load the model, then for each case time the layer-matched control ablations scan
makes (``set_ablation_losses``, zero ablation of ``k = 10`` random heads per set, on ``n_seqs x
seq_len`` random tokens), seconds per set, median of the sets after one warm-up set:

1. idle, 2 threads; 2. one core busy (a child process spinning on core 0), 2 threads;
3. one core busy, the default rule (it samples the idle cores first, so it sees the busy one).

Not a timed test: the numbers depend on the machine and on what else runs on it. Run it alone.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time


def _spin(core: int) -> None:
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {core})
    while True:
        pass


def per_set_seconds(model, tokens, sets) -> float:
    from headprobe.analyses.ablation import set_ablation_losses

    times = []
    for s in sets:
        t0 = time.perf_counter()
        set_ablation_losses(model, tokens, [s], "zero", None, first=1)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--sets", type=int, default=6)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--n-seqs", type=int, default=8)
    args = p.parse_args()
    os.environ.pop("OMP_NUM_THREADS", None)  # the default rule must sample, not read the variable
    import torch

    from headprobe.options import choose_threads, load_model

    model = load_model(args.model, device="cpu")
    spec = model.spec
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(10, 1000, (args.n_seqs, args.seq_len), generator=g)
    heads = [(l, h) for l in range(spec.n_layers) for h in range(spec.n_heads)]
    sets = [[heads[i] for i in torch.randperm(len(heads), generator=g)[:10].tolist()] for _ in range(args.sets + 1)]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{args.model}: {args.n_seqs} x {args.seq_len} tokens, {args.sets} sets of 10 heads (zero), {cores} cores")

    torch.set_num_threads(2)
    idle = per_set_seconds(model, tokens, sets)
    print(f"idle, 2 threads:                      {idle:.3f} s/set")
    busy = mp.get_context("fork").Process(target=_spin, args=(0,), daemon=True)
    busy.start()
    try:
        time.sleep(1.0)
        torch.set_num_threads(2)
        two = per_set_seconds(model, tokens, sets)
        print(f"one core busy, 2 threads:             {two:.3f} s/set")
        n, why = choose_threads()
        torch.set_num_threads(n)
        rule = per_set_seconds(model, tokens, sets)
        print(f"one core busy, default rule ({n}: {why}): {rule:.3f} s/set")
    finally:
        busy.terminate()
    print(f"ratio busy 2 threads / default rule = {two / rule:.2f}")


if __name__ == "__main__":
    main()
