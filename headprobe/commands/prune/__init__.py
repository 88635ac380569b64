"""``headprobe prune``: iterative head pruning (Michel et al. 2019, arXiv 1905.10650) against a
random-order baseline, recording the held-out natural-text loss and the induction (in-context)
loss after each step; optionally saves a model with the pruned heads' weights removed.

Data: ``2 n_natural`` disjoint natural-text windows, the first half scores head importance, the
second half is held out for the curve; repeated random tokens give the induction loss (the
repeated half, Olsson et al. 2022). Writes ``pruning_curve.csv``, ``summary.json``,
``pruning_curve.png/pdf`` and, with ``--save-pruned``, ``pruned_model.pt``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from headprobe import options
from headprobe.options import positive_int
from headprobe.probe.errors import HeadprobeError

HELP = "iterative head pruning by gradient importance vs a random order: pruning_curve.csv + figure, optional pruned model"

_CORE = ("run", "prune", "PruneResult")
"""Names of :mod:`headprobe.commands.prune.core`, the computation, imported on first use (it needs
torch; this module, the settings and the flags, does not)."""

__all__ = ["HELP", "ORDERS", "PRUNED_FILE", "PruneConfig", "add_arguments", "config_from_args", "main", *_CORE]


def __getattr__(name: str):
    if name in _CORE:
        from headprobe.commands.prune import core

        return getattr(core, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


ORDERS = ("importance", "random")
PRUNED_FILE = "pruned_model.pt"


@dataclass(frozen=True)
class PruneConfig(options.ModelRunConfig):
    """Settings of ``headprobe prune`` (recorded in summary.json's ``config``; the checkpoint's key):
    the shared ones of :class:`~headprobe.options.ModelRunConfig` (``n_natural`` sequences score
    the importance, as many more are held out for the curve; ``seed`` also orders the random
    baseline) and the pruning's own. Invalid values raise
    :class:`~headprobe.probe.errors.HeadprobeError` when the config is made.

    Attributes:
        step_fraction: fraction of all heads removed per step, in (0, 1].
        max_fraction: stop once this fraction of heads is removed, in (0, 1].
        rescore: recompute the importance after every step (False: once before pruning, as in the paper).
        normalize: per-layer L2 normalisation of the importance (Michel et al. section 4.2).
        save_pruned: also build the model with the first ``save_fraction`` of heads (importance order)
            removed for real, check it against the masked model and save it (native backend only).
        save_fraction: fraction of heads removed in that model, in (0, 1].
    """

    step_fraction: float = 0.1
    max_fraction: float = 1.0
    rescore: bool = True
    normalize: bool = True
    save_pruned: bool = False
    save_fraction: float = 0.3

    def __post_init__(self):
        for name in ("step_fraction", "max_fraction", "save_fraction"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise HeadprobeError(f"--{name.replace('_', '-')} must be in (0, 1], got {v}")
        super().__post_init__()
        if self.save_pruned and self.backend == "transformer-lens":
            raise HeadprobeError("--save-pruned needs the native backend (--backend native)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    options.add_model_run_options(p)
    p.add_argument("--n-natural", type=positive_int, default=8,
                   help="natural-text sequences for scoring, and as many held out for the curve (default %(default)s)")
    p.add_argument("--step-fraction", type=float, default=0.1, help="fraction of all heads removed per step (default %(default)s)")
    p.add_argument("--max-fraction", type=float, default=1.0, help="stop after removing this fraction (default %(default)s)")
    p.add_argument("--no-rescore", dest="rescore", action="store_false",
                   help="score importance once before pruning (as in the paper) instead of after every step")
    p.add_argument("--no-normalize", dest="normalize", action="store_false", help="skip per-layer L2 normalisation of importance")
    p.add_argument("--save-pruned", action="store_true",
                   help="save the model with the first --save-fraction of heads (importance order) really removed (native backend)")
    p.add_argument("--save-fraction", type=float, default=0.3, help="fraction of heads removed in the saved model (default %(default)s)")


def config_from_args(args: argparse.Namespace) -> PruneConfig:
    """The :class:`PruneConfig` the flags ask for (checks everything the flags alone decide)."""
    return PruneConfig(**{f: getattr(args, f) for f in PruneConfig.__dataclass_fields__})


def main(args: argparse.Namespace) -> int:
    """``headprobe prune``: flags -> config (checked with --text and --out before the model loads)
    -> resumable run -> save -> print."""
    return options.main_resumable(args, config_from_args(args), "headprobe.commands.prune.core",
                                  lambda saved: ", ".join(f"{order}: {len(s['rows']) - 1} steps" for order, s in saved.items()) + " done")
