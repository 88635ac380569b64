"""The reported head metrics (analyses/metrics.py, analyses/composition.py): hand-made patterns and
weights with known answers, brute-force references (a d_vocab eigendecomposition, a loop over head
pairs with explicit d_model x d_model matrices), the logit identity of the direct logit
attribution, and both backends' weight accessors against the Hugging Face modules."""

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from conftest import TINY_MODELS

from headprobe.analyses import composition, metrics
from headprobe.analyses.data import needle_tokens
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.capture import capture_heads


def uniform_causal(B: int, H: int, T: int) -> torch.Tensor:
    p = torch.ones(T, T).tril()
    return (p / p.sum(-1, keepdim=True)).expand(B, H, T, T).clone()


# ---- pattern metrics on hand-made patterns ------------------------------------------------------


def test_entropy_of_a_uniform_causal_pattern_is_mean_log_of_the_keys_seen():
    T = 12
    got = metrics.attention_entropy(uniform_causal(2, 3, T))
    want = np.mean([math.log(i + 1) for i in range(1, T)])
    assert torch.allclose(got, torch.full((3,), want), atol=1e-5)
    onehot = torch.eye(T)[None, None].expand(1, 2, T, T)
    assert torch.allclose(metrics.attention_entropy(onehot), torch.zeros(2))


def test_sink_rate_averages_over_the_queries_that_see_the_key():
    T = 10
    pat = uniform_causal(1, 2, T)
    pat[0, 1] = 0
    pat[0, 1, :, 0] = 1  # head 1: every query attends only to token 0
    got = metrics.sink_rate(pat)
    want0 = np.mean([1 / (i + 1) for i in range(T)])  # query 0 included: it sees key 0
    assert got[0].item() == pytest.approx(want0, rel=1e-6)
    assert got[1].item() == pytest.approx(1.0)
    # key 3 is seen by queries 3..T-1 only (Gu et al.'s 1/(T-k+1))
    assert metrics.sink_rate(pat, key=3)[0].item() == pytest.approx(
        np.mean([1 / (i + 1) for i in range(3, T)]), rel=1e-6
    )
    with pytest.raises(ValueError):
        metrics.sink_rate(pat, key=T)


def test_retrieval_hits_counts_a_top_key_in_the_needle_holding_the_predicted_token():
    # needle [5, 6, 5, 7] at 1..4, again at 7..10; queries 7..9 predict needle tokens 2..4
    tokens = torch.tensor([[0, 5, 6, 5, 7, 1, 2, 5, 6, 5, 7, 3]])
    T = tokens.shape[1]
    queries = torch.tensor([[7, 8, 9]])
    predicted = torch.tensor([[6, 5, 9]])  # the model gets tokens 2 and 3 right, misses 4
    pat = uniform_causal(1, 4, T) * 0.1
    for i in range(3):
        q = queries[0, i]
        pat[0, 0, q, 2 + i] = 5.0  # head 0: the needle position the token came from
        pat[0, 1, q, 1] = 5.0  # head 1: needle position 1, which holds 5
        pat[0, 2, q, q] = 5.0  # head 2: the second needle itself (not the needle in the context)
    pat[0, 3, 8, 4] = 5.0  # head 3, query 8: a needle key holding 7, not the predicted 5
    got = metrics.retrieval_hits(pat, queries, tokens, predicted, torch.tensor([1]), 4)
    # Wu et al.: a hit when the top key is in the needle and holds the predicted token, at whichever
    # needle position: head 0 at queries 7 and 8 (query 9's prediction 9 is no needle token), head 1
    # at query 8 (position 1 holds 5 = the prediction, though token 3's own source is position 3)
    assert got.tolist() == pytest.approx([2 / 3, 1 / 3, 0.0, 0.0])


def test_needle_set_repeats_the_needle_and_keeps_its_length(tiny_gpt2_native):
    text = " ".join(f"t{i % 90}" for i in range(400))
    ns = needle_tokens(tiny_gpt2_native, 3, 40, 6, seed=1, text=text)
    assert ns.tokens.shape == (3, 40)
    for b in range(3):
        a, c = int(ns.first[b]), int(ns.second[b])
        assert c >= a + 2 * 6
        assert torch.equal(ns.tokens[b, a : a + 6], ns.tokens[b, c : c + 6])
    q, s, t = metrics.needle_queries(ns)
    assert torch.equal(ns.tokens.gather(1, s), t)  # the source holds the token to predict


def needle_with_repeats(model, hf, n_seqs: int, seq_len: int, needle_len: int):
    """A needle set whose needle cycles through the 3 tokens ``hf`` predicts most often on it
    (``a b c a b c ...``): a random-init model then predicts needle tokens, right or wrong, and a
    head can copy one from a position other than the one the predicted token came from."""
    text = " ".join(f"t{(7 * i) % 97}" for i in range(600))
    ns = needle_tokens(model, n_seqs, seq_len, needle_len, seed=0, text=text)
    with torch.no_grad():
        top3 = torch.bincount(hf(ns.tokens).logits.argmax(-1).flatten()).argsort(descending=True, stable=True)[:3]
    tokens = ns.tokens.clone()
    for b in range(n_seqs):
        f, s2 = int(ns.first[b]), int(ns.second[b])
        cycle = top3.repeat(needle_len)[:needle_len]
        tokens[b, f : f + needle_len] = cycle
        tokens[b, s2 : s2 + needle_len] = cycle
    return dataclasses.replace(ns, tokens=tokens)


@pytest.mark.parametrize(
    ("fixture", "reference"),
    [("tiny_llama_gqa_native", "tiny_llama_gqa_checkpoint"), ("tiny_gpt2", "tiny_gpt2_checkpoint")],
)
def test_retrieval_score_is_wu_et_al_copy_paste_rule_on_the_hugging_face_model(fixture, reference, request):
    model = request.getfixturevalue(fixture)
    hf = request.getfixturevalue(reference).hf_model
    ns = needle_with_repeats(model, hf, 4, 48, 9)
    got = metrics.retrieval_score(model, ns)
    with torch.no_grad():
        out = hf(ns.tokens, output_attentions=True)
    pred = out.logits.argmax(-1)
    want = torch.zeros_like(got)
    strict = torch.zeros_like(got)  # the top key must be the predicted token's own source, and the prediction right
    n = 0
    for b in range(ns.tokens.shape[0]):
        f, s2, length = int(ns.first[b]), int(ns.second[b]), ns.needle_len
        for i in range(length - 1):
            q = s2 + i
            n += 1
            for layer, att in enumerate(out.attentions):
                for h in range(att.shape[1]):
                    j = int(att[b, h, q].argmax())
                    # Wu et al.'s check_if_attend_ref: needle_start <= j < needle_end and prompt_ids[j] == token
                    want[layer, h] += f <= j < f + length and int(ns.tokens[b, j]) == int(pred[b, q])
                    strict[layer, h] += j == f + i + 1 and int(pred[b, q]) == int(ns.tokens[b, q + 1])
    want /= n
    strict /= n
    assert (want != strict).any(), "the needle set does not tell the two rules apart"
    assert torch.allclose(got, want, atol=1e-6)
    if fixture.endswith("_native"):  # the streamed argmax (no pattern materialised) gives the same score
        assert torch.allclose(metrics.retrieval_score(model, ns, streaming=True), want, atol=1e-6)


# ---- weights: accessors, copying, composition ---------------------------------------------------


@pytest.mark.parametrize("fixture", TINY_MODELS)
def test_weight_accessors_match_the_hugging_face_modules(fixture, request):
    model = request.getfixturevalue(fixture)
    ckpt = request.getfixturevalue(
        "tiny_gpt2_checkpoint" if "gpt2" in fixture else "tiny_llama_gqa_checkpoint"
    ).hf_model
    d, dh = model.spec.d_model, model.spec.d_head
    if "gpt2" in fixture:
        blk = ckpt.transformer.h[1]
        Wq, Wk, Wv = blk.attn.c_attn.weight.split(d, dim=1)  # Conv1D: [in, out]
        ln, lnf, W_E = blk.ln_1, ckpt.transformer.ln_f, ckpt.transformer.wte.weight
    else:
        blk = ckpt.model.layers[1]
        Wq, Wk, Wv = (getattr(blk.self_attn, n).weight.T for n in ("q_proj", "k_proj", "v_proj"))
        ln, lnf, W_E = blk.input_layernorm, ckpt.model.norm, ckpt.model.embed_tokens.weight
    split = lambda W: W.unflatten(1, (-1, dh)).transpose(0, 1)
    assert torch.allclose(model.W_Q(1), split(Wq))
    assert torch.allclose(model.W_K(1), split(Wk)) and model.W_K(1).shape[0] == model.spec.n_kv_heads
    assert torch.allclose(model.W_V(1), split(Wv))
    assert torch.allclose(model.W_E(), W_E) and torch.allclose(model.W_U(), ckpt.lm_head.weight.T)
    for nw, module in ((model.norm_weights(1), ln), (model.norm_weights(None), lnf)):
        assert torch.allclose(nw.weight, module.weight, atol=1e-5)
        assert nw.centers == ("gpt2" in fixture)
        if "gpt2" in fixture:
            assert torch.allclose(nw.bias, module.bias, atol=1e-5)


def test_copying_score_is_one_for_an_identity_ov_and_minus_one_for_its_negation():
    torch.manual_seed(0)
    V, D = 50, 8
    W_E = torch.randn(V, D)
    eye = torch.eye(D)[None, None]  # one layer, one head, d_head = d_model
    W_V = torch.cat([eye, eye, torch.randn(1, 1, D, D)], dim=1)  # [1, 3, D, D]
    W_O = torch.cat([eye, -eye, torch.randn(1, 1, D, D)], dim=1)
    got = composition.copying_scores(W_E, W_V, W_O, W_E.T)  # W_E W_OV W_E^T: PSD, or -PSD
    assert got[0, 0].item() == pytest.approx(1.0, abs=1e-6)
    assert got[0, 1].item() == pytest.approx(-1.0, abs=1e-6)
    assert -1 < got[0, 2].item() < 1


@pytest.mark.parametrize("fixture", ["tiny_gpt2_native", "tiny_llama_gqa"])
def test_copying_score_equals_the_brute_force_d_vocab_eigendecomposition(fixture, request):
    model = request.getfixturevalue(fixture)
    w = composition.head_weights(model)
    got = composition.copying_score(model)
    for layer in range(model.spec.n_layers):
        for h in range(model.spec.n_heads):
            M = (w.W_E.double() @ w.W_V[layer, h].double() @ w.W_O[layer, h].double() @ w.W_U.double()).numpy()
            lam = np.linalg.eigvals(M)  # [d_vocab], all but d_head of them ~0
            assert got[layer, h].item() == pytest.approx(lam.sum().real / np.abs(lam).sum(), abs=2e-4)
    # GQA: the heads of one key/value group share W_V; their scores still differ through W_O
    assert torch.equal(w.W_V[0, 0], w.W_V[0, model.spec.group_size - 1])


@pytest.fixture(scope="module")
def shared_unembedding_direction(tiny_llama_gqa_checkpoint):
    """(model, the same model with one vector ``m`` added to every token's unembedding column).

    The model is the untied tiny GQA Llama with one vector added to every token's embedding (token
    embeddings that share a mean direction, as trained models' do); adding ``m`` to the
    unembedding then adds ``x . m`` to every logit, so no prediction changes. Both vectors are 10
    times the rows' RMS norm, in random directions."""
    import copy
    import dataclasses

    from headprobe.probe.backends.wrapping import wrap

    g = torch.Generator().manual_seed(7)

    def add_shared(W: torch.Tensor) -> None:  # [d_vocab, d_model]: the same vector added to every row
        v = torch.randn(W.shape[1], generator=g)
        W += 10 * W.norm(dim=1).pow(2).mean().sqrt() * v / v.norm()

    ckpt = tiny_llama_gqa_checkpoint
    base = copy.deepcopy(ckpt.hf_model)
    assert not base.config.tie_word_embeddings
    with torch.no_grad():
        add_shared(base.model.embed_tokens.weight)
    shifted = copy.deepcopy(base)
    with torch.no_grad():
        add_shared(shifted.lm_head.weight)  # row v is W_U[:, v]
    return (
        wrap(dataclasses.replace(ckpt, hf_model=base), backend="native"),
        wrap(dataclasses.replace(ckpt, hf_model=shifted), backend="native"),
    )


def test_copying_score_ignores_a_direction_shared_by_every_tokens_unembedding(shared_unembedding_direction):
    """Elhage et al. 2021 and TransformerLens' default processing (``center_unembed``) read W_U
    centred over the vocabulary: a vector added to every token's unembedding moves every logit
    equally and changes no prediction, so it must not change a copying score. Reference: the
    ``d_vocab`` eigenvalues of ``W_E W_V W_O W_U`` with ``W_U`` folded (final RMSNorm weight) and
    centred here by hand."""
    model, shifted = shared_unembedding_direction
    tokens = torch.randint(0, 100, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(
            shifted.forward(tokens).log_softmax(-1), model.forward(tokens).log_softmax(-1), atol=1e-4, rtol=0
        )  # the same predictions
    base, got = composition.copying_score(model), composition.copying_score(shifted)
    torch.testing.assert_close(got, base, atol=1e-4, rtol=0)
    w = composition.head_weights(shifted)
    W_U = shifted.norm_weights(None).weight.double()[:, None] * shifted.W_U().detach().double()
    W_U = W_U - W_U.mean(dim=1, keepdim=True)  # centred over the vocabulary
    for layer in range(shifted.spec.n_layers):
        for h in range(shifted.spec.n_heads):
            M = (w.W_E.double() @ w.W_V[layer, h].double() @ w.W_O[layer, h].double() @ W_U).numpy()
            lam = np.linalg.eigvals(M)
            assert got[layer, h].item() == pytest.approx(lam.sum().real / np.abs(lam).sum(), abs=2e-4)
    raw = composition.copying_scores(
        w.W_E, w.W_V, w.W_O, shifted.norm_weights(None).weight[:, None] * shifted.W_U().detach()
    )
    # the case that matters: uncentred, the shared direction swamps most heads' scores (to about +-1)
    assert (raw.abs() > 0.95).float().mean() > 0.5 and (raw - got).abs().max() > 0.5


def _loop_composition(w: composition.HeadWeights) -> dict[str, torch.Tensor]:
    L, H = w.W_Q.shape[:2]
    out = {k: torch.full((L, H, L, H), float("nan"), dtype=torch.float64) for k in "qkv"}
    fro = torch.linalg.matrix_norm
    for lj in range(L):
        for hj in range(H):
            QK = w.W_Q[lj, hj].double() @ w.W_K[lj, hj].double().T
            OVj = w.W_V[lj, hj].double() @ w.W_O[lj, hj].double()
            for li in range(lj):
                for hi in range(H):
                    OV = w.W_V[li, hi].double() @ w.W_O[li, hi].double()
                    for k, right in (("q", QK), ("k", QK.T), ("v", OVj)):
                        out[k][lj, hj, li, hi] = fro(OV @ right) / (fro(OV) * fro(right))
    return out


@pytest.mark.parametrize("fixture", ["tiny_llama_gqa_native", "tiny_gpt2"])
def test_composition_scores_match_a_loop_over_head_pairs_and_are_scale_invariant(fixture, request):
    model = request.getfixturevalue(fixture)
    w = composition.head_weights(model)
    got = composition.composition_scores(w)
    want = _loop_composition(w)
    passes = composition.composition_scores(w, heads_per_pass=3)  # later heads 3 at a time, the last pass short
    for k in "qkv":
        assert torch.equal(passes[k].isnan(), got[k].isnan())
        assert torch.allclose(passes[k].nan_to_num(), got[k].nan_to_num(), atol=1e-6)
        assert got[k].shape == (model.spec.n_layers, model.spec.n_heads) * 2
        assert torch.equal(torch.isnan(got[k]), torch.isnan(want[k]))
        assert torch.allclose(got[k].double().nan_to_num(), want[k].nan_to_num(), atol=1e-5)
        assert got[k].nan_to_num().std() > 0.005  # not a constant
    # rescaling one head's matrices changes no score
    W_V, W_Q = w.W_V.clone(), w.W_Q.clone()
    W_V[0, 1] *= 3.0
    W_Q[1, 2] *= 0.25
    scaled = composition.composition_scores(composition.HeadWeights(W_Q, w.W_K, W_V, w.W_O, w.W_E, w.W_U))
    for k in "qkv":
        assert torch.allclose(scaled[k].nan_to_num(), got[k].nan_to_num(), atol=1e-5)
    # while changing a head's direction does
    W_O = w.W_O.clone()
    W_O[0, 1] = torch.randn_like(W_O[0, 1])
    moved = composition.composition_scores(composition.HeadWeights(w.W_Q, w.W_K, w.W_V, W_O, w.W_E, w.W_U))
    assert not torch.allclose(moved["k"][1, :, 0, 1], got["k"][1, :, 0, 1], atol=1e-3)


def test_composition_passes_follow_the_budget_and_refuse_before_allocating(tiny_llama_gqa_native, monkeypatch):
    """The later heads a pass scores come from the budget (composition_plan): 2 where the budget
    holds the fixed part and two heads' products, all 8 where it holds more; below one head the
    scan's composition step is refused in one line naming --no-metrics, before any weight is read."""
    from headprobe.analyses import metrics as M
    from headprobe.probe.core import memory

    model = tiny_llama_gqa_native
    monkeypatch.setattr(memory, "free_bytes", lambda device: 2**40)  # 64 GiB is not above the free memory
    memory.set_budget("64GiB")
    try:
        full = composition.composition_plan(model.spec, "cpu")
        assert full.items == model.spec.n_heads
        passes = []
        real = composition.composition_scores
        monkeypatch.setattr(
            composition, "composition_scores", lambda w, d=None, n=None: passes.append(n) or real(w, d, n)
        )
        memory.set_budget(full.fixed + 2 * full.per_item + full.per_item // 2)
        assert composition.composition_plan(model.spec, "cpu").items == 2
        two = M.scan_composition(model)
        memory.set_budget(None)
        assert passes == [2] and two is not None
        want = real(composition.head_weights(model, vocab=False))
        assert all(np.allclose(two[k], want[k].numpy(), atol=1e-6, equal_nan=True) for k in "qkv")
        memory.set_budget(full.fixed + full.per_item // 2)
        monkeypatch.setattr(composition, "head_weights", lambda *a, **k: pytest.fail("weights read before the refusal"))
        with pytest.raises(HeadprobeError, match=r"^scan's composition scores needs about .*--no-metrics$"):
            M.scan_composition(model)
    finally:
        memory.set_budget(None)


# ---- direct logit attribution -------------------------------------------------------------------

GRANITE_LOGITS_SCALING = 8.0


def _tiny_granite(tokenizer, backend):
    """A tiny random Granite (Llama-like, logits divided by ``logits_scaling`` = 8 after the LM
    head): a family whose logits are not ``final_norm(x) @ W_U``."""
    import zoo
    from transformers import AutoConfig, AutoModelForCausalLM

    from headprobe.probe.backends.wrapping import wrap
    from headprobe.probe.layout.spec import Checkpoint

    cfg = AutoConfig.for_model(
        "granite", **zoo.TINY_FIELDS, logits_scaling=GRANITE_LOGITS_SCALING, architectures=["GraniteForCausalLM"]
    )
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    return wrap(Checkpoint("tiny-granite", "tiny-granite", "float32 (random init)", hf, tokenizer), backend=backend)


@pytest.fixture(scope="module")
def tiny_granite(tiny_tokenizer):
    """Granite behind TransformerLens' bridge."""
    return _tiny_granite(tiny_tokenizer, "transformer-lens")


@pytest.fixture(scope="module")
def tiny_granite_native(tiny_tokenizer):
    """Granite on the native backend (``logits_scaling`` in its config)."""
    return _tiny_granite(tiny_tokenizer, "native")


@pytest.mark.parametrize("fixture", [*TINY_MODELS, "tiny_granite", "tiny_granite_native"])
def test_dla_plus_the_other_components_sums_to_the_logit(fixture, request):
    """The identity: heads + b_O + embeddings + MLP outputs, each through the frozen final norm,
    plus the norm's bias and b_U, give the correct token's logit (Hugging Face's); times the
    family's logit scale, here Granite's ``1 / logits_scaling`` by hand."""
    model = request.getfixturevalue(fixture)
    scale = GRANITE_LOGITS_SCALING if fixture.startswith("tiny_granite") else 1.0
    spec = model.spec
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    first = 1
    dla = metrics.direct_logit_attribution(model, tokens, first)  # [batch, n, layer, head]
    kept = {}
    names = ["hook_embed", "hook_pos_embed"] + [
        f"blocks.{l}.hook_{k}" for l in range(spec.n_layers) for k in ("attn_out", "mlp_out")
    ]
    names += [f"blocks.{spec.n_layers - 1}.hook_resid_post"]
    hooks = [
        (n, (lambda n: lambda x, hook: kept.__setitem__(n, x.detach().double()))(n))  # noqa: B023 - bound by the call
        for n in names
        if n in model.hook_names()
    ]
    logits = model.forward(tokens, fwd_hooks=hooks).double()
    x = kept[f"blocks.{spec.n_layers - 1}.hook_resid_post"][:, first:-1]
    target = tokens[:, first + 1 :]
    # the frozen final norm, computed here from its definition: w * (x - mean) / sigma + b
    nw = model.norm_weights(None)
    w, b = nw.weight.double(), nw.bias.double()
    xc = x - x.mean(-1, keepdim=True) if nw.centers else x
    y = model.final_norm(x.float()).double()
    sigma = ((w * xc) * (w * xc)).sum(-1, keepdim=True) / ((y - b) * (w * xc)).sum(-1, keepdim=True)
    W_U = model.W_U().double() / scale
    direct = lambda c: (
        ((((c - c.mean(-1, keepdim=True)) if nw.centers else c) * w / sigma) @ W_U)
        .gather(-1, target[..., None])
        .squeeze(-1)
    )
    b_U = model.b_U()
    rest = (b @ W_U)[target] + (0 if b_U is None else b_U.double()[target] / scale)
    heads_sum = torch.zeros_like(rest)
    for l in range(spec.n_layers):
        # attn_out minus the heads is b_O: the heads come from dla, b_O from the bias
        b_O = model.b_O(l)
        if b_O is not None:
            rest = rest + direct(b_O.double().expand_as(x))
        rest = rest + direct(kept[f"blocks.{l}.hook_mlp_out"][:, first:-1])
        heads_sum = heads_sum + dla[:, :, l].double().sum(-1)
    rest = rest + direct(kept["hook_embed"][:, first:-1])
    if "hook_pos_embed" in kept:
        rest = rest + direct(kept["hook_pos_embed"][:, first:-1])
    want = logits[:, first:-1].gather(-1, target[..., None]).squeeze(-1)
    assert torch.allclose(heads_sum + rest, want, atol=1e-3, rtol=1e-4)
    assert heads_sum.abs().max() > 1e-3  # the heads carry part of it


def test_dla_catches_a_head_output_that_is_not_what_the_block_adds(tiny_gpt2_native):
    """The identity above can fail: attributing with a wrong W_O breaks it."""
    model = tiny_gpt2_native
    tokens = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(4))
    good = metrics.direct_logit_attribution(model, tokens, 1)

    wrong = copy.copy(model)  # the same LoadedModel (the interface), its W_O rescaled
    wrong.W_O = lambda layer: model.W_O(layer) * 1.5
    bad = metrics.direct_logit_attribution(wrong, tokens, 1)
    assert not torch.allclose(good.sum((-1, -2)), bad.sum((-1, -2)), atol=1e-4)


# ---- the real model ------------------------------------------------------------------------------


@pytest.mark.real_model
def test_smollm2_previous_token_heads_k_compose_into_induction_heads(smollm2_native):
    """On SmolLM2-135M the top previous-token heads' outputs are read by the top induction heads'
    keys more than by a typical pair of heads (Olsson et al. 2022's induction circuit)."""
    from pathlib import Path

    import pandas as pd

    table = pd.read_csv(Path(__file__).parents[1] / "figures/smollm2-135m/head_scores.csv")
    top = lambda col: [tuple(map(int, r)) for r in table.nlargest(5, col)[["layer", "head"]].to_numpy()]
    k = composition.composition_scores(composition.head_weights(smollm2_native))["k"].numpy()
    s = metrics.composition_summary(k, top("previous_token"), top("induction"))
    assert s["pairs_stats"]["mean"] > s["all_pairs"]["p95"]  # the circuit's pairs, on average, beyond 95% of all pairs
    assert (
        s["pairs_stats"]["median"] > s["into_same_heads"]["median"]
    )  # not just induction heads' keys reading everything


def test_the_distant_mass_heatmap_names_its_window():
    """The title and colour-bar label say which W the distant mass is read at (they said "W")."""
    import matplotlib.pyplot as plt

    from headprobe.analyses.metrics import LOCAL_FRACTION, heatmap_makers

    scores = {"distant_mass": np.linspace(0, 1, 8).reshape(2, 4)}
    fig = heatmap_makers([LOCAL_FRACTION], scores, 2, "tiny", fields={"W": 64})["heatmap_distant_mass"]()
    texts = [t.get_text() for ax in fig.axes for t in (ax.title, ax.yaxis.label)]
    plt.close(fig)
    assert any("beyond the last 64 keys" in t for t in texts) and any("keys 64 or more back" in t for t in texts), texts
    fig = heatmap_makers([LOCAL_FRACTION], scores, 2, "tiny")["heatmap_distant_mass"]()  # no fields: the name stays
    assert any("last W keys" in ax.title.get_text() for ax in fig.axes)
    plt.close(fig)


# ---- how a head says nothing: learned sinks, output gates, value-weighted attention ---------------


def test_learned_sink_mass_is_one_minus_the_row_sums():
    """Rows of 0.7 (the sink took 0.3) give 0.3; rows of 1 (no sink) give 0."""
    p = uniform_causal(2, 3, 6)
    p[:, 1] *= 0.7
    torch.testing.assert_close(metrics.learned_sink_mass(p), torch.tensor([0.0, 0.3, 0.0]), atol=1e-6, rtol=0)


def test_gate_closure_is_one_minus_the_mean_gate():
    """Per head: always open (1) -> 0, a quarter open -> 0.75, half its dimensions shut -> 0.5 (its first
    dimension alone, shut: 1)."""
    g = torch.ones(2, 5, 3, 4)
    g[:, :, 1] = 0.25
    g[:, :, 2, :2] = 0.0
    torch.testing.assert_close(metrics.gate_closure(g), torch.tensor([0.0, 0.75, 0.5]), atol=1e-6, rtol=0)
    torch.testing.assert_close(metrics.gate_closure(g[..., 0]), torch.tensor([0.0, 0.75, 1.0]), atol=1e-6, rtol=0)


def test_value_norms_match_a_loop_over_heads_and_keys():
    """||v_j W_O^(h)|| through the Gram matrix equals the plain product's norm (GQA: head h reads kv head h // 2)."""
    g = torch.Generator().manual_seed(0)
    v, W_O = torch.randn(2, 5, 2, 3, generator=g), torch.randn(4, 3, 7, generator=g)
    got = metrics.value_norms(v, W_O)
    for b in range(2):
        for h in range(4):
            for j in range(5):
                assert got[b, h, j].item() == pytest.approx((v[b, j, h // 2] @ W_O[h]).norm().item(), rel=1e-5)


def test_value_weighted_share_weights_attention_by_the_value_norms():
    """Uniform attention over keys 0 and 1 with value norms 3 and 1: token 0 gets 3/4 at query 1; at query 2
    (uniform over norms 3, 1, 0) also 3/4; query 0 is left out. A head whose token-0 value is 0 gives 0."""
    p = uniform_causal(1, 2, 3)
    norms = torch.tensor([[[3.0, 1.0, 0.0], [0.0, 1.0, 2.0]]])
    torch.testing.assert_close(metrics.value_weighted_share(p, norms), torch.tensor([0.75, 0.0]), atol=1e-6, rtol=0)
    with pytest.raises(ValueError):
        metrics.value_weighted_share(p, norms, key=2)


def _natural(model, n=2, T=24):
    from headprobe.analyses.data import TokenSet

    tokens = torch.randint(0, 100, (n, T), generator=torch.Generator().manual_seed(0))
    tokens[:, 0] = model.bos_token_id
    return TokenSet(tokens, 1, "random")


def test_no_op_columns_are_nan_with_reasons_where_the_model_lacks_the_mechanism(tiny_llama_gqa_native):
    """A model without sinks and gates: learned_sink_mass and gate_closure NaN with their reasons;
    value_share_token0 equals a loop over the captured pattern, z's values and W_O."""
    model = tiny_llama_gqa_native
    nat = _natural(model)
    scores, skipped = metrics.scan_metrics(model, nat, None, 1, streaming="off")
    assert np.isnan(scores["learned_sink_mass"]).all() and skipped["learned_sink_mass"] == metrics.NO_SINKS
    assert np.isnan(scores["gate_closure"]).all() and skipped["gate_closure"] == metrics.NO_GATE
    assert "value_share_token0" not in skipped
    got = scores["value_share_token0"]
    values = {}
    hooks = [(f"blocks.{l}.attn.hook_v", lambda v, hook, l=l: values.__setitem__(l, v.clone())) for l in range(2)]
    pats = {}
    hooks += [(f"blocks.{l}.attn.hook_pattern", lambda p, hook, l=l: pats.__setitem__(l, p.clone())) for l in range(2)]
    model.forward(nat.tokens, fwd_hooks=hooks)
    group = model.spec.n_heads // values[0].shape[2]
    for l in range(2):
        W_O = model.W_O(l).detach()
        for h in range(model.spec.n_heads):
            shares = []
            for b in range(2):
                f = torch.stack([(values[l][b, j, h // group] @ W_O[h]).norm() for j in range(24)])
                for i in range(1, 24):
                    w = pats[l][b, h, i] * f
                    shares.append((w[0] / w.sum()).item())
            assert got[l, h] == pytest.approx(np.mean(shares), rel=1e-4)


def test_learned_sink_mass_of_a_sink_model_and_its_streamed_value(tiny_llama_gqa_native):
    """With learned sinks: 1 - the mean row sum of the captured pattern, from the pattern and from streaming."""
    import zoo

    model = zoo.with_sinks(tiny_llama_gqa_native, scale=2.0)
    nat = _natural(model)
    pats = capture_heads(model, nat.tokens)["pattern"]
    want = np.stack([(1 - pats[l].sum(-1)).mean(dim=(0, 2)).numpy() for l in range(2)])
    for streaming in ("off", "on"):
        scores, skipped = metrics.scan_metrics(model, nat, None, 1, streaming=streaming)
        assert "learned_sink_mass" not in skipped
        np.testing.assert_allclose(scores["learned_sink_mass"], want, atol=1e-5)
    assert want.min() > 1e-3 and want.max() > 0.3
    assert skipped["value_share_token0"].startswith("value-weighted attention needs the materialised pattern")


def test_gate_closure_reads_a_gate_hook_where_the_model_has_one(tiny_llama_gqa_native):
    """A model given a hook_gate per layer (firing with gates 0.25 on head 1, 1 elsewhere) gets
    gate_closure 0.75 on head 1 and 0 elsewhere; a gate with the wrong head axis is refused in one line."""
    import copy as copy_

    from transformer_lens.hook_points import HookPoint

    from headprobe.probe.backends.base import LoadedModel
    from headprobe.probe.core.errors import HeadprobeError

    net = copy_.deepcopy(tiny_llama_gqa_native.model)
    shape_heads = [tiny_llama_gqa_native.spec.n_heads]
    for b in net.blocks:
        b.attn.hook_gate = HookPoint()

        def fire(mod, args, out, attn=b.attn):
            gate = torch.ones(*out.shape[:2], shape_heads[0])
            gate[:, :, 1] = 0.25
            attn.hook_gate(gate)

        b.attn.hook_z.register_forward_hook(fire)
    net.setup()
    model = LoadedModel(net, tiny_llama_gqa_native.tokenizer, tiny_llama_gqa_native.spec)
    got = metrics.gate_closures(model, _natural(model).tokens)
    want = torch.zeros(2, model.spec.n_heads)
    want[:, 1] = 0.75
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    shape_heads[0] = 2
    with pytest.raises(HeadprobeError, match="hook_gate of layer 0") as e:
        metrics.gate_closures(model, _natural(model).tokens)
    assert "\n" not in str(e.value)


def test_sink_removal_hooks_equal_a_model_without_those_sinks(tiny_llama_gqa_native):
    """Removing the sinks of heads 0.0 and 1.6 by hook (:func:`sink_removal_hooks`) equals the loss of a copy
    whose sink logits there are -inf (rows of those heads then sum to 1; the fused path masks a -inf sink)."""
    import zoo

    from headprobe.probe.backends.base import scored_loss
    from headprobe.probe.hooks.ablation import sink_removal_hooks

    model = zoo.with_sinks(tiny_llama_gqa_native, scale=2.0)
    tokens = _natural(model).tokens
    heads = [(0, 0), (1, 6)]  # sink masses 0.66 and 0.47 (the largest of each layer)
    got = (
        (
            scored_loss(model.forward(tokens, fwd_hooks=sink_removal_hooks(heads)), tokens, 1)
            - scored_loss(model.forward(tokens), tokens, 1)
        )
        .mean()
        .item()
    )
    removed = zoo.with_sinks(tiny_llama_gqa_native, scale=2.0)
    with torch.no_grad():
        for l, h in heads:
            removed.model.blocks[l].attn.sinks[h] = float("-inf")
        want = (
            (scored_loss(removed.forward(tokens), tokens, 1) - scored_loss(model.forward(tokens), tokens, 1))
            .mean()
            .item()
        )
    assert got == pytest.approx(want, abs=1e-5) and abs(want) > 1e-4
    pats = {}
    model.forward(
        tokens,
        fwd_hooks=[
            *sink_removal_hooks(heads),
            ("blocks.0.attn.hook_pattern", lambda p, hook: pats.__setitem__(0, p.clone())),
        ],
    )
    rows = pats[0].sum(-1)
    torch.testing.assert_close(rows[:, 0], torch.ones_like(rows[:, 0]), atol=1e-5, rtol=0)
    assert (rows[:, 1] < 1 - 1e-3).all()
