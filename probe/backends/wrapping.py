"""A checkpoint, or a transformers model already in memory, put behind a backend's hook points:
:func:`wrap` (the backend ``auto`` or the one asked for) and :func:`wrap_model` (``headprobe.wrap``,
with its checks of the caller's model and tokenizer)."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.backends.hf_checkpoint import check_finite_weights, refuse_unstudiable
from headprobe.probe.backends.hf_tokenizers import _tokenizer_fix, _tokenizer_warning, no_bos_note
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.vocabulary import backend_class
from headprobe.probe.layout.spec import Checkpoint


def wrap(
    ckpt: Checkpoint,
    backend: str = "auto",
    device: str | torch.device = "cpu",
    prepend_bos: bool = True,
    copy: bool = True,
) -> LoadedModel:
    """Put a checkpoint behind TransformerLens hook points.

    The caller's Hugging Face model is left as it was: the native backend copies its weights, and
    the bridge (which rewires the model it wraps) gets a deep copy, unless ``copy=False`` hands
    the model over (what :func:`load_model` does with a checkpoint nobody else holds): then the
    native backend takes its tensors without copying them (:func:`~headprobe.probe.model.convert.from_hf`),
    so a load never holds two copies of the weights, and the caller must not use
    ``ckpt.hf_model`` afterwards.

    Args:
        backend: ``native`` copies the weights into headprobe's own
            :class:`~headprobe.probe.model.transformer.Transformer` (GPT-2, Llama, Mistral, Qwen2/3, OLMo-2, Gemma-2, GPT-NeoX, dense DeepSeek-V2/V3; see :mod:`headprobe.probe.model.convert`); ``transformer-lens``
            wraps the Hugging Face model in a ``TransformerBridge``; ``auto`` takes native
            wherever it supports the architecture, else the bridge.
        copy: leave ``ckpt.hf_model`` untouched and unshared (default), or hand it over.

    Raises:
        HeadprobeError: unknown backend, ``native`` asked for an architecture it lacks, or
            ``transformer-lens`` asked for an encoder (BERT).
    """
    # auto: the first registered backend that runs the architecture (native, then the bridge)
    cls = backend_class(backend, lambda: ckpt.hf_model.config)
    return cls.from_checkpoint(ckpt, device=device, prepend_bos=prepend_bos, copy=copy)


def _lacks_lm_head(hf_model: Any) -> bool:
    """Whether a transformers decoder has no language-model head (``get_output_embeddings()`` None:
    a base ``LlamaModel`` or ``GPT2Model``, a sequence classifier), so its logits cannot be read."""
    get = getattr(hf_model, "get_output_embeddings", None)
    return callable(get) and get() is None


def wrap_model(
    hf_model: Any,
    tokenizer: Any,
    backend: str = "auto",
    device: str | torch.device | None = None,
    prepend_bos: bool = True,
    name: str | None = None,
) -> LoadedModel:
    """Wrap a transformers model already in memory (a notebook's ``AutoModelForCausalLM``, or
    ``AutoModel`` for an encoder) and its tokenizer as a :class:`LoadedModel`: ``headprobe.wrap``.

    The caller's model is left untouched (weights, buffers, mode and forward; tested): ``native``
    (``auto`` wherever :mod:`headprobe.probe.model.convert` supports the family, see :func:`wrap`) copies
    its weights into headprobe's own transformer; the TransformerLens bridge wraps a deep copy. A
    model in half precision is converted and self-checked in float32, then cast back
    (:meth:`LoadedModel.to`), on the native backend; the bridge checks it in its own dtype. The
    load-time self-check (:mod:`headprobe.probe.hooks.selfcheck`) runs before this returns.

    Args:
        hf_model: a ``transformers`` ``PreTrainedModel`` (it must have ``.config``).
        tokenizer: its tokenizer.
        backend: ``auto``, ``native`` or ``transformer-lens``.
        device: where the wrapped copy goes (default: where ``hf_model``'s weights are).
        prepend_bos: put the tokenizer's BOS token in front of every sequence (once), as
            :func:`headprobe.load_model`'s; a decoder whose tokenizer has none runs without, and a
            ``NOTE: headprobe.wrap: ...`` line says so.
        name: what outputs call the model (default: the config's ``_name_or_path``, else the class name).

    Returns:
        LoadedModel: self-checked, what every command's function and :func:`headprobe.capture_heads`
            take; its ``spec`` gives the layers, heads, ``d_model`` and ``n_ctx``.

    Raises:
        HeadprobeError: ``hf_model`` is not a transformers model or (a decoder) has no LM head (a base
            ``AutoModel``, a classifier), ``tokenizer`` is None or no tokenizer object, ``prepend_bos``
            not a bool, weights that are NaN or Inf, a model without attention layers or a tokenizer that
            cannot be its (:func:`refuse_unstudiable`), or as :func:`wrap` (an unknown backend, ``native`` for
            an architecture it lacks). A tokenizer that may not be the model's (:func:`_tokenizer_warning`)
            gets one ``WARNING: headprobe.wrap: ...`` line on stderr, not an error.
    """
    if not isinstance(hf_model, torch.nn.Module) or getattr(hf_model, "config", None) is None:
        raise HeadprobeError(f"headprobe.wrap takes a transformers model (with .config), got {type(hf_model).__name__}")
    if tokenizer is None:
        raise HeadprobeError("headprobe.wrap needs the model's tokenizer")
    if not callable(tokenizer) or isinstance(tokenizer, (str, os.PathLike)):
        raise HeadprobeError(
            f"headprobe.wrap: tokenizer must be the model's tokenizer object (AutoTokenizer.from_pretrained(...)), "
            f"got {type(tokenizer).__name__}"
        )
    if not isinstance(prepend_bos, bool):
        raise HeadprobeError(f"headprobe.wrap: prepend_bos must be True or False, got {type(prepend_bos).__name__}")
    from headprobe.probe.model.convert import is_encoder

    if not is_encoder(getattr(hf_model.config, "model_type", None)) and _lacks_lm_head(hf_model):
        raise HeadprobeError(
            f"headprobe.wrap takes a causal language model with its LM head (AutoModelForCausalLM), got "
            f"{type(hf_model).__name__}, which has none: load it with AutoModelForCausalLM.from_pretrained(...)"
        )
    check_finite_weights(hf_model)
    hf_name = getattr(hf_model.config, "_name_or_path", "") or type(hf_model).__name__
    first = next(hf_model.parameters())
    dtype = first.dtype
    precision = f"{str(dtype).removeprefix('torch.')} (a transformers model wrapped in memory)"
    ckpt = Checkpoint(name or hf_name, hf_name, precision, hf_model, tokenizer)
    refuse_unstudiable(ckpt, _tokenizer_fix(tokenizer))
    if (warning := _tokenizer_warning(hf_model, tokenizer)) is not None:
        print(f"WARNING: headprobe.wrap: {warning}", file=sys.stderr, flush=True)
    loaded = wrap(ckpt, backend, first.device if device is None else device, prepend_bos, copy=True)
    if loaded.half_precision and dtype != torch.float32:
        loaded.model.float()  # its own copy: check the decomposition in float32, then round
        loaded.to(dtype)
    loaded.self_check  # noqa: B018 - as load_model: run the self-check now
    if (note := no_bos_note(loaded, prepend_bos)) is not None:
        print(f"NOTE: headprobe.wrap: {note}", file=sys.stderr, flush=True)
    return loaded
