"""The tokenizer of a Hugging Face model as headprobe reads it (``AutoTokenizer``, except where a
directory names the generic class and transformers picks the family's), and the checks that a
tokenizer given with a model is the model's (its embedding's rows, the class it was read as). Used
by :mod:`~headprobe.probe.backends.hf_checkpoint`, :mod:`~headprobe.probe.backends.wrapping` and
:func:`headprobe.probe.backends.loading.load_tokenizer`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from headprobe.probe.backends.tokens import refuse_folder_without_tokenizer

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


def _embedding_rows(hf_model: Any) -> int | None:
    """The rows of a transformers model's input embedding (its vocabulary size), None where it has none to read."""
    get = getattr(hf_model, "get_input_embeddings", None)
    weight = getattr(get() if callable(get) else None, "weight", None)
    return int(weight.shape[0]) if isinstance(weight, torch.Tensor) else None


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
    if rows is not None and size < FEWEST_TOKENS_SHARE * rows:
        return (
            f"the tokenizer has {size} tokens for the model's embedding of {rows} rows ({size / rows:.0%}; a model's "
            f"own leaves at most a few rows of padding unused): it may not be the model's; {fix}"
        )
    return None


FEWEST_TOKENS_SHARE = 0.9
"""A tokenizer with fewer tokens than this share of the embedding's rows gets :func:`_tokenizer_warning`'s
line: models pad their vocabulary by a few rows (GPT-2 none, Qwen2.5 0.2%, Phi-3 0.2%), not by a third
(BERT's 30,522 tokens on SmolLM2's 49,152 rows: 62%)."""


def no_bos_note(model: Any, asked: bool) -> str | None:
    """Where BOS was asked for (``asked``, ``prepend_bos``) but a decoder's tokenizer has none, so its
    sequences start with the text's first token: a NOTE saying so (a first-token or attention-sink
    score then reads that token), else None."""
    if not asked or model.prepend_bos or not model.spec.causal:
        return None
    return (
        f"{model.spec.name}'s tokenizer has no BOS token: sequences start with the text's first token, not BOS "
        "(first-token and attention-sink scores read that token); pass prepend_bos=False (--no-bos) to say so"
    )
