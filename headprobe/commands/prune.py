"""``headprobe prune``: head pruning methods on one curve: Michel et al. 2019's iterative
gradient importance (arXiv 1905.10650, ``michel``: their ``I_h`` l2-normalised per layer by
default, not the unnormalised ``I_h`` that ``ablate`` reports), Voita et al. 2019's L0 head gates (arXiv
1905.09418, ``l0``) and a seeded random order (``random``, one curve per seed, drawn as a band),
each recording the held-out natural-text loss and the in-context loss on repeated random tokens
(``repeated``, the induction task) against the fraction of heads removed; optionally saves a
model with the pruned heads' weights removed.

Data: ``2 n_natural`` disjoint natural-text windows, the first half scores head importance, the
second half is held out for the curve; repeated random tokens give the ``repeated`` loss (the
repeated half, Olsson et al. 2022). Writes ``pruning_curve.csv``, ``summary.json``
(with each curve's area), ``pruning_curve.<format>`` for each of ``--formats``, with
``--per-layer`` ``per_layer.csv`` and its figure, and with ``--save-pruned`` the directory
``pruned_model/`` (a model ``--model DIR`` loads).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

from headprobe import options, settings
from headprobe.analyses.vocabulary import PRUNING_METHODS as METHODS  # the --method choices, torch-free
from headprobe.analyses.vocabulary import PRUNING_ORDERS as ORDERS
from headprobe.commands import Command, lazy_names
from headprobe.options import positive_int
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.core.vocabulary import refuse_lacking
from headprobe.settings import Needs, setting

HELP = "head pruning methods compared (Michel gradient importance, L0 gates, random): one CSV + figure, optional pruned model"

EPILOG = """\
sharded over processes (torch.distributed, gloo on CPU, NCCL with one GPU per process):
  torchrun --nproc-per-node 2 -m headprobe prune --out out/ [flags as above]
  Every rank runs every curve; within each step the gradient importance and the held-out losses
  are data-parallel over the sequences, and --per-layer's head sets are split over the ranks.
  The steps of a curve are sequential and the L0 gates are trained alike on every rank (not
  split). Rank 0 writes the same files as one process and keeps the one checkpoint.
"""

_CORE = ("run", "prune", "PruneResult")
"""Names of :mod:`headprobe.commands.prune_core`, the computation, imported on first use (it needs
torch; this module, the settings and the flags, does not)."""

__all__ = [
    "HELP",
    "COMMAND",
    "EPILOG",
    "METHODS",
    "ORDERS",
    "PRUNED_DIR",
    "PRUNED_FILE",
    "PruneConfig",
    "FLAGS",
    "config_from_args",
    "main",
    *_CORE,
]

__getattr__ = lazy_names(__name__, "headprobe.commands.prune_core", _CORE)


PRUNED_DIR = "pruned_model"
PRUNED_FILE = PRUNED_DIR  # an alias for importers of the output's name


def parse_methods(text: str) -> tuple[str, ...]:
    """``"michel,l0"`` -> ``("michel", "l0")``, in the order given, duplicates dropped.

    Raises:
        HeadprobeError: an unknown or empty method.
    """
    out: list[str] = []
    for m in (x.strip().lower() for x in str(text).split(",")):
        if m not in METHODS:
            raise HeadprobeError(
                f"--method: unknown pruning method {m!r}{did_you_mean(m, METHODS)}; choose from {','.join(METHODS)}"
            )
        if m not in out:
            out.append(m)
    return tuple(out)


def parse_floats(text: str) -> tuple[float, ...]:
    """``"1,3,10"`` -> ``(1.0, 3.0, 10.0)``.

    Raises:
        HeadprobeError: not a comma-separated list of numbers.
    """
    try:
        return tuple(float(x) for x in str(text).split(","))
    except ValueError:
        raise HeadprobeError(f"--l0-lambdas: expected comma-separated numbers, got {text!r}") from None


@dataclass(frozen=True)
class PruneConfig(options.ModelRunConfig):
    """Settings of ``headprobe prune`` (recorded in summary.json's ``config``; the checkpoint's key):
    the shared ones of :class:`~headprobe.options.ModelRunConfig` (``n_natural`` sequences score
    the importance, as many more are held out for the curve; ``seed`` also orders the random
    baseline) and the pruning's own. Invalid values raise
    :class:`~headprobe.probe.core.errors.HeadprobeError` when the config is made.

    Attributes:
        step_fraction: fraction of all heads removed per step, in (0, 1].
        max_fraction: stop once this fraction of heads is removed, in (0, 1].
        rescore: recompute the importance after every step (False: once before pruning, as in the paper).
        normalize: rank by Michel et al.'s ``I_h`` divided by its layer's l2 norm (their section
            4.1; default True); False: by the unnormalised ``I_h``, the score ``ablate``'s
            ``<task>_importance`` columns hold.
        methods: the methods compared, a subset of :data:`METHODS` (a comma-separated string is accepted).
        n_seeds: random orders drawn (seeds ``seed .. seed + n_seeds - 1``), shown as a band (>= 1).
        l0_lambdas: the L0 penalty weights swept, increasing (nats per whole model's heads; see
            :func:`headprobe.analyses.pruning.l0_pruning`).
        l0_steps: Adam steps of the gates per penalty weight (>= 1).
        per_layer: also compute Michel et al.'s per-layer table (each layer reduced to its best head).
        save_pruned: also build the model with the first ``save_fraction`` of heads (in the removal
            order of the first method given, random's first seed for ``random``) removed for real,
            check it against the masked model and save it as a model directory (native backend only).
        save_fraction: fraction of heads removed in that model, in (0, 1].
    """

    methods: tuple[str, ...] | str = setting(
        METHODS,
        "pruning methods to compare, comma-separated: michel (gradient "
        "importance, per-layer l2-normalised unless --no-normalize), l0 (Voita et al. head gates), random (default %(default)s)",
        flag="--method",
        aliases=("--methods",),
        text=",".join,
    )
    n_seeds: int = setting(
        3,
        "random orders drawn, shown as a band (default %(default)s)",
        type=positive_int,
        needs=Needs("methods", ("random",), contains=True),
    )
    l0_lambdas: tuple[float, ...] | str = setting(
        (1.0, 3.0, 10.0, 30.0, 100.0),
        "L0 penalty weights swept, increasing, in nats per whole model's heads (default %(default)s)",
        text=lambda lams: ",".join(f"{x:g}" for x in lams),
        needs=Needs("methods", ("l0",), contains=True),
    )
    l0_steps: int = setting(
        20,
        "Adam steps of the gates per penalty weight (default %(default)s)",
        type=positive_int,
        needs=Needs("methods", ("l0",), contains=True),
    )
    per_layer: bool = setting(
        False,
        "also write per_layer.csv + figure: each layer reduced to its single best head (Michel et al. Table 2)",
        action="store_true",
    )
    step_fraction: float = setting(
        0.1,
        "fraction of all heads removed per step (default %(default)s)",
        type=float,
        needs=Needs("methods", ("michel", "random"), contains=True),
    )
    max_fraction: float = setting(
        1.0,
        "stop after removing this fraction (default %(default)s)",
        type=float,
        needs=Needs("methods", ("michel", "random"), contains=True),
    )
    rescore: bool = setting(
        True,
        "score importance once before pruning (as in the paper) instead of after every step",
        flag="--no-rescore",
        action="store_false",
        needs=Needs("methods", ("michel",), contains=True),
    )
    normalize: bool = setting(
        True,
        "michel: rank by the unnormalised importance I_h (as ablate reports it) instead of I_h "
        "l2-normalised per layer (the default, Michel et al. section 4.1)",
        flag="--no-normalize",
        action="store_false",
        needs=Needs("methods", ("michel",), contains=True),
    )
    save_pruned: bool = setting(
        False,
        "save the model with the first --save-fraction of heads (first method's order) "
        "really removed, as a model directory pruned_model/ that --model DIR loads (native "
        "backend)",
        action="store_true",
    )
    save_fraction: float = setting(
        0.3,
        "fraction of heads removed in the saved model (default %(default)s)",
        type=float,
        needs=Needs("save_pruned", (True,)),
    )

    def __post_init__(self):
        for name in ("step_fraction", "max_fraction", "save_fraction"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise HeadprobeError(f"--{name.replace('_', '-')} must be in (0, 1], got {v}")
        if isinstance(self.methods, str):
            object.__setattr__(self, "methods", parse_methods(self.methods))
        else:
            object.__setattr__(self, "methods", parse_methods(",".join(self.methods)))
        if isinstance(self.l0_lambdas, str):
            object.__setattr__(self, "l0_lambdas", parse_floats(self.l0_lambdas))
        lams = tuple(float(x) for x in self.l0_lambdas)
        object.__setattr__(self, "l0_lambdas", lams)
        if not lams or any(not 0 <= x < math.inf for x in lams) or list(lams) != sorted(lams):
            raise HeadprobeError(
                f"--l0-lambdas must be non-negative and increasing (and finite), got {','.join(map(str, lams))}"
            )
        if self.n_seeds < 1 or self.l0_steps < 1:
            raise HeadprobeError("--n-seeds and --l0-steps must be at least 1")
        super().__post_init__()
        if self.per_layer and self.n_natural < 2:  # a head picked on half the held-out windows, scored on the other
            raise HeadprobeError(f"--per-layer needs --n-natural 2 or more, got {self.n_natural}")
        if self.save_pruned:  # torch-free for the declared backends (BACKEND_CAPABILITIES)
            refuse_lacking(self.backend, "removes_heads", "--save-pruned needs the native backend (--backend native)")
        if self.save_pruned and self.save_fraction > self.max_fraction:  # the removal order stops at max_fraction
            raise HeadprobeError(
                f"--save-fraction {self.save_fraction} is beyond --max-fraction {self.max_fraction}: the removal "
                f"order stops there; give --max-fraction {self.save_fraction} or more, or a smaller --save-fraction"
            )
        if self.save_pruned and self.device_map is not None:  # removing heads rewrites weights that may be offloaded
            raise HeadprobeError("--save-pruned needs the whole model on one device: drop --device-map")

    def preflight(self) -> None:
        """Check, without loading weights, what the settings and files alone decide: the text file, and an
        encoder where its config says so (:func:`headprobe.options.refuse_encoder`; else after the load).

        Raises:
            HeadprobeError: a bad text file, or an encoder."""
        super().preflight()
        options.refuse_encoder(self.model, NEEDS_CAUSAL)


NEEDS_CAUSAL = "prune needs a causal language model (its curves are next-token losses)"
"""Why prune refuses an encoder (:func:`headprobe.options.require_causal`), before the load where the config says so."""

FLAGS = (
    *options.model_run_flags(
        n_natural_help="natural-text sequences for scoring, and as many held out for the curve (default %(default)s)"
    ),
    settings.Flags(
        only=(
            "methods",
            "n_seeds",
            "l0_lambdas",
            "l0_steps",
            "per_layer",
            "step_fraction",
            "max_fraction",
            "rescore",
            "normalize",
            "save_pruned",
            "save_fraction",
        )
    ),
)
"""``headprobe prune``'s flags in ``--help`` order."""


def config_from_args(args: argparse.Namespace) -> PruneConfig:
    """The :class:`PruneConfig` the flags ask for (checks everything the flags alone decide)."""
    return settings.from_args(PruneConfig, args)


def main(args: argparse.Namespace, config: PruneConfig) -> int:
    """``headprobe prune``: the checked config (with --text and --out, before the model loads)
    -> resumable run -> save -> print."""

    def resumed(saved: dict) -> str:
        return (
            ", ".join(
                f"{name}: {len(s['rows']) - 1} steps"
                for name, s in saved.items()
                if isinstance(s, dict) and "rows" in s
            )
            + " done"
        )

    models = (PRUNED_DIR,) if config.save_pruned else ()  # the one model folder a pruning writes, and may replace
    return options.run_command(
        args, config, options.Run("headprobe.commands.prune_core", resumed=resumed, models=models)
    )


COMMAND = Command(
    HELP,
    config=PruneConfig,
    run="headprobe.commands.prune:main",
    flags=FLAGS,
    api="headprobe.commands.prune_core:prune",
    epilog=EPILOG,
)
"""``headprobe prune``, registered in :data:`headprobe.commands.COMMANDS`."""
