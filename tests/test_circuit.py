"""Path patching and edge attribution (analyses/circuit.py).

References: (1) a hand-built two-head attention-only model whose paths are known by construction
(the sender writes only dimensions the receiver's key reads, and nothing its query, value or the
unembedding reads) and a plain numpy forward of it with the sender's corrupted output sent along
one path; (2) finite differences: EAP is the derivative of path patching along delta_s, so path
patching with delta_s scaled by eps, divided by eps, must approach it; (3) EAP-IG against exact
path patching on every edge of tiny zoo models (Spearman)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import zoo
from scipy.stats import spearmanr

from headprobe.analyses import circuit as circuit_module
from headprobe.analyses.circuit import (
    EdgeScores,
    agreement,
    edge_scores,
    parse_edge,
    path_patch_effects,
    prepare_runs,
    verify_edges,
)
from headprobe.probe.backends.loading import LoadedModel
from headprobe.probe.backends.wrapping import wrap
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.convert import spec_from_native
from headprobe.probe.model.transformer import Transformer

V, D, T = 12, 8, 6


def _two_head_model(tokenizer):
    """Layer 0 head 0 (sender) writes only dims 6-7; layer 1 head 0 (receiver) reads dims 6-7 only
    through its key; its query and value and the unembedding read dims 0-5 only."""
    cfg = TransformerConfig(
        n_layers=2,
        d_model=D,
        n_heads=1,
        d_vocab=V,
        n_ctx=16,
        mlp=None,
        bias=False,
        pre_norm=False,
        final_norm=False,
        tied_unembed=False,
    )
    torch.manual_seed(0)
    net = Transformer(cfg).eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        net.embed.W_E.weight.copy_(torch.cat([torch.randn(V, 4, generator=g), torch.zeros(V, 4)], 1))
        net.embed.W_pos.weight.copy_(
            torch.cat([torch.zeros(16, 4), torch.randn(16, 2, generator=g), torch.zeros(16, 2)], 1)
        )
        a0, a1 = net.blocks[0].attn, net.blocks[1].attn
        for p in (a0.q_proj, a0.k_proj, a0.v_proj):
            p.weight.copy_(torch.randn(D, D, generator=g))
        a0.o_proj.weight.copy_(torch.cat([torch.zeros(6, D), torch.randn(2, D, generator=g)]))  # writes dims 6-7
        read = lambda cols: torch.randn(D, D, generator=g) * torch.isin(torch.arange(D), torch.tensor(cols))
        a1.q_proj.weight.copy_(read([0, 1, 2, 3, 4, 5]))
        a1.k_proj.weight.copy_(read([6, 7]) * 2)
        a1.v_proj.weight.copy_(read([0, 1, 2, 3]))
        a1.o_proj.weight.copy_(torch.randn(D, D, generator=g))
        net.unembed.weight.copy_(torch.cat([torch.randn(V, 6, generator=g), torch.zeros(V, 2)], 1))
    return LoadedModel(
        net, tokenizer, spec_from_native("two-head", "two-head", "hand-built", cfg), prepend_bos=False
    ), net


def _np_attn(x, attn):
    W = lambda p: p.weight.detach().double().numpy().T
    q, k, v = x @ W(attn.q_proj), x @ W(attn.k_proj), x @ W(attn.v_proj)
    return q, k, v


def _np_out(q, k, v, attn):
    s = q @ k.T / np.sqrt(q.shape[-1])
    s[np.triu_indices(len(s), 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return p @ v @ attn.o_proj.weight.detach().double().numpy().T


def _np_loss(x_final, net, tokens):
    logits = x_final @ net.unembed.weight.detach().double().numpy().T
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return -np.mean([logp[i, tokens[i + 1]] for i in range(len(tokens) - 1)])


def _np_path(net, clean, corrupted, path):
    """Loss change of the numpy forward with the sender's corrupted output sent along ``path``."""
    E = lambda t: (
        net.embed.W_E.weight.detach().double().numpy()[t] + net.embed.W_pos.weight.detach().double().numpy()[: len(t)]
    )
    a0, a1 = net.blocks[0].attn, net.blocks[1].attn
    x0c, x0x = E(clean), E(corrupted)
    out0c, out0x = _np_out(*_np_attn(x0c, a0), a0), _np_out(*_np_attn(x0x, a0), a0)
    x1 = x0c + out0c
    delta = out0x - out0c
    q, k, v = _np_attn(x1, a1)
    qp, kp, vp = _np_attn(x1 + delta, a1)
    qkv = {"q": (qp, k, v), "k": (q, kp, v), "v": (q, k, vp), "logits": (q, k, v)}[path]
    final = x1 + _np_out(*qkv, a1) + (delta if path == "logits" else 0)
    return _np_loss(final, net, clean) - _np_loss(x1 + _np_out(q, k, v, a1), net, clean)


def test_path_patching_equals_the_hand_built_models_known_paths(tiny_tokenizer):
    model, net = _two_head_model(tiny_tokenizer)
    g = torch.Generator().manual_seed(5)
    clean, corrupted = torch.randint(0, V, (1, T), generator=g), torch.randint(0, V, (1, T), generator=g)
    runs = prepare_runs(model, clean, corrupted)
    got = {inp: float(path_patch_effects(model, runs, [(0, 0)], (1, 0), inp)[0]) for inp in ("q", "k", "v")}
    got["logits"] = float(path_patch_effects(model, runs, [(0, 0)], None)[0])
    for path in got:
        assert got[path] == pytest.approx(_np_path(net, clean[0].numpy(), corrupted[0].numpy(), path), abs=1e-5), path
    # by construction only the key path carries the sender's change; "zero" is to float32 rounding of
    # a loss near 2.5 (a few ulp, 2.4e-7 each: runs batched differently round differently; seen 1.9e-6)
    assert got["q"] == pytest.approx(0, abs=1e-5) and got["v"] == pytest.approx(0, abs=1e-5)
    assert got["logits"] == pytest.approx(0, abs=1e-5) and abs(got["k"]) > 1e-3
    scores = edge_scores(model, runs, "eap-ig", steps=4)
    assert scores.head_scores[0, 1, 0, 0, 0] == pytest.approx(0, abs=1e-6)  # q
    assert scores.head_scores[2, 1, 0, 0, 0] == pytest.approx(0, abs=1e-6)  # v
    assert scores.logit_scores[0, 0] == pytest.approx(0, abs=1e-6)
    assert abs(scores.head_scores[1, 1, 0, 0, 0]) > 1e-4


def _sharpened(tokenizer, family, qk=6, ov=3):
    """A zoo model with sharper attention (W_Q, W_K x ``qk``) and larger head outputs (W_V, W_O x ``ov``), so that
    its path effects (1e-4 to 1e-2 nats) are well above float32 rounding of the loss (random init: ~1e-6)."""
    model = wrap(zoo.make_checkpoint(family, tokenizer), backend="native")
    with torch.no_grad():
        for block in model.model.blocks:
            for name, factor in (("q_proj", qk), ("k_proj", qk), ("v_proj", ov), ("o_proj", ov)):
                getattr(block.attn, name).weight.mul_(factor)
    return model


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen3", "gemma2", "gpt_neox"])
def test_eap_is_the_derivative_of_path_patching(tiny_tokenizer, family):
    """Central differences: path patching with every delta scaled by +-eps, over 2 eps, tends to EAP."""
    model = _sharpened(tiny_tokenizer, family)
    g = torch.Generator().manual_seed(2)
    clean, corrupted = torch.randint(0, 100, (2, 10), generator=g), torch.randint(0, 100, (2, 10), generator=g)
    runs = prepare_runs(model, clean, corrupted, first=2)
    eap = edge_scores(model, runs, "eap")
    eps = 5e-2  # central differences: error O(eps^2); float32 noise ~1e-6 / eps
    plus, minus = (dataclasses.replace(runs, deltas=runs.deltas * e) for e in (eps, -eps))
    H = model.spec.n_heads

    def fd(senders, receiver, inp="k"):
        return (
            path_patch_effects(model, plus, senders, receiver, inp)
            - path_patch_effects(model, minus, senders, receiver, inp)
        ) / (2 * eps)

    senders = [(0, h) for h in range(H)]
    got = np.array([[fd(senders, (1, hr), inp) for hr in range(H)] for inp in ("q", "k", "v")])
    want = eap.head_scores[:, 1, :, 0]
    assert np.abs(want).max() > 1e-4  # not vacuous
    np.testing.assert_allclose(got, want, rtol=5e-2, atol=2e-2 * np.abs(want).max(), err_msg=family)
    got = fd(senders + [(1, h) for h in range(H)], None)
    np.testing.assert_allclose(got, eap.logit_scores.ravel(), rtol=5e-2, atol=5e-2 * np.abs(eap.logit_scores).max())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_eap_ig_ranks_edges_as_exact_path_patching(tiny_tokenizer, family):
    """Every edge of a 2-layer model: EAP-IG against exact path patching. Effects of 1e-6 to 1e-2 nats;
    the ranks of the smallest are float32 noise, so the model is sharpened (x3, x2) as in the report."""
    model = _sharpened(tiny_tokenizer, family, qk=3, ov=2)
    g = torch.Generator().manual_seed(4)
    clean, corrupted = torch.randint(0, 100, (3, 10), generator=g), torch.randint(0, 100, (3, 10), generator=g)
    runs = prepare_runs(model, clean, corrupted, first=2)
    ig = edge_scores(model, runs, "eap-ig", steps=8)
    H = model.spec.n_heads
    exact, approx = [], []
    for i, inp in enumerate(("q", "k", "v")):
        for hr in range(H):
            exact += list(path_patch_effects(model, runs, [(0, h) for h in range(H)], (1, hr), inp))
            approx += list(ig.head_scores[i, 1, hr, 0])
    exact += list(path_patch_effects(model, runs, [(l, h) for l in range(2) for h in range(H)], None))
    approx += list(ig.logit_scores.ravel())
    got = agreement(np.array(exact), np.array(approx), k=10)
    assert got["spearman"] == pytest.approx(spearmanr(exact, approx).statistic)
    assert got["spearman"] > 0.9 and got["pearson"] > 0.95 and got["top_k_recall"] >= 0.6, got  # chance: 10/56
    shuffled = agreement(np.array(exact), np.random.default_rng(0).permutation(approx), k=5)
    assert shuffled["spearman"] < 0.5  # the check can fail


def test_agreement_by_hand():
    got = agreement(np.array([3.0, -2.0, 1.0, 0.5]), np.array([2.5, -3.0, 0.1, 0.2]), k=2)
    assert got["top_k_recall"] == 1.0 and got["spearman"] == pytest.approx(0.8)
    got = agreement(np.array([3.0, -2.0, 1.0, 0.5]), np.array([0.1, 0.2, 2.5, -3.0]), k=2)
    assert got["top_k_recall"] == 0.0  # the two largest exact effects are the two smallest scores
    # with k edges or fewer verified, every edge is in both top-k sets: no recall, and why
    whole = agreement(np.array([3.0, -2.0, 1.0, 0.5]), np.array([0.1, 0.2, 2.5, -3.0]), k=4)
    assert whole["top_k_recall"] is None and "recall 1 by construction" in whole["null_reasons"]["top_k_recall"]
    with pytest.raises(HeadprobeError, match="at least 3"):
        agreement(np.ones(2), np.ones(2))


def test_gqa_key_patching_touches_one_query_head(tiny_tokenizer):
    """Patching query head 0's key leaves head 1 (same key/value head) as in the clean run."""
    model = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")
    g = torch.Generator().manual_seed(2)
    clean, corrupted = torch.randint(0, 100, (1, 8), generator=g), torch.randint(0, 100, (1, 8), generator=g)
    runs = prepare_runs(model, clean, corrupted)
    from headprobe.analyses.circuit import _receiver_hooks

    seen = {}
    hooks = [
        *_receiver_hooks(model, runs, (1, 0), "k", runs.deltas[0, :, :, 0], 1),
        ("blocks.1.attn.hook_pattern", lambda x, hook: seen.setdefault("p", x.detach().clone())),
    ]
    model.forward(clean, fwd_hooks=hooks)
    clean_p = {}
    model.forward(
        clean, fwd_hooks=[("blocks.1.attn.hook_pattern", lambda x, hook: clean_p.setdefault("p", x.detach().clone()))]
    )
    torch.testing.assert_close(seen["p"][:, 1:], clean_p["p"][:, 1:])
    assert (seen["p"][:, 0] - clean_p["p"][:, 0]).abs().max() > 1e-4


def test_bad_edges_and_inputs_are_one_line(tiny_tokenizer, tiny_gpt2):
    model = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")
    clean = torch.randint(0, 100, (1, 6))
    runs = prepare_runs(model, clean, clean.flip(1))
    with pytest.raises(HeadprobeError, match="before its receiver"):
        path_patch_effects(model, runs, [(1, 0)], (1, 2), "k")
    with pytest.raises(HeadprobeError, match="same shape"):
        prepare_runs(model, clean, clean[:, :4])
    with pytest.raises(HeadprobeError, match="native backend"):
        prepare_runs(tiny_gpt2, clean, clean)
    with pytest.raises(HeadprobeError, match="is not"):
        parse_edge("5.1 -> 7.2:z")
    assert parse_edge("5.1 -> 7.2:k").name == "5.1 -> 7.2:k" and parse_edge("0.3->logits").receiver is None
    for text in ("5.1.2 -> logits", "5 -> logits", "5.1 -> 7.2.1:k"):  # a sender into the logits was not checked
        with pytest.raises(HeadprobeError, match="is not"):
            parse_edge(text)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_neox"])
def test_forward_from_a_layer_equals_the_whole_forward(tiny_tokenizer, family):
    model = wrap(zoo.make_checkpoint(family, tiny_tokenizer), backend="native")
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    seen = {}
    want = model.forward(
        tokens, fwd_hooks=[("blocks.1.hook_resid_pre", lambda x, hook: seen.setdefault("r", x.detach().clone()))]
    )
    torch.testing.assert_close(model.forward_from(1, seen["r"]), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(HeadprobeError, match="native backend"):
        LoadedModel._forward_from(model, 1, seen["r"])  # the base version of the hook: refuses


@pytest.mark.parametrize("side", ["right", "left"])
def test_forward_from_a_layer_of_a_padded_batch_reads_its_mask_as_the_forward(tiny_tokenizer, side):
    """``forward_from`` with ``attention_mask`` gives the padding and positions the whole forward
    gives (its logits at every position, 1e-5), and refuses a mask holding a 2 as the forward does:
    ``_resid_from`` derived them itself and read a 2 as a real token. Reference: ``model.forward``."""
    from headprobe.probe.core.errors import InputValueError
    from headprobe.probe.hooks.capture import pad_prompts

    model = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")
    g = torch.Generator().manual_seed(1)
    tokens, mask = pad_prompts([torch.randint(0, 100, (n,), generator=g) for n in (10, 6)], 0, side)
    seen = {}
    hook = ("blocks.1.hook_resid_pre", lambda x, hook: seen.setdefault("r", x.detach().clone()))
    want = model.forward(tokens, fwd_hooks=[hook], attention_mask=mask)
    torch.testing.assert_close(model.forward_from(1, seen["r"], attention_mask=mask), want, rtol=1e-5, atol=1e-5)
    assert (model.forward_from(1, seen["r"]) - want).abs().max() > 1e-3  # the mask is not vacuous
    bad = mask.clone()
    bad[0, -1 if side == "right" else 0] = 2
    with pytest.raises(InputValueError, match="attention_mask must hold 1 .* or 0 .* only, got 2") as refused:
        model.forward(tokens, attention_mask=bad)
    with pytest.raises(InputValueError, match="attention_mask must hold 1") as resumed:
        model.forward_from(1, seen["r"], attention_mask=bad)
    assert str(resumed.value) == str(refused.value)


@pytest.mark.real_model
def test_smollm2_induction_keys_read_the_previous_token_heads(smollm2_native):
    """On SmolLM2's repeated random task, path patching into induction head 18.6's key puts the
    previous-token heads 16.0 and 17.8 (scan: previous-token 0.77 and 0.34) far above other
    senders, EAP-IG ranks them first too, and the QK attribution's key side agrees."""
    from headprobe.analyses.data import repeated_random_tokens
    from headprobe.analyses.qk_attribution import qk_attribution

    model = smollm2_native
    clean, corr = (repeated_random_tokens(model, 2, 12, s) for s in (0, 1))
    runs = prepare_runs(model, clean.tokens, corr.tokens, first=clean.start + 12)
    senders = [(16, 0), (17, 8), (10, 8), (5, 3), (12, 4), (17, 0)]
    exact = path_patch_effects(model, runs, senders, (18, 6), "k")
    assert exact[0] > 0.5 and exact[1] > 0.3 and np.abs(exact[2:]).max() < 0.2 * exact[1], exact
    ig = edge_scores(model, runs, "eap-ig", steps=3).head_scores[1, 18, 6, :18].ravel()
    assert set(np.argsort(-ig)[:2]) == {16 * 9 + 0, 17 * 9 + 8}
    qk = qk_attribution(model, clean.tokens[:1], 18, 6, 19, 8)
    assert list(qk.key_side().index[:2]) == ["16.0", "17.8"] and qk.identity_error < 1e-4


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_padded_batch_equals_each_prompt_run_alone(tiny_tokenizer, side):
    """Two prompt pairs of lengths 9 and 6 in one padded batch: path patching (into a key, a value
    and the logits) and EAP-IG equal the mean of the two pairs run alone, unpadded (1e-5, or 1e-6 nats); the
    padding is not vacuous (the same batch without its mask differs)."""
    from headprobe.analyses.circuit import edge_attribution, path_patch
    from headprobe.probe.hooks.capture import pad_prompts

    model = _sharpened(tiny_tokenizer, "llama")  # GQA: 4 query heads on 2 KV heads; effects well above float32 rounding
    g = torch.Generator().manual_seed(5)
    pairs = [(torch.randint(0, 100, (n,), generator=g), torch.randint(0, 100, (n,), generator=g)) for n in (9, 6)]
    clean, mask = pad_prompts([c for c, _ in pairs], 0, side)
    corrupted, mask2 = pad_prompts([x for _, x in pairs], 0, side)
    assert torch.equal(mask, mask2) and not bool(mask.all())
    senders = [(0, h) for h in range(model.spec.n_heads)]
    for receiver, inp in (((1, 1), "k"), ((1, 2), "v"), ("logits", "k")):
        padded = path_patch(model, clean, corrupted, senders, receiver, inp, first=2, attention_mask=mask)
        alone = np.mean(
            [path_patch(model, c[None], x[None], senders, receiver, inp, first=2) for c, x in pairs], axis=0
        )
        np.testing.assert_allclose(padded, alone, rtol=1e-5, atol=1e-6)  # atol: float32 rounding of a ~5-nat loss
        if receiver != "logits":
            unmasked = path_patch(model, clean, corrupted, senders, receiver, inp, first=2)
            assert np.abs(unmasked - alone).max() > 1e-4
    ig = edge_attribution(model, clean, corrupted, steps=3, first=2, attention_mask=mask)
    singles = [edge_attribution(model, c[None], x[None], steps=3, first=2) for c, x in pairs]
    np.testing.assert_allclose(ig.head_scores, np.mean([s.head_scores for s in singles], axis=0), rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(
        ig.logit_scores, np.mean([s.logit_scores for s in singles], axis=0), rtol=1e-4, atol=1e-7
    )
    with pytest.raises(HeadprobeError, match="no prediction from its real token 5"):  # the 6-token row: NaN, refused
        path_patch(model, clean, corrupted, senders, (1, 1), "k", first=5, attention_mask=mask)


def _baseline_by_definition(model, runs, layers):
    """The baseline error as defined: the clean metric against a forward resumed, unpatched, at every
    one of ``layers`` (and the unembedding of the clean final residual), one forward each."""
    tokens = runs.clean
    outs = [model.logits_from_residual(runs.resid_final)]
    outs += [model.forward_from(l, runs.resid_pre[l], attention_mask=runs.mask) for l in layers]
    return max(float((runs.metric(o.float(), tokens).float() - runs.clean_metric).abs().max()) for o in outs)


@pytest.mark.parametrize("drift_at", [None, 1, 2, 3])
def test_the_one_pass_baseline_equals_its_definition(tiny_tokenizer, drift_at):
    """baseline_error (one resumed pass, then one forward per layer only where a block drifts) equals
    the definition on a faithful model (0) and on one whose block ``drift_at``, resumed, adds 0.05 to
    the residual (the check must then fail, whichever block it is)."""
    from headprobe.analyses.circuit import baseline_error

    model = wrap(zoo.make_checkpoint("llama", tiny_tokenizer, num_hidden_layers=4), backend="native")
    g = torch.Generator().manual_seed(0)
    clean, corrupted = (torch.randint(0, 100, (3, 12), generator=g) for _ in range(2))
    runs = prepare_runs(model, clean, corrupted, first=2)
    handle = None
    if drift_at is not None:  # after the clean run: only resumed forwards see it
        handle = model.model.blocks[drift_at].register_forward_hook(lambda module, args, out: out + 0.05)
    try:
        with torch.inference_mode():
            want = _baseline_by_definition(model, runs, [1, 2, 3])
        got = baseline_error(model, runs, [1, 2, 3])
    finally:
        if handle is not None:
            handle.remove()
    assert got == want
    assert (got == 0.0) if drift_at is None else (got > 1e-3)


def _prompt_pair(model, pos=25):
    g = torch.Generator().manual_seed(11)
    return (torch.randint(0, 100, (2, pos), generator=g) for _ in range(2))


def test_path_patch_refuses_a_first_without_predictions(tiny_llama_gqa_native):
    """Prompts of 25 tokens predict at positions 0..23: first=23 equals a hand-made metric of the
    last prediction alone; 24, 25, 100 (no prediction: NaN) and negative values are refused in one
    line naming the range; so is a caller's metric that is NaN."""
    from headprobe.analyses.circuit import path_patch
    from headprobe.probe.backends.base import token_losses

    model = tiny_llama_gqa_native
    clean, corrupted = _prompt_pair(model)
    last = path_patch(model, clean, corrupted, (0, 1), (1, 2), "k", first=23)
    by_hand = path_patch(model, clean, corrupted, (0, 1), (1, 2), "k", metric=lambda lg, t: token_losses(lg, t)[:, 23])
    assert np.isfinite(last) and last == pytest.approx(by_hand, rel=1e-5, abs=1e-9)
    for first in (24, 25, 100, -1, -2):
        with pytest.raises(HeadprobeError, match=r"first=-?\d+ is out of range for prompts of 25 tokens.*0\.\.23$"):
            path_patch(model, clean, corrupted, (0, 1), (1, 2), "k", first=first)
    with pytest.raises(HeadprobeError, match="metric of the clean run is not finite"):
        path_patch(model, clean, corrupted, (0, 1), (1, 2), "k", metric=lambda lg, t: lg[:, :0, 0].mean(1))


def test_path_patch_reads_and_checks_heads_as_the_other_apis(tiny_llama_gqa_native):
    """Heads as "l.h" strings give what (l, h) pairs give; a receiver or sender outside the model is
    named as out of range (check_head's line), not an IndexError or 'not before its receiver'."""
    from headprobe.analyses.circuit import path_patch

    model = tiny_llama_gqa_native  # 2 layers of 8 heads
    clean, corrupted = _prompt_pair(model, 9)
    for senders, receiver, message in (
        ((0, 1), (1, 99), r"^head 1\.99 is out of range: the model has 2 layers of 8 heads"),
        ((99, 0), (1, 2), r"^head 99\.0 is out of range"),
        ("0.9", (1, 2), r"^head 0\.9 is out of range"),
        ((1, 0), (1, 2), r"^sender 1\.0 is not a head before its receiver 1\.2"),
        ((0, 1), (0, 2), r"^receiver 0\.2 is in layer 0"),
    ):
        with pytest.raises(HeadprobeError, match=message):
            path_patch(model, clean, corrupted, senders, receiver, "k")
    pairs = path_patch(model, clean, corrupted, [(0, 1), (0, 3)], (1, 2), "v")
    assert np.array_equal(path_patch(model, clean, corrupted, ["0.1", (0, 3)], "1.2", "v"), pairs)
    assert np.array_equal(path_patch(model, clean, corrupted, "0.1,0.3", "1.2", "v"), pairs)
    assert path_patch(model, clean, corrupted, "0.1", "1.2", "v") == pairs[0]


def _near_tie_table(rng):
    """An :meth:`EdgeScores.table` of a 4-layer, 3-head graph whose small scores come in tied
    ``+s, -s`` pairs and values 1e-7 apart: the ``|score|`` order of these is float noise."""
    L, H = 4, 3
    head = np.zeros((3, L, H, L, H))
    for lr in range(1, L):
        head[:, lr, :, :lr, :] = rng.normal(size=(3, H, lr, H))
    head[head.nonzero()] *= 1e-3  # near zero ...
    head[0, 3, 0, :3, :] = np.arange(1, 10).reshape(3, H)  # ... but for 9 large ones (the top)
    head[1, 2, 1, 0, 0], head[1, 2, 1, 0, 1] = 2.7e-4, -2.7e-4  # a tied pair
    return EdgeScores("eap", 1, head, rng.normal(size=(L, H)) * 1e-3)


def _drawn(monkeypatch, model, scores, n, seed):
    """The edge names :func:`verify_edges` path patches (exact effects replaced by zeros; ``model``
    only stands in: the table is not its graph)."""
    seen = []

    def fake_exact(model, runs, edges, **kwargs):
        seen.extend(e.name for e in edges)
        return np.zeros(len(edges))

    monkeypatch.setattr(circuit_module, "exact_effects", fake_exact)
    clean = torch.randint(0, 100, (1, 6), generator=torch.Generator().manual_seed(0))
    verify_edges(model, prepare_runs(model, clean, clean.flip(1)), scores.table, n, seed)
    return seen


def test_the_random_verified_edges_do_not_depend_on_the_float_order_of_small_scores(monkeypatch, tiny_tokenizer):
    """The committed SmolLM2 run drew 5 of its 30 random edges differently on another host: ties
    in ``|score|`` (``+s`` and ``-s``) and scores 1e-6 apart sorted otherwise. Reference: the same
    scores with every tied pair's signs swapped and 1e-7 noise on the small ones draw the same names."""
    model = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")
    scores = _near_tie_table(np.random.default_rng(0))
    head, logits = scores.head_scores.copy(), scores.logit_scores.copy()
    small = (np.abs(head) < 1e-2) & (head != 0)
    head[small] = -head[small] + np.random.default_rng(1).normal(size=small.sum()) * 1e-7
    logits = -logits + np.random.default_rng(2).normal(size=logits.shape) * 1e-7
    shaken = EdgeScores("eap", 1, head, logits)
    order = scores.table["edge"].to_numpy()
    assert (order != shaken.table["edge"].to_numpy())[9:].any()  # the |score| order did change
    for seed in range(5):
        first = _drawn(monkeypatch, model, scores, 9, seed)
        assert len(first) == 18 and first[:9] == list(order[:9])  # the top 9, then 9 random from the rest
        assert set(first[9:]).isdisjoint(first[:9])
        assert _drawn(monkeypatch, model, shaken, 9, seed) == first
        assert _drawn(monkeypatch, model, scores, 9, seed) == first  # reproducible
    draws = {tuple(_drawn(monkeypatch, model, scores, 9, seed)[9:]) for seed in range(5)}
    assert len(draws) == 5  # and seeded: other seeds, other edges
