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
4. head_scores.csv, summary.json, heatmaps, example patterns and the ablation figure; every head's
   pattern on the first sequence of each token set (patterns.npz, for ``headprobe view``) and,
   with ``--html``, the viewer page index.html.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from headprobe import options
from headprobe.analyses import figures as figs
from headprobe.analyses.ablation import (
    SINGLE_INPUT_KINDS, Verification, ablated_loss, empirical_p_value, is_confirmed, names, random_head_sets, task_loss,
    top_heads,
)
from headprobe.analyses.data import TokenSet, natural_text_tokens, read_text_file, repeated_random_tokens
from headprobe.analyses.detectors import DETECTORS, select_detectors
from headprobe.analyses.scoring import example_patterns, score_token_set  # noqa: F401 - score_token_set re-exported
from headprobe.analyses import viewer
from headprobe.options import positive_int
from headprobe.probe.capture import kv_head_of
from headprobe.probe.errors import HeadprobeError
from headprobe.probe.hooks import format_head
from headprobe.probe.io import package_versions, prepare_output_dir, write_json, write_text

HELP = "find the classic head types in a pretrained model, verify them by ablation, write table and figures"

ABLATION_KINDS = SINGLE_INPUT_KINDS
"""The kinds scan verifies with: those needing no second input (zero, mean)."""
DEFAULT_SEQ_LEN = 128  # natural-text tokens per sequence, unless the model's context is shorter
DEFAULT_PERIOD = 50  # repeated block, unless two of them do not fit the context
DEFAULT_K = 10  # heads ablated per type, unless that is more than a quarter of the model's heads


@dataclass(frozen=True)
class ScanConfig:
    """Settings of a scan (all recorded in summary.json's ``config``). Invalid values raise
    :class:`~headprobe.probe.errors.HeadprobeError` when the config is made, before any model loads.

    Attributes:
        model: model name or path (see :func:`headprobe.probe.loading.load_model`); loaded by :func:`scan` and the CLI.
        n_natural: natural-text sequences (>= 1).
        seq_len: natural-text sequence length in tokens, BOS included (>= 2); None: 128, or the model's context if shorter.
        n_repeated: repeated-random-token sequences (>= 1).
        period: length S of the repeated block (>= 2); None: 50, or the longest that fits twice, ``(n_ctx - 1) // 2``.
        k: heads ablated per type and per random draw (>= 1, below the head count); None: 10, or a quarter of the heads if fewer.
        n_random: random draws of k heads for the control (>= 1).
        seed: seeds the window choice, the random tokens and the random head draws.
        text: a UTF-8 file to use instead of the Python documentation text (read and checked when the config is made).
        device: ``auto``, ``cpu`` or ``cuda``; applies when the model is loaded by name.
        dtype: compute precision (``float32``, ``bfloat16``, ``float16`` or bf16/fp16/fp32); applies when the model is loaded by name.
        prepend_bos: put the tokenizer's BOS token first (once) where the model has one; applies when loaded by name.
        backend: ``auto`` (native where supported), ``native`` or ``transformer-lens``; applies when loaded by name.
        verify: ablate each type's top-k heads against random heads (needs the per-head decomposition's self-check); False scores patterns only.
        types: head types to score, verify and draw (names of :data:`~headprobe.analyses.detectors.DETECTORS`, a tuple
            or a comma-separated string, ``-``/``_`` alike); None: all. Stored as the tuple of registry names.
        pattern_len: every head's pattern on the first ``pattern_len`` tokens of each token set's first
            sequence is kept for the viewer (patterns.npz, uint8, see :mod:`headprobe.analyses.viewer`); 0: none.
    """

    model: str = options.DEFAULT_MODEL
    n_natural: int = 8
    seq_len: int | None = None
    n_repeated: int = 8
    period: int | None = None
    k: int | None = None
    n_random: int = 5
    seed: int = 0
    text: str | None = None
    device: str = "auto"
    dtype: str = "float32"
    prepend_bos: bool = True
    backend: str = "auto"
    verify: bool = True
    types: str | Sequence[str] | None = None
    pattern_len: int = viewer.DEFAULT_PATTERN_LEN

    def __post_init__(self):
        object.__setattr__(self, "types", select_detectors(self.types))
        options.check_config_fields(self)
        if self.n_random < 1:
            raise HeadprobeError(f"--n-random must be at least 1, got {self.n_random}")
        if self.k is not None and self.k < 1:
            raise HeadprobeError(f"--top-k must be at least 1, got {self.k}")
        if self.pattern_len != 0 and self.pattern_len < 2:
            raise HeadprobeError(f"--pattern-len must be 0 (no patterns.npz) or at least 2, got {self.pattern_len}")

    def preflight(self) -> None:
        """Every check the settings alone decide, before a model loads (the text file here).

        Raises:
            HeadprobeError: as :meth:`read_text`.
        """
        self.read_text()

    def read_text(self) -> str | None:
        """The natural text (None: the default text); checks the file.

        Raises:
            HeadprobeError: missing, a directory, unreadable, not UTF-8 or empty.
        """
        return read_text_file(self.text) if self.text else None

    def resolved(self, spec) -> ScanConfig:
        """This config with the model-dependent defaults filled in for ``spec`` (a ModelSpec).

        Raises:
            HeadprobeError: a sequence longer than the model's context, or k >= the head count.
        """
        if self.seq_len is not None and self.seq_len > spec.n_ctx:
            raise HeadprobeError(f"--seq-len {self.seq_len} is longer than the model's context ({spec.n_ctx} tokens); "
                                 f"use --seq-len {spec.n_ctx} or less (longer text is cut into windows)")
        if self.period is not None and 2 * self.period + 1 > spec.n_ctx:
            raise HeadprobeError(f"--period {self.period} gives sequences longer than the model's context ({spec.n_ctx} tokens); "
                                 f"use --period {(spec.n_ctx - 1) // 2} or less")
        n_heads = spec.n_layers * spec.n_heads
        if self.k is not None and self.k >= n_heads:
            raise HeadprobeError(f"--top-k {self.k} leaves no random control: the model has {n_heads} heads; "
                                 f"use --top-k {max(1, n_heads // 4)} or so")
        return replace(self, seq_len=self.seq_len or min(DEFAULT_SEQ_LEN, spec.n_ctx),
                       period=self.period or min(DEFAULT_PERIOD, (spec.n_ctx - 1) // 2),
                       k=self.k or max(1, min(DEFAULT_K, n_heads // 4)))


@dataclass
class ScanResult:
    """What a scan found. Losses in nats/token, scores as defined in :mod:`headprobe.analyses.detectors`.

    Attributes:
        config: the settings, model-dependent defaults filled in.
        spec: the model's :class:`~headprobe.probe.loading.ModelSpec`.
        table: head_scores.csv: one row per head (``layer``, ``head``, ``kv_head``, then the selected types' columns).
        scores: column -> ``[layer, head]`` array (the selected types' columns).
        verifications: one :class:`~headprobe.analyses.ablation.Verification` per selected type and ablation kind.
        clean_loss: task (``natural``, ``repeated``) -> loss with no head ablated.
        natural, repeated: the token sets scored.
        examples: head type -> ``{"head", "pattern", "labels"}``, its top head's pattern on a short example.
        timings: seconds per stage (``load_s``, ``score_s``, ``ablate_s``).
        device, dtype: where and in which precision the model ran.
        self_check: the model's load-time self-check (:meth:`SelfCheck.to_dict`).
        patterns: every head's pattern on each token set's first sequence (``natural``, ``repeated``;
            :func:`headprobe.analyses.viewer.head_patterns`), or None (``pattern_len`` 0).
    """

    config: ScanConfig
    spec: object
    table: pd.DataFrame
    scores: dict[str, np.ndarray]
    verifications: list[Verification]
    clean_loss: dict[str, float]
    natural: TokenSet
    repeated: TokenSet
    examples: dict[str, dict]
    timings: dict[str, float]
    device: str = "cpu"
    dtype: str = "float32"
    self_check: dict | None = None
    patterns: dict | None = None

    def summary(self) -> dict:
        """summary.json's content (as a dict; package versions included)."""
        return summary(self)

    def figures(self) -> dict[str, object]:
        """The figures scan writes, by file stem (``heatmap_induction``, ``overview``, ``pattern_induction``,
        ``ablation``): matplotlib Figures of the selected types only."""
        return scan_figures(self)

    def report(self) -> str:
        """The short terminal table: top heads per type and the ablation verdicts."""
        return format_report(self)

    def html(self) -> str:
        """The viewer page (``headprobe view``'s index.html) of this result: self-contained, offline."""
        return viewer.build_page(self.table, self.summary(), self.patterns)

    def _repr_html_(self) -> str:
        """Jupyter shows the viewer page, in a sandboxed iframe."""
        return viewer.notebook_html(self.html())

    def save(self, out_dir: str | Path, overwrite: bool = False, html: bool = False) -> list[Path]:
        """Write head_scores.csv, the figures (PNG and PDF), patterns.npz (if kept), with ``html`` the
        viewer page index.html, and, last, summary.json into ``out_dir``, each file atomically, so a
        directory with summary.json in it is complete. Returns the paths.

        Raises:
            HeadprobeError: ``out_dir`` is a file, not writable, or not empty and ``overwrite`` is False.
        """
        out = prepare_output_dir(out_dir, overwrite)
        return write_outputs(self, out, html=html)


def verify(model, scores: dict[str, np.ndarray], natural: TokenSet, repeated: TokenSet, clean: dict[str, float],
           mean_z: torch.Tensor, cfg: ScanConfig, progress: bool = True) -> list[Verification]:
    """Zero- and mean-ablate the top-k heads of each of ``cfg.types`` and ``cfg.n_random`` sets of
    k random heads; ``cfg`` is resolved (k set).

    Each type's control draws k random heads from those outside its own top-k (seeded, so the
    draws of a type do not depend on which other types are selected); types with the same task and
    the same top-k share their draws. One forward pass per draw, control and ablation kind.
    """
    spec = model.spec
    k = cfg.k
    sets = {"natural": natural, "repeated": repeated}
    dets = {name: DETECTORS[name] for name in cfg.types}
    top = {name: top_heads(torch.as_tensor(scores[det.rank_by]), k) for name, det in dets.items()}
    group_of = {name: (det.task, tuple(sorted(top[name]))) for name, det in dets.items()}  # (task, heads excluded)
    groups = list(dict.fromkeys(group_of.values()))
    draws = {key: random_head_sets(spec.n_layers, spec.n_heads, k, cfg.n_random, cfg.seed, exclude=key[1])
             for key in groups}
    jobs = [("random", key, kind, i) for key in groups for kind in ABLATION_KINDS for i in range(cfg.n_random)]
    jobs += [("top", name, kind, None) for name in dets for kind in ABLATION_KINDS]
    random_effects: dict[tuple, list[float]] = {}
    out: list[Verification] = []
    for what, name, kind, i in tqdm(jobs, desc="ablations", unit="pass", disable=not progress):
        if what == "random":
            task = name[0]
            ts = sets[task]
            loss = ablated_loss(model, ts.tokens, draws[name][i], kind, mean_z, task, ts.start, ts.period)
            random_effects.setdefault((name, kind), []).append(loss - clean[task])
            continue
        det = dets[name]
        ts = sets[det.task]
        heads = top[name]
        loss = ablated_loss(model, ts.tokens, heads, kind, mean_z, det.task, ts.start, ts.period)
        effect = loss - clean[det.task]
        key = group_of[name]
        rand = random_effects[(key, kind)]
        out.append(Verification(
            head_type=name, kind=kind, task=det.task, k=k, top_heads=names(heads), clean_loss=clean[det.task],
            top_loss=loss, top_effect=effect, random_effects=rand, random_mean=float(np.mean(rand)),
            random_max=float(np.max(rand)), confirmed=is_confirmed(effect, rand),
            random_heads=[names(s) for s in draws[key]], control_excludes=names(key[1]),
            p_value=empirical_p_value(effect, rand),
        ))
    return out


def run(model, config: ScanConfig, progress: bool = True) -> ScanResult:
    """Run the scan (see the module docstring) on a loaded model.

    Args:
        model: a :class:`~headprobe.probe.loading.LoadedModel`, used as given (``config``'s device,
            dtype, backend and prepend_bos apply only where :func:`scan` or the CLI load it).
        config: the settings.
        progress: show progress bars (stderr).

    Raises:
        HeadprobeError: bad text, sequences longer than the context, k too large, a model whose
            self-check forbids patterns (or, with ``verify``, head ablation), or NaN activations.
    """
    timings: dict[str, float] = {"load_s": 0.0}
    text = config.read_text()
    spec = model.spec
    model.self_check.require_patterns("head scores")
    if config.verify:
        model.self_check.require_decomposition("verification by ablation (pass --no-verify to score patterns only)")

    t0 = time.perf_counter()
    cfg = config.resolved(spec)
    natural = natural_text_tokens(model, cfg.n_natural, cfg.seq_len, cfg.seed, text,
                                  source=str(cfg.text) if cfg.text else None)
    repeated = repeated_random_tokens(model, cfg.n_repeated, cfg.period, cfg.seed)
    steps = tqdm(total=2, desc="scoring heads", unit="pass", disable=not progress)
    nat_scores, nat_logits, mean_z = score_token_set(model, natural, "natural", mean_z=cfg.verify, types=cfg.types)
    steps.update()
    rep_scores, rep_logits, _ = score_token_set(model, repeated, "repeated", types=cfg.types)
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

    best = {name: top_heads(torch.as_tensor(scores[DETECTORS[name].rank_by]), 1)[0] for name in cfg.types}
    examples = example_patterns(model, best, natural, repeated)
    patterns = (viewer.head_patterns(model, {"natural": natural, "repeated": repeated}, cfg.pattern_len)
                if cfg.pattern_len else None)

    layer, head = np.meshgrid(np.arange(spec.n_layers), np.arange(spec.n_heads), indexing="ij")
    dets = [DETECTORS[name] for name in cfg.types]
    table = pd.DataFrame({
        "layer": layer.ravel(),
        "head": head.ravel(),
        "kv_head": kv_head_of(head.ravel(), spec.n_heads, spec.n_kv_heads),
        **{c: scores[c].ravel() for d in dets for c in d.columns},
    })
    for d in dets:
        for c in d.integer_columns:
            table[c] = table[c].astype(int)
    return ScanResult(cfg, spec, table, scores, verifications, clean, natural, repeated, examples, timings,
                      device=str(model.device), dtype=str(model.dtype), self_check=model.self_check.to_dict(),
                      patterns=patterns)




def scan(model="smollm2-135m", *, progress: bool = False, **config_fields) -> ScanResult:
    """Score, verify and draw the heads of ``model``: ``headprobe scan`` as a function.

    Args:
        model: a model name or path (loaded as ``config_fields`` ask), or a
            :class:`~headprobe.probe.loading.LoadedModel` (used as given).
        progress: show progress bars.
        **config_fields: any :class:`ScanConfig` field but ``model`` (e.g. ``types=("induction",)``, ``k=5``).

    Returns:
        :class:`ScanResult`; ``result.table`` is head_scores.csv, ``result.save(out)`` writes the CLI's files.

    Raises:
        HeadprobeError: bad settings (before anything loads), or as :func:`run`.
        TypeError: an unknown config field.
    """
    config, loaded, load_s = options.config_and_model(ScanConfig, model, config_fields)
    result = run(loaded, config, progress=progress)
    result.timings["load_s"] = load_s
    return result


def run_scan(cfg: ScanConfig, model=None, progress: bool = True) -> ScanResult:
    """Compatibility: :func:`run` on ``model``, or on ``cfg.model`` loaded when ``model`` is None."""
    t0 = time.perf_counter()
    loaded = options.load_for(cfg) if model is None else model
    load_s = time.perf_counter() - t0
    result = run(loaded, cfg, progress=progress)
    result.timings["load_s"] = load_s if model is None else 0.0
    return result


def summary(result: ScanResult, top_n: int = 5) -> dict:
    """summary.json's content: layout, token sets, settings, clean losses, each selected type's
    top ``top_n`` heads, the ablation verdicts and evidence, timings and package versions."""
    spec, cfg = result.spec, result.config
    top = {}
    for name in cfg.types:
        det = DETECTORS[name]
        col = result.scores[det.rank_by]
        entries = []
        for layer, head in top_heads(torch.as_tensor(col), top_n):
            e = {"head": format_head((layer, head)), "kv_head": int(kv_head_of(head, spec.n_heads, spec.n_kv_heads)),
                 "score": round(float(col[layer, head]), 4)}
            for key, column in det.top_head_extras:
                e[key] = int(result.scores[column][layer, head])
            entries.append(e)
        top[name] = entries
    confirmed = {}
    for v in result.verifications:
        confirmed.setdefault(v.head_type, {})[v.kind] = v.confirmed
    return {
        "model": spec.name,
        "hf_name": spec.hf_name,
        "weights_precision": spec.precision,
        "layout": {"attention": spec.kind, "n_layers": spec.n_layers, "n_heads": spec.n_heads,
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
        "backend": spec.backend,
        "self_check": result.self_check,
        "config": asdict(cfg),
        "clean_loss_nats": result.clean_loss,
        "top_heads": top,
        "confirmed": confirmed,
        "confirmation_rule": "top-k effect >= 0.05 nats, > every random draw's effect, and >= 2x the mean random effect",
        "control_rule": "each type's random draws of k heads come from the heads outside its own top-k; "
                        "p_value = (1 + #draws with effect >= the top-k effect) / (1 + draws)",
        "ablations": [v.to_dict() for v in result.verifications],
        "timings_s": {k: round(v, 2) for k, v in result.timings.items()},
        "versions": package_versions(),
    }


def scan_figures(result: ScanResult) -> dict[str, object]:
    """File stem -> matplotlib Figure: one heatmap per registered figure of each selected type
    (``heatmap_<column>``), the ``overview`` of their ranking scores, each type's top-head
    ``pattern_<type>`` and, after verification, the ``ablation`` bars."""
    spec = result.spec
    dets = [DETECTORS[name] for name in result.config.types]
    tag = f"{spec.name} ({figs.weights_label(spec.weights)})"
    out: dict[str, object] = {}
    for det in dets:
        for style in det.figures:
            out[f"heatmap_{style.column}"] = figs.head_heatmap(result.scores[style.column], f"{style.title}, {tag}",
                                                               style.label, group_size=spec.group_size, **dict(style.options))
    panels = [(det.panel_title, result.scores[det.rank_by]) for det in dets]
    out["overview"] = figs.scores_overview(panels, spec.group_size, f"Head scores of {tag}")
    for head_type, ex in result.examples.items():
        title = f"top {head_type.replace('_', '-')} head L{ex['head'][0]}H{ex['head'][1]}, {spec.name}"
        out[f"pattern_{head_type}"] = figs.pattern_plot(ex["pattern"], ex["labels"], title)
    rows = [v.to_dict() for v in result.verifications]
    if rows:
        out["ablation"] = figs.ablation_plot(rows, f"Ablation check, {tag}")
    return out


def write_outputs(result: ScanResult, out: Path, html: bool = False) -> list[Path]:
    """Write head_scores.csv, all figures, patterns.npz (if kept), with ``html`` index.html, and,
    last, summary.json into the existing directory ``out`` (each file atomically), so a directory
    with summary.json in it is complete."""
    out = Path(out)
    csv = out / "head_scores.csv"
    write_text(csv, result.table.to_csv(index=False, float_format="%.5f"))
    written = [csv]
    for stem, fig in scan_figures(result).items():
        written += figs.save_figure(fig, out / stem)
    if result.patterns:
        written.append(viewer.save_patterns(out / "patterns.npz", result.patterns))
    if html:
        write_text(out / "index.html", result.html())
        written.append(out / "index.html")
    write_json(out / "summary.json", result.summary())
    written.append(out / "summary.json")
    return written


def format_report(result: ScanResult) -> str:
    """The short terminal table: top heads per type and the ablation verdicts."""
    spec = result.spec
    lines = [f"{spec.name}: weights {spec.precision}", ""]
    lines.append(f"{'head type':<16} {'top heads (score)':<52}")
    for name in result.config.types:
        col = result.scores[DETECTORS[name].rank_by]
        tops = top_heads(torch.as_tensor(col), 4)
        cells = ", ".join(f"{format_head(h)} ({col[h]:.2f})" for h in tops)
        lines.append(f"{name:<16} {cells}")
    lines.append("")
    if not result.verifications:
        lines.append("no ablation check (--no-verify): these are pattern scores, not verified findings")
        return "\n".join(lines)
    lines.append(f"{'ablation (k=' + str(result.config.k) + ')':<22} {'task':<9} {'clean':>6} {'top-k Δ':>8} "
                 f"{'random Δ mean/max':>18} {'p':>6}  verdict")
    for v in result.verifications:
        verdict = "CONFIRMED" if v.confirmed else "not confirmed"
        lines.append(f"{v.head_type + ' ' + v.kind:<22} {v.task:<9} {v.clean_loss:6.2f} {v.top_effect:+8.2f} "
                     f"{v.random_mean:+9.2f}/{v.random_max:+.2f} {v.p_value:6.3f}  {verdict}")
    n = len(result.verifications[0].random_effects)
    lines.append(f"(random Δ: {n} draws of k heads outside the type's top-k; p = (1 + draws >= top-k Δ) / (1 + {n}), "
                 f"at least {1 / (n + 1):.3f})")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = ScanConfig()
    options.add_model_options(p)
    options.add_output_options(p)
    options.add_data_options(p, seq_len=None, n_repeated=d.n_repeated, period=None,
                             seq_len_help=f"(default {DEFAULT_SEQ_LEN}, or the model's context if shorter)",
                             period_help=f"(default {DEFAULT_PERIOD}, or what fits the model's context twice)")
    p.add_argument("--n-natural", type=positive_int, default=d.n_natural, help="natural-text sequences (default %(default)s)")
    p.add_argument("-k", "--top-k", dest="k", type=positive_int, default=None,
                   help=f"heads ablated per type (default {DEFAULT_K}, or a quarter of the heads if fewer)")
    p.add_argument("--n-random", type=positive_int, default=d.n_random, help="random draws of k heads for the control (default %(default)s)")
    options.add_seed_option(p, d.seed)
    p.add_argument("--types", default=None, metavar="TYPE[,TYPE...]",
                   help=f"score, verify and draw only these head types (default: all of {','.join(DETECTORS)})")
    p.add_argument("--no-bos", dest="prepend_bos", action="store_false", help="do not put BOS in front of sequences")
    p.add_argument("--no-verify", dest="verify", action="store_false",
                   help="score patterns only, without the ablation check (also where a model's per-head decomposition fails its self-check)")
    p.add_argument("--pattern-len", type=int, default=d.pattern_len, metavar="N",
                   help="keep every head's pattern on the first N tokens of each example in patterns.npz, "
                        "for headprobe view (default %(default)s; 0: none)")
    p.add_argument("--html", action="store_true",
                   help="also write index.html, the interactive viewer (same as headprobe view OUT afterwards)")


def config_from_args(args: argparse.Namespace) -> ScanConfig:
    """The :class:`ScanConfig` the flags ask for (checks everything the flags alone decide)."""
    return ScanConfig(**{f: getattr(args, f) for f in ScanConfig.__dataclass_fields__})


def main(args: argparse.Namespace) -> int:
    """``headprobe scan``: flags -> config (checked, with --text and --out, before the model loads) -> run -> save -> print."""
    config = config_from_args(args)
    config.read_text()
    prepare_output_dir(args.out, args.overwrite, create=False)
    t0 = time.perf_counter()
    model = options.load_for(config)
    load_s = time.perf_counter() - t0
    print(options.describe_model(model), flush=True)
    result = run(model, config)
    result.timings["load_s"] = load_s
    paths = result.save(args.out, args.overwrite, html=args.html)
    print()
    print(result.report())
    extras = (", patterns.npz" if result.patterns else "") + (", index.html" if args.html else "")
    print(f"\nwrote {len(paths)} files to {Path(args.out)}/ (head_scores.csv, summary.json, figures as PNG and PDF{extras})")
    return 0
