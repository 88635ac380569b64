"""KV policies on sliding-window layers: a streaming group of a sliding layer reads the
intersection of its layer's window and sink + recent window, and caches what that leaves.

References that share no code with the policy: Hugging Face's own model with the sliding layers'
window shrunk (a streaming group with no sink inside a wider layer window *is* a narrower window),
a hand-built boolean mask on the materialised scores, a loop over positions for the cache formula,
and the cache allocated by cached generation. Each comparison is shown failing when the layer's
window is dropped."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import zoo
from test_kv_policy_model import _hand_mask  # causal, the layer window, the group's streaming, by loops

from headprobe.analyses import kvpolicy as kp
from headprobe.probe.backends.wrapping import wrap
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout import cost
from headprobe.probe.layout.attention import AttentionLayout, KVPolicy, Streaming
from headprobe.probe.model.transformer import generate

FAMILIES = ("gemma3_text", "gpt_oss", "gemma2", "cohere2", "mistral")


def _tokens(T=20, batch=2, seed=1):
    return torch.randint(0, zoo.VOCAB - 1, (batch, T), generator=torch.Generator().manual_seed(seed))


def _streaming_everywhere(model, sink=2, window=3, full=((-1, -1),)):
    """Every group streaming, sliding layers included, except ``full`` (the last group of the last layer)."""
    L, G = model.cfg.n_layers, model.n_kv_groups
    keep = {(layer % L, g % G) for layer, g in full}
    return KVPolicy(
        tuple(tuple(None if (layer, g) in keep else Streaming(sink, window) for g in range(G)) for layer in range(L))
    )


def _reference_logits(model, policy, tokens, drop_layer_window=False):
    """The unmodified model (no policy) with every layer's scores masked by the hand-built mask;
    ``drop_layer_window``: a copy whose layers ignore their own window, masked without it (the
    sinks read past the layer's window: the semantics not chosen)."""
    T = tokens.shape[1]
    if drop_layer_window:
        model = copy.deepcopy(model)
        for b in model.blocks:
            b.attn.window = None

    def hook(layer):
        window = None if drop_layer_window else model.cfg.layout.windows[layer]
        mask = _hand_mask(policy, layer, model.blocks[layer].attn.n_heads, T, window)
        return lambda scores, hook: scores.masked_fill(~mask, float("-inf"))

    hooks = [(f"blocks.{layer}.attn.hook_attn_scores", hook(layer)) for layer in range(model.cfg.n_layers)]
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=hooks)


@pytest.fixture(scope="module", params=FAMILIES)
def net(request, tiny_tokenizer):
    model = wrap(zoo.make_checkpoint(request.param, tiny_tokenizer), backend="native").model.eval()
    assert model.cfg.layout.windows is not None and 8 in model.cfg.layout.windows
    return request.param, model


def test_policy_on_sliding_layers_equals_hand_mask(net):
    """Streaming groups on the sliding layers too (window 3 inside the layers' 8, sink 2): the
    policy's logits equal the hand-built intersection; the mask without the layer window (the
    sinks read past the layer's window) is a different model at 20 tokens."""
    _, model = net
    policy = _streaming_everywhere(model)
    x = _tokens()
    with torch.no_grad(), model.kv_policy(policy):
        got = model(x)
    torch.testing.assert_close(got, _reference_logits(model, policy, x), atol=1e-5, rtol=1e-5)
    assert (got - _reference_logits(model, policy, x, drop_layer_window=True)).abs().max() > 1e-4


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_sinkless_streaming_is_hugging_faces_narrower_window(family, tiny_tokenizer):
    """Independent of headprobe's masks: ``Streaming(0, 3)`` on every group of the sliding layers
    (global layers full) is Hugging Face's own model with ``sliding_window=3``; a policy with the
    window 4 is not."""
    hf_narrow = zoo.make_checkpoint(family, tiny_tokenizer, sliding_window=3).hf_model
    model = wrap(zoo.make_checkpoint(family, tiny_tokenizer), backend="native").model.eval()
    ref = zoo.make_checkpoint(family, tiny_tokenizer).hf_model.state_dict()
    assert all(torch.equal(v, ref[k]) for k, v in hf_narrow.state_dict().items())  # the same weights
    L, G = model.cfg.n_layers, model.n_kv_groups
    sliding = [model.cfg.is_sliding(layer) for layer in range(L)]
    assert any(sliding) and not all(sliding)

    def policy(window):
        return KVPolicy(
            tuple(tuple(Streaming(0, window) if sliding[layer] else None for _ in range(G)) for layer in range(L))
        )

    x = _tokens()
    with torch.no_grad():
        want = hf_narrow(x).logits
        with model.kv_policy(policy(3)):
            got = model(x)
        with model.kv_policy(policy(4)):
            wrong = model(x)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (wrong - want).abs().max() > 1e-3


def test_streaming_cache_on_sliding_layers_equals_recomputation_and_formula(net):
    """Cached generation under the policy equals recomputation; the allocated bytes equal
    ``policy_cost`` on the model's layout, not on the layout with its windows dropped."""
    _, model = net
    policy = _streaming_everywhere(model, sink=2, window=5)
    prompt = _tokens(T=9)
    cached, cache = generate(model, prompt, 10, use_cache=True, policy=policy)
    plain, _ = generate(model, prompt, 10, use_cache=False, policy=policy)
    assert torch.equal(cached, plain)
    layout = dataclasses.replace(model.cfg.layout, bytes_per_element=4)
    n = cache.n_tokens
    assert n > 8 + 2  # past the layer window and the sinks
    assert cache.nbytes == cost.policy_cost(layout, policy, n, batch=2).kv_bytes
    assert cache.nbytes < cost.policy_cost(dataclasses.replace(layout, windows=None), policy, n, batch=2).kv_bytes


def test_allocated_cache_check_fails_without_the_layer_window(tiny_tokenizer, text_file):
    """``allocated_cache_check`` is an identity: given the model's layout it passes; given the same
    layout with the windows dropped (the formula ignoring them) it refuses."""
    from headprobe.analyses.data import natural_text_tokens

    loaded = wrap(zoo.make_checkpoint("gemma3_text", tiny_tokenizer), backend="native")
    layout = loaded.kv_layout
    streaming = Streaming(2, 4)
    policy = kp.policy_with_full(layout, [(1, 0)], streaming, kp.streaming_candidates(layout, streaming))
    assert policy.groups[0][0] == streaming  # a sliding layer's group streams
    tokens = natural_text_tokens(loaded, 1, 48, 0, text_file.read_text()).tokens
    check = kp.allocated_cache_check(loaded, tokens, policy, layout)
    assert check["ok"] and check["tokens"] > 8
    with pytest.raises(HeadprobeError, match="differs from budget's formula"):
        kp.allocated_cache_check(loaded, tokens, policy, dataclasses.replace(layout, windows=None))
    full_sliding = KVPolicy(
        ((None, None), policy.groups[1])
    )  # also a full group of a sliding layer keeps its window only
    with pytest.raises(HeadprobeError, match="differs from budget's formula"):
        kp.allocated_cache_check(loaded, tokens, full_sliding, dataclasses.replace(layout, windows=None))


def _loop_positions(T, s, W):
    """Cached positions and (query, key) pairs of one streaming head by loops over the intersection mask."""

    def reads(i, j):
        return j <= i and (W is None or j > i - W) and (j < s.sink or j > i - s.window)

    return sum(reads(T - 1, j) for j in range(T)), sum(reads(i, j) for i in range(T) for j in range(T))


def test_streaming_cost_on_a_sliding_layer_equals_a_loop():
    for T in (1, 3, 8, 9, 13, 30):
        for s in (Streaming(0, 1), Streaming(2, 3), Streaming(4, 5), Streaming(3, 12)):
            for W in (None, 1, 3, 5, 8, 20):
                want = _loop_positions(T, s, W)
                assert (cost.streaming_positions(T, s, W), cost.streaming_visible_keys(T, s, W)) == want, (T, s, W)
            assert cost.streaming_positions(T, s) == min(T, s.span)
            assert cost.streaming_visible_keys(T, s) == cost.visible_keys(T, s.span)
    lay = AttentionLayout(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, windows=(8, None), bytes_per_element=4)
    policy = KVPolicy.uniform(2, 2, Streaming(2, 3))
    pc = cost.policy_cost(lay, policy, 30)
    per_pos = 2 * lay.d_head * 4
    assert pc.kv_bytes == 2 * per_pos * (
        _loop_positions(30, Streaming(2, 3), 8)[0] + _loop_positions(30, Streaming(2, 3), None)[0]
    )
    assert pc.kv_bytes_full == cost.kv_bytes_per_request(lay, 30)


def test_candidates_budget_and_matched_controls():
    """Groups of layers no wider than the window are not candidates and stay full everywhere; the
    budget's greedy choice fits; random controls have the chosen policy's bytes exactly and uniform
    at most them; without windows it is the homogeneous choice (:func:`n_full_for_budget`, the old
    random draw, :func:`uniform_policy`)."""
    lay = AttentionLayout(
        d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, windows=(8, None, 16, None), bytes_per_element=4
    )
    st, T = Streaming(2, 8), 64
    cands = kp.streaming_candidates(lay, st)
    assert cands == [(1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (3, 1)]  # layer 0's window 8 <= 8
    score = torch.tensor([[9.0, 9.0], [0.1, 0.2], [0.5, 0.4], [0.3, 0.0]])
    for b in (0.5, 0.75, 1.0):
        full = kp.budget_full_groups(score, st, lay, T, b, cands)
        assert (0, 0) not in full and (0, 1) not in full
        chosen = kp.policy_with_full(lay, full, st, cands)
        assert chosen.groups[0] == (None, None)
        pc = cost.policy_cost(lay, chosen, T)
        assert pc.kv_fraction <= b + 1e-12
        for seed in range(4):
            rnd = kp.matched_random_policy(lay, full, st, cands, T, seed)
            assert rnd.groups[0] == (None, None) and cost.policy_cost(lay, rnd, T).kv_bytes == pc.kv_bytes
        uni = kp.matched_uniform_policy(lay, pc.kv_bytes // (2 * lay.d_head * 4), st, cands, T)
        assert uni.groups[0] == (None, None) and cost.policy_cost(lay, uni, T).kv_bytes <= pc.kv_bytes
    with pytest.raises(HeadprobeError, match="below what every group streaming costs"):
        kp.budget_full_groups(score, st, lay, T, 0.2, cands)
    plain = AttentionLayout(d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, bytes_per_element=4)
    score3 = torch.rand(3, 2, generator=torch.Generator().manual_seed(0))
    all_groups = kp.streaming_candidates(plain, st)
    for b in (0.3, 0.5, 0.9):
        k = kp.n_full_for_budget(6, T, st.span, b)
        full = kp.budget_full_groups(score3, st, plain, T, b, all_groups)
        assert full == kp.ranked_groups(score3)[:k]
        assert kp.matched_random_policy(plain, full, st, all_groups, T, 7) == kp.random_policy(3, 2, k, st, 7)
        positions = cost.policy_cost(plain, kp.chosen_policy(score3, k, st), T).kv_bytes // (2 * plain.d_head * 4)
        assert kp.matched_uniform_policy(plain, positions, st, all_groups, T) == kp.uniform_policy(3, 2, k, st, T)


def test_distant_mass_is_zero_where_streaming_changes_nothing(tiny_tokenizer):
    """On a sliding layer (window 8) a window-8 streaming group drops nothing the layer reads: its
    estimated cost is 0; a narrower window has mass to drop there."""
    loaded = wrap(zoo.make_checkpoint("gemma3_text", tiny_tokenizer), backend="native")
    x = _tokens(T=24)
    wide, narrow = kp.distant_mass(loaded, x, 2, 8), kp.distant_mass(loaded, x, 2, 4)
    assert loaded.model.cfg.is_sliding(0)
    assert float(wide[0].abs().max()) < 1e-6 and float(narrow[0].min()) > 1e-3
    assert float(wide[1].min()) > 1e-3  # the global layer reads past the window


def test_chunked_attention_is_refused_before_any_work(tiny_tokenizer, text_file):
    """Llama-4's chunked layers are not sliding windows (a chunk's first query reads one key): ``kv``
    refuses them in one line, before the token sets are built."""
    from headprobe.commands.kv_core import KVConfig, run

    loaded = wrap(zoo.make_checkpoint("llama4_text", tiny_tokenizer), backend="native")
    assert any(loaded.model.cfg.is_chunked(layer) for layer in range(loaded.model.cfg.n_layers))
    with pytest.raises(HeadprobeError, match="chunked attention"):
        run(
            loaded,
            KVConfig(model="llama4_text", seq_len=48, block_len=6, sink=2, window=6, text=str(text_file)),
            progress=False,
        )


def test_check_budget_refuses_exactly_below_the_all_streaming_floor():
    """Check_budget's floor is the all-streaming policy's share of the full cache (cost.policy_cost,
    the layers' windows included): that share passes, one a hair below is refused, as is (0, 1]'s outside."""
    lay = AttentionLayout(
        d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, windows=(8, None, 16, None), bytes_per_element=4
    )
    st, T = Streaming(2, 8), 64
    cands = kp.streaming_candidates(lay, st)
    floor = cost.policy_cost(lay, kp.policy_with_full(lay, [], st, cands), T).kv_fraction
    assert 0 < floor < 1
    for b in (floor, (floor + 1) / 2, 1.0):
        kp.check_budget(b, st, lay, T, cands)
    for b, match in (
        (floor * (1 - 1e-6), "below what every group streaming costs"),
        (0.0, r"in \(0, 1\]"),
        (1.5, r"in \(0, 1\]"),
    ):
        with pytest.raises(HeadprobeError, match=match):
            kp.check_budget(b, st, lay, T, cands)


def test_check_kv_policy_refuses_chunked_attention_and_wrong_shapes(tiny_tokenizer):
    loaded = wrap(zoo.make_checkpoint("llama4_text", tiny_tokenizer), backend="native")
    with pytest.raises(HeadprobeError, match="chunked attention"):
        loaded.check_kv_policy(KVPolicy.uniform(loaded.spec.n_layers, loaded.n_kv_groups))
    llama = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")
    llama.check_kv_policy(KVPolicy.uniform(llama.spec.n_layers, llama.n_kv_groups))
    with pytest.raises(HeadprobeError, match="KV groups"):
        llama.check_kv_policy(KVPolicy.uniform(llama.spec.n_layers + 1, llama.n_kv_groups))
