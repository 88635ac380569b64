"""Per-head activation patching with a logit-difference metric, and the indirect-object
identification (IOI) prompts of Wang et al. 2022 as the worked example.

Activation patching (Meng et al. 2022; Wang et al. 2022, "Interpretability in the Wild: a Circuit
for Indirect Object Identification in GPT-2 small", arXiv 2211.00593; the conventions of Heimersheim
& Nanda 2024, "How to use and interpret activation patching"): run the model on a *clean* prompt
and on a *corrupted* one of the same length, then run the clean prompt again with one head's
output replaced by its output on the corrupted prompt, and measure how far the metric moves.
Here a head's output is its ``z`` at ``hook_z`` (before W_O), as in every ablation of the engine
(:func:`headprobe.probe.hooks.head_ablation_hooks`, kind ``resample``), at every position.

Metric: the logit difference ``LD = logit(correct) - logit(wrong)`` at the last position of each
prompt (IOI: correct = the indirect object, wrong = the subject). Per head ``h`` and prompt ``i``:
``effect_h,i = LD_patched(h),i - LD_clean,i`` (nats of logit difference; negative: the head
carries what the clean answer needs), and the normalised effect
``effect_h / (LD_corrupted - LD_clean)`` of the means (1: patching this head alone moves the
metric all the way to the corrupted run's; 0: no change).

Intervals: 95% percentile bootstrap over prompts (:func:`headprobe.analyses.statistics.bootstrap_ci`),
as for ablations.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jaxtyping import Float, Int
from torch import Tensor

from headprobe.analyses.ablation import LOGITS_BYTES_PER_PASS, require_head_ablation
from headprobe.analyses.statistics import bootstrap_ci
from headprobe.probe.backend import LoadedModel
from headprobe.probe.capture import capture_internal
from headprobe.probe.errors import HeadprobeError
from headprobe.probe.heads import all_heads
from headprobe.probe.hooks import Head, batched_ablation_hooks, head_set_masks


@dataclass(frozen=True)
class PromptPair:
    """One clean/corrupted pair: the two prompts must have the same number of tokens; the metric is
    ``logit(correct) - logit(wrong)`` after the last token (``correct``/``wrong`` are single tokens,
    with their leading space where the tokenizer has one, e.g. ``" Mary"``)."""

    clean: str
    corrupted: str
    correct: str
    wrong: str
    template: str = ""


# --------------------------------------------------------------------------------------------
# The IOI worked example
# --------------------------------------------------------------------------------------------

IOI_TEMPLATES = (
    "When {A} and {B} went to the store, {S} gave a drink to",
    "When {A} and {B} went to the park, {S} gave a ball to",
    "After {A} and {B} went to the office, {S} gave a book to",
    "While {A} and {B} were working at the school, {S} gave a pen to",
    "Then, {A} and {B} had a long argument. Afterwards {S} said to",
    "Friends {A} and {B} found a bone at the garden. {S} gave it to",
)
"""BABA/ABBA templates after Wang et al. 2022 (Appendix, "templates"): {S} is the subject, repeated;
the indirect object is the other name."""

IOI_NAMES = (
    "Mary", "John", "Tom", "James", "Anna", "Paul", "Sarah", "David", "Laura", "Michael", "Emma", "Daniel", "Kate",
    "Mark", "Lisa", "Peter", "Alice", "Robert", "Susan", "George", "Rachel", "Steven", "Linda", "Kevin", "Amy", "Brian",
    "Jessica", "Eric", "Karen", "Jack", "Helen", "Frank", "Julia", "Adam", "Emily", "Richard", "Grace", "Thomas", "Rose",
)
"""First names from Wang et al.'s list; :func:`ioi_prompts` keeps those that are one token after a space."""


def single_token_names(tokenizer: Any, names: Sequence[str] = IOI_NAMES) -> list[str]:
    """The names that ``tokenizer`` encodes as one known token after a space (``" Mary"``; not
    the unknown token)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    out = []
    for n in names:
        ids = tokenizer(" " + n, add_special_tokens=False)["input_ids"]
        if len(ids) == 1 and (unk is None or ids[0] != unk):
            out.append(n)
    return out


def ioi_prompts(tokenizer: Any, n: int = 48, seed: int = 0) -> list[PromptPair]:
    """``n`` IOI prompt pairs: clean = a template with names A, B and the subject S in {A, B}
    (half ABBA, half BABA), answer = the other name (the indirect object), wrong = S; corrupted =
    the same template with three other distinct names (Wang et al.'s "ABC" distribution), so the
    corrupted prompt carries no information about which of the clean names is the answer.
    Templates cycle in order, names are drawn with ``seed``.

    Raises:
        HeadprobeError: fewer than 6 of :data:`IOI_NAMES` are single tokens for this tokenizer.
    """
    names = single_token_names(tokenizer)
    if len(names) < 6:
        raise HeadprobeError(f"the IOI example needs at least 6 first names that are one token each; this tokenizer has {len(names)}")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        template = IOI_TEMPLATES[i % len(IOI_TEMPLATES)]
        a, b, x, y, z = (names[j] for j in rng.choice(len(names), 5, replace=False))
        io, s = (a, b) if i % 2 == 0 else (b, a)  # ABBA: S = B; BABA: S = A
        clean = template.format(A=a, B=b, S=s)
        corrupted = template.format(A=x, B=y, S=z)
        out.append(PromptPair(clean, corrupted, " " + io, " " + s, template))
    return out


# --------------------------------------------------------------------------------------------
# Patching
# --------------------------------------------------------------------------------------------

@dataclass
class PatchingResult:
    """Per-head activation patching over a set of prompt pairs.

    Attributes:
        heads: the patched ``(layer, head)`` pairs, in order.
        clean_ld, corrupted_ld: ``[n_prompts]`` logit differences of the clean and corrupted runs.
        patched_ld: ``[n_heads_patched, n_prompts]`` logit difference of the clean run with one head's z
            from the corrupted run.
        n_layers, n_heads: the model's layout (for ``[layer, head]`` arrays).
    """

    heads: list[Head]
    clean_ld: np.ndarray
    corrupted_ld: np.ndarray
    patched_ld: np.ndarray
    n_layers: int
    n_heads: int
    pairs: list[PromptPair] = field(default_factory=list)

    @property
    def effect(self) -> np.ndarray:
        """``[n_heads_patched, n_prompts]``: patched minus clean logit difference."""
        return self.patched_ld - self.clean_ld[None]

    @property
    def total(self) -> float:
        """Mean corrupted minus mean clean logit difference: the normaliser."""
        return float(self.corrupted_ld.mean() - self.clean_ld.mean())

    def as_grid(self, values: np.ndarray) -> np.ndarray:
        """``[layer, head]`` array of per-patched-head ``values`` (NaN for heads not patched)."""
        grid = np.full((self.n_layers, self.n_heads), np.nan)
        for (layer, head), v in zip(self.heads, values):
            grid[layer, head] = v
        return grid

    def table(self, seed: int = 0):
        """head_patching.csv: ``layer, head, effect`` (mean over prompts), ``effect_ci95_lo/hi``
        (bootstrap over prompts), ``normalized`` (``effect / total``)."""
        import pandas as pd

        eff = self.effect
        ci = bootstrap_ci(eff.T, seed=seed)  # [2, n_heads_patched]
        total = self.total
        return pd.DataFrame({
            "layer": [h[0] for h in self.heads], "head": [h[1] for h in self.heads],
            "effect": eff.mean(1), "effect_ci95_lo": ci[0], "effect_ci95_hi": ci[1],
            "normalized": eff.mean(1) / total if total != 0 else np.nan,
        })


def _token_id(tokenizer: Any, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise HeadprobeError(f"answer {text!r} is {len(ids)} tokens for this tokenizer; the metric needs single-token answers")
    if ids[0] == getattr(tokenizer, "unk_token_id", None):
        raise HeadprobeError(f"answer {text!r} is the tokenizer's unknown token; the metric needs answers the model knows")
    return ids[0]


def encode_pairs(model: LoadedModel, pairs: Sequence[PromptPair]) -> list[tuple[Tensor, Tensor, Tensor, list[int]]]:
    """Group ``pairs`` by token length: ``(clean [n, pos], corrupted [n, pos], answers [n, 2], indices)``
    per length (answers: correct and wrong token ids).

    Raises:
        HeadprobeError: a pair whose prompts differ in length, or an answer that is not one token.
    """
    groups: dict[int, list] = {}
    for i, p in enumerate(pairs):
        c, x = model.to_tokens(p.clean)[0], model.to_tokens(p.corrupted)[0]
        if c.shape != x.shape:
            raise HeadprobeError(f"prompt pair {i + 1}: clean and corrupted prompts have {len(c)} and {len(x)} tokens; "
                                 f"patching needs the same length")
        try:
            ans = torch.tensor([_token_id(model.tokenizer, p.correct), _token_id(model.tokenizer, p.wrong)])
        except HeadprobeError as e:
            raise HeadprobeError(f"prompt pair {i + 1}: {e}") from None
        groups.setdefault(len(c), []).append((c, x, ans, i))
    return [(torch.stack([g[0] for g in grp]), torch.stack([g[1] for g in grp]), torch.stack([g[2] for g in grp]),
             [g[3] for g in grp]) for _, grp in sorted(groups.items())]


def logit_diff(logits: Float[Tensor, "batch pos d_vocab"], answers: Int[Tensor, "batch 2"]) -> Float[Tensor, "batch"]:
    """``logit(answers[:, 0]) - logit(answers[:, 1])`` at the last position, in float32."""
    last = logits[:, -1].float()
    return last.gather(1, answers[:, :1].to(last.device))[:, 0] - last.gather(1, answers[:, 1:].to(last.device))[:, 0]


def _last_logit_diff(model: LoadedModel, tokens: Tensor, answers: Tensor, hooks=()) -> Tensor:
    """:func:`logit_diff` of a forward with ``hooks``: the last position's final residual through
    the backend's own logits function (:meth:`~headprobe.probe.backend.LoadedModel.logits_from_residual`:
    final norm, unembedding, the family's soft-cap and logit scale), for the two answer tokens
    only (the numbers of Hugging Face's logits, tested, without a ``[batch, pos, d_vocab]``
    tensor on the native backend)."""
    resid = model.final_residual(tokens, hooks)[:, -1]  # after the final norm
    logits = model.logits_from_residual(resid, vocab=answers, normed=True).float()  # [batch, 2]
    return logits[:, 0] - logits[:, 1]


@torch.inference_mode()
def patch_heads(model: LoadedModel, pairs: Sequence[PromptPair], heads: Sequence[Head] | None = None,
                max_batch: int = 64, progress: bool = False) -> PatchingResult:
    """Patch each of ``heads`` (default: all) alone from the corrupted into the clean run.

    Several heads share a forward pass along the batch axis (the clean prompts repeated once per
    head; :func:`~headprobe.probe.hooks.batched_ablation_hooks` replaces, in each copy, that copy's head
    by its corrupted z: resample ablation),
    at most ``max_batch`` sequences and :data:`~headprobe.analyses.ablation.LOGITS_BYTES_PER_PASS`
    of logits per pass. Equal to one forward per head with a ``resample`` hook (tested).

    Raises:
        HeadprobeError: bad pairs (see :func:`encode_pairs`), or a model whose self-check forbids head ablation.
    """
    require_head_ablation(model)
    spec = model.spec
    heads = list(all_heads(spec.n_layers, spec.n_heads) if heads is None else heads)
    n = len(pairs)
    clean_ld, corrupted_ld = np.zeros(n), np.zeros(n)
    patched = np.zeros((len(heads), n))
    from tqdm.auto import tqdm

    groups = encode_pairs(model, pairs)
    bar = tqdm(total=len(heads) * len(groups), desc=f"patching {len(heads)} heads x {len(groups)} prompt lengths", unit="pass",
               disable=not progress)
    for clean, corrupted, answers, idx in groups:
        clean, corrupted = clean.to(model.device), corrupted.to(model.device)
        B, T = clean.shape
        clean_ld[idx] = _last_logit_diff(model, clean, answers).cpu().numpy()
        source = capture_internal(model, corrupted)["z"]  # {layer: [B, T, head, d_head]}
        corrupted_ld[idx] = _last_logit_diff(model, corrupted, answers).cpu().numpy()
        per_pass = max(1, min(max_batch // B, LOGITS_BYTES_PER_PASS // max(1, B * T * spec.d_vocab * 4)))
        for lo in range(0, len(heads), per_pass):
            chunk = heads[lo:lo + per_pass]
            m = len(chunk)
            masks = head_set_masks([[head] for head in chunk], spec.n_layers, spec.n_heads)  # copy j patches chunk[j]
            hooks = batched_ablation_hooks(masks.to(model.device), B, "resample", source_z=source)
            ld = _last_logit_diff(model, clean.repeat(m, 1), answers.repeat(m, 1), hooks).view(m, B).cpu().numpy()
            patched[lo:lo + m, idx] = ld
            bar.update(m)
    bar.close()
    return PatchingResult(heads, clean_ld, corrupted_ld, patched, spec.n_layers, spec.n_heads, list(pairs))
