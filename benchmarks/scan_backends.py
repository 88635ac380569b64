"""Benchmark: `headprobe scan` on the native backend vs the TransformerLens bridge.

Loads the checkpoint once, wraps it both ways, runs the same scan (default settings unless
given) on each, and prints both times, their ratio, the largest score difference and whether
the top heads of every type agree. Not a test: numbers depend on the machine.

    python benchmarks/scan_backends.py [--model smollm2-135m] [--n-random 5]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import numpy as np
import torch

from headprobe.analyses.ablation import top_heads
from headprobe.analyses.detectors import DETECTORS, SCORE_COLUMNS
from headprobe.commands.scan import ScanConfig, run_scan
from headprobe.probe.backends.hf_checkpoint import load_checkpoint
from headprobe.probe.backends.wrapping import wrap


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--n-random", type=int, default=ScanConfig.n_random)
    p.add_argument("--top", type=int, default=5, help="compare the top-N heads of each type")
    args = p.parse_args()
    torch.manual_seed(0)
    ckpt = load_checkpoint(args.model)
    cfg = ScanConfig(model=args.model, n_random=args.n_random)
    results, times = {}, {}
    for backend in ("transformer-lens", "native"):
        model = wrap(dataclasses.replace(ckpt, hf_model=copy.deepcopy(ckpt.hf_model)), backend=backend)
        t0 = time.perf_counter()
        results[backend] = run_scan(cfg, model=model, progress=False)
        times[backend] = time.perf_counter() - t0
        del model
    tl, nat = results["transformer-lens"], results["native"]
    diff = max(float(np.abs(tl.scores[c] - nat.scores[c]).max()) for c in SCORE_COLUMNS if c != "positional_offset")
    same = all(
        top_heads(torch.as_tensor(tl.scores[d.rank_by]), args.top)
        == top_heads(torch.as_tensor(nat.scores[d.rank_by]), args.top)
        for d in DETECTORS.values()
    )
    loss_diff = max(abs(a.top_loss - b.top_loss) for a, b in zip(tl.verifications, nat.verifications))
    print(f"{'backend':<18}{'scan (s)':>10}")
    for b, t in times.items():
        print(f"{b:<18}{t:>10.1f}")
    print(
        f"same top-{args.top} heads for every type: {same}; max score diff {diff:.2e}; max ablated-loss diff {loss_diff:.2e}"
    )
    print(f"ratio={times['transformer-lens'] / times['native']:.2f} same_top_heads={same} max_score_diff={diff:.2e}")


if __name__ == "__main__":
    main()
