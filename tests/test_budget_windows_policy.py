"""``headprobe budget`` with sliding windows (FLOPs, attention-matrix bytes and crossover of the
keys each query reads, min(W, pos+1)) and with a head-level KV policy (``--policy FILE``),
checked against hand-computed numbers and plain loops over positions and groups."""

from __future__ import annotations

import json

import pytest

from headprobe.cli import main
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout import cost
from headprobe.probe.layout.attention import KVPolicy, Streaming
from headprobe.probe.layout.cost import AttentionLayout

MISTRAL = ["--d-model", "4096", "--n-layers", "32", "--n-heads", "32", "--n-kv-heads", "8", "--d-head", "128"]


def budget_json(capsys, *argv):
    code = main(["budget", *argv, "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_mistral_7b_window_4096_at_32k_by_hand(capsys):
    r = budget_json(capsys, *MISTRAL, "--sliding-window", "4096", "--seq-len", "32768")
    T, W = 32768, 4096
    keys = sum(min(W, pos + 1) for pos in range(T))  # each query reads min(W, pos+1) keys
    assert keys == 4096 * 4097 // 2 + (T - W) * W == 125_831_168
    assert r["kv_bytes_per_request"] == 32 * W * 8 * 2 * 128 * 2 == 512 * 2**20  # 512 MiB
    (w,) = r["windowed_layers"]
    assert w["window"] == W and w["n_layers"] == 32
    # QK^T and AV: 2 FLOPs per multiply-add, (128 + 128) per key, 32 query heads
    assert w["flops_scores_per_layer"] == 2 * 32 * keys * 256 == 2_061_617_856_512  # 2.06 TFLOP (17.6 full)
    assert r["flops_scores_per_layer"] == 2 * 32 * T * T * 256  # the full-attention row stays
    assert r["flops_scores_all_layers"] == 32 * w["flops_scores_per_layer"]
    assert w["attention_matrix_bytes_per_layer"] == 32 * keys * 2  # 7.5 GiB in bf16, not 64 GiB
    proj = r["flops_projections_per_layer"]
    assert proj == 2 * T * (4096 * 4096 * 2 + 2 * 4096 * 1024)
    # projections 2*(2*4096^2 + 2*4096*1024) = 83.9 MFLOP per token; a windowed query's scores
    # are at most 2*32*256*4096 = 67.1 MFLOP: the scores never catch up
    assert w["crossover_seq_len"] is None
    assert w["quadratic_share"] == pytest.approx(w["flops_scores_per_layer"] / (w["flops_scores_per_layer"] + proj))


def test_a_window_as_long_as_the_sequence_costs_what_a_global_layer_costs(capsys):
    """Totals that mix global and windowed layers (or full and streaming groups) count one way on
    every layer, the keys each query sees under the causal mask: a global layer counted T**2 beside
    windowed ones counted min(W, pos+1), so a window of T halved the cost of a layer it leaves as is."""
    T = 4096
    mixed = budget_json(capsys, *MISTRAL, "--sliding-window", str(T), "--global-every", "2", "--seq-len", str(T))
    every = budget_json(capsys, *MISTRAL, "--sliding-window", str(T), "--seq-len", str(T))
    assert mixed["flops_scores_all_layers"] == every["flops_scores_all_layers"]
    assert every["flops_scores_all_layers"] == 32 * 2 * 32 * sum(pos + 1 for pos in range(T)) * 256  # a loop
    lay = cost.preset("llama3-8b")
    everyone_full = KVPolicy.uniform(32, 8)
    window_of_t = KVPolicy.with_full(32, 8, [], Streaming(4, T))  # sink + window cover every key
    full, streamed = cost.policy_cost(lay, everyone_full, T), cost.policy_cost(lay, window_of_t, T)
    assert full.flops_scores == full.flops_scores_full == streamed.flops_scores


@pytest.mark.parametrize("window", [200, 512, 100_000])
def test_windowed_crossover_is_where_a_loop_finds_it(window):
    lay = AttentionLayout(d_model=64, n_layers=1, n_heads=4, bytes_per_element=4)
    t = cost.crossover_seq_len(lay, window=window)
    first = next(T for T in range(1, 5000) if cost.score_flops(lay, T, window=window) >= cost.projection_flops(lay, T))
    assert t is not None and first == pytest.approx(t, abs=1) and first >= t


def test_visible_keys_loop_and_errors():
    for T in (1, 5, 17):
        for W in (1, 3, 17, 40):
            assert cost.visible_keys(T, W) == sum(min(W, p + 1) for p in range(T))
        assert cost.visible_keys(T) == T * T
    with pytest.raises(HeadprobeError, match="window"):
        cost.visible_keys(4, 0)


def _loop_policy_cost(lay, policy, T):
    """Bytes and FLOPs summed group by group, position by position (no closed forms)."""
    kv = flops = 0
    per_pos = (lay.d_head * 2 if not lay.is_mla else lay.kv_lora_rank + lay.qk_rope_head_dim) * lay.bytes_per_element
    heads = lay.n_heads // policy.n_kv_groups
    for row in policy.groups:
        for s in row:
            kept = T if s is None else len({*range(min(s.sink, T)), *range(max(0, T - s.window), T)})
            kv += kept * per_pos
            for q in range(T):
                seen = q + 1 if s is None else len({k for k in range(q + 1) if k < s.sink or k > q - s.window})
                flops += heads * 2 * seen * (lay.d_qk + lay.d_head)  # the causal keys, full or streaming
    return kv, flops


@pytest.mark.parametrize("kind", ["MHA", "GQA", "MQA", "MLA"])
def test_policy_cost_equals_a_loop(kind):
    kv_heads = {"MHA": 4, "GQA": 2, "MQA": 1, "MLA": None}[kind]
    lay = (
        AttentionLayout(d_model=32, n_layers=3, n_heads=4, kv_lora_rank=8, qk_rope_head_dim=4, bytes_per_element=4)
        if kind == "MLA"
        else AttentionLayout(d_model=32, n_layers=3, n_heads=4, n_kv_heads=kv_heads, bytes_per_element=4)
    )
    G = cost.n_kv_groups(lay)
    policy = KVPolicy.with_full(3, G, [(0, 0), (2, G - 1)], Streaming(2, 5))
    for T in (3, 7, 30):
        pc = cost.policy_cost(lay, policy, T)
        assert (pc.kv_bytes, pc.flops_scores) == _loop_policy_cost(lay, policy, T)
        assert pc.kv_bytes_full == cost.kv_bytes_per_request(lay, T)
        assert pc.flops_scores_full == 3 * cost.score_flops(lay, T, window=T)  # causal: T(T+1)/2 keys a head


def test_policy_file_round_trip_and_cli(tmp_path, capsys):
    policy = KVPolicy.with_full(32, 8, [(layer, 0) for layer in range(32)], Streaming(4, 1020), model="mistral")
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(policy.to_dict()))
    assert KVPolicy.from_dict(json.loads(path.read_text())) == policy
    r = budget_json(capsys, *MISTRAL, "--seq-len", "32768", "--policy", str(path))
    # 32 full groups of 32768 positions, 224 streaming of 1024, 256 numbers of 2 bytes each
    assert r["policy"]["kv_bytes"] == (32 * 32768 + 224 * 1024) * 256 * 2 == 654_311_424
    assert r["policy"]["kv_bytes_full"] == r["kv_bytes_per_request"]


@pytest.mark.parametrize("beside", ["itself", "policy_budget.json", "none"])
def test_a_policy_costed_at_another_length_says_where_its_quality_was_measured(tmp_path, capsys, beside):
    """``budget --policy`` of a policy measured at 1,024 tokens, at 32,768, printed "KV cache fraction
    0.4245" with no word that its window (128) was 1/8 of the measured sequence and is 1/256 here: a
    NOTE under the header (and ``policy_measured`` in --json) gives both shares, the length read from
    the file (kv writes measured_seq_len), else from a kv run's policy_budget.json beside it, else "not
    recorded"; none at the measured length."""
    d = KVPolicy.with_full(32, 8, [(layer, 0) for layer in range(32)], Streaming(4, 124)).to_dict()
    if beside == "itself":
        d["measured_seq_len"] = 1024
    elif beside == "policy_budget.json":
        (tmp_path / beside).write_text(json.dumps({"layout": {}, "seq_len": 1024}))
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(d))
    note = {  # (4 + 124) / 1024 = 12.5%, / 32768 = 0.391%
        "none": "NOTE: the length this policy's quality was measured at is not recorded (headprobe kv's "
        "policy.json records it; sink 4 + window 124)",
    }.get(beside, "NOTE: this policy's quality was measured at 1,024 tokens (sink 4 + window 124 = 12.5% of it)")
    note += "; at 32,768 tokens the window is 0.391%: the cost is exact, the quality is not measured at this length"
    assert main(["budget", *MISTRAL, "--seq-len", "32768", "--policy", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[lines.index(f"KV policy {path}") + 1] == note
    r = budget_json(capsys, *MISTRAL, "--seq-len", "32768", "--policy", str(path))
    assert r["policy_measured"]["note"] == note.removeprefix("NOTE: ")
    assert r["policy_measured"]["seq_len"] == (None if beside == "none" else 1024)
    if beside != "none":  # at the measured length: nothing to say
        assert (
            budget_json(capsys, *MISTRAL, "--seq-len", "1024", "--policy", str(path))["policy_measured"]["note"] is None
        )


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.update(format="x"), "not a KV policy file"),
        (lambda d: d["groups"].pop(), "groups are not listed"),
        (lambda d: d["groups"].append(dict(d["groups"][0])), "listed twice"),
        (lambda d: d["groups"][1].update(window=0), "window must be a positive integer"),
        # the file and the group named, as the other policy errors name them (it named neither)
        (lambda d: d["groups"][1].update(window=0), "p.json: group (layer 0, kv_group 1): a streaming group's window"),
        (
            lambda d: d["groups"][3].update(window=1.5),
            "p.json: group (layer 1, kv_group 1): a streaming group's sink must be",
        ),
        (lambda d: d.update(n_layers=3), "has 2 layers x 2 KV groups"),
    ],
)
def test_bad_policy_files_are_one_line_errors(tmp_path, capsys, edit, message):
    d = KVPolicy.with_full(2, 2, [(0, 0)], Streaming(1, 4)).to_dict()
    edit(d)
    if message.startswith("has"):
        d = KVPolicy.with_full(3, 2, [(0, 0)], Streaming(1, 4)).to_dict()
        message = "the KV policy has 3 layers x 2 KV groups; the layout has 2 x 2"
    path = tmp_path / "p.json"
    path.write_text(json.dumps(d))
    code = main(
        ["budget", "--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--n-kv-heads", "2", "--policy", str(path)]
    )
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err


def test_mistral_7b_preset_is_its_published_layout_and_prints_no_global_layer(capsys):
    """Mistral-7B-v0.1's config.json: 32 layers of 32 query heads and 8 KV heads of 128, sliding
    window 4096 on every layer. With no global layer, the text report has no "global layer" rows
    (they described a layer the model does not have)."""
    lay = cost.preset("mistral-7b")
    assert (lay.d_model, lay.n_layers, lay.n_heads, lay.n_kv_heads, lay.d_head, lay.bias) == (
        4096,
        32,
        32,
        8,
        128,
        "none",
    )
    assert lay.windows == tuple([4096] * 32)
    by_flags = budget_json(capsys, *MISTRAL, "--sliding-window", "4096", "--seq-len", "32768")
    by_preset = budget_json(capsys, "--preset", "mistral-7b", "--seq-len", "32768")
    # the preset adds its whole-model rows (MLP, vocabulary: cost.MODEL_SHAPES), which flags cannot give
    whole = {"model_params", "model_params_by_part", "model_params_non_embedding", "tied_embeddings"}
    whole |= {"forward_flops_per_token", "forward_flops_per_token_attention_context"}
    assert whole <= set(by_preset) and not whole & set(by_flags)
    strip = lambda r: {k: v for k, v in r.items() if k != "layout" and k not in whole}
    assert strip(by_preset) == strip(by_flags) and by_preset["n_global_layers"] == 0
    assert main(["budget", "--preset", "mistral-7b", "--seq-len", "32768"]) == 0
    text = capsys.readouterr().out
    assert "global layer" not in text and "[batch, head, T, T]" not in text
    assert "window 4,096" in text and "512 MiB" in text
    # a layout with global layers keeps them, named as such
    assert main(["budget", *MISTRAL, "--sliding-window", "4096", "--global-every", "2", "--seq-len", "32768"]) == 0
    labels = [line.split("  ")[0] for line in capsys.readouterr().out.splitlines()]
    assert sum(label.endswith(", global layer") for label in labels) == 4  # per layer; then "global layers (x16)"
