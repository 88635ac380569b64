"""Precision at scale: the exact sweep of every head in bfloat16 (and TF32 where CUDA offers it)
against float32, on the same model and tokens.

Usage: ``PYTHONPATH=. python benchmarks/precision.py [--model smollm2-135m] [--n-seqs 8] [--seq-len 128]``

Prints, for each lower precision: the largest difference of a head's ablation effect from
float32's (nats/token), the Spearman rank correlation of the two sweeps' effects over all heads,
and how many heads' verdict changes under the effect floor of the CONFIRMED rule
(:class:`headprobe.analyses.verdicts.VerdictRule`'s ``min_effect``: effect at least that much, or
not, in one precision and not the other); then, on a second line, whether the lower precision moves
effects one way: the mean and median signed difference (lower minus float32, nats/token), how many
heads it raises, and how many of the crossings go up (below the floor in float32, at or above it in
the lower precision) and how many down. TF32: CUDA only (n/a on a CPU). With ``--out FILE`` it also
writes every head's effect in each precision (CSV: ``layer, head, float32, bfloat16[, tf32]``), the
file the printed numbers can be recomputed from. Not a timed test.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import time

import pandas as pd
import torch


def main(argv: list[str] | None = None) -> None:
    from headprobe.analyses.ablation import exact_sweep, spearman
    from headprobe.analyses.data import natural_text_tokens
    from headprobe.analyses.verdicts import VerdictRule
    from headprobe.probe.backends.hf_checkpoint import load_checkpoint
    from headprobe.probe.backends.loading import device_auto
    from headprobe.probe.backends.wrapping import wrap

    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n-seqs", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=None, help="CSV of every head's effect in each precision (nats/token)")
    args = ap.parse_args(argv)
    device = device_auto(args.device)
    ckpt = load_checkpoint(args.model)
    f32 = wrap(dataclasses.replace(ckpt, hf_model=copy.deepcopy(ckpt.hf_model)), "native", device)
    tokens = natural_text_tokens(f32, args.n_seqs, args.seq_len, 0).tokens
    floor = VerdictRule().min_effect
    t0 = time.perf_counter()
    ref = exact_sweep(f32, tokens).effect
    print(
        f"float32 sweep of {ref.numel()} heads on {tuple(tokens.shape)} tokens: {time.perf_counter() - t0:.1f} s "
        f"(effect floor {floor} nats/token)"
    )
    runs = {"bfloat16": lambda: exact_sweep(f32.to(torch.bfloat16), tokens).effect}
    if device.startswith("cuda"):

        def tf32():
            torch.backends.cuda.matmul.allow_tf32 = True
            try:
                return exact_sweep(wrap(ckpt, "native", device), tokens).effect
            finally:
                torch.backends.cuda.matmul.allow_tf32 = False

        runs["tf32"] = tf32
    else:
        print("tf32: n/a (CUDA only)")
    effects = {"float32": ref}
    for name, fn in runs.items():
        t0 = time.perf_counter()
        eff = effects[name] = fn()
        ok = ~(ref.isnan() | eff.isnan())
        diff = float((eff[ok] - ref[ok]).abs().max())
        rho = spearman(eff[ok], ref[ok])
        flips = int(((eff[ok] >= floor) != (ref[ok] >= floor)).sum())
        print(
            f"{name}: {time.perf_counter() - t0:.1f} s; largest |effect difference| {diff:.4f} nats/token; Spearman "
            f"{rho:.4f}; heads whose effect crosses the {floor} floor: {flips} of {int(ok.sum())}"
        )
        print(_offset_line(name, eff[ok] - ref[ok], ref[ok], eff[ok], floor))

    if args.out:
        layer, head = (i.flatten() for i in torch.meshgrid(*(torch.arange(n) for n in ref.shape), indexing="ij"))
        cols = {"layer": layer, "head": head, **{k: v.float().cpu().flatten() for k, v in effects.items()}}
        pd.DataFrame({k: v.numpy() for k, v in cols.items()}).to_csv(args.out, index=False)


def _offset_line(name: str, diff: torch.Tensor, ref: torch.Tensor, eff: torch.Tensor, floor: float) -> str:
    """The signed offset of ``eff`` from ``ref`` (both ``[n]`` effects over the same heads, nats/token):
    mean and median of ``diff = eff - ref``, heads with ``diff > 0``, and the floor's crossings by
    direction (up: ``ref < floor <= eff``; down: ``eff < floor <= ref``)."""
    d = diff.double()
    up = int(((ref < floor) & (eff >= floor)).sum())
    down = int(((eff < floor) & (ref >= floor)).sum())
    return (
        f"{name} - float32: mean {float(d.mean()):+.4f}, median {float(d.quantile(0.5)):+.4f} nats/token; "
        f"higher for {int((d > 0).sum())} of {d.numel()} heads; crossings up {up}, down {down}"
    )


if __name__ == "__main__":
    main()
