"""``headprobe robustness``: each head type's top-k set and verdict under several conditions --
disjoint data, other ablation kinds, other control draws and, where one exists, another detector --
and how stable each head's label is across them (docs/robustness.md).

The settings (:class:`RobustnessConfig`, whose fields are the flags) and :func:`main` import no
torch; the computation is :mod:`headprobe.commands.robustness_core`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from headprobe import options, settings
from headprobe.analyses import vocabulary as vocab
from headprobe.analyses.columns import refuse_encoder_only
from headprobe.commands import Command, lazy_names
from headprobe.options import positive_int
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.settings import OUTPUT, DataSettings, Flags, ModelSettings, Needs, context_fitted, setting

__getattr__ = lazy_names(
    __name__, "headprobe.commands.robustness_core", ("run", "robustness", "RobustnessResult", "Condition", "conditions")
)

HELP = "how stable each head type's top-k heads and verdict are across data splits, ablation kinds, seeds and detectors"

GROUPS = ("data", "kind", "seed", "detector")
"""The condition groups (``--vary``): disjoint data, ablation kinds, control-draw seeds, another detector."""
DEFAULT_TYPES = ("induction", "positional")
"""The head types checked unless ``--types`` says otherwise."""
DEFAULT_K = 10
"""Heads per top-k set, unless that is more than a quarter of the heads (scan's rule)."""


def _names(value: str | Sequence[str], allowed: Sequence[str], flag: str) -> tuple[str, ...]:
    """A comma-separated string or a sequence -> a tuple of names from ``allowed``; refused otherwise."""
    names = tuple(v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip())
    bad = [n for n in names if n not in allowed]
    if bad or not names:
        hint = did_you_mean(bad[0], allowed) if bad else ""
        raise HeadprobeError(f"{flag} takes names from {','.join(allowed)}, got {','.join(bad) or 'nothing'}{hint}")
    return names


@dataclass(frozen=True)
class RobustnessConfig(ModelSettings, DataSettings):
    """Settings of ``headprobe robustness`` (recorded in summary.json's ``config``): the shared model
    and data settings (``n_natural`` windows are the base split, as many more the disjoint other
    half) and the conditions' own.

    Attributes:
        types: head types (:data:`~headprobe.analyses.detectors.DETECTORS`), comma-separated or a tuple.
        k: heads per top-k set (None: 10, or a quarter of the heads if fewer).
        n_random, alpha, control, correction: the verification's, as ``headprobe scan``'s.
        vary: condition groups (:data:`GROUPS`).
        kinds: ablation kinds whose verdicts are compared (the base is ``mean``).
        control_seeds: extra seeds of the control draws (seed+1 ... seed+N).
        other_period: the repeated block's length in the data group's other-period condition
            (None: :meth:`resolved_other_period`, never ``period``).
        n_boot: bootstrap resamples of each stability interval.
    """

    seq_len: int | None = context_fitted("seq_len")
    period: int | None = context_fitted("period")
    types: str | Sequence[str] = setting(
        ",".join(DEFAULT_TYPES), "head types (default %(default)s)", metavar="TYPE[,TYPE...]"
    )
    k: int | None = setting(
        None,
        f"heads per top-k set (default {DEFAULT_K}, or a quarter of the heads if fewer)",
        flag="--top-k",
        short="-k",
        type=positive_int,
    )
    n_random: int = setting(50, "the most control sets per verdict, as scan's (default %(default)s)", type=positive_int)
    alpha: float = setting(
        vocab.ALPHA, "significance level of the verdicts (default %(default)s)", type=settings.probability
    )
    control: str = setting("layer-matched", "control sets (default %(default)s)", choices=vocab.CONTROLS)
    correction: str = setting(
        vocab.CORRECTION, "correction over each condition's verdicts (default %(default)s)", choices=vocab.CORRECTIONS
    )
    vary: str | Sequence[str] = setting(
        ",".join(GROUPS),
        "condition groups: data (disjoint text half, repeated "
        "tokens at another seed and period), kind (ablation kinds), seed (control "
        "draws), detector (induction by the OV copying score) (default %(default)s)",
        metavar="GROUP[,GROUP...]",
    )
    kinds: str | Sequence[str] = setting(
        "zero,resample",
        "ablation kinds besides mean whose verdicts are compared (default %(default)s)",
        metavar="KIND[,KIND...]",
        needs=Needs("vary", ("kind",), contains=True),
    )
    control_seeds: int = setting(
        2,
        "extra seeds of the control draws (default %(default)s)",
        type=int,
        metavar="N",
        needs=Needs("vary", ("seed",), contains=True),
    )
    other_period: int | None = setting(
        None,
        "repeated block length of the other-period condition (default: 3/5 of --period, at least 4; where "
        "that is --period or does not fit the context, the longest shorter one, at least 3, that does)",
        type=positive_int,
        needs=Needs("vary", ("data",), contains=True),
    )
    n_boot: int = setting(
        2000, "bootstrap resamples of each stability interval (default %(default)s)", type=positive_int
    )

    def __post_init__(self):
        object.__setattr__(self, "types", vocab.select_head_types(self.types))
        refuse_encoder_only(self.types, NEEDS_CAUSAL)
        object.__setattr__(self, "vary", _names(self.vary, GROUPS, "--vary"))
        from headprobe.probe.core import ablation_kinds

        object.__setattr__(self, "kinds", _names(self.kinds, ablation_kinds.names(), "--kinds"))
        super().__post_init__()
        vocab.check_verification_choices(self.alpha, self.control, self.correction)
        vocab.check_n_random(self.n_random)
        if self.control_seeds < 0:
            raise HeadprobeError(f"--control-seeds must be 0 or more, got {self.control_seeds}")
        if self.other_period is not None and self.other_period < 2:
            raise HeadprobeError(f"--other-period must be at least 2, got {self.other_period}")
        # the same period and seed draw the base's own sequences: a condition that cannot differ from it
        if "data" in self.vary and self.other_period is not None and self.other_period == self.period:
            raise HeadprobeError(
                f"--other-period {self.other_period} is --period {self.period}: the other-period condition "
                "would repeat the base sequences; give another --other-period"
            )

    def resolved_other_period(self, n_ctx: int | None = None) -> int:
        """The other-period condition's block length (tokens): ``--other-period``; else 3/5 of
        ``--period``, at least 4, or where that is ``--period`` itself or its sequences (``[BOS] + 2``
        blocks) pass the context ``n_ctx`` (None: not checked), the longest shorter block of at least
        :data:`~headprobe.analyses.vocabulary.MIN_PERIOD` (3) tokens that is neither (``--period 4``: 3).
        ``period`` must be set (given, or :func:`~headprobe.commands.robustness_core.resolved`).

        Raises:
            HeadprobeError: no such block (one line)."""
        assert self.period is not None
        if self.other_period:
            return self.other_period
        default = max(4, 3 * self.period // 5)
        for p in range(default, vocab.MIN_PERIOD - 1, -1):
            if p != self.period and (not n_ctx or 2 * p + 1 <= n_ctx):
                return p
        raise HeadprobeError(
            f"no default other period beside --period {self.period}: a block of {vocab.MIN_PERIOD} to {default} "
            f"tokens other than {self.period} does not fit the model's context ({n_ctx} tokens) twice; "
            "give --other-period or leave data out of --vary"
        )

    def check_other_period(self, n_ctx: int | None) -> None:
        """Refuse an ``other_period`` whose sequences (``[BOS] + 2 x other_period`` tokens) are longer
        than the model's context ``n_ctx`` (None: unknown, not checked), as ``--period``'s are.

        Raises:
            HeadprobeError: one line naming the longest that fits."""
        if n_ctx and "data" in self.vary and self.other_period is not None and 2 * self.other_period + 1 > n_ctx:
            raise HeadprobeError(
                f"--other-period {self.other_period} gives sequences longer than the model's context "
                f"({n_ctx} tokens): use --other-period {(n_ctx - 1) // 2} or less"
            )

    def preflight(self) -> None:
        """The text file, an encoder where its config says so (:func:`headprobe.options.refuse_encoder`;
        else after the load) and ``k`` against the head count config.json gives, before loading.

        Raises:
            HeadprobeError: a bad text file, an encoder, k at least the head count, or an --other-period
                longer than the context (:meth:`check_other_period`).
        """
        from headprobe.probe.core.io import open_text_file

        if self.text:
            open_text_file(self.text)
        options.refuse_encoder(self.model, NEEDS_CAUSAL, hint=None)
        cfg = options.peek_config(self.model)
        if cfg:
            self.check_other_period(cfg.get("n_ctx"))
        if cfg and self.k is not None and self.k >= cfg["n_layers"] * cfg["n_heads"]:
            raise HeadprobeError(
                f"--top-k {self.k} leaves no control heads: the model has {cfg['n_layers'] * cfg['n_heads']} heads"
            )


NEEDS_CAUSAL = "robustness needs a causal language model (its verdicts are loss effects)"
"""Why robustness refuses an encoder (:func:`headprobe.options.require_causal`), before the load where the config says so."""

FLAGS = (
    Flags(group=ModelSettings),
    OUTPUT,
    Flags(group=DataSettings),
    Flags(
        only=(
            "types",
            "k",
            "n_random",
            "alpha",
            "control",
            "correction",
            "vary",
            "kinds",
            "control_seeds",
            "other_period",
            "n_boot",
        )
    ),
)
"""``headprobe robustness``'s flags in ``--help`` order."""


def main(args: argparse.Namespace, config: RobustnessConfig) -> int:
    """``headprobe robustness``: checked config -> load -> run -> save -> print (:func:`headprobe.options.run_command`)."""
    return options.run_command(args, config, options.Run("headprobe.commands.robustness_core"))


COMMAND = Command(
    HELP,
    config=RobustnessConfig,
    run="headprobe.commands.robustness:main",
    flags=FLAGS,
    api="headprobe.commands.robustness_core:robustness",
)
"""``headprobe robustness``, registered in :data:`headprobe.commands.COMMANDS`."""
