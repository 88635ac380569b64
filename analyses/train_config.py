"""The settings of ``headprobe train`` (:class:`TrainConfig`) and its constants, torch-free so that
the command's flags are built and checked before torch loads (:mod:`headprobe.analyses.train` runs them)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from headprobe.analyses.vocabulary import MIN_PERIOD, seed_error
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.core.vocabulary import DEVICES
from headprobe.probe.model.tokenizers import TEXT_CHARS

CORPORA = ("copy", "text+copy")
"""The training corpora :attr:`TrainConfig.corpus` accepts."""
INDUCTION_FORMED = 0.5
"""An induction score above this: the head has formed (train's summary, the phase change, study's marks)."""
COPIES_IN_CONTEXT = 0.5
"""A final in-context loss at or below ``-COPIES_IN_CONTEXT * ln(n_words)`` nats: the model copies in
context (half of chance recovered from earlier in the sequence), whatever circuit does it (train's summary)."""


def copying_floor(n_words: int) -> float:
    """``-COPIES_IN_CONTEXT * ln(n_words)`` nats: the in-context loss at or below which a model copies."""
    return -COPIES_IN_CONTEXT * math.log(n_words)


N_CHARS = len(TEXT_CHARS)
"""96: the character vocabulary of ``corpus="text+copy"`` (newline and printable ASCII)."""
WARMUP = 50
"""Warm-up steps when :attr:`TrainConfig.warmup` is not given (fewer in a shorter run: ``min(50, steps)``)."""

COPY_FRACTION = 0.5
"""The copy sequences' share of a ``corpus="text+copy"`` batch when :attr:`TrainConfig.copy_fraction` is not given."""


def refuse_copy_fraction(corpus: str, copy_fraction: float | None) -> None:
    """Refuse a copy fraction given for a corpus without natural text to mix copies with (only
    ``"text+copy"`` has one): ``headprobe train`` and ``headprobe study`` would ignore it.

    Raises:
        HeadprobeError: ``copy_fraction`` is not None and ``corpus`` is not ``"text+copy"``.
    """
    if copy_fraction is not None and corpus != "text+copy":
        raise HeadprobeError(f"--copy-fraction applies to --corpus text+copy only, not to --corpus {corpus}")


@dataclass(frozen=True)
class TrainConfig:
    """Settings of one training run (all recorded in the checkpoint's config.json and in summary.json).

    The model is :class:`headprobe.probe.model.transformer.Transformer` with :meth:`model_config`;
    :meth:`validate` raises :class:`HeadprobeError` on settings that cannot train (the messages
    name the ``headprobe train`` flag of each field: ``n_layers`` is ``--n-layers``).
    """

    n_layers: int = 2
    """Transformer blocks."""
    d_model: int = 64
    """Residual stream width."""
    n_heads: int = 4
    """Query heads per layer (``d_head = d_model // n_heads``)."""
    n_kv_heads: int | None = None
    """Key/value heads per layer: None is MHA (``n_heads``), 1 is MQA, between is GQA."""
    mlp: str | None = None
    """``"gelu"`` adds a GELU MLP to every block; None (default) is attention-only."""
    positional: str = "rotary"
    """``"rotary"`` or ``"learned"`` positions."""
    n_words: int = 64
    """Vocabulary of random tokens; the model's ``d_vocab`` is ``n_words + 1`` (BOS is id ``n_words``).
    Must be :data:`N_CHARS` (96) for ``corpus="text+copy"``."""
    seq_len: int = 96
    """Training sequence length in tokens, BOS included (also the model's ``n_ctx``); at least 20."""
    min_period: int = 8
    """Shortest segment that reappears in a copy sequence (tokens, >= 2)."""
    max_period: int = 32
    """Longest segment that reappears (tokens); ``2 * max_period + 1 <= seq_len``."""
    periodic: bool = True
    """The segment repeats to the end of the sequence (True) instead of reappearing once (CLI ``--data pair``)."""
    batch_size: int = 32
    """Sequences per optimiser step."""
    steps: int = 1000
    """Optimiser steps."""
    lr: float = 3e-3
    """AdamW learning rate (betas 0.9, 0.98; gradient norm clipped at 1)."""
    weight_decay: float = 0.01
    """AdamW weight decay."""
    warmup: int | None = None
    """Steps of linear learning-rate warm-up, constant after: step k (1-based) runs at
    ``lr * min(1, k / warmup)``, so the peak ``lr`` is reached at step ``warmup``, which must not
    exceed ``steps``. None: :data:`WARMUP` (50), or ``steps`` if fewer."""
    eval_every: int = 100
    """Steps between evaluations (the last step is always evaluated, and step 0 before training)."""
    n_eval: int = 64
    """Sequences in each fixed evaluation set."""
    eval_period: int = 24
    """Length S of the repeated block ``[BOS] r_1..r_S r_1..r_S`` the detectors score on."""
    seed: int = 0
    """Seeds the initialisation (``seed``), the training data (``seed``) and the evaluation sets
    (``seed + 1`` copy sequences, ``seed + 2`` repeated tokens, ``seed + 3`` held-out text)."""
    device: str = "auto"
    """``"auto"`` (cuda when a GPU is present), ``"cpu"`` or ``"cuda"``."""
    bias: bool = True
    """Biases in the attention projections (MLA needs False)."""
    kv_lora_rank: int | None = None
    """MLA's latent rank (see :class:`headprobe.probe.model.config.TransformerConfig`); None for MHA/GQA/MQA."""
    qk_rope_head_dim: int = 0
    """MLA's decoupled rotary width (0 for MHA/GQA/MQA)."""
    corpus: str = "copy"
    """The training data. ``"copy"``: only random-token copy sequences (:func:`copy_sequences`)
    over a word-level vocabulary of ``n_words`` ids (tokenizer :func:`word_level_tokenizer`).
    ``"text+copy"``: every batch mixes natural-text windows (CPython's documentation,
    :func:`text_corpus`, character level) with copy sequences whose random tokens are drawn from
    the same 96 characters (tokenizer :func:`char_level_tokenizer`); evaluation then reports the
    held-out *text* loss as ``eval_loss``."""
    copy_fraction: float | None = None
    """``"text+copy"`` only: the fraction of each batch that is copy sequences
    (``round(batch_size * copy_fraction)`` of them), the rest natural text; in [0, 1]. None:
    :data:`COPY_FRACTION` (0.5) with ``"text+copy"``, and stays None with ``"copy"``, which has no
    text to mix (:meth:`validate` refuses a value there, :func:`refuse_copy_fraction`)."""
    save_every: int = 0
    """Keep a snapshot of the weights at step 0 and every ``save_every`` steps (the last step is the
    final model); 0 keeps none. ``headprobe train`` writes them as checkpoint directories
    ``checkpoints/step-NNNNNN/`` that ``headprobe scan`` and ``headprobe atlas --checkpoints`` read."""

    def __post_init__(self) -> None:
        if self.warmup is None and isinstance(self.steps, int):
            object.__setattr__(self, "warmup", min(WARMUP, self.steps))
        if self.copy_fraction is None and self.corpus == "text+copy":
            object.__setattr__(self, "copy_fraction", COPY_FRACTION)

    def validate(self) -> None:
        """Raise :class:`HeadprobeError` (one line) on settings that cannot train, or a setting
        that would do nothing (a copy fraction without text to mix)."""
        for name in (
            "n_layers",
            "d_model",
            "n_heads",
            "n_words",
            "seq_len",
            "batch_size",
            "steps",
            "eval_every",
            "n_eval",
            "min_period",
            "max_period",
            "eval_period",
        ):
            if getattr(self, name) < 1:
                raise HeadprobeError(
                    f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}"
                )
        if self.n_eval < 2:  # one sequence gives no interval: induction_formed and the in-context interval need two
            raise HeadprobeError(
                f"--n-eval must be at least 2 (the 95% intervals over evaluation sequences need two), got {self.n_eval}"
            )
        if self.n_kv_heads is not None and self.n_kv_heads < 1:
            raise HeadprobeError(f"--n-kv-heads must be a positive integer, got {self.n_kv_heads}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise HeadprobeError(f"--lr must be a positive number, got {self.lr}")
        if not 0 <= self.weight_decay < math.inf:
            raise HeadprobeError(f"--weight-decay must be a finite number, not negative, got {self.weight_decay}")
        if self.warmup is None or self.warmup < 0:
            raise HeadprobeError(f"--warmup must not be negative, got {self.warmup}")
        if self.warmup > self.steps:  # the schedule's multiplier min(1, k / warmup) would stop below 1
            raise HeadprobeError(
                f"--warmup {self.warmup} is longer than --steps {self.steps}: the learning rate would stop at "
                f"{self.steps}/{self.warmup} of --lr; give --warmup at most {self.steps}"
            )
        if why := seed_error(self.seed):
            raise HeadprobeError(f"--seed {why}")
        if self.n_words < 2:
            raise HeadprobeError(f"--n-words must be at least 2, got {self.n_words}")
        if self.min_period < 2 or self.min_period > self.max_period:
            raise HeadprobeError(f"need 2 <= --min-period <= --max-period, got {self.min_period} and {self.max_period}")
        if 2 * self.max_period + 1 > self.seq_len:
            raise HeadprobeError(
                f"--max-period {self.max_period} does not fit twice in --seq-len {self.seq_len} (needs 2*period+1)"
            )
        if self.eval_period < MIN_PERIOD or 2 * self.eval_period + 1 > self.seq_len:
            raise HeadprobeError(
                f"--eval-period {self.eval_period} must be >= {MIN_PERIOD} (induction's target is the previous "
                f"token at 2) and fit twice in --seq-len {self.seq_len}"
            )
        if self.seq_len < 20:
            raise HeadprobeError(f"--seq-len {self.seq_len} is too short for the in-context loss (needs >= 20)")
        if self.corpus not in CORPORA:
            raise HeadprobeError(
                f"--corpus must be one of {', '.join(CORPORA)}, got {self.corpus!r}{did_you_mean(str(self.corpus), CORPORA)}"
            )
        if self.corpus == "text+copy" and self.n_words != N_CHARS:
            raise HeadprobeError(
                f"--corpus text+copy uses the {N_CHARS}-character vocabulary: --n-words must be {N_CHARS}, "
                f"got {self.n_words}"
            )
        if self.save_every < 0:
            raise HeadprobeError(
                f"--save-every must be 0 (no snapshots) or a positive number of steps, got {self.save_every}"
            )
        refuse_copy_fraction(self.corpus, self.copy_fraction)
        if self.copy_fraction is not None and not 0 <= self.copy_fraction <= 1:
            raise HeadprobeError(f"--copy-fraction must be between 0 and 1, got {self.copy_fraction}")
        if self.device not in DEVICES:
            raise HeadprobeError(
                f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}{did_you_mean(str(self.device), DEVICES)}"
            )

    def model_config(self):
        """The :class:`headprobe.probe.model.config.TransformerConfig` of the model to train
        (``d_vocab = n_words + 1``, ``n_ctx = seq_len``).

        Raises:
            HeadprobeError: a layout the transformer cannot build (``d_model`` not a multiple of
                ``n_heads``, ``n_heads`` not a multiple of ``n_kv_heads``, ...).
        """
        from headprobe.probe.model.config import TransformerConfig

        return TransformerConfig(
            n_layers=self.n_layers,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            d_vocab=self.n_words + 1,
            n_ctx=self.seq_len,
            mlp=self.mlp,
            positional=self.positional,
            bias=self.bias,
            kv_lora_rank=self.kv_lora_rank,
            qk_rope_head_dim=self.qk_rope_head_dim,
        )
