"""KV-cache generation: cached greedy decoding equals recomputing the whole sequence,
and the cache's measured size equals headprobe.probe.layout.cost's KV-cache formula, for MHA, GQA and MQA."""

from __future__ import annotations

import pytest
import torch

from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout.cost import AttentionLayout, kv_bytes_per_request, kv_bytes_per_token
from headprobe.probe.model.cache import KVCache
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.transformer import Transformer, generate, init_weights


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("positional", ["learned", "rotary"])
def test_cached_generation_equals_recomputation(n_kv_heads, positional):
    torch.manual_seed(0)
    cfg = TransformerConfig(
        n_layers=2,
        d_model=32,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        d_vocab=50,
        n_ctx=40,
        positional=positional,
        mlp="gelu",
    )
    model = init_weights(Transformer(cfg), std=0.2).eval()
    prompt = torch.randint(50, (3, 7))
    cached, cache = generate(model, prompt, 12, use_cache=True)
    plain, _ = generate(model, prompt, 12, use_cache=False)
    assert torch.equal(cached, plain)
    # logits of every position agree too: prompt + one token at a time vs one full pass
    with torch.inference_mode():
        cache2 = KVCache()
        steps = [model(cached[:, :7], cache=cache2)] + [model(cached[:, i : i + 1], cache=cache2) for i in range(7, 19)]
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


@pytest.mark.parametrize("rank, rope, positional", [(8, 4, "rotary"), (4, 0, "learned"), (16, 8, "rotary")])
def test_mla_params_cache_and_hooks(rank, rope, positional):
    """MLA (DeepSeek-V2): parameter count and KV cache per token equal headprobe.probe.layout.cost's formulas;
    cached generation equals recomputation; pattern, z and result hooks decompose the output."""
    torch.manual_seed(0)
    cfg = TransformerConfig(
        n_layers=2,
        d_model=32,
        n_heads=4,
        d_vocab=50,
        n_ctx=40,
        positional=positional,
        mlp=None,
        bias=False,
        kv_lora_rank=rank,
        qk_rope_head_dim=rope,
    )
    model = init_weights(Transformer(cfg), std=0.2).eval()
    layout = AttentionLayout(
        d_model=32, n_layers=2, n_heads=4, kv_lora_rank=rank, qk_rope_head_dim=rope or None, bytes_per_element=4
    )
    from headprobe.probe.layout.cost import attention_params_per_layer

    attn = model.blocks[0].attn
    assert sum(p.numel() for p in attn.parameters()) == attention_params_per_layer(layout)
    prompt = torch.randint(50, (2, 5))
    cached, cache = generate(model, prompt, 10, use_cache=True)
    plain, _ = generate(model, prompt, 10, use_cache=False)
    assert torch.equal(cached, plain)
    assert cache.nbytes == kv_bytes_per_request(layout, cache.n_tokens, batch=2)
    mha = AttentionLayout(d_model=32, n_layers=2, n_heads=4, bytes_per_element=4)
    assert kv_bytes_per_token(layout) < kv_bytes_per_token(mha)
    # hooks: the eager pattern path equals the fused path, and attn_out = sum_h result_h
    tokens = cached[:, :12]
    with torch.inference_mode():
        logits, c = model.run_with_cache(tokens)
        torch.testing.assert_close(logits, model(tokens), atol=1e-5, rtol=1e-5)
        for layer in range(2):
            p = c[f"blocks.{layer}.attn.hook_pattern"]
            assert p.shape == (2, 4, 12, 12)
            torch.testing.assert_close(p.sum(-1), torch.ones(2, 4, 12))
            assert (p.triu(1) == 0).all()
            result = torch.einsum("bphd,hdm->bphm", c[f"blocks.{layer}.attn.hook_z"], model.blocks[layer].attn.W_O)
            torch.testing.assert_close(result.sum(2), c[f"blocks.{layer}.hook_attn_out"], atol=1e-5, rtol=1e-5)


def test_mla_config_errors():
    with pytest.raises(HeadprobeError, match="n_kv_heads"):
        TransformerConfig(n_layers=1, d_model=16, n_heads=4, n_kv_heads=2, d_vocab=10, bias=False, kv_lora_rank=4)
    with pytest.raises(HeadprobeError, match="qk_rope_head_dim > 0"):
        TransformerConfig(
            n_layers=1, d_model=16, n_heads=4, d_vocab=10, bias=False, kv_lora_rank=4, positional="rotary"
        )
    with pytest.raises(HeadprobeError, match="kv_lora_rank too"):
        TransformerConfig(n_layers=1, d_model=16, n_heads=4, d_vocab=10, qk_rope_head_dim=4)
