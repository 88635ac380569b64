"""``headprobe budget``'s modes agree with each other and refuse what they would ignore.

* ``--flops-table`` and ``--compare`` cost sliding windows as the one-layout report does (each
  query reads ``min(W, pos + 1)`` keys), checked against the report and a loop over positions;
* ``--recommend``'s sentence on MLA names the GQA caches it falls between, from the bytes;
* a flag of another mode is one line and exit 2, not silently ignored;
* ``--policy``'s notes say which keys its FLOPs count;
* every output block of docs/budget.md is what the command prints, line for line.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

from headprobe.cli import main
from headprobe.commands import budget
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout import cost
from headprobe.probe.layout.attention import KVPolicy, Streaming

ROOT = Path(__file__).resolve().parents[1]

# Mistral 7B's attention (config.json of mistralai/Mistral-7B-v0.1): D 4096, 32 heads of 128, 8 KV heads, W 4096
D, H, DH, W, T = 4096, 32, 128, 4096, 32768
MISTRAL = ["--d-model", "4096", "--n-layers", "32", "--n-heads", "32", "--n-kv-heads", "8", "--sliding-window", "4096"]


def run_cli(capsys, *argv):
    code = main(["budget", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def budget_json(capsys, *argv):
    code, out, err = run_cli(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def keys_per_head(seq_len, window):
    """(query, key) pairs one head scores: every score of the T x T matrix on a global layer, the
    keys each query reads, min(W, pos + 1), on a windowed one (a loop over positions)."""
    return seq_len * seq_len if window is None else sum(min(window, pos + 1) for pos in range(seq_len))


def hand_scores(seq_len, window, n_heads=H, d_head=DH):
    return 2 * n_heads * keys_per_head(seq_len, window) * (d_head + d_head)  # QK^T and AV


def hand_projections(seq_len, n_kv_heads, d_model=D, n_heads=H, d_head=DH):
    return 2 * seq_len * (2 * d_model * n_heads * d_head + 2 * d_model * n_kv_heads * d_head)  # W_Q, W_O; W_K, W_V


def report_scores(report):
    """window -> scores + AV FLOPs of one layer, as the one-layout report prints them."""
    out = {w["window"]: w["flops_scores_per_layer"] for w in report.get("windowed_layers", [])}
    if report.get("n_global_layers", 1):
        out[None] = report["flops_scores_per_layer"]
    return out


LAYOUTS = {
    "mistral-7b": ["--preset", "mistral-7b"],
    "global every 2": [*MISTRAL, "--global-every", "2"],
    "llama3-8b (no window)": ["--preset", "llama3-8b"],
}
WINDOWS = {"mistral-7b": [W], "global every 2": [None, W], "llama3-8b (no window)": [None]}


@pytest.mark.parametrize("name", LAYOUTS)
def test_flops_table_rows_are_the_reports_windowed_flops(capsys, name):
    """Mistral 7B at T = 32,768: W(W+1)/2 + (T-W) W = 125,831,168 keys a head, 2.06 TFLOP of
    scores per layer, in the flops table as in the report (not the 17.6 of a global layer)."""
    argv = LAYOUTS[name]
    assert keys_per_head(T, W) == W * (W + 1) // 2 + (T - W) * W == 125_831_168
    rows = budget_json(capsys, *argv, "--flops-table", "1024", str(T))["flops"]
    for r in rows:
        window = r.get("window", WINDOWS[name][0])  # a row names its kind of layer
        assert r["scores"] == hand_scores(r["seq_len"], window)
        report = budget_json(capsys, *argv, "--seq-len", str(r["seq_len"]))
        assert r["scores"] == report_scores(report)[window]
        assert r["projections"] == report["flops_projections_per_layer"] == hand_projections(r["seq_len"], 8)
        assert r["crossover_seq_len"] == cost.crossover_seq_len(cost.preset("llama3-8b"), window)
    assert [(r["seq_len"], r["window"]) for r in rows] == [(t, w) for t in (1024, T) for w in WINDOWS[name]]
    _, text, _ = run_cli(capsys, *argv, "--flops-table", str(T))
    if W in WINDOWS[name]:
        line = next(x for x in text.splitlines() if "window 4,096" in x and x.startswith("32,768"))
        assert line.split()[-3:] == ["2.75", "2.06", "43%"]
        assert "window 4,096: the two are never equal" in text  # s W = 64 Mi FLOPs <= p = 80 Mi
    assert ("the two are equal at T = 5,120" in text) == (None in WINDOWS[name])


@pytest.mark.parametrize("name", LAYOUTS)
def test_compare_rows_are_the_reports_windowed_flops(capsys, name):
    """Each --compare row's FLOPs per layer (projections + scores + AV) is the report's for that
    KV-head count: the GQA-8 row of Mistral 7B at 32,768 tokens is 2.75 + 2.06 = 4.81 TFLOP."""
    argv = LAYOUTS[name]
    rows = budget_json(capsys, *argv, "--compare", "--seq-len", str(T))["compare"]
    for r in rows:
        report = budget_json(capsys, *argv, "--n-kv-heads", str(r["n_kv_heads"]), "--seq-len", str(T))
        kinds = r.get(
            "flops_per_layer_by_window", [{"window": WINDOWS[name][0], "flops_per_layer": r["flops_per_layer"]}]
        )
        for k in kinds:
            assert k["flops_per_layer"] == hand_projections(T, r["n_kv_heads"]) + hand_scores(T, k["window"])
            assert k["flops_per_layer"] == report["flops_projections_per_layer"] + report_scores(report)[k["window"]]
        assert [k["window"] for k in kinds] == WINDOWS[name]
        assert r["flops_per_layer"] == (kinds[0]["flops_per_layer"] if len(kinds) == 1 else None)
        assert r["kv_bytes_per_request"] == report["kv_bytes_per_request"]
        # the attention matrix and the fused kernel's memory of one layer, as the report gives them and by hand
        # (bf16; batch 1): [head, q, k] weights of a global layer (else the window's band); Q, K, V, out, LSE
        matrix = report["attention_matrix_bytes_per_layer"] if None in WINDOWS[name] else None
        if matrix is None:
            (banded,) = report["windowed_layers"]
            matrix = banded["attention_matrix_bytes_per_layer"]
        assert r["attention_matrix_bytes_per_layer"] == matrix == H * keys_per_head(T, WINDOWS[name][0]) * 2
        assert r["fused_attention_bytes_per_layer"] == report["fused_attention_bytes_per_layer"]
        assert r["fused_attention_bytes_per_layer"] == T * (2 * H * DH + 2 * r["n_kv_heads"] * DH) * 2 + T * H * 4
    if name == "mistral-7b":
        gqa8 = next(r for r in rows if r["n_kv_heads"] == 8)
        assert gqa8["flops_per_layer"] == 2_748_779_069_440 + 2_061_617_856_512  # 4.81 TFLOP, not 20.3
        _, text, _ = run_cli(capsys, *argv, "--compare", "--seq-len", str(T))
        assert "FLOPs/layer, window 4,096" in text
        line = next(x for x in text.splitlines() if x.split()[:2] == ["GQA", "8"])
        assert "4.81 TFLOP" in line, line
        assert "attn matrix/layer, window 4,096" in text
        assert line.split()[-4:] == [
            *cost.format_bytes(matrix).split(),
            *cost.format_bytes(gqa8["fused_attention_bytes_per_layer"]).split(),
        ], line


@pytest.mark.parametrize(
    "d_model, n_layers, seq_len, limit, expected",
    [
        # 56 heads of 128; MLA caches 512 + 64 = 576 numbers a token and layer, GQA-k 2 k 128
        (7168, 61, 131072, 10 * cost.GIB, ((2, "GQA-2"), (4, "GQA-4"))),
        # 17 heads of 64 (17 is prime): MLA's 256 + 32 = 288 lies between MQA's 128 and MHA's 2,176
        (1088, 4, 4096, None, ((1, "MQA"), (17, "MHA"))),
    ],
)
def test_recommend_names_the_gqa_caches_mla_falls_between(d_model, n_layers, seq_len, limit, expected):
    rec = cost.recommend(
        d_model=d_model, n_layers=n_layers, seq_len=seq_len, kv_limit_bytes=limit, target="long-context"
    )
    assert rec.use_mla
    d_head = 128 if d_model >= 2048 else 64
    mla = n_layers * seq_len * (4 * d_head + d_head // 2) * 2
    (lo, lo_name), (hi, hi_name) = expected
    lo_bytes, hi_bytes = (n_layers * seq_len * 2 * k * d_head * 2 for k in (lo, hi))
    assert lo_bytes < mla < hi_bytes and rec.kv_bytes_per_request == mla
    assert (
        f"for a cache between {lo_name} ({cost.format_bytes(lo_bytes)}) and {hi_name} ({cost.format_bytes(hi_bytes)})"
        in rec.explanation[-1]
    )


@pytest.mark.parametrize(
    "argv, flag, mode",
    [
        (["--preset", "llama3-8b", "--kv-limit", "2GiB"], "--kv-limit", "--recommend"),
        (["--preset", "llama3-8b", "--params", "8B"], "--params", "--recommend"),
        (["--preset", "llama3-8b", "--target", "edge"], "--target", "--recommend"),
        (["--preset", "llama3-8b", "--target", "gpu-server"], "--target", "--recommend"),
        (["--preset", "llama3-8b", "--compare", "--kv-limit", "2GiB"], "--kv-limit", "--recommend"),
        (["--preset", "llama3-8b", "--as-mha"], "--as-mha", "--flops-table"),
        (["--preset", "llama3-8b", "--compare", "--as-mha"], "--as-mha", "--flops-table"),
        (["--recommend", "--params", "8B", "--policy", "/nonexistent.json"], "--policy", "the one-layout report"),
        (["--preset", "llama3-8b", "--compare", "--policy", "/nonexistent.json"], "--policy", "the one-layout report"),
        (["--recommend", "--preset", "llama3-8b"], "--preset", "the one-layout report, --compare or --flops-table"),
        (["--recommend", "--params", "8B", "--n-kv-heads", "2"], "--n-kv-heads", "the one-layout report"),
        (["--recommend", "--params", "8B", "--sliding-window", "512"], "--sliding-window", "the one-layout report"),
        # the table takes its lengths after --flops-table; a --seq-len beside it (8192 too, the default) was ignored
        (["--preset", "llama3-8b", "--flops-table", "--seq-len", "4096"], "--seq-len", "the one-layout report"),
        (["--preset", "llama3-8b", "--flops-table", "1024", "--seq-len", "8192"], "--seq-len", "the one-layout report"),
    ],
)
def test_a_flag_of_another_mode_is_refused_naming_it_and_its_mode(capsys, argv, flag, mode):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1, (code, out, err)
    assert err.startswith(f"headprobe: error: {flag} belongs to {mode}"), err


def test_the_flags_of_each_mode_still_run(capsys):
    """What the refusal must not catch: each flag in its own mode."""
    assert run_cli(capsys, "--recommend", "--params", "8B", "--kv-limit", "2GiB", "--target", "edge")[0] == 0
    assert run_cli(capsys, "--preset", "llama3-8b", "--flops-table", "--as-mha")[0] == 0
    assert run_cli(capsys, "--recommend", "--d-model", "4096", "--n-layers", "32", "--dtype", "fp8")[0] == 0
    for mode in (["--preset", "llama3-8b"], ["--preset", "llama3-8b", "--compare"], ["--recommend", "--params", "8B"]):
        assert run_cli(capsys, *mode, "--seq-len", "4096")[0] == 0  # --seq-len in its three modes


def test_the_seq_len_refusal_with_a_flops_table_says_where_the_lengths_go(capsys):
    """``--seq-len`` with ``--flops-table`` is refused, not ignored (its default could not be told
    from a given 8192); the line shows the table with that length, which then runs; the Python
    API refuses it too and reports the default T where none is given."""
    code, out, err = run_cli(capsys, "--preset", "llama3-8b", "--flops-table", "--seq-len", "4096")
    assert code == 2 and out == ""
    assert err.strip().endswith("give the lengths after --flops-table (--flops-table 4096) and leave --seq-len out")
    code, out, _ = run_cli(capsys, "--preset", "llama3-8b", "--flops-table", "4096")
    assert code == 0 and re.search(r"^\s*4,096 ", out, re.M)
    with pytest.raises(HeadprobeError, match="--seq-len belongs to"):
        budget.budget(preset="llama3-8b", flops_table=(1024,), seq_len=8192)
    result = budget.budget(preset="llama3-8b")
    assert result.config.seq_len is None and result.data["workload"]["seq_len"] == budget.DEFAULT_SEQ_LEN == 8192


@pytest.mark.parametrize(
    "argv, full_note",
    [
        (["--preset", "mistral-7b"], "min(4,096, pos+1)"),
        (["--preset", "llama3-8b"], "pos+1"),
        ([*MISTRAL, "--global-every", "2"], "pos+1 on 16 global layers, min(4,096, pos+1) on 16 windowed layers"),
    ],
)
def test_policy_notes_name_the_keys_its_flops_count(tmp_path, capsys, argv, full_note):
    """The all-full FLOPs are n_kv_groups x group_size heads x 2 (d_qk + d_head) per key, summed
    over layers of the causal keys each layer's query reads (min(W, pos+1) windowed, pos+1 global),
    and the note says exactly that count."""
    policy = KVPolicy.with_full(32, 8, [(layer, 0) for layer in range(32)], Streaming(4, 1020))
    path = tmp_path / "policy.json"
    path.write_text(json.dumps(policy.to_dict()))
    r = budget_json(capsys, *argv, "--seq-len", "8192", "--policy", str(path))
    windows = r["layout"]["windows"] or [None] * 32
    keys = sum(sum(min(w or 8192, pos + 1) for pos in range(8192)) for w in windows)
    assert r["policy"]["flops_scores_full"] == 2 * H * keys * 2 * DH
    _, text, _ = run_cli(capsys, *argv, "--seq-len", "8192", "--policy", str(path))
    full_row = next(x for x in text.splitlines() if x.startswith("scores + AV FLOPs, all layers, full"))
    assert full_row.endswith(f"causal keys: {full_note}"), full_row


def doc_blocks(page: Path = ROOT / "docs" / "budget.md"):
    """(command, expected lines) for each ``$ headprobe budget`` block of the page that needs no model."""
    blocks, lines = [], page.read_text(encoding="utf-8").split("\n")
    starts = [i for i, x in enumerate(lines) if x.startswith("$ headprobe budget") and "--model" not in x]
    for i in starts:
        end = lines.index("```", i)
        blocks.append((lines[i], lines[i + 1 : end]))
    return blocks


@pytest.mark.parametrize("command, expected", doc_blocks(), ids=[c for c, _ in doc_blocks()])
def test_docs_blocks_are_the_commands_output_line_for_line(capsys, command, expected):
    """A block that starts with ``...`` shows the output's last lines."""
    code, out, err = run_cli(capsys, *shlex.split(command)[3:])
    assert code in (0, 1), err
    got = out.rstrip("\n").split("\n")
    if expected[:1] == ["..."]:
        expected, got = expected[1:], got[-(len(expected) - 1) :]
    assert got == expected


def test_divisors_are_every_divisor_largest_first():
    """Against trial division up to n (the old loop, the reference) for 1..600, and a large
    composite whose divisors are known (2^40 * 3: 41 * 2 of them) in O(sqrt n) steps."""
    from headprobe.probe.layout.cost import divisors

    for n in range(1, 601):
        assert divisors(n) == [d for d in range(n, 0, -1) if n % d == 0]
    big = divisors(2**40 * 3)
    assert len(big) == 82 and big[0] == 2**40 * 3 and big[-1] == 1 and big == sorted(big, reverse=True)


def test_kv_positions_total_is_the_sum_over_layers():
    from headprobe.probe.layout.attention import AttentionLayout
    from headprobe.probe.layout.cost import kv_positions, kv_positions_total

    layouts = [
        AttentionLayout(d_model=64, n_layers=6, n_heads=4),
        AttentionLayout(d_model=64, n_layers=6, n_heads=4, head_layers=(0, 2, 5)),
        AttentionLayout(d_model=64, n_layers=4, n_heads=4, windows=(8, None, 3, None)),
        AttentionLayout(d_model=64, n_layers=4, n_heads=4, windows=(8, None, 3, None), head_layers=(1, 2)),
    ]
    for lay in layouts:
        for seq_len in (1, 5, 16):
            assert kv_positions_total(lay, seq_len) == sum(kv_positions(lay, seq_len))
        assert lay.n_attention_layers == len(lay.attention_layers)


def test_recommend_for_a_huge_budget_builds_no_list_per_layer_or_head(monkeypatch):
    """``budget --recommend --params 1e30`` took 4.5 minutes (a layout of 1.7e8 layers and 1.7e8
    heads: kv_positions' list of every layer, divisors' loop to n_heads). Now neither runs: the
    count is ``n_layers * seq_len`` and the KV heads tried are the divisors up to the cap. Old code:
    the stubs below raise."""
    from headprobe.probe.layout import cost

    def refused(*a, **k):
        raise AssertionError("a list of every layer, or a loop over every head count")

    monkeypatch.setattr(cost, "kv_positions", refused)
    monkeypatch.setattr(cost, "divisors", refused)
    rec = cost.recommend(seq_len=8192, n_params=10**30, kv_limit_bytes=2**50)
    assert rec.layout.n_layers > 10**8 and rec.layout.n_heads > 10**8
    assert rec.kv_bytes_per_request == rec.layout.n_layers * 8192 * cost.kv_numbers_per_token_per_layer(rec.layout) * 2


def test_recommends_kv_heads_from_the_divisors_up_to_the_cap():
    """The largest divisor of n_heads not above the cap, as the old filter of every divisor chose."""
    from headprobe.probe.layout.cost import divisors, recommend

    for n_params in (135 * 10**6, 10**9, 8 * 10**9, 70 * 10**9):
        for target in ("gpu-server", "edge"):
            rec = recommend(seq_len=4096, n_params=n_params, target=target)
            cap = {"gpu-server": 8, "edge": 4}[target]
            want = [k for k in divisors(rec.layout.n_heads) if k <= cap][0]
            assert rec.use_mla or rec.layout.n_kv_heads == want, (n_params, target)


def test_divisors_beyond_the_bound_are_refused_in_one_line_not_looped(capsys):
    """``budget --compare --n-heads 10**18`` looped 1e9 times in divisors() (39 s and exit 0
    on the old code); now one line, exit 2, at once. At the bound (10**13 heads) it still runs and
    lists every divisor (2^13 * 5^13: 14 * 14 of them)."""
    import time

    big = str(10**18)
    t0 = time.perf_counter()
    code = main(
        ["budget", "--compare", "--d-model", str(2 * 10**18), "--n-layers", "2", "--n-heads", big, "--d-head", "2"]
    )
    assert code == 2 and time.perf_counter() - t0 < 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compared for at most 10,000,000,000,000 heads" in err[0], err
    assert len(cost.divisors(cost.MAX_DIVIDED_HEADS)) == 196
    with pytest.raises(HeadprobeError, match="compared for at most"):
        cost.divisors(cost.MAX_DIVIDED_HEADS + 1)


def test_sliding_windows_beyond_the_bound_are_refused_and_at_it_are_built(capsys):
    """A windowed layout is costed layer by layer: 1e6 layers took 2.8-5.3 s and 141 MB (old code: exit 0). Above
    MAX_WINDOWED_LAYERS (1e5) one line, exit 2; at it, the tuple is still one window per layer
    (the reference: Gemma 2's pattern written out)."""
    n = 100_000
    assert (
        main(["budget", "--d-model", "4096", "--n-layers", str(n + 1), "--n-heads", "32", "--sliding-window", "8"]) == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("headprobe: error: --n-layers 100,001 with --sliding-window"), err
    assert cost.MAX_WINDOWED_LAYERS == n
    windows = cost.sliding_windows(n, 8, 2)
    assert windows is not None and len(windows) == n and windows[:4] == (8, None, 8, None)
    assert windows.count(None) == n // 2


def test_compare_prints_each_layouts_flops_apart(capsys):
    """SmolLM2-135M at 8,192 tokens: MHA 176.3, GQA 169.1, MQA 166.7 GFLOP per layer (by hand: Q and O
    2TD(H dh) each, K and V 2TD(n_kv dh) each, scores + AV 4T^2(H dh)) printed 0.18, 0.17, 0.17 TFLOP;
    each now prints apart, within half its last digit of the count."""
    T, D, H, dh = 8192, 576, 9, 64
    want = {n: 2 * 2 * T * D * H * dh + 2 * 2 * T * D * n * dh + 4 * T * T * H * dh for n in (9, 3, 1)}
    code, out, err = run_cli(capsys, "--preset", "smollm2-135m", "--compare", "--seq-len", str(T))
    assert code == 0, err
    rows = [x.split() for x in out.splitlines() if x.split()[:1] in (["MHA"], ["GQA"], ["MQA"])]
    printed = {int(r[1]): r[-6] for r in rows}  # the FLOPs column, before the two memory columns
    assert [r[-5] for r in rows] == ["TFLOP"] * 3 and len(set(printed.values())) == 3, printed
    for n, text in printed.items():
        step = 10.0 ** -len(text.partition(".")[2])
        assert abs(float(text) * 1e12 - want[n]) <= step / 2 * 1e12, (n, text, want[n])


def test_the_kv_cache_row_names_the_whole_batch(capsys):
    """``--batch 4 --seq-len 2048`` printed "KV cache per request (4 x 2048 tokens)  180 MiB": the
    cache of all 4 sequences (4 x 2048 x 30 layers x 384 numbers x 2 bytes), read as one's."""
    code, out, err = run_cli(capsys, "--preset", "smollm2-135m", "--seq-len", "2048", "--batch", "4")
    assert code == 0, err
    (row,) = [x for x in out.splitlines() if x.startswith("KV cache, ")]
    assert row.startswith("KV cache, 4 sequences x 2048 tokens ") and cost.format_bytes(4 * 2048 * 30 * 384 * 2) in row
    assert cost.format_bytes(4 * 2048 * 30 * 384 * 2) == "180 MiB"
