"""Loading Hugging Face weights into headprobe's own :class:`~headprobe.probe.model.transformer.Transformer`:
the machinery every family shares. Each family's config mapping and weight conversion lives in
its own module ``probe/model/families/<model_type>.py``, registered by ``model_type`` in
:data:`~headprobe.probe.model.families.FAMILIES`; this module dispatches through that registry.

The families load exactly (logits equal to the Hugging Face eager model's to 1e-4 and every
pattern to 1e-5 in float32, tested in ``tests/test_native_model.py`` and
``tests/test_native_families.py``); an option of theirs the native model lacks raises, so
:func:`supports` is False and ``--backend auto`` takes the TransformerLens bridge.

:func:`headprobe.probe.backends.loading.load_model` with ``backend="native"`` (the default wherever
:func:`supports` holds) puts the native model behind the same :class:`~headprobe.probe.backends.loading.LoadedModel`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout.spec import ModelSpec
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.families import FAMILIES
from headprobe.probe.model.families.base import Family
from headprobe.probe.model.transformer import Transformer


def family_of(hf_config: Any) -> Family:
    """The registered family of a Hugging Face config (its ``model_type``).

    Raises:
        HeadprobeError: a ``model_type`` no family is registered for (one line, with the
            closest registered ones).
    """
    return FAMILIES.get(getattr(hf_config, "model_type", None))


def is_encoder(model_type: str | None) -> bool:
    """Whether ``model_type`` is a registered encoder family (loaded with ``AutoModel``, no causal
    LM head, and run with bidirectional attention)."""
    return model_type in FAMILIES and FAMILIES.get(model_type).encoder


def supports(hf_config: Any) -> bool:
    """Whether :func:`config_from_hf` can map this Hugging Face config (no error raised)."""
    try:
        config_from_hf(hf_config)
    except HeadprobeError:
        return False
    return True


def config_from_hf(hf_config: Any) -> TransformerConfig:
    """The :class:`TransformerConfig` that reproduces a Hugging Face config of a registered family
    (:data:`~headprobe.probe.model.families.FAMILIES`): the family's own mapping.

    Raises:
        HeadprobeError: another architecture, or an option of the family the native model
            does not implement (rotary scaling, a GPT-2 activation other than ``gelu_new``,
            Llama-style attention biases, ...).
    """
    return family_of(hf_config).config(hf_config)


def from_hf(hf_model: Any, copy: bool = True) -> Transformer:
    """A native :class:`Transformer` holding a Hugging Face model's weights (a registered family):
    copies by default, so the two models share no storage.

    ``copy=False`` hands the weights over: the native model takes the Hugging Face model's
    tensors themselves wherever the conversion is a plain rename (most of them; GPT-2's
    transposed ``Conv1D`` weights and fused projections are still copied), so no second copy of
    the weights is ever alive. Then the caller must drop the Hugging Face model and never use it
    again (it would see the native model's in-place changes, and vice versa). What
    :func:`~headprobe.probe.backends.loading.load_model` does with a checkpoint nobody else holds.

    Raises:
        HeadprobeError: an architecture :func:`config_from_hf` does not support.
    """
    source = NativeSource.of(hf_model.config)
    return source.build({k: v.detach() for k, v in hf_model.state_dict().items()}, copy=copy)


@dataclass(frozen=True)
class NativeSource:
    """What turns a Hugging Face state dict into a native model, without the Hugging Face model
    or config classes: the native config, the family (``model_type``) that names the weights,
    and DeepSeek's ``rope_interleave``. Saved as JSON beside cached weights
    (:mod:`headprobe.probe.backends.weights_cache`), so a warm load needs no transformers model at all.
    """

    config: TransformerConfig
    model_type: str
    rope_interleave: bool = False

    @classmethod
    def of(cls, hf_config: Any) -> NativeSource:
        """From a Hugging Face config.

        Raises:
            HeadprobeError: an architecture :func:`config_from_hf` does not support.
        """
        return cls(config_from_hf(hf_config), hf_config.model_type, bool(getattr(hf_config, "rope_interleave", False)))

    def to_json(self) -> dict[str, Any]:
        return {
            "config": dataclasses.asdict(self.config),
            "model_type": self.model_type,
            "rope_interleave": self.rope_interleave,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> NativeSource:
        """Inverse of :meth:`to_json` (JSON lists back to the config's tuples).

        Raises:
            KeyError, TypeError: not what :meth:`to_json` writes.
        """
        return cls(TransformerConfig.from_json(data["config"]), data["model_type"], bool(data["rope_interleave"]))

    def build(self, hf_state: dict[str, Tensor], copy: bool = False) -> Transformer:
        """The native model holding ``hf_state``'s weights (Hugging Face names) in their dtype;
        the tensors themselves unless ``copy``.

        Raises:
            HeadprobeError: no family is registered for :attr:`model_type`.
            KeyError: a weight the family needs is missing. RuntimeError: one is left over.
        """
        cfg, family = self.config, FAMILIES.get(self.model_type)
        embed, unembed = family.embedding_names
        if cfg.tied_unembed and embed not in hf_state and unembed in hf_state:
            hf_state = {**hf_state, embed: hf_state[unembed]}  # safetensors keeps one name of a tied pair
        converted = family.weights(hf_state, cfg, self.rope_interleave)
        return Transformer.from_state_dict(
            cfg,
            {
                k: v.clone(memory_format=torch.contiguous_format) if copy else v.contiguous()
                for k, v in converted.items()
            },
        )


def spec_from_native(name: str, hf_name: str, weights: str, cfg: TransformerConfig) -> ModelSpec:
    """The :class:`ModelSpec` of a native model: its layout is ``cfg.layout``; ``weights`` says
    where the weights come from and their precision (the backend is ``native``)."""
    return ModelSpec(
        name=name,
        hf_name=hf_name,
        layout=cfg.layout,
        d_vocab=cfg.d_vocab,
        n_ctx=cfg.n_ctx,
        weights=weights,
        backend="native",
        causal=cfg.causal,
        d_mlp=mlp_activation_width(cfg),
    )


def mlp_activation_width(cfg: TransformerConfig) -> int:
    """:attr:`ModelSpec.d_mlp` of a native model: 0 without MLPs, ``d_mlp`` for dense ones, and for a
    mixture of experts ``n_experts_per_token * d_expert + d_shared_expert`` (each token's routed
    experts and the shared one; :class:`~headprobe.probe.model.feedforward.MoE`), or the dense width
    where that is wider and some layers are dense (``moe_layers``)."""
    if cfg.mlp is None:
        return 0
    assert cfg.d_mlp is not None  # filled by TransformerConfig.__post_init__
    if cfg.n_experts is None:
        return cfg.d_mlp
    routed = cfg.n_experts_per_token * (cfg.d_expert or cfg.d_mlp) + (cfg.d_shared_expert or 0)
    return routed if cfg.moe_layers is None else max(routed, cfg.d_mlp)
