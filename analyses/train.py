"""Training small native transformers from scratch, to watch induction heads form.

The training data, the training loop and the evaluation behind ``headprobe train`` and
``headprobe study`` (the commands only map flags to a :class:`TrainConfig` and write files):

* data: :func:`copy_sequences` (random tokens with a segment that repeats, so only in-context
  copying beats ``ln(n_words)`` nats), and for ``corpus="text+copy"`` CPython's documentation at
  character level (:func:`text_corpus`, :func:`text_windows`, :func:`held_out_text_windows`),
  mixed with copy sequences in every batch (:func:`mixed_batch`);
* evaluation (:func:`evaluate`): every head's induction and previous-token score
  (:mod:`headprobe.analyses.detectors`) on repeated random tokens, the in-context loss
  (:func:`in_context_loss`, after Olsson et al. 2022), the loss on the repeated half and the
  held-out loss;
* :func:`train`: AdamW with linear warm-up, deterministic given the seed on one device, logging
  one row per evaluation; :func:`phase_change_interval` reads the phase change off the log.

Olsson et al. 2022 ("In-context Learning and Induction Heads") observe a phase change in models of
2+ layers: induction heads form abruptly, and the in-context loss drops at the same step.

No argparse and no printing here: :func:`train` reports progress only through its ``on_eval``
callback.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from jaxtyping import Float, Int
from torch import Tensor

from headprobe.analyses.ablation import task_loss, token_losses
from headprobe.analyses.data import TokenSet, ascii_text, pydoc_topics, repeated_random_tokens
from headprobe.analyses.detectors import induction_scores, previous_token_score
from headprobe.analyses.train_config import (  # noqa: F401 - re-exported
    COPIES_IN_CONTEXT,
    CORPORA,
    INDUCTION_FORMED,
    N_CHARS,
    TrainConfig,
    copying_floor,
)
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.backends.native import NativeModel
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.ablation import format_head
from headprobe.probe.hooks.capture import patterns_by_layer
from headprobe.probe.model.tokenizers import TEXT_CHARS, char_level_tokenizer, word_level_tokenizer

# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextCorpus:
    """Natural text for training, split by topic into a training and a held-out part.

    Attributes:
        train, held_out: 1-D character-level token ids (id ``i`` is ``TEXT_CHARS[i]``, see
            :func:`headprobe.probe.model.tokenizers.char_level_tokenizer`): the topics of each part, in key order,
            through :func:`headprobe.analyses.data.ascii_text`, joined by a blank line (training topics
            without the paragraphs they share with held-out ones, see :func:`text_corpus`).
        train_topics, held_out_topics: the topic names of each part (disjoint).
        source: where the text comes from.
    """

    train: Int[Tensor, " n_train"]
    held_out: Int[Tensor, " n_held_out"]
    train_topics: tuple[str, ...]
    held_out_topics: tuple[str, ...]
    source: str


def char_ids(text: str) -> Int[Tensor, " n_tokens"]:
    """Character-level ids of ``text`` (id ``i`` is ``TEXT_CHARS[i]``; the same ids as
    :func:`headprobe.probe.model.tokenizers.char_level_tokenizer`, computed by table look-up). Characters outside
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
    return TextCorpus(
        char_ids(ascii_text(train_text)),
        char_ids(ascii_text(held_text)),
        train_keys,
        held_keys,
        "pydoc_data.topics (CPython documentation), split by topic",
    )


def copy_sequences(
    n_seqs: int,
    seq_len: int,
    n_words: int,
    min_period: int,
    max_period: int,
    gen: torch.Generator,
    periodic: bool = False,
) -> Int[Tensor, "batch pos"]:
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


def text_windows(
    ids: Int[Tensor, " n_tokens"], n_seqs: int, seq_len: int, bos: int, gen: torch.Generator
) -> Int[Tensor, "batch pos"]:
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


def held_out_text_windows(
    ids: Int[Tensor, " n_tokens"], n_seqs: int, seq_len: int, bos: int, seed: int
) -> Int[Tensor, "batch pos"]:
    """A fixed evaluation set: the text is cut into consecutive non-overlapping windows of
    ``seq_len - 1`` tokens and ``n_seqs`` of them (all there are, if fewer) are drawn without
    replacement with ``seed``, in text order; BOS in front: ``[batch, seq_len]``, ``batch =
    min(n_seqs, len(ids) // (seq_len - 1))``.

    Raises:
        HeadprobeError: ``ids`` has fewer than ``seq_len - 1`` tokens (not one window).
    """
    body = seq_len - 1
    n_windows = len(ids) // body
    if n_windows == 0:
        raise HeadprobeError(f"the held-out text has {len(ids)} tokens, fewer than one sequence of {body}")
    windows = ids[: n_windows * body].view(n_windows, body)
    pick = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed))[:n_seqs].sort().values
    return torch.cat([torch.full((len(pick), 1), bos, dtype=torch.long), windows[pick]], dim=1)


def mixed_batch(
    n_seqs: int,
    seq_len: int,
    text_ids: Int[Tensor, " n_tokens"],
    n_words: int,
    min_period: int,
    max_period: int,
    copy_fraction: float,
    gen: torch.Generator,
    periodic: bool = True,
) -> tuple[Int[Tensor, "batch pos"], Tensor]:
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
    score (the loss at token 500 minus that at token 50) scaled to short contexts: the mean over
    ``±window`` positions around the ``late`` and ``early`` fractions of the sequence (0.98 and
    0.10 are about 500/512 and 50/512).

    ``losses`` is ``[batch, pos - 1]`` from :func:`headprobe.analyses.ablation.token_losses` (index i
    predicts token i + 1). Negative when later tokens are predicted better. The mean over the batch of
    :func:`in_context_losses`.
    """
    return float(in_context_losses(losses, early, late, window).mean())


def in_context_losses(
    losses: Float[Tensor, "batch pos"], early: float = 0.10, late: float = 0.98, window: int = 2
) -> Float[Tensor, " batch"]:
    """:func:`in_context_loss` of each sequence, ``[batch]`` (nats): the loss over the ``2 window + 1``
    positions around the ``late`` fraction minus that around ``early``, the same positions in every sequence."""
    n = losses.shape[1]

    def around(frac: float) -> Tensor:
        c = min(max(int(round(frac * n)), window), n - 1 - window)
        return losses[:, c - window : c + window + 1].mean(dim=1)

    return around(late) - around(early)


def in_context_ci(losses: Float[Tensor, "batch pos"], mean: float) -> tuple[float, float]:
    """The 95% Student-t interval of :func:`in_context_loss` over the sequences of ``losses``
    (:func:`~headprobe.analyses.statistics.mean_ci` of :func:`in_context_losses`; NaN from one sequence),
    after checking that the per-sequence values average to ``mean`` (the printed in-context loss)
    within 1e-4 nats. A non-finite ``mean`` (a diverged model) gets NaN bounds, unchecked.

    Raises:
        HeadprobeError: they do not (the interval would not be the printed number's).
    """
    from headprobe.analyses.statistics import mean_ci

    per_seq = in_context_losses(losses.double()).cpu().numpy()
    if not math.isfinite(mean):  # diverged weights: train refuses the run itself, naming the step
        return float("nan"), float("nan")
    if not abs(float(per_seq.mean()) - mean) <= 1e-4:
        raise HeadprobeError(
            f"the per-sequence in-context losses average to {per_seq.mean():+.6f} nats, the in-context loss "
            f"is {mean:+.6f}: no interval is written for a number it does not belong to"
        )
    lo, hi = mean_ci(per_seq)
    return float(lo), float(hi)


@torch.inference_mode()
def evaluate(loaded: LoadedModel, held_out: Tensor, repeated, held_out_text: Tensor | None = None) -> dict[str, object]:
    """Scores of every head and the evaluation losses.

    Args:
        held_out: ``[batch, pos]`` held-out copy sequences (the in-context loss; and the
            held-out loss when there is no text).
        repeated: the repeated random tokens the detectors score on.
        held_out_text: ``[batch, pos]`` held-out natural-text windows (``"text+copy"``), or None.

    Returns:
        ``{"induction": [layer, head], "induction_per_sequence": [layer, head, sequence] (of
        ``repeated``), "previous_token": [layer, head], "repeated_loss",
        "eval_loss", "in_context_loss", "in_context_loss_ci95"}`` (losses in nats/token;
        ``in_context_loss_ci95``: ``(lo, hi)`` over the ``held_out`` sequences, :func:`in_context_ci`). ``eval_loss`` is the mean loss
        on ``held_out_text`` when given (then ``"text_in_context_loss"``, the in-context loss on
        that text, is added), else on ``held_out``; ``in_context_loss`` is always on ``held_out``.
    """
    spec = loaded.spec
    ind = torch.zeros(spec.n_layers, spec.n_heads)
    prev = torch.zeros(spec.n_layers, spec.n_heads)
    ind_seq = torch.zeros(spec.n_layers, spec.n_heads, repeated.tokens.shape[0])

    def on_pattern(layer: int, pattern: Tensor) -> None:
        pooled, per_sequence = induction_scores(pattern, repeated.period, repeated.start)  # one read
        ind[layer], ind_seq[layer] = pooled.cpu(), per_sequence.T.cpu()
        prev[layer] = previous_token_score(pattern[..., repeated.start :, repeated.start :]).cpu()

    logits = patterns_by_layer(loaded, repeated.tokens, on_pattern)
    rep_loss = task_loss(logits, repeated.tokens.to(logits.device), "repeated", repeated.start, repeated.period)
    losses = token_losses(loaded.forward(held_out), held_out)
    icl = in_context_loss(losses)
    out = {
        "induction": ind,
        "induction_per_sequence": ind_seq,
        "previous_token": prev,
        "repeated_loss": rep_loss,
        "eval_loss": float(losses.mean()),
        "in_context_loss": icl,
        "in_context_loss_ci95": in_context_ci(losses, icl),
    }
    if held_out_text is not None:
        text_losses = token_losses(loaded.forward(held_out_text), held_out_text)
        out["eval_loss"] = float(text_losses.mean())
        out["text_in_context_loss"] = in_context_loss(text_losses)
    return out


def induction_formed(per_sequence: np.ndarray) -> dict:
    """Whether an induction head formed: the head of highest mean induction score (``per_sequence``
    ``[layer, head, sequence]``) with the lower bound of its 95% interval over the sequences
    (:func:`~headprobe.analyses.statistics.mean_ci`, clipped to the score's range [0, 1]) above :data:`INDUCTION_FORMED`. The largest of
    several noisy means leans upward, so its mean alone above 0.5 does not say a head formed.

    Returns:
        ``{"formed": bool, "head": (layer, head), "score": its mean, "ci95": (lo, hi)}``; from one
        sequence the interval is NaN and ``formed`` False.
    """
    from headprobe.analyses.detectors import DETECTORS
    from headprobe.analyses.statistics import mean_ci

    means = per_sequence.mean(axis=-1)
    layer, head = (int(i) for i in np.unravel_index(np.argmax(means), means.shape))
    bounds = DETECTORS["induction"].column_range("induction") or (-np.inf, np.inf)
    lo, hi = (float(np.clip(b, *bounds)) for b in mean_ci(per_sequence[layer, head]))  # the score's range
    return {
        "formed": bool(lo > INDUCTION_FORMED),
        "head": (layer, head),
        "score": float(means[layer, head]),
        "ci95": (lo, hi),
    }


def phase_change_interval(
    steps: np.ndarray, icl: np.ndarray, induction: np.ndarray | None = None, threshold: float = INDUCTION_FORMED
) -> tuple[int, int] | None:
    """The two consecutive evaluation steps ``(before, after)`` between which the phase change happened:
    where the 3-point running mean of the in-context loss ``icl`` (nats, one per step of ``steps``) falls
    fastest per step, the steepest fall of the raw loss among the (at most 3) intervals that mean spans.
    Evaluations every 100 steps locate it to 100 steps, no finer. None with fewer than 3 evaluations,
    or when ``induction`` (at each evaluation, the score that decides whether a head formed: train's
    ``top_induction_ci95_low``) never exceeds ``threshold``: without induction heads there was no
    phase change, however the loss wandered."""
    if len(steps) < 3 or (induction is not None and not (np.asarray(induction) > threshold).any()):
        return None
    steps, icl = np.asarray(steps), np.asarray(icl, dtype=float)
    smooth = np.convolve(icl, np.ones(3) / 3, mode="same")
    smooth[0], smooth[-1] = icl[0], icl[-1]
    k = int(np.argmin(np.diff(smooth) / np.diff(steps))) + 1  # smooth[k] - smooth[k-1] spans raw intervals k-2..k
    window = np.arange(max(k - 2, 0), min(k, len(steps) - 2) + 1)
    j = int(window[np.argmin(np.diff(icl)[window] / np.diff(steps)[window])])
    return int(steps[j]), int(steps[j + 1])


# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def training_tokenizer(cfg: TrainConfig, save_dir):
    """The tokenizer :func:`train` needs for ``cfg.corpus``: :func:`char_level_tokenizer` for
    ``"text+copy"``, :func:`word_level_tokenizer` over ``cfg.n_words`` ids for ``"copy"`` (both
    saved to and reloaded from ``save_dir``, which may be a temporary directory)."""
    return char_level_tokenizer(save_dir) if cfg.corpus == "text+copy" else word_level_tokenizer(save_dir, cfg.n_words)


@dataclass
class TrainRun:
    """What :func:`train` returns.

    Attributes:
        config: the settings it ran with.
        loaded: a :class:`headprobe.probe.backends.loading.LoadedModel` around the trained native
            :class:`~headprobe.probe.model.transformer.Transformer` (in eval mode, float32, on ``device``).
        log: one row per evaluation (step 0, every ``eval_every`` steps and the last step):
            ``step``, ``train_loss`` (mean over the steps since the previous row; NaN at step 0),
            ``eval_loss``, ``in_context_loss`` (``text_in_context_loss`` too for ``"text+copy"``),
            ``repeated_loss`` (nats/token), ``max_induction``, ``top_induction_ci95_low``
            (:func:`induction_formed`'s lower bound), ``max_previous_token`` and one
            ``induction_L.H`` and ``previous_token_L.H`` column per head.
        final_scores: ``"induction"`` / ``"previous_token"`` -> ``[layer, head]`` scores at the last step,
            ``"induction_per_sequence"`` -> ``[layer, head, sequence]``, each repeated sequence's.
        seconds: wall time of the evaluations and steps (model building excluded).
        device: the device it trained on (``"cpu"`` or ``"cuda"``).
        snapshots: step -> the model's state dict (on the CPU) at that step, for ``save_every > 0``:
            step 0 (the initialisation) and every ``save_every`` steps; empty otherwise.
    """

    config: TrainConfig
    loaded: NativeModel
    log: pd.DataFrame
    final_scores: dict[str, np.ndarray]
    seconds: float
    device: str
    snapshots: dict[int, dict[str, Tensor]] = field(default_factory=dict)


def train(cfg: TrainConfig, tokenizer, on_eval: Callable[[dict, float], None] | None = None) -> TrainRun:
    """Train a model as ``cfg`` says; deterministic given ``cfg.seed`` on one device.

    ``tokenizer`` is a word-level tokenizer over the ``n_words`` random tokens plus BOS (see
    :func:`headprobe.probe.model.tokenizers.word_level_tokenizer`) for ``corpus="copy"``, the character-level one
    (:func:`headprobe.probe.model.tokenizers.char_level_tokenizer`) for ``"text+copy"``; :func:`training_tokenizer`
    builds the right one. ``on_eval(row, seconds)``, when given, is called after every evaluation
    but the one at step 0 with the new log row (a dict, see :attr:`TrainRun.log`) and the seconds
    since training started: the only progress report (nothing is printed).

    Raises:
        HeadprobeError: bad settings, a tokenizer that does not fit the corpus, no GPU for
            ``device="cuda"``, or a diverged loss.
    """
    cfg.validate()
    text = cfg.corpus == "text+copy"
    if text and tokenizer.convert_tokens_to_ids(list(TEXT_CHARS)) != list(range(N_CHARS)):
        raise HeadprobeError(
            "--corpus text+copy needs the character-level tokenizer (headprobe.probe.model.tokenizers.char_level_tokenizer)"
        )
    model, loaded, device = _untrained_model(cfg, tokenizer)
    mcfg = cfg.model_config()
    held_out, repeated, held_out_text, corpus = _eval_data(cfg, loaded, device)
    data_gen = torch.Generator().manual_seed(cfg.seed)

    opt, sched = _optimizer(cfg, model)
    heads = [format_head((layer, h)) for layer in range(mcfg.n_layers) for h in range(mcfg.n_heads)]
    rows: list[dict] = []
    running: list[float] = []
    last_ind: list[Tensor] = []  # the latest evaluation's per-sequence induction scores

    def log_row(step: int) -> dict:
        model.eval()
        ev = evaluate(loaded, held_out, repeated, held_out_text)
        last_ind[:] = [torch.as_tensor(ev["induction_per_sequence"])]
        model.train()
        row = _log_row(step, running, ev, heads, text)
        running.clear()
        bad = [k for k, v in row.items() if k != "train_loss" and isinstance(v, float) and not math.isfinite(v)]
        if bad:  # finite weights so large that the forward pass overflows: the model is no better than NaN ones
            raise HeadprobeError(
                f"training diverged at step {step} (the evaluation's {bad[0]} is {row[bad[0]]}); lower --lr"
            )
        return row

    snapshots: dict[int, dict[str, Tensor]] = {}

    def snapshot(step: int) -> None:
        if cfg.save_every and step % cfg.save_every == 0:
            snapshots[step] = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}

    t0 = time.perf_counter()
    rows.append(log_row(0))
    snapshot(0)
    model.train()
    for step in range(1, cfg.steps + 1):
        tokens = _training_batch(cfg, corpus, data_gen).to(device)
        running.append(_train_step(model, opt, sched, tokens, step))
        snapshot(step)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            rows.append(log_row(step))
            if on_eval is not None:
                on_eval(dict(rows[-1]), time.perf_counter() - t0)
    seconds = time.perf_counter() - t0
    model.eval()
    log = pd.DataFrame(rows)
    final = {**_final_scores(log, heads, mcfg), "induction_per_sequence": last_ind[0].numpy()}
    return TrainRun(cfg, loaded, log, final, seconds, device, snapshots)


def _optimizer(
    cfg: TrainConfig, model: torch.nn.Module
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """:func:`train`'s AdamW over ``model``'s parameters (``cfg.lr``, ``cfg.weight_decay``) and its
    schedule: a linear warm-up over ``cfg.warmup`` steps, then constant."""
    warmup = max(cfg.warmup or 0, 1)  # set by TrainConfig.__post_init__
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.98))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    return opt, sched


def _train_step(model: torch.nn.Module, opt, sched, tokens: Tensor, step: int) -> float:
    """One optimiser step of :func:`train` on ``tokens`` (gradients clipped to norm 1); returns the
    loss (nats/token) before the update.

    Raises:
        HeadprobeError: the loss, or a weight after the update, is NaN or Inf.
    """
    loss = token_losses(model(tokens), tokens).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    value = float(loss.detach())
    if not math.isfinite(value):
        raise HeadprobeError(f"training diverged at step {step} (loss {value}); lower --lr")
    # the loss above is the one before this step's update: an update that made the weights NaN or
    # Inf shows only in the next step's loss, and after the last step in none (a NaN model, its
    # evaluation NaN, would be saved and summarised); one check over every parameter, on the device
    if not bool(torch.stack([p.detach().isfinite().all() for p in model.parameters()]).all()):
        raise HeadprobeError(
            f"training diverged at step {step} (a weight is NaN or Inf after the update, "
            f"loss before it {value:.4g}); lower --lr"
        )
    return value


def _final_scores(log: pd.DataFrame, heads: list[str], mcfg) -> dict[str, np.ndarray]:
    """:attr:`TrainRun.final_scores` from the log's last row: ``"induction"`` / ``"previous_token"``
    -> ``[layer, head]`` (``heads`` named ``L.H`` in that order, ``mcfg`` the model's config)."""
    last = log.iloc[-1]
    return {
        kind: np.array([last[f"{kind}_{h}"] for h in heads]).reshape(mcfg.n_layers, mcfg.n_heads)
        for kind in ("induction", "previous_token")
    }


def _untrained_model(cfg: TrainConfig, tokenizer) -> tuple[torch.nn.Module, NativeModel, str]:
    """:func:`train`'s model before its first step, ``(model, loaded, device)``: the native
    :class:`~headprobe.probe.model.transformer.Transformer` of ``cfg.model_config()``, initialised from
    ``cfg.seed`` (:func:`~headprobe.probe.model.transformer.init_weights`) on ``device`` (``"cpu"`` or
    ``"cuda"``, from ``cfg.device``), and ``loaded``, the
    :class:`~headprobe.probe.backends.loading.LoadedModel` around it with ``tokenizer`` and the
    training's periods (``trained_periods``, as its saved copy reloads with them).

    Raises:
        HeadprobeError: ``device="cuda"`` without a CUDA GPU.
    """
    from headprobe.probe.backends.loading import device_auto, require_gpu
    from headprobe.probe.model.convert import spec_from_native
    from headprobe.probe.model.transformer import Transformer, init_weights

    device = device_auto(cfg.device)
    require_gpu(device)
    mcfg = cfg.model_config()
    torch.manual_seed(cfg.seed)
    model = init_weights(Transformer(mcfg)).to(device)
    spec = spec_from_native("headprobe-train", "headprobe-train", "float32 (training)", mcfg)
    loaded = NativeModel(model, tokenizer, spec, prepend_bos=True)  # what LoadedModel(model, ...) picks
    # the periods its saved copy reloads with (native_loading): the default --period is the same in memory
    loaded.trained_periods = (cfg.min_period, cfg.max_period, cfg.eval_period)
    return model, loaded, device


def _eval_data(
    cfg: TrainConfig, loaded: LoadedModel, device: str
) -> tuple[Tensor, TokenSet, Tensor | None, TextCorpus | None]:
    """:func:`train`'s fixed evaluation data, on ``device``: ``(held_out, repeated,
    held_out_text, corpus)``: ``cfg.n_eval`` copy sequences (seed ``cfg.seed + 1``), repeated
    random tokens of period ``cfg.eval_period`` (seed ``+ 2``) and, for ``"text+copy"``, windows
    of the corpus' held-out text (seed ``+ 3``) and the corpus itself (None otherwise)."""
    eval_gen = torch.Generator().manual_seed(cfg.seed + 1)
    held_out = copy_sequences(
        cfg.n_eval, cfg.seq_len, cfg.n_words, cfg.min_period, cfg.max_period, eval_gen, cfg.periodic
    ).to(device)
    repeated = repeated_random_tokens(loaded, cfg.n_eval, cfg.eval_period, cfg.seed + 2)
    repeated = type(repeated)(**{**repeated.__dict__, "tokens": repeated.tokens.to(device)})
    text = cfg.corpus == "text+copy"
    corpus = text_corpus() if text else None
    held_out_text = (
        held_out_text_windows(corpus.held_out, cfg.n_eval, cfg.seq_len, cfg.n_words, cfg.seed + 3).to(device)
        if corpus is not None
        else None
    )  # text
    return held_out, repeated, held_out_text, corpus


def _training_batch(cfg: TrainConfig, corpus: TextCorpus | None, gen: torch.Generator) -> Int[Tensor, "batch pos"]:
    """One training batch of ``cfg.batch_size`` sequences drawn from ``gen`` (on the CPU): copy
    sequences, mixed with windows of ``corpus.train`` for ``"text+copy"``."""
    if cfg.corpus == "text+copy":
        assert corpus is not None and cfg.copy_fraction is not None  # _eval_data made it; TrainConfig sets the fraction
        return mixed_batch(
            cfg.batch_size,
            cfg.seq_len,
            corpus.train,
            cfg.n_words,
            cfg.min_period,
            cfg.max_period,
            cfg.copy_fraction,
            gen,
            cfg.periodic,
        )[0]
    return copy_sequences(cfg.batch_size, cfg.seq_len, cfg.n_words, cfg.min_period, cfg.max_period, gen, cfg.periodic)


def _log_row(step: int, running: list[float], ev: dict, heads: list[str], text: bool) -> dict:
    """One row of :attr:`TrainRun.log` from :func:`evaluate`'s ``ev``: ``train_loss`` is the mean
    of ``running`` (the losses since the previous row; NaN when empty), then the evaluation's
    losses (nats/token), every head's induction and previous-token score (``heads`` named
    ``L.H`` in ``[layer, head]`` order) and ``top_induction_ci95_low``, the top induction head's lower
    95% bound over the repeated sequences (:func:`induction_formed`'s: formed where above 0.5)."""
    row = {
        "step": step,
        "train_loss": float(np.mean(running)) if running else float("nan"),
        "eval_loss": ev["eval_loss"],
        "in_context_loss": ev["in_context_loss"],
        "in_context_loss_ci95_low": ev["in_context_loss_ci95"][0],
        "in_context_loss_ci95_high": ev["in_context_loss_ci95"][1],
        **({"text_in_context_loss": ev["text_in_context_loss"]} if text else {}),
        "repeated_loss": ev["repeated_loss"],
        "max_induction": float(ev["induction"].max()),
        "top_induction_ci95_low": induction_formed(np.asarray(ev["induction_per_sequence"]))["ci95"][0],
        "max_previous_token": float(ev["previous_token"].max()),
    }
    row.update({f"induction_{h}": float(v) for h, v in zip(heads, ev["induction"].flatten())})
    row.update({f"previous_token_{h}": float(v) for h, v in zip(heads, ev["previous_token"].flatten())})
    return row
