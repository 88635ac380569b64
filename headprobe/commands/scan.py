"""``headprobe scan``: score every head for the classic head types, verify the detections by
ablation against a random-head control, and write a table, a summary and figures.

Pipeline (one model load, a handful of forward passes):

1. natural text -> one forward pass that streams each layer's patterns into the
   previous-token, first-token and positional scores, records each head's mean z (for mean
   ablation) and gives the clean natural-text loss;
2. repeated random tokens -> one forward pass for the duplicate-token and induction scores and
   the clean loss on the repeated half;
3. for each head type, zero- and mean-ablate its top-k heads, and k random heads (several seeded
   draws, shared by the types judged on the same task), and compare the loss increases;
4. head_scores.csv, summary.json, heatmaps, example patterns and the ablation figure.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from headprobe.analyses import figures
from headprobe.options import positive_int
from headprobe.analyses.ablation import (
    Verification, ablated_loss, is_confirmed, names, random_head_sets, task_loss, top_heads,
)
from headprobe.analyses.data import TokenSet, natural_text_tokens, read_text_file, repeated_random_tokens
from headprobe.analyses.detectors import DETECTORS, SCORE_COLUMNS
from headprobe.probe.capture import kv_head_of, stream_patterns
from headprobe.probe.errors import HeadprobeError
from headprobe.probe.hooks import attn_hook, format_head
from headprobe.probe.io import package_versions, prepare_output_dir, write_json, write_text

HELP = "find the classic head types in a pretrained model, verify them by ablation, write table and figures"

ABLATION_KINDS = ("zero", "mean")
DEFAULT_SEQ_LEN = 128  # natural-text tokens per sequence, unless the model's context is shorter
DEFAULT_PERIOD = 50  # repeated block, unless two of them do not fit the context
DEFAULT_K = 10  # heads ablated per type, unless that is more than a quarter of the model's heads


@dataclass(frozen=True)
class ScanConfig:
    """Settings of a scan (all recorded in summary.json).

    Attributes:
        model: model name or path (see :func:`headprobe.probe.loading.load_model`).
        n_natural: natural-text sequences. seq_len: their length in tokens (BOS included); None:
            128, or the model's context if that is shorter.
        n_repeated: repeated-random-token sequences. period: length S of the repeated block; None:
            50, or the longest that fits the model's context twice (``(n_ctx - 1) // 2``).
        k: heads ablated per type, and per random draw; None: 10, or a quarter of the model's
            heads if that is fewer. Must be below the number of heads. n_random: random draws of k heads.
        seed: seeds window choice, random tokens and random head draws.
        text: a UTF-8 file to use instead of the Python documentation text.
        device: ``auto``, ``cpu`` or ``cuda``.
        prepend_bos: put the tokenizer's BOS token first (once) where the model has one.
        backend: ``auto`` (headprobe's own transformer where it supports the architecture),
            ``native`` or ``transformer-lens`` (TransformerLens' TransformerBridge).
        verify: ablate the top-k heads of each type against random heads (needs the model's
            per-head decomposition to pass its self-check); False scores patterns only.
    """

    model: str = "smollm2-135m"
    n_natural: int = 8
    seq_len: int | None = None
    n_repeated: int = 8
    period: int | None = None
    k: int | None = None
    n_random: int = 5
    seed: int = 0
    text: str | None = None
    device: str = "auto"
    prepend_bos: bool = True
    backend: str = "auto"
    verify: bool = True


@dataclass
class ScanResult:
    config: ScanConfig
    spec: object
    table: pd.DataFrame
    scores: dict[str, np.ndarray]  # column -> [layer, head]
    verifications: list[Verification]
    clean_loss: dict[str, float]
    natural: TokenSet
    repeated: TokenSet
    examples: dict[str, dict]  # head type -> {"head", "pattern", "labels"}
    timings: dict[str, float]
    device: str = "cpu"
    dtype: str = "float32"
    self_check: dict | None = None


def score_token_set(model, tokens: TokenSet, dataset: str, mean_z: bool = False):
    """Stream one forward pass over ``tokens``, scoring every head with the detectors of ``dataset``.

    Returns:
        (scores, logits, mean_z): ``scores[column]`` is ``[layer, head]``; ``mean_z`` is
        ``[layer, head, d_head]`` (each head's mean z over real positions) or None.
    """
    spec = model.spec
    dets = [d for d in DETECTORS.values() if d.dataset == dataset]
    scores = {c: torch.zeros(spec.n_layers, spec.n_heads) for d in dets for c in d.columns}
    z_mean = torch.zeros(spec.n_layers, spec.n_heads, spec.d_head) if mean_z else None

    def on_pattern(layer: int, pattern: torch.Tensor) -> None:
        for det in dets:
            for col, v in det.score(pattern, tokens.period, tokens.start).items():
                scores[col][layer] = v.cpu()

    first_bad: list[int] = []

    def make_finite_check(layer: int):
        def hook(resid, hook):
            if not first_bad and not torch.isfinite(resid).all():
                first_bad.append(layer)
        return hook

    extra = [(f"blocks.{layer}.hook_resid_post", make_finite_check(layer)) for layer in range(spec.n_layers)]
    if mean_z:
        def make(layer: int):
            def hook(z, hook):
                z_mean[layer] = z[:, tokens.start:].float().mean(dim=(0, 1)).cpu()
            return hook
        extra += [(attn_hook(layer, "z"), make(layer)) for layer in range(spec.n_layers)]

    logits = stream_patterns(model, tokens.tokens, on_pattern, extra_hooks=extra)
    if first_bad:
        raise HeadprobeError(f"activations become NaN or Inf in layer {first_bad[0]} (residual stream after the block); "
                             f"check the weights of that layer")
    if not torch.isfinite(logits).all():
        raise HeadprobeError("the model produced NaN or Inf logits on the scan's input")
    return scores, logits, z_mean


def _token_labels(model, ids: torch.Tensor) -> list[str]:
    labels = []
    for i in ids.tolist():
        s = model.tokenizer.decode([i]).replace("\n", "\\n")
        labels.append((s if s.strip() else repr(s)[1:-1] or "·")[:10])
    return labels


@torch.inference_mode()
def example_patterns(model, best: dict[str, tuple[int, int]], natural: TokenSet, repeated: TokenSet) -> dict[str, dict]:
    """The attention pattern of the top head of each type on a short example of its token set."""
    period = 10
    short = {
        "natural": natural.tokens[:1, :28],
        "repeated": torch.cat(
            [repeated.tokens[:1, : repeated.start + period], repeated.tokens[:1, repeated.start : repeated.start + period]], dim=1
        ),
    }
    out: dict[str, dict] = {}
    for dataset, toks in short.items():
        wanted = {t: h for t, h in best.items() if DETECTORS[t].dataset == dataset}
        layers = sorted({h[0] for h in wanted.values()})
        if not layers:
            continue
        kept: dict[int, torch.Tensor] = {}

        def on_pattern(layer, pattern):
            kept[layer] = pattern[0].detach().float().cpu().clone()

        stream_patterns(model, toks, on_pattern, layers=layers)
        labels = _token_labels(model, toks[0])
        for t, (layer, head) in wanted.items():
            out[t] = {"head": (layer, head), "pattern": kept[layer][head].numpy(), "labels": labels}
    return out


def verify(model, scores: dict[str, np.ndarray], natural: TokenSet, repeated: TokenSet, clean: dict[str, float],
           mean_z: torch.Tensor, cfg: ScanConfig, progress: bool = True) -> list[Verification]:
    """Zero- and mean-ablate each type's top-k heads and ``cfg.n_random`` sets of k random heads.

    Random draws are shared by the types judged on the same task, so each draw costs one
    forward pass per task and ablation kind.
    """
    spec = model.spec
    k = cfg.k  # run_scan checked k < number of heads
    sets = {"natural": natural, "repeated": repeated}
    random_sets = random_head_sets(spec.n_layers, spec.n_heads, k, cfg.n_random, cfg.seed)
    tasks = sorted({d.task for d in DETECTORS.values()})
    jobs = [("random", task, kind, i) for task in tasks for kind in ABLATION_KINDS for i in range(cfg.n_random)]
    jobs += [("top", det.name, kind, None) for det in DETECTORS.values() for kind in ABLATION_KINDS]
    random_effects: dict[tuple[str, str], list[float]] = {}
    out: list[Verification] = []
    for what, name, kind, i in tqdm(jobs, desc="ablations", unit="pass", disable=not progress):
        if what == "random":
            ts = sets[name]
            loss = ablated_loss(model, ts.tokens, random_sets[i], kind, mean_z, name, ts.start, ts.period)
            random_effects.setdefault((name, kind), []).append(loss - clean[name])
            continue
        det = DETECTORS[name]
        ts = sets[det.task]
        heads = top_heads(torch.as_tensor(scores[det.rank_by]), k)
        loss = ablated_loss(model, ts.tokens, heads, kind, mean_z, det.task, ts.start, ts.period)
        effect = loss - clean[det.task]
        rand = random_effects[(det.task, kind)]
        out.append(Verification(
            head_type=name, kind=kind, task=det.task, k=k, top_heads=names(heads), clean_loss=clean[det.task],
            top_loss=loss, top_effect=effect, random_effects=rand, random_mean=float(np.mean(rand)),
            random_max=float(np.max(rand)), confirmed=is_confirmed(effect, rand),
            random_heads=[names(s) for s in random_sets],
        ))
    return out


def run_scan(cfg: ScanConfig, model=None, progress: bool = True) -> ScanResult:
    """Run the whole scan (see the module docstring); ``model`` skips loading when given."""
    from headprobe.probe.loading import device_auto, load_model

    timings: dict[str, float] = {}
    text = read_text_file(cfg.text) if cfg.text else None
    t0 = time.perf_counter()
    if model is None:
        if progress:
            print(f"loading {cfg.model} ...", flush=True)
        model = load_model(cfg.model, device=device_auto(cfg.device), prepend_bos=cfg.prepend_bos, backend=cfg.backend)
    timings["load_s"] = time.perf_counter() - t0
    spec = model.spec
    if progress:
        print(f"model {spec.name}: {spec.n_layers} layers x {spec.n_heads} heads ({spec.layout}, "
              f"{spec.n_kv_heads} KV heads); weights: {spec.precision}", flush=True)
    model.self_check.require_patterns("head scores")
    if cfg.verify:
        model.self_check.require_decomposition("verification by ablation (pass --no-verify to score patterns only)")

    t0 = time.perf_counter()
    if cfg.seq_len is not None and cfg.seq_len > spec.n_ctx:
        raise HeadprobeError(f"--seq-len {cfg.seq_len} is longer than the model's context ({spec.n_ctx} tokens); "
                             f"use --seq-len {spec.n_ctx} or less (longer text is cut into windows)")
    if cfg.period is not None and 2 * cfg.period + 1 > spec.n_ctx:
        raise HeadprobeError(f"--period {cfg.period} gives sequences longer than the model's context ({spec.n_ctx} tokens); "
                             f"use --period {(spec.n_ctx - 1) // 2} or less")
    n_heads = spec.n_layers * spec.n_heads
    if cfg.k is not None and cfg.k >= n_heads:
        raise HeadprobeError(f"--top-k {cfg.k} leaves no random control: the model has {n_heads} heads; "
                             f"use --top-k {max(1, n_heads // 4)} or so")
    cfg = replace(cfg, seq_len=cfg.seq_len or min(DEFAULT_SEQ_LEN, spec.n_ctx),
                  period=cfg.period or min(DEFAULT_PERIOD, (spec.n_ctx - 1) // 2),
                  k=cfg.k or max(1, min(DEFAULT_K, n_heads // 4)))
    natural = natural_text_tokens(model, cfg.n_natural, cfg.seq_len, cfg.seed, text,
                                  source=str(cfg.text) if cfg.text else None)
    repeated = repeated_random_tokens(model, cfg.n_repeated, cfg.period, cfg.seed)
    steps = tqdm(total=2, desc="scoring heads", unit="pass", disable=not progress)
    nat_scores, nat_logits, mean_z = score_token_set(model, natural, "natural", mean_z=cfg.verify)
    steps.update()
    rep_scores, rep_logits, _ = score_token_set(model, repeated, "repeated")
    steps.update()
    steps.close()
    scores = {c: v.numpy() for c, v in {**nat_scores, **rep_scores}.items()}
    clean = {
        "natural": task_loss(nat_logits, natural.tokens, "natural", natural.start, None),
        "repeated": task_loss(rep_logits, repeated.tokens, "repeated", repeated.start, repeated.period),
    }
    timings["score_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    verifications = verify(model, scores, natural, repeated, clean, mean_z, cfg, progress) if cfg.verify else []
    timings["ablate_s"] = time.perf_counter() - t0

    best = {name: top_heads(torch.as_tensor(scores[d.rank_by]), 1)[0] for name, d in DETECTORS.items()}
    examples = example_patterns(model, best, natural, repeated)

    layer, head = np.meshgrid(np.arange(spec.n_layers), np.arange(spec.n_heads), indexing="ij")
    table = pd.DataFrame({
        "layer": layer.ravel(),
        "head": head.ravel(),
        "kv_head": kv_head_of(head.ravel(), spec.n_heads, spec.n_kv_heads),
        **{c: scores[c].ravel() for c in SCORE_COLUMNS},
    })
    table["positional_offset"] = table["positional_offset"].astype(int)
    param = next(model.model.parameters())
    return ScanResult(cfg, spec, table, scores, verifications, clean, natural, repeated, examples, timings,
                      device=str(param.device), dtype=str(param.dtype), self_check=model.self_check.to_dict())


def summary(result: ScanResult, top_n: int = 5) -> dict:
    spec, cfg = result.spec, result.config
    top = {}
    for name, det in DETECTORS.items():
        col = result.scores[det.rank_by]
        entries = []
        for layer, head in top_heads(torch.as_tensor(col), top_n):
            e = {"head": format_head((layer, head)), "kv_head": int(kv_head_of(head, spec.n_heads, spec.n_kv_heads)),
                 "score": round(float(col[layer, head]), 4)}
            if name == "positional":
                e["offset"] = int(result.scores["positional_offset"][layer, head])
            entries.append(e)
        top[name] = entries
    confirmed = {}
    for v in result.verifications:
        confirmed.setdefault(v.head_type, {})[v.kind] = v.confirmed
    return {
        "model": spec.name,
        "hf_name": spec.hf_name,
        "weights_precision": spec.precision,
        "layout": {"attention": spec.layout, "n_layers": spec.n_layers, "n_heads": spec.n_heads,
                   "n_kv_heads": spec.n_kv_heads, "d_head": spec.d_head, "d_model": spec.d_model},
        "tokens": {
            "natural_text": {"source": result.natural.source, "sequences": int(result.natural.tokens.shape[0]),
                             "seq_len": int(result.natural.tokens.shape[1]), "tokens": result.natural.n_tokens,
                             "windows_available": result.natural.n_available, "bos": bool(result.natural.start)},
            "repeated_random": {"sequences": int(result.repeated.tokens.shape[0]), "period": result.repeated.period,
                                "seq_len": int(result.repeated.tokens.shape[1]), "tokens": result.repeated.n_tokens,
                                "bos": bool(result.repeated.start)},
        },
        "seed": cfg.seed,
        "device": str(result.device),
        "dtype": str(result.dtype).removeprefix("torch."),
        "backend": "native" if "native backend" in spec.precision else "transformer-lens",
        "self_check": result.self_check,
        "config": asdict(cfg),
        "clean_loss_nats": result.clean_loss,
        "top_heads": top,
        "confirmed": confirmed,
        "confirmation_rule": "top-k effect >= 0.05 nats, > every random draw's effect, and >= 2x the mean random effect",
        "ablations": [v.to_dict() for v in result.verifications],
        "timings_s": {k: round(v, 2) for k, v in result.timings.items()},
        "versions": package_versions(),
    }


SCORE_FIGURES = {
    # column: (title, colour-bar label, heatmap kwargs)
    "previous_token": ("previous-token score", "attention to i−1", {}),
    "duplicate_token": ("duplicate-token score", "attention to earlier copy", {}),
    "induction": ("induction score", "attention to token after copy", {}),
    "first_token": ("first-token (sink) score", "attention to position 0", {}),
    "positional_fraction": ("positional score", "share of queries at top offset", {}),
    "positional_offset": ("positional offset k − q", "most frequent offset of the maximum",
                          {"cmap": "cividis", "vmin": -8, "vmax": 0, "extend": "min"}),
}


def write_outputs(result: ScanResult, out: Path) -> list[Path]:
    """Write head_scores.csv, all figures and, last, summary.json into ``out`` (each file
    atomically), so a directory with summary.json in it is complete."""
    spec = result.spec
    written = []
    csv = out / "head_scores.csv"
    write_text(csv, result.table.to_csv(index=False, float_format="%.5f"))
    written.append(csv)

    tag = f"{spec.name} ({figures.weights_label(spec.precision)})"
    for col, (title, label, kw) in SCORE_FIGURES.items():
        fig = figures.head_heatmap(result.scores[col], f"{title}, {tag}", label, group_size=spec.group_size, **kw)
        written += figures.save_figure(fig, out / f"heatmap_{col}")
    panels = [(SCORE_FIGURES[c][0].removesuffix(" score"), result.scores[c])
              for c in ("previous_token", "duplicate_token", "induction", "first_token", "positional_fraction")]
    written += figures.save_figure(figures.scores_overview(panels, spec.group_size, f"Head scores of {tag}"), out / "overview")
    for head_type, ex in result.examples.items():
        title = f"top {head_type.replace('_', '-')} head L{ex['head'][0]}H{ex['head'][1]}, {spec.name}"
        written += figures.save_figure(figures.pattern_plot(ex["pattern"], ex["labels"], title), out / f"pattern_{head_type}")
    rows = [v.to_dict() for v in result.verifications]
    if rows:
        written += figures.save_figure(figures.ablation_plot(rows, f"Ablation check, {tag}"), out / "ablation")
    write_json(out / "summary.json", summary(result))
    written.append(out / "summary.json")
    return written


def format_report(result: ScanResult) -> str:
    """The short terminal table: top heads per type and the ablation verdicts."""
    spec = result.spec
    lines = [f"{spec.name}: weights {spec.precision}", ""]
    lines.append(f"{'head type':<16} {'top heads (score)':<52}")
    for name, det in DETECTORS.items():
        col = result.scores[det.rank_by]
        tops = top_heads(torch.as_tensor(col), 4)
        cells = ", ".join(f"{format_head(h)} ({col[h]:.2f})" for h in tops)
        lines.append(f"{name:<16} {cells}")
    lines.append("")
    if not result.verifications:
        lines.append("no ablation check (--no-verify): these are pattern scores, not verified findings")
        return "\n".join(lines)
    lines.append(f"{'ablation (k=' + str(result.config.k) + ')':<22} {'task':<9} {'clean':>6} {'top-k Δ':>8} {'random Δ mean/max':>18}  verdict")
    for v in result.verifications:
        verdict = "CONFIRMED" if v.confirmed else "not confirmed"
        lines.append(f"{v.head_type + ' ' + v.kind:<22} {v.task:<9} {v.clean_loss:6.2f} {v.top_effect:+8.2f} "
                     f"{v.random_mean:+9.2f}/{v.random_max:+.2f}  {verdict}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ScanConfig()
    p.add_argument("--model", default=d.model, help="smollm2-135m (default, embedded 4-bit weights), gpt2, any TransformerLens-supported name, a local HF directory or .gguf file")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace files in a non-empty output directory")
    p.add_argument("--text", default=None, help="UTF-8 text file for natural-text scores (default: CPython's pydoc_data.topics)")
    p.add_argument("--n-natural", type=positive_int, default=d.n_natural, help="natural-text sequences (default %(default)s)")
    p.add_argument("--seq-len", type=positive_int, default=None,
                   help=f"natural-text sequence length in tokens (default {DEFAULT_SEQ_LEN}, or the model's context if shorter)")
    p.add_argument("--n-repeated", type=positive_int, default=d.n_repeated, help="repeated random sequences (default %(default)s)")
    p.add_argument("--period", type=positive_int, default=None,
                   help=f"length of the repeated random block (default {DEFAULT_PERIOD}, or what fits the model's context twice)")
    p.add_argument("-k", "--top-k", dest="k", type=positive_int, default=None,
                   help=f"heads ablated per type (default {DEFAULT_K}, or a quarter of the heads if fewer)")
    p.add_argument("--n-random", type=positive_int, default=d.n_random, help="random draws of k heads for the control (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])
    p.add_argument("--backend", default=d.backend, choices=["auto", "native", "transformer-lens"],
                   help="native: headprobe's own transformer (GPT-2 and Llama families; auto picks it where it can); "
                        "transformer-lens: TransformerLens' TransformerBridge around the Hugging Face model")
    p.add_argument("--no-bos", dest="prepend_bos", action="store_false", help="do not put BOS in front of sequences")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="score patterns only, without the ablation check (also where a model's per-head decomposition fails its self-check)")


def run(args: argparse.Namespace) -> int:
    if args.seq_len is not None and args.seq_len < 2:
        raise HeadprobeError(f"sequence length {args.seq_len} is too short: scores need at least 2 positions (--seq-len)")
    if args.period is not None and args.period < 2:
        raise HeadprobeError(f"--period {args.period} is too short: induction needs a repeated block of at least 2 tokens")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise HeadprobeError("--device cuda was asked for but no CUDA GPU is available")
    prepare_output_dir(args.out, args.overwrite, create=False)
    cfg = ScanConfig(**{f: getattr(args, f) for f in ScanConfig.__dataclass_fields__})
    result = run_scan(cfg)
    out = prepare_output_dir(args.out, args.overwrite)
    paths = write_outputs(result, out)
    print()
    print(format_report(result))
    print(f"\nwrote {len(paths)} files to {out}/ (head_scores.csv, summary.json, figures as PNG and PDF)")
    return 0
