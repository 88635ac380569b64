"""The headprobe checkpoint format, written by ``headprobe train``: a directory holding
``headprobe_model.pt`` (a native :class:`~headprobe.probe.model.transformer.Transformer`'s state dict),
``config.json`` (``{"format": NATIVE_FORMAT, "model": TransformerConfig fields, ...}``) and the
tokenizer files. :func:`headprobe.probe.backends.native_loading.load_native` (through ``load_model``) reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from headprobe.probe.layout.spec import PRUNED_FROM

NATIVE_WEIGHTS = "headprobe_model.pt"
NATIVE_FORMAT = "headprobe-native-1"


PRUNED_WEIGHTS = "headprobe_model.safetensors"
"""The weights of a pruned model directory (:func:`headprobe.probe.model.pruned.save_pruned_dir`; its
config.json has the same format, plus ``pruned``)."""


def pruned_weights(dtype: str, n_removed: Any, source_weights: str | None) -> str:
    """A pruned checkpoint's ``ModelSpec.weights``: its dtype, the heads removed and, when recorded
    (:func:`headprobe.probe.model.pruned.save_pruned_dir`'s ``source_weights``), the weights it was pruned from (e.g. the 4-bit
    SmolLM2's ``4-bit Q4_1 GGUF (...), dequantized to float32``: its values are those, as stored)."""
    own = f"{dtype} (pruned headprobe checkpoint, {n_removed} heads removed, zero weights)"
    return own + (f"{PRUNED_FROM}{source_weights}" if source_weights else "")


def source_weights(weights: str) -> str:
    """The weights of the first model in a chain of prunings: ``weights`` after the first
    :data:`PRUNED_FROM` (:func:`pruned_weights`), or ``weights`` itself for a model never pruned."""
    return weights.split(PRUNED_FROM, 1)[-1]


def is_native_dir(path: str | Path) -> bool:
    """Whether ``path`` is a headprobe checkpoint directory (it holds ``headprobe_model.pt``, or
    ``headprobe_model.safetensors`` for a pruned model)."""
    return (Path(path) / NATIVE_WEIGHTS).is_file() or (Path(path) / PRUNED_WEIGHTS).is_file()


def save_native(model: Any, out: str | Path, extra: dict[str, Any] | None = None) -> None:
    """Write a native :class:`~headprobe.probe.model.transformer.Transformer`'s weights (``headprobe_model.pt``) and
    ``config.json`` (``{"format", "model": TransformerConfig fields, **extra}``) into ``out``,
    atomically. The tokenizer files are the caller's (``tokenizer.save_pretrained(out)``)."""
    save_native_state(model.state_dict(), model.cfg, out, extra)


def save_native_state(
    state: dict[str, torch.Tensor], cfg: Any, out: str | Path, extra: dict[str, Any] | None = None
) -> None:
    """:func:`save_native` from a state dict and its :class:`~headprobe.probe.model.config.TransformerConfig`
    (e.g. a snapshot taken during training) instead of a model."""
    from dataclasses import asdict

    from headprobe.probe.core.io import atomic_path, write_json

    with atomic_path(Path(out) / NATIVE_WEIGHTS) as tmp:
        torch.save({k: v.detach().cpu() for k, v in state.items()}, tmp)
    write_json(Path(out) / "config.json", {"format": NATIVE_FORMAT, "model": asdict(cfg), **(extra or {})})
