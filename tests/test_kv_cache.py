"""KV-cache generation (issue 7): cached greedy decoding equals recomputing the whole sequence,
and the cache's measured size equals probe.cost's KV-cache formula, for MHA, GQA and MQA."""

from __future__ import annotations

import pytest
import torch

from probe.cost import AttentionLayout, kv_bytes_per_request, kv_bytes_per_token
from probe.errors import HeadprobeError
from probe.model import KVCache, Transformer, TransformerConfig, generate, init_weights


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("positional", ["learned", "rotary"])
def test_cached_generation_equals_recomputation(n_kv_heads, positional):
    torch.manual_seed(0)
    cfg = TransformerConfig(n_layers=2, d_model=32, n_heads=4, n_kv_heads=n_kv_heads, d_vocab=50, n_ctx=40,
                            positional=positional, mlp="gelu")
    model = init_weights(Transformer(cfg), std=0.2).eval()
    prompt = torch.randint(50, (3, 7))
    cached, cache = generate(model, prompt, 12, use_cache=True)
    plain, _ = generate(model, prompt, 12, use_cache=False)
    assert torch.equal(cached, plain)
    # logits of every position agree too: prompt + one token at a time vs one full pass
    with torch.inference_mode():
        cache2 = KVCache()
        steps = [model(cached[:, :7], cache=cache2)] + [model(cached[:, i:i + 1], cache=cache2) for i in range(7, 19)]
        torch.testing.assert_close(torch.cat(steps, dim=1), model(cached[:, :19]), atol=1e-5, rtol=1e-5)
    # the measured cache equals the calculator's formula (float32: 4 bytes per number)
    layout = AttentionLayout(d_model=32, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, bytes_per_element=4)
    assert cache.n_tokens == 7 + 12 - 1  # the last generated token was never fed back
    assert cache.nbytes == kv_bytes_per_request(layout, cache.n_tokens, batch=3)
    assert cache.nbytes == 3 * cache.n_tokens * kv_bytes_per_token(layout)
    assert cache.keys[0].shape == (3, n_kv_heads, cache.n_tokens, 8)


def test_cache_respects_n_ctx_and_padding():
    model = Transformer(TransformerConfig(n_layers=1, d_model=16, n_heads=2, d_vocab=10, n_ctx=8)).eval()
    cache = KVCache()
    with torch.no_grad():
        model(torch.zeros(1, 6, dtype=torch.long), cache=cache)
    with pytest.raises(HeadprobeError, match="n_ctx=8"):
        model(torch.zeros(1, 3, dtype=torch.long), cache=cache)
    with pytest.raises(HeadprobeError, match="attention_mask"):
        model(torch.zeros(1, 2, dtype=torch.long), attention_mask=torch.ones(1, 2), cache=KVCache())
