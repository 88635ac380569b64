"""Linear-attention token mixers in a native block (Qwen3-Next's and Qwen3.5's Gated DeltaNet): Hugging
Face's own module, with no heads.
"""

from __future__ import annotations

from jaxtyping import Bool, Float, Int
from torch import Tensor, nn

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.model.cache import KVCache, StreamingKVCache
from headprobe.probe.model.config import TransformerConfig

_LINEAR_MIXERS = {  # model_type -> (module, config class, mixer class) in transformers
    "qwen3_next": ("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextConfig", "Qwen3NextGatedDeltaNet"),
    "qwen3_5_text": ("transformers.models.qwen3_5.modeling_qwen3_5", "Qwen3_5TextConfig", "Qwen3_5GatedDeltaNet"),
}


class LinearAttention(nn.Module):
    """A linear-attention layer's token mixer, run by Hugging Face's own module (``mixer``:
    ``Qwen3NextGatedDeltaNet``, Yang et al. 2024's Gated DeltaNet, built from ``cfg.linear_mixer``
    and holding the checkpoint's tensors under their Hugging Face names). It has no heads: no
    attention hook points, ``head_mask`` and KV policies do not reach it.

    Raises (forward):
        HeadprobeError: with a KV cache (its recurrent state is not cached here).
    """

    force_eager = False
    streaming = None

    def __init__(self, cfg: TransformerConfig, layer: int):
        super().__init__()
        import importlib

        fields = dict(cfg.linear_mixer or {})
        kind = fields.pop("model_type", None)
        if kind not in _LINEAR_MIXERS:
            raise HeadprobeError(
                f"linear attention of model_type {kind!r} is not one of {sorted(_LINEAR_MIXERS)}{did_you_mean(str(kind), _LINEAR_MIXERS)}"
            )
        module, config_class, mixer_class = _LINEAR_MIXERS[kind]
        lib = importlib.import_module(module)
        hf_cfg = getattr(lib, config_class)(**fields)
        self.mixer = getattr(lib, mixer_class)(hf_cfg, layer)

    def forward(
        self,
        x: Float[Tensor, "batch pos d_model"],
        positions: Int[Tensor, "batch pos"],
        padding: Bool[Tensor, "batch pos"] | None = None,
        head_mask: Tensor | None = None,
        cache: KVCache | StreamingKVCache | None = None,
    ) -> Float[Tensor, "batch pos d_model"]:
        """The mixer's output ``[batch, pos, d_model]``; padding positions are zeroed at its input, as Hugging Face's."""
        if cache is not None:
            raise HeadprobeError("a KV cache is not implemented for linear-attention layers (Gated DeltaNet)")
        return self.mixer(x, attention_mask=None if padding is None else padding.long())
