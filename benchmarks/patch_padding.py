"""Padded patching on SmolLM2-135M: forward passes and seconds of ``patch`` with all IOI pairs in
one padded batch against one batch per token length (the engine before padding), and the IOI
effects of a few heads at each site (z, q, k, v) and of the residual stream at the last position.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/patch_padding.py [--heads 16.0,17.4,20.0,23.3]

Timings compare within one run only (a shared machine's load moves them between runs)."""

from __future__ import annotations

import argparse
import time

import numpy as np

import headprobe
from headprobe.analyses.patching import encode_pairs, ioi_prompts, patch
from headprobe.probe.core.heads import parse_heads


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--heads", default="16.0,17.4,20.0,23.3,29.0,29.1")
    ap.add_argument("--timing-layers", default="16,17,18,23", help="layers whose every head is timed")
    ap.add_argument("--n-prompts", type=int, default=24)
    args = ap.parse_args()
    model = headprobe.load_model("smollm2-135m", quiet=True)
    spec = model.spec
    four = ioi_prompts(model.tokenizer, 4, seed=0)
    lengths = sorted({len(model.to_tokens(p.clean)[0]) for p in four})
    timed = [(layer, h) for layer in map(int, args.timing_layers.split(",")) for h in range(spec.n_heads)]
    t0 = time.perf_counter()
    padded = patch(model, four, "z", timed)
    t_padded = time.perf_counter() - t0
    t0, n_groups = time.perf_counter(), 0
    per_length = np.zeros_like(padded.patched_ld)
    for b in encode_pairs(model, four, pad=False):
        r = patch(model, [four[i] for i in b.index], "z", timed)
        per_length[:, b.index] = r.patched_ld
        n_groups += r.n_forward
    t_groups = time.perf_counter() - t0
    print(
        f"4 IOI pairs, token lengths {lengths}, {len(timed)} heads (site z): padded {padded.n_forward} forward passes "
        f"{t_padded:.1f} s; one batch per length {n_groups} passes {t_groups:.1f} s; "
        f"max |difference| {np.abs(padded.patched_ld - per_length).max():.2e}"
    )
    pairs = ioi_prompts(model.tokenizer, args.n_prompts, seed=0)
    heads = parse_heads(args.heads, spec.n_layers, spec.n_heads)
    for site in ("z", "q", "k", "v"):
        r = patch(model, pairs, site, heads)
        t = r.table()
        cells = ", ".join(
            f"{layer}.{h} {e:+.2f} [{lo:+.2f}, {hi:+.2f}]"
            for layer, h, e, lo, hi in zip(t["layer"], t["head"], t["effect"], t["effect_ci95_lo"], t["effect_ci95_hi"])
        )
        print(f"site {site}: clean LD {r.clean_ld.mean():+.2f}, corrupted {r.corrupted_ld.mean():+.2f}; {cells}")
    r = patch(model, pairs, "resid", [(layer, -1) for layer in range(spec.n_layers)])
    norm = r.effect.mean(1) / r.total
    print("resid at the last position, normalised effect by layer: " + " ".join(f"{x:.2f}" for x in norm))


if __name__ == "__main__":
    main()
