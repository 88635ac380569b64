"""``headprobe budget --model`` on every architecture of the zoo, and the new layout terms
(QK-norm, sliding windows, MLA's value width) against Hugging Face's own modules and caches.

References are independent of headprobe's formulas: parameters are counted on transformers'
attention modules, cached positions and bytes are read from transformers' ``StaticCache`` and
``DynamicCache`` after a forward pass longer than the window, and hand sums.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import zoo

from headprobe.cli import main
from headprobe.commands import budget
from headprobe.probe.layout import attention as layout
from headprobe.probe.layout import cost
from headprobe.probe.layout.cost import AttentionLayout


@pytest.fixture(scope="module")
def zoo_dirs(tiny_tokenizer, tmp_path_factory):
    """Family -> a tiny Hugging Face model directory of that family (built on first use)."""
    root = tmp_path_factory.mktemp("zoo")
    made: dict[str, str] = {}

    def get(family: str) -> str:
        if family not in made:
            made[family] = str(zoo.save_dir(family, tiny_tokenizer, root / family))
        return made[family]

    return get


# ---------------------------------------------------------------------------------------------
# The live check says OK on every family
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(zoo.ZOO))
def test_live_check_matches_every_zoo_family(family, zoo_dirs, capsys):
    code = main(["budget", "--model", zoo_dirs(family)])
    out, _ = capsys.readouterr()
    assert "OK: the formulas match the model" in out and "MISMATCH" not in out, out
    assert code == 0
    code = main(["budget", "--model", zoo_dirs(family), "--json"])
    check = json.loads(capsys.readouterr().out)["check"]
    assert code == 0 and check["ok"] and check["attn_params_per_layer"]["ok"]  # the parameter check ran
    assert check["measured"]["tokens"] >= budget.CHECK_MIN_TOKENS  # even where the prompt is one unknown token


def test_live_check_runs_past_gemma2s_window(zoo_dirs, capsys):
    window = zoo.ZOO["gemma2"]["sliding_window"]
    code = main(["budget", "--model", zoo_dirs("gemma2"), "--seq-len", "64", "--json"])
    r = json.loads(capsys.readouterr().out)
    m = r["check"]["measured"]
    assert code == 0 and m["tokens"] > window and m["cache_class"] == "StaticCache"  # the one budget handed in
    assert m["positions_per_layer"] == [window, m["tokens"]]  # layer 0 sliding, layer 1 global
    assert r["layout"]["windows"] == [window, None]
    # The report at 64 tokens: layer 0 holds 8 positions, layer 1 all 64; 2 KV heads of 16, bf16.
    assert r["kv_bytes_per_request"] == (window + 64) * 2 * 2 * 16 * 2
    main(["budget", "--model", zoo_dirs("gemma2"), "--seq-len", "64"])
    assert "1 of 2 layers sliding-window (8 positions)" in capsys.readouterr().out


def test_live_check_reads_mla_and_qk_norm_from_the_config(zoo_dirs, capsys):
    main(["budget", "--model", zoo_dirs("deepseek_v3"), "--json"])
    r = json.loads(capsys.readouterr().out)
    z = zoo.ZOO["deepseek_v3"]
    lay = r["layout"]
    assert (
        lay["kind"],
        lay["kv_lora_rank"],
        lay["q_lora_rank"],
        lay["qk_rope_head_dim"],
        lay["qk_nope_head_dim"],
        lay["d_head"],
    ) == ("MLA", z["kv_lora_rank"], z["q_lora_rank"], z["qk_rope_head_dim"], z["qk_nope_head_dim"], z["v_head_dim"])
    assert r["kv_numbers_per_token_per_layer"] == z["kv_lora_rank"] + z["qk_rope_head_dim"]
    main(["budget", "--model", zoo_dirs("qwen3"), "--json"])
    assert json.loads(capsys.readouterr().out)["layout"]["qk_norm"] == "per_head"
    main(["budget", "--model", zoo_dirs("olmo2"), "--json"])
    assert json.loads(capsys.readouterr().out)["layout"]["qk_norm"] == "full"


def test_a_wrong_formula_is_a_mismatch(zoo_dirs, capsys, monkeypatch):
    """The check can fail: without the QK-norm term the Qwen3 count disagrees (exit 1)."""
    monkeypatch.setitem(layout.QK_NORM_OF_MODEL_TYPE, "qwen3", "none")  # the bridge's spec reads it at load
    code = main(["budget", "--model", zoo_dirs("qwen3")])
    out = capsys.readouterr().out
    assert code == 1 and "MISMATCH: the formulas disagree with the model" in out


# ---------------------------------------------------------------------------------------------
# Parameters against transformers' attention modules
# ---------------------------------------------------------------------------------------------


def _n(module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize("kv", [4, 2, 1])
def test_qk_norm_params_match_qwen3_and_olmo2(kv):
    from transformers import Olmo2Config, Qwen3Config
    from transformers.models.olmo2.modeling_olmo2 import Olmo2Attention
    from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

    qwen = Qwen3Attention(
        Qwen3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv, head_dim=24), layer_idx=0
    )
    lay = AttentionLayout(d_model=64, n_layers=1, n_heads=4, n_kv_heads=kv, d_head=24, qk_norm="per_head")
    assert (
        _n(qwen)
        == cost.attention_params_per_layer(lay)
        == cost.attention_params_per_layer(AttentionLayout(d_model=64, n_layers=1, n_heads=4, n_kv_heads=kv, d_head=24))
        + 2 * 24
    )
    olmo = Olmo2Attention(Olmo2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=kv), layer_idx=0)
    lay = AttentionLayout(d_model=64, n_layers=1, n_heads=4, n_kv_heads=kv, qk_norm="full")
    assert _n(olmo) == cost.attention_params_per_layer(lay)


def test_mla_params_with_a_value_width_of_its_own():
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    for q_lora in (48, None):
        cfg = DeepseekV3Config(
            hidden_size=96,
            num_attention_heads=4,
            q_lora_rank=q_lora,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=24,
        )
        lay = AttentionLayout(
            d_model=96,
            n_layers=1,
            n_heads=4,
            d_head=24,
            kv_lora_rank=32,
            q_lora_rank=q_lora,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
        )
        assert _n(DeepseekV3Attention(cfg, layer_idx=0)) == cost.attention_params_per_layer(lay)


# ---------------------------------------------------------------------------------------------
# Sliding windows against transformers' caches
# ---------------------------------------------------------------------------------------------


def _hf_cache_after(model, T: int, cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        out = model(torch.arange(T)[None] % 50, use_cache=True, past_key_values=cache)
    return [(layer.keys, layer.values) for layer in out.past_key_values.layers]


@pytest.mark.parametrize("family, T", [("gemma2", 5), ("gemma2", 21), ("mistral", 21)])
def test_windowed_kv_cache_matches_transformers_static_cache(family, T):
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, StaticCache

    z = dict(zoo.ZOO[family], num_hidden_layers=4)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **z), attn_implementation="eager").eval()
    cfg = model.config
    windows = layout.windows_from_hf_config(cfg, cfg.num_hidden_layers)
    w = z["sliding_window"]
    assert windows == ((w, None, w, None) if family == "gemma2" else (w,) * 4)  # Gemma 2 alternates, Mistral does not
    lay = AttentionLayout(
        d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, d_head=16, windows=windows, bytes_per_element=4
    )
    static = _hf_cache_after(model, T, StaticCache(config=cfg, max_cache_len=T))
    assert [k.shape[-2] for k, _ in static] == cost.kv_positions(lay, T)
    assert sum(k.nbytes + v.nbytes for k, v in static) == cost.kv_bytes_per_request(lay, T)
    # DynamicCache keeps window - 1 positions between steps (the step's own key makes it the window).
    dynamic = _hf_cache_after(model, T, DynamicCache(config=cfg))
    assert [k.shape[-2] for k, _ in dynamic] == [
        p if (wl is None or T < wl) else wl - 1 for p, wl in zip(cost.kv_positions(lay, T), windows)
    ]


def test_non_attention_layers_are_refused_by_budget_and_read_as_global_by_a_spec():
    """Budget's formulas cover attention layers only; a loaded hybrid model's spec (strict=False)
    reads such a layer as global rather than refusing the model."""
    from types import SimpleNamespace

    from headprobe.probe.core.errors import HeadprobeError

    cfg = SimpleNamespace(sliding_window=4, layer_types=["sliding_attention", "linear_attention", "full_attention"])
    with pytest.raises(HeadprobeError, match="'linear_attention'.*attention layers only"):
        layout.windows_from_hf_config(cfg, 3)
    assert layout.windows_from_hf_config(cfg, 3, strict=False) == (4, None, None)


def test_windowed_kv_by_hand():
    lay = AttentionLayout(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, windows=(4, None, 6), bytes_per_element=2)
    assert cost.kv_positions(lay, 3) == [3, 3, 3]
    assert cost.kv_positions(lay, 10) == [4, 10, 6]
    assert cost.kv_bytes_per_request(lay, 10, batch=3) == (4 + 10 + 6) * (2 * 2 * 16) * 2 * 3
    assert cost.kv_bytes_per_request(lay, 10) < cost.kv_bytes_per_request(
        AttentionLayout(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2), 10
    )
    assert AttentionLayout(d_model=64, n_layers=2, n_heads=4, windows=(None, None)).windows is None
    assert lay.n_windowed_layers == 2
    gemma3 = cost.sliding_windows(12, 1024, global_every=6)  # 5 local : 1 global
    assert [i for i, w in enumerate(gemma3) if w is None] == [5, 11] and gemma3[0] == 1024
    assert cost.sliding_windows(3, 16) == (16, 16, 16) and cost.sliding_windows(3, None) is None


def test_max_tokens_with_windows_matches_a_loop():
    lay = AttentionLayout(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, windows=(4, None, 6), bytes_per_element=2)
    for limit in (64, 1000, 1024, 5000, 12345):
        fits = [T for T in range(1, 400) if cost.kv_bytes_per_request(lay, T) <= limit]
        assert cost.max_tokens_in_kv(lay, limit) == (max(fits) if fits else 0), limit
    all_windowed = AttentionLayout(d_model=64, n_layers=2, n_heads=4, windows=(4, 4), bytes_per_element=2)
    assert cost.max_tokens_in_kv(all_windowed, 10**6) == cost.UNBOUNDED_TOKENS
    assert cost.max_tokens_in_kv(all_windowed, 3 * 2 * 128 * 2) == 3  # 3 positions in each of 2 layers


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(windows=(4,)), "one per layer"),
        (dict(windows=(4, 0)), "window must be a positive integer"),
        (dict(qk_norm="some"), "unknown qk_norm"),
        (dict(kv_lora_rank=8, qk_norm="full"), "qk_norm describes"),
        (dict(qk_nope_head_dim=8), "give kv_lora_rank"),
    ],
)
def test_bad_new_layout_fields_raise(kwargs, fragment):
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match=fragment):
        AttentionLayout(d_model=64, n_layers=2, n_heads=4, **kwargs)


# ---------------------------------------------------------------------------------------------
# headprobe checkpoint directories: trained (headprobe train) and pruned (prune --save-pruned)
# ---------------------------------------------------------------------------------------------

PRUNINGS = [  # (family, removed heads): the zoo has 2 layers of 4 query heads (GQA: on 2 KV heads)
    ("llama", [(0, 0), (0, 1), (0, 2), (1, 3)]),  # layer 0 keeps head 3 (KV head 1 only); layer 1 3 heads on 2
    ("llama", [(0, 0), (0, 1), (0, 2), (0, 3), (1, 0)]),  # layer 0 loses every head
    ("qwen2", [(0, 1), (1, 2), (1, 3)]),  # q/k/v biases; layer 1 loses KV head 1
    ("qwen3", [(0, 0), (1, 1)]),  # per-head QK-norm
    ("gpt2", [(0, 0), (0, 1), (1, 2)]),  # MHA, every projection biased
    ("gemma2", [(0, 0), (1, 1), (1, 2)]),  # layer 0 sliding-window
]


def _native(family, tokenizer):
    from headprobe.probe.backends.wrapping import wrap

    return wrap(zoo.make_checkpoint(family, tokenizer), backend="native")


@pytest.mark.parametrize("family, removed", PRUNINGS)
def test_budget_reads_a_pruned_directory(family, removed, tiny_tokenizer, tmp_path, capsys):
    """``budget --model DIR`` on prune --save-pruned's directory reports the pruned model's
    real costs (it said to use --backend native, which budget does not take). References: the small model's
    own tensors (its attention parameters, the key and value widths of its k_proj and v_proj) and the
    unpruned layout's uniform formulas."""
    from headprobe.probe.model.pruned import (
        count_attention_parameters,
        keep_mask_from,
        load_pruned_dir,
        remove_heads,
        save_pruned_dir,
    )

    full = _native(family, tiny_tokenizer)
    L, H = full.spec.n_layers, full.spec.n_heads
    d = tmp_path / "pruned_model"
    save_pruned_dir(remove_heads(full.model, keep_mask_from(removed, L, H)), d, tiny_tokenizer)
    T = 100
    code = main(["budget", "--model", str(d), "--seq-len", str(T), "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["check"]["ok"], r["check"]
    small = load_pruned_dir(d)
    p, u = r["pruned"], r["unpruned"]
    assert p["heads_per_layer"] == [H - sum(l == layer for l, _ in removed) for layer in range(L)]
    assert (
        p["attn_params"]
        == count_attention_parameters(small)
        < count_attention_parameters(full.model)
        == u["attn_params"]
    )
    kv_widths = [
        0 if not b.attn.n_kept else b.attn.k_proj.out_features + b.attn.v_proj.out_features for b in small.blocks
    ]
    assert p["kv_numbers_per_token"] == sum(kv_widths)
    windows = r["layout"]["windows"] or [None] * L
    positions = [T if w is None else min(T, w) for w in windows]
    assert p["kv_bytes_per_request"] == sum(n * w for n, w in zip(positions, kv_widths)) * 2  # bf16
    lay = replace(full.spec.layout, bytes_per_element=2)
    assert u["kv_bytes_per_request"] == cost.kv_bytes_per_request(lay, T)
    assert u["flops_scores"] == L * cost.score_flops(lay, T)
    assert p["flops_scores"] == sum(p["heads_per_layer"]) * 2 * T * T * 2 * lay.d_head  # QK^T and AV per head
    code = main(["budget", "--model", str(d)])
    out = capsys.readouterr().out
    assert code == 0 and "OK: the formulas match the model" in out and "pruned" in out and "unpruned" in out


def test_budget_reads_a_trained_directory(tiny_tokenizer, tmp_path, capsys):
    """A headprobe checkpoint (headprobe train's format) is read directly too, with every mode; its KV cache
    is the native model's own (KVCache after a forward pass) and its parameters the model's."""
    from headprobe.probe.model.cache import KVCache

    model = _native("llama", tiny_tokenizer)
    d = tmp_path / "trained"
    d.mkdir()
    model.save(d)
    tiny_tokenizer.save_pretrained(str(d))
    T = 50
    code = main(["budget", "--model", str(d), "--seq-len", str(T), "--dtype", "fp32", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert code == 0 and r["check"]["ok"] and r["check"]["self_check"]["ok"]
    cache = KVCache()
    with torch.no_grad():
        model.model(torch.arange(T)[None], cache=cache)
    assert r["kv_bytes_per_request"] == cache.nbytes
    assert r["attn_params"] == model.attention_parameters()
    assert main(["budget", "--model", str(d), "--compare"]) == 0
    assert "OK: the formulas match the model" in capsys.readouterr().out


@pytest.fixture
def pruned_dir(tiny_tokenizer, tmp_path):
    from headprobe.probe.model.pruned import keep_mask_from, remove_heads, save_pruned_dir

    full = _native("llama", tiny_tokenizer)
    save_pruned_dir(remove_heads(full.model, keep_mask_from([(0, 0), (1, 1)], 2, 4)), tmp_path / "p", tiny_tokenizer)
    return str(tmp_path / "p")


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--compare"], "--compare describes"),
        (["--n-heads", "2", "--flops-table"], "--n-heads, --flops-table describe"),
    ],
)
def test_uniform_layout_flags_on_a_pruned_directory_are_one_line(pruned_dir, flags, named, capsys):
    code = main(["budget", "--model", pruned_dir, *flags])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("headprobe: error: ") and named in err and "pruned model" in err


def test_a_wrong_pruned_formula_is_a_mismatch(pruned_dir, capsys, monkeypatch):
    """The check can fail: a per-layer formula off by one number disagrees with the small model (exit 1)."""
    real = cost.layer_cost
    monkeypatch.setattr(cost, "layer_cost", lambda *args: real(*args) + 1)
    code = main(["budget", "--model", pruned_dir])
    out = capsys.readouterr().out
    assert code == 1 and "MISMATCH: the formulas disagree with the model" in out
    # the row that disagrees shows both lists; the rows that agree say "= measured" (not the list twice)
    params = next(x for x in out.splitlines() if x.startswith("attention params per layer"))
    assert "= measured" not in params and params.count(" x ") >= 2
    assert next(x for x in out.splitlines() if x.startswith("query heads per layer")).endswith("= measured")


def test_live_check_names_the_backend_it_loads(tiny_dir, capsys, monkeypatch):
    """The header names the backend of the model budget actually loaded (recorded at the load), and
    the backend the other commands pick for it (``auto``: the first whose ``supports`` takes the config)."""
    from transformers import AutoConfig

    from headprobe.probe.backends import loading
    from headprobe.probe.core.vocabulary import backend_class
    from headprobe.probe.layout.spec import BACKEND_LABELS

    loaded = []
    real = loading.load_model
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: loaded.append(real(*a, **k)) or loaded[-1])
    code = main(["budget", "--model", str(tiny_dir)])
    out = capsys.readouterr().out
    (model,) = loaded
    used = BACKEND_LABELS[type(model).name]
    default = BACKEND_LABELS[backend_class("auto", lambda: AutoConfig.from_pretrained(tiny_dir)).name]
    assert code == 0 and used == "TransformerLens" and default == "native"  # the case this test is about
    backend_lines = [line for line in out.splitlines() if line.startswith("backend: ")]
    assert len(backend_lines) == 1, out
    assert backend_lines[0].startswith(f"backend: {used} ") and f"run this model on the {default} backend" in out


def test_a_length_beyond_the_models_context_is_noted(zoo_dirs, capsys):
    """``budget --model smollm2-135m --seq-len 32768`` (4x its context) printed the costs without a
    word; the context is the model's config's ``max_position_embeddings``, read here by hand."""
    from transformers import AutoConfig

    d = zoo_dirs("llama")
    n_ctx = AutoConfig.from_pretrained(d).max_position_embeddings
    for seq_len, noted in ((n_ctx, False), (n_ctx + 1, True)):
        main(["budget", "--model", d, "--seq-len", str(seq_len)])
        out = capsys.readouterr().out
        assert (f"NOTE: {n_ctx + 1:,} tokens is beyond the model's context of {n_ctx:,} (n_ctx)" in out) == noted
        main(["budget", "--model", d, "--seq-len", str(seq_len), "--json"])
        r = json.loads(capsys.readouterr().out)
        assert r.get("beyond_context") == ({"seq_len": seq_len, "n_ctx": n_ctx} if noted else None)
    main(["budget", "--model", d, "--flops-table", "64", str(2 * n_ctx)])
    assert f"NOTE: {2 * n_ctx:,} tokens is beyond" in capsys.readouterr().out
