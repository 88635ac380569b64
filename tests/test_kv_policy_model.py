"""Per-KV-group streaming attention in the native model (``Transformer.kv_policy``) against a
hand-built boolean mask applied to the materialised scores, and the policy's KV cache
(``StreamingKVCache``) against recomputation and against ``budget --policy``'s bytes, on the zoo:
MHA (gpt2), GQA (llama, qwen2), MQA (llama with one KV head), MLA (deepseek_v3: the latent is the
layer's one group), gemma2 (soft-capping: the eager path; its sliding layer stays full), SmolLM3 and
Cohere2 (a NoPE layer; Cohere2's interleaved rotary), Gemma-3 (a rotary base per layer)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import zoo

from headprobe.probe.backends.wrapping import wrap
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout import cost
from headprobe.probe.layout.attention import KVPolicy, Streaming
from headprobe.probe.model import attention as attention_mod
from headprobe.probe.model.transformer import generate

CASES = {
    "gpt2-MHA": ("gpt2", {}),
    "llama-GQA": ("llama", {}),
    "llama-MQA": ("llama", {"num_key_value_heads": 1}),
    "qwen2-GQA": ("qwen2", {}),
    "deepseek_v3-MLA": ("deepseek_v3", {}),
    "gemma2-softcap": ("gemma2", {}),
    "smollm3-NoPE": ("smollm3", {}),
    "cohere2-NoPE-interleaved": ("cohere2", {}),
    "gemma3_text-rope-bases": ("gemma3_text", {}),
}


@pytest.fixture(scope="module", params=list(CASES))
def net(request, tiny_tokenizer):
    family, change = CASES[request.param]
    model = wrap(zoo.make_checkpoint(family, tiny_tokenizer, **change), backend="native").model.eval()
    return request.param, model


def _policy(model, sink=2, window=3):
    """Group 0 of layer 0 and the last group of the last layer full, every other group streaming
    (a sliding-window layer stays full)."""
    L, G = model.cfg.n_layers, model.n_kv_groups
    rows = [
        [
            None if (layer, g) in {(0, 0), (L - 1, G - 1)} or model.cfg.is_sliding(layer) else Streaming(sink, window)
            for g in range(G)
        ]
        for layer in range(L)
    ]
    if G == 1:  # MLA / MQA: one group per layer; make layer 0 streaming, keep the last full
        rows = [
            [None if layer == L - 1 or model.cfg.is_sliding(layer) else Streaming(sink, window)] for layer in range(L)
        ]
    return KVPolicy(tuple(map(tuple, rows)))


def _hand_mask(policy, layer, n_heads, T, window):
    """[head, q_pos, k_pos] by loops: causal, the layer's ``window`` (None: global) and the streaming of
    query head h's group (``h * G // n_heads``)."""
    G = policy.n_kv_groups
    m = torch.zeros(n_heads, T, T, dtype=torch.bool)
    for h in range(n_heads):
        s = policy.groups[layer][h * G // n_heads]
        for i in range(T):
            for j in range(i + 1):
                ok = s is None or j < s.sink or i - j < s.window
                m[h, i, j] = ok and (window is None or i - j < window)
    return m


def _reference_logits(model, policy, tokens):
    """The unmodified model with every layer's scores masked by the hand-built mask (eager path)."""
    T = tokens.shape[1]

    def hook(layer):
        mask = _hand_mask(policy, layer, model.blocks[layer].attn.n_heads, T, model.blocks[layer].attn.window)
        return lambda scores, hook: scores.masked_fill(~mask, float("-inf"))

    hooks = [(f"blocks.{layer}.attn.hook_attn_scores", hook(layer)) for layer in range(model.cfg.n_layers)]
    with torch.no_grad():
        return model.run_with_hooks(tokens, fwd_hooks=hooks)


def _tokens(T=20, batch=2, seed=1):
    return torch.randint(0, zoo.VOCAB - 1, (batch, T), generator=torch.Generator().manual_seed(seed))


def test_policy_equals_hand_built_mask(net, monkeypatch):
    name, model = net
    policy = _policy(model)
    x = _tokens()
    want = _reference_logits(model, policy, x)
    monkeypatch.setattr(attention_mod, "STREAMING_MASK_ENTRIES", 7 * 4 * 20)  # several query blocks
    with torch.no_grad(), model.kv_policy(policy):
        got = model(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        full = model(x)
    assert (got - full).abs().max() > 1e-3, "the policy must change something at 20 tokens (window 3)"
    assert all(b.attn.streaming is None for b in model.blocks)  # restored


def test_a_wrong_mask_is_caught(net):
    """The comparison can fail: a window one key wider is not the policy."""
    name, model = net
    policy = _policy(model)
    wider = KVPolicy(
        tuple(tuple(None if s is None else Streaming(s.sink, s.window + 1) for s in row) for row in policy.groups)
    )
    x = _tokens()
    with torch.no_grad(), model.kv_policy(wider):
        got = model(x)
    assert (got - _reference_logits(model, policy, x)).abs().max() > 1e-4


def test_streaming_cache_equals_recomputation_and_budget(net):
    name, model = net
    policy = _policy(model)
    prompt = _tokens(T=9, batch=2)
    cached, cache = generate(model, prompt, 8, use_cache=True, policy=policy)
    plain, _ = generate(model, prompt, 8, use_cache=False, policy=policy)
    assert torch.equal(cached, plain)
    with torch.no_grad():
        c2 = model.streaming_cache(policy)
        steps = [model(cached[:, :9], cache=c2)] + [model(cached[:, i : i + 1], cache=c2) for i in range(9, 17)]
        with model.kv_policy(policy):
            torch.testing.assert_close(torch.cat(steps, 1), model(cached[:, :17]), atol=1e-5, rtol=1e-5)
    layout = dataclasses.replace(model.cfg.layout, bytes_per_element=4)
    n = cache.n_tokens
    assert n == 9 + 8 - 1
    assert cache.nbytes == cost.policy_cost(layout, policy, n, batch=2).kv_bytes
    assert cache.nbytes < cost.kv_bytes_per_request(layout, n, batch=2)  # streaming groups evicted keys


def test_policy_refusals(tiny_tokenizer):
    mistral = wrap(zoo.make_checkpoint("mistral", tiny_tokenizer), backend="native").model
    with pytest.raises(HeadprobeError, match="the model has 2 x 2"):
        mistral.check_kv_policy(KVPolicy.uniform(3, 2))
    llama = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native").model
    with pytest.raises(HeadprobeError, match="padding"), llama.kv_policy(KVPolicy.uniform(2, 2, Streaming(1, 2))):
        llama(_tokens(), attention_mask=torch.ones(2, 20))
