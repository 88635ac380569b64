"""Tokenizers for models headprobe trains from scratch (``headprobe train``, ``headprobe study``):
word level over random tokens, character level over ASCII text. Built with ``tokenizers`` and
wrapped for transformers; a trained checkpoint saves its tokenizer beside the weights, and
:func:`headprobe.probe.backends.native_loading.load_native` reads it back with ``AutoTokenizer``.
"""

from __future__ import annotations

from pathlib import Path


def _word_level_tokenizer(vocab: dict[str, int], save_dir: str | Path, pre_tokenizer, decoder=None):
    """A ``tokenizers`` word-level model over ``vocab`` plus ``<|endoftext|>`` (the next id) as
    BOS/EOS/unknown, wrapped for transformers, saved to ``save_dir`` and reloaded so that it has a
    ``name_or_path``, as TransformerLens expects."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    eot = "<|endoftext|>"
    tk = Tokenizer(models.WordLevel({**vocab, eot: len(vocab)}, unk_token=eot))
    tk.pre_tokenizer = pre_tokenizer
    if decoder is not None:
        tk.decoder = decoder
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token=eot, eos_token=eot, unk_token=eot).save_pretrained(save_dir)
    return AutoTokenizer.from_pretrained(save_dir)


def word_level_tokenizer(save_dir: str | Path, n_words: int):
    """A word-level tokenizer over ``t0 .. t{n-1}`` with ``<|endoftext|>`` (id ``n_words``) as
    BOS/EOS/unknown, for models trained on random tokens; ``d_vocab = n_words + 1``.

    Saved to ``save_dir`` and reloaded so that it has a ``name_or_path``, as TransformerLens expects.
    """
    from tokenizers import pre_tokenizers

    return _word_level_tokenizer({f"t{i}": i for i in range(n_words)}, save_dir, pre_tokenizers.WhitespaceSplit())


TEXT_CHARS = "\n" + "".join(chr(i) for i in range(32, 127))
"""The character vocabulary of :func:`char_level_tokenizer`: newline and printable ASCII (96
characters, ids 0..95 in this order)."""


def char_level_tokenizer(save_dir: str | Path):
    """A character-level tokenizer over :data:`TEXT_CHARS` (id ``i`` is ``TEXT_CHARS[i]``) with
    ``<|endoftext|>`` (id 96) as BOS/EOS/unknown, for tiny models trained on natural text (see
    :func:`headprobe.analyses.data.ascii_text`, which maps other characters into the vocabulary);
    ``d_vocab = 97``. Every character is one token (spaces and newlines included) and
    ``decode`` joins them without separators, so ``decode(encode(s)) == s`` for ASCII text.

    Built with ``tokenizers`` (a word-level model over single characters) and saved to
    ``save_dir`` and reloaded, like :func:`word_level_tokenizer`.
    """
    from tokenizers import Regex, decoders, pre_tokenizers

    return _word_level_tokenizer(
        {c: i for i, c in enumerate(TEXT_CHARS)},
        save_dir,
        pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"),  # one piece per character
        decoders.Fuse(),
    )  # join characters without spaces
