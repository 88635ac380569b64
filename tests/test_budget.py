"""Tests of headprobe.probe.layout.cost and ``headprobe budget``.

Three kinds of check:

* the worked numbers of the lesson (shared/seeds/003_*: "Сколько это стоит", "FLOPs", "Память",
  "Мост к MQA, GQA и MLA") reproduced exactly;
* independent references: parameters counted on real torch / transformers attention modules,
  FLOPs counted by torch's FlopCounterMode on an explicit attention, KV-cache bytes measured on
  a tiny random Llama's own Hugging Face cache, attention-matrix bytes from a meta tensor;
* the CLI as a user runs it, bad input included (exit 2, one line, no traceback).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from headprobe.cli import main
from headprobe.commands import budget
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout import cost
from headprobe.probe.layout.cost import GIB, KIB, MIB, TIB, AttentionLayout

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# The lesson's numbers, exactly
# ---------------------------------------------------------------------------------------------


def test_gpt2_small_attention_params():
    gpt2 = cost.preset("gpt2-small")
    assert cost.attention_params_per_layer(replace(gpt2, bias="none")) == 4 * 768**2 == 2_359_296
    assert cost.attention_params_per_layer(gpt2) == 2_362_368  # + 3072 biases, as in the checkpoint


def test_original_transformer_attention_params():
    assert cost.attention_params_per_layer(cost.preset("transformer-base")) == 4 * 512**2 == 1_048_576


@pytest.mark.parametrize("n_heads", [1, 2, 4, 8, 16, 32, 64, 512])
def test_mha_params_do_not_depend_on_the_number_of_heads(n_heads):
    assert cost.attention_params_per_layer(AttentionLayout(d_model=512, n_layers=1, n_heads=n_heads)) == 1_048_576


def test_llama3_8b_kv_cache():
    llama = cost.preset("llama3-8b")
    assert llama.bytes_per_element == 2  # bf16
    assert cost.kv_numbers_per_token_per_layer(llama.as_mha()) == 2 * 32 * 128 == 8192
    assert cost.kv_bytes_per_token(llama.as_mha()) == 512 * KIB
    assert cost.kv_bytes_per_token(llama) == 128 * KIB  # 8 KV heads
    assert cost.kv_bytes_per_request(llama.as_mha(), 32 * 1024) == 16 * GIB
    assert cost.format_bytes(cost.kv_bytes_per_token(llama.as_mha())) == "512 KiB"
    assert cost.format_bytes(cost.kv_bytes_per_token(llama)) == "128 KiB"
    assert cost.format_bytes(cost.kv_bytes_per_request(llama.as_mha(), 32768)) == "16 GiB"


def test_llama3_8b_attention_matrix():
    llama = cost.preset("llama3-8b")
    assert cost.attention_matrix_bytes(llama, 8192) == 32 * 8192**2 * 2 == 4 * GIB
    assert cost.attention_matrix_bytes(llama, 131072) == 1 * TIB
    assert cost.format_bytes(cost.attention_matrix_bytes(llama, 8192)) == "4 GiB"
    assert cost.format_bytes(cost.attention_matrix_bytes(llama, 131072)) == "1 TiB"


# The lesson's table for D = 4096 counted as MHA: T, projections, scores + AV (TFLOP), share.
LESSON_FLOPS = [
    (1024, "0.14", "0.02", 11),
    (8192, "1.10", "1.10", 50),
    (32768, "4.40", "17.6", 80),
    (131072, "17.6", "281", 94),
]


@pytest.mark.parametrize("seq_len, proj, scores, share", LESSON_FLOPS)
def test_lesson_flops_table(seq_len, proj, scores, share):
    for lay in (AttentionLayout(d_model=4096, n_layers=32, n_heads=32), cost.preset("llama3-8b")):
        fl = cost.attention_flops(lay, seq_len, as_mha=True)
        assert fl.projections == 8 * seq_len * 4096**2
        assert fl.scores == 4 * seq_len**2 * 4096
        assert cost.format_tflop(fl.projections) == proj
        assert cost.format_tflop(fl.scores) == scores
        assert round(100 * fl.quadratic_share) == share


@pytest.mark.parametrize("d_model, n_heads", [(4096, 32), (768, 12), (512, 8), (576, 9)])
def test_crossover_is_2d_for_mha(d_model, n_heads):
    lay = AttentionLayout(d_model=d_model, n_layers=1, n_heads=n_heads)
    fl = cost.attention_flops(lay, 2 * d_model)
    assert fl.crossover_seq_len == 2 * d_model
    assert fl.projections == fl.scores and fl.quadratic_share == 0.5


def test_gqa_reduces_projection_flops_only():
    llama = cost.preset("llama3-8b")
    mha = cost.attention_flops(llama, 8192, as_mha=True)
    gqa = cost.attention_flops(llama, 8192)
    assert gqa.scores == mha.scores
    # W_K and W_V are 4x smaller: 2 + 2/4 of the 4 D x D matrices' FLOPs
    assert gqa.projections == 2 * 8192 * (2 * 4096**2 + 2 * 4096 * 1024)
    assert gqa.quadratic_share > mha.quadratic_share
    assert gqa.crossover_seq_len < 2 * 4096


def test_deepseek_v3_mla_kv_cache():
    ds = cost.preset("deepseek-v3")
    assert cost.kv_numbers_per_token_per_layer(ds) == 512 + 64
    # the lesson's MHA "of the same width": 128 heads of 128-wide keys and values
    lesson_mha = AttentionLayout(d_model=7168, n_layers=61, n_heads=128, d_head=128)
    assert cost.kv_numbers_per_token_per_layer(lesson_mha) == 2 * 128 * 128 == 32768
    ratio = cost.kv_numbers_per_token_per_layer(lesson_mha) / cost.kv_numbers_per_token_per_layer(ds)
    assert round(ratio) == 57  # "почти в 57 раз больше"
    # MHA of DeepSeek-V3's own heads: keys 128 + 64 = 192 wide, values 128
    assert cost.kv_numbers_per_token_per_layer(ds.as_mha()) == 128 * (192 + 128) == 40960
    # MLA's cache does not grow with the number of heads: Kimi K2 has half the heads, same cache
    assert cost.kv_numbers_per_token_per_layer(cost.preset("kimi-k2")) == 576
    assert ds.n_heads * ds.d_head == 16384 > ds.d_model


def test_presets_match_the_lesson_table():
    table = {  # model: (d_model, n_heads, d_head, n_kv_heads or None for MHA/MLA)
        "transformer-base": (512, 8, 64, None),
        "gpt2-small": (768, 12, 64, None),
        "gpt3-175b": (12288, 96, 128, None),
        "llama3-8b": (4096, 32, 128, 8),
        "qwen2.5-7b": (3584, 28, 128, 4),
        "deepseek-v3": (7168, 128, 128, None),
        "kimi-k2": (7168, 64, 128, None),
        "smollm2-135m": (576, 9, 64, 3),
        "mistral-7b": (4096, 32, 128, 8),
        "mistral-7b-v0.3": (4096, 32, 128, 8),
    }
    assert set(table) == set(cost.PRESETS)
    for name, (d, h, dh, kv) in table.items():
        lay = cost.preset(name)
        assert (lay.d_model, lay.n_heads, lay.d_head) == (d, h, dh), name
        assert lay.n_kv_heads == (kv or h), name
    assert cost.preset("deepseek-v3").qk_rope_head_dim == cost.preset("kimi-k2").qk_rope_head_dim == 64


# ---------------------------------------------------------------------------------------------
# Independent references
# ---------------------------------------------------------------------------------------------


class _ReferenceAttention(nn.Module):
    """A plain GQA attention layer with explicit matmuls (no fused kernel)."""

    def __init__(self, d_model, n_heads, n_kv_heads, d_head, qkv_bias=False, o_bias=False):
        super().__init__()
        self.h, self.kv, self.dh = n_heads, n_kv_heads, d_head
        self.q = nn.Linear(d_model, n_heads * d_head, bias=qkv_bias)
        self.k = nn.Linear(d_model, n_kv_heads * d_head, bias=qkv_bias)
        self.v = nn.Linear(d_model, n_kv_heads * d_head, bias=qkv_bias)
        self.o = nn.Linear(n_heads * d_head, d_model, bias=o_bias)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.dh).transpose(1, 2)
        k = self.k(x).view(B, T, self.kv, self.dh).transpose(1, 2).repeat_interleave(self.h // self.kv, dim=1)
        v = self.v(x).view(B, T, self.kv, self.dh).transpose(1, 2).repeat_interleave(self.h // self.kv, dim=1)
        w = (q @ k.transpose(-1, -2) / self.dh**0.5).softmax(-1)
        return self.o((w @ v).transpose(1, 2).reshape(B, T, self.h * self.dh))


LAYOUTS = [  # d_model, n_heads, n_kv_heads, d_head, bias
    (64, 8, 8, 8, "none"),  # MHA
    (64, 8, 2, 8, "none"),  # GQA
    (64, 8, 1, 8, "none"),  # MQA
    (96, 4, 2, 32, "qkv"),  # heads wider than the model, Qwen-style biases
    (48, 6, 3, 8, "all"),
    (48, 6, 2, 8, "out"),  # a bias on W_O only (a native TransformerConfig(bias=True, qkv_bias=False))
]


@pytest.mark.parametrize("d, h, kv, dh, bias", LAYOUTS)
def test_params_match_a_torch_module(d, h, kv, dh, bias):
    ref = _ReferenceAttention(d, h, kv, dh, qkv_bias=bias in ("qkv", "all"), o_bias=bias in ("all", "out"))
    lay = AttentionLayout(d_model=d, n_layers=1, n_heads=h, n_kv_heads=kv, d_head=dh, bias=bias)
    assert cost.attention_params_per_layer(lay) == sum(p.numel() for p in ref.parameters())


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
@pytest.mark.parametrize("h, kv, bias", [(3, 2, "qkv"), (1, 1, "all"), (5, 1, "none"), (0, 0, "all"), (0, 0, "none")])
def test_layer_cost_of_a_pruned_layer_matches_a_torch_module(h, kv, bias):
    """A pruned layer's counts need not divide (3 query heads on 2 KV heads) and may be 0 (only b_O left)."""
    ref = _ReferenceAttention(48, h, kv, 8, qkv_bias=bias in ("qkv", "all"), o_bias=bias in ("all", "out"))
    lay = AttentionLayout(d_model=48, n_layers=4, n_heads=6, n_kv_heads=2, d_head=8, bias=bias)
    assert cost.layer_cost(cost.attention_params_per_layer, lay, h, kv) == sum(p.numel() for p in ref.parameters())
    assert cost.layer_cost(cost.kv_numbers_per_token_per_layer, lay, h, kv) == 2 * kv * 8
    assert cost.layer_cost(cost.attention_params_per_layer, lay, 6, 2) == cost.attention_params_per_layer(lay)


@pytest.mark.parametrize("h, kv", [(2, 3), (2, 0), (0, 1), (-1, 0)])
def test_layer_cost_refuses_impossible_counts(h, kv):
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match="cannot keep"):
        cost.layer_cost(cost.attention_params_per_layer, cost.preset("llama3-8b"), h, kv)


def test_params_match_torch_multihead_attention():
    for d, h in [(512, 8), (768, 12)]:
        for bias in (False, True):
            ref = nn.MultiheadAttention(d, h, bias=bias)
            lay = AttentionLayout(d_model=d, n_layers=1, n_heads=h, bias="all" if bias else "none")
            assert cost.attention_params_per_layer(lay) == sum(p.numel() for p in ref.parameters())


def test_params_match_transformers_attention_modules():
    from transformers import DeepseekV3Config, GPT2Config, LlamaConfig, Qwen2Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention
    from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
    from transformers.models.llama.modeling_llama import LlamaAttention
    from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention

    def n(module):
        return sum(p.numel() for p in module.parameters())

    assert n(GPT2Attention(GPT2Config(n_embd=768, n_head=12), layer_idx=0)) == cost.attention_params_per_layer(
        cost.preset("gpt2-small")
    )
    for kv in (8, 2, 1):
        llama = LlamaAttention(LlamaConfig(hidden_size=128, num_attention_heads=8, num_key_value_heads=kv), layer_idx=0)
        assert n(llama) == cost.attention_params_per_layer(
            AttentionLayout(d_model=128, n_layers=1, n_heads=8, n_kv_heads=kv)
        )
    qwen = Qwen2Attention(Qwen2Config(hidden_size=256, num_attention_heads=8, num_key_value_heads=2), layer_idx=0)
    assert n(qwen) == cost.attention_params_per_layer(
        AttentionLayout(d_model=256, n_layers=1, n_heads=8, n_kv_heads=2, bias="qkv")
    )
    for q_lora in (96, None):
        cfg = DeepseekV3Config(
            hidden_size=256,
            num_attention_heads=4,
            q_lora_rank=q_lora,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            qk_nope_head_dim=32,
            v_head_dim=32,
        )
        lay = AttentionLayout(
            d_model=256, n_layers=1, n_heads=4, d_head=32, kv_lora_rank=32, q_lora_rank=q_lora, qk_rope_head_dim=16
        )
        assert n(DeepseekV3Attention(cfg, layer_idx=0)) == cost.attention_params_per_layer(lay)


def test_deepseek_v3_attention_params():
    # Hand sum of DeepSeek-V3's projections (config.json sizes) plus the two latent RMSNorms.
    expected = 7168 * 1536 + 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 + 512 * 128 * 256 + 128 * 128 * 7168
    assert cost.attention_params_per_layer(cost.preset("deepseek-v3")) == expected == 187_107_328


@pytest.mark.parametrize("d, h, kv, dh, bias", LAYOUTS[:4])
def test_flops_match_torch_flop_counter(d, h, kv, dh, bias):
    from torch.utils.flop_counter import FlopCounterMode

    T, B = 24, 2
    ref = _ReferenceAttention(d, h, kv, dh)
    lay = AttentionLayout(d_model=d, n_layers=1, n_heads=h, n_kv_heads=kv, d_head=dh)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        ref(torch.randn(B, T, d))
    fl = cost.attention_flops(lay, T, batch=B)
    assert counter.get_total_flops() == fl.projections + fl.scores


@pytest.mark.parametrize("n_kv_heads", [8, 4, 1])
def test_kv_cache_matches_a_tiny_llamas_own_cache(n_kv_heads):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    B, T = 2, 11
    with torch.no_grad():
        out = model(torch.randint(0, 64, (B, T)), use_cache=True)
    cache = getattr(out, "cache", None) or out.past_key_values
    nbytes = sum(
        layer.keys.numel() * layer.keys.element_size() + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
    )
    lay = AttentionLayout(d_model=64, n_layers=3, n_heads=8, n_kv_heads=n_kv_heads, bytes_per_element=2)
    assert nbytes == cost.kv_bytes_per_request(lay, T, batch=B)


def test_attention_matrix_bytes_match_a_meta_tensor():
    llama = cost.preset("llama3-8b")
    for B, T in [(1, 8192), (1, 131072), (3, 1000)]:
        t = torch.empty(B, 32, T, T, dtype=torch.bfloat16, device="meta")
        assert cost.attention_matrix_bytes(llama, T, batch=B) == t.numel() * t.element_size()


def test_fused_kernel_keeps_linear_memory():
    llama = cost.preset("llama3-8b")
    # Q and output 32 heads, K and V 8 heads, of 128, bf16; plus one fp32 log-sum-exp per row.
    T = 32768
    assert cost.fused_attention_bytes(llama, T) == T * (32 + 8 + 8 + 32) * 128 * 2 + 32 * T * 4
    assert cost.fused_attention_bytes(llama, 2 * T) == 2 * cost.fused_attention_bytes(llama, T)
    assert cost.fused_attention_bytes(llama, T) < cost.attention_matrix_bytes(llama, T) / 50


# ---------------------------------------------------------------------------------------------
# Formatting, parsing, errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "n, text",
    [
        (0, "0 B"),
        (1023, "1023 B"),
        (1024, "1 KiB"),
        (1536, "1.5 KiB"),
        (512 * KIB, "512 KiB"),
        (180 * MIB, "180 MiB"),
        (16 * GIB, "16 GiB"),
        (TIB, "1 TiB"),
        (int(8.58 * GIB), "8.58 GiB"),
    ],
)
def test_format_bytes(n, text):
    assert cost.format_bytes(n) == text


_FLOP_SIZE = {"TFLOP": 10**12, "GFLOP": 10**9, "MFLOP": 10**6, "kFLOP": 10**3, "FLOP": 1}


def test_format_flops_like_reads_in_the_other_counts_unit():
    """A row comparing two counts reads in one unit (the pruned model's 90 GFLOP beside the
    unpruned 120 GFLOP printed as 90.0 GFLOP and 0.12 TFLOP); the text reads back to the count."""
    rng = torch.Generator().manual_seed(0)
    for _ in range(500):
        a, b = (float(10 ** (14 * torch.rand(1, generator=rng).item())) for _ in range(2))
        ta, tb = budget._flops_pair(a, b)
        (va, ua), (vb, ub) = (t.split() for t in (ta, tb))
        assert ua == ub == cost.format_flops(max(a, b)).split()[1], (a, b, ta, tb)
        for v, n in ((va, a), (vb, b)):  # within half the last digit shown
            last = 10.0 ** -len(v.partition(".")[2])
            assert abs(float(v) * _FLOP_SIZE[ua] - n) <= 0.5 * _FLOP_SIZE[ua] * last * (1 + 1e-9), (v, ua, n)
    assert budget._flops_pair(9e10, 1.2e11) == ("0.09 TFLOP", "0.12 TFLOP")
    assert cost.format_flops(9e10) == "90.0 GFLOP"  # alone, its own unit


def test_parse_sizes_and_counts():
    assert cost.parse_bytes("2GiB") == 2 * GIB
    assert cost.parse_bytes("512 MiB") == 512 * MIB
    assert cost.parse_bytes("1.5GB") == 1_500_000_000
    assert cost.parse_count("135M") == 135_000_000
    assert cost.parse_count("8B") == 8_000_000_000
    assert cost.parse_count("7e9") == 7_000_000_000
    assert cost.parse_bytes("4096") == 4096 and cost.parse_bytes("512B") == 512
    for bad in ("", "2XB", "-1GiB", "0"):
        with pytest.raises(HeadprobeError):
            cost.parse_bytes(bad)
    with pytest.raises(HeadprobeError, match="give a unit, e.g. 2GiB"):  # --kv-limit's guard: a forgotten unit
        cost.parse_bytes("2", "--kv-limit", bare_at_least=KIB)


def test_absurd_sizes_print_their_exact_integers():
    """At 10**23 tokens every byte and FLOP count prints its exact integer (float division
    printed 5**23 TiB as 11920928955078124 TiB); a crossover past 2**53 prints only the digits it knows."""
    T = 10**23
    text = budget.budget(preset="llama3-8b", seq_len=T).format()
    kv = 2 * 8 * 128 * 2 * 32 * T  # K and V, 8 KV heads x d_head 128, 2 bytes, 32 layers
    scores = 2 * 32 * T * T * (128 + 128)  # 32 heads, QK^T and AV
    matrix = 32 * T * T * 2  # [1, 32, T, T] in bf16
    assert kv % TIB == matrix % TIB == scores % 10**12 == 0
    for value in (f"{kv // TIB} TiB", f"{scores // 10**12} TFLOP", f"{matrix // TIB} TiB"):
        assert value in text, value
    wide = budget.budget(d_model=10**23, n_layers=1, n_heads=1, seq_len=3).format()
    assert "200,000,000,000,000,000,000,000" in wide  # 2D
    table = budget.budget(d_model=1024, n_layers=1, n_heads=1, flops_table=[T + 1]).format()
    proj, att = 8 * 1024**2 * (T + 1), 2 * (T + 1) ** 2 * 2048  # 8*T*D^2; 2*T^2*(d_qk + d_head)
    assert f" {proj // 10**12}  {att // 10**12} " in table  # float: 838860800000000128, 409599999999999977...


def test_json_crossover_is_an_exact_integer_where_whole(capsys):
    """``--json`` gave the crossover as a float: 2D at d_model 10**23 was 2e23, which reads back as
    199999999999999983222784. A whole crossover is now an int (exact); another stays the double
    nearest the fraction p/s (GQA's, and a window's ``s*W(W-1) / (2(s*W - p))``). Old code: 2e+23."""
    code, out, _ = run_cli(
        capsys, "--d-model", str(10**23), "--n-layers", "1", "--n-heads", "1", "--seq-len", "3", "--json"
    )
    r = json.loads(out)
    assert code == 0 and r["crossover_seq_len"] == 2 * 10**23 and type(r["crossover_seq_len"]) is int
    assert r["crossover_seq_len_as_mha"] == 2 * 10**23 and type(r["crossover_seq_len_as_mha"]) is int
    # GQA without a window: p/s = 2(2 D H d + 2 D kv d) / (4 H d) = D (H + kv) / H tokens
    code, out, _ = run_cli(capsys, "--preset", "llama3-8b", "--seq-len", "8192", "--json")
    r = json.loads(out)
    assert r["crossover_seq_len"] == 4096 * (32 + 8) // 32 == 5120 and type(r["crossover_seq_len"]) is int
    lay = AttentionLayout(d_model=64, n_layers=1, n_heads=3, n_kv_heads=1, d_head=16)
    assert cost.crossover_seq_len(lay) == 64 * 4 / 3  # 85.33...: the nearest double, as before
    wide = AttentionLayout(d_model=2**60, n_layers=1, n_heads=1)
    assert cost.crossover_seq_len(wide) == 2**61 and cost.crossover_seq_len(wide, window=2**62) == 2**62 - 1


def test_recommend_rounds_a_huge_budget_exactly():
    """``--recommend`` worked the shape out in floats: at ``--params`` 6 d**2 (2m + 1) + 1, whose
    layers ``params / (12 d**2) = m + 1/2 + 1/(12 d**2)`` round to m + 1, the float quotient was m +
    1/2 and rounded to m (even); with ``--d-model 64`` a quotient of 2**53 + 1 layers read 2**53. Old
    code: 79822 and 9007199254740992."""
    d, m = 10217472, 79822  # shape_for_params' width near 1e20
    n = 6 * d * d * (2 * m + 1) + 1
    rec = cost.recommend(seq_len=8192, n_params=n)
    assert (rec.layout.d_model, rec.layout.n_layers) == (d, m + 1)
    rec = cost.recommend(seq_len=8, n_params=12 * 64**2 * (2**53 + 1), d_model=64)
    assert rec.layout.n_layers == 2**53 + 1
    assert rec.kv_bytes_per_request == (2**53 + 1) * 8 * 2 * 64 * 2  # K and V, 1 head of 64, bf16


def test_huge_counts_and_sizes_parse_exactly():
    """``1e23`` is 10**23, not the float's 99999999999999991611392; a size past a float is refused."""
    assert cost.parse_count("1e23") == 10**23 and cost.parse_count("1.5e22k") == 15 * 10**24
    assert cost.parse_bytes("1e30GiB") == 10**30 * GIB
    with pytest.raises(HeadprobeError, match="too large"):
        cost.parse_bytes("1e400GiB")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(d_model=100, n_layers=2, n_heads=3), "not divisible by n_heads"),
        (dict(d_model=128, n_layers=2, n_heads=8, n_kv_heads=3), "not divisible by n_kv_heads"),
        (dict(d_model=128, n_layers=2, n_heads=8, n_kv_heads=16), "not divisible by n_kv_heads"),
        (dict(d_model=0, n_layers=2, n_heads=8), "d_model must be a positive integer"),
        (dict(d_model=128, n_layers=-1, n_heads=8), "n_layers must be a positive integer"),
        (dict(d_model=128, n_layers=1, n_heads=8, bias="some"), "unknown bias"),
        (dict(d_model=128, n_layers=1, n_heads=8, qk_rope_head_dim=16), "give kv_lora_rank"),
    ],
)
def test_bad_layouts_raise(kwargs, fragment):
    with pytest.raises(HeadprobeError, match=fragment):
        AttentionLayout(**kwargs)


def test_bad_workload_and_preset_raise():
    llama = cost.preset("llama3-8b")
    with pytest.raises(HeadprobeError, match="seq_len"):
        cost.kv_bytes_per_request(llama, 0)
    with pytest.raises(HeadprobeError, match="batch"):
        cost.attention_matrix_bytes(llama, 8, batch=-2)
    with pytest.raises(HeadprobeError, match="unknown preset"):
        cost.preset("gpt5")


# ---------------------------------------------------------------------------------------------
# Recommend mode: the three cases of docs_budget.md, and a case where nothing fits
# ---------------------------------------------------------------------------------------------


def test_recommend_gpu_server():
    rec = cost.recommend(n_params=8 * 10**9, seq_len=8192, kv_limit_bytes=2 * GIB, target="gpu-server")
    lay = rec.layout
    assert (lay.d_model, lay.d_head, lay.n_heads, lay.n_kv_heads) == (4096, 128, 32, 8)
    assert not rec.use_mla and rec.fits
    assert rec.kv_bytes_per_request <= 2 * GIB
    assert 2 <= len(rec.explanation) <= 3


def test_recommend_edge():
    rec = cost.recommend(d_model=576, n_layers=30, seq_len=8192, kv_limit_bytes=128 * MIB, target="edge")
    lay = rec.layout
    assert (lay.d_head, lay.n_heads) == (64, 9)
    assert lay.n_kv_heads == 1 and lay.kind == "MQA"  # 3 KV heads (SmolLM2) need 180 MiB
    assert not rec.use_mla and rec.fits and rec.kv_bytes_per_request == 60 * MIB
    rec = cost.recommend(d_model=576, n_layers=30, seq_len=8192, kv_limit_bytes=256 * MIB, target="edge")
    assert rec.layout.n_kv_heads == 3  # SmolLM2-135M's own choice


def test_recommend_long_context():
    rec = cost.recommend(d_model=7168, n_layers=61, seq_len=131072, kv_limit_bytes=10 * GIB, target="long-context")
    assert rec.use_mla and rec.fits
    assert (rec.layout.kv_lora_rank, rec.layout.qk_rope_head_dim, rec.layout.d_head) == (512, 64, 128)
    assert rec.kv_bytes_per_request == 576 * 61 * 2 * 131072
    assert 2 <= len(rec.explanation) <= 3


def test_recommend_nothing_fits():
    rec = cost.recommend(d_model=4096, n_layers=32, seq_len=131072, kv_limit_bytes=256 * MIB, target="gpu-server")
    assert not rec.fits and rec.layout.n_kv_heads == 1
    assert "at most 16384 tokens fit" in rec.explanation[-1]  # 256 MiB / (256 * 32 * 2 bytes)


def test_recommend_bad_input():
    with pytest.raises(HeadprobeError, match="target"):
        cost.recommend(n_params=10**9, seq_len=4096, target="phone")
    with pytest.raises(HeadprobeError, match="parameter budget"):
        cost.recommend(seq_len=4096)


# ---------------------------------------------------------------------------------------------
# The CLI as a user runs it
# ---------------------------------------------------------------------------------------------


def run_cli(capsys, *argv):
    code = main(["budget", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_llama_preset_prints_the_lesson_numbers(capsys):
    code, out, _ = run_cli(capsys, "--preset", "llama3-8b", "--seq-len", "32768")
    assert code == 0
    for text in ("128 KiB", "512 KiB", "16 GiB", "4 GiB", "41,943,040"):
        assert text in out


def test_cli_json(capsys):
    code, out, _ = run_cli(capsys, "--preset", "llama3-8b", "--seq-len", "8192", "--json")
    r = json.loads(out)
    assert code == 0
    assert r["kv_bytes_per_token"] == 128 * KIB and r["kv_bytes_per_token_mha"] == 512 * KIB
    assert r["attention_matrix_bytes_per_layer"] == 4 * GIB
    assert r["crossover_seq_len_as_mha"] == 8192


def test_cli_explicit_flags_defaults(capsys):
    code, out, _ = run_cli(capsys, "--d-model", "768", "--n-layers", "12", "--n-heads", "12", "--bias", "all", "--json")
    r = json.loads(out)
    assert r["layout"]["n_kv_heads"] == 12 and r["layout"]["d_head"] == 64 and r["layout"]["kind"] == "MHA"
    assert r["attn_params_per_layer"] == 2_362_368
    code, out, _ = run_cli(capsys, "--preset", "llama3-8b", "--n-kv-heads", "32", "--dtype", "fp32", "--json")
    assert json.loads(out)["kv_bytes_per_token"] == 1024 * KIB


def test_cli_flops_table_prints_the_lessons_table(capsys):
    code, out, _ = run_cli(capsys, "--d-model", "4096", "--n-layers", "32", "--n-heads", "32", "--flops-table")
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert rows == [
        ["1,024", "0.14", "0.02", "11%"],
        ["8,192", "1.10", "1.10", "50%"],
        ["32,768", "4.40", "17.6", "80%"],
        ["131,072", "17.6", "281", "94%"],
    ]
    assert "T = 8,192" in out


def test_cli_compare(capsys):
    code, out, _ = run_cli(capsys, "--preset", "llama3-8b", "--compare", "--seq-len", "32768", "--json")
    rows = json.loads(out)["compare"]
    assert [r["n_kv_heads"] for r in rows] == [32, 16, 8, 4, 2, 1]
    assert [r["layout"] for r in rows] == ["MHA", "GQA", "GQA", "GQA", "GQA", "MQA"]
    assert rows[0]["kv_bytes_per_request"] == 16 * GIB and rows[-1]["kv_bytes_per_token"] == 16 * KIB
    code, out, _ = run_cli(capsys, "--preset", "deepseek-v3", "--compare")
    assert "MLA" in out and "576" in out and "40,960" in out


def test_compare_mha_baseline_of_mla_has_the_models_own_key_and_value_widths(capsys):
    """DeepSeek-V3's config.json (deepseek-ai/DeepSeek-V3): num_hidden_layers 61,
    num_attention_heads 128, hidden_size 7168, qk_nope_head_dim 128, qk_rope_head_dim 64 (a key is
    192 wide), v_head_dim 128, kv_lora_rank 512; bf16, 2 bytes. The MHA, GQA and MQA rows are those
    heads with one key and value per KV head; the ratio is checked by hand arithmetic."""
    n_layers, n_heads, d_model, key, value, latent, rope, nbytes = 61, 128, 7168, 128 + 64, 128, 512, 64, 2
    code, out, _ = run_cli(capsys, "--preset", "deepseek-v3", "--compare", "--seq-len", "1024", "--json")
    rows = {r["layout"] if r["layout"] != "GQA" else f"GQA{r['n_kv_heads']}": r for r in json.loads(out)["compare"]}
    mha, gqa8, mqa, mla = rows["MHA"], rows["GQA8"], rows["MQA"], rows["MLA"]
    assert code == 0 and all((r["d_qk"], r["d_head"]) == (key, value) for r in rows.values())
    assert mha["kv_bytes_per_token"] == n_layers * n_heads * (key + value) * nbytes == 4_997_120
    assert gqa8["kv_numbers_per_token_per_layer"] == 8 * (key + value)
    assert mqa["kv_numbers_per_token_per_layer"] == key + value
    assert mla["kv_bytes_per_token"] == n_layers * (latent + rope) * nbytes
    assert mla["kv_vs_mha"] == (latent + rope) / (n_heads * (key + value))
    assert round(1 / mla["kv_vs_mha"], 1) == 71.1  # not the 57 of 128-wide keys
    # W_Q and W_K d_model -> heads x 192, W_V d_model -> heads x 128, W_O heads x 128 -> d_model
    assert mha["attn_params_per_layer"] == d_model * n_heads * (2 * key + 2 * value)
    _, text, _ = run_cli(capsys, "--preset", "deepseek-v3", "--compare")
    header, _, mha_line = text.splitlines()[2:5]
    assert "key/value width" in header and mha_line.split()[:2] == ["MHA", "128"] and "192/128" in mha_line
    _, report, _ = run_cli(capsys, "--preset", "deepseek-v3", "--json")
    assert json.loads(report)["kv_numbers_per_token_per_layer_mha"] == n_heads * (key + value)


def test_cli_recommend(capsys):
    code, out, _ = run_cli(
        capsys,
        "--recommend",
        "--d-model",
        "7168",
        "--n-layers",
        "61",
        "--seq-len",
        "131072",
        "--kv-limit",
        "10GiB",
        "--target",
        "long-context",
    )
    assert code == 0
    assert "MLA latent 512 + rotary key 64" in out and "MLA is worth it" in out
    code, out, _ = run_cli(
        capsys, "--recommend", "--d-model", "4096", "--n-layers", "32", "--seq-len", "131072", "--kv-limit", "256MiB"
    )
    assert code == 1 and "Nothing fits" in out  # an answer, not an error: exit 1 like grep's "no match"


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--d-model", "100", "--n-layers", "2", "--n-heads", "3"], "not divisible by n_heads"),
        (["--preset", "llama3-8b", "--compare", "--flops-table"], "--compare and --flops-table are separate modes"),
        (["--d-model", "128", "--n-layers", "2", "--n-heads", "8", "--n-kv-heads", "3"], "not divisible by n_kv_heads"),
        (["--preset", "nope"], "unknown preset"),
        (["--preset", "llama3-8b", "--seq-len", "0"], "argument --seq-len: must be a positive integer, got 0"),
        (
            ["--d-model", "128", "--n-layers", "-4", "--n-heads", "8"],
            "argument --n-layers: must be a positive integer, got -4",
        ),
        (["--n-heads", "4"], "missing --d-model, --n-layers"),
        (["--recommend", "--params", "lots", "--seq-len", "4096"], "parameter count"),
        (["--preset", "deepseek-v3", "--n-kv-heads", "8"], "--n-kv-heads 8 does not apply to an MLA layout"),
        (
            ["--d-model", "1024", "--n-layers", "2", "--n-heads", "8", "--kv-lora-rank", "512", "--n-kv-heads", "4"],
            "(--kv-lora-rank 512:",
        ),
    ],
)
def test_cli_bad_input_exit_2_one_line(capsys, argv, fragment):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("headprobe: error: ") and fragment in err


@pytest.mark.parametrize(
    "preset, flags",
    [
        ("llama3-8b", ["--kv-lora-rank", "512"]),
        ("llama3-8b", ["--qk-rope-head-dim", "64"]),
        ("gpt2-small", ["--q-lora-rank", "64"]),
        ("mistral-7b", ["--qk-nope-head-dim", "64"]),
        ("llama3-8b", ["--kv-lora-rank", "512", "--qk-rope-head-dim", "64"]),
    ],
)
def test_an_mla_flag_on_a_layout_without_a_latent_is_refused_naming_it(capsys, preset, flags):
    """An MLA-only flag would turn a GQA/MHA preset into MLA (rotary key 0 unless given) or be
    refused for another reason: one line names the flags and the preset's kind, exit 2, nothing printed."""
    code, out, err = run_cli(capsys, "--preset", preset, *flags)
    named = ", ".join(f"{flag} {value}" for flag, value in zip(flags[::2], flags[1::2]))
    kind = cost.preset(preset).kind
    assert code == 2 and out == "" and err.count("\n") == 1, (code, out, err)
    assert err.startswith(f"headprobe: error: {named} do") and f"not apply to a {kind} layout" in err, err


def test_an_mla_flag_on_a_models_layout_without_a_latent_is_refused():
    """The same check for a base that is a loaded model's layout (``--model``), not a preset."""
    base = AttentionLayout(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, name="tiny")
    with pytest.raises(HeadprobeError, match=r"^--kv-lora-rank 8 does not apply to a GQA layout \(tiny"):
        budget.layout_from_config(budget.BudgetConfig(kv_lora_rank=8), base)


def test_mla_flags_still_describe_an_mla_layout_from_scratch_or_change_an_mla_preset():
    """What the refusal must not catch: MLA from the layout flags alone, and an MLA preset's own sizes changed."""
    lay = budget.layout_from_config(budget.BudgetConfig(d_model=128, n_layers=2, n_heads=8, kv_lora_rank=32))
    assert lay.is_mla and lay.kv_lora_rank == 32
    ds = budget.layout_from_config(budget.BudgetConfig(preset="deepseek-v3", kv_lora_rank=256, qk_rope_head_dim=32))
    assert (ds.kv_lora_rank, ds.qk_rope_head_dim, ds.q_lora_rank) == (256, 32, 1536)


def test_cli_bad_input_in_a_subprocess():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "headprobe.cli", "budget", "--d-model", "100", "--n-layers", "2", "--n-heads", "3"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "headprobe: error: d_model 100 is not divisible by n_heads 3; choose n_heads dividing d_model or give d_head explicitly"
    ]


# ---------------------------------------------------------------------------------------------
# The live check on the embedded model
# ---------------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_live_kv_cache_check_on_smollm2(smollm2):
    lay, record = budget.check_loaded(smollm2)
    assert (lay.d_model, lay.n_layers, lay.n_heads, lay.n_kv_heads, lay.d_head) == (576, 30, 9, 3, 64)
    m = record["measured"]
    assert m["n_layers"] == 30 and m["element_bytes"] == 4  # float32 weights and cache
    assert m["numbers_per_token_per_layer"] == 2 * 3 * 64 == 384
    assert m["bytes_per_token"] == 384 * 30 * 4 == cost.kv_bytes_per_token(lay)
    assert m["key_shape"] == [1, 3, m["tokens"], 64]
    assert (
        record["attn_params_per_layer"]["counted"]
        == 884_736
        == cost.attention_params_per_layer(cost.preset("smollm2-135m"))
    )
    assert record["ok"]
    # The preset agrees with the loaded model.
    preset = cost.preset("smollm2-135m")
    assert cost.kv_bytes_per_token(replace(lay, bytes_per_element=2)) == cost.kv_bytes_per_token(preset)
    assert "OK: the formulas match the model" in budget.format_check(record)


@pytest.mark.real_model
def test_cli_model_flag_on_smollm2(smollm2, monkeypatch, capsys):
    import headprobe.probe.backends.loading

    monkeypatch.setattr(
        headprobe.probe.backends.loading, "load_model", lambda name, **kw: smollm2
    )  # reuse the session's model
    code, out, _ = run_cli(capsys, "--model", "smollm2-135m", "--seq-len", "8192", "--json")
    r = json.loads(out)  # nothing but JSON on stdout
    assert code == 0 and r["check"]["ok"]
    assert r["kv_bytes_per_token"] == 384 * 30 * 2  # reported in --dtype bf16
    assert r["kv_bytes_per_request"] == 180 * MIB


def test_cli_flops_table_of_a_small_model_scales_its_unit(capsys):
    """SmolLM2's attention layer is under a TFLOP at every length asked: the table switches to GFLOP
    (not rows of 0.00), and its numbers are the cost model's divided by 10^9."""
    from headprobe.probe.layout import cost

    code, out, _ = run_cli(capsys, "--preset", "smollm2-135m", "--flops-table", "128", "1024")
    assert code == 0 and "projections, GFLOP" in out and "1 GFLOP = 10^9 FLOPs" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    fl = cost.attention_flops(cost.PRESETS["smollm2-135m"], 1024, 1)
    assert rows[1][:3] == ["1,024", f"{fl.projections / 1e9:.2f}", f"{fl.scores / 1e9:.2f}"]


def test_compare_latex_keeps_every_gqa_layout_as_its_own_column(capsys):
    """walk-layouts: with 16 heads --compare has three GQA rows (8, 4 and 2 KV heads), and --latex
    kept one column named GQA (the last), under a column spec of six: every row is a column, the GQA
    ones named by their KV heads, each column the row's --json numbers."""
    import json
    import re

    argv = ("--d-model", "2048", "--n-layers", "24", "--n-heads", "16", "--compare", "--seq-len", "32768")
    code, out, _ = run_cli(capsys, *argv, "--json")
    rows = json.loads(out)["compare"]
    assert [r["n_kv_heads"] for r in rows] == [16, 8, 4, 2, 1]
    code, tex, _ = run_cli(capsys, *argv, "--latex")
    assert code == 0
    spec, head, body = re.search(
        r"\\begin\{tabular\}\{(\w+)\}\n\\toprule\n(.*?) \\\\\n\\midrule\n(.*?)\\bottomrule", tex, re.S
    ).groups()
    assert [c.strip() for c in head.split("&")] == ["", "MHA", "GQA-8", "GQA-4", "GQA-2", "MQA"]
    assert spec == "l" + "r" * len(rows)
    line = {c[0]: c[1:] for c in ([x.strip() for x in r.split("&")] for r in body.strip().split(" \\\\\n"))}
    assert line["attn params/layer"] == [f"{r['attn_params_per_layer']:,}" for r in rows]


def test_a_compare_flops_column_is_in_one_unit(capsys):
    """walk-layouts: at 2,048 tokens the --compare FLOPs column read 0.10 TFLOP above 85.9 GFLOP:
    every row is in the largest row's unit, and still tells the layouts apart."""
    import re

    code, out, _ = run_cli(
        capsys, "--d-model", "2048", "--n-layers", "24", "--n-heads", "16", "--compare", "--seq-len", "2048"
    )
    assert code == 0
    rows = [line for line in out.splitlines() if re.match(r"(MHA|GQA|MQA) +\d", line)]
    flops = [re.search(r"([\d.]+) (\w?FLOP)", line).groups() for line in rows]
    assert len(flops) == 5 and {unit for _, unit in flops} == {"TFLOP"}, flops
    assert len({number for number, _ in flops}) == 5


def test_compare_latex_is_the_json_numbers_one_column_per_layout_and_fits_a_page(capsys, tmp_path):
    """budget had no table for a paper (walk-paper: the MHA/GQA/MQA cost table built by hand from
    --json): --compare --latex prints a booktabs table, one column per layout, whose cells are the
    --json numbers (thousands separators), that pdflatex reads within a 397 pt text width; without
    --compare, or with --json, one line and exit 2."""
    import json
    import re
    import shutil

    argv = ("--preset", "smollm2-135m", "--compare", "--seq-len", "8192")
    code, out, _ = run_cli(capsys, *argv, "--json")
    rows = json.loads(out)["compare"]
    code, tex, _ = run_cli(capsys, *argv, "--latex")
    assert code == 0 and tex.count("\\toprule") == 1 and "\\label{tab:budget-compare}" in tex
    head, body = re.search(r"\\toprule\n(.*?) \\\\\n\\midrule\n(.*?)\\bottomrule", tex, re.S).groups()
    assert [c.strip() for c in head.split("&")] == ["", *(r["layout"] for r in rows)], head  # one layout of each
    cells = [[c.strip() for c in r.split("&")] for r in body.strip().removesuffix(" \\\\").split(" \\\\\n")]
    line = {c[0]: c[1:] for c in cells}
    assert line["attn params/layer"] == [f"{r['attn_params_per_layer']:,}" for r in rows]
    assert line["KV numbers/token/layer"] == [f"{r['kv_numbers_per_token_per_layer']:,}" for r in rows]
    assert line["n\\_kv\\_heads"] == [str(r["n_kv_heads"]) for r in rows]
    for bad in ((), ("--compare", "--json")):
        code, _, err = run_cli(capsys, "--preset", "smollm2-135m", *bad, "--latex")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
    if shutil.which("pdflatex"):
        from test_export_latex import _assert_compiles_within

        _assert_compiles_within("budget-compare", tex, 397, tmp_path)
