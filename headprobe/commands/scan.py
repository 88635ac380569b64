"""``headprobe scan``: score every head for the classic head types, verify the detections by
ablation against a random-head control, and write a table, a summary and figures.

Pipeline (one model load, a handful of forward passes):

1. natural text -> one forward pass that streams each layer's patterns into the
   previous-token, first-token and positional scores, records each head's mean z (for mean
   ablation) and gives the clean natural-text loss;
2. repeated random tokens -> one forward pass for the duplicate-token and induction scores and
   the clean loss on the repeated half;
3. for each head type, mean- and zero-ablate its top-k heads and layer-matched random control sets
   of k heads, drawn in batches until the verdict at ``--alpha`` is settled, and correct the
   verdicts' p-values for their number: :mod:`headprobe.analyses.verification`;
4. head_scores.csv, summary.json, heatmaps, example patterns and the ablation figure; every head's
   pattern on the first sequence of each token set (patterns.npz, for ``headprobe view``) and,
   with ``--html``, the viewer page index.html.

The settings (:class:`ScanConfig`, whose fields are the flags) and :func:`main` live here and import
no torch, so a bad flag is refused in a fraction of a second; the computation is
:mod:`headprobe.commands.scan_core`, imported on first use (``run``, ``scan``, ``ScanResult``, ...).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, replace

from headprobe import options, settings
from headprobe.analyses import vocabulary as vocab
from headprobe.commands import Command, lazy_names
from headprobe.options import positive_int
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.io import TextFile, open_text_file
from headprobe.probe.core.registry import did_you_mean
from headprobe.settings import OUTPUT, DataSettings, Flags, ModelSettings, Needs, setting

_CORE = (
    "run",
    "scan",
    "run_scan",
    "ScanResult",
    "verify",
    "summary",
    "scan_figures",
    "figure_makers",
    "write_outputs",
    "format_report",
    "verification_settings",
    "scan_metric",
    "metrics_summary",
    "unknown_share",
    "removed_heads",
    "score_token_set",
)
"""Names of :mod:`headprobe.commands.scan_core` (it needs torch), imported on first use."""

__getattr__ = lazy_names(__name__, "headprobe.commands.scan_core", _CORE)


HELP = "find the classic head types in a pretrained model, verify them by ablation, write table and figures"

EPILOG = """\
sharded over processes (torch.distributed, gloo on CPU, NCCL with one GPU per process):
  torchrun --nproc-per-node 2 -m headprobe scan --out out/ [flags as above]
  The verification's ablations (every task's seeded random head sets and the top-k sets) are
  split over the ranks and gathered; the scores, metrics and patterns are computed on every rank
  (a few forward passes). Rank 0 writes the same files as one process. A killed run resumes
  from the checkpoint in --out when started again with the same flags, with torchrun or without.
"""

DEFAULT_SEQ_LEN = vocab.DEFAULT_SEQ_LEN  # natural-text tokens per sequence, unless the model's context is shorter
DEFAULT_PERIOD = vocab.DEFAULT_PERIOD  # repeated block, unless two of them do not fit the context
DEFAULT_K = 10  # heads ablated per type, unless that is more than a quarter of the model's heads
VERIFIED = Needs("verify", (True,))
"""Where the verification's settings act: not with ``--no-verify`` (refused there, :func:`~headprobe.settings.refuse_inert`)."""


STREAMING = ("auto", "on", "off")
"""``--streaming``'s choices (:data:`headprobe.analyses.scoring.STREAMING_CHOICES`, kept torch-free here)."""


@dataclass(frozen=True)
class ScanConfig(ModelSettings, DataSettings):
    """Settings of a scan (all recorded in summary.json's ``config``): the shared
    :class:`~headprobe.settings.ModelSettings` (applied when the model is loaded by name) and
    :class:`~headprobe.settings.DataSettings` composed, and the scan's own. Invalid values raise
    :class:`~headprobe.probe.core.errors.HeadprobeError` when the config is made, before any model loads.

    Attributes:
        seq_len: as :class:`~headprobe.settings.DataSettings`; None (default): 128, or the model's context if shorter.
        period: as :class:`~headprobe.settings.DataSettings`; None (default): 50, or the longest that fits twice,
            ``(n_ctx - 1) // 2``.
        k: heads ablated per type and per random draw (>= 1, below the head count); None: 10, or a quarter of the heads if fewer.
        n_random: the most random control sets of k heads a verdict's test ablates (>= 1); a test stops
            earlier once its outcome at ``alpha`` is settled (:mod:`headprobe.analyses.verification`).
            Raised to what one verdict needs (see ``keep_n_random``) unless ``keep_n_random``.
        alpha: significance level of the verdicts (after ``correction`` over the run's tested
            verdicts), in (0, 1). Fewer than ``1 / alpha - 1`` draws can confirm nothing.
        control: how control sets are drawn: ``layer-matched`` (as many heads per layer as the
            top-k set) or ``uniform`` (any heads outside the task's top-k sets).
        correction: ``bh`` (Benjamini-Hochberg, default) or ``holm`` over the run's tested verdicts.
        sequential: stop each test once settled (False: every test ablates ``n_random`` sets).
        keep_n_random: keep ``n_random`` where it is below the draws one test needs to be
            CONFIRMED on its own under ``correction`` (``m / alpha - 1`` for m tests); by default it
            is raised to that number, and the plan printed before the ablations says so.
        verify: ablate each type's top-k heads against random heads (needs the per-head decomposition's self-check); False scores patterns only.
        types: head types to score, verify and draw (names of :data:`~headprobe.analyses.detectors.DETECTORS`, a tuple
            or a comma-separated string, ``-``/``_`` alike); None: all. Stored as the tuple of registry names.
        pattern_len: every head's pattern on the first ``pattern_len`` tokens of each token set's first
            sequence is kept for the viewer (patterns.npz, uint8, see :mod:`headprobe.analyses.viewer`); 0: none.
        metrics: also compute the reported (not ablation-verified) head metrics of
            :mod:`headprobe.analyses.metrics` (columns ``copying``, ``sink_rate``, ``entropy``,
            ``retrieval``, ``dla``, ``local_<W>``, ``distant_mass``, their heatmaps, and the K-composition figure).
        streaming: ``auto`` (default), ``on`` or ``off``: compute the head statistics streamed from each
            layer's queries and keys, without the ``[head, q_pos, k_pos]`` pattern (:mod:`headprobe.probe.hooks.online_stats`;
            the same numbers; native backend), or from the materialised pattern; ``auto`` streams sequences
            of 1,024 tokens or more on the native backend.
    """

    seq_len: int | None = settings.context_fitted("seq_len")
    period: int | None = settings.context_fitted("period")
    k: int | None = setting(
        None,
        f"heads ablated per type (default {DEFAULT_K}, or a quarter of the heads if fewer)",
        flag="--top-k",
        short="-k",
        type=positive_int,
        needs=VERIFIED,
    )
    n_random: int = setting(
        50,
        "the most random control sets of k heads a verdict's test ablates; it stops earlier once "
        "its outcome at --alpha is settled (default %(default)s, raised to the draws one verdict needs, "
        "m/alpha - 1 for m tested types, e.g. 99 for five at 0.05, unless --keep-n-random)",
        type=positive_int,
        needs=VERIFIED,
    )
    alpha: float = setting(
        vocab.ALPHA,
        "significance level of the verdicts, after --correction (default %(default)s)",
        type=settings.probability,
        needs=VERIFIED,
    )
    control: str = setting(
        "layer-matched",
        "control sets: as many heads per layer as the top-k set (layer-matched), or "
        "any heads (uniform) (default %(default)s)",
        choices=vocab.CONTROLS,
        needs=VERIFIED,
    )
    correction: str = setting(
        vocab.CORRECTION,
        "multiple-testing correction over the run's verdicts: Benjamini-Hochberg "
        "(bh, false discovery rate) or Holm (family-wise error) (default %(default)s)",
        choices=vocab.CORRECTIONS,
        needs=VERIFIED,
    )
    sequential: bool = setting(
        True,
        "ablate --n-random control sets for every test (no early stopping)",
        flag="--fixed-draws",
        action="store_false",
        needs=VERIFIED,
    )
    keep_n_random: bool = setting(
        False,
        "keep --n-random where it is below the draws one verdict needs to be CONFIRMED on "
        "its own under --correction (m/alpha - 1 for m tested types); by default it is raised, "
        "and the plan printed before the ablations says so",
        action="store_true",
        needs=VERIFIED,
    )
    verify: bool = setting(
        True,
        "score patterns only, without the ablation check (also where a model's per-head "
        "decomposition fails its self-check)",
        flag="--no-verify",
        action="store_false",
    )
    types: str | Sequence[str] | None = setting(
        None,
        lambda: (
            f"score, verify and draw only these head types (default: all of {', '.join(vocab.HEAD_TYPES)}; "
            "a decoder skips the encoder-only ones, which read keys after the query: docs/scan.md)"
        ),
        metavar="TYPE[,TYPE...]",
    )
    pattern_len: int = setting(
        vocab.DEFAULT_PATTERN_LEN,
        "keep every head's pattern on the first N tokens of each example "
        "in patterns.npz, for headprobe view (default %(default)s; 0: none)",
        type=int,
        metavar="N",
    )
    metrics: bool = setting(
        True,
        "skip the reported head metrics (copying, sink rate, entropy, retrieval, DLA, composition)",
        flag="--no-metrics",
        action="store_false",
    )
    streaming: str = setting(
        "auto",
        "head statistics streamed from queries and keys without the N x N pattern (on; native "
        "backend), from the pattern (off), or streamed from 1,024 tokens on (auto, the default)",
        choices=STREAMING,
    )

    def __post_init__(self):
        object.__setattr__(self, "types", vocab.select_head_types(self.types))
        super().__post_init__()  # the shared settings' checks (headprobe.settings.check_settings)
        if self.n_random < 1:
            raise HeadprobeError(f"--n-random must be at least 1, got {self.n_random}")
        vocab.check_n_random(self.n_random)
        vocab.check_verification_choices(self.alpha, self.control, self.correction)
        if self.k is not None and self.k < 1:
            raise HeadprobeError(f"--top-k must be at least 1, got {self.k}")
        if self.streaming not in STREAMING:
            raise HeadprobeError(
                f"--streaming must be auto, on or off, got {self.streaming!r}{did_you_mean(str(self.streaming), STREAMING)}"
            )
        if self.pattern_len != 0 and self.pattern_len < 2:
            raise HeadprobeError(f"--pattern-len must be 0 (no patterns.npz) or at least 2, got {self.pattern_len}")

    def preflight(self) -> None:
        """Every check the settings alone decide, before a model loads: the text file, and ``k``, the
        sequence length and the period against the layout and context config.json gives
        (:func:`headprobe.options.peek_config`; else after loading, :meth:`resolved`).

        Raises:
            HeadprobeError: as :meth:`read_text`; ``k`` at least the head count; a sequence longer than the context;
                only encoder-only head types for a model :func:`headprobe.options.peek_encoder` reads as causal.
        """
        from headprobe.analyses.columns import ENCODER_ONLY_TYPES
        from headprobe.probe.backends.sources import canonical_name

        self.read_text()
        assert self.types is not None  # set by __post_init__
        if set(self.types) <= set(ENCODER_ONLY_TYPES) and options.peek_encoder(self.model) is False:
            raise self._encoder_only(canonical_name(self.model))  # torch-free: the registry's records import it
        cfg = options.peek_config(self.model)
        if cfg:
            self._check_layout(cfg["n_layers"] * cfg["n_heads"], cfg["n_ctx"])

    def _check_types(self, causal: bool, name: str) -> tuple[str, ...]:
        """The asked head types that apply to a ``causal`` model (or an encoder), in order.

        Raises:
            HeadprobeError: none applies (encoder-only types for the causal model ``name``)."""
        from headprobe.analyses.columns import DETECTORS

        assert self.types is not None  # set by __post_init__
        if not (types := tuple(t for t in self.types if DETECTORS[t].applies_to(causal))):
            raise self._encoder_only(name)
        return types

    def _encoder_only(self, name: str) -> HeadprobeError:
        """The refusal of only encoder-only head types for the causal model ``name``."""
        assert self.types is not None  # set by __post_init__
        names = ", ".join(self.types).replace("_", "-")
        what = f"head type {names} is" if len(self.types) == 1 else f"head types {names} are"
        return HeadprobeError(f"{what} scored on encoders only (bidirectional attention); {name} is causal")

    def _check_layout(self, n_heads: int, n_ctx: int | None) -> None:
        """The checks of ``seq_len``, ``period`` and ``k`` against a model's context and head count
        (``n_ctx`` None: unknown, not checked)."""
        if n_ctx and self.seq_len is not None and self.seq_len > n_ctx:
            raise HeadprobeError(
                f"--seq-len {self.seq_len} is longer than the model's context ({n_ctx} tokens); "
                f"use --seq-len {n_ctx} or less (longer text is cut into windows)"
            )
        if n_ctx and self.period is not None and 2 * self.period + 1 > n_ctx:
            raise HeadprobeError(
                f"--period {self.period} gives sequences longer than the model's context ({n_ctx} tokens); "
                f"use --period {(n_ctx - 1) // 2} or less"
            )
        if self.k is not None and self.k >= n_heads:
            raise HeadprobeError(
                f"--top-k {self.k} leaves no random control: the model has {n_heads} heads; "
                f"use --top-k {max(1, n_heads // 4)} or so"
            )

    def read_text(self) -> TextFile | None:
        """The natural-text file, checked but read only as the token sets need it (None: the default text).

        Raises:
            HeadprobeError: missing, a directory, unreadable, binary, not UTF-8 or empty.
        """
        return open_text_file(self.text) if self.text else None

    def resolved(self, spec, trained_periods: tuple[int, int, int] | None = None) -> ScanConfig:
        """This config with the model-dependent defaults filled in for ``spec`` (a ModelSpec); the
        encoder-only head types (:attr:`~headprobe.analyses.detectors.Detector.encoder_only`) are
        dropped for a causal model. ``trained_periods``: ``(min, max, eval)`` periods of a model
        ``headprobe train`` made (:attr:`LoadedModel.trained_periods`); when the default period
        falls outside ``[min, max]`` the model never saw repeats that long, and its eval period
        is the default instead.

        Raises:
            HeadprobeError: a sequence longer than the model's context, or k >= the head count.
        """
        n_heads = spec.n_layers * spec.n_heads
        self._check_layout(n_heads, spec.n_ctx)
        from headprobe.analyses.data import fit_lengths

        types = self._check_types(spec.causal, spec.name)
        seq_len, period = fit_lengths(spec.n_ctx, self.seq_len, self.period, trained_periods)
        k = self.k or max(1, min(DEFAULT_K, n_heads // 4))
        return replace(self, types=types, seq_len=seq_len, period=period, k=k)


@dataclass(frozen=True)
class ScanFiles:
    """What ``headprobe scan`` writes beyond the files of its result (not part of :class:`ScanConfig`:
    the same scan may be written with or without them)."""

    html: bool = setting(
        False,
        "also write index.html, the interactive viewer (same as headprobe view OUT afterwards)",
        action="store_true",
    )
    """Write the viewer page index.html too."""


FLAGS = (
    Flags(group=ModelSettings),
    OUTPUT,
    Flags(group=DataSettings),
    Flags(
        only=(
            "k",
            "n_random",
            "alpha",
            "control",
            "correction",
            "keep_n_random",
            "sequential",
            "types",
            "verify",
            "pattern_len",
            "metrics",
            "streaming",
        )
    ),
    Flags(ScanFiles),
)
"""``headprobe scan``'s flags in ``--help`` order."""


def config_from_args(args: argparse.Namespace) -> ScanConfig:
    """The :class:`ScanConfig` the flags ask for (checks everything the flags alone decide)."""
    return settings.from_args(ScanConfig, args)


def main(args: argparse.Namespace, config: ScanConfig) -> int:
    """``headprobe scan``: the checked config (with --text and --out, before the model loads) -> run -> save -> print
    (:func:`headprobe.options.run_command`; torchrun shards the verification over the ranks)."""

    def resumed(saved: dict) -> str:
        return f"{len(saved.get('verification', {}).get('losses', {}))} head sets already ablated"

    return options.run_command(
        args,
        config,
        options.Run(
            "headprobe.commands.scan_core",
            resumed=resumed,
            sharded="verification",
            save={"html": args.html, "progress": True},
        ),
    )


COMMAND = Command(
    HELP,
    config=ScanConfig,
    run="headprobe.commands.scan:main",
    flags=FLAGS,
    api="headprobe.commands.scan_core:scan",
    epilog=EPILOG,
)
"""``headprobe scan``, registered in :data:`headprobe.commands.COMMANDS`."""
