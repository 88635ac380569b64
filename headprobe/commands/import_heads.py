"""``headprobe import --heads-file FILE --model M``: check someone else's head file against the
model and run scan's causal verdict on the heads it names.

The file is a DuoAttention ``full_attention_heads.tsv`` (or its folder), a Retrieval_Head / HeadKV
score JSON, an EAP-IG / MIB circuit graph (``Graph.to_json``'s JSON or ``to_pt``'s ``.pt``), a headprobe head table (Parquet, or a CSV such as scan's ``head_scores.csv``) or KV policy, or a plain
``layer.head`` list (one per line or comma-separated); :mod:`headprobe.analyses.exchange` reads
them. Its shape is checked against the model's config before any weights load where config.json
gives the layout (one line naming the mismatch: ``full_attention_heads.tsv has 32 rows; M has 30
layers``), else after loading. The heads (a DuoAttention or policy file: the query heads of its
full-cache KV groups; a score file: its top ``--top-k``; a graph: its attention nodes) are then
mean-ablated against control sets of as many heads, with scan's draws, ``--alpha``,
``--correction`` and stopping rule (:func:`headprobe.analyses.verification.verify_heads`), on
``--task``. With ``--kv``, a DuoAttention or policy file's KV policy is measured as ``headprobe kv``
measures its own (exact per-group masks), against full caches and one window on every group at the
same memory. Nothing is written; the verdict is printed.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass

from headprobe import options
from headprobe.analyses import vocabulary as vocab
from headprobe.commands import Command, lazy_names, resolve
from headprobe.commands.scan import DEFAULT_K, ScanConfig
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.settings import (
    DEFAULT_BLOCK_LEN,
    DataSettings,
    Flags,
    ModelSettings,
    long_range_floor,
    losses_floor,
    setting,
)

_CORE = ("ImportResult", "run", "import_heads")
"""Names of :mod:`headprobe.commands.import_heads_core` (torch), imported on first use."""

__all__ = ["HELP", "COMMAND", "ImportConfig", "FLAGS", "main", *_CORE]

__getattr__ = lazy_names(__name__, "headprobe.commands.import_heads_core", _CORE)

HELP = (
    "check a DuoAttention, HeadKV, MIB or layer.head file against a model and give scan's causal verdict on its heads"
)


@dataclass(frozen=True)
class ImportConfig(ScanConfig):
    """Settings of ``headprobe import``: scan's (:class:`~headprobe.commands.scan.ScanConfig`: the
    model, the token sets and the verification's draws, alpha, control design and correction) and its own.

    Attributes:
        heads_file: the head file (see the module docstring).
        task: the task the heads are judged on, ``natural`` or ``repeated`` (the induction task).
        score: a head table's column ranked for the top ``k`` (None: ``retrieval``, else ``induction``).
        measure_kv: also measure a DuoAttention or policy file's KV policy (``headprobe kv``'s measurement).
    """

    heads_file: str = setting(
        MISSING,
        "a DuoAttention full_attention_heads.tsv (or its folder), a Retrieval_Head/HeadKV "
        "JSON, an EAP-IG/MIB graph (.json or .pt), a headprobe .parquet or policy.json, or layer.head lines",
        metavar="FILE",
        required=True,
        kw_only=True,
    )
    task: str = setting(
        "repeated",
        "the task the heads are judged on: repeated (the induction task on repeated random "
        "tokens; default) or natural (natural text)",
        choices=vocab.TASKS,
    )
    score: str | None = setting(
        None,
        "a head table's (Parquet, CSV) column whose top --top-k heads are checked (default: retrieval, else induction)",
        metavar="COLUMN",
    )
    measure_kv: bool = setting(
        False,
        "also measure a DuoAttention/policy file's KV policy as headprobe kv does (exact "
        "per-group masks) against full caches and one window at the same memory",
        flag="--kv",
        action="store_true",
    )

    def __post_init__(self):
        super().__post_init__()
        if self.task not in vocab.TASKS:
            raise HeadprobeError(
                f"--task must be one of {', '.join(vocab.TASKS)}, got {self.task!r}{did_you_mean(str(self.task), vocab.TASKS)}"
            )

    def seq_len_floor(self) -> tuple[int, str]:
        """The fewest ``--seq-len`` positions (:func:`headprobe.settings.seq_len_floor`): no head
        type is scored, so the natural-text losses' (:func:`headprobe.settings.losses_floor`), or
        with ``--kv`` ``headprobe kv``'s long-range task at its default ``--block-len``
        (:func:`headprobe.settings.long_range_floor`; the config :func:`~headprobe.commands.import_heads_core.measure_policy` builds)."""
        if not self.measure_kv:
            return losses_floor(self)
        least, why = long_range_floor(DEFAULT_BLOCK_LEN, self.prepend_bos)
        return least, f"--kv measures as headprobe kv: {why}"

    def preflight(self) -> None:
        """The file read and its shape checked against the model's config.json, before any weights load.

        Raises:
            HeadprobeError: as :func:`headprobe.analyses.exchange.read_head_file`, :func:`refuse_unused`,
                or scan's preflight."""
        self.read_text()
        cfg = options.peek_config(self.model)
        from headprobe.analyses.exchange import Layout, read_head_file

        layout = (
            Layout(
                self.model,
                cfg["n_layers"],
                cfg["n_heads"],
                cfg.get("n_kv_heads"),
                cfg.get("n_kv_groups"),
                cfg.get("d_model"),
                cfg.get("parallel_attn_mlp"),
            )
            if cfg
            else None
        )
        hf = read_head_file(self.heads_file, layout, self.k or DEFAULT_K, self.score)
        refuse_unused(self, hf)
        options.refuse_removed(hf.heads, self.model)  # a pruned checkpoint's removed heads, from its config.json
        if self.measure_kv and hf.policy is not None:
            n_ctx = cfg["n_ctx"] if cfg else None
            seq_len = vocab.fitted_seq_len(n_ctx, self.seq_len) if n_ctx else self.seq_len or None
            if seq_len is not None:  # else the fitted default is known, and checked, once the model loads
                check_policy_span(hf.policy, seq_len)


def policy_span(policy) -> tuple[int, int]:
    """``(sink, window)`` in positions of a KV policy's streaming groups
    (:class:`~headprobe.analyses.kvpolicy.KVPolicy`; a file gives one span for all of them), ``(0, 1)`` where none streams."""
    spans = {(s.sink, s.window) for row in policy.groups for s in row if s is not None}
    return spans.pop() if spans else (0, 1)


def check_policy_span(policy, seq_len: int) -> None:
    """Refuse ``import --kv`` where the policy's sink and window cover all ``seq_len`` positions: nothing
    would stream. Checked before the load where ``--seq-len`` (or the context it is fitted to) is known
    (:meth:`ImportConfig.preflight`), else by :func:`~headprobe.commands.import_heads_core.measure_policy`.

    Raises:
        HeadprobeError: one line naming the sink, the window and ``--seq-len``."""
    sink, window = policy_span(policy)
    if sink + window >= seq_len:
        raise HeadprobeError(
            f"the policy's sink {sink} + window {window} cover all {seq_len} tokens of --seq-len: "
            "nothing would stream; give a longer --seq-len"
        )


SCORE_FILES = ("headkv", "parquet", "csv")
"""The head files that rank heads by a score (``--top-k``, ``--score`` pick from them); the others name their heads."""


def refuse_unused(config: ImportConfig, hf) -> None:
    """Refuse the flags that file ``hf`` (a :class:`~headprobe.analyses.exchange.HeadFile`) makes
    do nothing: ``--top-k`` or ``--score`` on a file that names its heads (DuoAttention, a graph, a
    policy, a list), ``--kv`` on one without a KV policy. Known once the file is read, before any
    weights load (:meth:`ImportConfig.preflight`; from Python with a loaded model, before the run).

    Raises:
        HeadprobeError: one line naming the flags and the file's kind."""
    given = [f for f, v in (("--top-k", config.k), ("--score", config.score)) if v is not None]
    if given and hf.kind not in SCORE_FILES:
        raise HeadprobeError(
            f"{' and '.join(given)} only {'act' if len(given) > 1 else 'acts'} on score files (HeadKV, Parquet, CSV); "
            f"{config.heads_file} is a {hf.kind} file, which names its heads (all checked): leave "
            f"{'them' if len(given) > 1 else 'it'} out"
        )
    if config.measure_kv and hf.policy is None:
        raise HeadprobeError(
            f"--kv only acts on a DuoAttention or policy file; {config.heads_file} is a {hf.kind} file, which "
            "carries no KV policy: leave --kv out"
        )


FLAGS = (
    Flags(group=ModelSettings),
    Flags(group=DataSettings),
    Flags(
        only=(
            "heads_file",
            "task",
            "k",
            "score",
            "n_random",
            "alpha",
            "control",
            "correction",
            "keep_n_random",
            "sequential",
            "measure_kv",
        ),
        helps={
            "k": f"a score file's (HeadKV, Parquet, CSV) top K heads are checked (default {DEFAULT_K}); other files name their heads"
        },
    ),
)
"""``headprobe import``'s flags in ``--help`` order."""


def main(args: argparse.Namespace, config: ImportConfig) -> int:
    """Check the file before loading, load the model, verify the heads, print the verdict."""
    import time

    options.check_model(config.model)
    config.preflight()  # the file against config.json: before torch and the weights
    run = resolve("headprobe.commands.import_heads_core:run")  # named as a string: no import cycle
    t0 = time.perf_counter()
    model = options.load_for(config)
    print(options.describe_model(model), flush=True)  # the header every command that loads a model prints
    result = run(model, config, progress=True)
    result.load_s = time.perf_counter() - t0 - result.seconds
    print(result.report())
    return 0


COMMAND = Command(
    HELP,
    config=ImportConfig,
    run="headprobe.commands.import_heads:main",
    flags=FLAGS,
    api="headprobe.commands.import_heads_core:import_heads",
)
"""``headprobe import``, registered in :data:`headprobe.commands.COMMANDS`."""
