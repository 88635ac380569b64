"""Flags every command shares, defined once: the same names, choices and help in every command.

Commands call :func:`add_model_options` / :func:`add_output_options` / :func:`add_seed_option`
from their ``add_arguments``; their config dataclasses take the parsed values. Nothing here
imports torch (``headprobe budget`` must start fast): dtypes are names until :func:`torch_dtype`.
"""

from __future__ import annotations

import argparse

DTYPES = ("float32", "bfloat16", "float16")
"""Compute precisions, by torch's names."""
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
"""Short names accepted everywhere for :data:`DTYPES`."""
DEVICES = ("auto", "cpu", "cuda")
BACKENDS = ("auto", "native", "transformer-lens")
DEFAULT_MODEL = "smollm2-135m"


def positive_int(text: str) -> int:
    """argparse ``type`` for counts and lengths: an integer >= 1 (else a one-line usage error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def dtype_name(text: str) -> str:
    """argparse ``type`` for ``--dtype``: torch's name (``bfloat16``) or a short alias (``bf16``),
    returned as torch's name."""
    name = DTYPE_ALIASES.get(text.lower().removeprefix("torch."), text.lower().removeprefix("torch."))
    if name not in DTYPES:
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r}; choose one of {', '.join(DTYPES)} "
                                         f"(or {', '.join(DTYPE_ALIASES)})")
    return name


def torch_dtype(name: str):
    """The ``torch.dtype`` of a :data:`DTYPES` name (imports torch)."""
    import torch

    return getattr(torch, dtype_name(name))


def add_model_options(p: argparse.ArgumentParser, *, dtype: bool = True, backend: bool = True,
                      default_model: str | None = DEFAULT_MODEL) -> None:
    """``--model --device [--dtype] [--backend]``."""
    p.add_argument("--model", default=default_model,
                   help=f"{DEFAULT_MODEL} (default, embedded 4-bit weights), gpt2 or another Hugging Face name, "
                        "a local Hugging Face directory, a .gguf file or a headprobe checkpoint directory")
    p.add_argument("--device", default="auto", choices=DEVICES, help="auto: cuda when a GPU is present, else cpu")
    if dtype:
        p.add_argument("--dtype", default="float32", type=dtype_name, metavar="{" + ",".join(DTYPES) + "}",
                       help="compute precision (default %(default)s; bf16/fp16/fp32 accepted)")
    if backend:
        p.add_argument("--backend", default="auto", choices=BACKENDS,
                       help="native: headprobe's own transformer (auto picks it where it supports the architecture); "
                            "transformer-lens: TransformerLens' TransformerBridge around the Hugging Face model")


def add_output_options(p: argparse.ArgumentParser) -> None:
    """``--out --overwrite``."""
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace files in a non-empty output directory")


def add_text_option(p: argparse.ArgumentParser) -> None:
    """``--text``."""
    p.add_argument("--text", default=None, help="UTF-8 text file for natural text (default: CPython's pydoc_data.topics)")


def add_seed_option(p: argparse.ArgumentParser, default: int = 0) -> None:
    """``--seed``."""
    p.add_argument("--seed", type=int, default=default, help="seeds data windows, random tokens and draws (default %(default)s)")
