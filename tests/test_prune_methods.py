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
                losses.append(float(scored_loss(model.model(held.tokens, head_mask=keep), held.tokens, 1).mean()))
            assert row["best_head"] == int(np.argmin(losses))
            assert row["loss_best_only"] == pytest.approx(min(losses), abs=1e-5)
            assert row["loss_worst_only"] == pytest.approx(max(losses), abs=1e-5)
    assert rows[1]["best_head"] == ESSENTIAL[1]  # layer 1 reduced to one head: the essential one
