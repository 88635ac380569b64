"""``headprobe ablate``: every head's exact single-head ablation effect on natural text and on the
in-context (induction) task, with Michel et al.'s gradient importance and attribution patching
beside it, written as a CSV, a summary and heatmaps.

Tasks (losses in nats/token):

* ``natural``: every next-token prediction on held-out windows of natural text;
* ``induction``: the repeated half of ``[BOS] r_1..r_S r_1..r_S`` random tokens (predictions of
  r_2..r_S of the repeat), which only in-context copying can get right (Olsson et al. 2022).

The exact sweep is :func:`headprobe.analyses.ablation.exact_sweep` (fast on the native model); the
gradient scores come from one forward and one backward pass per task
(:func:`headprobe.analyses.ablation.head_importance`).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from headprobe.analyses import figures
from headprobe.options import positive_int
from headprobe.analyses.ablation import (
    SweepResult, all_heads, capture_z, exact_sweep, first_scored, head_importance, mean_z_from, spearman, top_heads,
)
from headprobe.analyses.data import natural_text_tokens, read_text_file, repeated_random_tokens
from headprobe.probe.capture import kv_head_of
from headprobe.probe.errors import HeadprobeError
from headprobe.probe.hooks import ABLATION_KINDS, format_head, parse_heads
from headprobe.probe.io import RunCheckpoint, package_versions, prepare_output_dir, write_json, write_text

HELP = "exact single-head ablation effect of every head (natural text, induction task), gradient importance, CSV + heatmaps"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TASKS = ("natural", "induction")


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """Arguments shared by ``ablate`` and ``prune``."""
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default), gpt2, a local HF directory or .gguf file")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace files in a non-empty output directory")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="compute precision (default %(default)s)")
    p.add_argument("--backend", default="auto", choices=["auto", "native", "transformer-lens"],
                   help="native (auto where supported) is fast; transformer-lens falls back to the per-head hook loop")
    p.add_argument("--text", default=None, help="UTF-8 text file for natural text (default: CPython's pydoc_data.topics)")
    p.add_argument("--seq-len", type=positive_int, default=128, help="natural-text sequence length in tokens (default %(default)s)")
    p.add_argument("--n-repeated", type=positive_int, default=8, help="repeated random sequences (default %(default)s)")
    p.add_argument("--period", type=positive_int, default=50, help="length of the repeated random block (default %(default)s)")
    p.add_argument("--seed", type=int, default=0)


def load_for_cli(args: argparse.Namespace, progress: bool = True):
    """Load ``args.model`` on ``args.device`` in ``args.dtype`` with ``args.backend``.

    Raises:
        HeadprobeError: CUDA asked for but absent, or the model cannot be loaded.
    """
    from headprobe.probe.loading import device_auto, load_model

    if args.device == "cuda" and not torch.cuda.is_available():
        raise HeadprobeError("--device cuda was asked for but no CUDA GPU is available")
    device = device_auto(args.device)
    if progress:
        print(f"loading {args.model} on {device} ({args.dtype}) ...", flush=True)
    model = load_model(args.model, device=device, backend=args.backend)
    model.self_check.require_decomposition("head ablation (ablate, prune)")
    model.model.to(DTYPES[args.dtype])
    spec = model.spec
    if 2 * args.period + 1 > spec.n_ctx:
        raise HeadprobeError(f"--period {args.period} gives sequences longer than the model's context ({spec.n_ctx})")
    if progress:
        print(f"model {spec.name}: {spec.n_layers} layers x {spec.n_heads} heads ({spec.layout}, {spec.n_kv_heads} KV heads); "
              f"weights: {spec.precision}", flush=True)
    return model


def task_tokens(model, args: argparse.Namespace, n_natural: int):
    """(natural windows ``[2 n_natural, pos]`` split into two disjoint halves, repeated set,
    a second repeated set for resampling)."""
    text = read_text_file(args.text) if args.text else None
    if args.seq_len > model.spec.n_ctx or 2 * args.period + 1 > model.spec.n_ctx:
        raise HeadprobeError(f"--seq-len {args.seq_len} / --period {args.period} give sequences longer than the "
                             f"model's context ({model.spec.n_ctx} tokens)")
    natural = natural_text_tokens(model, 2 * n_natural, args.seq_len, args.seed, text,
                                  source=str(args.text) if args.text else None)
    if natural.tokens.shape[0] < 2 * n_natural:
        raise HeadprobeError(f"the text holds {natural.tokens.shape[0]} windows of {args.seq_len} tokens; "
                             f"{2 * n_natural} are needed: give more text or a shorter --seq-len")
    repeated = repeated_random_tokens(model, args.n_repeated, args.period, args.seed)
    repeated_src = repeated_random_tokens(model, args.n_repeated, args.period, args.seed + 1)
    return natural, repeated, repeated_src


def open_checkpoint(args: argparse.Namespace) -> tuple[RunCheckpoint, dict]:
    """Check ``--out`` (a directory holding this run's own checkpoint may be reused without
    ``--overwrite``) and load the checkpoint of an interrupted run with the same settings.

    Raises:
        HeadprobeError: ``--out`` is unusable, or holds a checkpoint of other settings.
    """
    prepare_output_dir(args.out, args.overwrite, create=False, resumable=True)
    checkpoint = RunCheckpoint(args.out, run_key(args))
    return checkpoint, checkpoint.load(args.overwrite)


def run_key(args: argparse.Namespace) -> dict:
    """The settings a checkpoint must share with the run that resumes it (all but where output goes)."""
    return {k: v for k, v in sorted(vars(args).items()) if not k.startswith("_") and k not in ("out", "overwrite")}


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--n-natural", type=positive_int, default=8, help="natural-text sequences (default %(default)s)")
    p.add_argument("--kind", default="zero", choices=ABLATION_KINDS,
                   help="zero, mean (mean z over other natural-text windows) or resample (z on other inputs)")
    p.add_argument("--heads", default=None,
                   help="sweep only these heads, as layer.head, comma-separated (e.g. 5.1,17.3); default: all")
    p.add_argument("--max-batch", type=positive_int, default=64, help="sequences per forward pass in the sweep (default %(default)s)")


@dataclass(frozen=True)
class TaskResult:
    clean_loss: float
    effect: np.ndarray  # [layer, head], nats/token
    importance: np.ndarray
    attribution: np.ndarray
    sweep_s: float
    gradient_s: float


CHUNK_LAYERS = 5
"""Layers swept between two checkpoints (each chunk costs one extra clean forward pass)."""


def checkpointed_sweep(model, tokens, heads, kind, mean_z, source_tokens, first, max_batch, done: dict, save,
                       desc: str = "ablation sweep") -> SweepResult:
    """:func:`~headprobe.analyses.ablation.exact_sweep` in chunks of :data:`CHUNK_LAYERS` layers, recording
    each chunk's losses in ``done`` (``{"clean": float, "loss": {"layer.head": float}}``) and
    calling ``save()`` after it; chunks already in ``done`` are skipped. Every chunk is
    deterministic, so a resumed sweep equals an uninterrupted one."""
    from tqdm.auto import tqdm

    spec = model.spec
    layers = sorted({layer for layer, _ in heads})
    chunks = [[h for h in heads if h[0] in layers[i:i + CHUNK_LAYERS]] for i in range(0, len(layers), CHUNK_LAYERS)]
    for chunk in tqdm(chunks, desc=desc, unit="chunk"):
        if all(format_head(h) in done["loss"] for h in chunk):
            continue
        part = exact_sweep(model, tokens, heads=chunk, kind=kind, mean_z=mean_z, source_tokens=source_tokens,
                           first=first, max_batch=max_batch)
        done["clean"] = part.clean_loss
        done["loss"].update({format_head(h): float(part.loss[h]) for h in chunk})
        save()
    loss = torch.full((spec.n_layers, spec.n_heads), float("nan"))
    for name, value in done["loss"].items():
        layer, head = map(int, name.split("."))
        loss[layer, head] = value
    return SweepResult(done["clean"], loss, kind)


def _rank_correlation(a, b) -> float | None:
    """:func:`spearman` over the heads finite in both; None (JSON null) when fewer than 3 heads
    were swept, too few to rank."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    return spearman(a, b) if (np.isfinite(a) & np.isfinite(b)).sum() >= 3 else None


def run(args: argparse.Namespace) -> int:
    if args.period < 2:
        raise HeadprobeError("--period must be at least 2")
    checkpoint, saved = open_checkpoint(args)
    if saved:
        print(f"resuming from {checkpoint.path} ({sum(len(t['loss']) for t in saved.values())} head ablations done)")
    t_start = time.perf_counter()
    model = load_for_cli(args)
    spec = model.spec
    heads = parse_heads(args.heads, spec.n_layers, spec.n_heads) if args.heads else all_heads(spec.n_layers, spec.n_heads)
    natural, repeated, repeated_src = task_tokens(model, args, args.n_natural)
    nat, nat_ref = natural.tokens[: args.n_natural], natural.tokens[args.n_natural:]
    ref_z = capture_z(model, nat_ref)
    mean_z = mean_z_from(ref_z, natural.start) if args.kind == "mean" else None
    sets = {
        "natural": (nat, first_scored("natural", natural.start, None), nat_ref),
        "induction": (repeated.tokens, first_scored("repeated", repeated.start, repeated.period), repeated_src.tokens),
    }
    results: dict[str, TaskResult] = {}
    for task, (tokens, first, source) in sets.items():
        src = source if args.kind == "resample" else None
        t0 = time.perf_counter()
        sweep = checkpointed_sweep(model, tokens, heads, args.kind, mean_z, src, first, args.max_batch,
                                   saved.setdefault(task, {"clean": None, "loss": {}}), lambda: checkpoint.save(saved),
                                   desc=f"ablation sweep ({task})")
        t1 = time.perf_counter()
        grad = head_importance(model, tokens, first, kind=args.kind, mean_z=mean_z, source_tokens=src)
        t2 = time.perf_counter()
        results[task] = TaskResult(sweep.clean_loss, sweep.effect.numpy(), grad.importance.numpy(),
                                   grad.attribution.numpy(), t1 - t0, t2 - t1)

    # prefix-matching (induction) score of every head, to check the induction ranking against
    from headprobe.commands.scan import score_token_set

    induction_score = score_token_set(model, repeated, "repeated")[0]["induction"].numpy()

    layer, head = np.meshgrid(np.arange(spec.n_layers), np.arange(spec.n_heads), indexing="ij")
    cols = {"layer": layer.ravel(), "head": head.ravel(), "kv_head": kv_head_of(head.ravel(), spec.n_heads, spec.n_kv_heads)}
    for task, r in results.items():
        cols[f"{task}_loss_delta"] = r.effect.ravel()
    for task, r in results.items():
        cols[f"{task}_importance"] = r.importance.ravel()
        cols[f"{task}_attribution"] = r.attribution.ravel()
    cols["induction_score"] = induction_score.ravel()
    table = pd.DataFrame(cols)

    top_n = 10
    summary = {
        "model": spec.name, "weights_precision": spec.precision, "dtype": args.dtype, "device": str(model.device),
        "self_check": model.self_check.to_dict(), "ablation": args.kind, "units": "nats/token",
        "tokens": {"natural": list(nat.shape), "induction": list(repeated.tokens.shape), "period": args.period,
                   "natural_source": natural.source},
        "clean_loss": {t: r.clean_loss for t, r in results.items()},
        "top_heads_by_loss_delta": {t: [{"head": format_head(h), "loss_delta": round(float(r.effect[h]), 5)}
                                        for h in top_heads(torch.as_tensor(r.effect), top_n)] for t, r in results.items()},
        # importance is unsigned (E|dL/dxi|): compared with the effect's size, and with the signed effect
        "spearman_with_exact_sweep": {t: {
            "gradient_importance_vs_abs_effect": _rank_correlation(r.importance, np.abs(r.effect)),
            "gradient_importance": _rank_correlation(r.importance, r.effect),
            "attribution_patching": _rank_correlation(r.attribution, r.effect)} for t, r in results.items()},
        "top_induction_score_heads": [format_head(h) for h in top_heads(torch.as_tensor(induction_score), top_n)],
        "spearman_induction_score_vs_induction_loss_delta": _rank_correlation(induction_score, results["induction"].effect),
        "timings_s": {**{f"{t}_sweep": round(r.sweep_s, 2) for t, r in results.items()},
                      **{f"{t}_gradient": round(r.gradient_s, 2) for t, r in results.items()},
                      "total": round(time.perf_counter() - t_start, 1)},
        "config": {k: v for k, v in vars(args).items() if not k.startswith("_")},
        "versions": package_versions(),
    }
    out = prepare_output_dir(args.out, True)  # ours: only the checkpoint can be there unless --overwrite
    write_text(out / "head_ablation.csv", table.to_csv(index=False, float_format="%.6f"))
    tag = f"{spec.name} ({figures.weights_label(spec.precision)}), {args.kind}-ablated"
    fig = figures.ablation_effect_panels(
        [("natural text", results["natural"].effect), ("induction (repeated half)", results["induction"].effect)],
        spec.group_size, f"Loss increase from ablating one head\n{tag}")
    paths = figures.save_figure(fig, out / "ablation_effect")
    write_json(out / "summary.json", summary)  # last: a directory with summary.json is complete
    checkpoint.clear()
    print(f"\nclean loss: natural {results['natural'].clean_loss:.3f}, induction {results['induction'].clean_loss:.3f} nats/token")
    for t in TASKS:
        tops = ", ".join(f"{e['head']} ({e['loss_delta']:+.3f})" for e in summary["top_heads_by_loss_delta"][t][:5])
        rho = summary["spearman_with_exact_sweep"][t]
        r = {k: "n/a" if v is None else f"{v:.2f}" for k, v in rho.items()}
        print(f"{t:<10} top heads by Δ loss: {tops}; Spearman with exact sweep: importance vs |Δ| "
              f"{r['gradient_importance_vs_abs_effect']} (signed {r['gradient_importance']}), "
              f"attribution {r['attribution_patching']}")
    print(f"top induction-score heads: {', '.join(summary['top_induction_score_heads'][:5])}")
    print("timings: " + ", ".join(f"{k.replace('_', ' ')} {v:.1f} s" for k, v in summary["timings_s"].items()))
    print(f"wrote head_ablation.csv, summary.json, {', '.join(p.name for p in paths)} to {out}/")
    return 0
