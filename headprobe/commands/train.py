"""``headprobe train``: grow induction heads from scratch in a small native transformer.

The model (default: 2 layers, attention-only, MHA; ``--n-kv-heads`` for GQA/MQA) is trained on
random token sequences in which a random segment starts repeating part-way through, so the
only way to beat ``ln(n_words)`` nats is in-context copying. Every ``eval_every`` steps it logs:

* every head's induction (prefix-matching) and previous-token score on repeated random tokens
  ``[BOS] r_1..r_S r_1..r_S``, with the detectors of :mod:`headprobe.analyses.detectors`;
* the in-context loss: loss late in the sequence minus loss early (Olsson et al. 2022 use token
  500 minus token 50 of 512; here the mean over a few positions around 98% and 10% of the
  context, on a fixed held-out batch of the training distribution);
* the loss on the repeated half of the repeated random tokens, and the held-out loss.

Olsson et al. 2022 ("In-context Learning and Induction Heads") observe a phase change in models of
2+ layers: induction heads form abruptly, and the in-context loss drops at the same step.

Outputs (``--out``): ``train_log.csv`` (one row per evaluation), ``summary.json``, the figure
``training.{png,pdf}`` and a headprobe checkpoint (``headprobe_model.pt``, ``config.json``,
tokenizer files) that ``headprobe scan --model OUT`` reads.
"""

from __future__ import annotations

import argparse
import math
import time
import zlib
from pathlib import Path
from dataclasses import asdict, dataclass

import numpy as np
import pandas as pd
import torch
from jaxtyping import Int
from torch import Tensor

from headprobe.analyses import figures
from headprobe.analyses.ablation import task_loss, token_losses
from headprobe.analyses.data import ascii_text, pydoc_topics, repeated_random_tokens
from headprobe.analyses.detectors import induction_score, previous_token_score
from headprobe.probe.capture import stream_patterns
from headprobe.probe.errors import HeadprobeError
from headprobe.probe.hooks import format_head
from headprobe.probe.io import package_versions, prepare_output_dir, write_json, write_text
from headprobe.probe.loading import TEXT_CHARS

HELP = "train a small attention-only transformer from scratch and watch induction heads form (phase change)"


@dataclass(frozen=True)
class TrainConfig:
    """Settings of a training run (all recorded in config.json).

    Attributes:
        n_layers, d_model, n_heads: model size. n_kv_heads: key/value heads (None: MHA).
        mlp: ``"gelu"`` adds MLPs; None (default) is attention-only.
        positional: ``"learned"`` or ``"rotary"``.
        n_words: vocabulary of random tokens (the model's ``d_vocab`` is ``n_words + 1``, for BOS).
        seq_len: training sequence length in tokens, BOS included (also the model's ``n_ctx``).
        min_period, max_period: length range of the segment that reappears in each sequence.
        periodic: the segment repeats to the end of the sequence instead of reappearing once.
        batch_size, steps, lr, weight_decay, warmup: optimiser (AdamW, linear warm-up, constant after).
        eval_every: steps between evaluations. n_eval: sequences per evaluation set.
        eval_period: length S of the repeated block the detectors score on.
        seed: seeds the initialisation, the training data and the evaluation data.
        device: ``auto``, ``cpu`` or ``cuda``.
        bias: biases in the attention projections (MLA needs False).
        kv_lora_rank, qk_rope_head_dim: MLA's latent rank and decoupled rotary width (see
            :class:`headprobe.probe.model.TransformerConfig`); None for MHA/GQA/MQA.
        corpus: the training data. ``"copy"`` (default): only random-token copy sequences
            (:func:`copy_sequences`) over a word-level vocabulary of ``n_words`` ids.
            ``"text+copy"``: every batch mixes natural-text windows (CPython's documentation,
            :func:`text_corpus`, character level) with copy sequences whose random tokens are
            drawn from the same 96 characters; needs ``n_words == 96`` and the tokenizer of
            :func:`headprobe.probe.loading.char_level_tokenizer`. Evaluation then reports the held-out
            *text* loss as ``eval_loss``.
        copy_fraction: ``"text+copy"`` only: the fraction of each batch that is copy sequences
            (``round(batch_size * copy_fraction)`` of them), the rest natural text.
    """

    n_layers: int = 2
    d_model: int = 64
    n_heads: int = 4
    n_kv_heads: int | None = None
    mlp: str | None = None
    positional: str = "rotary"
    n_words: int = 64
    seq_len: int = 96
    min_period: int = 8
    max_period: int = 32
    periodic: bool = True
    batch_size: int = 32
    steps: int = 1000
    lr: float = 3e-3
    weight_decay: float = 0.01
    warmup: int = 50
    eval_every: int = 100
    n_eval: int = 64
    eval_period: int = 24
    seed: int = 0
    device: str = "auto"
    bias: bool = True
    kv_lora_rank: int | None = None
    qk_rope_head_dim: int = 0
    corpus: str = "copy"
    copy_fraction: float = 0.5

    def validate(self) -> None:
        """Raise :class:`HeadprobeError` (one line) on settings that cannot train."""
        for name in ("n_layers", "d_model", "n_heads", "n_words", "seq_len", "batch_size", "steps",
                     "eval_every", "n_eval", "min_period", "max_period", "eval_period"):
            if getattr(self, name) < 1:
                raise HeadprobeError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if self.n_kv_heads is not None and self.n_kv_heads < 1:
            raise HeadprobeError(f"--n-kv-heads must be a positive integer, got {self.n_kv_heads}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise HeadprobeError(f"--lr must be a positive number, got {self.lr}")
        if self.weight_decay < 0 or self.warmup < 0:
            raise HeadprobeError("--weight-decay and --warmup must not be negative")
        if self.n_words < 2:
            raise HeadprobeError(f"--n-words must be at least 2, got {self.n_words}")
        if self.min_period < 2 or self.min_period > self.max_period:
            raise HeadprobeError(f"need 2 <= --min-period <= --max-period, got {self.min_period} and {self.max_period}")
        if 2 * self.max_period + 1 > self.seq_len:
            raise HeadprobeError(f"--max-period {self.max_period} does not fit twice in --seq-len {self.seq_len} (needs 2*period+1)")
        if self.eval_period < 2 or 2 * self.eval_period + 1 > self.seq_len:
            raise HeadprobeError(f"--eval-period {self.eval_period} must be >= 2 and fit twice in --seq-len {self.seq_len}")
        if self.seq_len < 20:
            raise HeadprobeError(f"--seq-len {self.seq_len} is too short for the in-context loss (needs >= 20)")
        if self.corpus not in CORPORA:
            raise HeadprobeError(f"--corpus must be one of {', '.join(CORPORA)}, got {self.corpus!r}")
        if self.corpus == "text+copy" and self.n_words != N_CHARS:
            raise HeadprobeError(f"--corpus text+copy uses the {N_CHARS}-character vocabulary: --n-words must be {N_CHARS}, "
                                 f"got {self.n_words}")
        if not 0 <= self.copy_fraction <= 1:
            raise HeadprobeError(f"--copy-fraction must be between 0 and 1, got {self.copy_fraction}")

    def model_config(self):
        from headprobe.probe.model import TransformerConfig

        return TransformerConfig(
            n_layers=self.n_layers, d_model=self.d_model, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads,
            d_vocab=self.n_words + 1, n_ctx=self.seq_len, mlp=self.mlp, positional=self.positional,
            bias=self.bias, kv_lora_rank=self.kv_lora_rank, qk_rope_head_dim=self.qk_rope_head_dim,
        )


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------

CORPORA = ("copy", "text+copy")
INDUCTION_FORMED = 0.5  # an induction score above this: the head has formed (summary, phase change, study)
N_CHARS = len(TEXT_CHARS)  # 96: newline and printable ASCII


@dataclass(frozen=True)
class TextCorpus:
    """Natural text for training, split by topic into a training and a held-out part.

    Attributes:
        train, held_out: 1-D character-level token ids (id ``i`` is ``TEXT_CHARS[i]``, see
            :func:`headprobe.probe.loading.char_level_tokenizer`): the topics of each part, in key order,
            through :func:`headprobe.analyses.data.ascii_text`, joined by a blank line (training topics
            without the paragraphs they share with held-out ones, see :func:`text_corpus`).
        train_topics, held_out_topics: the topic names of each part (disjoint).
        source: where the text comes from.
    """

    train: Int[Tensor, "n_train"]
    held_out: Int[Tensor, "n_held_out"]
    train_topics: tuple[str, ...]
    held_out_topics: tuple[str, ...]
    source: str


def char_ids(text: str) -> Int[Tensor, "n_tokens"]:
    """Character-level ids of ``text`` (id ``i`` is ``TEXT_CHARS[i]``; the same ids as
    :func:`headprobe.probe.loading.char_level_tokenizer`, computed by table look-up). Characters outside
    the vocabulary map to BOS/unknown (96); pass the text through :func:`headprobe.analyses.data.ascii_text` first."""
    table = np.full(256, N_CHARS, dtype=np.int64)
    table[[ord(c) for c in TEXT_CHARS]] = np.arange(N_CHARS)
    codes = np.frombuffer(text.encode("ascii", errors="replace"), dtype=np.uint8)
    return torch.from_numpy(table[codes])


def _paragraphs(text: str) -> list[str]:
    return [p for p in text.split("\n\n") if p.strip()]


def text_corpus(held_out_fraction: float = 0.1) -> TextCorpus:
    """CPython's documentation topics (``pydoc_data.topics``, offline everywhere; the scan's default
    text) split by topic into training and held-out text.

    Held-out topics: the topics in order of ``crc32(name)`` (a fixed pseudo-random order that
    does not move when other topics are added), taken until they hold ``held_out_fraction`` of
    the characters. Many topics quote each other (``compound`` contains ``for``, ``while``, ...),
    so every paragraph (blank-line separated) that occurs in a held-out topic is removed from the
    training topics. Paragraphs that differ slightly stay (on CPython 3.11, 6 held-out paragraphs,
    1.1k characters, are contained in longer training paragraphs: 0.3% of the training text).
    On CPython 3.11: 79 topics, 465k characters; 8 held-out topics (71k characters), 351k
    training characters.

    Raises:
        HeadprobeError: either part would be empty.
    """
    topics = pydoc_topics()
    total = sum(len(t) for t in topics.values())
    held: list[str] = []
    for k in sorted(topics, key=lambda k: zlib.crc32(k.encode())):
        if sum(len(topics[h]) for h in held) >= held_out_fraction * total:
            break
        held.append(k)
    held_set = set(held)
    held_keys = tuple(k for k in topics if k in held_set)
    held_pars = {p for k in held_keys for p in _paragraphs(topics[k])}
    train_keys = tuple(k for k in topics if k not in held_set)
    train_text = "\n\n".join("\n\n".join(p for p in _paragraphs(topics[k]) if p not in held_pars) for k in train_keys)
    held_text = "\n\n".join(topics[k] for k in held_keys)
    if not held_keys or not train_text.strip():
        raise HeadprobeError(f"splitting {len(topics)} documentation topics left one part empty")
    return TextCorpus(char_ids(ascii_text(train_text)), char_ids(ascii_text(held_text)), train_keys, held_keys,
                      "pydoc_data.topics (CPython documentation), split by topic")


def copy_sequences(n_seqs: int, seq_len: int, n_words: int, min_period: int, max_period: int,
                   gen: torch.Generator, periodic: bool = False) -> Int[Tensor, "batch pos"]:
    """Random sequences that need in-context copying: ``[BOS]`` then ``seq_len - 1`` tokens.

    Each sequence starts with a random-length prefix of tokens uniform over ``0..n_words-1``;
    then a random segment of random length ``S`` in ``[min_period, max_period]`` appears and
    reappears once after a random gap (``periodic=False``), or repeats with period ``S`` to the
    end (``periodic=True``; the last copy may be cut off), followed by random tokens. Only
    in-context copying predicts the repeats; nothing predicts the rest. BOS is ``n_words``.
    Deterministic given ``gen``'s state.
    """
    T = seq_len - 1
    tokens = torch.randint(n_words, (n_seqs, T), generator=gen)
    S = torch.randint(min_period, max_period + 1, (n_seqs,), generator=gen)
    u = torch.rand(n_seqs, 2, generator=gen)
    slack = T - 2 * S  # the longest prefix that still leaves two whole copies
    a = (u[:, 0] * (slack + 1)).long().clamp(max=slack)  # the first copy starts at a
    pos = torch.arange(T)
    if periodic:
        rel = pos - a[:, None]
        src = torch.where(rel >= S[:, None], a[:, None] + rel % S[:, None], pos)
    else:
        b = a + S + (u[:, 1] * (slack - a + 1)).long().clamp(max=slack - a)  # second copy at b >= a + S
        second = (pos >= b[:, None]) & (pos < (b + S)[:, None])
        src = torch.where(second, pos - b[:, None] + a[:, None], pos)
    tokens = tokens.gather(1, src)
    bos = torch.full((n_seqs, 1), n_words, dtype=torch.long)
    return torch.cat([bos, tokens], dim=1)


def text_windows(ids: Int[Tensor, "n_tokens"], n_seqs: int, seq_len: int, bos: int,
                 gen: torch.Generator) -> Int[Tensor, "batch pos"]:
    """``n_seqs`` windows of ``seq_len - 1`` consecutive tokens of ``ids`` at offsets drawn
    uniformly (with ``gen``; windows may overlap and cross topic boundaries), each with ``bos``
    in front: ``[batch, seq_len]``.

    Raises:
        HeadprobeError: the text is shorter than one window.
    """
    body = seq_len - 1
    if len(ids) < body:
        raise HeadprobeError(f"the text has {len(ids)} tokens, fewer than one sequence of {body}")
    starts = torch.randint(len(ids) - body + 1, (n_seqs,), generator=gen)
    windows = ids[starts[:, None] + torch.arange(body)]
    return torch.cat([torch.full((n_seqs, 1), bos, dtype=torch.long), windows], dim=1)


def held_out_text_windows(ids: Int[Tensor, "n_tokens"], n_seqs: int, seq_len: int, bos: int,
                          seed: int) -> Int[Tensor, "batch pos"]:
    """A fixed evaluation set: the text is cut into consecutive non-overlapping windows of
    ``seq_len - 1`` tokens and ``n_seqs`` of them (all there are, if fewer) are drawn without
    replacement with ``seed``, in text order; BOS in front: ``[batch, seq_len]``."""
    body = seq_len - 1
    n_windows = len(ids) // body
    if n_windows == 0:
        raise HeadprobeError(f"the held-out text has {len(ids)} tokens, fewer than one sequence of {body}")
    windows = ids[: n_windows * body].view(n_windows, body)
    pick = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed))[:n_seqs].sort().values
    return torch.cat([torch.full((len(pick), 1), bos, dtype=torch.long), windows[pick]], dim=1)


def mixed_batch(n_seqs: int, seq_len: int, text_ids: Int[Tensor, "n_tokens"], n_words: int, min_period: int,
                max_period: int, copy_fraction: float, gen: torch.Generator,
                periodic: bool = True) -> tuple[Int[Tensor, "batch pos"], Tensor]:
    """A ``"text+copy"`` training batch: ``round(n_seqs * copy_fraction)`` copy sequences
    (:func:`copy_sequences`, random tokens ``0..n_words-1``) followed by natural-text windows of
    ``text_ids`` (:func:`text_windows`), all ``[BOS]`` + ``seq_len - 1`` tokens with BOS =
    ``n_words``. Deterministic given ``gen``'s state.

    Returns:
        ``(tokens [batch, pos], is_copy [batch] bool)``.
    """
    n_copy = int(round(n_seqs * copy_fraction))
    copies = copy_sequences(n_copy, seq_len, n_words, min_period, max_period, gen, periodic)
    text = text_windows(text_ids, n_seqs - n_copy, seq_len, n_words, gen)
    return torch.cat([copies, text]), torch.arange(n_seqs) < n_copy


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


def in_context_loss(losses: Tensor, early: float = 0.10, late: float = 0.98, window: int = 2) -> float:
    """Loss late in the sequence minus loss early (nats), Olsson et al. 2022's in-context-learning
    score scaled to short contexts: token 500 vs token 50 of 512 becomes the mean over
    ``±window`` positions around ``late`` and ``early`` fractions of the sequence.

    ``losses`` is ``[batch, pos - 1]`` from :func:`headprobe.analyses.ablation.token_losses` (index i
    predicts token i + 1). Negative when later tokens are predicted better.
    """
    n = losses.shape[1]

    def around(frac: float) -> float:
        c = min(max(int(round(frac * n)), window), n - 1 - window)
        return float(losses[:, c - window : c + window + 1].mean())

    return around(late) - around(early)


@torch.inference_mode()
def evaluate(loaded, held_out: Tensor, repeated, held_out_text: Tensor | None = None) -> dict[str, object]:
    """Scores of every head and the evaluation losses.

    Args:
        held_out: ``[batch, pos]`` held-out copy sequences (the in-context loss; and the
            held-out loss when there is no text).
        repeated: the repeated random tokens the detectors score on.
        held_out_text: ``[batch, pos]`` held-out natural-text windows (``"text+copy"``), or None.

    Returns:
        ``{"induction": [layer, head], "previous_token": [layer, head], "repeated_loss",
        "eval_loss", "in_context_loss"}`` (losses in nats/token). ``eval_loss`` is the mean loss
        on ``held_out_text`` when given (then ``"text_in_context_loss"``, the in-context loss on
        that text, is added), else on ``held_out``; ``in_context_loss`` is always on ``held_out``.
    """
    spec = loaded.spec
    ind = torch.zeros(spec.n_layers, spec.n_heads)
    prev = torch.zeros(spec.n_layers, spec.n_heads)

    def on_pattern(layer: int, pattern: Tensor) -> None:
        ind[layer] = induction_score(pattern, repeated.period, repeated.start).cpu()
        prev[layer] = previous_token_score(pattern[..., repeated.start :, repeated.start :]).cpu()

    logits = stream_patterns(loaded, repeated.tokens, on_pattern)
    rep_loss = task_loss(logits, repeated.tokens.to(logits.device), "repeated", repeated.start, repeated.period)
    losses = token_losses(loaded.forward(held_out), held_out)
    out = {"induction": ind, "previous_token": prev, "repeated_loss": rep_loss,
           "eval_loss": float(losses.mean()), "in_context_loss": in_context_loss(losses)}
    if held_out_text is not None:
        text_losses = token_losses(loaded.forward(held_out_text), held_out_text)
        out["eval_loss"] = float(text_losses.mean())
        out["text_in_context_loss"] = in_context_loss(text_losses)
    return out


def phase_change_step(steps: np.ndarray, icl: np.ndarray, induction: np.ndarray | None = None,
                      threshold: float = INDUCTION_FORMED) -> int | None:
    """The evaluation step at which the in-context loss falls fastest (between consecutive
    evaluations, after a 3-point running mean). None with fewer than 3 evaluations, or when
    ``induction`` (the max induction score at each evaluation) never exceeds ``threshold``: without
    induction heads there was no phase change, however the loss wandered."""
    if len(steps) < 3 or (induction is not None and not (np.asarray(induction) > threshold).any()):
        return None
    smooth = np.convolve(icl, np.ones(3) / 3, mode="same")
    smooth[0], smooth[-1] = icl[0], icl[-1]
    drop = np.diff(smooth) / np.diff(steps)
    i = int(np.argmin(drop))
    return int(steps[i + 1])


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


@dataclass
class TrainResult:
    config: TrainConfig
    loaded: object  # LoadedModel around the trained native Transformer
    log: pd.DataFrame
    final_scores: dict[str, np.ndarray]  # "induction"/"previous_token" -> [layer, head]
    seconds: float
    device: str


def train(cfg: TrainConfig, tokenizer, progress: bool = True) -> TrainResult:
    """Train a model as ``cfg`` says; deterministic given ``cfg.seed`` on one device.

    ``tokenizer`` is a word-level tokenizer over the ``n_words`` random tokens plus BOS (see
    :func:`headprobe.probe.loading.word_level_tokenizer`) for ``corpus="copy"``, the character-level one
    (:func:`headprobe.probe.loading.char_level_tokenizer`) for ``"text+copy"``.

    Raises:
        HeadprobeError: bad settings, a tokenizer that does not fit the corpus, no GPU for
            ``device="cuda"``, or a diverged loss.
    """
    from headprobe.probe.convert import spec_from_native
    from headprobe.probe.loading import LoadedModel, device_auto
    from headprobe.probe.model import Transformer, init_weights

    cfg.validate()
    text = cfg.corpus == "text+copy"
    if text and tokenizer.convert_tokens_to_ids(list(TEXT_CHARS)) != list(range(N_CHARS)):
        raise HeadprobeError("--corpus text+copy needs the character-level tokenizer (headprobe.probe.loading.char_level_tokenizer)")
    device = device_auto(cfg.device)
    if device == "cuda" and not torch.cuda.is_available():
        raise HeadprobeError("--device cuda was asked for but no CUDA GPU is available")
    mcfg = cfg.model_config()
    torch.manual_seed(cfg.seed)
    model = init_weights(Transformer(mcfg)).to(device)
    spec = spec_from_native("headprobe-train", "headprobe-train", "float32 (training)", mcfg)
    loaded = LoadedModel(model, tokenizer, spec, prepend_bos=True)

    eval_gen = torch.Generator().manual_seed(cfg.seed + 1)
    held_out = copy_sequences(cfg.n_eval, cfg.seq_len, cfg.n_words, cfg.min_period, cfg.max_period, eval_gen, cfg.periodic).to(device)
    repeated = repeated_random_tokens(loaded, cfg.n_eval, cfg.eval_period, cfg.seed + 2)
    repeated = type(repeated)(**{**repeated.__dict__, "tokens": repeated.tokens.to(device)})
    corpus = text_corpus() if text else None
    held_out_text = (held_out_text_windows(corpus.held_out, cfg.n_eval, cfg.seq_len, cfg.n_words, cfg.seed + 3).to(device)
                     if text else None)
    data_gen = torch.Generator().manual_seed(cfg.seed)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(cfg.warmup, 1)))
    heads = [format_head((layer, h)) for layer in range(mcfg.n_layers) for h in range(mcfg.n_heads)]
    rows: list[dict] = []
    running: list[float] = []

    def log_row(step: int) -> dict:
        model.eval()
        ev = evaluate(loaded, held_out, repeated, held_out_text)
        model.train()
        row = {"step": step, "train_loss": float(np.mean(running)) if running else float("nan"),
               "eval_loss": ev["eval_loss"], "in_context_loss": ev["in_context_loss"],
               **({"text_in_context_loss": ev["text_in_context_loss"]} if text else {}),
               "repeated_loss": ev["repeated_loss"],
               "max_induction": float(ev["induction"].max()), "max_previous_token": float(ev["previous_token"].max())}
        row.update({f"induction_{h}": float(v) for h, v in zip(heads, ev["induction"].flatten())})
        row.update({f"previous_token_{h}": float(v) for h, v in zip(heads, ev["previous_token"].flatten())})
        running.clear()
        return row

    t0 = time.perf_counter()
    rows.append(log_row(0))
    model.train()
    for step in range(1, cfg.steps + 1):
        if text:
            tokens = mixed_batch(cfg.batch_size, cfg.seq_len, corpus.train, cfg.n_words, cfg.min_period, cfg.max_period,
                                 cfg.copy_fraction, data_gen, cfg.periodic)[0].to(device)
        else:
            tokens = copy_sequences(cfg.batch_size, cfg.seq_len, cfg.n_words, cfg.min_period, cfg.max_period,
                                    data_gen, cfg.periodic).to(device)
        loss = token_losses(model(tokens), tokens).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        running.append(float(loss.detach()))
        if not math.isfinite(running[-1]):
            raise HeadprobeError(f"training diverged at step {step} (loss {running[-1]}); lower --lr")
        if step % cfg.eval_every == 0 or step == cfg.steps:
            rows.append(log_row(step))
            if progress:
                r = rows[-1]
                print(f"step {step:5d}  loss {r['train_loss']:.3f}  in-context {r['in_context_loss']:+.3f}  "
                      f"max induction {r['max_induction']:.2f}  max prev-token {r['max_previous_token']:.2f}  "
                      f"({time.perf_counter() - t0:.0f} s)", flush=True)
    seconds = time.perf_counter() - t0
    model.eval()
    log = pd.DataFrame(rows)
    last = log.iloc[-1]
    final = {kind: np.array([last[f"{kind}_{h}"] for h in heads]).reshape(mcfg.n_layers, mcfg.n_heads)
             for kind in ("induction", "previous_token")}
    return TrainResult(cfg, loaded, log, final, seconds, device)


def summary(result: TrainResult) -> dict:
    log, cfg = result.log, result.config
    steps, icl = log["step"].to_numpy(), log["in_context_loss"].to_numpy()
    formed = log.index[log["max_induction"] > INDUCTION_FORMED]
    top = np.unravel_index(np.argmax(result.final_scores["induction"]), result.final_scores["induction"].shape)
    top_prev = np.unravel_index(np.argmax(result.final_scores["previous_token"]), result.final_scores["previous_token"].shape)
    last = log.iloc[-1]
    return {
        "layout": result.loaded.spec.layout,
        "n_params": sum(p.numel() for p in result.loaded.model.parameters()),
        "device": result.device,
        "train_seconds": round(result.seconds, 1),
        "final": {"train_loss": round(float(last["train_loss"]), 4), "eval_loss": round(float(last["eval_loss"]), 4),
                  "in_context_loss": round(float(last["in_context_loss"]), 4),
                  "repeated_loss": round(float(last["repeated_loss"]), 4),
                  "top_induction_head": format_head(tuple(int(i) for i in top)),
                  "top_induction_score": round(float(result.final_scores["induction"].max()), 4),
                  "top_previous_token_head": format_head(tuple(int(i) for i in top_prev)),
                  "top_previous_token_score": round(float(result.final_scores["previous_token"].max()), 4)},
        "chance_loss_nats": round(math.log(cfg.n_words), 4),
        "first_step_induction_above_0.5": int(log.loc[formed[0], "step"]) if len(formed) else None,
        "phase_change_step": phase_change_step(steps, icl, log["max_induction"].to_numpy()),
        "phase_change_rule": "evaluation step where the 3-point running mean of the in-context loss falls fastest; "
                             "none unless some head's induction score exceeds 0.5",
        "induction_formed": bool(result.final_scores["induction"].max() > INDUCTION_FORMED),
        "seed": cfg.seed,
        "self_check": result.loaded.self_check.to_dict(),
        "dtype": str(next(result.loaded.model.parameters()).dtype).removeprefix("torch."),
        "config": asdict(cfg),
        "versions": package_versions(),
    }


def write_outputs(result: TrainResult, out) -> list:
    """train_log.csv, the checkpoint (config.json, headprobe_model.pt, tokenizer files),
    training.{png,pdf} and, last, summary.json, each written atomically."""
    from headprobe.probe.loading import save_native

    summ = summary(result)
    written = []
    write_text(out / "train_log.csv", result.log.to_csv(index=False, float_format="%.5f"))
    tokenizer_files = result.loaded.tokenizer.save_pretrained(out)
    save_native(result.loaded.model, out, {"train": asdict(result.config)})
    written += [out / "train_log.csv", out / "summary.json", out / "config.json", out / "headprobe_model.pt"]
    written += sorted({Path(f) for f in tokenizer_files if Path(f).is_file()} - set(written))
    log, spec = result.log, result.loaded.spec
    title = (f"{spec.n_layers}-layer attention-only {spec.layout} ({spec.n_heads} heads, d_model {spec.d_model})"
             if result.config.mlp is None else f"{spec.n_layers}-layer {spec.layout} ({spec.n_heads} heads)")
    fig = figures.training_curves(
        log["step"].to_numpy(), log["max_induction"].to_numpy(), log["max_previous_token"].to_numpy(),
        log["in_context_loss"].to_numpy(), log["train_loss"].to_numpy(), summ["phase_change_step"], title)
    written += figures.save_figure(fig, out / "training")
    write_json(out / "summary.json", summ)  # last: a directory with summary.json is complete
    return written


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    p.add_argument("--out", required=True, help="output directory (must be empty or absent unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace files in a non-empty output directory")
    p.add_argument("--n-layers", type=int, default=d.n_layers, help="blocks (default %(default)s)")
    p.add_argument("--d-model", type=int, default=d.d_model, help="residual width (default %(default)s)")
    p.add_argument("--n-heads", type=int, default=d.n_heads, help="query heads per layer (default %(default)s)")
    p.add_argument("--n-kv-heads", type=int, default=None, help="key/value heads (default: n_heads, MHA; 1: MQA)")
    p.add_argument("--mlp", choices=["none", "gelu"], default="none", help="add GELU MLPs (default: attention-only)")
    p.add_argument("--positional", choices=["learned", "rotary"], default=d.positional)
    p.add_argument("--n-words", type=int, default=d.n_words, help="random-token vocabulary (default %(default)s)")
    p.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens per sequence, BOS included (default %(default)s)")
    p.add_argument("--min-period", type=int, default=d.min_period, help="shortest repeated segment (default %(default)s)")
    p.add_argument("--max-period", type=int, default=d.max_period, help="longest repeated segment (default %(default)s)")
    p.add_argument("--data", choices=["periodic", "pair"], default="periodic",
                   help="periodic: the segment repeats to the end of each sequence (default); pair: it reappears once")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--steps", type=int, default=d.steps, help="optimiser steps (default %(default)s)")
    p.add_argument("--lr", type=float, default=d.lr, help="AdamW learning rate (default %(default)s)")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay)
    p.add_argument("--warmup", type=int, default=d.warmup, help="linear warm-up steps (default %(default)s)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="steps between head scores (default %(default)s)")
    p.add_argument("--n-eval", type=int, default=d.n_eval, help="sequences per evaluation set (default %(default)s)")
    p.add_argument("--eval-period", type=int, default=d.eval_period, help="repeated block length for the detectors (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, choices=["auto", "cpu", "cuda"])


def run(args: argparse.Namespace) -> int:
    import tempfile

    from headprobe.probe.loading import word_level_tokenizer

    fields = {f: getattr(args, f) for f in TrainConfig.__dataclass_fields__ if hasattr(args, f)}
    fields["mlp"] = None if args.mlp == "none" else args.mlp
    fields["periodic"] = args.data == "periodic"
    cfg = TrainConfig(**fields)
    cfg.validate()
    cfg.model_config()  # layout errors (n_heads vs n_kv_heads, d_model vs n_heads) before any work
    prepare_output_dir(args.out, args.overwrite, create=False)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = word_level_tokenizer(tmp, cfg.n_words)
        result = train(cfg, tokenizer)
    out = prepare_output_dir(args.out, args.overwrite)
    paths = write_outputs(result, out)
    s = summary(result)
    print(f"\ntrained {s['n_params']} parameters in {s['train_seconds']} s on {s['device']}; final loss "
          f"{s['final']['train_loss']:.3f} (chance {s['chance_loss_nats']:.3f}), in-context loss {s['final']['in_context_loss']:+.3f}")
    formed = (f"induction > 0.5 first at step {s['first_step_induction_above_0.5']}; phase change at step {s['phase_change_step']}"
              if s["phase_change_step"] is not None else "no head's induction score exceeded 0.5: no phase change yet")
    print(f"top induction head {s['final']['top_induction_head']} ({s['final']['top_induction_score']:.2f}); {formed}")
    print(f"wrote {len(paths)} files to {out}/ (headprobe scan --model {out} reads the checkpoint)")
    return 0
