"""A Hugging Face checkpoint read with transformers (:func:`load_checkpoint`): the model in float32
with eager attention and its tokenizer, a GGUF file through the weights cache
(:mod:`~headprobe.probe.backends.weights_cache`), without transformers' progress bars; its weights
checked finite and the checkpoint refused where headprobe cannot study it. The names, sources and
cache: :mod:`headprobe.probe.backends.loading`."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from headprobe.probe.backends.hf_tokenizers import _embedding_rows, _read_tokenizer
from headprobe.probe.backends.sources import SMOLLM2_NAME, canonical_name
from headprobe.probe.backends.sources import resolve as _resolve
from headprobe.probe.backends.tokens import refuse_unusable_tokenizer
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout.spec import Checkpoint


@contextlib.contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' and huggingface_hub's progress bars (``Loading weights``, downloads,
    ``Converting and de-quantizing GGUF tensors``) for the ``with`` body, and restore their
    previous state after it. headprobe prints its own one line per phase instead.

    The GGUF bar is a plain ``tqdm`` that no switch of transformers reaches, so the name
    ``tqdm`` in ``transformers.modeling_gguf_pytorch_utils`` is replaced for the duration.
    """
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as hf_logging

    hf_was_on = hf_logging.is_progress_bar_enabled()
    hub_was_off = hub_utils.are_progress_bars_disabled()
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover - transformers without GGUF support
        gguf_utils = None  # the module or None, read with getattr below
    gguf_tqdm = getattr(gguf_utils, "tqdm", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "cannot disable: HF_HUB_DISABLE_PROGRESS_BARS=0 has priority"
        hf_logging.disable_progress_bar()  # and huggingface_hub's bars
    if gguf_tqdm is not None:
        gguf_utils.tqdm = lambda iterable=None, *args, **kwargs: iterable
    try:
        yield
    finally:
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if hf_was_on:
                hf_logging.enable_progress_bar()
            (hub_utils.disable_progress_bars if hub_was_off else hub_utils.enable_progress_bars)()


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """For the ``with`` body, ``gguf.GGUFReader`` of a path already read returns that reader, and
    ``gguf.get_tensor_name_map`` of an (architecture, depth) already built returns that map.

    transformers parses a GGUF file anew for the tokenizer, the config and the weights (each
    ``load_gguf_checkpoint`` imports ``GGUFReader`` from ``gguf`` when called; 11 s apiece for
    SmolLM2's 49,152-token vocabulary on 2 CPU cores) and builds the whole tensor-name map again
    for each of the model's 397 modules (``get_gguf_hf_weights_map``): a cold SmolLM2 load took
    37 s, 13 s with both read once. Both are read-only after they are built; the readers (memory
    maps) are dropped when the body ends. Without the ``gguf`` package: nothing changes."""
    try:
        import gguf
    except ImportError:  # pragma: no cover - transformers then refuses a GGUF file itself
        yield
        return
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[str, Any] = {}

    def read_once(path, *args, **kwargs):
        key = str(Path(path).resolve())
        if args or kwargs:  # another mode than transformers' read-only default: not shared
            return reader(path, *args, **kwargs)
        if key not in readers:
            readers[key] = reader(path)
        return readers[key]

    module: Any = gguf  # its attributes replaced for the body (a class by a function, as transformers calls it)
    module.GGUFReader, module.get_tensor_name_map = read_once, functools.lru_cache(maxsize=None)(name_map)
    try:
        yield
    finally:
        module.GGUFReader, module.get_tensor_name_map = reader, name_map
        readers.clear()


def _load_hf(source: str, local_only: bool, gguf_file: str | None = None, split: dict[str, Any] | None = None):
    """(hf_model, tokenizer) in float32 with eager attention, without progress bars; ``split``:
    transformers' ``device_map``, ``max_memory`` and ``offload_folder`` for the model."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from headprobe.probe.model.convert import is_encoder

    kwargs: dict[str, Any] = {"local_files_only": local_only}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    from headprobe.probe.backends.devicemap import quiet_accelerate

    parsed_once = gguf_parsed_once() if gguf_file is not None else contextlib.nullcontext()
    with warnings.catch_warnings(), quiet_progress_bars(), quiet_accelerate(), parsed_once:
        warnings.simplefilter("ignore")
        tokenizer = _read_tokenizer(source, kwargs)
        config = AutoConfig.from_pretrained(source, **kwargs)
        # an encoder (BERT) has no causal LM head: load the bare model, read bidirectionally
        auto = (
            AutoModel
            if is_encoder(config.model_type) and not getattr(config, "is_decoder", False)
            else AutoModelForCausalLM
        )
        # the config just read, not read again (a GGUF file's reader is shared: gguf_parsed_once)
        model = auto.from_pretrained(
            source, config=config, dtype=torch.float32, attn_implementation="eager", **kwargs, **(split or {})
        )
    return model.eval(), tokenizer


def _load_source(name: str, kwargs: dict[str, Any], quiet: bool, split: dict[str, Any] | None = None):
    """(hf_model, tokenizer) for a resolved source; a GGUF file goes through the weights cache
    (:mod:`headprobe.probe.backends.weights_cache`). Prints one progress line to stderr unless ``quiet``.
    ``split``: see :func:`_load_hf` (a GGUF file is split only when read from its cache entry)."""
    import sys

    def say(line: str) -> None:
        if not quiet:
            print(line, file=sys.stderr, flush=True)

    if kwargs.get("gguf_file") is None:
        say(f"loading {name}{'' if kwargs['local_only'] else ': downloading from the Hugging Face hub'} ...")
        return _load_hf(**kwargs, split=split)
    from headprobe.probe.backends import weights_cache

    smollm2 = name == SMOLLM2_NAME
    return weights_cache.load_cached(
        Path(kwargs["source"]) / kwargs["gguf_file"],
        build=lambda: _load_hf(**kwargs),
        load_dir=lambda entry: _load_hf(str(entry), local_only=True, split=split),
        say=say,
        name=name,
        what="4-bit GGUF" if smollm2 else f"GGUF file {kwargs['gguf_file']}",
        extra=_native_source_file,
    )


NATIVE_SOURCE_FILE = "headprobe_native.json"
"""In a weights-cache entry of an architecture the native backend supports: the
:class:`~headprobe.probe.model.convert.NativeSource` that turns the entry's weights into the native
model, so that a warm native load needs neither transformers' model classes nor its config."""


def _native_source_file(hf_model: Any) -> dict[str, Any]:
    """The extra files of a new weights-cache entry: :data:`NATIVE_SOURCE_FILE` where the native
    backend supports the architecture."""
    from headprobe.probe.model import convert

    if not convert.supports(hf_model.config):
        return {}
    return {NATIVE_SOURCE_FILE: convert.NativeSource.of(hf_model.config).to_json()}


def check_finite_weights(model: torch.nn.Module) -> None:
    """Raise HeadprobeError naming the first parameter that holds NaN or Inf.

    A parameter whose sum is finite holds no NaN or Inf (either would make the sum NaN or
    infinite), so only a parameter with a non-finite sum (NaN/Inf, or a float overflow of finite
    values) is checked element by element; the sum is ~10x cheaper than ``isfinite(p).all()``.
    """
    for pname, p in model.named_parameters():
        if p.is_meta:  # offloaded by a device map (to disk, or to the CPU behind a GPU): not in memory to check
            continue
        if not torch.isfinite(p.detach().sum()) and not torch.isfinite(p).all():
            raise HeadprobeError(f"weights are not finite: parameter {pname} holds NaN or Inf")


def load_checkpoint(name: str = SMOLLM2_NAME, quiet: bool = False, split: dict[str, Any] | None = None) -> Checkpoint:
    """Find and load ``name`` (see the module docstring) with transformers.

    ``split``: transformers' ``device_map``, ``max_memory`` and ``offload_folder``, to load the
    model split over devices (what the transformer-lens backend does with ``device_map``).

    A GGUF file (``smollm2-135m`` included) is dequantized once and then read from the weights
    cache (see the module docstring); the tensors and tokenizer are the same either way. One
    progress line goes to stderr (``loading smollm2-135m from cache ...``) unless ``quiet``.

    Raises:
        HeadprobeError: the model cannot be found or read, a directory without tokenizer files, its
            weights hold NaN or Inf, or as :func:`refuse_unstudiable` (one line, says how to supply it).
    """
    name = canonical_name(name)
    hf_name, precision, kwargs = _resolve(name)
    try:
        hf_model, tokenizer = _load_source(name, kwargs, quiet, split)
    except HeadprobeError:
        raise
    except Exception as e:  # a third-party file can fail in any library's own way (safetensors, gguf, json, ...)
        if _gated(e):
            raise HeadprobeError(
                f"cannot load model {name}: {hf_name} is gated on the Hugging Face hub: request access at "
                f"https://huggingface.co/{hf_name}, then log in (`hf auth login`) or set HF_TOKEN; "
                "or pass a local copy (--model PATH)"
            ) from None
        msg = " ".join(str(e).split())[:300]
        raise HeadprobeError(f"cannot load model {name}: {type(e).__name__}: {msg}") from None
    check_finite_weights(hf_model)
    ckpt = Checkpoint(name, hf_name, precision, hf_model, tokenizer)
    refuse_unstudiable(ckpt)
    return ckpt


def _gated(error: BaseException) -> bool:
    """Whether ``error`` (or what it was raised from) is the hub's refusal of a gated repository without
    access: huggingface_hub's ``GatedRepoError``, or transformers' ``OSError`` naming a gated repo."""
    seen: BaseException | None = error
    while seen is not None:
        if type(seen).__name__ == "GatedRepoError" or "gated repo" in str(seen).lower():
            return True
        seen = seen.__cause__ or seen.__context__
    return False


RECURRENT_NAMED_ATTENTION = {
    t: "its *SelfAttention modules are RWKV's time mixing, a recurrence with no attention pattern"
    for t in ("rwkv", "rwkv5", "rwkv6", "rwkv7")
}
"""Hugging Face ``model_type`` -> why: attention-free models whose modules are named as attention, which
the module-name check of :func:`refuse_unstudiable` would pass."""


def refuse_unstudiable(ckpt: Checkpoint, fix: str | None = None) -> None:
    """Refuse, before any wrapping, a checkpoint headprobe cannot study: a model without attention
    layers (Mamba: no module of its named ``*Attention*``/``*Attn*``; RWKV, whose are:
    :data:`RECURRENT_NAMED_ATTENTION`), or a tokenizer that cannot be
    the model's (:func:`~headprobe.probe.backends.tokens.refuse_unusable_tokenizer`; ``fix``: what its
    message advises, None for its default).

    Raises:
        HeadprobeError: either (one line).
    """
    hf_model = ckpt.hf_model
    names = {type(m).__name__.lower() for m in hf_model.modules()}
    model_type = str(getattr(hf_model.config, "model_type", ""))
    if not any("attention" in n or "attn" in n for n in names) or model_type in RECURRENT_NAMED_ATTENTION:
        why = RECURRENT_NAMED_ATTENTION.get(model_type)
        raise HeadprobeError(
            f"{ckpt.name} ({type(hf_model).__name__}) has no attention layers: headprobe studies attention heads"
            + (f" ({why})" if why else "")
        )
    rows = _embedding_rows(hf_model)
    refuse_unusable_tokenizer(ckpt.tokenizer, rows, ckpt.name, *([fix] if fix else []))
