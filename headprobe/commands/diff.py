"""``headprobe diff A B``: the same heads in two models of one layout -- each head's change in every
detector score and in its single-head ablation effect, a paired sign-flip test over sequences per
head, Benjamini-Hochberg over heads, and the heads whose role flipped (docs/robustness.md).

The settings (:class:`DiffConfig`) and :func:`main` import no torch; the computation is
:mod:`headprobe.commands.diff_core`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import MISSING, dataclass
from pathlib import Path

from headprobe import options, settings
from headprobe.analyses import vocabulary as vocab
from headprobe.analyses.columns import refuse_encoder_only
from headprobe.commands import Command, lazy_names
from headprobe.options import positive_int
from headprobe.probe.core.errors import HeadprobeError
from headprobe.settings import OUTPUT, DataSettings, Flags, ModelSettings, context_fitted, setting

__getattr__ = lazy_names(__name__, "headprobe.commands.diff_core", ("run", "diff", "DiffResult"))

HELP = "compare the same heads in two models of one layout: score and ablation changes, paired tests, flipped roles"

REQUANTIZE = ("int8", "int4", "int3")
"""``--requantize-b`` choices (:data:`headprobe.probe.requantize.REQUANTIZE`, repeated here without torch)."""
KINDS = ("zero", "mean", "resample")
"""Single-head ablation kinds of the sweep (:mod:`headprobe.probe.core.ablation_kinds`)."""


def layout_of(model: str) -> tuple[int, int, int | None] | None:
    """``(n_layers, n_heads, n_kv_heads)`` read without loading (:func:`headprobe.options.peek_config`;
    ``n_kv_heads`` from config.json's ``num_key_value_heads``, else the head count, None where
    unknown); None where the layout cannot be read cheaply."""
    cfg = options.peek_config(model)
    if not cfg:
        return None
    kv: int | None = None
    try:
        raw = json.loads((Path(model).expanduser() / "config.json").read_text(encoding="utf-8-sig"))
        kv = raw.get("num_key_value_heads") or raw.get("n_kv_heads") or cfg["n_heads"]
    except (OSError, ValueError, AttributeError):
        kv = None
    return cfg["n_layers"], cfg["n_heads"], kv


def layout_refusal(a: tuple, b: tuple, name_a: str, name_b: str) -> str | None:
    """The one-line refusal when layouts ``(n_layers, n_heads, n_kv_heads)`` differ (None: they agree
    or a part is unknown)."""
    what = ("n_layers", "n_heads", "n_kv_heads")
    bad = [f"{w} {x} vs {y}" for w, x, y in zip(what, a, b) if x is not None and y is not None and x != y]
    return (
        (
            f"{name_a} and {name_b} have different layouts ({', '.join(bad)}): diff compares the same heads of two "
            "models of one layout"
        )
        if bad
        else None
    )


def check_resample_sources(counts: dict[str, int]) -> None:
    """Resample ablation takes each sequence's head outputs from another sequence of the task (the
    batch rolled by one); a task of one sequence has no other.

    Raises:
        HeadprobeError: a task with fewer than 2 sequences (one line naming it and its count)."""
    few = {task: n for task, n in counts.items() if n < 2}
    if few:
        raise HeadprobeError(
            "--kind resample needs at least 2 sequences per task (each is resampled from another); "
            + ", ".join(f"{task} has {n}" for task, n in few.items())
            + ": give more (--n-natural, --n-repeated, a longer --text) or --kind mean"
        )


DEFAULT_SEQUENCES = 16
"""diff's default ``--n-natural`` and ``--n-repeated`` (the shared settings' 8 elsewhere). Over SmolLM2-135M's
270 heads at alpha 0.05 with BH a lone head's change needs p <= 0.05 / 270, which the sign-flip test
reaches from 15 sequences (:func:`headprobe.analyses.robustness.detection_limit`, at seed 0; at 8 a
change passes only with 43 heads changed as much); at 16 also for 33 of seeds 0-39, at 15 for 23."""


@dataclass(frozen=True)
class DiffConfig(ModelSettings, DataSettings):
    """Settings of ``headprobe diff`` (recorded in summary.json's ``config``). ``model`` is A, ``b`` is
    B, both loaded as the shared model settings ask.

    Attributes:
        b: the second model (name or path; may be A itself with ``requantize_b``).
        types: head types compared (None: every causal type).
        k: the top-k set of a type whose membership defines a role (default 10, or a quarter of the heads).
        kind: the single-head ablation kind of the sweeps.
        alpha: level of each head's test after ``correction`` over the heads.
        min_change: effect-size floor of a change that counts (with ``alpha``), in standard deviations of
            that quantity over the heads, pooled over A and B.
        correction: ``bh`` or ``holm`` over the heads, per quantity.
        n_perm: random sign flips per test (above 12 sequences; fewer are enumerated exactly).
        requantize_b: round B's block weights to int8 (per channel) or 4/3 bits (groups of 32) first.
    """

    model: str = setting(MISSING, "model A (name or path)", metavar="A", positional=True, kw_only=True)
    b: str = setting(
        MISSING,
        "model B, of the same layout (may be A with --requantize-b)",
        metavar="B",
        positional=True,
        kw_only=True,
    )
    seq_len: int | None = context_fitted("seq_len")
    n_natural: int = setting(
        DEFAULT_SEQUENCES,
        "natural-text sequences (default %(default)s: below 15 no lone head's change can pass on SmolLM2's 270 heads)",
        type=positive_int,
    )
    n_repeated: int = setting(
        DEFAULT_SEQUENCES, "repeated random sequences (default %(default)s, as --n-natural)", type=positive_int
    )
    period: int | None = context_fitted("period")
    types: str | Sequence[str] | None = setting(None, "head types (default: all causal ones)", metavar="TYPE[,TYPE...]")
    k: int | None = setting(
        None,
        "a type's top-k set defines its role (default 10, or a quarter of the heads)",
        flag="--top-k",
        short="-k",
        type=positive_int,
    )
    kind: str = setting("mean", "single-head ablation kind of the sweeps (default %(default)s)", choices=KINDS)
    alpha: float = setting(
        vocab.ALPHA, "level of each head's test after --correction (default %(default)s)", type=settings.probability
    )
    min_change: float = setting(
        0.5,
        "a change counts when significant and at least this many standard deviations of "
        "the quantity over the heads, A and B pooled (default %(default)s)",
        type=float,
        metavar="SD",
    )
    correction: str = setting(
        vocab.CORRECTION, "correction over the heads, per quantity (default %(default)s)", choices=vocab.CORRECTIONS
    )
    n_perm: int = setting(
        9999, "random sign flips per test above 12 sequences (default %(default)s)", type=positive_int
    )
    requantize_b: str | None = setting(
        None,
        "round B's block weights first: int8 per output channel, int4/int3 per "
        "group of 32 inputs (scale and minimum, as GGUF's Q4_1; default: none)",
        choices=REQUANTIZE,
    )

    def __post_init__(self):
        object.__setattr__(self, "types", vocab.select_head_types(self.types) if self.types is not None else None)
        refuse_encoder_only(self.types, NEEDS_CAUSAL)
        super().__post_init__()
        vocab.check_verification_choices(self.alpha, "layer-matched", self.correction)
        if not 0 <= self.min_change < float("inf"):
            raise HeadprobeError(f"--min-change must be a number >= 0 (standard deviations), got {self.min_change}")
        if self.kind == "resample":
            check_resample_sources({"natural": self.n_natural, "repeated": self.n_repeated})

    def preflight(self) -> None:
        """The text file, an encoder where its config says so (:func:`headprobe.options.peek_encoder`; else
        after the load) and the two layouts as config.json gives them, before loading.

        Raises:
            HeadprobeError: a bad text file, an encoder, or layouts that differ.
        """
        from headprobe.probe.core.io import open_text_file

        if self.text:
            open_text_file(self.text)
        options.check_model(self.b)
        if options.peek_encoder(self.model) or options.peek_encoder(self.b):
            raise HeadprobeError(NEEDS_CAUSAL)
        a, b = layout_of(self.model), layout_of(self.b)
        if a and b and (why := layout_refusal(a, b, self.model, self.b)):
            raise HeadprobeError(why)


NEEDS_CAUSAL = "diff needs two causal language models (its ablation effects are loss effects)"
"""Why diff refuses an encoder as A or B, before the load where a config says so."""

FLAGS = (
    Flags(only=("model", "b")),
    Flags(group=ModelSettings, skip=("model",)),
    OUTPUT,
    Flags(group=DataSettings),
    Flags(only=("types", "k", "kind", "alpha", "min_change", "correction", "n_perm", "requantize_b")),
)
"""``headprobe diff``'s flags in ``--help`` order."""


def main(args: argparse.Namespace, config: DiffConfig) -> int:
    """``headprobe diff``: checked config and --out -> load A and B -> run -> save -> print."""
    return options.run_command(args, config, options.Run("headprobe.commands.diff_core"))


EPILOG = """\
cost: every head's single-head ablation in both models on both tasks (the exact sweep, twice):
  85 minutes for SmolLM2-135M at the defaults (16 x 128 text tokens, 16 repeated sequences), 32-40
  at 16 x 64 text tokens, on one thread of a shared 2-core CPU (docs/robustness.md); fewer or shorter sequences
  (--n-natural, --seq-len, --n-repeated) are faster, --types is not.
"""

COMMAND = Command(
    HELP,
    config=DiffConfig,
    run="headprobe.commands.diff:main",
    flags=FLAGS,
    api="headprobe.commands.diff_core:diff",
    epilog=EPILOG,
)
"""``headprobe diff``, registered in :data:`headprobe.commands.COMMANDS`."""
