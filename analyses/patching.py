"""Activation patching with a logit-difference metric at five sites (a head's z, q, k or v; the
residual stream by layer and position), all prompt pairs in one padded batch, and the
indirect-object identification (IOI) prompts of Wang et al. 2022 as the worked example.

Activation patching (Meng et al. 2022; Wang et al. 2022, "Interpretability in the Wild: a Circuit
for Indirect Object Identification in GPT-2 small", arXiv 2211.00593; the conventions of Heimersheim
& Nanda 2024, "How to use and interpret activation patching"): run the model on a *clean* prompt
and on a *corrupted* one of the same length, then run the clean prompt again with one unit's
activation replaced by its activation on the corrupted prompt, and measure how far the metric
moves. Sites (:data:`SITES`): a head's ``z`` at ``hook_z`` (before W_O; as every ablation of the
engine, kind ``resample``), its query, key or value input (``hook_q``/``hook_k``/``hook_v``; under
GQA one query head's k/v as :func:`head_input_hooks` says), each at every position; or the
residual stream entering a layer at one position (``hook_resid_pre``).

Metric: the logit difference ``LD = logit(correct) - logit(wrong)`` after the last (real) token of
each prompt (IOI: correct = the indirect object, wrong = the subject). Per unit ``u`` and prompt
``i``: ``effect_u,i = LD_patched(u),i - LD_clean,i`` (logit units; negative: the unit carries what
the clean answer needs), and the normalised effect ``effect_u / (LD_corrupted - LD_clean)`` of the
means (1: patching this unit alone moves the metric all the way to the corrupted run's; 0: no change).

Intervals: the Student-t interval over prompts (:func:`headprobe.analyses.statistics.mean_ci`), as
for ablations, from ``MIN_N_FOR_CI`` (2) pairs up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from headprobe.analyses.ablation import LOGITS_BYTES_PER_PASS, require_head_ablation
from headprobe.analyses.statistics import interval_rule, mean_ci
from headprobe.analyses.vocabulary import MIN_N_FOR_CI, PATCH_SITES
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core import memory
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import all_heads, given_heads
from headprobe.probe.core.registry import did_you_mean
from headprobe.probe.hooks.ablation import Head, HookFn
from headprobe.probe.hooks.names import attn_hook, block_hook


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
    "Mary",
    "John",
    "Tom",
    "James",
    "Anna",
    "Paul",
    "Sarah",
    "David",
    "Laura",
    "Michael",
    "Emma",
    "Daniel",
    "Kate",
    "Mark",
    "Lisa",
    "Peter",
    "Alice",
    "Robert",
    "Susan",
    "George",
    "Rachel",
    "Steven",
    "Linda",
    "Kevin",
    "Amy",
    "Brian",
    "Jessica",
    "Eric",
    "Karen",
    "Jack",
    "Helen",
    "Frank",
    "Julia",
    "Adam",
    "Emily",
    "Richard",
    "Grace",
    "Thomas",
    "Rose",
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
        raise HeadprobeError(
            f"the IOI example needs at least 6 first names that are one token each; this tokenizer has {len(names)}"
        )
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
# Hook sites: what a patch replaces (small public functions; path patching builds on them)
# --------------------------------------------------------------------------------------------

SITES = PATCH_SITES
"""Where :func:`patch` can patch: a head's ``z`` (its output, before W_O), its query, key or value
input (``hook_q``/``hook_k``/``hook_v``), or the residual stream entering a layer at one position
(``hook_resid_pre``)."""

HEAD_SITES = ("z", "q", "k", "v")
"""The sites patched per query head (the others are patched per layer and position)."""


def site_hook_name(site: str, layer: int) -> str:
    """The TransformerLens hook name of ``site`` at ``layer``: ``blocks.{layer}.attn.hook_{z,q,k,v}``
    (``hook_z`` ``[batch, pos, head, d_head]``; ``hook_q`` ``[batch, pos, head, d_qk]``; ``hook_k``,
    ``hook_v`` ``[batch, pos, kv_head, d]``, before rotary and QK-norm on the native backend) or
    ``blocks.{layer}.hook_resid_pre`` ``[batch, pos, d_model]``.

    Raises:
        HeadprobeError: ``site`` not one of :data:`SITES`.
    """
    if site == "resid":
        return block_hook(layer, "resid_pre")
    if site in HEAD_SITES:
        return attn_hook(layer, site)
    raise HeadprobeError(
        f"unknown patching site {site!r}{did_you_mean(str(site), SITES)}; choose one of {', '.join(SITES)}"
    )


def check_site(model: LoadedModel, site: str, layers: Sequence[int]) -> None:
    """Refuse, with one line, a site the backend has no hook point for (at one of ``layers``).

    Raises:
        HeadprobeError: unknown ``site`` or a missing hook point.
    """
    names = set(model.hook_names())
    for layer in layers:
        if site_hook_name(site, layer) not in names:
            raise HeadprobeError(
                f"the {model.backend} backend has no hook point {site_hook_name(site, layer)}: "
                f"--site {site} is not available for this model"
            )


def _select(keep: Tensor, source: Tensor, act: Tensor) -> Tensor:
    """``torch.where(keep, source, act)`` over ``act``'s ``[rows, ...]`` (``keep`` ``[rows, ...]``,
    broadcastable), where ``source`` holds ``rows`` sequences or one batch of ``n`` that the rows
    repeat ``rows // n`` times along the batch axis: then a view of ``act`` as ``[rows // n, n, ...]``
    lets ``torch.where`` broadcast the one source over the copies (the same numbers as repeating it
    first, without the copies).

    Raises:
        HeadprobeError: ``rows`` is not a multiple of the source's sequences.
    """
    rows, n = act.shape[0], source.shape[0]
    if n == rows:
        return torch.where(keep, source.to(act), act)
    if n == 0 or rows % n:
        raise HeadprobeError(f"a patch source of {n} sequences cannot serve a forward of {rows}")
    m = rows // n
    return torch.where(keep.unflatten(0, (m, n)), source.to(act), act.unflatten(0, (m, n))).flatten(0, 1)


def head_input_hooks(
    layer: int,
    site: str,
    heads: Bool[Tensor, "rows head"],
    source: Float[Tensor, "batch pos n d"],
    clean_z: Float[Tensor, "batch pos head d_head"] | None = None,
) -> list[tuple[str, Any]]:
    """Hooks giving, in row ``r`` of a forward, each query head ``h`` with ``heads[r, h]`` its
    ``site`` activation (``z``, ``q``, ``k`` or ``v``) from ``source`` at layer ``layer``, every
    position; every other head keeps its own. ``source`` and ``clean_z`` hold either one sequence
    per row (``batch = rows``; row ``r`` reads ``source[r]``) or one batch that the forward's rows
    repeat ``rows // batch`` times along the batch axis (as :func:`patch` runs its units; row ``r``
    reads ``source[r % batch]``), read once for every copy through a broadcast view, never repeated.

    GQA (``n_kv_heads < n_heads``): a key or value belongs to one KV head, shared by its group of
    ``n_heads // n_kv_heads`` query heads. To give one query head the corrupted k/v while its group
    keeps the clean one, the KV head is replaced at ``hook_k``/``hook_v`` (so every head of the
    group attends with it) and, at the same layer's ``hook_z``, the group's *other* heads get back
    their clean ``z`` from ``clean_z`` (the run without the patch). This is exact: the patch acts at
    ``layer`` only, so that layer's input is the clean run's and the other heads' clean ``z`` is
    what they compute with the clean k/v. It equals expanding the KV head into one copy per query
    head and patching that query head's copy (tested against a model whose KV heads are expanded so,
    tests/test_patch.py). Where the hook holds one slice per query head (``q``, ``z``, MHA, MLA, or a
    backend that expands KV heads itself), the slice is replaced directly.

    Args:
        layer: the layer. site: ``z``, ``q``, ``k`` or ``v``. heads: ``[rows, head]`` which query
            heads are patched in which row. source: the site's activation ``[batch, pos, n, d]``
            on the corrupted input (``n``: heads or KV heads, as the hook holds them).
        clean_z: ``[batch, pos, head, d_head]``, the layer's z without the patch; needed for ``k``/``v``
            under GQA.

    Raises:
        HeadprobeError: (when the hooks run) the hook's head axis fits neither the query heads nor a
            grouping of them, ``clean_z`` missing where a group's other heads must be restored, or
            ``rows`` not a multiple of ``batch``.
    """
    name, n_heads, state = site_hook_name(site, layer), heads.shape[1], {}

    def put(act: Tensor, hook: Any) -> Tensor:
        n = act.shape[2]
        if n == n_heads:
            sel = heads.to(act.device)
        elif site in ("k", "v") and n_heads % n == 0:  # the KV heads read by the patched query heads
            sel = heads.to(act.device).view(heads.shape[0], n, n_heads // n).any(-1)
            state["others"] = sel.repeat_interleave(n_heads // n, dim=1) & ~heads.to(act.device)
        else:
            raise HeadprobeError(f"{name} has {n} heads on its head axis; expected {n_heads} query heads or a divisor")
        return _select(sel[:, None, :, None], source, act)

    def restore(z: Tensor, hook: Any) -> Tensor:
        others = state.pop("others", None)
        if others is None or not others.any():
            return z
        if clean_z is None:
            raise HeadprobeError(
                "patching one query head's k or v under GQA needs the layer's clean z (clean_z) "
                "to keep the other heads of its group clean"
            )
        return _select(others[:, None, :, None], clean_z, z)

    hooks: list[tuple[str, HookFn]] = [(name, put)]
    if site in ("k", "v"):
        hooks.append((attn_hook(layer, "z"), restore))
    return hooks


def resid_hooks(
    layer: int, where: Bool[Tensor, "rows pos"], source: Float[Tensor, "batch pos d_model"]
) -> list[tuple[str, Any]]:
    """A hook replacing the residual stream entering ``layer`` (``hook_resid_pre``) by ``source``
    where ``where`` is True (sequence, position) and leaving it elsewhere; ``source`` may hold one
    batch that the forward's rows repeat, read once for every copy (as :func:`head_input_hooks`)."""

    def put(x: Tensor, hook: Any) -> Tensor:
        return _select(where.to(x.device)[..., None], source, x)

    return [(site_hook_name("resid", layer), put)]


# --------------------------------------------------------------------------------------------
# Patching
# --------------------------------------------------------------------------------------------

Unit = tuple[int, int]
"""What one patch replaces: ``(layer, head)`` for the head sites, ``(layer, pos)`` for ``resid``
(``pos`` indexes the prompt's real tokens, BOS included; negative counts from the end)."""


@dataclass
class PatchingResult:
    """Activation patching of one site over a set of prompt pairs.

    Attributes:
        site: one of :data:`SITES`. units: the patched ``(layer, head)`` (head sites) or
            ``(layer, pos)`` (``resid``) pairs, in order (``heads`` is the same list).
        clean_ld, corrupted_ld: ``[n_prompts]`` logit differences of the clean and corrupted runs.
        patched_ld: ``[n_units, n_prompts]`` logit difference of the clean run with one unit from
            the corrupted run.
        n_layers, n_heads: the model's layout (for ``[layer, head]`` arrays).
        n_forward: forward passes the run took (the clean and corrupted capture included).
    """

    heads: list[Unit]
    clean_ld: np.ndarray
    corrupted_ld: np.ndarray
    patched_ld: np.ndarray
    n_layers: int
    n_heads: int
    pairs: list[PromptPair] = field(default_factory=list)
    site: str = "z"
    n_forward: int = 0

    @property
    def units(self) -> list[Unit]:
        """The patched units (the same list as ``heads``; ``(layer, pos)`` for ``resid``)."""
        return self.heads

    @property
    def effect(self) -> np.ndarray:
        """``[n_units, n_prompts]``: patched minus clean logit difference."""
        return self.patched_ld - self.clean_ld[None]

    @property
    def total(self) -> float:
        """Mean corrupted minus mean clean logit difference: the normaliser."""
        return float(self.corrupted_ld.mean() - self.clean_ld.mean())

    @property
    def has_intervals(self) -> bool:
        """Whether there are enough pairs (:data:`MIN_N_FOR_CI`) for intervals."""
        return len(self.clean_ld) >= MIN_N_FOR_CI

    @property
    def interval_note(self) -> str:
        """What the outputs say about intervals."""
        if self.has_intervals:
            return interval_rule("prompt pairs")
        return f"none: {len(self.clean_ld)} prompt pair; intervals are given from {MIN_N_FOR_CI} pairs up"

    @property
    def positions(self) -> list[int]:
        """``resid``: the patched positions, in the order they first appear."""
        return list(dict.fromkeys(u[1] for u in self.heads))

    def as_grid(self, values: np.ndarray) -> np.ndarray:
        """``[layer, head]`` (``resid``: ``[layer, position]`` over :attr:`positions`) array of
        per-unit ``values`` (NaN where not patched)."""
        cols = {p: i for i, p in enumerate(self.positions)} if self.site == "resid" else None
        grid = np.full((self.n_layers, len(cols) if cols else self.n_heads), np.nan)
        for (layer, col), v in zip(self.heads, values):
            grid[layer, cols[col] if cols else col] = v
        return grid

    def table(self, seed: int = 0):
        """The CSV: ``layer, head`` (``resid``: ``layer, pos``), ``effect`` (mean over prompts),
        ``effect_ci95_lo/hi`` (t interval over prompts; from :data:`MIN_N_FOR_CI` pairs up, else
        one column ``effect_ci95`` saying why there are none), ``normalized`` (``effect / total``)
        and ``effect_pair_1 .. effect_pair_n`` (each prompt pair's effect; their mean is ``effect``)."""
        import pandas as pd

        eff = self.effect
        total = self.total
        cols: dict[str, Any] = {
            "layer": [u[0] for u in self.heads],
            ("pos" if self.site == "resid" else "head"): [u[1] for u in self.heads],
            "effect": eff.mean(1),
        }
        if self.has_intervals:
            ci = mean_ci(eff.T)  # [2, n_units]
            cols.update(effect_ci95_lo=ci[0], effect_ci95_hi=ci[1])
        else:
            cols["effect_ci95"] = self.interval_note
        cols["normalized"] = eff.mean(1) / total if total != 0 else np.nan
        cols.update({f"effect_pair_{i + 1}": eff[:, i] for i in range(eff.shape[1])})
        return pd.DataFrame(cols)


def _token_id(tokenizer: Any, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise HeadprobeError(
            f"answer {text!r} is {len(ids)} tokens for this tokenizer; the metric needs single-token answers"
        )
    if ids[0] == getattr(tokenizer, "unk_token_id", None):
        raise HeadprobeError(
            f"answer {text!r} is the tokenizer's unknown token; the metric needs answers the model knows"
        )
    return ids[0]


def answer_space_notes(tokenizer: Any, pairs: Sequence[PromptPair]) -> list[str]:
    """A note (one line, no ``NOTE:``) when answers lack the leading space a word after a word has in
    a BPE vocabulary (``"Mary"`` after ``"... to"``, where the model's next token is ``" Mary"``), and
    the spaced form is one token too: both are valid answers, so the run is not refused, but the
    unspaced one is seldom the continuation meant. Empty when every answer is spaced or follows a space."""

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    odd = [
        a
        for p in pairs
        for a in (p.correct, p.wrong)
        if a[:1].isalnum() and p.clean[-1:].isalnum() and len(spaced := ids(" " + a)) == 1 and spaced != ids(a)
    ]
    if not odd:
        return []
    shown = ", ".join(repr(a) for a in dict.fromkeys(odd[:3]))
    return [
        f"{len(odd)} of {2 * len(pairs)} answers have no leading space ({shown}) after a prompt that ends in a "
        f"word: the next token there is usually the spaced one ({' ' + odd[0]!r}, also one token); check the answers"
    ]


@dataclass
class PairBatch:
    """Prompt pairs as one (padded) batch: ``clean``, ``corrupted`` ``[n, pos]``, ``mask`` ``[n, pos]``
    (1 real, 0 padding; None when nothing is padded), ``answers`` ``[n, 2]`` (correct, wrong token
    ids), ``first``/``last`` ``[n]`` (index of each prompt's first and last real token), ``index``
    (which pairs, in the caller's order). A pair's two prompts have one length, so they pad alike."""

    clean: Tensor
    corrupted: Tensor
    mask: Tensor | None
    answers: Tensor
    first: Tensor
    last: Tensor
    index: list[int]

    @property
    def lengths(self) -> Tensor:
        """``[n]`` each prompt's number of real tokens."""
        return self.last - self.first + 1


def encode_pairs(
    model: LoadedModel, pairs: Sequence[PromptPair], padding_side: str = "left", pad: bool | None = None
) -> list[PairBatch]:
    """Tokenize ``pairs`` into one padded :class:`PairBatch` (``pad``; default: where the backend
    computes ``padding_side`` exactly, :attr:`~headprobe.probe.backends.base.LoadedModel.padding_sides`:
    the native backend both sides, the bridge right padding), else one unpadded batch per token
    length, shortest first.

    Raises:
        HeadprobeError: a pair whose prompts are empty, differ in length or are longer than the model's
            context (``spec.n_ctx``), an answer that is not one token, the same token as correct and
            wrong, or a token id outside the model's
            vocabulary (:meth:`~headprobe.probe.backends.base.LoadedModel.check_token_ids`).
    """
    from headprobe.probe.hooks.capture import pad_prompts

    rows = []
    for i, p in enumerate(pairs):
        for which, text in (("clean", p.clean), ("corrupted", p.corrupted)):
            if not text.strip():
                raise HeadprobeError(
                    f"prompt pair {i + 1}: the {which} prompt is empty; the metric needs a prompt to continue"
                )
        try:
            c, x = model.to_tokens(p.clean)[0], model.to_tokens(p.corrupted)[0]
        except HeadprobeError as e:
            raise HeadprobeError(f"prompt pair {i + 1}: {e}") from None
        if c.shape != x.shape:
            raise HeadprobeError(
                f"prompt pair {i + 1}: clean and corrupted prompts have {len(c)} and {len(x)} tokens; "
                f"patching needs the same length"
            )
        if len(c) > model.spec.n_ctx:
            raise HeadprobeError(
                f"prompt pair {i + 1}: the prompts are {len(c)} tokens, longer than the model's context "
                f"of {model.spec.n_ctx} positions"
            )
        try:
            ans = torch.tensor([_token_id(model.tokenizer, p.correct), _token_id(model.tokenizer, p.wrong)])
        except HeadprobeError as e:
            raise HeadprobeError(f"prompt pair {i + 1}: {e}") from None
        if ans[0] == ans[1]:
            raise HeadprobeError(
                f"prompt pair {i + 1}: correct {p.correct!r} and wrong {p.wrong!r} are the same token; "
                f"their logit difference is 0 whatever is patched"
            )
        model.check_token_ids(ans, f"prompt pair {i + 1}: the answers")
        rows.append((c, x, ans, i))
    pad = padding_side in getattr(model, "padding_sides", ()) if pad is None else pad
    groups: dict[int, list] = {}
    for r in rows:
        groups.setdefault(0 if pad else len(r[0]), []).append(r)
    out = []
    for _, grp in sorted(groups.items()):
        clean, mask = pad_prompts([g[0] for g in grp], model.pad_token_id, padding_side)
        corrupted, _ = pad_prompts([g[1] for g in grp], model.pad_token_id, padding_side)
        lengths = mask.sum(1)
        first = clean.shape[1] - lengths if padding_side == "left" else torch.zeros_like(lengths)
        out.append(
            PairBatch(
                clean,
                corrupted,
                None if bool(mask.all()) else mask,
                torch.stack([g[2] for g in grp]),
                first,
                first + lengths - 1,
                [g[3] for g in grp],
            )
        )
    return out


def logit_diff(logits: Float[Tensor, "batch pos d_vocab"], answers: Int[Tensor, "batch 2"]) -> Float[Tensor, " batch"]:
    """``logit(answers[:, 0]) - logit(answers[:, 1])`` at the last position, in float32."""
    last = logits[:, -1].float()
    return last.gather(1, answers[:, :1].to(last.device))[:, 0] - last.gather(1, answers[:, 1:].to(last.device))[:, 0]


def _logit_diffs(model: LoadedModel, batch: PairBatch, tokens: Tensor, copies: int, hooks=()) -> Tensor:
    """The logit difference after each prompt's last real token (``copies`` repeats of ``batch``
    along the batch axis) from one forward with ``hooks``: the final residual there through the
    backend's own logits function (:meth:`~headprobe.probe.backends.base.LoadedModel.logits_from_residual`:
    final norm, unembedding, the family's soft-cap and logit scale), for the two answer tokens
    only (the numbers of Hugging Face's logits, tested, without a ``[batch, pos, d_vocab]``
    tensor on the native backend)."""
    mask = None if batch.mask is None else batch.mask.repeat(copies, 1).to(model.device)
    resid = model.final_residual(tokens.to(model.device), hooks, mask)  # after the final norm
    last = batch.last.repeat(copies).to(resid.device)
    resid = resid[torch.arange(len(last), device=resid.device), last]
    logits = model.logits_from_residual(resid, vocab=batch.answers.repeat(copies, 1), normed=True).float()  # [rows, 2]
    return logits[:, 0] - logits[:, 1]


def _capture(
    model: LoadedModel, batch: PairBatch, names: Sequence[str]
) -> tuple[dict[str, Tensor], dict[str, Tensor], Tensor]:
    """One forward over the clean and corrupted prompts together: the activations at ``names``
    (clean, corrupted) and the logit differences ``[2, n]``."""
    kept: dict[str, Tensor] = {}

    def saver(name: str):
        def hook(x: Tensor, hook: Any) -> None:
            kept[name] = x.detach().clone()

        return hook

    clean, corrupted, answers, first, last = (
        torch.cat([t, t]) for t in (batch.clean, batch.corrupted, batch.answers, batch.first, batch.last)
    )
    both = PairBatch(
        clean,
        corrupted,
        None if batch.mask is None else torch.cat([batch.mask, batch.mask]),
        answers,
        first,
        last,
        index=batch.index,
    )
    ld = _logit_diffs(model, both, torch.cat([batch.clean, batch.corrupted]), 1, [(n, saver(n)) for n in names])
    n = batch.clean.shape[0]
    return {k: v[:n] for k, v in kept.items()}, {k: v[n:] for k, v in kept.items()}, ld.view(2, n)


def _unit_hooks(
    site: str,
    chunk: Sequence[Unit],
    batch: PairBatch,
    n_heads: int,
    clean: dict[str, Tensor],
    corrupted: dict[str, Tensor],
) -> list[tuple[str, Any]]:
    """Hooks for one forward over ``len(chunk)`` copies of ``batch``: copy ``j`` patches ``chunk[j]``.
    Each layer's corrupted source (and clean ``z``) is held once, not once per copy: the hooks
    broadcast it over the copies (:func:`head_input_hooks`)."""
    m, n, T = len(chunk), batch.clean.shape[0], batch.clean.shape[1]
    hooks: list[tuple[str, Any]] = []
    for layer in sorted({u[0] for u in chunk}):
        name = site_hook_name(site, layer)
        source = corrupted[name]
        if site == "resid":
            where = torch.zeros(m, n, T, dtype=torch.bool)
            for j, (lay, pos) in enumerate(chunk):
                if lay == layer:
                    index = batch.first + pos if pos >= 0 else batch.last + 1 + pos
                    where[j, torch.arange(n), index] = True
            hooks += resid_hooks(layer, where.flatten(0, 1), source)
            continue
        sel = torch.zeros(m, n_heads, dtype=torch.bool)
        for j, (lay, head) in enumerate(chunk):
            sel[j, head] = lay == layer
        z = clean.get(attn_hook(layer, "z"))
        hooks += head_input_hooks(layer, site, sel.repeat_interleave(n, dim=0), source, z)
    return hooks


def default_units(spec: Any, site: str, pairs_min_length: int) -> list[Unit]:
    """Every head for the head sites; every (layer, position) of the shortest prompt for ``resid``."""
    if site == "resid":
        return [(layer, pos) for layer in range(spec.n_layers) for pos in range(pairs_min_length)]
    return list(all_heads(spec.n_layers, spec.n_heads))


def _check_units(spec: Any, site: str, units: Sequence[Unit], batches: Sequence[PairBatch]) -> None:
    shortest = min(int(b.lengths.min()) for b in batches)
    for layer, col in units:
        if not 0 <= layer < spec.n_layers:
            raise HeadprobeError(f"layer {layer} does not exist (the model has {spec.n_layers} layers)")
        if site != "resid" and not 0 <= col < spec.n_heads:
            raise HeadprobeError(f"head {layer}.{col} does not exist (the model has {spec.n_heads} heads per layer)")
        if site == "resid" and not -shortest <= col < shortest:
            raise HeadprobeError(
                f"position {col} is outside the shortest prompt ({shortest} tokens); "
                f"positions run from {-shortest} to {shortest - 1}"
            )


def site_width(spec: Any, site: str) -> int:
    """Numbers per token that the hook of ``site`` holds at one layer: ``z`` ``n_heads * d_head``,
    ``q`` ``n_heads * d_qk``, ``k`` ``kv * d_qk``, ``v`` ``kv * d_head`` (``kv``: the key/value heads,
    an MLA layer's ``n_heads``), ``resid`` ``d_model``."""
    lay = spec.layout
    kv = lay.n_heads if lay.is_mla else lay.n_kv_heads
    widths = {"z": lay.n_heads * lay.d_head, "q": lay.n_heads * lay.d_qk, "k": kv * lay.d_qk, "v": kv * lay.d_head}
    return int(widths.get(site, lay.d_model))


def pass_plans(
    model: LoadedModel, batch: int, seq_len: int, site: str, n_layers: int, max_batch: int = 64
) -> tuple[memory.BatchPlan, memory.BatchPlan]:
    """The two steps of :func:`patch` on one :class:`PairBatch` of ``batch`` pairs of ``seq_len``
    tokens patching units of ``n_layers`` layers, each planned under the memory budget
    (:func:`headprobe.probe.core.memory.plan`), in bytes with ``e`` the model's element size and
    ``w`` :func:`site_width` (plus ``n_heads * d_head`` for ``k``/``v``, whose clean ``z`` is kept too):

    - kept through both: the captured clean and corrupted activations, ``2 * batch * seq_len * n_layers * w * e``;
    - the capture: ``2 * batch`` sequences (clean and corrupted together), each
      :func:`~headprobe.probe.layout.cost.forward_sequence_bytes` with float32 logits at the answer
      position (every position where :attr:`~LoadedModel.residual_with_logits`);
    - a patched pass: from ``batch`` (one unit) up to ``batch * (max_batch // batch)`` sequences, each the
      same forward plus the hook's patched copy, ``seq_len * held * e`` (``held``: ``w``, plus the
      restored ``z`` for ``k``/``v``); the sources are the kept corrupted activations, read by every
      copy through a broadcast view (:func:`head_input_hooks`), never repeated per unit.

    Returns:
        ``(capture, passes)``; ``passes.items`` is the most sequences a patched pass may hold.

    Raises:
        HeadprobeError: a step that does not fit in the budget (one line, before any allocation).
    """
    spec, e, T = model.spec, model.dtype.itemsize, seq_len
    w = site_width(spec, site)
    held = w + (spec.n_heads * spec.d_head if site in ("k", "v") else 0)
    kept = 2 * batch * T * n_layers * held * e
    positions = T if model.residual_with_logits else 1
    fwd = spec.forward_sequence_bytes(T, e, logit_positions=positions)
    units = max(1, max_batch // batch)
    per = fwd + T * e * held
    shape = f"{batch} x {T} tokens"
    both = f"patching's clean and corrupted capture (2 x {shape})"
    capture = memory.plan(fwd, model.device, 2 * batch, both, kept, 2 * batch)
    one = f"patching's passes ({shape} a unit, --site {site})"
    passes = memory.plan(per, model.device, batch, one, kept, units * batch)
    return capture, passes


def memory_plan(
    model: LoadedModel,
    pairs: Sequence[PromptPair],
    site: str = "z",
    units: Sequence[Unit] | None = None,
    max_batch: int = 64,
    padding_side: str | None = None,
) -> memory.BatchPlan:
    """The largest step of :func:`patch` on ``pairs`` (:func:`pass_plans` of each batch
    :func:`encode_pairs` makes): the plan whose whole batch and kept bytes are the most.

    Raises:
        HeadprobeError: as :func:`encode_pairs`, or a step that does not fit in the memory budget.
    """
    batches = encode_pairs(model, pairs, _padding_side(model, padding_side))
    shortest = min(int(b.lengths.min()) for b in batches)
    layers = {u[0] for u in (default_units(model.spec, site, shortest) if units is None else units)}
    plans = [
        p for b in batches for p in pass_plans(model, b.clean.shape[0], b.clean.shape[1], site, len(layers), max_batch)
    ]
    return max(plans, key=lambda p: p.total)


def _padding_side(model: LoadedModel, padding_side: str | None) -> str:
    sides = getattr(model, "padding_sides", ())
    return padding_side or ("left" if "left" in sides or not sides else "right")


@torch.inference_mode()
def patch(
    model: LoadedModel,
    pairs: Sequence[PromptPair],
    site: str = "z",
    units: Sequence[Unit] | None = None,
    max_batch: int = 64,
    padding_side: str | None = None,
    progress: bool = False,
) -> PatchingResult:
    """Patch each of ``units`` alone at ``site`` from the corrupted into the clean run.

    ``site`` (:data:`SITES`): a query head's ``z``, ``q``, ``k`` or ``v`` at every position (units
    ``(layer, head)``; k/v under GQA as :func:`head_input_hooks` says), or the residual stream
    entering a layer at one position (``resid``; units ``(layer, pos)``, ``pos`` counted over the
    prompt's real tokens). Default units: :func:`default_units`.

    All pairs run as one padded batch (``padding_side``; default left where the backend computes it
    exactly, else right: :attr:`~headprobe.probe.backends.base.LoadedModel.padding_sides`), so pairs of
    different lengths need no pass per length (one batch per length where the backend takes no
    padding). One forward captures
    the clean and corrupted runs together; then several units share a forward along the batch
    axis (the clean prompts repeated once per unit), at most ``max_batch`` sequences, as many as the
    memory budget holds (:func:`pass_plans`) and
    :data:`~headprobe.analyses.ablation.LOGITS_BYTES_PER_PASS` of logits per pass. Equal to one
    unpadded forward per unit and pair with a hand-written hook (tested).

    Raises:
        HeadprobeError: bad pairs (see :func:`encode_pairs`), a unit or site that does not exist
            for the model, a model whose self-check forbids head ablation, or a step that does not fit
            in the memory budget (:func:`pass_plans`, before its batch is captured).
    """
    require_head_ablation(model)
    spec = model.spec
    batches = encode_pairs(model, pairs, _padding_side(model, padding_side))
    units = given_heads(units, "units") or list(default_units(spec, site, min(int(b.lengths.min()) for b in batches)))
    _check_units(spec, site, units, batches)
    layers = sorted({u[0] for u in units})
    check_site(model, site, layers)
    names = [site_hook_name(site, layer) for layer in layers]
    names += [attn_hook(layer, "z") for layer in layers] if site in ("k", "v") else []
    n = len(pairs)
    clean_ld, corrupted_ld, patched = np.zeros(n), np.zeros(n), np.zeros((len(units), n))
    from headprobe.probe.core.progress import progress_bar

    bar = progress_bar(
        total=len(units) * len(batches), desc=f"patching {len(units)} x {site}", unit="patch", progress=progress
    )
    passes = 0
    for b in batches:
        B, T = b.clean.shape
        planned = pass_plans(model, B, T, site, len(layers), max_batch)[1].items // B
        clean, corrupted, ld = _capture(model, b, names)
        clean_ld[b.index], corrupted_ld[b.index] = ld.cpu().numpy()
        per_pass = max(1, min(planned, LOGITS_BYTES_PER_PASS // max(1, B * T * spec.d_vocab * 4)))
        passes += 1 + -(-len(units) // per_pass)
        for lo in range(0, len(units), per_pass):
            chunk = units[lo : lo + per_pass]
            hooks = _unit_hooks(site, chunk, b, spec.n_heads, clean, corrupted)
            ld = _logit_diffs(model, b, b.clean.repeat(len(chunk), 1), len(chunk), hooks)
            patched[lo : lo + len(chunk), b.index] = ld.view(len(chunk), B).cpu().numpy()
            bar.update(len(chunk))
        del clean, corrupted  # before the next batch's capture
    bar.close()
    return PatchingResult(
        units, clean_ld, corrupted_ld, patched, spec.n_layers, spec.n_heads, list(pairs), site, passes
    )


def patch_heads(
    model: LoadedModel,
    pairs: Sequence[PromptPair],
    heads: Sequence[Head] | None = None,
    max_batch: int = 64,
    progress: bool = False,
) -> PatchingResult:
    """:func:`patch` at ``site="z"``: each of ``heads`` (default: all) alone, its ``z`` from the
    corrupted run (resample ablation at ``hook_z``; equal to one forward per head with a
    ``resample`` hook of :func:`~headprobe.probe.hooks.ablation.head_ablation_hooks`, tested).

    Raises:
        HeadprobeError: as :func:`patch`.
    """
    return patch(model, pairs, "z", given_heads(heads), max_batch=max_batch, progress=progress)
