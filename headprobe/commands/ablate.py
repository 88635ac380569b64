"""``headprobe ablate``: every head's exact single-head ablation effect on natural text and on the
in-context task on repeated random tokens (``repeated``, the induction task), with Michel et al.'s gradient importance (their ``I_h``,
unnormalised: not the per-layer l2-normalised score ``prune`` ranks by) and attribution patching
beside it, written as a CSV, a summary and heatmaps.

Tasks (losses in nats/token):

* ``natural``: every next-token prediction on held-out windows of natural text;
* ``repeated``: the repeated half of ``[BOS] r_1..r_S r_1..r_S`` random tokens (predictions of
  r_2..r_S of the repeat), which only in-context copying can get right (Olsson et al. 2022).

The exact sweep is :func:`headprobe.analyses.ablation.exact_sweep` (fast on the native model); the
gradient scores come from one forward and one backward pass per task
(:func:`headprobe.analyses.ablation.head_importance`). With ``--estimate atp|attribution|gradient``
there is no sweep: AtP* (:func:`headprobe.analyses.attribution.atp_star`), attribution patching or
the gradient importance is written instead, labelled as an estimate.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from headprobe import options, settings
from headprobe.analyses.vocabulary import ESTIMATORS as ESTIMATES  # the --estimate choices, torch-free
from headprobe.analyses.vocabulary import TASKS  # ("natural", "repeated"): the tasks, named as scan names them
from headprobe.commands import Command, lazy_names
from headprobe.options import positive_int
from headprobe.probe.core import ablation_kinds
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import Head, all_heads, check_head_layers, heads_text, parse_heads
from headprobe.probe.core.registry import did_you_mean
from headprobe.settings import Needs, setting

HELP = "exact single-head ablation effect of every head (natural text, repeated tokens), gradient importance, CSV + heatmaps"

EPILOG = """\
sharded over processes (torch.distributed, gloo on CPU, NCCL with one GPU per process):
  torchrun --nproc-per-node 2 -m headprobe ablate --out out/ [flags as above]
  Each rank sweeps its share of the heads and of the gradient batch; rank 0 writes the same
  files as one process. Killed? Run the same command again: each rank keeps its own checkpoint
  in --out (.headprobe-checkpoint.shard-R-of-N.json) and only missing head ablations are redone.
"""

_CORE = ("run", "ablate", "AblateResult", "TaskResult", "checkpointed_sweep", "CHUNK_LAYERS", "TOP_N")
"""Names of :mod:`headprobe.commands.ablate_core`, the computation, imported on first use (it needs
torch; this module, the settings and the flags, does not)."""

__all__ = [
    "HELP",
    "COMMAND",
    "EPILOG",
    "TASKS",
    "ESTIMATES",
    "AblateConfig",
    "FLAGS",
    "config_from_args",
    "main",
    *_CORE,
]

__getattr__ = lazy_names(__name__, "headprobe.commands.ablate_core", _CORE)


def _kind_help() -> str:
    """``--kind``'s help, from the kinds registered when the parser is made."""
    kinds = ", ".join(f"{k.name} ({k.help})" for k in ablation_kinds.kinds())
    return (
        f"how an ablated head's z is replaced: {kinds}; the reference tokens are other natural-text windows, the "
        "other input one of the same task (default %(default)s)"
    )


@dataclass(frozen=True)
class AblateConfig(options.ModelRunConfig):
    """Settings of ``headprobe ablate`` (recorded in summary.json's ``config``; the checkpoint's key):
    the shared ones of :class:`~headprobe.options.ModelRunConfig` (``n_natural`` sequences are
    ablated, as many more, disjoint, are the mean/resample reference; the resample source uses
    ``seed + 1``) and the sweep's own. Invalid values raise
    :class:`~headprobe.probe.core.errors.HeadprobeError` when the config is made.

    Attributes:
        kind: ablation kind, a name in :data:`headprobe.probe.core.ablation_kinds.KINDS` (zero, mean, resample).
        heads: heads to sweep, in any form :func:`~headprobe.probe.core.heads.read_heads` takes
            (``"5.1,7.3"``, ``["5.1", "7.3"]``, ``[(5, 1), (7, 3)]``, ``(5, 1)``; stored as the string); None: all.
        max_batch: most sequences per forward pass in the sweep and its gradient scores (>= 1); None: as
            many as the memory budget holds (:func:`headprobe.analyses.ablation.sweep_plan`).
        estimate: None: the exact sweep; one of :data:`ESTIMATES`: that gradient estimate of every head's
            effect instead, with no sweep (for models where the sweep is too slow; labelled as an estimate).
        n_probes: sampled-target probes of ``estimate="second-order"`` (>= 1; ignored otherwise).
    """

    kind: str = setting(
        "zero",
        lambda: _kind_help(),
        choices=ablation_kinds.names,
        needs=Needs("estimate", (None, "atp", "attribution", "second-order")),  # gradient: unsigned, no replacement
    )
    heads: str | tuple[int, int] | Sequence[str | tuple[int, int]] | None = setting(
        None, "sweep only these heads, as layer.head, comma-separated (e.g. 5.1,17.3; L5H1 also accepted); default: all"
    )
    max_batch: int | None = setting(
        None,
        "most sequences per forward pass in the sweep and its gradient scores (default: as many as the memory "
        "budget holds, see --memory-budget; the header prints the choice)",
        type=positive_int,
        needs=Needs("estimate", (None,)),
    )
    estimate: str | None = setting(
        None,
        "no sweep: write a gradient estimate of each head's effect instead (atp: AtP* with "
        "GradDrop, ~n_layers+2 forward passes; attribution: attribution patching, ~3; gradient: "
        "Michel et al.'s unsigned importance I_h, unnormalised, ~3; second-order: attribution patching plus a "
        "sampled Gauss-Newton curvature term, ~3+2*n_probes; default: none, the exact sweep)",
        choices=ESTIMATES,
    )
    n_probes: int = setting(
        8,
        "sampled-target backward passes of --estimate second-order (default %(default)s)",
        type=positive_int,
        needs=Needs("estimate", ("second-order",)),
    )

    def __post_init__(self):
        super().__post_init__()
        ablation_kinds.KINDS.get(self.kind)
        if self.max_batch is not None and self.max_batch < 1:
            raise HeadprobeError(f"--max-batch must be at least 1, got {self.max_batch}")
        if self.estimate is not None and self.estimate not in ESTIMATES:
            raise HeadprobeError(
                f"--estimate {self.estimate!r} is not one of {', '.join(ESTIMATES)}{did_you_mean(str(self.estimate), ESTIMATES)}"
            )
        if self.n_probes < 1:
            raise HeadprobeError(f"--n-probes must be at least 1, got {self.n_probes}")
        object.__setattr__(self, "heads", heads_text(self.heads))

    def head_list(self, n_layers: int, n_heads: int, head_layers: Sequence[int] | None = None) -> list[Head]:
        """The heads to sweep in a model of ``n_layers x n_heads`` whose layers ``head_layers`` have
        heads (None: every layer; a hybrid's linear-attention layers have none); a head named twice once.

        Raises:
            HeadprobeError: a head out of range (one line naming the model's layout), or in a layer without heads.
        """
        if not self.heads:
            heads = all_heads(n_layers, n_heads)
        else:
            assert isinstance(self.heads, str)  # stored as the string by __post_init__
            # a head named twice (0.1,0.1 or 0.1,L0H1) is swept once, as patch does
            heads = list(dict.fromkeys(parse_heads(self.heads, n_layers, n_heads)))
            check_head_layers(heads, head_layers)
        return [h for h in heads if head_layers is None or h[0] in head_layers]

    def preflight(self) -> None:
        """Check, without loading weights, what the settings and files alone decide: the text file, an
        encoder where its config says so (:func:`headprobe.options.refuse_encoder`; else after the load), and
        the heads' range where the model's layout can be read cheaply (:func:`headprobe.options.peek_layout`).

        Raises:
            HeadprobeError: a bad text file, an encoder or a head out of range.
        """
        super().preflight()
        options.refuse_encoder(self.model, NEEDS_CAUSAL)
        layout = options.peek_layout(self.model)
        if layout and self.heads:
            self.head_list(*layout)


NEEDS_CAUSAL = "ablate needs a causal language model (its effects are next-token loss effects)"
"""Why ablate refuses an encoder (:func:`headprobe.options.require_causal`), before the load where the config says so."""

FLAGS = (*options.model_run_flags(), settings.Flags(only=("kind", "heads", "max_batch", "estimate", "n_probes")))
"""``headprobe ablate``'s flags in ``--help`` order."""


def config_from_args(args: argparse.Namespace) -> AblateConfig:
    """The :class:`AblateConfig` the flags ask for (checks everything the flags alone decide)."""
    return settings.from_args(AblateConfig, args)


def main(args: argparse.Namespace, config: AblateConfig) -> int:
    """``headprobe ablate``: the checked config (with --text, --heads and --out, before the
    model loads) -> resumable run -> save -> print."""

    def resumed(saved: dict) -> str:
        return f"{sum(len(t.get('seq', {})) for t in saved.values())} head ablations done"

    return options.run_command(args, config, options.Run("headprobe.commands.ablate_core", resumed=resumed))


COMMAND = Command(
    HELP,
    config=AblateConfig,
    run="headprobe.commands.ablate:main",
    flags=FLAGS,
    api="headprobe.commands.ablate_core:ablate",
    epilog=EPILOG,
)
"""``headprobe ablate``, registered in :data:`headprobe.commands.COMMANDS`."""
