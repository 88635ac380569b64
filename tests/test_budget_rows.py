"""The rows of ``headprobe budget``'s one-layout report read as a lecturer would read them: each
row's label says what it counts (per token up to a window, per layer or over the layers of one
kind), and the numbers a reader adds up add up. References are worked out here by hand."""

from __future__ import annotations

import json

import pytest

from headprobe.cli import main
from headprobe.probe.layout import cost
from headprobe.probe.layout.cost import AttentionLayout

KIB, MIB = 2**10, 2**20
MIXED = [
    *("--d-model", "4096", "--n-layers", "4", "--n-heads", "32", "--n-kv-heads", "8"),
    *("--sliding-window", "4096", "--global-every", "2", "--seq-len", "32768"),
]


def run(capsys, *argv):
    """(the printed table's rows as {label: (value, note)}, the ``--json`` dict)."""
    assert main(["budget", *argv]) == 0
    text = capsys.readouterr().out
    assert main(["budget", *argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    lines = text.split("\n")
    rule = next(i for i, x in enumerate(lines) if x.startswith("-----"))
    widths = [len(c) for c in lines[rule].split("  ")]
    rows = {}
    for line in lines[rule + 1 :]:
        if not line.strip():
            break
        cells, at = [], 0
        for w in widths:
            cells.append(line[at : at + w].strip())
            at += w + 2
        rows[cells[0]] = tuple(cells[1:])
    return rows, data


def test_mistral_7b_kv_per_token_says_the_window_caps_it(capsys):
    """Mistral 7B at 32K: each token adds 2 (K, V) x 8 KV heads x 128 x 2 bytes x 32 layers =
    128 KiB while it is inside the 4,096 window, and nothing past it (every layer is windowed),
    so the sequence caches 128 KiB x 4,096 = 512 MiB, not 128 KiB x 32,768 = 4 GiB."""
    rows, data = run(capsys, "--preset", "mistral-7b", "--seq-len", "32768")
    per_token = 2 * 8 * 128 * 2 * 32
    assert per_token == 128 * KIB
    assert "KV cache per token" not in rows  # no bare per-token figure that reads as linear in T
    assert rows["KV cache per token, tokens 1 to 4,096"][0] == "128 KiB"
    assert rows["KV cache per token, past token 4,096"][0] == "0 B"
    value, note = rows["KV cache, 1 sequence x 32768 tokens"]
    assert value == "512 MiB" and per_token * 4096 == 512 * MIB
    assert note.endswith("= 128 KiB x 4,096 + 0 B x 28,672")
    assert [(s["first_token"], s["last_token"], s["bytes_per_token"]) for s in data["kv_bytes_per_token_spans"]] == [
        (1, 4096, per_token),
        (4097, None, 0),
    ]


def test_mixed_windows_kv_per_token_spans_add_up_to_the_sequence(capsys):
    """4 layers, every second global: tokens 1 to 4,096 add 4 layers' K and V (2 x 8 x 128 x 2
    bytes each = 4 KiB), later ones only the 2 global layers' (8 KiB); at 32K and batch 3 the
    cache is 3 x (16 KiB x 4,096 + 8 KiB x 28,672) = 3 x 288 MiB."""
    rows, data = run(capsys, *MIXED, "--batch", "3")
    layer = 2 * 8 * 128 * 2
    assert rows["KV cache per token, tokens 1 to 4,096"][0] == "16 KiB" and 4 * layer == 16 * KIB
    assert rows["KV cache per token, past token 4,096"][0] == "8 KiB" and 2 * layer == 8 * KIB
    assert "only the 2 layers without a window" in rows["KV cache per token, past token 4,096"][1]
    total = 3 * (4 * layer * 4096 + 2 * layer * (32768 - 4096))
    assert data["kv_bytes_per_request"] == total == 3 * 288 * MIB
    assert rows["KV cache, 3 sequences x 32768 tokens"][1].endswith("= 16 KiB x 4,096 + 8 KiB x 28,672, x 3 sequences")


@pytest.mark.parametrize(
    "windows", [(4096,) * 3, (None, 8, None, 3, 8), (5, 5, 2), None], ids=["all", "two-sizes", "short", "none"]
)
def test_kv_spans_are_a_per_token_loop(windows):
    """Against a loop over token positions: token t (1-based) is cached by every layer whose
    window is at least t (a global layer caches every token); per layer 2 x 2 x 16 numbers of 4 bytes."""
    n = 5 if windows is None else len(windows)
    lay = AttentionLayout(d_model=64, n_layers=n, n_heads=4, n_kv_heads=2, windows=windows, bytes_per_element=4)
    spans = cost.kv_bytes_per_token_spans(lay)
    per_layer = 2 * 2 * 16 * 4
    for t in range(1, 40):
        (span,) = [s for s in spans if s.first_token <= t and (s.last_token is None or t <= s.last_token)]
        cached = sum(1 for w in (windows or (None,) * n) if w is None or t <= w)
        assert span.bytes_per_token == per_layer * cached
    for T in (1, 2, 3, 7, 8, 9, 100):
        assert cost.kv_bytes_per_request(lay, T) == sum(s.bytes_per_token * s.tokens_within(T) for s in spans)


@pytest.mark.parametrize(
    "dtype, cache_bytes, compute, compute_bytes",
    [
        ("fp8", 1, "bf16", 2),
        ("int8", 1, "bf16", 2),
        ("bf16", 2, "bf16", 2),
        ("fp16", 2, "fp16", 2),
        ("fp32", 4, "fp32", 4),
    ],
)
def test_attention_matrix_is_in_the_compute_dtype_not_the_cache_format(
    capsys, dtype, cache_bytes, compute, compute_bytes
):
    """Llama 3 8B at 32K: the KV cache is stored in --dtype (2 x 8 x 128 x 32 layers x 32,768
    tokens x its bytes), but the materialised softmax (32 heads x T x T) and the fused kernel's Q,
    K, V and output are in the compute dtype: an fp8 cache leaves them bf16 (64 GiB, not 32)."""
    T = 32768
    rows, data = run(capsys, "--preset", "llama3-8b", "--seq-len", str(T), "--dtype", dtype)
    assert data["kv_bytes_per_request"] == 2 * 8 * 128 * 32 * T * cache_bytes
    matrix = 32 * T * T * compute_bytes
    assert data["attention_matrix_bytes_per_layer"] == matrix
    assert rows[f"attention matrix per layer [batch, head, T, T] in {compute}"][0] == cost.format_bytes(matrix)
    fused = T * (32 * 128 + 8 * 128 + 8 * 128 + 32 * 128) * compute_bytes + T * 32 * 4  # + one fp32 LSE per row
    assert data["fused_attention_bytes_per_layer"] == fused
    assert rows["fused kernel per layer (Q, K, V, out, LSE)"] == (
        cost.format_bytes(fused),
        f"FlashAttention / SDPA; {compute}, LSE fp32",
    )


def test_fp8_header_and_windowed_matrix_say_the_attention_is_bf16(capsys):
    """Mistral 7B, fp8 cache: the banded matrix of a 4,096 window holds 32 heads x
    (4096 x 4097 / 2 + (T - 4096) x 4096) weights of 2 bytes (bf16), and the header says which
    format is the cache's and which the attention's."""
    T, W = 32768, 4096
    assert main(["budget", "--preset", "mistral-7b", "--seq-len", str(T), "--dtype", "fp8"]) == 0
    text = capsys.readouterr().out
    assert "fp8 KV cache (1 byte), attention computed in bf16" in text.split("\n")[0]
    rows, data = run(capsys, "--preset", "mistral-7b", "--seq-len", str(T), "--dtype", "fp8")
    banded = 32 * (W * (W + 1) // 2 + (T - W) * W) * 2
    assert data["windowed_layers"][0]["attention_matrix_bytes_per_layer"] == banded
    assert rows["attention matrix per layer in bf16, window 4,096"][0] == cost.format_bytes(banded) == "7.5 GiB"


def test_a_window_as_long_as_the_sequence_is_the_causal_half_of_a_global_layers_matrix_and_says_so(capsys):
    """A window W = T stores T(T+1)/2 weights a head (the keys each query reads) where a global layer
    counts all T^2 (an eager kernel materialises the masked half too): 32 GiB beside 64 GiB for one
    computation read as a contradiction (walk plan8b). The banded row now names the eager T^2 too."""
    T = 32768
    rows, data = run(capsys, "--preset", "mistral-7b", "--sliding-window", str(T), "--seq-len", str(T))
    value, note = rows[f"attention matrix per layer in bf16, window {T:,}"]
    assert value == cost.format_bytes(32 * T * (T + 1) // 2 * 2) == "32 GiB"
    assert "banded" in note and note.endswith(f"holds all T^2: {cost.format_bytes(32 * T * T * 2)}")
    rows, _ = run(capsys, "--preset", "llama3-8b", "--seq-len", str(T))
    value, note = rows["attention matrix per layer [batch, head, T, T] in bf16"]
    assert value == "64 GiB" and "all T^2, the masked half too" in note


def test_mixed_windows_flops_rows_say_per_layer_or_per_kind_and_add_up(capsys):
    """4 layers, every second global, T = 32,768, W = 4,096. Per layer, a global layer scores all
    T^2 (17.6 TFLOP; causal pos+1 keys: T(T+1)/2, 8.80), a windowed one W(W+1)/2 + (T-W)W keys
    (2.06). Over the layers of each kind (x2): 2 x 8.80 and 2 x 2.06, and the all-layers row is
    their sum (21.7), not 2 x 17.6 + 2 x 2.06 = 39.3."""
    T, W = 32768, 4096
    rows, data = run(capsys, *MIXED)
    per_key = 2 * 32 * (128 + 128)  # QK^T and AV, 32 query heads, multiply-add = 2 FLOPs
    full, causal, band = per_key * T * T, per_key * T * (T + 1) // 2, per_key * (W * (W + 1) // 2 + (T - W) * W)
    assert rows["scores + AV FLOPs per layer, global layer"][0] == cost.format_flops(full) == "17.6 TFLOP"
    assert "each of 2 of 4 layers" in rows["scores + AV FLOPs per layer, global layer"][1]
    assert f"causal: {cost.format_flops(causal)}" in rows["scores + AV FLOPs per layer, global layer"][1]
    assert rows["scores + AV FLOPs per layer, window 4,096"] == (
        cost.format_flops(band),
        "each of 2 of 4 layers; min(W, pos+1) keys per query",
    )
    kinds = {k["window"]: k for k in data["flops_scores_by_kind"]}
    assert kinds[None]["flops_scores"] == 2 * causal and kinds[W]["flops_scores"] == 2 * band
    # the identity: the all-layers total is the sum of the per-kind rows the table shows
    assert data["flops_scores_all_layers"] == sum(k["flops_scores"] for k in data["flops_scores_by_kind"])
    assert data["flops_scores_all_layers"] == 2 * causal + 2 * band
    g = rows["scores + AV FLOPs, global layers (x2)"]
    b = rows["scores + AV FLOPs, window 4,096 layers (x2)"]
    assert g[0] == cost.format_flops(2 * causal) and g[1].startswith(f"2 x {cost.format_flops(causal)}")
    assert b[0] == cost.format_flops(2 * band) and b[1].startswith(f"2 x {cost.format_flops(band)}")
    total = rows["scores + AV FLOPs, all 4 layers"]
    assert total[0] == cost.format_flops(2 * causal + 2 * band) == "21.7 TFLOP"
    assert total[1].startswith(f"= {g[0]} + {b[0]};")
    assert "scores + AV FLOPs, all layers" not in rows  # the old label, read as 2 x 17.6 + 2 x 2.06


@pytest.mark.parametrize(
    "argv, windowed, n_layers",
    [
        (["--preset", "mistral-7b"], 32, 32),
        (
            ["--d-model", "256", "--n-layers", "6", "--n-heads", "4", "--sliding-window", "64", "--global-every", "3"],
            4,
            6,
        ),
        (
            ["--d-model", "256", "--n-layers", "5", "--n-heads", "4", "--sliding-window", "64", "--global-every", "2"],
            3,
            5,
        ),
    ],
)
def test_window_row_counts_the_models_own_layers(capsys, argv, windowed, n_layers):
    """The per-layer window row names how many of the model's layers have the window (with
    --global-every N, layer l is global when (l + 1) % N == 0: 6 layers, N = 3: 2 global, 4
    windowed), and the all-layers row counts the model's layers."""
    rows, data = run(capsys, *argv, "--seq-len", "8192")
    window_rows = [v for k, v in rows.items() if k.startswith("scores + AV FLOPs per layer, window")]
    assert [v[1].split(";")[0] for v in window_rows] == [f"each of {windowed} of {n_layers} layers"]
    assert f"scores + AV FLOPs, all {n_layers} layers" in rows
    assert sum(k["n_layers"] for k in data["flops_scores_by_kind"]) == n_layers


def test_recommend_case_1_says_how_it_differs_from_llama_3_8b():
    """docs/budget.md's case 1 (--params 8B at 8K in 2 GiB) proposes Llama 3 8B's heads but not its
    depth: 8e9 / (12 x 4096^2) = 39.7 -> 40 layers, where Llama 3 8B (config.json: vocab 128,256,
    untied embeddings, intermediate 14,336, 32 layers) has 32 and 8,030,261,248 parameters. The
    page must say so, with these numbers, instead of calling the answer "Llama 3 8B's own choice"."""
    from pathlib import Path

    rec = cost.recommend(n_params=8 * 10**9, seq_len=8192, kv_limit_bytes=2 * 2**30, target="gpu-server")
    assert round(8e9 / (12 * 4096**2)) == 40 == rec.layout.n_layers != cost.preset("llama3-8b").n_layers == 32
    d, vocab, mlp = 4096, 128256, 14336
    layer = (2 * d * d + 2 * d * 1024) + 3 * d * mlp + 2 * d  # attention (GQA-8), gated MLP, two RMSNorms
    assert layer == 218_112_000 and 32 * layer + d + 2 * vocab * d == 8_030_261_248
    assert rec.kv_bytes_per_request == 40 * 8192 * 2 * 8 * 128 * 2 == 1.25 * 2**30
    page = (Path(__file__).parents[1] / "docs" / "budget.md").read_text(encoding="utf-8")
    case = page[page.index("**Case 1") : page.index("```", page.index("**Case 1"))]
    assert "own choice" not in case
    for fact in ("40 layers", "Llama 3 8B has 32", "8,030,261,248", "1,050,673,152", "218,112,000", "1.25 GiB"):
        assert fact.replace("\n", " ") in case.replace("\n", " "), fact


def _dense_params(
    d, layers, heads, kv_heads, d_mlp, vocab, *, gated=True, tied=False, qkv_bias=False, gpt2=False, positions=1024
):
    """A dense decoder's parameters from its config.json, written out: attention, MLP, norms, embeddings."""
    dh = d // heads
    attention = d * heads * dh + 2 * d * kv_heads * dh + heads * dh * d
    if qkv_bias:
        attention += heads * dh + 2 * kv_heads * dh
    if gpt2:  # c_attn and c_proj biases, MLP biases, LayerNorm weight + bias, learned positions
        attention += 3 * d + d
        mlp, norm, positions = 2 * d * d_mlp + d_mlp + d, 2 * d, positions * d
    else:
        mlp, norm, positions = (3 if gated else 2) * d * d_mlp, d, 0
    embeddings = vocab * d * (1 if tied else 2) + positions
    return layers * (attention + mlp + 2 * norm) + norm + embeddings, embeddings


@pytest.mark.parametrize(
    "preset, expected, shape",
    [
        ("llama3-8b", 8_030_261_248, dict(d=4096, layers=32, heads=32, kv_heads=8, d_mlp=14336, vocab=128256)),
        ("mistral-7b", 7_241_732_096, dict(d=4096, layers=32, heads=32, kv_heads=8, d_mlp=14336, vocab=32000)),
        ("mistral-7b-v0.3", 7_248_023_552, dict(d=4096, layers=32, heads=32, kv_heads=8, d_mlp=14336, vocab=32768)),
        (
            "qwen2.5-7b",
            7_615_616_512,
            dict(d=3584, layers=28, heads=28, kv_heads=4, d_mlp=18944, vocab=152064, qkv_bias=True),
        ),
        (
            "smollm2-135m",
            134_515_008,
            dict(d=576, layers=30, heads=9, kv_heads=3, d_mlp=1536, vocab=49152, tied=True),
        ),
        (
            "gpt2-small",
            124_439_808,
            dict(d=768, layers=12, heads=12, kv_heads=12, d_mlp=3072, vocab=50257, tied=True, gpt2=True),
        ),
        (  # Brown et al. 2020, Table 2.1: "175.0B"; GPT-2's architecture at n_ctx 2048, d_ff = 4 d_model
            "gpt3-175b",
            174_604_259_328,
            dict(
                d=12288,
                layers=96,
                heads=96,
                kv_heads=96,
                d_mlp=49152,
                vocab=50257,
                tied=True,
                gpt2=True,
                positions=2048,
            ),
        ),
    ],
)
def test_whole_model_parameters_and_forward_flops_per_token_by_hand(capsys, preset, expected, shape):
    """The whole-model row against the published totals worked out from each config.json (Llama 3
    8B: 8,030,261,248), and the forward FLOPs of a token attending to T = 32,768 keys: 2 x the
    non-embedding parameters (Kaplan et al. 2020) + 2 x heads x (d_qk + d_head) per key and layer,
    min(T, 4096) keys on Mistral's windowed layers."""
    T = 32768
    total, embeddings = _dense_params(**shape)
    assert total == expected
    rows, data = run(capsys, "--preset", preset, "--seq-len", str(T))
    assert data["model_params"] == total and data["model_params_non_embedding"] == total - embeddings
    assert rows["parameters, whole model"][0] == f"{total:,}"
    keys = min(T, 4096) if preset == "mistral-7b" else T
    d, heads = shape["d"], shape["heads"]
    flops = 2 * (total - embeddings) + shape["layers"] * keys * 2 * heads * 2 * (d // heads)
    assert data["forward_flops_per_token"] == flops
    assert rows["forward FLOPs per token, whole model"][0] == cost.format_flops(flops)
    assert rows["forward FLOPs per token, whole model"][1].startswith(f"2 x {total - embeddings:,} non-embedding")


def test_attention_only_rows_say_so(capsys):
    """Every report says its rows count attention only; a preset's whole-model rows are the
    exceptions, absent for an MoE preset and when --d-model or --n-layers replaces the preset's shape."""
    for argv, whole in (
        (["--preset", "llama3-8b"], True),
        (["--preset", "deepseek-v3"], False),
        (["--preset", "llama3-8b", "--n-layers", "16"], False),
        (["--d-model", "512", "--n-layers", "2", "--n-heads", "8"], False),
    ):
        assert main(["budget", *argv]) == 0
        text = capsys.readouterr().out
        assert text.split("\n")[2].startswith("rows count attention only (no MLP, embeddings or norms)")
        assert ("parameters, whole model" in text) == whole
        assert "attention projection FLOPs per layer" in text


def test_compare_kv_per_token_column_says_up_to_the_window(capsys):
    """--compare on Mistral 7B: the per-token column is the cost of tokens 1 to 4,096 (GQA-8:
    2 x 8 x 128 x 2 bytes x 32 layers = 128 KiB), not a cost per token at any length; without
    windows it stays KV/token (Llama 3 8B)."""
    assert main(["budget", "--preset", "mistral-7b", "--compare", "--seq-len", "32768"]) == 0
    lines = capsys.readouterr().out.split("\n")
    header = next(x for x in lines if x.startswith("layout "))
    assert "KV/token, tokens 1 to 4,096" in header
    gqa8 = next(x for x in lines if x.split()[:2] == ["GQA", "8"])
    assert cost.format_bytes(2 * 8 * 128 * 2 * 32) == "128 KiB" and " 128 KiB " in gqa8
    assert main(["budget", "--preset", "llama3-8b", "--compare"]) == 0
    assert "  KV/token  " in capsys.readouterr().out
