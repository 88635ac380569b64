"""What the commands share above the settings: loading a model as the settings ask
(:func:`load_model`, :func:`load_for`), the one runner of a command (:func:`run_command`), the
one maker of a command's Python function (:func:`command_function`), and the flag blocks of
:class:`ModelRunConfig` (:func:`model_run_flags`). The settings themselves and the
flag generator are :mod:`headprobe.settings` (``check_settings`` is also importable here as
``check_config_fields``). Nothing
here imports torch at module level (``headprobe budget`` must start fast): dtypes are names until
:func:`torch_dtype`.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from headprobe.settings import (  # noqa: F401 - the shared vocabularies and flag types, re-exported
    BACKENDS,
    DEFAULT_MODEL,
    DEVICE_MAPS,
    DEVICES,
    DTYPE_ALIASES,
    DTYPES,
    FLOAT16_BRIDGE,
    OUTPUT,
    DataSettings,
    Flags,
    ModelSettings,
    OutputSettings,
    add_flags,
    add_layout,
    check_device_map,
    context_fitted,
    device_map_float32_only,
    dtype_name,
    max_memory_dict,
    parse_max_memory,
    positive_int,
)
from headprobe.settings import check_settings as check_config_fields  # noqa: F401 - an alias for importers

if TYPE_CHECKING:
    import os

    import torch

    from headprobe.analyses.data import TaskTokens
    from headprobe.probe.backends.base import LoadedModel


def torch_dtype(name: str):
    """The ``torch.dtype`` of a :data:`DTYPES` name (imports torch)."""
    import torch

    return getattr(torch, dtype_name(name))


SMOLLM2_LAYOUT = (30, 9)
"""(layers, query heads per layer) of the embedded ``smollm2-135m`` (SmolLM2-135M; checked against
the loaded model by the real-model tests)."""

SMOLLM2_KV_HEADS = 3
"""Key/value heads per layer of the embedded ``smollm2-135m`` (GQA, 3 query heads each)."""

SMOLLM2_CONTEXT = 8192
"""Context length (positions) of the embedded ``smollm2-135m`` (its ``max_position_embeddings``)."""

SMOLLM2_D_MODEL = 576
"""Residual width of the embedded ``smollm2-135m`` (its ``hidden_size``)."""


def peek_config(model: str) -> dict | None:
    """What ``model``'s config says, read without loading weights or torch (milliseconds):
    ``{"n_layers", "n_heads", "n_ctx", "n_kv_heads", "n_kv_groups", "d_model", "parallel_attn_mlp"}``
    (``n_ctx`` and ``d_model`` None where the config gives none; ``n_kv_groups``: the KV heads, or 1
    for MLA's per-layer latent; ``parallel_attn_mlp``: attention and MLP read the same residual, a
    headprobe checkpoint's ``parallel_residual`` or by the Hugging Face ``model_type``
    (:func:`headprobe.probe.layout.attention.parallel_attn_mlp_from_hf_config`), None without one),
    from the embedded ``smollm2-135m``'s layout, a Hugging Face directory's ``config.json``, a
    headprobe checkpoint directory's, or a hub name's in the local Hugging Face cache. None where it
    cannot be read that cheaply (hub names not cached, ``.gguf`` files, unreadable configs): the
    caller checks after loading instead."""
    import json

    from headprobe.probe.backends.sources import embedded

    if embedded(model) == DEFAULT_MODEL:  # case-insensitive, and before a folder of that name, as load_model reads it
        return {
            "n_layers": SMOLLM2_LAYOUT[0],
            "n_heads": SMOLLM2_LAYOUT[1],
            "n_ctx": SMOLLM2_CONTEXT,
            "n_kv_heads": SMOLLM2_KV_HEADS,
            "n_kv_groups": SMOLLM2_KV_HEADS,
            "d_model": SMOLLM2_D_MODEL,
            "parallel_attn_mlp": False,
        }
    path = _config_file(model)
    if path is None:
        return None
    try:
        cfg = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    if isinstance(cfg.get("model"), dict) and "format" in cfg:  # headprobe checkpoint
        cfg = cfg["model"]
        parallel: bool | None = bool(cfg.get("parallel_residual", False))  # TransformerConfig's default
    else:
        cfg = cfg.get("text_config", cfg) if isinstance(cfg.get("text_config"), dict) else cfg
        parallel = _hf_parallel_attn_mlp(cfg)

    def first(*keys):
        return next((cfg[k] for k in keys if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool)), None)

    layers = first("n_layers", "num_hidden_layers", "n_layer", "num_layers")
    heads = first("n_heads", "num_attention_heads", "n_head")
    n_ctx = first("n_ctx", "max_position_embeddings", "n_positions")
    kv_heads = first("num_key_value_heads", "n_kv_heads", "n_head_kv") or (1 if cfg.get("multi_query") else heads)
    kv_groups = 1 if cfg.get("kv_lora_rank") else kv_heads
    return (
        {
            "n_layers": layers,
            "n_heads": heads,
            "n_ctx": n_ctx,
            "n_kv_heads": kv_heads,
            "n_kv_groups": kv_groups,
            "d_model": first("d_model", "hidden_size", "n_embd"),
            "parallel_attn_mlp": parallel,
        }
        if layers and heads
        else None
    )


def peek_context(model: str) -> int | None:
    """``model``'s context length (positions) read without loading weights: :func:`peek_config`'s
    ``n_ctx``, else a ``.gguf`` file's ``<general.architecture>.context_length`` (the ``gguf``
    reader maps the file and parses its header; no tensor data is read). None where neither is at hand."""
    cfg = peek_config(model)
    if cfg and cfg["n_ctx"]:
        return cfg["n_ctx"]
    path = Path(model).expanduser()
    if path.suffix != ".gguf" or not path.is_file():
        return None
    try:
        from gguf import GGUFReader

        fields = GGUFReader(str(path)).fields
        arch = bytes(fields["general.architecture"].parts[-1]).decode()
        return int(fields[f"{arch}.context_length"].parts[-1][0])
    except Exception:  # an unreadable header: the loaded model's n_ctx decides
        return None


def peek_removed_heads(model: str) -> tuple[set[tuple[int, int]], str] | None:
    """``(removed heads, config.json's path)`` of a pruned checkpoint directory (``prune
    --save-pruned``'s: ``pruned.removed_heads``, one list of head indices per layer), read without
    torch; None for any other model or an unreadable config (the loaded model's
    ``spec.removed_heads`` decides then: :func:`refuse_removed`)."""
    import json

    path = Path(model).expanduser() / "config.json"
    try:
        pruned = json.loads(path.read_text(encoding="utf-8")).get("pruned")
        removed = {(layer, int(h)) for layer, hs in enumerate(pruned["removed_heads"]) for h in hs}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None
    return removed, str(path)


def refuse_removed(heads, model: str | LoadedModel) -> None:
    """Refuse ``heads`` (``(layer, head)``) that the pruned checkpoint ``model`` no longer has
    (:func:`~headprobe.probe.core.heads.check_not_removed`): a name or path read before loading
    (:func:`peek_removed_heads`), a loaded model by its ``spec.removed_heads``.

    Raises:
        HeadprobeError: one line naming the heads and the config.json that lists them."""
    import os

    from headprobe.probe.core.heads import check_not_removed

    if isinstance(model, (str, os.PathLike)):
        peeked = peek_removed_heads(str(model))
        if peeked is not None:
            check_not_removed(heads, *peeked)
        return
    removed = getattr(model.spec, "removed_heads", None) or ()
    if removed:
        where = Path(model.spec.name) / "config.json"
        check_not_removed(heads, removed, str(where) if where.is_file() else f"{model.spec.name}'s config.json")


def _config_file(model: str) -> Path | None:
    """``model``'s ``config.json``: a directory's, else a hub name's (or alias's) in the local Hugging
    Face cache (no download); None where neither is at hand."""
    local = Path(model).expanduser()
    if local.exists() or model.startswith((".", "/", "~")):
        return local / "config.json"
    from headprobe.probe.backends.sources import ALIASES, cached_config

    return cached_config(ALIASES.get(model.lower(), model))


def _hf_parallel_attn_mlp(cfg: dict) -> bool | None:
    """:func:`headprobe.probe.layout.attention.parallel_attn_mlp_from_hf_config` of a ``config.json``."""
    from types import SimpleNamespace

    from headprobe.probe.layout.attention import parallel_attn_mlp_from_hf_config

    return parallel_attn_mlp_from_hf_config(SimpleNamespace(**{str(k): v for k, v in cfg.items()}))


def peek_layout(model: str) -> tuple[int, int] | None:
    """``(n_layers, n_heads)`` of ``model`` read without loading weights (:func:`peek_config`), so
    that flags naming heads can be checked before a load; None where it cannot be read cheaply."""
    cfg = peek_config(model)
    return (cfg["n_layers"], cfg["n_heads"]) if cfg else None


def peek_token_count(model: str, text: str, prepend_bos: bool = True) -> int | None:
    """How many tokens ``model`` makes of ``text`` (BOS included where ``prepend_bos`` and the
    tokenizer has one), read without loading weights or torch: the ``tokenizers`` library over the
    model directory's ``tokenizer.json`` (the embedded ``smollm2-135m``: its weights-cache entry's).
    None where no such file is at hand; the caller counts after loading instead. For checks before
    a load only: the loaded model's own count is the one that is final."""
    import glob
    import json
    from pathlib import Path

    from headprobe.probe.backends.sources import embedded

    folder = Path(model).expanduser()
    if embedded(model) == DEFAULT_MODEL:
        from headprobe.probe.backends.weights_cache import cache_root

        root = cache_root()
        found = sorted(glob.glob(str(root / "gguf" / "SmolLM2-135M-Instruct*" / "tokenizer.json"))) if root else []
        folder = Path(found[-1]).parent if found else folder
    if not (folder / "tokenizer.json").is_file():
        return None
    try:
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        n = len(tokenizer.encode(text, add_special_tokens=False).ids)
        bos = (
            json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8-sig")).get("bos_token")
            if (folder / "tokenizer_config.json").is_file()
            else None
        )
    except Exception:
        return None
    return n + int(bool(prepend_bos and bos))


ENCODER_HINT = "headprobe scan verifies an encoder's heads by 1 - cos of its output"
"""What :func:`require_causal` points an encoder's user to."""


def peek_encoder(model: str) -> bool | None:
    """Whether ``model`` is an encoder (bidirectional attention, no next-token loss), read without loading
    weights or torch: the embedded ``all-minilm-l6-v2`` is, ``smollm2-135m`` is not; else :func:`_config_file`'s
    ``config.json``: a headprobe checkpoint's ``causal`` False, or a Hugging Face ``model_type`` of a registered
    encoder family (:func:`headprobe.probe.model.families.is_encoder_type`) not configured ``is_decoder``, as the
    loader reads it. None where no config can be read that cheaply: the loaded model's ``spec.causal`` decides."""
    import json

    from headprobe.probe.backends.sources import MINILM_NAME, embedded
    from headprobe.probe.model.families import is_encoder_type

    if (name := embedded(model)) is not None:  # the embedded models, taken from their wheels (sources.resolve)
        return name == MINILM_NAME
    path = _config_file(model)
    try:
        cfg = json.loads(path.read_text(encoding="utf-8-sig")) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(cfg, dict):
        return None
    if isinstance(cfg.get("model"), dict) and "format" in cfg:  # headprobe checkpoint
        return cfg["model"].get("causal", True) is False
    return is_encoder_type(cfg.get("model_type")) and not cfg.get("is_decoder", False)


def refuse_encoder(model: str, needs: str, hint: str | None = ENCODER_HINT) -> None:
    """:func:`require_causal`'s refusal before the load, where :func:`peek_encoder` reads ``model`` as an
    encoder (else the loaded model's ``spec.causal`` is checked as before).

    Raises:
        HeadprobeError: the model is an encoder, in the words of :func:`require_causal`."""
    from headprobe.probe.backends.sources import canonical_name

    if peek_encoder(model):
        raise _encoder_refusal(canonical_name(model), needs, hint)


def check_model(model: str) -> None:
    """Refuse, before torch loads, a ``--model`` that cannot be loaded (an unknown name, a missing
    path, a directory without config.json or weights; :func:`headprobe.probe.backends.sources.check_model`).

    Raises:
        HeadprobeError: one line.
    """
    from headprobe.probe.backends.sources import check_model as check

    check(model)


def load_model(
    name: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    device: str = "auto",
    dtype: str | torch.dtype = "float32",
    backend: str = "auto",
    prepend_bos: bool = True,
    quiet: bool = False,
    device_map: str | dict | None = None,
    max_memory: dict | str | None = None,
    offload_dir: str | None = None,
) -> LoadedModel:
    """Load ``name`` as every command's ``--model --device --dtype --backend`` flags do
    (``headprobe.load_model``): a :class:`~headprobe.probe.backends.loading.LoadedModel` that has
    run its float32 load-time self-check.

    Args:
        name: ``smollm2-135m`` (the default, offline), a Hugging Face name, a local model
            directory or a ``.gguf`` file (:func:`headprobe.probe.backends.loading.load_model`).
        device: ``auto`` (CUDA when present, as the commands), ``cuda``, ``cuda:N`` or ``cpu``.
        dtype: the weights' dtype after the self-check: ``float32``, ``bfloat16`` or ``float16``
            (or an alias, :data:`DTYPES`, or the ``torch.dtype``). Half precision: weights and activations in ``dtype``;
            attention scores and softmax, losses and importance scores in float32; rotary
            frequencies float32 (docs/engine.md, "Precision").
        backend: ``auto`` (native where supported), ``native`` or ``transformer-lens``.
        prepend_bos: put the tokenizer's BOS token in front of every sequence (once).
        quiet: print no progress line (by default one line per long phase goes to stderr).
        device_map: split the model over GPUs, CPU memory and disk with accelerate: a
            :data:`DEVICE_MAPS` strategy or (native only) ``{piece: device}``
            (:mod:`headprobe.probe.backends.devicemap`); the model is read, self-checked and cast
            on the CPU, then split; ``device`` must be ``auto`` or ``cpu``.
        max_memory: per device for a ``device_map`` strategy: a dict (bytes or sizes such as
            ``"2GiB"``, keys GPU indices, ``cpu``, ``disk``) or ``--max-memory``'s text.
        offload_dir: folder for the pieces mapped to ``disk`` (default: a temporary directory).

    Returns:
        LoadedModel: self-checked, on ``device`` in ``dtype``; its ``spec`` gives the layers, heads,
            ``d_model`` and ``n_ctx`` (:class:`~headprobe.probe.backends.loading.LoadedModel`).

    Raises:
        HeadprobeError: ``name`` not a str or path, ``prepend_bos`` or ``quiet`` not a bool, an unknown device, ``cuda``/``cuda:N`` asked for
            but absent, an unknown dtype or one of another type, ``float16`` on a
            backend without ``half_precision`` (:data:`FLOAT16_BRIDGE`), a bad ``max_memory``, a
            ``device_map`` with ``device`` ``cuda`` or, in half precision, on a backend without
            ``splits_after_load``, or the model cannot be loaded (one line each).
    """
    import os

    from headprobe.probe.backends import loading
    from headprobe.probe.core.errors import HeadprobeError, one_line_repr

    name = os.fspath(name) if isinstance(name, os.PathLike) else name
    if not isinstance(name, str):
        raise HeadprobeError(
            f"load_model(): name must be a model name or path, got {one_line_repr(name)} ({type(name).__name__})"
        )
    for setting, value in (("prepend_bos", prepend_bos), ("quiet", quiet)):
        if not isinstance(value, bool):  # "no" would read as True
            raise HeadprobeError(f"load_model(): {setting} must be True or False, got {one_line_repr(value)}")
    dtype, max_memory = _checked_load_settings(device, dtype, backend, device_map, max_memory)
    device = "cpu" if device_map is not None else loading.device_auto(device)
    split_later = device_map is not None and dtype != "float32"  # cast first: a split model's dtype is fixed
    model = loading.load_model(
        name,
        device=device,
        prepend_bos=prepend_bos,
        backend=backend,
        quiet=quiet,
        device_map=None if split_later else device_map,
        max_memory=None if split_later else max_memory,
        offload_dir=offload_dir,
    )
    if dtype == "float16" and not model.half_precision:
        raise model.lacks("half_precision", f"{model.architecture}: {FLOAT16_BRIDGE}")
    if dtype != "float32":
        model.to(torch_dtype(dtype))  # after load_model's float32 self-check (LoadedModel.to)
    if split_later:
        assert device_map is not None  # split_later says so
        model.dispatch(device_map, max_memory)
    return model


def _checked_load_settings(
    device: str, dtype: str | torch.dtype, backend: str, device_map, max_memory
) -> tuple[str, dict | None]:
    """``(dtype's torch name, max_memory as a dict)`` once :func:`load_model`'s settings are checked
    (its refusals but the model's own, before anything loads)."""
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.core.vocabulary import refuse_lacking

    try:
        dtype = dtype_name(dtype)
    except argparse.ArgumentTypeError as e:
        raise HeadprobeError(str(e)) from None
    if dtype == "float16":
        refuse_lacking(backend, "half_precision", FLOAT16_BRIDGE)
    check_device_present(device)
    max_memory = max_memory_dict(max_memory)
    check_device_map(device, device_map, max_memory)
    if device_map is not None and dtype != "float32":
        refuse_lacking(backend, "splits_after_load", device_map_float32_only(backend))
    return dtype, max_memory


def check_device_present(device: str) -> None:
    """``device`` (``--device``, ``load_model``'s) is ``auto``, ``cpu``, or ``cuda`` / ``cuda:N``
    with that GPU present (``N`` below ``torch.cuda.device_count()``): checked before anything loads.

    Raises:
        HeadprobeError: an unknown device, or a GPU that is not there (one line).
    """
    from headprobe.probe.backends.loading import require_gpu
    from headprobe.settings import check_device

    check_device(device, indexed=True)
    require_gpu(device)


def describe_model(model: LoadedModel, note: str = "") -> str:
    """A loaded model's device, precision, layout and weights, for a command's output: one line
    (``note`` at its end), and for a pruned checkpoint a second, the weights it was pruned from
    (:func:`~headprobe.probe.layout.spec.precision_lines`)."""
    from headprobe.probe.layout.spec import precision_lines

    spec = model.spec
    weights, *source = precision_lines(spec.precision)
    dtype = str(model.dtype).removeprefix("torch.")
    split = getattr(model, "device_map", None)
    where = model.device.type
    if split:  # a model split over devices (--device-map): the devices, in order of first use
        names = [f"cuda:{d}" if isinstance(d, int) else str(d) for d in split.values()]
        where = f"{', '.join(dict.fromkeys(names))} (--device-map)"
    threads = getattr(model, "threads_note", None)
    return (
        f"model {spec.name} on {where} ({dtype}): {spec.n_layers} layers x {spec.n_heads} heads ({spec.kind}, "
        f"{spec.n_kv_heads} KV head{'' if spec.n_kv_heads == 1 else 's'}); weights: {weights}"
        + (f"; {threads}" if threads else "")
        + note
        + "".join(f"\n{line}" for line in source)
    )


def require_causal(spec, needs: str, hint: str | None = None) -> None:
    """Refuse an encoder (``spec.causal`` False) for a command measured in next-token losses:
    ``"<needs>; <name> is an encoder"`` (``needs``, e.g. ``"ablate needs a causal language model
    (...)"``), then ``": <hint>"`` where given. Through tied embeddings an encoder's "loss" sits
    at chance (all-MiniLM-L6-v2: 10.19 nats, ln 30522 = 10.33): no effect to measure.

    Raises:
        HeadprobeError: the model is an encoder.
    """
    if not spec.causal:
        raise _encoder_refusal(spec.name, needs, hint)


def _encoder_refusal(name: str, needs: str, hint: str | None):
    """The HeadprobeError of :func:`require_causal` (after the load) and :func:`refuse_encoder` (before it):
    ``"<needs>; <name> is an encoder"``, then ``": <hint>"`` where given."""
    from headprobe.probe.core.errors import HeadprobeError

    return HeadprobeError(f"{needs}; {name} is an encoder" + (f": {hint}" if hint else ""))


IDLE_SAMPLE_S = 0.25
"""How long :func:`choose_threads` watches the cores to count the idle ones (seconds)."""


def choose_threads(requested: int | None = None) -> tuple[int, str]:
    """torch's CPU threads for a run, and why: ``requested`` (``--threads``); else
    ``OMP_NUM_THREADS`` where it is set; else the cores this process may use that are idle now --
    the sum of their idle shares over :data:`IDLE_SAMPLE_S` (psutil), rounded, at least 1.

    Why: torch's CPU kernels split each operation over one thread per core and wait for the
    slowest, so a thread that shares its core with a busy process slows the whole run several-fold
    (README, "On a machine shared with other jobs"; benchmarks/threads.py measures it).
    """
    import os

    if requested is not None:
        return requested, "--threads"
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    try:
        import psutil

        busy = psutil.cpu_percent(interval=IDLE_SAMPLE_S, percpu=True)
        idle = sum(1 - busy[c] / 100 for c in cores if c < len(busy))
    except Exception:  # no psutil or no per-core counters: take every core
        return len(cores), f"{len(cores)} cores (idle time not readable)"
    n = max(1, min(len(cores), round(idle)))
    return n, f"{idle:.1f} of {len(cores)} cores idle"


def set_threads(requested: int | None = None) -> str:
    """Set torch's CPU threads by :func:`choose_threads`; the header's words for it."""
    import torch

    n, why = choose_threads(requested)
    for before in _THREADS_BEFORE:  # an open threads_restored block that began before torch was imported
        if not before:
            before.append(torch.get_num_threads())
    torch.set_num_threads(n)
    return f"torch threads {n} ({why})"


MODEL_ARGS = ("model", "models", "b")
"""The settings that hold models (``diff A B``'s second is ``b``): an embedded model's name there
is no path, even where a folder of that name exists (:func:`model_paths`)."""

OUTPUT_ARGS = ("out",)
"""The settings that name the folder a run writes: never its inputs."""


def model_paths(value) -> list[str]:
    """The items of a model setting (a name, a comma-separated list or a list) that are read from
    the file system (:func:`headprobe.probe.backends.sources.reads_path`): the run's model inputs."""
    from headprobe.probe.backends.sources import reads_path

    items = value if isinstance(value, (list, tuple)) else str(value or "").split(",")
    return [str(v) for v in items if str(v).strip() and reads_path(str(v))]


def input_values(named: Mapping[str, Any]) -> list:
    """The values among a run's settings ``named`` (name -> value: the parsed flags, a Config's
    fields) that may name its inputs, for :func:`~headprobe.probe.core.io.run_inputs`: all but the
    output folder's (:data:`OUTPUT_ARGS`) and private ones, a model setting's read paths only."""
    values = [v for k, v in named.items() if k not in OUTPUT_ARGS and not k.startswith("_") and k not in MODEL_ARGS]
    return values + [model_paths(v) for k, v in named.items() if k in MODEL_ARGS]


def config_inputs(config) -> tuple[Path, ...]:
    """The paths a run of ``config`` (a Config dataclass) reads, resolved now
    (:func:`input_values` of its fields, :func:`~headprobe.probe.core.io.input_paths`): a result's
    ``inputs``, which its ``save(overwrite=True)`` never removes."""
    import dataclasses

    from headprobe.probe.core.io import input_paths

    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return tuple(input_paths(input_values(fields)))


_THREADS_BEFORE: list[list[int]] = []
"""One list per open :func:`threads_restored` block: torch's CPU threads before the block set any
(empty until torch is imported and :func:`set_threads` first sets them)."""


@contextlib.contextmanager
def threads_restored():
    """Within the block, :func:`set_threads` may set torch's CPU threads; on leaving (however the
    block ends) torch has the threads it had before: a command's Python function given a model name
    (``headprobe.scan("gpt2", threads=4)``) or :func:`headprobe.cli.main` called from Python sets
    them for its own run, not for the rest of the process. Imports no torch: where torch is not
    imported yet, the count to go back to is torch's own, read by :func:`set_threads` before it
    first sets one (``headprobe budget`` and the refusals before a run start without torch)."""
    torch = sys.modules.get("torch")
    before = [torch.get_num_threads()] if torch is not None else []
    _THREADS_BEFORE.append(before)
    try:
        yield
    finally:
        _THREADS_BEFORE.remove(before)
        torch = sys.modules.get("torch")
        if before and torch is not None and torch.get_num_threads() != before[0]:
            torch.set_num_threads(before[0])


@contextlib.contextmanager
def own_run():
    """What a command's Python function sets for its run only, as it was again once the function
    returns or raises: the stated memory budget (:func:`headprobe.probe.core.memory.budget_restored`)
    and torch's CPU threads (:func:`threads_restored`)."""
    from headprobe.probe.core import memory

    with memory.budget_restored(), threads_restored():
        yield


def load_for(config):
    """Load ``config.model`` as a command's config asks (its ``device``, ``dtype``, ``backend`` and,
    where it has one, ``prepend_bos``); see :func:`load_model`. Sets torch's CPU threads first
    (``config.threads``, :func:`set_threads`); the words for it are the model's ``threads_note``. States the
    process's working-memory budget (``config.memory_budget``, :func:`headprobe.probe.core.memory.set_budget`)."""
    from headprobe.probe.core import memory

    note = set_threads(getattr(config, "threads", None))
    memory.set_budget(getattr(config, "memory_budget", None))
    model = _load_for(config)
    model.threads_note = note
    return model


def _load_for(config):
    return load_model(
        config.model,
        device=config.device,
        dtype=config.dtype,
        backend=config.backend,
        prepend_bos=getattr(config, "prepend_bos", True),
        device_map=getattr(config, "device_map", None),
        max_memory=getattr(config, "max_memory", None),
    )


def config_and_model(
    config_cls, model: str | LoadedModel, config_fields: dict, name: str | None = None, accepts: Callable | None = None
):
    """What a command's Python function (``headprobe.scan(model, **fields)``, ...) starts with:
    ``(config, LoadedModel, load seconds or None)``.

    ``model`` is a name or path -- the config is built and its ``preflight()`` run (every check
    the settings alone decide) before the model loads as the config asks -- or a
    :class:`~headprobe.probe.backends.loading.LoadedModel`, used as given where it is
    (:func:`loaded_fields`; load seconds None: the caller loaded it, not 0 s).

    Raises:
        HeadprobeError: ``model`` of another type, bad settings, a setting given where it does
            nothing (:func:`~headprobe.settings.refuse_inert`), a ``device`` other than a loaded
            model's, or the model cannot be loaded.
        TypeError: a field ``config_cls`` does not have (naming the function ``name`` and the keywords
            of ``accepts``, the command's function, see :func:`check_fields`).
    """
    import os
    import time

    from headprobe.settings import given_in_python, refuse_inert

    check_fields(config_cls, config_fields, name, accepts=accepts)
    check_model_argument(model, name or config_cls.__name__.removesuffix("Config").lower())
    given = given_in_python(config_cls, config_fields)  # a setting that would do nothing is refused, as its flag
    if isinstance(model, (str, os.PathLike)):
        config = config_cls(model=str(model), **config_fields)
        refuse_inert(config, given)
        check_model(config.model)
        config.preflight()
        t0 = time.perf_counter()
        loaded = load_for(config)
        return config, loaded, time.perf_counter() - t0
    config = config_cls(model=model.spec.name, **loaded_fields(model, config_fields))
    refuse_inert(config, given)
    from headprobe.probe.core import memory

    memory.set_budget(getattr(config, "memory_budget", None))
    return config, model, None


def check_model_argument(model: str | os.PathLike[str] | LoadedModel, function: str) -> None:
    """Refuse a ``model`` argument of a command's Python function that is neither a name or path
    (``str``, ``os.PathLike``) nor a :class:`~headprobe.probe.backends.base.LoadedModel` (an
    object with its ``spec``).

    Raises:
        HeadprobeError: one line naming ``function`` and what ``model`` must be.
    """
    import os

    from headprobe.probe.core.errors import HeadprobeError, one_line_repr

    if not isinstance(model, (str, os.PathLike)) and not hasattr(model, "spec"):  # a LoadedModel, or one alike
        raise HeadprobeError(
            f"{function}(): model must be a model name, a path or a model loaded by headprobe.load_model, "
            f"got {one_line_repr(model)} ({type(model).__name__})"
        )


def loaded_fields(model: LoadedModel, config_fields: dict) -> dict:
    """``config_fields`` of a command run on ``model``, already loaded, with ``device`` and
    ``dtype`` set to the kind of device the model is on (``cpu``, ``cuda``) and its dtype's name:
    what the run uses and summary.json records. A loaded model runs where and as it is (it is
    never moved or cast), so a ``device`` other than ``auto`` or the model's own, or a ``dtype``
    other than the model's, is refused; so are the other load settings (:func:`_load_fields_of`).

    Raises:
        HeadprobeError: ``device``, ``dtype``, ``backend`` or ``prepend_bos`` other than the model's,
            or a ``device_map`` / ``max_memory`` (one line).
    """
    from headprobe.probe.core.errors import HeadprobeError

    config_fields = _load_fields_of(model, config_fields)
    where = getattr(getattr(model, "device", None), "type", None)  # None: a stand-in without one
    asked = config_fields.get("device", "auto")
    if where is not None and asked not in ("auto", where) and isinstance(asked, str):
        raise HeadprobeError(
            f"device={asked!r}, but the model given is loaded on {where} and runs there: leave device at "
            f"auto, or load it with headprobe.load_model(..., device={asked!r})"
        )
    fields = {**config_fields, "device": where} if where in DEVICES else dict(config_fields)
    dtype = str(getattr(model, "dtype", "")).removeprefix("torch.")
    if dtype not in DTYPES:  # a stand-in, or a dtype no setting names: the config's own check decides
        return fields
    with contextlib.suppress(argparse.ArgumentTypeError):  # a bad dtype: refused by the config's check
        if "dtype" in fields and dtype_name(fields["dtype"]) != dtype:
            raise HeadprobeError(
                f"dtype={fields['dtype']!r}, but the model given is loaded in {dtype} and runs so: leave dtype "
                f"out, or load it with headprobe.load_model(..., dtype={dtype_name(fields['dtype'])!r})"
            )
    return {**fields, "dtype": dtype}


def _load_fields_of(model: LoadedModel, config_fields: dict) -> dict:
    """``config_fields`` with ``prepend_bos`` set to ``model``'s own (what the run uses and
    summary.json records), for a model already loaded. The config's ``backend`` stays the one asked
    for; summary.json records the model's (:func:`~headprobe.probe.core.io.summary_envelope`), as on
    the command line.

    Raises:
        HeadprobeError: a ``backend`` other than ``auto`` or the model's, a ``prepend_bos`` other than
            the model's, or a ``device_map`` / ``max_memory``: settings of a load by name (one line).
    """
    from headprobe.probe.backends.base import LoadedModel as Loaded
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.core.vocabulary import chosen_at_load

    fields = dict(config_fields)
    for name in ("device_map", "max_memory"):
        if fields.get(name) is not None:
            raise HeadprobeError(
                f"{name}= applies when the model is loaded by name; the model given is loaded already: leave "
                f"{name} out, or load it with headprobe.load_model(..., {name}=...)"
            )
    if isinstance(model, Loaded):  # else a stand-in: the config's own check decides
        backend, asked = model.backend, fields.get("backend", "auto")
        if not (chosen_at_load(asked) or asked == backend):
            raise HeadprobeError(
                f"backend={fields['backend']!r}, but the model given is loaded on the {backend} backend: leave "
                f"backend at auto, or load it with headprobe.load_model(..., backend={fields['backend']!r})"
            )
    bos = getattr(model, "prepend_bos", None)
    if isinstance(bos, bool):
        if fields.get("prepend_bos", bos) != bos:
            raise HeadprobeError(
                f"prepend_bos={fields['prepend_bos']!r}, but the model given was loaded with prepend_bos={bos}: "
                f"leave it out, or load it with headprobe.load_model(..., prepend_bos={fields['prepend_bos']!r})"
            )
        fields["prepend_bos"] = bos
    return fields


def command_function(
    config_cls, run: Callable, name: str, summary: str, example: str = "", command: str | None = None
) -> Callable:
    """``headprobe <name>`` as a Python function, the same for every command that runs one model:
    ``fn(model=DEFAULT_MODEL, *, progress=False, **config_fields)`` builds ``config_cls`` from
    ``config_fields`` and the model (:func:`config_and_model`: the config's checks and
    ``preflight`` before a model named by a string loads), checks the memory plan of ``run``'s module
    where it has one (its ``batch_line``, as the command does; printed to stderr with ``progress``), calls ``run(loaded, config,
    progress=progress)`` and records the load's seconds in the result's ``load_s`` where it has one
    (None for a model given loaded: :func:`~headprobe.probe.core.reprs.load_seconds`).

    The function gets ``__name__`` ``name`` (``command``: the command's own name where it is not a
    Python name, ``import``), ``__module__`` that of ``run``, a ``__signature__``
    listing every field of ``config_cls`` but ``model`` as a keyword with its type and default, so
    ``help(headprobe.scan)`` and ``inspect.signature`` show the settings, and a docstring
    (:func:`_command_doc`) opening with ``summary`` that documents each of them. A refusal naming
    the command's flags carries a note of their Python spelling (:func:`notes_flags`).
    """
    import dataclasses
    import inspect

    result = run.__annotations__.get("return", "")
    result = result if isinstance(result, str) else getattr(result, "__name__", "")

    def fn(model: str | LoadedModel = DEFAULT_MODEL, *, progress: bool = False, **config_fields):
        with own_run():  # memory_budget= and threads= are this run's, not the process's from now on
            return call(model, progress, config_fields)

    def call(model: str | LoadedModel, progress: bool, config_fields: dict):
        from headprobe.probe.core.io import ReadsInputs

        config, loaded, load_s = config_and_model(config_cls, model, config_fields, name, accepts=fn)
        # the memory plan the command checks before its run (run_command), refused here as there
        header = getattr(sys.modules[run.__module__], "batch_line", None)
        if header is not None and (line := header(loaded, config)) and progress:
            print(for_reader(command or name, line), file=sys.stderr, flush=True)  # progress, as its bars
        out = run(loaded, config, progress=progress)
        if hasattr(out, "load_s"):  # recorded in its summary.json's timings, as run_command does
            out.load_s = load_s
        if isinstance(out, ReadsInputs):  # what out.save(overwrite=True) must not remove, as --overwrite
            out.inputs = config_inputs(config)
        return out

    def default(f):  # a field without a default is a required keyword
        if f.default is not dataclasses.MISSING:
            return f.default
        return inspect.Parameter.empty if f.default_factory is dataclasses.MISSING else f.default_factory()

    keyword = inspect.Parameter.KEYWORD_ONLY
    flags = flag_fields(config_cls)  # the command's settings: those it has a flag for
    fields = [
        f for f in dataclasses.fields(config_cls) if f.init and f.name != "model" and (flags is None or f.name in flags)
    ]
    fn.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # what inspect.signature and help() read
        [
            inspect.Parameter(
                "model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=DEFAULT_MODEL, annotation="str | LoadedModel"
            ),
            inspect.Parameter("progress", keyword, default=False, annotation="bool"),
            *[inspect.Parameter(f.name, keyword, default=default(f), annotation=f.type) for f in fields],
        ],
        return_annotation=result,
    )
    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = run.__module__
    fields_doc = [f.name for f in fields]
    fn.__doc__ = _command_doc(config_cls, fields_doc, run, command or name, summary, example, result)
    return notes_flags(command or name)(fn)


def _command_doc(config_cls, fields: list[str], run: Callable, name: str, summary: str, example: str, result: str):
    """The docstring of :func:`command_function`'s function (Google style): ``summary``, then one
    argument per setting ``fields`` of ``config_cls``, documented by its flag and the flag's help
    (:func:`headprobe.settings.field_help`), the result and the errors."""
    from headprobe.settings import field_help, flag_names, switch_value

    flags = flag_names(config_cls)

    def setting(field_name: str) -> str:
        flag, value = flags.get(field_name), switch_value(config_cls, field_name)
        via = f"``{flag}``" + (f" (``{field_name}{value}``)" if value else "")
        text = field_help(config_cls, field_name) or f"a setting of :class:`{config_cls.__name__}`."
        return f"        {field_name}: {via + ': ' if flag else ''}{text}"

    settings_doc = "\n".join(setting(f) for f in fields)
    return f"""{summary}: ``headprobe {name}`` as a function{f" (e.g. {example})" if example else ""}.

    Every setting of :class:`{config_cls.__name__}` but ``model`` is a keyword argument (its
    command-line flag is shown beside it); an unknown keyword is a ``TypeError`` naming the one meant.

    Args:
        model: a model name or path (loaded as the settings ask, after the config's checks and
            ``preflight``), or a :class:`~headprobe.probe.backends.base.LoadedModel` (used as given,
            where and as it is: ``device`` and ``dtype`` left out or the model's own).
        progress: show progress bars.
{settings_doc}

    Returns:
        The result, :class:`{result}`: ``result.save(out)`` writes the files ``headprobe {name}`` writes.

    Raises:
        HeadprobeError: bad settings (before anything loads), the model cannot be loaded, or as
            :func:`{run.__module__}.run`; a message naming flags has a note giving their Python spelling (``e.__notes__``).
        TypeError: a keyword that is not a setting of :class:`{config_cls.__name__}`.
    """


def check_fields(
    config_cls,
    config_fields: dict,
    function: str | None = None,
    positional: tuple[str, ...] = ("model",),
    accepts: Callable | None = None,
) -> None:
    """Raise ``TypeError`` naming the command's function (``function``, else the Config's name without
    ``Config``: ``scan()``, not ``ScanConfig``), the unknown setting, the nearest valid one
    (:func:`nearest_keyword`) and every keyword the function takes (:func:`accepted_keywords` of
    ``accepts``, the function itself), for a keyword ``config_cls`` does not have (``positional``:
    fields the function takes as arguments, not through ``config_fields``). Without ``accepts``
    the list is the Config's fields, ``positional`` first."""
    import dataclasses

    names = [f.name for f in dataclasses.fields(config_cls)]
    flags = flag_fields(config_cls)  # a field the command has no flag for is not the function's either
    valid = [n for n in names if n not in positional and (flags is None or n in flags)]
    for name in config_fields:
        if name not in valid:
            named = (
                accepted_keywords(accepts, config_cls, positional)
                if accepts is not None
                else [*(n for n in positional if n in names), *valid]
            )
            near = nearest_keyword(name, named)
            hint = (
                _flag_hint(name, config_cls, named)
                or output_hint(name, config_cls)
                or (f"; did you mean {near}?" if near else "")
            )
            command = function or config_cls.__name__.removesuffix("Config").lower()
            raise TypeError(f"{command}() got an unknown setting {name!r}{hint} (settings: {', '.join(named)})")


def flag_fields(config_cls) -> set[str] | None:
    """The fields of ``config_cls`` that its command sets by a flag (the ``dest`` of each flag its
    parser has: :meth:`~headprobe.commands.Command.add_flags`), the settings its Python function
    takes; None where ``config_cls``'s module has no ``COMMAND`` of that Config (then every field).
    A Config shared through inheritance (``ImportConfig`` is ``ScanConfig``'s) has fields its
    command has no flag for (import's ``types``, ``verify``): the function refuses them as the parser
    does."""
    import argparse
    import dataclasses

    command = getattr(sys.modules.get(config_cls.__module__), "COMMAND", None)
    if command is None or command.config_class() is not config_cls:
        return None
    parser = argparse.ArgumentParser(add_help=False)
    command.add_flags(parser)
    return {a.dest for a in parser._actions} & {f.name for f in dataclasses.fields(config_cls)}


def accepted_keywords(function: Callable, config_cls, positional: tuple[str, ...] = ("model",)) -> list[str]:
    """The keywords a command's Python ``function`` takes, in the order of its signature
    (``inspect.signature``: a generated function's ``__signature__``): its named parameters but the
    private ones (``_name``), then, where it takes ``**fields``, the fields of ``config_cls`` it passes
    on (all but ``positional`` and those already named)."""
    import dataclasses
    import inspect

    params = inspect.signature(function).parameters.values()
    named = [p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and not p.name.startswith("_")]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        flags = flag_fields(config_cls)
        named += [
            f.name
            for f in dataclasses.fields(config_cls)
            if f.name not in {*named, *positional} and (flags is None or f.name in flags)
        ]
    return named


def _flag_hint(name: str, config_cls, valid: list[str]) -> str | None:
    """``; the flag --fixed-draws is the setting sequential=False`` where ``name`` spells a flag
    (``fixed_draws``, ``no_bos``, ``top_k``) of a setting in ``valid`` that has another name, or is the
    ``X`` of a ``--no-X`` switch whose setting is not ``X`` (``bos``: ``--no-bos`` is ``prepend_bos=False``);
    None otherwise."""
    from headprobe.settings import flag_spellings, switch_value

    def spells(flag: str, field_name: str) -> bool:
        underscored = flag.lstrip("-").replace("-", "_")
        return underscored == name or (underscored == f"no_{name}" and switch_value(config_cls, field_name) == "=False")

    for field_name, flags in flag_spellings(config_cls).items():
        flag = next((x for x in flags if spells(x, field_name)), None)
        if flag is not None and field_name in valid:
            return f"; the flag {flag} is the setting {field_name}{switch_value(config_cls, field_name)}"
    return None


def output_hint(name: str, config_cls) -> str | None:
    """``; formats is an output setting: ...`` where ``name`` is a flag of the command whose Config
    is ``config_cls`` that its Python function does not take because it says where and how the
    files are written (``--out``, ``--overwrite``, ``--formats``, ``scan --html``, ``budget --json``,
    ``show --prompt-file``: the fields of its flag blocks other than the Config's): where the
    setting goes in Python (:func:`_output_place`). None otherwise. The command is the ``COMMAND``
    of ``config_cls``'s module (imported already: this module imports no command).
    """
    command = getattr(sys.modules.get(config_cls.__module__), "COMMAND", None)
    if command is None or command.config_class() is not config_cls:
        return None
    place = _output_place(command, name)
    if place is None:
        return None
    call, function = place
    said = f"; {name} is an output setting: "
    if name == "out":
        return f"{said}pass the folder to {call}"
    if name in ("json", "latex"):
        return f"{said}{function}() returns the result; {call} is what --{name} prints"
    if name == "prompt_file":
        return "; prompt_file is a flag of the command line: pass the file's text as prompt="
    return f"{said}pass it to {call}"


def _output_place(command, name: str) -> tuple[str, str] | None:
    """``(call, function)``: where output setting ``name`` of :class:`~headprobe.commands.Command`
    ``command`` goes in Python -- ``result.save(path)`` (``out``), ``result.save(path,
    formats="png")`` (a keyword of the result's ``save``), ``result.to_dict()`` (``json``), ``result.latex()`` (``latex``) or
    ``prompt=`` (``prompt_file``) -- and the name of the command's function; None where ``name``
    is not a field of the command's flag blocks other than its Config's, or has no such place.
    The result class (the function's return annotation) is imported now (a refusal, not a run)."""
    import dataclasses
    import inspect

    config_cls = command.config_class()
    blocks = [b.settings for b in command.flags if b.settings is not None and b.settings is not config_cls]
    owner = next((s for s in blocks if name in {f.name for f in dataclasses.fields(s)}), None)
    function = command.function()
    if owner is None or function is None:
        return None
    returned = inspect.signature(function).return_annotation
    result = returned if inspect.isclass(returned) else getattr(inspect.getmodule(function), str(returned), None)
    save = getattr(result, "save", None)
    params = dict(inspect.signature(save).parameters) if save is not None else {}
    params.pop("self", None)
    if save is not None and name == "out":
        return "result.save(path)", function.__name__
    if name in params:
        value = "True" if isinstance(params[name].default, bool) else '"png"' if name == "formats" else "..."
        return f"result.save(path, {name}={value})", function.__name__
    if name == "json" and hasattr(result, "to_dict"):
        return "result.to_dict()", function.__name__
    if name == "latex" and hasattr(result, "latex"):
        return "result.latex()", function.__name__
    if name == "prompt_file":
        return "prompt=<the file's text>", function.__name__
    return None


_OTHER_COMMAND = re.compile(r"\bheadprobe ([a-z]+)\b")
"""``headprobe ablate``: a command named in a message; its flags follow it, or precede ``of`` it."""


def flag_note(command: str, message: str) -> str | None:
    """``in Python: --n-random is n_random=, --no-bos is prepend_bos=False, --out is
    result.save(path)``: the Python spelling of each flag of ``headprobe <command>`` that the
    refusal ``message`` names (:data:`~headprobe.probe.core.errors.FLAG_IN_MESSAGE`), for a caller of the command's function. A flag that
    is a keyword of the function is that keyword (a switch: its value); an output flag the function
    does not take is where it goes in Python (:func:`_output_place`). Left out: flags the command
    does not have, flags of another command named beside them (``give the --out folder of headprobe
    train``, ``headprobe budget --seq-len``), and flags whose keyword the message spells already
    (``--overwrite (overwrite=True in Python)``). None where none is left, or ``command`` is not
    registered (or ``headprobe.commands`` not imported: a command's function imports it first)."""
    said = _python_spellings(command, message)
    return "in Python: " + ", ".join(f"{flag} is {python}" for flag, python in said.items()) if said else None


def _python_spellings(command: str, message: str) -> dict[str, str]:
    """:func:`flag_note`'s spellings: each flag ``message`` names -> its Python spelling
    (``n_random=``, ``sequential=False``, ``result.save(path)``), in the order named; {} where none."""
    from headprobe.probe.core.errors import FLAG_IN_MESSAGE

    commands = sys.modules.get("headprobe.commands")  # above this layer: read, never imported from here
    if commands is None:
        return {}
    COMMANDS = commands.COMMANDS
    entry = COMMANDS.get(command) if command in COMMANDS else None  # None: a function of no registered command
    function = entry.function() if entry is not None else None
    if entry is None or function is None:
        return {}
    parser = argparse.ArgumentParser(add_help=False)
    entry.add_flags(parser)
    actions = {flag: action for action in parser._actions for flag in action.option_strings}
    keywords = set(accepted_keywords(function, entry.config_class(), positional=()))  # budget's model= too
    others = set(COMMANDS.names()) - {command}
    said: dict[str, str] = {}
    for clause in re.split(r"[;()]", message):
        before_other = [m.start() for m in _OTHER_COMMAND.finditer(clause) if m.group(1) in others]
        for match in FLAG_IN_MESSAGE.finditer(clause):
            flag, action = match.group(1), actions.get(match.group(1))
            after = re.match(r" (?:\S+ )?of headprobe ([a-z]+)\b", clause[match.end() :])
            if action is None or flag in said or any(start < match.start() for start in before_other):
                continue
            if (after and after.group(1) in others) or re.search(rf"\b{action.dest}=", message):
                continue
            if action.dest in keywords:
                switch = f"{action.const}" if action.nargs == 0 and isinstance(action.const, bool) else ""
                said[flag] = f"{action.dest}={switch}"
            elif (place := _output_place(entry, action.dest)) is not None:
                said[flag] = place[0]
    return said


def in_python(command: str, line: str) -> str:
    """``line``, a line a run of ``headprobe <command>`` prints, as a caller of its Python function
    reads it: each flag that is a keyword of the function spelled as the keyword, with the number
    after it (``use --n-random 19 or more`` -> ``use n_random=19 or more``, ``(--keep-n-random)`` ->
    ``(keep_n_random=True)``; :func:`flag_note`'s spellings). Other flags stay as they are."""
    from headprobe.probe.core.errors import FLAG_IN_MESSAGE

    said = {f: p for f, p in _python_spellings(command, line).items() if re.fullmatch(r"\w+=\w*", p)}

    def spell(match: re.Match) -> str:
        flag, number = match.group(1), match.group(2)
        if flag not in said:
            return match.group(0)
        python = said[flag]
        if not python.endswith("="):  # a switch: its value, then whatever followed
            return python + (f" {number}" if number else "")
        return python + number if number else python[:-1]

    return re.sub(FLAG_IN_MESSAGE.pattern + r"(?: (-?\d[\d.]*))?", spell, line)


_Function = TypeVar("_Function", bound=Callable[..., Any])


def for_reader(command: str, text: str) -> str:
    """``text`` of ``headprobe <command>`` as its reader calls it: unchanged in the command line's run
    (:func:`~headprobe.probe.core.io.command_words` set), its flags as keywords (:func:`in_python`) in
    a Python call or a result's method called from Python (``--no-verify`` -> ``verify=False``)."""
    from headprobe.probe.core.io import command_words

    if command_words() is not None:
        return text
    return "\n".join(in_python(command, line) if "--" in line else line for line in text.split("\n"))


def reports_for_readers(command: str) -> Callable[[_Function], _Function]:
    """Decorator of a result's ``report()`` method: its text through :func:`for_reader`."""
    import functools

    def wrap(report: _Function) -> _Function:
        @functools.wraps(report)
        def spoken(self, *args, **kwargs):
            return for_reader(command, report(self, *args, **kwargs))

        return spoken  # type: ignore[return-value]

    return wrap


def notes_flags(command: str) -> Callable[[_Function], _Function]:
    """Decorator of the Python function of ``headprobe <command>``: a ``HeadprobeError`` raised in
    a call of it whose message names flags of the command (``--n-random must be at least 1``)
    leaves with a note giving their Python spelling (:func:`flag_note`, ``BaseException.add_note``),
    the same exception object, its message untouched: the command line prints the message alone
    (``str(error)``), a traceback shows the note below it. Only the outermost command function
    called notes (one run inside another: the flags of the function the caller called), and none
    in the command line's run (:func:`~headprobe.probe.core.errors.python_note`). The output folders
    the call claims (:func:`~headprobe.probe.core.outlock.output_claims`) are held until it returns."""
    import functools

    from headprobe.probe.core.errors import python_note
    from headprobe.probe.core.outlock import output_claims

    def decorate(function: _Function) -> _Function:
        @functools.wraps(function)
        def noting(*args: Any, **kwargs: Any) -> Any:
            with python_note(lambda message: flag_note(command, message)), output_claims():
                return function(*args, **kwargs)

        return noting  # type: ignore[return-value]

    return decorate


def nearest_keyword(name: str, valid: list[str]) -> str | None:
    """The valid keyword ``name`` most likely means: the closest spelling (difflib, as Python's own
    ``did you mean``), else one that ``name`` ends with as its last word (a flag's spelling:
    ``top_k`` for ``k``, whose flag is ``--top-k``); None when none is near."""
    import difflib

    key = name.replace("-", "_").lower()
    near = difflib.get_close_matches(key, valid, n=1)
    if near:
        return near[0]
    return next((v for v in sorted(valid, key=len, reverse=True) if key.endswith("_" + v)), None)


_Run = TypeVar("_Run", bound="ModelRunConfig")


@dataclass(frozen=True)
class ModelRunConfig(ModelSettings, DataSettings):
    """The settings every command that runs a model on natural text and repeated random tokens
    shares (``ablate``, ``prune``): :class:`~headprobe.settings.ModelSettings` and
    :class:`~headprobe.settings.DataSettings` composed (the fields and their help are declared
    there). ``n_natural`` sequences are used, as many more, disjoint, are the reference (ablate:
    mean/resample source; prune: the held-out curve). A command's config derives from it and adds
    its own fields. Invalid values raise :class:`~headprobe.probe.core.errors.HeadprobeError` when the
    config is made. ``seq_len`` and ``period`` default to what fits the model's context, as
    ``scan``'s do (:meth:`resolved`)."""

    seq_len: int | None = context_fitted("seq_len")
    period: int | None = context_fitted("period")

    def resolved(self: _Run, spec, trained_periods: tuple[int, int, int] | None = None) -> _Run:
        """This config with ``seq_len`` and ``period`` set for ``spec`` (a ModelSpec): as given, or
        fitted to its context (:func:`headprobe.analyses.data.fit_lengths`, with ``trained_periods``
        of a model ``headprobe train`` made). What the run computes with and summary.json records.

        Raises:
            HeadprobeError: a given length that does not fit the context, in one line.
        """
        from headprobe.analyses.data import fit_lengths

        seq_len, period = fit_lengths(spec.n_ctx, self.seq_len, self.period, trained_periods)
        return replace(self, seq_len=seq_len, period=period)

    def preflight(self) -> None:
        """Check, without loading weights, what the settings and files alone decide (here: the
        text file; a command adds its own checks).

        Raises:
            HeadprobeError: a bad text file.
        """
        from headprobe.probe.core.io import open_text_file

        if self.text:
            open_text_file(self.text)

    def task_tokens(self, model: LoadedModel) -> TaskTokens:
        """``model``'s token sets of this (resolved) config: :func:`headprobe.analyses.data.task_tokens`
        with ``n_natural``, ``seq_len``, ``n_repeated``, ``period``, ``seed`` and the ``--text`` file (or
        the default text).

        Raises:
            HeadprobeError: a bad text file, or as :func:`~headprobe.analyses.data.task_tokens`.
        """
        from headprobe.analyses.data import task_tokens
        from headprobe.probe.core.io import open_text_file

        assert self.seq_len is not None and self.period is not None  # set by resolved
        text = open_text_file(self.text) if self.text else None
        source = str(self.text) if self.text else None
        return task_tokens(
            model, self.n_natural, self.seq_len, self.n_repeated, self.period, self.seed, text, source=source
        )


def model_run_flags(n_natural_help: str = "") -> tuple[Flags, ...]:
    """The flag blocks of a command that runs a model on text and writes a directory (``ablate``,
    ``prune``), generated from :class:`ModelRunConfig`'s settings: the model's (``--no-bos`` as
    scan's), the output's, the data's (``n_natural_help``: the command's own help of ``--n-natural``)."""
    return (
        Flags(group=ModelSettings),
        OUTPUT,
        Flags(group=DataSettings, helps={"n_natural": n_natural_help} if n_natural_help else None),
    )


@contextlib.contextmanager
def process_group(device: str = "auto"):
    """Around a command's ``main``: join the process group that ``torchrun`` describes
    (:func:`headprobe.analyses.distributed.init_from_env`; gloo on CPU, NCCL on CUDA for
    ``device``) and leave it at the end, however the block ends. Yields whether a multi-rank
    group is active (False in a single process, which never imports ``torch.distributed``).

    Raises:
        HeadprobeError: as :func:`~headprobe.analyses.distributed.init_from_env`.
    """
    from headprobe.analyses import distributed

    sharded = distributed.init_from_env(device)
    try:
        yield sharded
    finally:
        distributed.shutdown()


@dataclass(frozen=True)
class Run:
    """How :func:`run_command` runs one command (what differs between commands; the steps are the same).

    Attributes:
        core: the module with ``run(model, config, progress=..., [resume=..., on_save=...])``,
            imported only once the settings are checked (the computation needs torch).
        resumed: a short account of a checkpoint's state (``"12 head ablations done"``): the run is
            resumable, its checkpoint kept in ``--out`` (:class:`~headprobe.probe.core.io.RunCheckpoint`); None: not resumable.
        note: a line printed before the model loads (``NOTE: ...``), or None.
        sharded: what a multi-rank run splits, for the model line (``"verification"``), or ``""``.
        save: keyword arguments of the result's ``save`` beyond ``out`` and ``overwrite``.
        models: the model folders the run writes in ``--out`` (``prune --save-pruned``'s
            ``pruned_model``): any other model there refuses ``--out`` (:func:`~headprobe.probe.core.io.check_no_model`).
    """

    core: str
    resumed: Callable[[dict], str] | None = None
    note: str | None = None
    sharded: str = ""
    save: dict = field(default_factory=dict)
    models: tuple[str, ...] = ()


FIGURE_SUFFIXES = (".png", ".pdf", ".svg")


def wrote_tables(paths: list, out: Path) -> str:
    """``wrote 9 files to out/ (policy.json, curve.csv, summary.json; 6 figure files, PNG and PDF)``:
    every file but the figures by name and the figures counted with their formats, all computed
    from ``paths``, so none is left unsaid."""
    names = [Path(p).name for p in paths if Path(p).suffix not in FIGURE_SUFFIXES]
    formats = [s[1:].upper() for s in FIGURE_SUFFIXES if any(Path(p).suffix == s for p in paths)]
    n_fig = len(paths) - len(names)
    figures = f"; {n_fig} figure file{'' if n_fig == 1 else 's'}, {' and '.join(formats)}" if n_fig else ""
    return f"\nwrote {len(paths)} files to {out}/ ({', '.join(names)}{figures})"


RUN_ONLY = ("threads", "memory_budget", "max_batch")
"""Config fields that change how fast a run goes, not what it computes (the sweep is the same at
any batch size): left out of a checkpoint's key, so a run that ran out of memory resumes with a smaller
``--memory-budget`` or ``ablate --max-batch``."""


def checkpoint_key(config) -> dict:
    """The fields of ``config`` that a resumed run must share with the run that saved the checkpoint,
    ``model`` as the model it loads (:func:`~headprobe.probe.backends.sources.canonical_name`: the
    built-in names are case-insensitive, ``SmolLM2-135M`` resumes a ``smollm2-135m`` run)."""
    from headprobe.probe.backends.sources import canonical_name

    key = {k: v for k, v in asdict(config).items() if k not in RUN_ONLY}
    if isinstance(key.get("model"), str):
        key["model"] = canonical_name(key["model"])
    return key


def checkpoint_describer(config_cls):
    """``describe(name, value) -> (label, text)`` for a checkpoint's settings-mismatch message:
    each setting as the flag that sets it (``sequential`` is ``--fixed-draws``, given or not),
    a list comma-joined, an unset value or the field's default ``default``."""
    import dataclasses
    import functools
    import json

    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.settings import flag_names, switch_value

    flags = flag_names(config_cls)

    @functools.cache
    def defaults() -> dict:  # made only for a refusal's message, not for every run that resumes
        try:  # the defaults as a checkpoint's key stores them (resolved by the config, JSON: tuples as lists)
            return json.loads(json.dumps(dataclasses.asdict(config_cls()), default=str))
        except (TypeError, HeadprobeError):  # a config that needs arguments: no default is named
            return {}

    def describe(name: str, value) -> tuple[str, str]:
        flag = flags.get(name)
        if flag is None:
            return name, repr(value)
        switch = switch_value(config_cls, name)
        if switch:
            return flag, "given" if value == (switch == "=True") else "not given"
        if value is None or (isinstance(value, list) and value == defaults().get(name)):
            return flag, "default"
        if isinstance(value, list):
            return flag, ",".join(map(str, value))
        return flag, str(value)

    return describe


def _resume(out: str, overwrite: bool, config, module, sharded: bool, main_rank: bool):
    """``(state or None, the checkpoint this rank saves or None, checkpoints found, the inputs
    recorded by each one holding a state)`` of a resumable run; see :func:`run_command`."""
    from headprobe.analyses import distributed
    from headprobe.probe.core.io import RunCheckpoint, shard_checkpoint_name

    key, describe = checkpoint_key(config), checkpoint_describer(type(config))
    checkpoint = RunCheckpoint(out, key, describe=describe)
    merge = getattr(module, "merge_states", None)
    if merge is not None:  # every rank reads every checkpoint before any rank writes one
        found = RunCheckpoint.shards(out, key, describe)
        states = [c.load(overwrite) for c in found]
        if sharded:
            name = shard_checkpoint_name(distributed.rank(), distributed.world_size())
            checkpoint = RunCheckpoint(out, key, name, describe)
        return merge(states), checkpoint, found, [c.recorded_inputs for c, st in zip(found, states) if st]
    loaded = (checkpoint.load(overwrite), checkpoint.recorded_inputs) if main_rank or not sharded else None
    saved, recorded = distributed.broadcast_object(loaded)
    return saved, checkpoint if main_rank else None, [checkpoint], [recorded] if saved else []


INPUT_NAMES = {"text": "another text", "weights": "other model weights", "tokenizer": "another tokenizer"}
"""What a checkpoint records it was computed from (:func:`run_inputs`), as said when one differs."""


def run_inputs(config) -> dict[str, str]:
    """Fingerprints of what a resumable run computes from beyond its settings: ``text`` (SHA-256 of
    the bytes of ``--text`` a run may read, :data:`~headprobe.probe.core.io.MAX_TEXT_READ_BYTES` at
    most, or of the built-in text), read before the model loads; :func:`model_inputs` adds the model's.

    Raises:
        HeadprobeError: the ``--text`` file cannot be read.
    """
    import hashlib

    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.core.io import MAX_TEXT_READ_BYTES

    out = {}
    if hasattr(config, "text"):
        if config.text is None:
            from headprobe.analyses.data import default_text

            data = default_text().encode()
        else:
            try:
                with open(config.text, "rb") as f:
                    data = f.read(MAX_TEXT_READ_BYTES)
            except OSError as e:
                raise HeadprobeError(f"cannot read text file {config.text}: {e.strerror}") from None
        out["text"] = hashlib.sha256(data).hexdigest()
    return out


def model_inputs(model: LoadedModel) -> dict[str, str]:
    """The fingerprints of a loaded ``model`` a checkpoint records beside :func:`run_inputs`' text:
    ``weights`` and ``tokenizer`` (:meth:`~headprobe.probe.backends.base.LoadedModel.weights_fingerprint`,
    :meth:`~headprobe.probe.backends.base.LoadedModel.tokenizer_fingerprint`)."""
    return {"weights": model.weights_fingerprint(), "tokenizer": model.tokenizer_fingerprint()}


def _same_inputs(
    saved, found: list, recorded: list[dict], inputs: dict[str, str], out: str, overwrite: bool, main_rank: bool
):
    """``saved``, or None when a checkpoint holding it was computed from other ``inputs`` and
    ``overwrite`` (its files removed: the run starts over, and says so).

    Raises:
        HeadprobeError: other inputs without ``overwrite``, naming which differ.
    """
    from headprobe.probe.core.errors import HeadprobeError

    differ = [k for k in inputs if any(r.get(k) != inputs[k] for r in recorded)]
    if not saved or not differ:
        return saved
    what = (
        " and ".join(INPUT_NAMES.get(k, k) for k in differ)
        if all(recorded)
        else "inputs it does not record (no fingerprints of its text, weights and tokenizer)"
    )
    if not overwrite:
        raise HeadprobeError(
            f"the checkpoint in {out}/ was computed from {what} (same settings); pass --overwrite to start over"
        )
    if main_rank:
        print(f"starting over: the checkpoint in {out}/ was computed from {what}", flush=True)
        for c in found:
            c.clear()
    return None


def say_replaced_and_kept(out: str | Path) -> None:
    """Print, after a command wrote ``out``, which previous run its ``--overwrite`` replaced (its
    command and file count, :func:`~headprobe.probe.core.io.replaced_run`; nothing where ``out`` was
    empty or the run resumed there) and which files it kept (:func:`kept_line`): every command that
    writes a folder says both so."""
    from headprobe.probe.core.io import replaced_run

    if (replaced := replaced_run(out, forget=True)) is not None:
        print(replaced.line(out))
    if kept := kept_line(out):
        print(kept)


def kept_line(out: str | Path) -> str | None:
    """The line that says which files in ``out`` an ``--overwrite`` left because headprobe did not
    write them (:func:`~headprobe.probe.core.io.foreign_files`), or None when there are none."""
    from headprobe.probe.core.io import foreign_files

    kept = foreign_files(out)
    if not kept:
        return None
    shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
    return f"kept {len(kept)} file{'s' * (len(kept) != 1)} that no headprobe run recorded in {out}/: {shown}"


@contextlib.contextmanager
def out_as_it_was(out: str | Path, main_rank: bool = True):
    """Leave ``out`` as it was when the block fails (:class:`HeadprobeError`: the checkpoints the run
    added are removed, as resuming would fail alike; other errors and interruptions keep them, to
    resume), and remove it when the run created it and it is empty then. Writing goes through a
    staging folder (:func:`~headprobe.analyses.outputs.write_outputs`), so no other file is added."""
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.core.io import CHECKPOINT_GLOB

    out = Path(out)
    existed = out.exists()
    had = {p.name for p in out.glob(CHECKPOINT_GLOB)} if out.is_dir() else set()
    try:
        yield
    except BaseException as e:
        if main_rank and out.is_dir():
            if isinstance(e, HeadprobeError):
                for p in out.glob(CHECKPOINT_GLOB):
                    if p.name not in had:
                        p.unlink(missing_ok=True)
            if not existed and not any(out.iterdir()):
                out.rmdir()
        raise


def run_command(args: argparse.Namespace, config, how: Run) -> int:
    """The ``main`` of every command that loads one model and writes a directory (``scan``,
    ``ablate``, ``prune``, ``patch``): check the settings (``config.preflight()``) and ``--out``
    before the model loads, pick up the checkpoint an interrupted run of the same config wrote
    (resumable commands, ``how.resumed``), load the model (:func:`load_for`), run ``how.core``'s
    ``run`` (imported only now), save the result (``summary.json`` last), drop the checkpoint,
    print the report and the files written. Ctrl-C and SIGTERM end the run between writes
    (:mod:`headprobe.cli` says so); progress bars only on the main rank.

    Under ``torchrun --nproc-per-node N`` (``WORLD_SIZE > 1``) every rank runs this: it joins the
    process group (:func:`headprobe.analyses.distributed.init_from_env`), reads the checkpoints,
    waits for all ranks, and runs ``core.run``, which shards its work. Where ``core`` has
    ``merge_states`` (its work is sharded by job) every checkpoint in ``--out`` is read and merged
    -- the one-process one and each rank's of a sharded run with any N, with or without torchrun
    now -- and each rank saves its own (:func:`~headprobe.probe.core.io.shard_checkpoint_name`); else
    rank 0 reads and saves the one checkpoint and hands the state to the others. Only rank 0
    prints, writes the outputs and removes the checkpoints.

    Raises:
        HeadprobeError: bad settings, a bad ``--out``, or as ``run`` (``--out`` left as it was: :func:`out_as_it_was`).
    """
    from headprobe.analyses import distributed
    from headprobe.probe.core.io import prepare_output_dir

    with process_group(config.device) as sharded:
        main_rank, resumable = distributed.is_main(), how.resumed is not None
        check_model(config.model)
        config.preflight()
        prepare_output_dir(args.out, args.overwrite, create=False, resumable=resumable, models=how.models)
        with out_as_it_was(args.out, main_rank):
            _run_checked(args, config, how, sharded, main_rank, resumable)
        distributed.barrier()
    return 0


def _run_checked(args: argparse.Namespace, config, how: Run, sharded: bool, main_rank: bool, resumable: bool) -> None:
    """:func:`run_command` once the settings and ``--out`` are checked."""
    import importlib
    import time

    from headprobe.analyses import distributed
    from headprobe.probe.core.io import RunCheckpoint

    module = importlib.import_module(how.core)
    saved, checkpoint, found, recorded = (
        _resume(args.out, args.overwrite, config, module, sharded, main_rank) if resumable else (None, None, [], [])
    )
    distributed.barrier()  # every rank has checked --out (and read its checkpoint) before rank 0 writes
    inputs = run_inputs(config) if resumable else {}
    saved = _same_inputs(
        saved, found, recorded, inputs, args.out, args.overwrite, main_rank
    )  # the text: before loading
    if how.note and main_rank:  # said before anything runs
        print(f"NOTE: {how.note}", flush=True)
    t0 = time.perf_counter()
    model = load_for(config)
    load_s = time.perf_counter() - t0
    if main_rank:
        what = f"{how.sharded} sharded" if how.sharded else "sharded"
        print(describe_model(model, f"; {what} over {distributed.world_size()} ranks" if sharded else ""), flush=True)
    if resumable:  # what the checkpoint was computed from, and what it is saved with
        inputs = {**inputs, **model_inputs(model)}  # the text's, read before loading, and the model's
        saved = _same_inputs(saved, found, recorded, inputs, args.out, args.overwrite, main_rank)
        if checkpoint is not None:
            checkpoint.inputs = inputs
    if saved and main_rank:
        assert how.resumed is not None  # a resumable command says what its checkpoint holds
        print(f"resuming from {', '.join(str(c.path) for c in found if c.path.is_file())} ({how.resumed(saved)})")
    header = getattr(module, "batch_line", None)  # the batch sizes planned from memory; refuses what cannot fit
    if header is not None and (line := header(model, config)) and main_rank:
        print(line, flush=True)
    resume = {"resume": saved, "on_save": checkpoint.save if checkpoint is not None else None} if resumable else {}
    result = module.run(model, config, progress=main_rank, **resume)
    if hasattr(result, "load_s"):  # recorded in its summary.json's timings
        result.load_s = load_s
    if main_rank:  # the others computed the same result
        # resumable: only checkpoints can be in --out unless --overwrite (checked above)
        paths = result.save(args.out, overwrite=resumable or args.overwrite, **how.save)
        for c in RunCheckpoint.shards(args.out, checkpoint_key(config)) if resumable else ():
            c.clear()
        print()
        print(result.report())
        print(wrote_tables(paths, Path(args.out)))
        say_replaced_and_kept(args.out)
