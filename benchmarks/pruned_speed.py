"""Speed of a physically pruned model: tokens/s before and after removing heads, next to the FLOPs removed.

Usage: ``.venv/bin/python benchmarks/pruned_speed.py [--model smollm2-135m] [--fractions 0.25,0.5]
[--batch 8] [--seq-len 512] [--repeats 5] [--device cpu] [--dtype float32]``

In one process: load the model (native backend), rank its heads by Michel et al. 2019's
gradient importance (:func:`headprobe.analyses.ablation.head_importance`, per-layer normalised,
on 8 x 128 tokens of CPython's documentation), and for each fraction remove that share of the
heads, least important first, with :func:`headprobe.probe.model.pruned.remove_heads` (the rows of
W_Q and the columns of W_O of a removed head are gone; a key/value head goes when its whole
group does). Each model then runs ``--repeats`` forward passes (logits, ``inference_mode``) on
the same ``batch x seq_len`` natural-text tokens after one warm-up pass; the median time gives
tokens/s.

FLOPs of one forward pass are counted, not measured: every ``nn.Linear`` of the model
(attention projections, MLP, unembedding; ``2 x tokens x weights``) plus each layer's attention
scores and weighted sum (:func:`headprobe.probe.layout.cost.score_flops` with that layer's kept query
heads; every score counted, as for a non-causal kernel). The removed share is
``1 - flops_pruned / flops_full``; the realised share is the time saved over the FLOP share
removed, ``(1 - t_pruned / t_full) / flop_share``: 1.0 means the time fell exactly as the FLOPs,
the issue's goal is >= 0.8.

``--model`` takes what every command's does (``headprobe.load_model``: a built-in name, a Hugging
Face name or directory, a ``.gguf`` file, a headprobe checkpoint directory). Bad input (an unknown
model, a fraction outside (0, 1), a non-positive count) is one line on stderr and exit status 2.

Prints one row per model and a last line ``realised_<fraction>=<x>`` for each fraction, plus
``tokens_per_s_full=``. Not a timed test: numbers depend on the machine and on what else runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch


def linear_flops(net: torch.nn.Module, tokens: int) -> int:
    """``2 x tokens x weights`` summed over every ``nn.Linear`` (a tied matrix counted where it is applied)."""
    return sum(2 * tokens * m.weight.numel() for m in net.modules() if isinstance(m, torch.nn.Linear))


def forward_flops(net, layout, batch: int, seq_len: int) -> int:
    """Counted FLOPs of one forward pass of the native ``net`` (see the module docstring)."""
    from headprobe.probe.layout.cost import score_flops

    flops = linear_flops(net, batch * seq_len)  # the unembedding is an nn.Linear too
    for block in net.blocks:
        n = block.attn.n_heads
        if n:
            flops += score_flops(dataclasses.replace(layout, n_heads=n, n_kv_heads=n, n_layers=1), seq_len, batch)
    return flops


def time_forwards(nets: list, tokens: torch.Tensor, repeats: int) -> list[float]:
    """Median seconds of one forward pass of each net: one warm-up pass each, then ``repeats``
    rounds that run every net once in turn (so a slow spell of the machine hits all of them)."""
    sync = torch.cuda.synchronize if tokens.is_cuda else (lambda: None)
    times: list[list[float]] = [[] for _ in nets]
    with torch.inference_mode():
        for net in nets:
            net(tokens)
        for _ in range(repeats):
            for i, net in enumerate(nets):
                sync()
                t0 = time.perf_counter()
                net(tokens)
                sync()
                times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def fractions_of(text: str) -> list[float]:
    """``--fractions``' shares, each in (0, 1) (argparse ``type``: else a one-line usage error)."""
    try:
        values = [float(f) for f in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated numbers, got {text!r}") from None
    if not all(0 < v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"each share must be between 0 and 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> None:
    import headprobe
    from headprobe.analyses.ablation import head_importance
    from headprobe.analyses.data import natural_text_tokens
    from headprobe.cli import OneLineErrorParser
    from headprobe.options import DTYPES, check_model, torch_dtype
    from headprobe.probe.model.pruned import remove_heads
    from headprobe.settings import positive_int

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = OneLineErrorParser(
        prog="pruned_speed.py", description=__doc__.splitlines()[0]
    )  # one-line usage errors, exit 2
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--fractions", type=fractions_of, default="0.25,0.5", help="shares of heads to remove, comma-separated"
    )
    ap.add_argument("--batch", type=positive_int, default=8)
    ap.add_argument("--seq-len", type=positive_int, default=512)
    ap.add_argument("--repeats", type=positive_int, default=5)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    args = ap.parse_args(argv)
    fractions = args.fractions

    check_model(args.model)  # an unknown name or a folder without weights, before torch loads anything
    model = headprobe.load_model(args.model, device=args.device, backend="native", quiet=True)
    spec = model.spec
    layout = spec.layout
    imp_tokens = natural_text_tokens(model, 8, 128, seed=0).tokens
    importance = head_importance(model, imp_tokens, normalize=True).importance  # [layer, head]
    order = importance.flatten().argsort()  # least important first (ties: lowest index)
    tokens = natural_text_tokens(model, args.batch, args.seq_len, seed=1).tokens.to(model.device)
    dtype = torch_dtype(args.dtype)
    full = model.model.to(dtype)
    print(
        f"{args.model}: {spec.n_layers} layers x {spec.n_heads} heads ({spec.n_kv_heads} KV), "
        f"tokens {args.batch} x {args.seq_len}, {args.device} {args.dtype}, torch threads {torch.get_num_threads()}"
    )

    n_total = spec.n_layers * spec.n_heads
    pruned = []
    for frac in fractions:
        keep = torch.ones(n_total, dtype=torch.bool)
        keep[order[: round(frac * n_total)]] = False
        pruned.append(remove_heads(full, keep.view(spec.n_layers, spec.n_heads)))
    t_full, *t_pruned = time_forwards([full, *pruned], tokens, args.repeats)
    f_full = forward_flops(full, layout, args.batch, args.seq_len)
    n_tok = args.batch * args.seq_len
    print(
        f"{'model':<26}{'heads':>6}{'kv heads':>9}{'GFLOP':>8}{'FLOPs removed':>15}{'s/pass':>8}{'tokens/s':>10}{'time saved':>12}{'realised':>10}"
    )
    print(
        f"{'full':<26}{n_total:>6}{spec.n_layers * spec.n_kv_heads:>9}{f_full / 1e9:>8.1f}"
        f"{'':>15}{t_full:>8.3f}{n_tok / t_full:>10.0f}{'':>12}{'':>10}"
    )
    summary = {"tokens_per_s_full": f"{n_tok / t_full:.0f}"}
    for frac, net, t in zip(fractions, pruned, t_pruned):
        f = forward_flops(net, layout, args.batch, args.seq_len)
        share = 1 - f / f_full
        saved = 1 - t / t_full
        realised = saved / share if share > 0 else float("nan")
        heads = sum(b.attn.n_heads for b in net.blocks)
        kv = sum(len(b.attn.kept_kv_heads) for b in net.blocks)
        print(
            f"{f'removed {frac:.0%} (importance)':<26}{heads:>6}{kv:>9}{f / 1e9:>8.1f}"
            f"{share:>15.1%}{t:>8.3f}{n_tok / t:>10.0f}{saved:>12.1%}{realised:>10.2f}"
        )
        summary[f"flop_share_{frac:g}"] = f"{share:.3f}"
        summary[f"realised_{frac:g}"] = f"{realised:.2f}"
    print(" ".join(f"{k}={v}" for k, v in summary.items()))


if __name__ == "__main__":
    from headprobe.probe.core.errors import HeadprobeError

    try:
        main()
    except HeadprobeError as e:  # bad input: one line and exit 2, as every headprobe command
        print(f"pruned_speed.py: error: {e}", file=sys.stderr)
        sys.exit(2)
