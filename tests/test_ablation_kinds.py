"""Ablation kinds have one home (:mod:`headprobe.probe.core.ablation_kinds`): a kind registered there
alone reaches the hooks, the exact sweep, the set ablations, attribution patching, AtP*, the
second-order estimate and ``headprobe ablate --kind``; every entry point refuses a bad kind or a
missing input with the same error and message."""

from __future__ import annotations

import json

import pytest
import torch

from headprobe.analyses.ablation import (
    capture_z,
    exact_sweep,
    head_importance,
    mean_z_from,
    scored_loss,
    set_ablation_losses,
    sweep_loop,
)
from headprobe.analyses.attribution import atp_star, second_order
from headprobe.probe.core import ablation_kinds
from headprobe.probe.core.ablation_kinds import Kind
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.ablation import head_ablation_hooks
from headprobe.probe.hooks.names import attn_hook

HALF = 0.5


@pytest.fixture
def scaled():
    """A test-local kind, registered for one test only: ``r_h = 0.5 z_h``."""
    kind = ablation_kinds.register(Kind("scaled", lambda z, layer, heads, inputs: z * HALF, help="by half of itself"))
    yield kind
    ablation_kinds.KINDS.unregister(kind.name)


def _tokens(n=3, T=12, seed=0):
    return torch.randint(0, 100, (n, T), generator=torch.Generator().manual_seed(seed))


def _halving_hooks(heads):
    """The reference: hand-written hooks that halve the heads' z (no registry involved)."""

    def make(layer, hs):
        def hook(z, hook):
            z = z.clone()
            z[:, :, hs] = z[:, :, hs] * HALF
            return z

        return hook

    by_layer = {}
    for layer, head in heads:
        by_layer.setdefault(layer, []).append(head)
    return [(attn_hook(layer, "z"), make(layer, hs)) for layer, hs in by_layer.items()]


@pytest.mark.parametrize("name", ["tiny_llama_gqa_native", "tiny_gpt2"])
def test_a_kind_registered_in_one_place_reaches_hooks_sweep_and_set_ablations(request, scaled, name):
    model = request.getfixturevalue(name)
    tokens, first = _tokens(), 4
    heads = [(0, 1), (1, 2), (1, 3)]
    with torch.inference_mode():
        got = model.forward(tokens, fwd_hooks=head_ablation_hooks(heads, "scaled"))
        want = model.forward(tokens, fwd_hooks=_halving_hooks(heads))
        clean = model.forward(tokens)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got - clean).abs().max() > 1e-3  # the kind acts

    fast = exact_sweep(model, tokens, kind="scaled", first=first, max_batch=3)
    ref = sweep_loop(model, tokens, kind="scaled", first=first)
    torch.testing.assert_close(fast.loss, ref.loss, atol=1e-4, rtol=0)
    assert fast.effect.abs().max() > 50 * (fast.loss - ref.loss).abs().max()

    sets = [[(0, 1)], [(1, 0), (1, 3)], []]
    batched = set_ablation_losses(model, tokens, sets, "scaled", None, first, max_batch=6)
    with torch.inference_mode():
        loop = torch.stack(
            [scored_loss(model.forward(tokens, fwd_hooks=_halving_hooks(s)), tokens, first) for s in sets]
        )
    torch.testing.assert_close(batched, loop.float().cpu(), atol=1e-5, rtol=1e-5)


def test_a_registered_kind_reaches_the_gradient_estimates(tiny_llama_gqa_native, scaled):
    """Known answers by linearity: halving z moves it by ``r - z = -z / 2``, half of zero
    ablation's ``-z``, so every first-order estimate is half of zero ablation's, AtP* (a sum of
    absolute first-order terms) too, and the Gauss-Newton term ``1/2 d^T G d`` a quarter (same
    sampled targets)."""
    model, tokens, first = tiny_llama_gqa_native, _tokens(), 4
    half, zero = (head_importance(model, tokens, first, kind=k) for k in ("scaled", "zero"))
    torch.testing.assert_close(half.attribution, HALF * zero.attribution, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(half.importance, zero.importance)  # the mask gradient does not depend on the kind
    half, zero = (atp_star(model, tokens, first, kind=k) for k in ("scaled", "zero"))
    torch.testing.assert_close(half.attribution, HALF * zero.attribution, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(half.estimate, HALF * zero.estimate, atol=1e-6, rtol=1e-4)
    half, zero = (second_order(model, tokens, first, kind=k, n_probes=2) for k in ("scaled", "zero"))
    torch.testing.assert_close(half.attribution, HALF * zero.attribution, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(half.curvature, HALF**2 * zero.curvature, atol=1e-7, rtol=1e-4)
    assert zero.attribution.abs().max() > 1e-3


def test_a_registered_kind_is_an_ablate_choice(tiny_dir, tmp_path, capsys, scaled):
    from headprobe.cli import main

    assert main(["ablate", "--help"]) == 0
    assert "{zero,mean,resample,scaled}" in capsys.readouterr().out
    g = torch.Generator().manual_seed(0)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"t{i}" for i in torch.randint(0, 100, (600,), generator=g).tolist()))
    out = tmp_path / "out"
    assert (
        main(
            [
                "ablate",
                "--model",
                str(tiny_dir),
                "--out",
                str(out),
                "--text",
                str(text),
                "--kind",
                "scaled",
                "--heads",
                "0.1,1.2",
                "--seq-len",
                "16",
                "--n-natural",
                "2",
                "--n-repeated",
                "2",
                "--period",
                "6",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert json.loads((out / "summary.json").read_text())["config"]["kind"] == "scaled"


def test_resample_set_ablations_equal_one_forward_per_set(tiny_llama_gqa_native):
    model, tokens, source = tiny_llama_gqa_native, _tokens(), _tokens(seed=7)
    sets = [[(0, 1)], [(1, 0), (1, 3)], [(0, 2), (1, 2)]]
    got = set_ablation_losses(model, tokens, sets, "resample", None, 4, max_batch=6, source_tokens=source)
    source_z = capture_z(model, source)
    with torch.inference_mode():
        want = torch.stack(
            [
                scored_loss(
                    model.forward(tokens, fwd_hooks=head_ablation_hooks(s, "resample", source_z=source_z)), tokens, 4
                )
                for s in sets
            ]
        )
    torch.testing.assert_close(got, want.float().cpu(), atol=1e-5, rtol=1e-5)


def _entry_points(model, tokens):
    """Every function that takes an ablation kind, as ``kind, mean_z, source -> call``."""
    return {
        "hooks": lambda k, m, s: head_ablation_hooks([(0, 1)], k, m, None if s is None else capture_z(model, s)),
        "set_ablation_losses": lambda k, m, s: set_ablation_losses(model, tokens, [[(0, 1)]], k, m, 1, source_tokens=s),
        "exact_sweep": lambda k, m, s: exact_sweep(model, tokens, [(0, 1)], k, m, s),
        "sweep_loop": lambda k, m, s: sweep_loop(model, tokens, [(0, 1)], k, m, s),
        "head_importance": lambda k, m, s: head_importance(model, tokens, 1, k, m, s),
        "atp_star": lambda k, m, s: atp_star(model, tokens, 1, k, m, s),
        "second_order": lambda k, m, s: second_order(model, tokens, 1, k, m, s, n_probes=1),
    }


def test_bad_kinds_and_missing_inputs_are_one_error_with_one_message(tiny_gpt2_native):
    model, tokens = tiny_gpt2_native, _tokens()
    mean_z = mean_z_from(capture_z(model, _tokens(seed=5)), 1)
    for name, call in _entry_points(model, tokens).items():
        with pytest.raises(
            HeadprobeError,
            match=r"^unknown ablation kind: 'zeros' \(did you mean 'zero'\?\); known: zero, mean, resample$",
        ):
            call("zeros", None, None)
        with pytest.raises(
            HeadprobeError, match=r"^mean ablation needs mean_z \(each head's mean z over reference tokens\)$"
        ):
            call("mean", None, None)
        source = "source_z" if name == "hooks" else "source_tokens"
        with pytest.raises(
            HeadprobeError, match=rf"^resample ablation needs {source} \(the input whose z replaces the head's\)$"
        ):
            call("resample", None, None)
        call("mean", mean_z, None), call("resample", None, _tokens(seed=7))  # with their inputs they run
    with pytest.raises(HeadprobeError, match="needs source_z\\[1\\]"):
        head_ablation_hooks([(1, 0)], "resample", source_z={0: capture_z(model, tokens)[0]})
    from headprobe.commands.ablate import AblateConfig

    with pytest.raises(HeadprobeError, match=r"^unknown ablation kind: 'bogus'; known: zero, mean, resample$"):
        AblateConfig(kind="bogus")


@pytest.mark.parametrize("kind", ["zero", "mean", "resample"])
def test_gradient_scores_in_chunks_equal_one_pass(tiny_llama_gqa_native, kind):
    """``head_importance(max_batch=2)`` over 5 sequences (chunks 2, 2, 1; the resample source cut
    with them) gives the one-pass importance, attribution and loss: sequences do not interact."""
    model = tiny_llama_gqa_native
    tokens = _tokens(n=5, seed=3)
    mean_z = mean_z_from(capture_z(model, _tokens(seed=5)), 1) if kind == "mean" else None
    source = _tokens(n=5, seed=7) if kind == "resample" else None
    one, chunked = (head_importance(model, tokens, 1, kind, mean_z, source, max_batch=b) for b in (None, 2))
    torch.testing.assert_close(chunked.importance, one.importance, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(chunked.attribution, one.attribution, rtol=1e-5, atol=1e-7)
    assert chunked.clean_loss == pytest.approx(one.clean_loss, rel=1e-6)
    shuffled = head_importance(model, tokens, 1, kind, mean_z, None if source is None else source.flip(0), max_batch=2)
    if kind == "resample":  # the source rows travel with their own sequences: a shuffled source differs
        assert not torch.allclose(shuffled.attribution, one.attribution, atol=1e-6)
