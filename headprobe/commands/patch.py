"""``headprobe patch``: per-head activation patching from a corrupted into a clean prompt, scored
by a logit difference; the indirect-object identification task (Wang et al. 2022) built in.

For each head (or ``--heads``), the clean prompts are run with that head's ``z`` replaced by its
``z`` on the corrupted prompts, and the logit difference ``logit(correct) - logit(wrong)`` after
the last token is compared with the clean run's (definitions, normalisation and intervals:
:mod:`headprobe.analyses.patching`).

Prompts: ``--task ioi`` (default) builds ``--n-prompts`` IOI pairs from six templates
(:func:`headprobe.analyses.patching.ioi_prompts`: clean "When Mary and John went to the store,
John gave a drink to" -> " Mary" vs " John"; corrupted: three other names); ``--prompts FILE``
reads your own pairs, one JSON object per line with ``clean``, ``corrupted``, ``correct`` and
``wrong`` (the answers single tokens, e.g. ``" Mary"``; clean and corrupted the same token length).

Outputs: ``head_patching.csv`` (layer, head, kv_head, effect, its 95% interval, normalised
effect), ``patching.{png,pdf,svg}`` (the normalised effect of every head), ``patching_top``
(the largest effects with their intervals) and ``summary.json`` (written last).

As a library::

    result = headprobe.patch("smollm2-135m", n_prompts=24)   # PatchResult
    result.table                                            # head_patching.csv
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path


from headprobe.commands import Command
from headprobe import options, settings
from headprobe.options import positive_int
from headprobe.probe.errors import HeadprobeError
from headprobe.settings import ModelSettings
from headprobe.probe.io import package_versions, read_text_file

HELP = "activation patching per head (clean vs corrupted prompt, logit difference); the IOI task built in"

TASKS = ("ioi",)


@dataclass(frozen=True)
class PatchConfig(ModelSettings):
    """Settings of ``headprobe patch``: the shared :class:`~headprobe.settings.ModelSettings` (how
    the model is loaded, :func:`headprobe.options.load_model_as`) composed, and the patching's own.

    Attributes:
        task: ``ioi`` (ignored with ``prompts``).
        prompts: a JSONL file of prompt pairs (see the module docstring), instead of the task's.
        n_prompts: IOI pairs to build (>= 2). seed: draws the IOI names and the bootstrap.
        heads: ``layer.head`` list (comma-separated) to patch; None: every head.
    """

    task: str = "ioi"
    prompts: str | None = None
    n_prompts: int = 24
    seed: int = 0
    heads: str | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.task not in TASKS:
            raise HeadprobeError(f"--task must be one of {', '.join(TASKS)}, got {self.task!r} (or give --prompts FILE)")
        if self.n_prompts < 2:
            raise HeadprobeError(f"--n-prompts must be at least 2 (an interval needs two prompts), got {self.n_prompts}")

    def preflight(self) -> None:
        """Read and check ``prompts`` (before a model loads)."""
        self.read_pairs()

    def read_pairs(self):
        """The prompt pairs of ``prompts`` (None without it).

        Raises:
            HeadprobeError: unreadable file, a line that is not a JSON object with the four string fields, fewer than 2 pairs.
        """
        if self.prompts is None:
            return None
        from headprobe.analyses.patching import PromptPair

        pairs = []
        for n, line in enumerate(read_text_file(self.prompts).splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                pairs.append(PromptPair(**{k: obj[k] for k in ("clean", "corrupted", "correct", "wrong")}))
                if not all(isinstance(getattr(pairs[-1], k), str) for k in ("clean", "corrupted", "correct", "wrong")):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise HeadprobeError(f"{self.prompts} line {n}: expected a JSON object with string fields clean, corrupted, "
                                     f"correct and wrong") from None
        if len(pairs) < 2:
            raise HeadprobeError(f"{self.prompts} has {len(pairs)} prompt pair(s); patching needs at least 2")
        return pairs


@dataclass
class PatchResult:
    """A finished patching run: ``config``, the model's ``spec``, ``patching``
    (:class:`headprobe.analyses.patching.PatchingResult`), ``table`` (head_patching.csv) and ``seconds``."""

    config: PatchConfig
    spec: object
    patching: object
    table: object
    seconds: float = 0.0
    model_info: dict = field(default_factory=dict)

    def summary(self) -> dict:
        """summary.json: model, task, prompts, clean and corrupted logit differences (means and 95%
        intervals), the normaliser, the top heads by |effect|, the metric's definition."""
        from headprobe.analyses.statistics import bootstrap_ci

        p, seed = self.patching, self.config.seed
        top = self.table.reindex(self.table["effect"].abs().sort_values(ascending=False).index).head(10)
        return {
            "model": self.spec.name, "weights_precision": self.spec.precision, **self.model_info,
            "task": "custom prompts" if self.config.prompts else self.config.task,
            "n_prompts": int(len(p.clean_ld)), "example": asdict(p.pairs[0]) if p.pairs else None,
            "clean_logit_diff": round(float(p.clean_ld.mean()), 4),
            "clean_logit_diff_ci95": [round(float(x), 4) for x in bootstrap_ci(p.clean_ld, seed=seed)],
            "clean_correct_share": round(float((p.clean_ld > 0).mean()), 4),
            "corrupted_logit_diff": round(float(p.corrupted_ld.mean()), 4),
            "corrupted_logit_diff_ci95": [round(float(x), 4) for x in bootstrap_ci(p.corrupted_ld, seed=seed)],
            "normaliser": round(p.total, 4),
            **({} if p.total else {"normalized_null_reason": "undefined: the corrupted prompts' mean logit difference "
                                   "equals the clean prompts' (normaliser 0), so effect / normaliser is 0/0"}),
            "top_heads": [{"head": f"{int(r.layer)}.{int(r.head)}", "effect": round(float(r.effect), 4),
                           "effect_ci95": [round(float(r.effect_ci95_lo), 4), round(float(r.effect_ci95_hi), 4)],
                           "normalized": round(float(r.normalized), 4)} for r in top.itertuples()],
            "metric": "logit difference logit(correct) - logit(wrong) after the last token; effect = patched - clean "
                      "(per prompt, mean over prompts); normalized = effect / (mean corrupted - mean clean)",
            "patching": "the head's z (hook_z, every position) on the corrupted prompt, into the clean run",
            "interval_rule": "95% percentile bootstrap over prompts (2000 resamples, seeded)",
            "config": asdict(self.config), "seconds": round(self.seconds, 1), "versions": package_versions(),
        }

    def figures(self) -> dict:
        """``patching`` (every head's normalised effect, layer x head) and ``patching_top`` (the
        largest |effects| with 95% intervals)."""
        from headprobe.analyses import figures

        spec, p = self.spec, self.patching
        grid = p.as_grid(self.table["normalized"].to_numpy())
        task = "custom prompts" if self.config.prompts else self.config.task.upper()
        heat = figures.signed_head_heatmap(
            grid, f"{spec.name}: activation patching, {task} ({len(p.clean_ld)} prompts)",
            "normalised effect (1 = all of corrupted − clean)", group_size=spec.group_size)
        top = self.table.reindex(self.table["effect"].abs().sort_values(ascending=False).index).head(12)
        bars = figures.effect_bars([f"{int(r.layer)}.{int(r.head)}" for r in top.itertuples()], top["effect"].to_numpy(),
                                   top[["effect_ci95_lo", "effect_ci95_hi"]].to_numpy().T,
                                   f"{spec.name}: largest patching effects ({task})",
                                   "Δ logit difference (patched − clean)", signs=top["normalized"].to_numpy(),
                                   sign_labels=("normalised effect > 0: toward corrupted (red in patching.png)",
                                                "normalised effect < 0: away from corrupted (blue)"))
        return {"patching": heat, "patching_top": bars}

    def report(self) -> str:
        s = self.summary()
        lines = [f"clean logit difference {s['clean_logit_diff']:+.3f} (95% CI {s['clean_logit_diff_ci95'][0]:+.3f} .. "
                 f"{s['clean_logit_diff_ci95'][1]:+.3f}; correct on {s['clean_correct_share']:.0%} of {s['n_prompts']} prompts), "
                 f"corrupted {s['corrupted_logit_diff']:+.3f}",
                 "largest effects (Δ logit difference, 95% CI, normalised):"]
        for t in s["top_heads"][:8]:
            lines.append(f"  {t['head']:>6}  {t['effect']:+.3f}  [{t['effect_ci95'][0]:+.3f}, {t['effect_ci95'][1]:+.3f}]  "
                         + ("n/a" if "normalized_null_reason" in s else f"{t['normalized']:+.2f}"))
        if "normalized_null_reason" in s:
            lines.append(f"normalised effects n/a: {s['normalized_null_reason']}")
        return "\n".join(lines)

    def save(self, out_dir: str | Path, overwrite: bool = False) -> list[Path]:
        """Write head_patching.csv, the figures and, last, summary.json into ``out_dir``.

        Raises:
            HeadprobeError: ``out_dir`` is a file, not writable, or not empty without ``overwrite``.
        """
        from headprobe.analyses.outputs import write_outputs

        return write_outputs(out_dir, overwrite, summary=self.summary, figures=self.figures(),
                             tables={"head_patching.csv": self.table.to_csv(index=False, float_format="%.5f")})


def run(model, config: PatchConfig, progress: bool = True) -> PatchResult:
    """Patch every head (or ``config.heads``) of the loaded ``model`` on ``config``'s prompt pairs.

    Raises:
        HeadprobeError: bad prompts or heads, a model whose self-check forbids head ablation, or
            logit differences that are NaN or Inf (a float16 overflow).
    """
    import time

    import numpy as np

    from headprobe.analyses.patching import ioi_prompts, patch_heads
    from headprobe.probe.capture import kv_head_of
    from headprobe.probe.heads import parse_heads

    spec = model.spec
    if not spec.causal:
        raise HeadprobeError(f"{spec.name} is an encoder: patching's logit difference needs a language-model head")
    heads = parse_heads(config.heads, spec.n_layers, spec.n_heads) if config.heads else None
    pairs = config.read_pairs() or ioi_prompts(model.tokenizer, config.n_prompts, config.seed)
    t0 = time.perf_counter()
    p = patch_heads(model, pairs, heads, progress=progress)
    dtype = str(model.dtype).removeprefix("torch.")
    if not all(np.isfinite(x).all() for x in (p.clean_ld, p.corrupted_ld, p.patched_ld)):  # as scan and ablate refuse
        raise HeadprobeError(f"the model's logit differences are NaN or Inf in {dtype}"
                             + (" (float16 overflows above 65504: use --dtype bfloat16 or float32)" if dtype == "float16" else ""))
    table = p.table(seed=config.seed)
    table.insert(2, "kv_head", kv_head_of(table["head"].to_numpy(), spec.n_heads, spec.n_kv_heads))
    return PatchResult(config, spec, p, table, seconds=time.perf_counter() - t0,
                       model_info={"device": str(model.device), "dtype": dtype,
                                   "self_check": model.self_check.to_dict()})


def patch(model="smollm2-135m", *, progress: bool = False, **config_fields) -> PatchResult:
    """``headprobe patch`` as a function: ``model`` a name/path (loaded as ``config_fields`` ask) or a
    loaded model; ``config_fields`` the :class:`PatchConfig` fields.

    Raises:
        HeadprobeError: as :func:`run`, or bad settings. TypeError: an unknown field.
    """
    config, loaded, _ = options.config_and_model(PatchConfig, model, config_fields)
    return run(loaded, config, progress=progress)


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = PatchConfig()
    settings.add_flags(p, PatchConfig, group=ModelSettings, helps={"prepend_bos": "do not put BOS in front of the prompts"})
    options.add_output_options(p)
    p.add_argument("--task", choices=TASKS, default=d.task, help="built-in prompt pairs (default %(default)s: indirect-object identification)")
    p.add_argument("--prompts", default=None, metavar="FILE",
                   help="your own pairs instead: JSONL with clean, corrupted, correct, wrong per line")
    p.add_argument("--n-prompts", type=positive_int, default=d.n_prompts, help="IOI prompt pairs (default %(default)s)")
    p.add_argument("--heads", default=None, help="only these heads, e.g. 9.6,9.9 or L9H6 (default: every head)")
    options.add_seed_option(p, d.seed)


def main(args: argparse.Namespace) -> int:
    """``headprobe patch``: flags -> config (the prompts file and --out checked before the model
    loads) -> run -> save -> print (:func:`headprobe.options.run_command`)."""
    def wrote(paths, out):
        return f"\nwrote {len(paths)} files to {out}/ (head_patching.csv, summary.json, figures)"

    return options.run_command(args, settings.from_args(PatchConfig, args), options.Run("headprobe.commands.patch", wrote=wrote))

__all__ = ["HELP", "COMMAND", "PatchConfig", "PatchResult", "run", "patch", "add_arguments", "main"]


COMMAND = Command(HELP, add_arguments, main, api=patch)
"""``headprobe patch``, registered in :data:`headprobe.commands.COMMANDS`."""
