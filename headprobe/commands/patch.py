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

``--site q|k|v`` patches a head's query, key or value input instead of its ``z`` (GQA: that query
head alone gets the corrupted k/v), ``--site resid`` the residual stream before each layer at each
of ``--positions``; all pairs run as one padded batch.

Outputs: ``head_patching.csv`` (layer, head, kv_head, effect, its 95% t interval over prompts,
normalised effect, each pair's effect; ``resid_patching.csv`` for ``--site resid``), ``patching.{png,pdf,svg}`` (the normalised effect of every head), ``patching_top``
(the largest effects with their intervals) and ``summary.json`` (written last).

As a library::

    result = headprobe.patch("smollm2-135m", n_prompts=24)   # PatchResult
    result.table                                            # head_patching.csv
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from headprobe import options
from headprobe.analyses.outputs import WritesOutputs
from headprobe.analyses.vocabulary import PATCH_SITES
from headprobe.commands import Command
from headprobe.options import positive_int
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import heads_text, read_heads
from headprobe.probe.core.io import read_text_file, summary_envelope
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.core.reprs import CompactRepr, load_seconds
from headprobe.settings import OUTPUT, DataSettings, Flags, ModelSettings, setting, shared

if TYPE_CHECKING:  # torch-free module: the flags are checked before torch loads
    import pandas as pd

    from headprobe.analyses.patching import PatchingResult
    from headprobe.probe.backends.base import LoadedModel
    from headprobe.probe.layout.spec import ModelSpec

HELP = (
    "activation patching of heads (z, q, k, v) or the residual stream (clean vs corrupted prompt, logit "
    "difference); the IOI task built in"
)

TASKS = ("ioi",)
N_IOI_PROMPTS = 24
"""The IOI pairs ``patch`` builds without ``--n-prompts``."""


@dataclass(frozen=True)
class PatchConfig(ModelSettings):
    """Settings of ``headprobe patch``: the shared :class:`~headprobe.settings.ModelSettings` (how
    the model is loaded, :func:`headprobe.options.load_model`) composed, and the patching's own.

    Attributes:
        task: ``ioi`` (ignored with ``prompts``).
        prompts: a JSONL file of prompt pairs (see the module docstring), instead of the task's.
        n_prompts: IOI pairs to build (>= 2; None: :data:`N_IOI_PROMPTS`; not with ``prompts``).
            seed: draws the IOI names.
        heads: heads to patch, in any form :func:`~headprobe.probe.core.heads.read_heads` takes
            (``"9.6,9.9"``, ``["9.6", "9.9"]``, ``[(9, 6), (9, 9)]``, ``(9, 6)``; stored as the string);
            None: every head (not with ``resid``).
        site: what is patched (:data:`~headprobe.analyses.vocabulary.PATCH_SITES`): ``z`` (a head's
            output), ``q``, ``k``, ``v`` (its query, key or value input; GQA as
            :func:`headprobe.analyses.patching.head_input_hooks` says) or ``resid`` (the residual
            stream entering each layer, at one position at a time).
        positions: ``resid`` only: comma-separated token positions (0 = the first token, BOS;
            negative from the end); None: every position of the shortest prompt.
    """

    task: str = setting(
        "ioi", "built-in prompt pairs (default %(default)s: indirect-object identification)", choices=TASKS
    )
    prompts: str | None = setting(
        None,
        "your own pairs instead: JSONL with clean, corrupted, correct, wrong per line (default: none)",
        metavar="FILE",
    )
    n_prompts: int | None = setting(
        None,
        f"IOI prompt pairs (default {N_IOI_PROMPTS}; not with --prompts, which uses every pair of its file)",
        type=positive_int,
    )
    seed: int = shared(DataSettings, "seed")
    heads: str | tuple[int, int] | Sequence[str | tuple[int, int]] | None = setting(
        None, "only these heads, e.g. 9.6,9.9 or L9H6 (default: every head)"
    )
    site: str = setting(
        "z",
        "what to patch: z (a head's output, default), q/k/v (its query, key or value input; GQA: the "
        "query head alone gets the corrupted k/v) or resid (the residual stream before each layer, "
        "one position at a time)",
        choices=PATCH_SITES,
    )
    positions: str | None = setting(
        None,
        "--site resid: token positions (0 = first, negative from the end; default: every "
        "position of the shortest prompt)",
        metavar="P,P,...",
    )

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "heads", heads_text(self.heads))
        if self.task not in TASKS:
            raise HeadprobeError(
                f"--task must be one of {', '.join(TASKS)}, got {self.task!r}{did_you_mean(str(self.task), TASKS)} (or give --prompts FILE)"
            )
        if self.prompts is not None and self.n_prompts is not None:
            raise HeadprobeError(
                "--n-prompts counts the built-in IOI pairs; --prompts FILE uses every pair of the file "
                "(give fewer lines to use fewer)"
            )
        if self.n_prompts is not None and self.n_prompts < 2:
            raise HeadprobeError(
                f"--n-prompts must be at least 2 (an interval needs two prompts), got {self.n_prompts}"
            )
        if self.site not in PATCH_SITES:
            raise HeadprobeError(
                f"--site must be one of {', '.join(PATCH_SITES)}, got {self.site!r}{did_you_mean(str(self.site), PATCH_SITES)}"
            )
        if self.site == "resid" and self.heads:
            raise HeadprobeError("--heads names heads; --site resid patches layers and positions (use --positions)")
        if self.positions is not None and self.site != "resid":
            raise HeadprobeError(f"--positions is for --site resid, not --site {self.site}")
        self.position_list()

    def position_list(self) -> list[int] | None:
        """``positions`` as integers (None without it).

        Raises:
            HeadprobeError: not a comma-separated list of integers.
        """
        if self.positions is None:
            return None
        try:
            out = [int(x) for x in str(self.positions).split(",")]
        except ValueError:
            raise HeadprobeError(
                f"--positions takes comma-separated integers (e.g. -1,-3,0), got {self.positions!r}"
            ) from None
        return list(dict.fromkeys(out))

    def preflight(self) -> None:
        """Check before a model loads (torch-free): ``prompts`` read and checked, ``heads`` in range and
        each prompt within the model's context where config.json and tokenizer.json can be read
        (:func:`headprobe.options.peek_config`, :func:`headprobe.options.peek_token_count`).

        An encoder is refused here where its config says so (:func:`headprobe.options.peek_encoder`; else after the load).

        Raises:
            HeadprobeError: as :meth:`read_pairs`, an encoder, a head out of range, a prompt longer than the context.
        """
        pairs = self._pair_fields()
        if isinstance(self.model, str) and options.peek_encoder(self.model):
            from headprobe.probe.backends.sources import canonical_name

            raise HeadprobeError(encoder_refusal(canonical_name(self.model)))
        cfg = options.peek_config(self.model)
        if cfg and self.heads:
            options.refuse_removed(read_heads(self.heads, cfg["n_layers"], cfg["n_heads"]), self.model)
        for i, pair in enumerate(pairs or ()):
            for which in ("clean", "corrupted"):
                n = options.peek_token_count(self.model, pair[which], self.prepend_bos)
                if n is None or not cfg or not cfg["n_ctx"]:
                    return
                if n > cfg["n_ctx"]:
                    raise HeadprobeError(
                        f"prompt pair {i + 1}: the {which} prompt is {n} tokens, longer than the model's "
                        f"context of {cfg['n_ctx']} positions"
                    )

    def read_pairs(self):
        """The prompt pairs of ``prompts`` (:class:`headprobe.analyses.patching.PromptPair`; None without it).

        Raises:
            HeadprobeError: unreadable file, a line that is not a JSON object with the four string fields, fewer than 2 pairs.
        """
        if self.prompts is None:
            return None
        from headprobe.analyses.patching import PromptPair

        return [PromptPair(**pair) for pair in self._pair_fields()]

    def _pair_fields(self) -> list[dict] | None:
        """``prompts``' pairs as dicts of the four strings (torch-free; see :meth:`read_pairs`)."""
        if self.prompts is None:
            return None
        pairs, keys = [], ("clean", "corrupted", "correct", "wrong")
        for n, line in enumerate(read_text_file(self.prompts).splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                pairs.append({k: obj[k] for k in keys})
                if not all(isinstance(pairs[-1][k], str) for k in keys):
                    raise TypeError
            except (ValueError, KeyError, TypeError):
                raise HeadprobeError(
                    f"{self.prompts} line {n}: expected a JSON object with string fields clean, corrupted, "
                    f"correct and wrong"
                ) from None
        if len(pairs) < 2:
            raise HeadprobeError(f"{self.prompts} has {len(pairs)} prompt pair(s); patching needs at least 2")
        return pairs


SITE_TEXT = {
    "z": "the head's z (hook_z, every position) on the corrupted prompt, into the clean run",
    "q": "the head's query input (hook_q, every position) on the corrupted prompt, into the clean run",
    "k": "the head's key input (hook_k, every position) on the corrupted prompt, into the clean run; under GQA its KV "
    "head is replaced and the group's other query heads keep their clean z (as if the KV head were expanded into "
    "one copy per query head and only this head's copy patched)",
    "v": "the head's value input (hook_v, every position) on the corrupted prompt, into the clean run; under GQA its KV "
    "head is replaced and the group's other query heads keep their clean z (as if the KV head were expanded into "
    "one copy per query head and only this head's copy patched)",
    "resid": "the residual stream entering the layer (hook_resid_pre) at one position (counted over the prompt's real "
    "tokens, 0 = the first, negative from the end) on the corrupted prompt, into the clean run",
}


@dataclass(repr=False)
class PatchResult(CompactRepr, WritesOutputs):
    """A finished patching run: ``config``, the model's ``spec``, ``patching``
    (:class:`headprobe.analyses.patching.PatchingResult`), ``table`` (head_patching.csv, or
    resid_patching.csv for ``--site resid``), ``seconds`` (the run's) and ``load_s`` (seconds loading the
    model where patch loaded it; None where the caller passed a model it loaded (:func:`~headprobe.probe.core.reprs.load_seconds`))."""

    config: PatchConfig
    spec: ModelSpec
    patching: PatchingResult
    table: pd.DataFrame
    seconds: float = 0.0
    model_info: dict = field(default_factory=dict)
    load_s: float | None = load_seconds()
    notes: list[str] = field(default_factory=list)
    notes_printed: bool = False
    """Whether :func:`run` printed :attr:`notes` before patching (progress on, as the CLI runs it):
    :meth:`report` then does not repeat them; :attr:`notes` and summary.json keep them either way."""

    @property
    def csv_name(self) -> str:
        return "resid_patching.csv" if self.config.site == "resid" else "head_patching.csv"

    def _label(self, r) -> str:
        return f"L{int(r.layer)} pos {int(r.pos)}" if self.config.site == "resid" else f"{int(r.layer)}.{int(r.head)}"

    def _unit(self, r) -> dict:
        """summary.json's name of a row: ``{"head": "23.3"}``, or ``{"layer": 21, "pos": -1}`` (resid)."""
        if self.config.site == "resid":
            return {"layer": int(r.layer), "pos": int(r.pos)}
        return {"head": f"{int(r.layer)}.{int(r.head)}"}

    def _top(self, k: int):
        return self.table.reindex(self.table["effect"].abs().sort_values(ascending=False).index).head(k)

    def summary(self) -> dict:
        """summary.json: model, task, site, prompts, clean and corrupted logit differences (means and,
        95% t intervals), the normaliser, the top units by |effect|, the metric's
        definition, the interval rule, the forward passes taken."""
        from headprobe.analyses.statistics import mean_ci

        p = self.patching
        ci = (lambda x: {"ci95": [round(float(v), 4) for v in mean_ci(x)]}) if p.has_intervals else (lambda x: {})
        key = "top_positions" if self.config.site == "resid" else "top_heads"
        info = dict(self.model_info)
        device, self_check = info.pop("device", None), info.pop("self_check", None)
        return summary_envelope(
            {
                **info,
                "task": "custom prompts" if self.config.prompts else self.config.task,
                "site": self.config.site,
                "n_prompts": int(len(p.clean_ld)),
                "example": asdict(p.pairs[0]) if p.pairs else None,
                "notes": self.notes,
                "clean_logit_diff": round(float(p.clean_ld.mean()), 4),
                **{f"clean_logit_diff_{k}": v for k, v in ci(p.clean_ld).items()},
                "clean_correct_share": round(float((p.clean_ld > 0).mean()), 4),
                "corrupted_logit_diff": round(float(p.corrupted_ld.mean()), 4),
                **{f"corrupted_logit_diff_{k}": v for k, v in ci(p.corrupted_ld).items()},
                "normaliser": round(p.total, 4),
                **(
                    {}
                    if p.total
                    else {
                        "normalized_null_reason": "undefined: the corrupted prompts' mean logit difference "
                        "equals the clean prompts' (normaliser 0), so effect / normaliser is 0/0"
                    }
                ),
                key: [
                    {
                        **self._unit(r),
                        "effect": round(float(r.effect), 4),
                        **(
                            {"effect_ci95": [round(float(r.effect_ci95_lo), 4), round(float(r.effect_ci95_hi), 4)]}
                            if p.has_intervals
                            else {}
                        ),
                        "normalized": round(float(r.normalized), 4),
                    }
                    for r in self._top(10).itertuples()
                ],
                "metric": "logit difference logit(correct) - logit(wrong) after the last token; effect = patched - clean "
                "(per prompt pair: the effect_pair_* columns of the CSV; mean over pairs); "
                "normalized = effect / (mean corrupted - mean clean)",
                "patching": SITE_TEXT[self.config.site],
                "interval_rule": p.interval_note,
                "forward_passes": int(p.n_forward),
            },
            model=self.spec.name,
            precision=self.spec.precision,
            backend=self.spec.backend,
            device=device,
            self_check=self_check,
            config=self.config,
            timings_s={"load_s": self.load_s, "run_s": self.seconds},
        )

    def figures(self) -> dict:
        """``patching`` (every unit's normalised effect, layer x head or layer x position) and
        ``patching_top`` (the largest |effects|, with 95% t intervals over prompts)."""
        import numpy as np

        from headprobe.analyses import figures

        spec, p, site = self.spec, self.patching, self.config.site
        grid = p.as_grid(self.table["normalized"].to_numpy())
        task = "custom prompts" if self.config.prompts else self.config.task.upper()
        heat = figures.patching_heatmap(  # square cells, every label apart
            grid,
            f"{spec.name}: patching {site}, {task} ({len(p.clean_ld)} prompts)",
            "normalised effect (1 = all of corrupted − clean)",
            group_size=spec.group_size,
            positions=p.positions if site == "resid" else None,
        )
        if site == "resid":
            heat.axes[0].set_xlabel("position (token index: 0 = first, −1 = last)")
        top = self._top(12)
        ci = (
            top[["effect_ci95_lo", "effect_ci95_hi"]].to_numpy().T
            if p.has_intervals
            else np.full((2, len(top)), np.nan)
        )
        bars = figures.effect_bars(
            [self._label(r) for r in top.itertuples()],
            top["effect"].to_numpy(),
            ci,
            f"{spec.name}: largest effects, {site} ({task})",
            "Δ logit difference (patched − clean)",
            signs=top["normalized"].to_numpy(),
            sign_labels=(
                "normalised effect > 0: toward corrupted (red in patching.png)",
                "normalised effect < 0: away from corrupted (blue)",
            ),
            ci_label=(
                "whiskers: 95% t interval over prompts"
                if p.has_intervals
                else f"no whiskers: {p.interval_note.removeprefix('none: ')}"
            ),
            label_prefix="" if site == "resid" else "head ",
        )
        return {"patching": heat, "patching_top": bars}

    def report(self) -> str:
        s, p = self.summary(), self.patching
        ci = (
            (lambda k: f" (95% CI {s[k + '_ci95'][0]:+.3f} .. {s[k + '_ci95'][1]:+.3f})")
            if p.has_intervals
            else (lambda k: "")
        )
        lines = [
            f"clean logit difference {s['clean_logit_diff']:+.3f}{ci('clean_logit_diff')}, correct on "
            f"{s['clean_correct_share']:.0%} of {s['n_prompts']} prompts; corrupted {s['corrupted_logit_diff']:+.3f}",
            f"intervals: {p.interval_note}",
            f"largest effects at {self.config.site} (Δ logit difference{', 95% CI' if p.has_intervals else ''}, normalised"
            " = Δ / (corrupted - clean): 1 moves it all the way to the corrupted run's, 0 not at all):",
        ]
        for t in s["top_positions" if self.config.site == "resid" else "top_heads"][:8]:
            ci_text = f"  [{t['effect_ci95'][0]:+.3f}, {t['effect_ci95'][1]:+.3f}]" if "effect_ci95" in t else ""
            name = t["head"] if "head" in t else f"L{t['layer']} pos {t['pos']}"
            lines.append(
                f"  {name:>10}  {t['effect']:+.3f}{ci_text}  "
                + ("n/a" if "normalized_null_reason" in s else f"{t['normalized']:+.2f}")
            )
        if "normalized_null_reason" in s:
            lines.append(f"normalised effects n/a: {s['normalized_null_reason']}")
        return "\n".join([*lines, *(f"NOTE: {n}" for n in ([] if self.notes_printed else self.notes))])

    def outputs(self) -> dict[str, Any]:
        """save's files: head_patching.csv (resid_patching.csv for ``--site resid``), the figures and,
        last, summary.json."""
        return dict(
            summary=self.summary,
            figures=self.figures,
            tables={self.csv_name: self.table.to_csv(index=False, float_format="%.5f")},
        )


def encoder_refusal(name: str) -> str:
    """Patch's one line for an encoder ``name``, before the load (:meth:`PatchConfig.preflight`) and after."""
    return f"{name} is an encoder: patching's logit difference needs a language-model head"


def _pairs_and_units(model: LoadedModel, config: PatchConfig) -> tuple[list, list | None]:
    """The prompt pairs and units (None: :func:`~headprobe.analyses.patching.default_units`) of ``config``.

    Raises:
        HeadprobeError: an encoder, bad prompts or heads.
    """
    from headprobe.analyses.patching import ioi_prompts

    spec = model.spec
    if not spec.causal:
        raise HeadprobeError(encoder_refusal(spec.name))
    units = list(dict.fromkeys(read_heads(config.heads, spec.n_layers, spec.n_heads))) if config.heads else None
    options.refuse_removed(units or [], model)  # a removed head patches to nothing: no finding
    if config.site == "resid" and config.positions is not None:
        units = [
            (layer, pos) for layer in range(spec.n_layers) for pos in config.position_list() or []
        ]  # positions given
    pairs = config.read_pairs() or ioi_prompts(model.tokenizer, config.n_prompts or N_IOI_PROMPTS, config.seed)
    return pairs, units


def memory_plan(model: LoadedModel, config: PatchConfig):
    """:func:`headprobe.analyses.patching.memory_plan` of ``config``'s pairs, site and units on
    ``model`` (a :class:`~headprobe.probe.core.memory.BatchPlan`).

    Raises:
        HeadprobeError: as :func:`run`'s prompts and heads, or a step that does not fit in the memory budget.
    """
    from headprobe.analyses.patching import memory_plan as patching_memory_plan

    pairs, units = _pairs_and_units(model, config)
    return patching_memory_plan(model, pairs, config.site, units)


def batch_line(model: LoadedModel, config: PatchConfig) -> str:
    """The header line of :func:`memory_plan`; refuses, before any output, a step that cannot fit.

    Raises:
        HeadprobeError: as :func:`memory_plan`.
    """
    return memory_plan(model, config).line()


def run(model: LoadedModel, config: PatchConfig, progress: bool = True) -> PatchResult:
    """Patch every head (or ``config.heads``; ``resid``: every layer at each position) of the loaded
    ``model`` at ``config.site`` on ``config``'s prompt pairs, all pairs in one padded batch on the
    native backend.

    Raises:
        HeadprobeError: bad prompts, heads or positions, a site the backend has no hook for, a model
            whose self-check forbids head ablation, a step that does not fit in the memory budget
            (:func:`memory_plan`), or logit differences that are NaN or Inf (a
            float16 overflow).
    """
    import time

    import numpy as np

    from headprobe.analyses.patching import answer_space_notes, patch
    from headprobe.probe.hooks.capture import kv_head_of

    spec = model.spec
    pairs, units = _pairs_and_units(model, config)
    notes = answer_space_notes(model.tokenizer, pairs)  # the tokenizer alone decides: said before the run
    if progress:
        _say_notes(notes)
    t0 = time.perf_counter()
    p = patch(model, pairs, config.site, units, progress=progress)
    dtype = str(model.dtype).removeprefix("torch.")
    if not all(np.isfinite(x).all() for x in (p.clean_ld, p.corrupted_ld, p.patched_ld)):  # as scan and ablate refuse
        raise HeadprobeError(
            f"the model's logit differences are NaN or Inf in {dtype}"
            + (" (float16 overflows above 65504: use --dtype bfloat16 or float32)" if dtype == "float16" else "")
        )
    table = p.table(seed=config.seed)
    if config.site != "resid":
        table.insert(2, "kv_head", kv_head_of(table["head"].to_numpy(), spec.n_heads, spec.n_kv_heads))
    return PatchResult(
        config,
        spec,
        p,
        table,
        seconds=time.perf_counter() - t0,
        model_info={"device": str(model.device), "dtype": dtype, "self_check": model.self_check.to_dict()},
        notes=notes,
        notes_printed=progress and bool(notes),
    )


def _say_notes(notes: list[str]) -> None:
    """``NOTE:`` lines printed before the patching run, under the model's header and batch line (as
    the NOTE :func:`~headprobe.options.run_command` prints before the load); the report does not repeat them
    (:attr:`PatchResult.notes_printed`)."""
    for note in notes:
        print(f"NOTE: {note}", flush=True)


patch = options.command_function(
    PatchConfig,
    run,
    "patch",
    "Per-head activation patching from a corrupted into a clean prompt, scored by a logit difference",
    '``n_prompts=24``, ``site="v"``',
)
"""``headprobe patch`` as a function: :func:`headprobe.options.command_function` over :func:`run`."""


FLAGS = (
    Flags(group=ModelSettings, helps={"prepend_bos": "do not put BOS in front of the prompts"}),
    OUTPUT,
    Flags(only=("task", "prompts", "n_prompts", "heads", "site", "positions", "seed")),
)
"""``--help``'s blocks: the model's flags, the output's, the command's own."""


def main(args: argparse.Namespace, config: PatchConfig) -> int:
    """``headprobe patch``: config (the prompts file and --out checked before the model loads) ->
    run -> save -> print (:func:`headprobe.options.run_command`)."""

    return options.run_command(args, config, options.Run("headprobe.commands.patch"))


__all__ = ["HELP", "COMMAND", "PatchConfig", "PatchResult", "memory_plan", "batch_line", "run", "patch", "main"]


COMMAND = Command(HELP, config=PatchConfig, run="headprobe.commands.patch:main", flags=FLAGS, api=patch)
"""``headprobe patch``, registered in :data:`headprobe.commands.COMMANDS`."""
