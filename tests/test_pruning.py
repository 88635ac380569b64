"""Iterative pruning on tiny models, against independent computations of each step."""

from __future__ import annotations

import pytest
import torch

from headprobe.analyses.ablation import head_importance, scored_loss
from headprobe.analyses.pruning import LossSet, iterative_pruning, masked_loss
from headprobe.probe.core.errors import HeadprobeError


def _tokens(n=3, T=12, seed=0):
    return torch.randint(0, 100, (n, T), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_importance_pruning_curve(tiny_llama_gqa_native):
    model = tiny_llama_gqa_native
    score, held = LossSet(_tokens(seed=1)), LossSet(_tokens(seed=2), first=3)
    run = iterative_pruning(model, score, {"natural": held}, step_fraction=0.25)
    assert [r["n_pruned"] for r in run.rows] == [0, 4, 8, 12, 16]
    assert run.rows[-1]["fraction_pruned"] == 1.0
    assert sorted(run.removal_order) == [(l, h) for l in range(2) for h in range(8)]
    # step 0 is the clean model; the last step equals the native model with every head masked
    net = model.model
    tokens = held.tokens
    assert abs(run.rows[0]["natural_loss"] - float(scored_loss(net(tokens), tokens, 3).mean())) < 1e-5
    all_off = net(tokens, head_mask=torch.zeros(2, 8))
    assert abs(run.rows[-1]["natural_loss"] - float(scored_loss(all_off, tokens, 3).mean())) < 1e-5
    # the first step removes the four heads of lowest (layer-normalised) importance
    imp = head_importance(model, score.tokens, normalize=True).importance
    first = {(i // 8, i % 8) for i in imp.flatten().argsort()[:4].tolist()}
    assert set(run.removal_order[:4]) == first
    # after step 2, the loss equals a fresh masked evaluation of the same mask
    keep = run.keep_mask_after(8, 2, 8)
    assert (
        abs(run.rows[2]["natural_loss"] - float(scored_loss(net(tokens, head_mask=keep.float()), tokens, 3).mean()))
        < 1e-5
    )


def test_random_order_and_no_rescore(tiny_gpt2, tiny_gpt2_native):
    score, held = LossSet(_tokens(seed=1)), LossSet(_tokens(seed=2))
    rnd = iterative_pruning(tiny_gpt2_native, score, {"natural": held}, order="random", step_fraction=0.5, seed=3)
    assert len(rnd.rows) == 3 and len(set(rnd.removal_order)) == 8
    again = iterative_pruning(tiny_gpt2_native, score, {"natural": held}, order="random", step_fraction=0.5, seed=3)
    assert again.removal_order == rnd.removal_order
    once = iterative_pruning(
        tiny_gpt2_native, score, {"natural": held}, rescore=False, normalize=False, step_fraction=0.25, max_fraction=0.5
    )
    imp = head_importance(tiny_gpt2_native, score.tokens).importance
    assert once.removal_order == [(i // 4, i % 4) for i in imp.flatten().argsort()[:4].tolist()]
    # the bridge backend gives the same curve
    bridge = iterative_pruning(
        tiny_gpt2, score, {"natural": held}, rescore=False, normalize=False, step_fraction=0.25, max_fraction=0.5
    )
    assert bridge.removal_order == once.removal_order
    for a, b in zip(bridge.rows, once.rows):
        assert abs(a["natural_loss"] - b["natural_loss"]) < 1e-4


def test_masked_loss_all_ones_is_clean(tiny_gpt2_native):
    data = LossSet(_tokens())
    with torch.no_grad():
        clean = float(scored_loss(tiny_gpt2_native.forward(data.tokens), data.tokens, 0).mean())
    assert abs(masked_loss(tiny_gpt2_native, data, torch.ones(2, 4)) - clean) < 1e-6


def test_bad_arguments(tiny_gpt2_native):
    data = LossSet(_tokens())
    with pytest.raises(HeadprobeError):
        iterative_pruning(tiny_gpt2_native, data, {"x": data}, order="magnitude")
    with pytest.raises(HeadprobeError):
        iterative_pruning(tiny_gpt2_native, data, {"x": data}, step_fraction=0)


def test_each_steps_margin_is_the_gap_its_cut_left(tiny_llama_gqa_native):
    """``margin`` of every Michel step: the least important head kept minus the most important
    head removed, recomputed from a fresh importance at the step's mask; a tie gives 0."""
    from headprobe.analyses.pruning import least_important_cut

    def cut_margin(scores, keep, n):
        return least_important_cut(scores, keep, n)[1]

    model = tiny_llama_gqa_native
    score = LossSet(_tokens(seed=1))
    run = iterative_pruning(model, score, {"natural": LossSet(_tokens(seed=2))}, step_fraction=0.25)
    assert run.rows[0]["margin"] != run.rows[0]["margin"]  # NaN: nothing cut at step 0
    for step, row in enumerate(run.rows[1:], start=1):
        keep = run.keep_mask_after(4 * (step - 1), 2, 8)
        imp = head_importance(model, score.tokens, head_mask=keep.float(), normalize=True).importance
        removed = [imp[h] for h in run.removal_order[4 * (step - 1) : 4 * step]]
        kept = [
            imp[layer, head]
            for layer in range(2)
            for head in range(8)
            if run.keep_mask_after(4 * step, 2, 8)[layer, head]
        ]
        if kept:
            assert row["margin"] == pytest.approx(float(min(kept) - max(removed)), abs=1e-6) and row["margin"] >= 0
        else:
            assert row["margin"] != row["margin"]
    tied = torch.tensor([[0.3, 0.1, 0.1], [0.5, 0.2, 0.0]])
    keep = torch.tensor([[1, 1, 1], [1, 1, 0]])
    assert cut_margin(tied, keep, 1) == 0.0 and cut_margin(tied, keep, 3) == pytest.approx(0.1)
    assert cut_margin(tied, keep, 5) != cut_margin(tied, keep, 5)  # nothing kept after the cut


def test_tied_importances_are_cut_in_head_order():
    """Heads of equal importance go in head order (layer-major), whatever the sort would do on
    ties: the reference is Python's sort of (score, index) over the kept heads."""
    from headprobe.analyses.pruning import least_important_cut

    scores = torch.zeros(10, 27)
    scores.view(-1)[::7] = 1.0
    scores.view(-1)[5::11] = -0.5
    keep = torch.ones(10, 27)
    keep.view(-1)[3::13] = 0
    kept = [i for i in range(270) if keep.view(-1)[i]]
    ref = sorted(kept, key=lambda i: (float(scores.view(-1)[i]), i))
    for n in (1, 30, 200, len(kept)):
        assert least_important_cut(scores, keep, n)[0] == ref[:n]
