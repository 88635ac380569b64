"""``headprobe kv``: a head-level KV-cache policy, chosen from the heads and measured causally.

Each KV group (the unit that owns cache: a key/value head, or an MLA layer's latent) either keeps
a full cache or becomes *streaming*: its query heads read only the first ``--sink`` keys and the
last ``--window`` (StreamingLLM, arXiv:2309.17453; DuoAttention, arXiv:2410.10819, keeps full
caches only for its "retrieval heads"). The command

1. measures the full model on natural text and on the long-range retrieval task (a random block
   planted early in natural text and repeated at the end, at ``--distances``): the loss in
   nats/token and the repeat's top-1 copy accuracy;
2. scores each group's cost of streaming: ``--method retrieval`` (default; the attention its heads
   put on the planted block's first occurrence from the repeat, and outside the sink and window on
   natural text), ``estimate`` (the attention mass outside the sink and the window) or
   ``measured`` (the model with only that group streaming, one forward pass per group);
3. keeps the highest-cost groups full within ``--kv-budget`` (a fraction of the full cache) or,
   with ``--loss-tolerance``, the fewest whose natural-text loss increase stays within it (a
   binary search, each step measured exactly);
4. measures the chosen policy exactly (attention masked per KV group) against the same window on
   every group and random groups at the same memory (``--n-random`` seeds), for ``--budgets``,
   each number with a paired 95% interval (a block bootstrap over the natural text's tokens, a t
   interval over the long-range sequences; a comparison within the noise is not called a win).

Outputs: ``policy.json`` (format in docs/kv.md; ``headprobe budget --policy`` reads it),
``policy_budget.json`` (its KV bytes, FLOPs and attention bytes), ``group_costs.csv``,
``curve.csv``, ``kv_curve.{png,pdf,svg}`` and ``summary.json`` (last).

As a library::

    result = headprobe.kv("smollm2-135m", seq_len=1024, kv_budget=0.5)   # KVResult
    result.policy, result.curve   # curve: curve.csv as a pandas DataFrame
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from headprobe import options
from headprobe.commands import Command, lazy_names
from headprobe.options import positive_int
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.core.vocabulary import refuse_lacking
from headprobe.settings import (
    DEFAULT_BLOCK_LEN,
    OUTPUT,
    DataSettings,
    Flags,
    ModelSettings,
    Needs,
    long_range_floor,
    setting,
    shared,
)

_CORE = ("KVResult", "run", "kv")
"""Names of :mod:`headprobe.commands.kv_core` (the run: torch), imported on first use."""

__all__ = ["HELP", "COMMAND", "KVConfig", "FLAGS", "main", *_CORE]

__getattr__ = lazy_names(__name__, "headprobe.commands.kv_core", _CORE)

HELP = "head-level KV-cache policy: which KV groups keep a full cache, measured causally against uniform and random"

METHODS = ("estimate", "retrieval", "measured")
DEFAULT_BUDGETS = (0.25, 0.5, 0.75)
DEFAULT_KV_BUDGET = 0.5
"""``--kv-budget`` where neither it nor ``--loss-tolerance`` is given."""


def _fractions(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated fractions such as 0.25,0.5,0.75, got {text!r}"
        ) from None
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"budgets are fractions in (0, 1], got {text!r}")
    return values


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts such as 128,512, got {text!r}"
        ) from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"distances are positive token counts, got {text!r}")
    return values


def check_context(seq_len: int, n_ctx: int) -> None:
    """Refuse ``--seq-len`` beyond the model's context of ``n_ctx`` positions.

    Raises:
        HeadprobeError: ``seq_len > n_ctx``.
    """
    if seq_len > n_ctx:
        raise HeadprobeError(f"--seq-len {seq_len} is longer than the model's context ({n_ctx} tokens)")


@dataclass(frozen=True)
class KVConfig(ModelSettings):
    """Settings of ``headprobe kv``: the shared :class:`~headprobe.settings.ModelSettings` (how the
    model is loaded, :func:`headprobe.options.load_model`) composed, the natural-text settings of
    :class:`~headprobe.settings.DataSettings` it uses (``text``, ``seq_len``, ``n_natural``,
    ``seed``, declared there: :func:`~headprobe.settings.shared`; it has no repeated-token set), and
    its own. Every field's help is its flag's.

    Attributes:
        model: model name or path (the native backend: policies mask its attention per KV group).
        device_map, max_memory: refused (not ``--device-map``: the per-group masks and the
            streaming cache are checked on one device only); ``prepend_bos``: ``--no-bos``, as scan's.
        text: a UTF-8 file instead of CPython's pydoc_data.topics.
        seq_len: tokens per sequence of both tasks (natural text and long-range). n_natural: natural-text windows.
        distances: long-range task: tokens from the planted block to its repeat (None: 1/4, 1/2,
            3/4 of the room and the farthest whose first block starts after the sink). block_len: the planted block's tokens.
        n_per_distance: long-range sequences per distance.
        sink: attention-sink positions a streaming group keeps. window: recent positions it keeps
            (None: ``seq_len // 8``).
        kv_budget: the chosen policy's KV cache as a fraction of the full one; None: 0.5
            (:data:`DEFAULT_KV_BUDGET`) without loss_tolerance, and stays None with it, so summary.json's
            ``config`` records the one of the two exclusive flags given (a command rebuilt from it parses).
        loss_tolerance: instead of a budget, the most natural-text loss increase (nats/token) allowed.
        budgets: KV fractions of the quality-memory curve (kv_budget is added).
        method: ``estimate`` (attention mass outside sink + window), ``retrieval`` (attention on the
            planted block from its repeat; max over a group's heads) or ``measured`` (one group streaming at a time).
        n_random: random policies per budget (seeds seed .. seed + n_random - 1).
        seed: seeds the natural-text windows and the random policies; ``seed + 1`` seeds the
            long-range task (its text windows and planted blocks, :func:`~headprobe.analyses.data.long_range_tokens`).
    """

    text: str | None = shared(DataSettings, "text")
    seq_len: int = shared(DataSettings, "seq_len", 1024)
    n_natural: int = shared(DataSettings, "n_natural", 1)
    distances: tuple[int, ...] | None = setting(
        None,
        "long-range task: tokens from the planted block to its repeat (default: the farthest whose first "
        "block starts after the sink, seq-len - block-len - max(sink, 1), and 1/4, 1/2, 3/4 of it)",
        type=_ints,
        metavar="D,...",
    )
    block_len: int = setting(DEFAULT_BLOCK_LEN, "planted block length (default %(default)s)", type=positive_int)
    n_per_distance: int = setting(1, "long-range sequences per distance (default %(default)s)", type=positive_int)
    sink: int = setting(4, "attention-sink positions a streaming group keeps (default %(default)s)", type=int)
    window: int | None = setting(
        None, "recent positions a streaming group keeps (default seq-len / 8)", type=positive_int
    )
    kv_budget: float | None = setting(
        None,
        f"the policy's KV cache as a fraction of the full cache (default {DEFAULT_KV_BUDGET})",
        type=float,
        exclusive="budget",
        needs=Needs("loss_tolerance", (None,)),
    )
    loss_tolerance: float | None = setting(
        None,
        "instead: the most natural-text loss increase (nats/token); the fewest full groups that meet it "
        "(default: none, --kv-budget)",
        type=float,
        exclusive="budget",
    )
    budgets: tuple[float, ...] = setting(
        DEFAULT_BUDGETS,
        "KV fractions of the curve (default 0.25,0.5,0.75; --kv-budget is added)",
        type=_fractions,
        metavar="B,...",
    )
    method: str = setting(
        "retrieval",
        "group costs: retrieval (default: attention on the planted block's first occurrence "
        "from its repeat, max over a group's heads), estimate (attention mass outside sink + window, mean "
        "over a group's heads) or measured (one group streaming at a time, a forward pass per group)",
        choices=METHODS,
    )
    n_random: int = setting(3, "random policies per budget (default %(default)s)", type=positive_int)
    seed: int = shared(DataSettings, "seed")

    def __post_init__(self):
        super().__post_init__()  # the shared settings' checks (headprobe.settings.check_settings)
        if self.device_map is not None:
            raise HeadprobeError(
                "headprobe kv runs on one device: its per-KV-group masks and streaming cache are not "
                "checked on a model split by a device map (leave device_map and max_memory unset)"
            )
        if self.method not in METHODS:
            raise HeadprobeError(
                f"--method must be one of {', '.join(METHODS)}, got {self.method!r}{did_you_mean(str(self.method), METHODS)}"
            )
        if self.kv_budget is None and self.loss_tolerance is None:
            object.__setattr__(self, "kv_budget", DEFAULT_KV_BUDGET)
        if self.kv_budget is not None and not 0 < self.kv_budget <= 1:
            raise HeadprobeError(f"--kv-budget must be in (0, 1], got {self.kv_budget}")
        if self.loss_tolerance is not None and self.loss_tolerance < 0:
            raise HeadprobeError(f"--loss-tolerance is an increase in nats/token, >= 0; got {self.loss_tolerance}")
        for flag, value, least in (
            ("--sink", self.sink, 0),
            ("--n-random", self.n_random, 1),
            ("--block-len", self.block_len, 2),  # copying is scored on the repeat's tokens 2..block_len
        ):
            if value < least:
                raise HeadprobeError(f"{flag} must be >= {least}, got {value}")
        if self.window is None:
            object.__setattr__(self, "window", max(1, self.seq_len // 8))
        if self.sink + self.window >= self.seq_len:
            raise HeadprobeError(
                f"--sink {self.sink} + --window {self.window} cover all {self.seq_len} tokens: nothing would stream"
            )
        budgets = tuple(
            sorted(
                {*map(float, self.budgets), float(self.kv_budget)}
                if self.kv_budget is not None
                else set(map(float, self.budgets))
            )
        )
        object.__setattr__(self, "budgets", budgets)
        if self.distances is None:  # the farthest whose first block starts after the sink (and BOS)
            room = max(self.block_len, self.seq_len - self.block_len - max(self.sink, 1))
            object.__setattr__(
                self, "distances", tuple(sorted({max(self.block_len, room * i // 4) for i in (1, 2, 3)} | {room}))
            )
        object.__setattr__(self, "distances", tuple(sorted({int(d) for d in self.distances})))  # a set, as budgets

    def seq_len_floor(self) -> tuple[int, str]:
        """The fewest ``--seq-len`` positions (:func:`headprobe.settings.seq_len_floor`): :func:`~headprobe.settings.long_range_floor`."""
        return long_range_floor(self.block_len, self.prepend_bos)

    @property
    def floor(self) -> float:
        """The KV fraction of every group streaming."""
        assert self.window is not None  # filled by __post_init__
        return (self.sink + self.window) / self.seq_len

    def preflight(self) -> None:
        """Checks that need no model: the ``--text`` file readable, the backend, ``seq_len`` within the context where the config
        tells it without loading (:func:`headprobe.options.peek_context`; else :func:`run` checks it
        on the loaded model), an encoder where its config says so (:func:`headprobe.options.peek_encoder`),
        budgets above the all-streaming floor, distances in range."""
        if self.text:  # refused after the model's load before (15 s for smollm2-135m on 2 cores)
            from headprobe.probe.core.io import open_text_file

            open_text_file(self.text)
        refuse_lacking(
            self.backend,
            "kv_policies",
            "headprobe kv masks attention per KV group in headprobe's native model; use --backend "
            "native (or auto) with a family it supports",
        )
        if isinstance(self.model, str) and options.peek_encoder(self.model):
            from headprobe.analyses.vocabulary import KV_NEEDS_DECODER
            from headprobe.probe.backends.sources import canonical_name

            raise HeadprobeError(f"{canonical_name(self.model)} is an encoder; {KV_NEEDS_DECODER}")
        n_ctx = options.peek_context(self.model) if isinstance(self.model, str) else None
        if n_ctx:
            check_context(self.seq_len, n_ctx)
        low = [b for b in self.budgets if b < self.floor]  # kv_budget is among them where given
        if low:
            raise HeadprobeError(
                f"budget {low[0]} is below what every group streaming costs ({self.floor:.3f} of the cache "
                f"at {self.seq_len} tokens with --sink {self.sink} --window {self.window})"
            )
        assert self.distances is not None  # filled by __post_init__
        bad = [d for d in self.distances if not self.block_len <= d <= self.seq_len - self.block_len - 1]
        if bad:
            raise HeadprobeError(
                f"--distances must lie in [{self.block_len}, {self.seq_len - self.block_len - 1}]; got {bad[0]}"
            )


FLAGS = (
    Flags(group=ModelSettings, skip=("device_map", "max_memory")),
    OUTPUT,
    Flags(
        only=(
            "text",
            "seq_len",
            "n_natural",
            "distances",
            "block_len",
            "n_per_distance",
            "sink",
            "window",
            "kv_budget",
            "loss_tolerance",
            "budgets",
            "method",
            "n_random",
            "seed",
        ),
        helps={
            "seq_len": "tokens per sequence (default %(default)s)",
            "n_natural": "natural-text windows (default %(default)s)",
            "seed": "seeds the natural-text windows, the random policies (seed .. seed + n-random - 1) and, as "
            "seed + 1, the long-range task's sequences (default %(default)s)",
        },
    ),
)
"""``--help``'s blocks: the model's flags, the output's, the command's own."""


def main(args: argparse.Namespace, config: KVConfig) -> int:
    return options.run_command(args, config, options.Run("headprobe.commands.kv_core"))


COMMAND = Command(
    HELP, config=KVConfig, run="headprobe.commands.kv:main", flags=FLAGS, api="headprobe.commands.kv_core:kv"
)
"""``headprobe kv``, registered in :data:`headprobe.commands.COMMANDS`."""
