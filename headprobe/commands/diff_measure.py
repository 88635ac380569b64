"""``headprobe diff``'s measurement of one model and of both (torch): each type's ranking score
(:func:`~headprobe.analyses.scoring.score_tokens`) and each task's single-head ablation effect
(:func:`~headprobe.analyses.ablation.exact_sweep`), per sequence, on the tokens both models share,
and the check that their tokenizers give those tokens the same meaning. Used by
:mod:`headprobe.commands.diff_core`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from headprobe.analyses.ablation import exact_sweep, first_scored
from headprobe.analyses.columns import DETECTORS
from headprobe.analyses.data import TokenSet
from headprobe.analyses.scoring import score_tokens
from headprobe.commands.diff import DiffConfig
from headprobe.probe.backends.base import LoadedModel

MEASURE_STEPS = ("scoring natural", "scoring repeated", "ablation sweep natural", "ablation sweep repeated")
""":func:`measure`'s steps, in order (one model's; a progress bar counts them)."""


def measure(
    model: LoadedModel,
    natural: TokenSet,
    repeated: TokenSet,
    types: tuple[str, ...],
    kind: str,
    step: Callable[[str], None] | None = None,
    progress: bool = False,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``(per_sequence, means)``: quantity -> ``[batch, layer, head]`` per-sequence values and
    ``[layer, head]`` their scores as scan reports them. Quantities: each type's ranking column
    (on its token set) and ``ablation_<task>``, the single-head ablation effect on that task
    (nats/token, the exact sweep's per-sequence loss minus the clean loss). ``step`` is called with
    each of :data:`MEASURE_STEPS` as it starts; ``progress``: the sweeps' own bars over their passes."""
    say = step or (lambda _: None)
    per_seq: dict = {}
    first_nat = first_scored("natural", natural.start, None)
    first_rep = first_scored("repeated", repeated.start, repeated.period)
    say(MEASURE_STEPS[0])
    s1, _, mean_z = score_tokens(model, natural, "natural", first_nat, mean_z=True, types=types, per_sequence=per_seq)
    say(MEASURE_STEPS[1])
    s2, _, _ = score_tokens(model, repeated, "repeated", first_rep, types=types, per_sequence=per_seq)
    cols = [DETECTORS[t].rank_by for t in types]
    out = {c: per_seq[c].numpy() for c in cols}
    means = {c: {**s1, **s2}[c].numpy() for c in cols}
    for i, (task, ts, first) in enumerate((("natural", natural, first_nat), ("repeated", repeated, first_rep))):
        say(MEASURE_STEPS[2 + i])
        src = ts.tokens.roll(1, dims=0) if kind == "resample" else None
        sw = exact_sweep(
            model,
            ts.tokens,
            kind=kind,
            mean_z=mean_z,
            source_tokens=src,
            first=first,
            per_sequence=True,
            progress=progress,
        )
        assert sw.per_sequence is not None and sw.clean_per_sequence is not None
        eff = (sw.per_sequence - sw.clean_per_sequence[None, None]).permute(2, 0, 1)  # [batch, layer, head]
        out[f"ablation_{task}"] = eff.double().numpy()
        means[f"ablation_{task}"] = sw.effect.numpy()
    return out, means


SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token")
"""The special tokens two tokenizers must share: BOS starts every sequence, EOS separates texts,
UNK stands for what the vocabulary lacks (padding is never used: every sequence is full length)."""


def tokenizer_refusal(a, b, name_a: str, name_b: str) -> str | None:
    """The one-line refusal when two Hugging Face tokenizers give an id other token strings
    (``get_vocab()``, added tokens included) or differ in a :data:`SPECIAL_TOKENS` (its string or
    id); None where they agree. B is run on A's token ids, so they must mean the same tokens."""
    if a is b:
        return None
    try:
        va, vb = a.get_vocab(), b.get_vocab()
    except (AttributeError, NotImplementedError):
        return (
            f"cannot compare the tokenizers of {name_a} and {name_b} (no get_vocab): diff runs B on A's "
            "token ids, which must name the same tokens"
        )
    if va != vb:
        ia, ib = {i: t for t, i in va.items()}, {i: t for t, i in vb.items()}
        ids = sorted(set(ia) | set(ib))
        bad = [i for i in ids if ia.get(i) != ib.get(i)]
        return (
            f"{name_a} and {name_b} have different tokenizers: {len(bad)} of {len(ids)} ids name other tokens "
            f"(id {bad[0]} is {ia.get(bad[0])!r} in {name_a} and {ib.get(bad[0])!r} in {name_b}); diff runs B on "
            "A's token ids, which must name the same tokens"
        )
    for name in SPECIAL_TOKENS:
        ta, tb = getattr(a, name, None), getattr(b, name, None)
        ida, idb = getattr(a, name + "_id", None), getattr(b, name + "_id", None)
        if (str(ta), ida) != (str(tb), idb):
            return (
                f"{name_a} and {name_b} have different tokenizers: {name} {ta!r} (id {ida}) vs {tb!r} (id {idb}); "
                "diff runs B on A's token sequences"
            )
    return None


def _measured(a: LoadedModel, b: LoadedModel, natural: TokenSet, repeated: TokenSet, cfg: DiffConfig, progress: bool):
    """:func:`measure` of both models, under one progress bar over their :data:`MEASURE_STEPS`."""
    from headprobe.probe.core.progress import progress_bar

    assert cfg.types is not None  # set by compare_models
    per, means = {}, {}
    # no rate nor time left: the scoring steps take seconds, the sweeps minutes, so tqdm's estimate from the
    # steps done said "<00:05" through each sweep
    steps = "{l_bar}{bar}| {n_fmt}/{total_fmt} steps [{elapsed} so far]"
    with progress_bar(
        total=2 * len(MEASURE_STEPS), desc="diff", unit="step", progress=progress, bar_format=steps
    ) as bar:
        for name, m in (("A", a), ("B", b)):
            started = [False]

            def step(what: str, name=name, started=started) -> None:
                if started[0]:
                    bar.update()
                started[0] = True
                bar.set_description(f"diff: model {name}, {what}")

            per[name], means[name] = measure(m, natural, repeated, tuple(cfg.types), cfg.kind, step, progress)
            bar.update()
    return per, means
