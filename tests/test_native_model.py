"""The native transformer against independent references.

The lesson's checks (head layout, loop over heads, causality, ``nn.MultiheadAttention``,
parameter count, the W_O decomposition, MHA/GQA/MQA), the two attention paths against each
other, and logits against Hugging Face's GPT-2 and Llama (random small configs, and the real
SmolLM2-135M weights), and patterns/results against TransformerLens' TransformerBridge.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from headprobe.probe.backends.loading import LoadedModel, load_model
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.ablation import head_ablation_hooks
from headprobe.probe.hooks.capture import capture_heads
from headprobe.probe.model.attention import Attention, merge_heads, split_heads
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.convert import from_hf, spec_from_native
from headprobe.probe.model.transformer import Transformer

ATOL = 1e-5


def small_cfg(n_heads=4, n_kv_heads=None, **kw) -> TransformerConfig:
    base = dict(n_layers=2, d_model=32, n_heads=n_heads, n_kv_heads=n_kv_heads, d_vocab=101, n_ctx=64)
    return TransformerConfig(**{**base, **kw})


LLAMA_LIKE = dict(positional="rotary", norm="rmsnorm", mlp="swiglu", bias=False, rope_theta=1e5)
ARCHS = {
    "gpt2-mha": {},
    "llama-mha": LLAMA_LIKE,
    "llama-gqa": {**LLAMA_LIKE, "n_kv_heads": 2},
    "llama-mqa": {**LLAMA_LIKE, "n_kv_heads": 1},
    "attn-only-gqa": {"mlp": None, "n_kv_heads": 2},
}


def seeded_model(cfg: TransformerConfig, seed: int = 0, std: float = 0.3) -> Transformer:
    """Random weights large enough that patterns are far from uniform."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, std)
    return model.eval()


def tokens(batch=2, pos=12, d_vocab=101, seed=1):
    return torch.randint(0, d_vocab, (batch, pos), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------
# Independent references: written from the formulas, sharing no code with headprobe.probe.model.transformer.
# ------------------------------------------------------------------------------------------


def reference_loop_over_heads(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    """Attention as a Python loop over query heads, K/V copied per head (h reads kv h // group)."""
    cfg = attn.cfg
    B, T, _ = x.shape
    dh, G = cfg.d_head, cfg.n_heads // cfg.n_kv_heads
    Wq, Wk, Wv, Wo = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight
    bias = lambda lin, rows: 0 if lin.bias is None else lin.bias[rows]
    causal = torch.ones(T, T).tril().bool()
    out = torch.zeros(B, T, cfg.d_model)
    for h in range(cfg.n_heads):
        qr, kvr = slice(h * dh, (h + 1) * dh), slice((h // G) * dh, (h // G + 1) * dh)
        q = x @ Wq[qr].T + bias(attn.q_proj, qr)
        k = x @ Wk[kvr].T + bias(attn.k_proj, kvr)
        v = x @ Wv[kvr].T + bias(attn.v_proj, kvr)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
        pattern = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out = out + (pattern @ v) @ Wo[:, qr].T  # z_h W_O^(h)
    return out + (0 if attn.o_proj.bias is None else attn.o_proj.bias)


def reference_mqa(x, Wq, Wk, Wv, Wo, n_heads):
    """Multi-query attention as in Shazeer 2019: one K and one V broadcast to every query head."""
    B, T, D = x.shape
    dh = D // n_heads
    q = (x @ Wq.T).view(B, T, n_heads, dh).transpose(1, 2)  # [B, H, T, dh]
    k = (x @ Wk.T)[:, None]  # [B, 1, T, dh]
    v = (x @ Wv.T)[:, None]
    pattern = (
        (q @ k.transpose(-1, -2) / math.sqrt(dh))
        .masked_fill(~torch.ones(T, T).tril().bool(), float("-inf"))
        .softmax(-1)
    )
    return (pattern @ v).transpose(1, 2).reshape(B, T, D) @ Wo.T


def both_paths(attn_or_model, *args, **kw):
    """Output with the fused (SDPA) path and with the eager path."""
    attn_or_model.force_eager = False
    fused = attn_or_model(*args, **kw)
    attn_or_model.force_eager = True
    eager = attn_or_model(*args, **kw)
    attn_or_model.force_eager = False
    return fused, eager


def attention_module(cfg: TransformerConfig, seed=0) -> Attention:
    torch.manual_seed(seed)
    return Attention(cfg).eval()


def positions(B, T):
    return torch.arange(T).expand(B, T)


# ------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------


def test_config_rejects_d_model_not_multiple_of_n_heads():
    with pytest.raises(HeadprobeError, match=r"d_model=30 .*n_heads=4"):
        TransformerConfig(n_layers=1, d_model=30, n_heads=4, d_vocab=10)


def test_config_rejects_n_heads_not_multiple_of_n_kv_heads():
    with pytest.raises(HeadprobeError, match=r"n_heads=4 .*n_kv_heads=3"):
        TransformerConfig(n_layers=1, d_model=32, n_heads=4, n_kv_heads=3, d_vocab=10)


def test_config_is_frozen_and_derives_sizes():
    cfg = small_cfg(n_heads=4, n_kv_heads=2)
    assert (cfg.d_head, cfg.group_size, cfg.d_mlp) == (8, 2, 128)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.n_heads = 8  # type: ignore[misc]


# ------------------------------------------------------------------------------------------
# The lesson's checks
# ------------------------------------------------------------------------------------------


def test_split_merge_round_trip_and_head_layout():
    B, T, H, dh = 2, 3, 4, 5
    x = torch.arange(B * T * H * dh, dtype=torch.float32).view(B, T, H * dh)
    heads = split_heads(x, H)
    assert heads.shape == (B, H, T, dh)
    for h in range(H):  # head h holds columns h*d_head:(h+1)*d_head of every token
        assert torch.equal(heads[:, h], x[:, :, h * dh : (h + 1) * dh])
    assert torch.equal(merge_heads(heads), x)
    assert not torch.equal(x.reshape(B, H, T, dh), heads)  # the wrong split really differs


def test_model_head_layout_at_hook_q():
    """In the model: with W_Q = identity, hook_q's head h is columns h*d_head:(h+1)*d_head of x."""
    cfg = small_cfg(n_layers=1, bias=False)
    attn = attention_module(cfg)
    with torch.no_grad():
        attn.q_proj.weight.copy_(torch.eye(cfg.d_model))
    x = torch.randn(2, 6, cfg.d_model)
    seen = {}
    attn.hook_q.add_hook(lambda q, hook: seen.setdefault("q", q))
    attn(x, positions(2, 6))
    attn.hook_q.remove_hooks()
    for h in range(cfg.n_heads):
        assert torch.equal(seen["q"][:, :, h], x[..., h * cfg.d_head : (h + 1) * cfg.d_head])


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
@pytest.mark.parametrize("bias", [False, True])
def test_multi_head_output_equals_loop_over_heads(n_kv_heads, bias):
    attn = attention_module(small_cfg(n_kv_heads=n_kv_heads, bias=bias))
    x = torch.randn(2, 9, 32)
    ref = reference_loop_over_heads(attn, x)
    with torch.no_grad():
        fused, eager = both_paths(attn, x, positions(2, 9))
    torch.testing.assert_close(eager, ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(fused, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_causality_future_token_changes_no_earlier_output(arch):
    model = seeded_model(small_cfg(**ARCHS[arch]))
    a = tokens(pos=12)
    b = a.clone()
    b[:, 7] = (b[:, 7] + 1) % 101
    with torch.no_grad():
        for eager in (False, True):
            model.force_eager = eager
            la, lb = model(a), model(b)
            assert torch.equal(la[:, :7], lb[:, :7])
            assert not torch.allclose(la[:, 7:], lb[:, 7:])
    model.force_eager = False


def test_equals_torch_multihead_attention_with_same_weights():
    cfg = small_cfg(n_heads=8, bias=False)
    attn = attention_module(cfg)
    ref = nn.MultiheadAttention(cfg.d_model, cfg.n_heads, bias=False, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
        ref.out_proj.weight.copy_(attn.o_proj.weight)
    x = torch.randn(2, 10, cfg.d_model)
    future = torch.ones(10, 10, dtype=torch.bool).triu(1)  # True = forbidden, torch's convention
    with torch.no_grad():
        y_ref, _ = ref(x, x, x, attn_mask=future, need_weights=False)
        fused, eager = both_paths(attn, x, positions(2, 10))
    torch.testing.assert_close(fused, y_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(eager, y_ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("n_heads", [1, 2, 4, 8, 16])
def test_attention_parameter_count_is_4_d_model_squared(n_heads):
    cfg = TransformerConfig(n_layers=1, d_model=64, n_heads=n_heads, d_vocab=10, bias=False)
    assert sum(p.numel() for p in Attention(cfg).parameters()) == 4 * 64**2


def test_gqa_parameter_count():
    cfg = TransformerConfig(n_layers=1, d_model=64, n_heads=8, n_kv_heads=2, d_vocab=10, bias=False)
    assert sum(p.numel() for p in Attention(cfg).parameters()) == 2 * 64**2 + 2 * 64 * (2 * 8)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_concat_heads_W_O_equals_sum_of_head_results(arch):
    """Concat(z) W_O + b_O == sum_h z_h W_O^(h) + b_O; hook_result sums to hook_attn_out - b_O."""
    model = seeded_model(small_cfg(**ARCHS[arch]))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens())
    for layer, block in enumerate(model.blocks):
        attn = block.attn
        assert attn.W_O.shape == (4, 8, 32)
        assert attn.W_O.data_ptr() == attn.o_proj.weight.data_ptr()  # a view, not a copy
        result = cache[f"blocks.{layer}.attn.hook_result"]
        attn_out = cache[f"blocks.{layer}.hook_attn_out"]
        b_O = 0 if attn.b_O is None else attn.b_O
        torch.testing.assert_close(result.sum(dim=2), attn_out - b_O, atol=ATOL, rtol=0)
        z = cache[f"blocks.{layer}.attn.hook_z"]
        concat = attn.o_proj(z.flatten(2))  # Concat(heads) W_O + b_O, the fused projection
        torch.testing.assert_close(concat, attn_out, atol=ATOL, rtol=0)


def test_gqa_with_n_kv_heads_equal_n_heads_is_mha():
    """The same weights through an MHA config and a GQA config with n_kv_heads == n_heads."""
    mha = attention_module(small_cfg(bias=False))
    gqa = Attention(small_cfg(n_kv_heads=4, bias=False)).eval()
    gqa.load_state_dict(mha.state_dict())
    ref = nn.MultiheadAttention(32, 4, bias=False, batch_first=True)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([mha.q_proj.weight, mha.k_proj.weight, mha.v_proj.weight]))
        ref.out_proj.weight.copy_(mha.o_proj.weight)
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        y_ref, _ = ref(x, x, x, attn_mask=torch.ones(7, 7, dtype=torch.bool).triu(1), need_weights=False)
        for out in both_paths(gqa, x, positions(2, 7)):
            torch.testing.assert_close(out, y_ref, atol=ATOL, rtol=0)


def test_n_kv_heads_1_is_mqa():
    attn = attention_module(small_cfg(n_kv_heads=1, bias=False))
    assert attn.k_proj.weight.shape == (8, 32)  # one key head of width d_head
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        ref = reference_mqa(x, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight, 4)
        for out in both_paths(attn, x, positions(2, 7)):
            torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------------------
# Eager and fused paths, hooks, head mask, padding
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", list(ARCHS))
def test_eager_equals_sdpa(arch):
    model = seeded_model(small_cfg(**ARCHS[arch]))
    with torch.no_grad():
        fused, eager = both_paths(model, tokens(pos=20))
    torch.testing.assert_close(fused, eager, atol=ATOL, rtol=0)


def test_pattern_hook_switches_to_eager_path_and_sums_to_one():
    model = seeded_model(small_cfg(**ARCHS["llama-gqa"]))
    fired = []
    with torch.no_grad(), model.hooks(fwd_hooks=[("blocks.1.attn.hook_pattern", lambda p, hook: fired.append(p))]):
        model(tokens())
    assert len(fired) == 1
    pattern = fired[0]
    assert pattern.shape == (2, 4, 12, 12)
    torch.testing.assert_close(pattern.sum(-1), torch.ones(2, 4, 12))
    assert torch.all(pattern.triu(1) == 0)
    assert not model.blocks[1].attn.needs_pattern()  # hooks removed on exit
    with torch.no_grad():
        model(tokens())
    assert len(fired) == 1


def test_kv_hooks_carry_kv_head():
    model = seeded_model(small_cfg(**ARCHS["llama-gqa"]))
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens())
    assert cache["blocks.0.attn.hook_k"].shape == (2, 12, 2, 8)
    assert cache["blocks.0.attn.hook_v"].shape == (2, 12, 2, 8)
    assert cache["blocks.0.attn.hook_q"].shape == (2, 12, 4, 8)
    assert cache["blocks.0.attn.hook_z"].shape == (2, 12, 4, 8)
    assert cache["blocks.0.attn.hook_result"].shape == (2, 12, 4, 32)
    assert cache["blocks.0.attn.hook_pattern"].shape == (2, 4, 12, 12)


def test_head_mask_zero_equals_zero_ablation_at_hook_z():
    model = seeded_model(small_cfg(**ARCHS["gpt2-mha"]))
    t = tokens()
    mask = torch.ones(2, 4)
    mask[0, 1] = mask[1, 3] = 0
    with torch.no_grad():
        masked = model(t, head_mask=mask)
        ablated = model.run_with_hooks(t, fwd_hooks=head_ablation_hooks([(0, 1), (1, 3)], "zero"))
        plain = model(t)
    torch.testing.assert_close(masked, ablated, atol=ATOL, rtol=0)
    assert not torch.allclose(masked, plain)


def test_batched_head_mask_equals_one_mask_per_run():
    model = seeded_model(small_cfg(**ARCHS["llama-gqa"]))
    t = tokens(batch=1).expand(3, -1)
    masks = torch.ones(3, 2, 4)
    masks[1, 0, 2] = 0
    masks[2, 1, 0] = 0.5
    with torch.no_grad():
        batched = model(t, head_mask=masks)
        for i in range(3):
            torch.testing.assert_close(batched[i : i + 1], model(t[:1], head_mask=masks[i]), atol=ATOL, rtol=0)


def test_head_mask_gradient_is_importance_signal():
    model = seeded_model(small_cfg(**ARCHS["gpt2-mha"]))
    xi = torch.ones(2, 4, requires_grad=True)
    t = tokens()
    logits = model(t, head_mask=xi)
    F.cross_entropy(logits[:, :-1].flatten(0, 1), t[:, 1:].flatten()).backward()
    assert xi.grad is not None and xi.grad.shape == (2, 4) and xi.grad.abs().sum() > 0


def test_head_mask_wrong_shape_raises():
    model = seeded_model(small_cfg())
    with pytest.raises(HeadprobeError, match="head_mask has shape"):
        model(tokens(), head_mask=torch.ones(4))


@pytest.mark.parametrize("arch", ["gpt2-mha", "llama-gqa"])
def test_left_padding_matches_unpadded(arch):
    model = seeded_model(small_cfg(**ARCHS[arch]))
    t = tokens(batch=1, pos=8)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), t], dim=1)
    mask = torch.cat([torch.zeros(1, 3), torch.ones(1, 8)], dim=1).long()
    with torch.no_grad():
        ref = model(t)
        for out in both_paths(model, padded, attention_mask=mask):
            torch.testing.assert_close(out[:, 3:], ref, atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------
# Hugging Face equivalence
# ------------------------------------------------------------------------------------------


def _scale_weights(hf_model, seed=0, std=0.2):
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if "norm" in name or "ln_" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p)) if p.dim() == 1 and "bias" not in name else p.normal_(0, 0.1)
            else:
                p.normal_(0, std)
    return hf_model.eval()


def random_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_head=4, n_embd=32, vocab_size=101, n_positions=64, bos_token_id=100, eos_token_id=100)
    return _scale_weights(GPT2LMHeadModel(cfg).eval())


def random_llama(tied: bool):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=64,
        rope_theta=1e5,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return _scale_weights(LlamaForCausalLM(cfg).eval())


def test_gpt2_logits_equal_hugging_face():
    hf = random_gpt2()
    model = from_hf(hf)
    t = tokens(pos=20)
    with torch.no_grad():
        ref = hf(t).logits
        assert ref.std() > 0.5  # not a near-constant output that would match anything
        for out in both_paths(model, t):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_llama_gqa_logits_equal_hugging_face(tied):
    hf = random_llama(tied)
    model = from_hf(hf)
    assert model.cfg.n_kv_heads == 2 and model.cfg.rope_theta == 1e5
    t = tokens(pos=20)
    with torch.no_grad():
        ref = hf(t).logits
        assert ref.std() > 0.5
        for out in both_paths(model, t):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_rotary_theta_matters():
    """A wrong rope_theta must break equality (the test above would catch a RoPE mistake)."""
    hf = random_llama(False)
    model = from_hf(hf)
    wrong = Transformer(TransformerConfig(**{**model.cfg.__dict__, "rope_theta": 1e4})).eval()
    wrong.load_state_dict(model.state_dict())
    t = tokens(pos=20)
    with torch.no_grad():
        assert (wrong(t) - hf(t).logits).abs().max() > 1e-3


def test_unsupported_architecture_raises():
    from transformers import BertConfig, ElectraConfig

    from headprobe.probe.model.convert import config_from_hf

    with pytest.raises(HeadprobeError, match="native backend supports"):
        config_from_hf(ElectraConfig())  # BERT is supported since the encoder work; ELECTRA is not
    with pytest.raises(HeadprobeError, match="absolute positions"):
        config_from_hf(BertConfig(position_embedding_type="relative_key"))


@pytest.mark.real_model
def test_smollm2_logits_equal_hugging_face(smollm2_hf):
    hf, tokenizer = smollm2_hf
    model = from_hf(hf)
    assert (model.cfg.n_layers, model.cfg.n_heads, model.cfg.n_kv_heads, model.cfg.d_head) == (30, 9, 3, 64)
    text = ["The cat sat on the mat because it was warm and the", "def fibonacci(n):\n    if n < 2:\n        return n"]
    ids = [tokenizer(s, add_special_tokens=False)["input_ids"][:15] for s in text]
    t = torch.tensor([[tokenizer.bos_token_id or 1, *i] + [0] * (15 - len(i)) for i in ids])[:, :16]
    with torch.no_grad():
        ref = hf(t).logits
        for out in both_paths(model, t):
            torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)
        # patterns on the eager path equal Hugging Face's attention weights
        hf_attn = hf(t, output_attentions=True).attentions
        _, cache = model.run_with_cache(t, names_filter=lambda n: n.endswith("hook_pattern"))
    for layer in (0, 15, 29):
        torch.testing.assert_close(cache[f"blocks.{layer}.attn.hook_pattern"], hf_attn[layer], atol=1e-5, rtol=0)


# ------------------------------------------------------------------------------------------
# TransformerLens' TransformerBridge on the same weights
# ------------------------------------------------------------------------------------------


def tiny_tokenizer(tmp_path, d_vocab=101):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(d_vocab - 1)} | {"<|endoftext|>": d_vocab - 1}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "tok")
    return AutoTokenizer.from_pretrained(tmp_path / "tok")


def test_patterns_and_results_equal_transformer_bridge(tmp_path):
    from headprobe.probe.backends.loading import boot_bridge, spec_from_bridge
    from headprobe.probe.layout.attention import attention_bias

    hf = random_gpt2()
    native = from_hf(hf)
    tokenizer = tiny_tokenizer(tmp_path)
    bias = attention_bias(hf)  # read before the bridge rewires the model
    bridge = boot_bridge("gpt2", hf, tokenizer)
    tl = LoadedModel(bridge, tokenizer, spec_from_bridge("tiny", "gpt2", "float32", bridge, bias))
    ours = LoadedModel(native, tokenizer, spec_from_native("tiny", "gpt2", "float32", native.cfg))
    assert (ours.spec.backend, tl.spec.backend) == ("native", "transformer-lens")
    assert ours.spec == dataclasses.replace(tl.spec, backend="native")  # the same layout read two ways
    t = tokens(pos=16, d_vocab=100)
    theirs_out, ours_out = capture_heads(tl, t), capture_heads(ours, t)
    for kind in ("pattern", "z", "result", "attn_out"):
        for layer in range(2):
            torch.testing.assert_close(ours_out[kind][layer], theirs_out[kind][layer], atol=1e-5, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward(t), tl.forward(t), atol=1e-4, rtol=0)


def test_load_native_from_local_directory(tmp_path):
    """load_model(backend="native") resolves a local Hugging Face directory as load_model does and wraps the native model."""
    hf = random_gpt2()
    tokenizer = tiny_tokenizer(tmp_path)
    hf.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    loaded = load_model(str(tmp_path / "model"), backend="native")
    assert isinstance(loaded.model, Transformer)
    assert (loaded.spec.n_layers, loaded.spec.n_heads, loaded.spec.n_kv_heads, loaded.spec.kind) == (2, 4, 4, "MHA")
    assert loaded.spec.backend == "native" and loaded.spec.precision.endswith("; native backend")
    t = tokens(pos=10, d_vocab=100)
    with torch.no_grad():
        torch.testing.assert_close(loaded.forward(t), hf(t).logits, atol=1e-4, rtol=0)
    assert loaded.to_tokens("w3 w5")[0, 0].item() == tokenizer.bos_token_id
    assert loaded.W_O(1).shape == (4, 8, 32)


def test_load_native_missing_path_raises(tmp_path):
    with pytest.raises(HeadprobeError, match="does not exist"):
        load_model(str(tmp_path / "nope"), backend="native")


def test_from_state_dict_equals_loading_into_an_initialised_model():
    """Transformer.from_state_dict (meta-device build, tensors assigned) gives the model that
    load_state_dict into a normally built one gives: same outputs, same parameter count (a tied
    unembedding stays one parameter), rotary frequencies computed, nothing left on the meta device."""
    from headprobe.probe.model.config import TransformerConfig
    from headprobe.probe.model.transformer import Transformer

    for cfg in (
        TransformerConfig(
            n_layers=2,
            d_model=32,
            n_heads=4,
            d_vocab=50,
            n_ctx=16,
            positional="rotary",
            norm="rmsnorm",
            mlp="swiglu",
            bias=False,
            n_kv_heads=2,
        ),
        TransformerConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=50, n_ctx=16, tied_unembed=False),
    ):
        torch.manual_seed(0)
        ref = Transformer(cfg).eval()
        state = {k: v.clone() for k, v in ref.state_dict().items()}
        built = Transformer.from_state_dict(cfg, state)
        tokens = torch.randint(0, 50, (2, 16))
        assert torch.equal(built(tokens), ref(tokens))
        assert sum(p.numel() for p in built.parameters()) == sum(p.numel() for p in ref.parameters())
        assert (built.unembed.weight is built.embed.W_E.weight) == cfg.tied_unembed
        assert not any(t.is_meta for t in [*built.parameters(), *built.buffers()])


# ------------------------------------------------------------------------------------------
# One mask for every path, one attention class per mechanism
# ------------------------------------------------------------------------------------------


def reference_key_mask(n_queries, n_keys, causal=True, window=None, padding=None, batch=1):
    """``[batch, 1, q_pos, k_pos]``, entry by entry from the definitions: the queries are the last
    ``n_queries`` of ``n_keys`` positions; causal: key ``j <= p``; window: ``j > p - window``;
    padding: real keys only, a causal query reading itself regardless."""
    batch = batch if padding is None else padding.shape[0]
    out = torch.zeros(batch, 1, n_queries, n_keys, dtype=torch.bool)
    for b in range(batch):
        for i in range(n_queries):
            p = n_keys - n_queries + i
            for j in range(n_keys):
                ok = (not causal or j <= p) and (window is None or j > p - window)
                ok = ok and (padding is None or bool(padding[b, j]))
                out[b, 0, i, j] = ok or (causal and padding is not None and j == p)
    return out


_PADDING = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 1, 1]], dtype=torch.bool)


@pytest.mark.parametrize(
    "n_queries, n_keys, window, padding",
    [
        (6, 6, None, None),
        (6, 6, 3, None),
        (2, 9, None, None),
        (3, 9, 4, None),
        (1, 7, 1, None),
        (6, 6, None, _PADDING),
        (6, 6, 2, _PADDING),
    ],
)
def test_key_mask_against_the_definitions(n_queries, n_keys, window, padding):
    from headprobe.probe.model.masks import key_mask

    got = key_mask(n_queries, n_keys, torch.device("cpu"), window=window, padding=padding)
    want = reference_key_mask(n_queries, n_keys, window=window, padding=padding)
    assert torch.equal(torch.broadcast_to(got, want.shape), want)
    implicit = key_mask(n_queries, n_keys, torch.device("cpu"), window=window, padding=padding, implicit=True)
    # None only where SDPA's own is_causal is the same mask: square, no window, no padding
    assert (implicit is None) == (n_queries == n_keys and window is None and padding is None)
    for pad in (None, _PADDING):
        got = key_mask(6, 6, torch.device("cpu"), causal=False, padding=pad)
        want = reference_key_mask(6, 6, causal=False, padding=pad)
        assert got is None if pad is None else torch.equal(torch.broadcast_to(got, want.shape), want)


def _mask_cases():
    """(name, model, run) for every way a mask arises: fused and eager, padding, a KV cache,
    sliding windows, MLA and a pruned model; ``run(model)`` returns logits."""
    from headprobe.probe.model.cache import KVCache
    from headprobe.probe.model.pruned import keep_mask_from, remove_heads

    x = tokens(batch=3, pos=6, seed=3)
    cached = lambda m: torch.cat([m(x[:, :4], cache=(c := KVCache())), m(x[:, 4:], cache=c)], dim=1)
    padded = lambda m: m(x, attention_mask=_PADDING.long())
    gqa = seeded_model(small_cfg(n_kv_heads=2, **LLAMA_LIKE, sliding_window=3, sliding_layers=(0,)))
    mla = seeded_model(small_cfg(bias=False, kv_lora_rank=8, qk_rope_head_dim=4, positional="rotary"), std=0.2)
    pruned = remove_heads(gqa, keep_mask_from([(0, 1), (1, 3)], 2, 4))
    encoder = seeded_model(small_cfg(causal=False, pre_norm=False, post_ln=True, embed_norm=True))
    for eager in (False, True):
        for name, model, run in (
            ("plain", gqa, lambda m: m(x)),
            ("padded", gqa, padded),
            ("cached", gqa, cached),
            ("mla", mla, lambda m: m(x)),
            ("mla-cached", mla, cached),
            ("pruned", pruned, padded),
            ("encoder", encoder, padded),
        ):
            yield f"{name}-{'eager' if eager else 'fused'}", model, run, eager


def test_every_path_masks_through_key_mask(monkeypatch):
    """Each attention path takes its mask from ``key_mask`` alone: with the function replaced by
    the reference above the logits are unchanged, with a mask that reads every key they change."""
    import headprobe.probe.model.attention as attention_module
    import headprobe.probe.model.masks as masks_module

    real = masks_module.key_mask

    def reference(n_queries, n_keys, device, *, causal=True, window=None, padding=None, implicit=False, chunk=None):
        assert chunk is None  # no chunked model among the cases (chunks: tests/test_native_families.py)
        return reference_key_mask(n_queries, n_keys, causal, window, padding)

    def everything(n_queries, n_keys, device, **kw):
        return torch.ones(n_queries, n_keys, dtype=torch.bool)

    for name, model, run, eager in _mask_cases():
        model.force_eager = eager
        outputs = {}
        with torch.no_grad():
            for label, fn in (("real", real), ("reference", reference), ("everything", everything)):
                for module in (attention_module, masks_module):  # attend's mask, and with_sink_key's
                    monkeypatch.setattr(module, "key_mask", fn)
                outputs[label] = run(model)
        for module in (attention_module, masks_module):
            monkeypatch.setattr(module, "key_mask", real)
        model.force_eager = False
        torch.testing.assert_close(outputs["reference"], outputs["real"], atol=ATOL, rtol=0, msg=name)
        if not name.startswith("encoder"):  # an encoder without padding reads every key anyway
            assert (outputs["everything"] - outputs["real"]).abs().max() > 1e-3, name


def test_mla_is_an_attention_class_of_its_own():
    """MLA layers are LatentAttention (latent projections only), the others Attention (q/k/v
    projections only); both are SelfAttention, and neither accepts the other's config."""
    from headprobe.probe.model.attention import SelfAttention
    from headprobe.probe.model.latent_attention import LatentAttention

    mla_cfg = small_cfg(bias=False, kv_lora_rank=8, qk_rope_head_dim=4, positional="rotary")
    for cfg, cls, has, lacks in (
        (mla_cfg, LatentAttention, "kv_up", "k_proj"),
        (small_cfg(), Attention, "k_proj", "kv_up"),
    ):
        for block in Transformer(cfg).blocks:
            assert type(block.attn) is cls and isinstance(block.attn, SelfAttention)
            assert hasattr(block.attn, has) and not hasattr(block.attn, lacks)
    with pytest.raises(HeadprobeError, match="LatentAttention"):
        Attention(mla_cfg)
    with pytest.raises(HeadprobeError, match="MLA config"):
        LatentAttention(small_cfg())


@pytest.mark.parametrize("change", [{}, dict(sliding_window=5, sliding_layers=(0,))], ids=["full", "layer 0 slides"])
def test_learned_sinks_fused_path_equals_eager(tiny_llama_gqa_native, change):
    """With learned sinks the fused kernel (the sink as one more key) gives the eager path's logits
    (softmax over [scores, sink], sink column dropped): unpadded, left-padded, generating with a KV
    cache, and under a KV policy (streaming KV group 0 of layer 1, the learned sink kept); and the sinks
    change the model (a copy without them differs)."""
    import zoo

    from headprobe.probe.layout.attention import KVPolicy, Streaming
    from headprobe.probe.model.transformer import generate

    net = zoo.with_sinks(tiny_llama_gqa_native, scale=2.0, **change).model
    tokens = torch.randint(0, 100, (2, 14), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 14, dtype=torch.long)
    mask[0, :4] = 0
    policy = KVPolicy(((None, None), (Streaming(1, 4), None)))

    def both(**kw):
        with torch.no_grad():
            fused = net(tokens, **kw)
            net.force_eager = True
            try:
                eager = net(tokens, **kw)
            finally:
                net.force_eager = False
        return fused, eager

    for kw in ({}, dict(attention_mask=mask)):
        fused, eager = both(**kw)
        torch.testing.assert_close(fused[:, 4:], eager[:, 4:], atol=1e-5, rtol=1e-5)
    with net.kv_policy(policy):
        fused, eager = both()
    torch.testing.assert_close(fused, eager, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fused, both()[0], atol=1e-3)  # the policy changes the model
    cached, _ = generate(net, tokens[:, :6], 6, use_cache=True)
    recomputed, _ = generate(net, tokens[:, :6], 6, use_cache=False)
    assert torch.equal(cached, recomputed)
    if not change:
        with torch.no_grad():
            assert not torch.allclose(net(tokens), tiny_llama_gqa_native.model(tokens), atol=1e-3)
