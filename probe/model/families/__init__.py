"""The model families headprobe's native :class:`~headprobe.probe.model.transformer.Transformer` loads from
Hugging Face checkpoints, one module each: ``probe/model/families/<model_type>.py`` holds the family's
config mapping (Hugging Face config -> :class:`~headprobe.probe.model.config.TransformerConfig`), its
weight conversion, the tiny checkpoint the test zoo builds of it and the facts the tests check,
as one :class:`~headprobe.probe.model.families.base.Family` named ``FAMILY``.

:data:`FAMILIES` is the one place a family is registered: its Hugging Face ``model_type`` and a
lazy ``"module:attr"`` target (:class:`~headprobe.probe.core.registry.Registry`). Everything else finds
families here: :mod:`headprobe.probe.model.convert` (``--backend auto`` takes the native model wherever
a family's config mapping accepts the config), the loader (encoders), ``tests/zoo.py`` and
``tests/test_native_families.py``. Importing this package imports no torch and no family module.
"""

from __future__ import annotations

from headprobe.probe.core.registry import Registry

FAMILIES: Registry = Registry(
    "model type", hint="the native backend supports only these: use --backend transformer-lens"
)
"""Hugging Face ``model_type`` -> its :class:`~headprobe.probe.model.families.base.Family` (lazy)."""

ENCODER = "encoder"
"""The :data:`FAMILIES` group of the encoder families (``Family.encoder``: bidirectional, no LM head), so that
a config.json names an encoder before anything loads (:func:`is_encoder_type`)."""

for _model_type in (
    "gpt2",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "olmo2",
    "gemma2",
    "gpt_neox",
    "deepseek_v3",
    "bert",
    "mixtral",
    "qwen3_moe",
    "phi3",
    "granite",
    "smollm3",
    "olmo3",
    "gemma3_text",
    "cohere2",
    "gpt_oss",
    "llama4_text",
    "qwen3_next",
    "qwen3_5_text",
):
    FAMILIES.register(_model_type, f"{__name__}.{_model_type}:FAMILY", group=ENCODER if _model_type == "bert" else "")
del _model_type


def is_encoder_type(model_type: object) -> bool:
    """Whether ``model_type`` (a ``config.json``'s) is a registered encoder family (its ``Family.encoder``;
    the group :data:`ENCODER`), read without importing the family or torch."""
    return isinstance(model_type, str) and model_type in FAMILIES and FAMILIES.group_of(model_type) == ENCODER
