"""benchmarks/scale.py with --tiny (as on a CPU): every step of the table with finite numbers, and its
FLOP floor by three identities (the formula against probe/layout/cost.py's attention FLOPs plus a hand
count of the MLP and unembedding; against torch's FLOP counter on the real sweep; the printed fraction
against the printed FLOPs, rate and time)."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

from headprobe.probe.layout.attention import AttentionLayout
from headprobe.probe.layout.cost import attention_flops

ROOT = Path(__file__).resolve().parents[1]


def _scale():
    spec = importlib.util.spec_from_file_location("scale_benchmark", ROOT / "benchmarks" / "scale.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sweep_flops_against_cost_and_hand_count():
    scale = _scale()
    L, D, M, H, KV, dh, V, T, B = 3, 64, 96, 8, 2, 8, 50, 11, 2
    layout = AttentionLayout(d_model=D, n_layers=L, n_heads=H, n_kv_heads=KV, d_head=dh)
    att = attention_flops(layout, T)
    # cost.py counts the full T x T square; a causal query at pos reads pos + 1 keys: (T + 1) / (2 T) of it
    layer = att.projections + att.scores * (T + 1) // (2 * T) + 2 * T * 3 * D * M  # a gated MLP: three D x M
    clean = L * layer + 2 * (T - 1) * D * V  # logits at the T - 1 scored positions
    assert scale.sweep_flops(L, D, M, H, KV, dh, V, T, B, []) == B * clean
    # resumed at layer 0 (its head's change 2 T dh D and MLP, then 2 whole layers) and at layer 2
    # (change and MLP only), each with the unembedding; first = 4 scores 4 fewer positions
    resumed = 2 * T * dh * D + 2 * T * 3 * D * M
    heads = [(0, 1), (2, 5)]
    want = B * (clean + 2 * resumed + 2 * layer + 2 * 2 * (T - 1) * D * V)
    assert scale.sweep_flops(L, D, M, H, KV, dh, V, T, B, heads) == want
    assert scale.sweep_flops(L, D, M, H, KV, dh, V, T, B, heads, first=4) == want - B * 3 * 2 * 4 * D * V
    # Llama-3-8B at 8 x 128 tokens: a clean forward is about 2 N tokens, N = 8.03e9 parameters less the
    # input embedding's 128256 x 4096 (Kaplan et al.'s non-embedding count; the unembedding is a product)
    big = scale.sweep_flops(32, 4096, 14336, 32, 8, 128, 128256, 128, 8, [])
    assert abs(big / (2 * (8.03e9 - 128256 * 4096) * 1024) - 1) < 0.02


def test_sweep_flops_is_what_exact_sweep_multiplies(tiny_llama_gqa_native):
    """The floor against torch's FLOP counter on the real sweep (first = 0 and a later first): the
    counter sees every projection, MLP, head change and unembedding the engine runs but not the
    CPU's fused attention kernel, so the two differ by exactly the causal scores and weighted sum,
    ``2 H d_head T (T + 1)`` per sequence and layer run with attention (the clean pass's ``L``, the
    ``L - 1 - l`` after each head's layer ``l``, none in the head's own layer: only its change)."""
    from torch.utils.flop_counter import FlopCounterMode

    from headprobe.analyses.ablation import exact_sweep

    scale = _scale()
    model, sp = tiny_llama_gqa_native, tiny_llama_gqa_native.spec
    d_mlp = model.model.cfg.d_mlp  # the native network's config
    B, T = 2, 11
    tokens = torch.randint(0, sp.d_vocab, (B, T), generator=torch.Generator().manual_seed(0))
    exact_sweep(model, tokens, heads=[(0, 0)])  # anything done once per model (its self-check) is not the sweep's
    for heads, first in (([(0, 1)], 0), ([(1, 2)], 3), ([(0, 0), (0, 5), (1, 7)], 0)):  # [] is refused
        with FlopCounterMode(display=False) as counter:
            exact_sweep(model, tokens, heads=heads, first=first, max_batch=B)
        counted = counter.get_total_flops()
        attention_layers = sp.n_layers + sum(sp.n_layers - 1 - l for l, _ in heads)
        scores = B * attention_layers * 2 * sp.n_heads * sp.d_head * T * (T + 1)
        shape = (sp.n_layers, sp.d_model, d_mlp, sp.n_heads, sp.n_kv_heads, sp.d_head, sp.d_vocab, T, B, heads)
        assert scale.sweep_flops(*shape, first=first) == counted + scores, (heads, first)


def test_tiny_run_has_every_step(tmp_path, monkeypatch):
    monkeypatch.setenv("HEADPROBE_FIGURE_FORMATS", "none")
    scale = _scale()
    assert scale.main(["--tiny", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "scale.json").read_text())
    steps = [r["step"] for r in data["rows"]]
    for want in (
        "scan: scoring",
        "scan: verification",
        "sweep: exact, all heads",
        "sweep: TransformerLens hook loop (sample)",
        "gradient importance",
        "AtP*",
        "second-order estimate",
        "prune: curve (michel, random)",
        "prune: reload of --save-pruned",
        "circuit: EAP-IG",
        "kv at",
        "profile: exact sweep of layer 1's 4 heads",
        "profile: gradient importance",
    ):
        assert any(s.startswith(want) for s in steps), want
    for r in data["rows"]:
        assert math.isfinite(r["seconds"]) and r["seconds"] > 0 and r["peak_bytes"] > 0
        if r["step"].startswith("profile:"):  # time inside torch's operators: part of the wall time
            assert 0 < r["op_s"] <= 1.05 * r["seconds"] and r["op_share"] == pytest.approx(r["op_s"] / r["seconds"])
            assert r["top"].count(" s") == 3 and "aten::" in r["top"]
        assert r["rate"] is None or math.isfinite(r["rate"])
    sweep = next(r for r in data["rows"] if r["step"] == "sweep: exact, all heads")
    assert sweep["heads"] == 2 * 4 and sweep["rate"] == pytest.approx(sweep["heads"] / sweep["seconds"])
    assert sweep["floor_fraction"] == pytest.approx(sweep["flops"] / (sweep["matmul_tflops"] * 1e12) / sweep["seconds"])
    loop = next(r for r in data["rows"] if r["step"].startswith("sweep: TransformerLens"))
    assert loop["max_loss_diff"] < 1e-4  # the engine and the hook loop agree on the sampled heads
    # the loop runs a clean forward and one per sampled head, all of one cost: the whole loop's time is
    # (every head + 1) of them, against the sweep's time (its clean pass included)
    forward = loop["seconds"] / (loop["heads"] + 1)
    assert loop["engine_speedup"] == pytest.approx(forward * (sweep["heads"] + 1) / sweep["seconds"])
    md = (tmp_path / "scale.md").read_text()
    assert all(s in md for s in steps)
    # the peak column's header says what its numbers are on this CPU: per step where the peak can be reset
    assert data["peak_memory"] == (
        "peak RSS in the step" if scale._reset_peak("cpu") else "peak RSS of the process so far"
    )
    assert f"| rate | {data['peak_memory']} | notes |" in md
    assert [g["goal"] for g in data["goals"]] == [g for g, _, _ in scale.GOALS]
    assert data["goals"] == scale.goals(data["rows"], data["rows"][0]["model"], scale.SMALL) and "## Goals" in md
    # tiny settings judge no goal: each row says what it ran at instead of a yes or no
    assert all(g["reached"] is None for g in data["goals"]) and "| yes |" not in md and "| no |" not in md
    circuit = next(g for g in data["goals"] if g["goal"].startswith("EAP-IG"))
    assert circuit["not_tested"] == "not tested (tiny settings: 2 x 13 tokens within 1 GiB, a 2-layer random model)"
    assert f"| {circuit['goal']} | {circuit['measured']} | {circuit['not_tested']} |" in md
    assert next(r for r in data["rows"] if r["step"].startswith("circuit:"))["step"] == "circuit: EAP-IG 2 x 13 tokens"


_PEAKS = """
import importlib.util, json, sys
from pathlib import Path
import numpy as np
spec = importlib.util.spec_from_file_location("scale_benchmark", sys.argv[1])
scale = importlib.util.module_from_spec(spec)
spec.loader.exec_module(scale)

def status(field):  # bytes of one /proc/self/status field (proc(5): kB); None without /proc (not Linux)
    try:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    except OSError:
        return None
    return int(line.split()[1]) * 1024

seen = {}
def hold():  # 2^25 float64: 256 MiB, every page written; the RSS while they are held
    a = np.ones(2**25)
    seen["held"], seen["anon_held"] = status("VmRSS"), status("RssAnon")
    return a.sum()
def nothing():
    seen["start"] = status("VmRSS")  # just after the step's reset

seen["anon_before"] = status("RssAnon")
_, _, big = scale._timed("cpu", hold)
_, _, small = scale._timed("cpu", nothing)
print(json.dumps({"big": big, "small": small, "resets": scale._reset_peak("cpu"), **seen}))
"""


def test_the_cpu_peak_is_the_steps_own_where_it_can_be_reset():
    """A step that holds 256 MiB and one after it that holds nothing: where the peak RSS resets, the
    first's peak is at least the RSS it held and the second's is its own: each within 5% of 256 MiB
    of the RSS read in that step (the second's, not the first's 256 MiB more); else both are the
    process's peak. In a fresh process: a test worker's resident size after other tests is no step's peak.

    Each peak is compared with the RSS read in its own step, not the two peaks with each other: the
    kernel reclaims a process's file-backed pages (shared libraries) under memory pressure and they
    come back when touched, so the RSS around the 256 MiB drifts by megabytes between the steps
    (the difference of the two peaks can then fall short of 0.95 x 256 MiB)."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _PEAKS, str(ROOT / "benchmarks" / "scale.py")],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    got = json.loads(out)
    if got["resets"]:  # Linux: clear_refs, and /proc/self/status to compare with
        assert got["anon_held"] - got["anon_before"] >= 2**28 * 0.95, got  # the first step held the 256 MiB
        slack = 2**28 * 0.05  # pages reclaimed or counted late (per-CPU RSS counters) around a read
        assert got["big"] >= got["held"] - slack, got  # its peak covers what it held
        assert got["small"] <= got["start"] + slack, got  # the second's peak is its own
    else:
        assert got["small"] >= got["big"], got


def _rows(model="m", scan=(20.0, 30.0), sweep=(50.0, 0.6), prune=200.0, circuit_peak=30e9):
    return [
        {"model": model, "step": "scan: scoring", "seconds": scan[0]},
        {"model": model, "step": "scan: verification", "seconds": scan[1]},
        {"model": model, "step": "sweep: exact, all heads", "seconds": sweep[0], "floor_fraction": sweep[1]},
        {"model": model, "step": "prune: curve (michel, random)", "seconds": prune},
        {"model": model, "step": "circuit: EAP-IG 8 x 129 tokens", "seconds": 9.0, "peak_bytes": circuit_peak},
    ]


@pytest.mark.parametrize(
    "rows, reached",
    [
        (_rows(), [True, True, True, True]),
        (_rows(scan=(30.0, 30.5)), [False, True, True, True]),  # 60.5 s in all
        (_rows(sweep=(50.0, 0.49)), [True, False, True, True]),  # in time, below half the floor
        (_rows(sweep=(61.0, 0.9)), [True, False, True, True]),
        (_rows(prune=301.0), [True, True, False, True]),
        (_rows(circuit_peak=40.1e9), [True, True, True, True]),  # 40 GiB (42.9e9 bytes), not GB
        (_rows(circuit_peak=40 * 2**30 + 1), [True, True, True, False]),
        (_rows(model="other") + _rows(model="m", prune=400.0), [True, True, False, True]),  # its own rows only
    ],
)
def test_goals_are_judged_by_their_limits(rows, reached):
    assert [g["reached"] for g in _scale().goals(rows, "m")] == reached


def test_tiny_settings_judge_no_goal():
    """A tiny run's rows (here ones that would reach every goal) are not claims about the goals' settings."""
    scale = _scale()
    met = scale.goals(_rows(), "m", scale.SMALL)
    assert [g["reached"] for g in met] == [None] * 4
    assert [g["not_tested"] for g in met] == [
        "not tested (tiny settings: 2 x 16 tokens, a 2-layer random model)",
    ] * 3 + ["not tested (tiny settings: 2 x 13 tokens within 1 GiB, a 2-layer random model)"]
    table = scale.goals_table(met, "m", tiny=True)
    assert "| yes |" not in table and table.count("not tested (tiny settings:") == 4
