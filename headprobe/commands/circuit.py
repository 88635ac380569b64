"""``headprobe circuit``: how heads connect, on the induction task.

Clean prompts are ``--n-seqs`` repeated random sequences ``[BOS] r r`` (``--period`` tokens each);
the corrupted prompts are other repeated random sequences (seed + 1), so every head's output
differs between the two at every position. The metric is the next-token loss (nats/token) on the
second copy (its predictable part, from the second token of the copy on).

1. **Edge attribution** of every head -> head (q, k, v) and head -> logits edge, EAP or EAP-IG
   (``--method``, ``--steps``; Syed et al. 2023; Hanna et al. 2024, "Have Faith in Faithfulness").
2. **Exact direct-path patching** (the sender's change added to the receiver's input only, not through
   the MLPs between them as in Wang et al. 2022's path patching; Goldowsky-Dill et al. 2023) of the ``--verify``
   edges largest in ``|score|`` and as many drawn at random from the rest (seeded), and the
   agreement of the two (Spearman, Pearson, top-k recall).
3. With ``--receivers 18.6:k,17.3:k``: exact path patching from every earlier head into each.
4. With ``--qk-head 18.6``: the QK attribution of that head on the first clean prompt, query in
   the middle of the second copy, key the token after its first occurrence (the induction target).

Definitions: :mod:`headprobe.analyses.circuit`, :mod:`headprobe.analyses.qk_attribution`.

Outputs: ``edges.csv`` (every edge: ``edge, sender, receiver, input, score`` and ``exact`` where
path patched), ``path_patching.csv`` (``--receivers``), ``qk_attribution.csv`` (``--qk-head``: each
component's query-side and key-side total), ``circuit.{png,pdf,svg}`` (the ``--top`` edges as a
graph) and ``summary.json`` (written last). Native backend only (the bridge: a one-line refusal).

As a library::

    result = headprobe.circuit("smollm2-135m", n_seqs=2, period=12, receivers="18.6:k")
    result.edges.head()                                 # edges.csv
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass

from headprobe import options
from headprobe.analyses.vocabulary import CIRCUIT_NEEDS_DECODER, CIRCUIT_NEEDS_NATIVE
from headprobe.commands import Command, lazy_names
from headprobe.options import positive_int
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import check_head, check_receiver, parse_heads
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.core.vocabulary import refuse_lacking
from headprobe.settings import OUTPUT, DataSettings, Flags, ModelSettings, Needs, setting, shared

_CORE = ("CircuitResult", "run", "circuit")
"""Names of :mod:`headprobe.commands.circuit_core` (the run: torch), imported on first use."""

__all__ = ["HELP", "COMMAND", "CircuitConfig", "FLAGS", "main", *_CORE]

__getattr__ = lazy_names(__name__, "headprobe.commands.circuit_core", _CORE)

HELP = (
    "head circuits: edge attribution (EAP, EAP-IG) checked by exact direct-path patching (the sender's change "
    "reaches the receiver directly, not through the MLPs between), and why a head attends, on repeated random "
    "tokens (the induction task; your own prompts: headprobe show --why)"
)

METHODS = ("eap-ig", "eap")
_RECEIVER = re.compile(r"^(?P<head>[^:]+):(?P<input>q|k|v)$|^logits$")


def _gib(text: str) -> float:
    """``--memory-gb``: a positive number of GiB."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of GiB") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of GiB")
    return value


def parse_receivers(
    text: str, n_layers: int | None = None, n_heads: int | None = None
) -> list[tuple[tuple[int, int] | None, str]]:
    """``"18.6:k,17.3:q,logits"`` -> ``[((18, 6), "k"), ((17, 3), "q"), (None, "logits")]``; each head
    read and, given the layout, checked as every command checks a head name
    (:func:`~headprobe.probe.core.heads.parse_heads`, :func:`~headprobe.probe.core.heads.check_receiver`);
    a receiver named twice (``logits,logits``, ``18.6:k,L18H6:k``) once, in first-named order.

    Raises:
        HeadprobeError: an item not of the form ``L.H:q|k|v`` or ``logits``, a head outside the
            model or in layer 0.
    """
    out: list[tuple[tuple[int, int] | None, str]] = []
    for item in (s.strip() for s in text.split(",")):
        m = _RECEIVER.match(item)
        if m is None:
            raise HeadprobeError(f"--receivers item {item!r} is not L.H:q, L.H:k, L.H:v or logits")
        if item == "logits":
            out.append((None, "logits"))
            continue
        ((layer, head),) = parse_heads(m["head"], 10**9, 10**9)  # the form; the range below, where known
        if n_layers is not None and n_heads is not None:
            check_receiver((layer, head), n_layers, n_heads, name=m["head"])
        out.append(((layer, head), m["input"]))
    return list(dict.fromkeys(out))  # each receiver once: a repeat path-patched every sender into it again


def parse_qk_head(text: str, n_layers: int | None = None, n_heads: int | None = None) -> tuple[int, int]:
    """``--qk-head``'s one head, read (and checked against the layout, where given) as every command
    reads a head name (:func:`~headprobe.probe.core.heads.parse_heads`).

    Raises:
        HeadprobeError: not one head of the form ``layer.head``, or a head outside the model."""
    heads = parse_heads(text, 10**9, 10**9)
    if len(heads) != 1:
        raise HeadprobeError(f"--qk-head takes one head, got {text!r}")
    if n_layers is not None and n_heads is not None:
        check_head(heads[0], n_layers, n_heads, name=text.strip())
    return heads[0]


@dataclass(frozen=True)
class CircuitConfig(ModelSettings):
    """Settings of ``headprobe circuit``: the shared :class:`~headprobe.settings.ModelSettings` (how
    the model is loaded, :func:`headprobe.options.load_model`) composed, ``period`` and ``seed``
    of :class:`~headprobe.settings.DataSettings` (declared there: :func:`~headprobe.settings.shared`;
    its prompts are repeated random sequences only, counted by ``n_seqs``), and its own. Every
    field's help is its flag's.

    Attributes:
        model: model name or path.
        n_seqs: clean (and corrupted) repeated random sequences. period: tokens per copy (>= 4).
        seed: draws the clean sequences (the corrupted: ``seed + 1``) and the random verified edges.
        method: ``eap-ig`` or ``eap``. steps: EAP-IG's integration steps (>= 1; EAP: 1).
        verify: edges path patched exactly: this many largest by ``|score|`` and this many at random (0: none).
        top: edges in the figure.
        receivers: comma-separated ``L.H:q|k|v`` / ``logits``, each path patched from every earlier head.
        qk_head: ``L.H`` to explain by QK attribution, or None.
    """

    n_seqs: int = setting(2, "repeated random sequences (default %(default)s)", type=positive_int)
    period: int = shared(DataSettings, "period", 12)
    seed: int = shared(DataSettings, "seed")
    method: str = setting("eap-ig", "edge attribution (default %(default)s)", choices=METHODS)
    steps: int = setting(
        5, "EAP-IG integration steps (default %(default)s)", type=positive_int, needs=Needs("method", ("eap-ig",))
    )
    verify: int = setting(
        20, "path patch this many top edges and as many random ones exactly (default %(default)s; 0: none)", type=int
    )
    top: int = setting(20, "edges in the figure and summary (default %(default)s)", type=positive_int)
    receivers: str | None = setting(
        None, "path patch every earlier head into these, e.g. 18.6:k,17.3:k,logits (default: none)"
    )
    qk_head: str | None = setting(
        None,
        "explain this head's attention by QK attribution, e.g. 18.6, at the middle query of the first "
        "sequence's second copy and its induction target (default: none; another query or your own prompt: "
        "headprobe show --why, or headprobe.qk_attribution in Python)",
    )
    memory_budget: str | None = shared(
        ModelSettings,
        "memory_budget",
        help="working memory the scoring chunks and path-patched forwards may fill beyond the weights, e.g. "
        "4GiB or 500MB (default: $HEADPROBE_MEMORY_BUDGET, else 80 percent of the device's free memory, on a "
        "CPU at most 1 GiB); --memory-gb wins over it; the header prints the chunks, and a budget above the "
        "free memory or one sequence that does not fit is refused before it starts",
    )  # the CPU cap: headprobe.analyses.circuit.DEFAULT_BUDGET (plan_rows)
    memory_gb: float | None = setting(
        None,
        "the same budget in GiB (2^30 bytes, not GB: 40 is 42.9e9 bytes); wins over --memory-budget "
        "(default: --memory-budget's)",
        type=_gib,
    )

    def __post_init__(self):
        super().__post_init__()  # the shared settings' checks (headprobe.settings.check_settings)
        if self.method not in METHODS:
            raise HeadprobeError(
                f"--method must be one of {', '.join(METHODS)}, got {self.method!r}{did_you_mean(str(self.method), METHODS)}"
            )
        for name, least in (("n_seqs", 1), ("steps", 1), ("top", 1), ("verify", 0), ("period", 4)):
            if getattr(self, name) < least:
                raise HeadprobeError(f"--{name.replace('_', '-')} must be at least {least}, got {getattr(self, name)}")
        if self.receivers is not None:
            parse_receivers(self.receivers)
        if self.memory_gb is not None and not 0 < self.memory_gb < float("inf"):
            raise HeadprobeError(f"--memory-gb must be a positive number of GiB, got {self.memory_gb}")
        if self.qk_head is not None:
            parse_qk_head(self.qk_head)

    def preflight(self) -> None:
        """Check before the model loads (torch-free): what the settings alone decide (``__post_init__``)
        and, where config.json gives the layout (:func:`headprobe.options.peek_config`), the
        receivers, ``--qk-head`` and the sequences' length against it.

        An encoder is refused here where its config says so (:func:`headprobe.options.peek_encoder`; else after the load),
        a backend without path patching (``--backend transformer-lens``) always.

        Raises:
            HeadprobeError: a backend without path patching, an encoder, a head outside the model, or
                sequences longer than its context.
        """
        refuse_lacking(self.backend, "path_patching", CIRCUIT_NEEDS_NATIVE.format(backend=self.backend))
        if isinstance(self.model, str) and options.peek_encoder(self.model):
            from headprobe.probe.backends.sources import canonical_name

            raise HeadprobeError(CIRCUIT_NEEDS_DECODER.format(model=canonical_name(self.model)))
        cfg = options.peek_config(self.model)
        if cfg is None:
            return  # checked after loading (run)
        L, H, n_ctx = cfg["n_layers"], cfg["n_heads"], cfg["n_ctx"]
        named = [h for h, _ in parse_receivers(self.receivers, L, H) if h is not None] if self.receivers else []
        if self.qk_head is not None:
            named.append(parse_qk_head(self.qk_head, L, H))
        options.refuse_removed(named, self.model)  # a pruned checkpoint's removed heads, from its config.json
        if n_ctx and 2 * self.period + 1 > n_ctx:
            raise HeadprobeError(
                f"--period {self.period} gives sequences longer than the model's context ({n_ctx} tokens)"
            )


FLAGS = (
    Flags(group=ModelSettings, skip=("prepend_bos",)),
    OUTPUT,
    Flags(
        only=(
            "n_seqs",
            "period",
            "method",
            "steps",
            "verify",
            "top",
            "receivers",
            "qk_head",
            "memory_gb",
            "prepend_bos",
            "seed",
        ),
        helps={
            "period": "tokens per copy (default %(default)s)",
            "prepend_bos": "do not put BOS in front of the prompts",
        },
    ),
)
"""``--help``'s blocks: the model's flags (``--no-bos`` with the prompts'), the output's, the command's own."""


def main(args: argparse.Namespace, config: CircuitConfig) -> int:
    return options.run_command(args, config, options.Run("headprobe.commands.circuit_core"))


COMMAND = Command(
    HELP,
    config=CircuitConfig,
    run="headprobe.commands.circuit:main",
    flags=FLAGS,
    api="headprobe.commands.circuit_core:circuit",
)
"""``headprobe circuit``, registered in :data:`headprobe.commands.COMMANDS`."""
