"""Tokenizing for every backend: what :class:`~headprobe.probe.backends.base.LoadedModel` inherits from
:class:`Tokenizing` (BOS, an encoder's ``[CLS] ... [SEP]``, padding a batch of texts, refusing ids the
embedding has no row for, the tokenizer's fingerprint). The same code on every backend: it reads only
the Hugging Face tokenizer, the layout and ``prepend_bos``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.layout.spec import ModelSpec


class Tokenizing:
    """The tokenizing members of :class:`~headprobe.probe.backends.base.LoadedModel` (a mixin; the
    attributes below are the model's, set by its ``__init__``)."""

    tokenizer: Any
    spec: ModelSpec
    prepend_bos: bool

    @property
    def bos_token_id(self) -> int | None:
        """The tokenizer's BOS id, or None if it has none; an encoder's (BERT) is its ``[CLS]``."""
        bos = getattr(self.tokenizer, "bos_token_id", None)
        if bos is None and not self.spec.causal:
            bos = getattr(self.tokenizer, "cls_token_id", None)
        return bos

    @property
    def bos_name(self) -> str:
        """What the texts call the token in front of every sequence: ``BOS`` for a decoder; for an
        encoder, the tokenizer's own token of :attr:`bos_token_id` (BERT's ``[CLS]``; ``[CLS]`` where
        it has none)."""
        if self.spec.causal:
            return "BOS"
        name = self.tokenizer.convert_ids_to_tokens(self.bos_token_id) if self.bos_token_id is not None else None
        return name if isinstance(name, str) and name else "[CLS]"

    @property
    def end_token_id(self) -> int | None:
        """The token an encoder's input ends with (BERT's ``[SEP]``) when ``prepend_bos`` (its
        special tokens are on); None for decoders and without ``prepend_bos``."""
        if self.spec.causal or not self.prepend_bos:
            return None
        return getattr(self.tokenizer, "sep_token_id", None)

    def to_tokens(
        self, text: str | Sequence[str], padding_side: str = "right"
    ) -> Int[Tensor, "batch pos"] | tuple[Int[Tensor, "batch pos"], Int[Tensor, "batch pos"]]:
        """Tokenize ``text`` into ids ``[1, pos]`` (a batch of one, as TransformerLens' ``to_tokens``),
        with exactly one BOS in front when ``prepend_bos`` (an encoder: ``[CLS]`` in front and
        ``[SEP]`` at the end, as its tokenizer would). A tokenizer that already adds BOS does not
        get a second one.

        A list of strings gives a padded batch ``(tokens [batch, pos], attention_mask [batch, pos])``:
        each text tokenized as one string would be, padded to the longest with :attr:`pad_token_id`
        after (``padding_side="right"``) or before (``"left"``) it; the mask is 1 on real tokens, 0
        on padding (Hugging Face's convention). Pass the mask on to :meth:`LoadedModel.forward`,
        :func:`~headprobe.probe.hooks.capture.capture_heads`, ...: the native backend counts positions
        over real tokens only and masks padded keys, so either side gives the unpadded numbers at
        the real tokens (tests/test_padding.py).

        Raises:
            TypeError: ``text`` is neither a string nor a list/tuple of strings.
            HeadprobeError: an empty list, ``padding_side`` not ``left``/``right``, or a token id
                outside the model's vocabulary (:meth:`check_token_ids`).
        """
        if not isinstance(text, str):
            if not isinstance(text, (list, tuple)) or not all(isinstance(t, str) for t in text):
                raise TypeError(f"to_tokens takes a string or a list of strings, got {type(text).__name__}")
            if not text:
                raise HeadprobeError("to_tokens got an empty list of texts")
            if padding_side not in ("left", "right"):
                raise HeadprobeError(
                    f"padding_side must be 'left' or 'right', got {padding_side!r}{did_you_mean(str(padding_side), ('left', 'right'))}"
                )
            from headprobe.probe.hooks.capture import pad_prompts

            return pad_prompts([self.to_tokens(t)[0] for t in text], self.pad_token_id, padding_side)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if self.prepend_bos:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        if self.end_token_id is not None and ids[-1] != self.end_token_id:  # an encoder: [CLS] ... [SEP]
            ids = [*ids, self.end_token_id]
        self.check_token_ids(ids)
        return torch.tensor([ids], dtype=torch.long)

    def check_token_ids(self, ids: Sequence[int] | Tensor, what: str = "the text") -> None:
        """Refuse token ids (``ids`` of any shape, e.g. ``[batch, pos]``, read flattened) the
        embedding has no row for (``0 <= id < spec.d_vocab``): a tokenizer
        with tokens added after the model was made (an added special token) gives such ids, and the
        forward would end in ``IndexError: index out of range in self``. Run on every id
        :meth:`to_tokens` returns and on the token sets (:mod:`headprobe.analyses.data`).

        Raises:
            HeadprobeError: an id outside the embedding's rows, named with its token and the model's vocabulary size.
        """
        flat = torch.as_tensor(ids).reshape(-1)
        n = self.spec.d_vocab
        bad = flat[(flat < 0) | (flat >= n)]
        if bad.numel():
            tid = int(bad[0])
            token = (
                self.tokenizer.convert_ids_to_tokens(tid)
                if tid >= 0 and hasattr(self.tokenizer, "convert_ids_to_tokens")  # a negative id has no token
                else None
            )
            raise HeadprobeError(
                f"{what} has token id {tid}{f' ({token!r})' if token else ''}, outside the model's "
                f"vocabulary of {n} tokens (ids 0..{n - 1}): the tokenizer has tokens the embedding "
                f"has no rows for (added after the model was made?)"
            )

    @property
    def pad_token_id(self) -> int:
        """The id :meth:`to_tokens` pads with: the tokenizer's pad token, else EOS, else BOS, else 0
        (which one does not matter: padded keys are masked and padded positions never scored)."""
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            tid = getattr(self.tokenizer, name, None)
            if isinstance(tid, int):
                return tid
        return 0

    def tokenizer_fingerprint(self) -> str:
        """A SHA-256 of the tokenizer: its whole serialisation where it is a fast (``tokenizers``)
        one (vocabulary, merges, added tokens, normalizer, pre- and post-processing), else its
        vocabulary; with its special tokens and whether BOS is prepended."""
        import hashlib
        import json

        tok = self.tokenizer
        backend = getattr(tok, "backend_tokenizer", None)
        body = backend.to_str() if backend is not None else json.dumps(sorted(tok.get_vocab().items()))
        special = json.dumps(getattr(tok, "special_tokens_map", {}), sort_keys=True, default=str)
        return hashlib.sha256(f"{body}\n{special}\n{self.prepend_bos}".encode()).hexdigest()


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
"""Files a Hugging Face model directory keeps its tokenizer in (any one of them is a tokenizer to read)."""

PLAIN_SENTENCE = "The cat sat on the mat, and then it went home."
"""Plain English text that any language model's tokenizer encodes to some tokens (a word-level
tokenizer over other words gives unknown tokens, still tokens)."""


def refuse_folder_without_tokenizer(folder: Any) -> None:
    """Refuse a local model directory ``folder`` that holds none of :data:`TOKENIZER_FILES`:
    transformers then builds a tokenizer of one token that encodes every text to nothing.

    Raises:
        HeadprobeError: no tokenizer file there (one line, says how to supply one).
    """
    from pathlib import Path

    if not Path(folder).is_dir() or any((Path(folder) / f).is_file() for f in TOKENIZER_FILES):
        return
    raise HeadprobeError(
        f"{folder} has no tokenizer (no {', '.join(TOKENIZER_FILES[:-2])} ...): save one beside the model "
        f"(tokenizer.save_pretrained(dir)) or wrap the model with its tokenizer in Python "
        f"(headprobe.wrap(hf_model, tokenizer))"
    )


def refuse_unusable_tokenizer(
    tokenizer: Any,
    n_embed: int | None,
    name: str,
    fix: str = "save the model's beside it (tokenizer.save_pretrained(dir))",
) -> None:
    """Refuse a tokenizer that cannot be the model's: fewer than 2 tokens, or one that encodes
    :data:`PLAIN_SENTENCE` to no tokens. ``n_embed``: the embedding's rows (the message's scale);
    ``fix``: what the message advises.

    Raises:
        HeadprobeError: such a tokenizer (one line).
    """
    try:
        size: int | None = len(tokenizer)
    except TypeError:
        size = None
    try:
        n_ids: int | None = len(tokenizer(PLAIN_SENTENCE, add_special_tokens=False)["input_ids"])
    except Exception:  # a third-party tokenizer may fail in its own way: left to to_tokens to report
        n_ids = None
    if (size is None or size >= 2) and n_ids != 0:
        return
    rows = f" for an embedding of {n_embed} rows" if n_embed else ""
    raise HeadprobeError(
        f"{name}'s tokenizer ({type(tokenizer).__name__}, {size} tokens{rows}) "
        f"{'encodes plain English to no tokens' if n_ids == 0 else 'is too small'}: it is not the model's "
        f"tokenizer; {fix}"
    )
