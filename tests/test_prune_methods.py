"""Pruning methods compared (``headprobe prune --method``): Voita et al.'s L0 head gates on a tiny
model with a planted useless head and a planted essential head, the curve area, the per-layer
table and the pruned model directory, each against an independent computation."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from headprobe.analyses.ablation import scored_loss
from headprobe.analyses.pruning import (
    LossSet,
    curve_auc,
    expected_open,
    hard_concrete_sample,
    l0_pruning,
    per_layer_best_head,
)
from headprobe.probe.core.errors import HeadprobeError

USELESS, ESSENTIAL = (0, 1), (1, 2)


@pytest.fixture(scope="module")
def planted(tiny_gpt2_native):
    """The tiny GPT-2 (2 layers x 4 heads) with head 0.1's W_O zeroed (it contributes nothing) and
    head 1.2's W_O scaled by 30 (it dominates the logits), and text sampled from this model, so
    that the full model predicts it well and only 1.2 carries that prediction."""
    model = copy.deepcopy(tiny_gpt2_native)
    d = model.spec.d_head
    with torch.no_grad():
        for (layer, head), scale in ((USELESS, 0.0), (ESSENTIAL, 30.0)):
            model.model.blocks[layer].attn.o_proj.weight[:, head * d : (head + 1) * d] *= scale
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 100, (16, 1), generator=gen)
        for _ in range(15):
            probs = torch.softmax(model.forward(tokens)[:, -1].float(), dim=-1)
            tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return model, LossSet(tokens[:8], 1), LossSet(tokens[8:], 1)


def check_planted(run, n_heads_total: int) -> None:
    """The planted heads' fate: 0.1 goes with the first heads closed, 1.2 stays while any head stays."""
    closing = [i for i, row in enumerate(run.rows) if row["removed"]]
    assert closing, "no head was ever closed"
    first = run.rows[closing[0]]["removed"].split()
    assert "0.1" in first, f"the useless head 0.1 was not among the first closed ({first})"
    for row in run.rows:
        if row["n_pruned"] < n_heads_total:
            assert "1.2" not in " ".join(r["removed"] for r in run.rows[: row["step"] + 1]), (
                f"the essential head 1.2 was closed at lambda {row['lambda']} while other heads stayed"
            )


def test_l0_gates_close_the_useless_head_first_and_keep_the_essential_one(planted):
    model, train, held = planted
    before = {k: v.clone() for k, v in model.model.state_dict().items()}
    run = l0_pruning(model, train, {"natural": held}, lambdas=(0.3, 1.0, 3.0), steps=40, batch_size=8, seed=0)
    check_planted(run, 8)
    assert run.rows[-1]["n_pruned"] >= 3  # the sweep does close heads
    for k, v in model.model.state_dict().items():  # the model is frozen
        assert torch.equal(v, before[k])
    # each row's loss is the binary mask of the heads removed so far (an independent forward)
    keep = torch.ones(2, 4)
    for layer, head in run.removal_order:
        keep[layer, head] = 0
    with torch.no_grad():
        ref = float(scored_loss(model.model(held.tokens, head_mask=keep), held.tokens, 1).mean())
    assert abs(run.rows[-1]["natural_loss"] - ref) < 1e-5
    # closing the essential head would fail the check: it can fail
    broken = copy.deepcopy(run)
    broken.rows[1]["removed"] += " 1.2"
    with pytest.raises(AssertionError):
        check_planted(broken, 8)


def test_l0_is_seeded_and_resumable(planted):
    model, train, held = planted
    kw = dict(lambdas=(0.3, 1.0, 3.0), steps=5, batch_size=4, seed=3)
    full = l0_pruning(model, train, {"natural": held}, **kw)
    states = []
    l0_pruning(model, train, {"natural": held}, **{**kw, "lambdas": (0.3, 1.0)}, on_step=states.append)
    resumed = l0_pruning(model, train, {"natural": held}, **kw, resume=states[-1])
    assert [r["natural_loss"] for r in resumed.rows] == pytest.approx([r["natural_loss"] for r in full.rows], abs=1e-6)
    assert [r["expected_open"] for r in resumed.rows] == pytest.approx(
        [r["expected_open"] for r in full.rows], abs=1e-4
    )
    with pytest.raises(HeadprobeError):
        l0_pruning(model, train, {"natural": held}, lambdas=(3.0, 1.0))


def test_hard_concrete_against_its_definition():
    """Louizos et al. 2018: P(gate > 0) from the closed form equals the Monte Carlo frequency."""
    log_alpha = torch.tensor([-2.0, 0.0, 1.5])
    u = torch.rand(200_000, 3, generator=torch.Generator().manual_seed(0)).clamp(1e-6, 1 - 1e-6)
    g = hard_concrete_sample(log_alpha.expand(200_000, 3), u)
    assert g.min() >= 0 and g.max() <= 1 and (g == 0).any() and (g == 1).any()
    torch.testing.assert_close((g > 0).float().mean(0), expected_open(log_alpha), atol=5e-3, rtol=0)


def test_curve_auc_against_a_hand_computed_area():
    # loss 1 -> 3 linearly over [0, 1]: mean 2; over [0, 0.5]: 1 -> 2, mean 1.5
    assert curve_auc([0, 0.5, 1.0], [1, 2, 3], 1.0) == pytest.approx(2.0)
    assert curve_auc([1.0, 0, 0.25], [3, 1, 1.5], 0.5) == pytest.approx(1.5)  # unsorted, interpolated at 0.5
    assert curve_auc([0, 0.2, 0.2, 1.0], [1, 1, 2, 2], 1.0) == pytest.approx(
        1.8
    )  # a jump (two L0 points at one fraction)
    with pytest.raises(HeadprobeError):
        curve_auc([0, 0.3], [1, 2], 0.5)


def held_out_pick(losses: np.ndarray, pick=np.argmin) -> float:
    """Reference for cross_fit_pick: ``losses`` ``[head, window]``; the head picked on the first
    ceil(n/2) windows scored on the rest and vice versa, the window losses averaged."""
    cut = (losses.shape[1] + 1) // 2
    a, b = losses[:, :cut], losses[:, cut:]
    return float(np.concatenate([b[pick(a.mean(1))], a[pick(b.mean(1))]]).mean())


def test_per_layer_best_head_against_a_loop(planted):
    model, _, held = planted
    rows = per_layer_best_head(model, held)
    with torch.no_grad():
        for row in rows:
            layer = row["layer"]
            losses = []
            for h in range(4):
                keep = torch.ones(2, 4)
                keep[layer] = 0
                keep[layer, h] = 1
                losses.append(scored_loss(model.model(held.tokens, head_mask=keep), held.tokens, 1).numpy())
            losses = np.stack(losses)  # [head, window]
            assert row["best_head"] == int(np.argmin(losses.mean(1)))
            assert row["loss_best_only"] == pytest.approx(held_out_pick(losses), abs=1e-5)
            assert row["loss_worst_only"] == pytest.approx(held_out_pick(losses, np.argmax), abs=1e-5)
    assert rows[1]["best_head"] == ESSENTIAL[1]  # layer 1 reduced to one head: the essential one


def fake_set_losses(monkeypatch, table):
    """set_ablation_losses replaced: the set keeping head h of a layer alone gets ``table(layer, h)``
    (``[window]``), every other set (layer ablated, clean) zeros."""
    from headprobe.analyses import ablation

    def fake(model, tokens, sets, *args, **kwargs):
        out = torch.zeros(len(sets), tokens.shape[0])
        for i, s in enumerate(sets):
            layers = {layer for layer, _ in s}
            if len(s) == 3:  # 4 heads, one kept
                (layer,) = layers
                out[i] = table(layer, ({0, 1, 2, 3} - {h for _, h in s}).pop())
        return out

    monkeypatch.setattr(ablation, "set_ablation_losses", fake)


def test_per_layer_scores_each_pick_on_the_windows_it_was_not_picked_on(planted, monkeypatch):
    """Head 0 is best on the first two windows only and head 1 on the last two only: each pick's
    loss must come from the other half (same-window picking would report 0.0)."""
    losses = torch.tensor([[0.0, 0.0, 5.0, 5.0], [4.0, 4.0, 0.0, 0.0], [3.0] * 4, [3.0] * 4])
    fake_set_losses(monkeypatch, lambda layer, h: losses[h])
    rows = per_layer_best_head(planted[0], LossSet(torch.zeros(4, 3, dtype=torch.long), 1))
    for row in rows:
        assert row["loss_best_only"] == pytest.approx((5 + 5 + 4 + 4) / 4)  # head 0 on windows 3, 4; head 1 on 1, 2
        assert row["loss_worst_only"] == 0.0  # head 1 picked on windows 1, 2 scored on 3, 4; head 0 vice versa
        assert row["best_head"] == 1 and row["best_head_halves_agree"] is False
        assert row["delta_best_only"] == pytest.approx(4.5)


def test_per_layer_best_head_of_pure_noise_is_not_better_than_the_mean(planted, monkeypatch):
    """Heads whose window losses are independent noise of mean 0: the held-out loss of the pick
    averages 0 over 200 draws (the same-window minimum of 4 means of 8 windows would average
    about -1.03 / sqrt(8) = -0.36, the expected minimum of 4 standard normals over sqrt(8))."""
    gen = torch.Generator().manual_seed(0)
    best = []
    for _ in range(100):
        draws = torch.randn(2, 4, 8, generator=gen)
        fake_set_losses(monkeypatch, lambda layer, h, d=draws: d[layer, h])
        best += [r["loss_best_only"] for r in per_layer_best_head(planted[0], LossSet(torch.zeros(8, 3).long(), 1))]
    assert abs(np.mean(best)) < 0.08, np.mean(best)  # standard error 1 / sqrt(8 * 200) = 0.025


def test_per_layer_needs_two_windows(planted):
    from headprobe.commands.prune import PruneConfig

    with pytest.raises(HeadprobeError, match="at least 2 held-out windows"):
        per_layer_best_head(planted[0], LossSet(torch.zeros(1, 3, dtype=torch.long), 1))
    with pytest.raises(HeadprobeError, match="--per-layer needs --n-natural 2 or more, got 1"):  # before any load
        PruneConfig(per_layer=True, n_natural=1)


def hand_made_auc(michel: list[float], random: list[list[float]]) -> dict:
    """PruneResult.auc's dict of hand-made curves over 0, 0.25, 0.5 removed (the same on both tasks)."""
    area = lambda y: curve_auc([0.0, 0.25, 0.5], y, 0.5)
    rnd = [area(y) for y in random]
    one = rnd[0] if len(rnd) == 1 else {"mean": np.mean(rnd), "std": np.std(rnd, ddof=1), "per_seed": rnd}
    return {"range": [0.0, 0.5], "michel": dict.fromkeys(("natural", "repeated"), area(michel))} | {
        "random": dict.fromkeys(("natural", "repeated"), one)
    }


def test_michel_below_every_random_order_is_a_rank_p_value_not_significance():
    """Below all k = 3 random orders is rank p = 1 / 4, not a significant difference; a tie counts
    against the method: p = (1 + #random <= michel) / (k + 1), by hand from the curves' areas."""
    from headprobe.commands.prune_core import rank_lines, rank_vs_random

    michel = [3.0, 3.5, 4.0]  # area 3.5; the random orders' 4.5, 5.5, 6.5
    randoms = [[3.0, 4.5, 6.0], [3.0, 5.5, 8.0], [3.0, 6.5, 10.0]]
    ranks = rank_vs_random(hand_made_auc(michel, randoms), ("michel", "random"))
    assert ranks["michel"]["natural"] == {"n_random": 3, "n_random_at_or_below": 0, "p": 0.25}
    (line,) = rank_lines(ranks)
    assert "natural below 3 of 3 (rank p = 0.25)" in line and "1/(k+1) = 0.25" in line, line
    tie = rank_vs_random(hand_made_auc([3.0, 4.5, 6.0], randoms), ("michel", "random"))
    assert tie["michel"]["repeated"]["p"] == 0.5  # one random order at or below (equal)
    many = [[3.0, 4.0 + i, 5.0 + i] for i in range(19)]  # 19 orders: below all of them is p = 0.05
    assert rank_vs_random(hand_made_auc(michel, many), ("random", "michel"))["michel"]["natural"]["p"] == 0.05
    assert rank_vs_random(hand_made_auc(michel, randoms[:1]), ("michel", "random"))["michel"]["natural"]["p"] == 0.5
    assert rank_vs_random(hand_made_auc(michel, randoms), ("michel",)) is None
