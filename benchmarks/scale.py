"""headprobe at the scale users run at: one table of every step on a Llama-3-8B-shaped model.

Usage: ``PYTHONPATH=. python benchmarks/scale.py --out DIR [--tiny] [--no-reference] [--memory-bound 40]`` (GiB)

On a CUDA device it builds a random-init model of Llama-3-8B's shape in GPU memory from a
``LlamaConfig`` (32 layers x 32 query heads on 8 KV heads, d_model 4096, MLP 14336, vocabulary
128256, bfloat16; no weights read), wraps it with ``headprobe.wrap`` (SmolLM2's tokenizer: its ids
are all below the vocabulary) and times, then repeats on the embedded SmolLM2-135M for reference:

* ``matmul``: the device's measured bfloat16 matrix-product rate (an ``n^3`` product, n = 8192 on
  a GPU, 256 on a CPU), TFLOP/s: the FLOP floor's denominator (a model in another dtype, such as
  the float32 reference, is held to the rate measured in its own dtype: the sweep row's
  ``matmul_tflops`` and ``matmul_dtype``);
* ``scan``: ``headprobe.scan`` at the demo's settings (scoring, then the verification plan and its
  control sets: seconds, sets/s);
* ``sweep``: the exact sweep of every head (heads/s), the TransformerLens-style hook loop on a
  sample of heads (ms/head, its ratio to the engine: the loop's clean forward and one forward per
  sampled head, scaled to every head, over the sweep's time), and the fraction of the FLOP floor: the
  sweep's matrix-product FLOPs (:func:`sweep_flops`, from the model's shape) at the measured rate,
  over the measured time;
* ``gradient``, ``atp_star``, ``second_order``: the three estimates of every head's effect;
* ``prune``: the pruning curve (michel and random) with ``--save-pruned`` and the reload of the
  saved model;
* ``circuit``: EAP-IG on 8 sequences of 129 tokens within ``--memory-bound`` (GiB, 2^30 bytes, as
  ``circuit --memory-gb``; default 40 on a GPU: everything allocated, the weights included; the circuit's working memory is the bound less
  what is allocated before it starts);
* ``kv``: ``headprobe kv`` at 4,096 tokens;
* ``profile``: where the time of the two units the slow steps repeat goes (:func:`profile_step`):
  one layer's exact sweep (the scan's verification and the sweep are ablation passes) and one
  gradient importance (a forward and backward: the pruning curve's scoring). On CUDA: the time
  the device runs kernels, the part of it in copies, the rest of the wall time (Python, launches,
  host work) and the top kernels; on a CPU the time inside torch's operators and the top ones.

The 8B model's rows are judged against the goals for one H200 (:data:`GOALS`): reached or not,
with the numbers that decide it.

Each row has the seconds, a rate where one applies, the peak memory since the step began (GPU:
``max_memory_allocated``; CPU: the process's peak RSS, reset through ``/proc/self/clear_refs``;
where that cannot be reset, the process's peak so far, and the column's header says so) and a note. ``--tiny`` (automatic on a
CPU) runs the same steps on a tiny random model with tiny settings (``tests/test_scale_benchmark.py``
runs it, so the script cannot rot). Writes ``DIR/scale.md`` and ``DIR/scale.json``. Not a timed test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import resource
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

BIG = dict(
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    hidden_size=4096,
    intermediate_size=14336,
    vocab_size=128256,
    head_dim=128,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)
"""Llama-3-8B's shape (the ``llama8b-random`` config of ``../shared/gpu-bundle.sh`` with Llama 3's vocabulary)."""

TINY = dict(
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_size=32,
    intermediate_size=64,
    vocab_size=128,
    head_dim=8,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)

FULL = dict(n_seqs=8, seq_len=128, sample=32, circuit_seqs=8, period=64, kv_len=4096, matmul=8192, bound_gib=40.0)
SMALL = dict(n_seqs=2, seq_len=16, sample=4, circuit_seqs=2, period=6, kv_len=64, matmul=256, bound_gib=1.0)

GOALS = (
    ("scan and its verification at the demo's settings within 60 s", "scan", 60.0),
    ("exact sweep of every head at >= 50% of the FLOP floor, within 60 s", "sweep", 60.0),
    ("pruning curve (michel, random) within 5 minutes", "prune", 300.0),
    ("EAP-IG on 8 x 129 tokens within 40 GiB", "circuit", 40 * 2**30),
)
"""The goals for the 8B shape on one H200: (goal, what is judged, its limit: seconds or bytes)."""


def sweep_flops(
    n_layers: int,
    d_model: int,
    d_mlp: int,
    n_heads: int,
    n_kv_heads: int,
    d_head: int,
    d_vocab: int,
    seq_len: int,
    batch: int,
    heads: list[tuple[int, int]],
    first: int = 0,
) -> int:
    """Matrix-product FLOPs of an exact sweep of ``heads`` (the floor any implementation must compute),
    the work :func:`headprobe.analyses.ablation.exact_sweep` does: one clean forward, then per head
    of layer ``l`` its change ``(r_h - z_h) W_O^(h)`` (``2 T d_head D``), layer ``l``'s MLP, layers
    ``l+1 .. L-1`` whole, and the unembedding at the ``P = T - 1 - first`` scored positions
    (``2 P D V``). A whole layer is ``2 T (D (H + 2 KV) d_head + H d_head D + 3 D d_mlp)``
    (projections with GQA's narrower K and V, a gated MLP) plus the causal scores and weighted sum,
    ``2 H d_head T (T + 1)`` (each query reads the ``pos + 1`` keys up to itself; Kaplan et al. 2020,
    arXiv:2001.08361, table 1). Norms, softmax and rotary embeddings are not counted."""
    T, P = seq_len, seq_len - 1 - first
    mlp = 2 * T * 3 * d_model * d_mlp
    layer = 2 * T * (d_model * (n_heads + 2 * n_kv_heads) * d_head + n_heads * d_head * d_model) + mlp
    layer += 2 * n_heads * d_head * T * (T + 1)
    unembed = 2 * P * d_model * d_vocab
    resumed = 2 * T * d_head * d_model + mlp  # the ablated head's layer: its change and the MLP
    clean = n_layers * layer + unembed
    return batch * (clean + sum(resumed + (n_layers - 1 - l) * layer + unembed for l, _ in heads))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _reset_peak(device: str) -> bool:
    """Start a step's peak memory: CUDA's peak statistics, or on a CPU the process's peak RSS
    (Linux's VmHWM, reset by writing 5 to ``/proc/self/clear_refs``, proc(5)). False where it cannot
    be reset: the CPU peak is then the process's peak so far."""
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        return True
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _peak(device: str) -> int:
    """Peak memory since :func:`_reset_peak`, bytes: ``max_memory_allocated`` on CUDA, else the
    process's peak RSS (VmHWM; ``ru_maxrss`` where /proc has none)."""
    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated())
    try:
        status = Path("/proc/self/status").read_text()
        return int(next(x for x in status.splitlines() if x.startswith("VmHWM:")).split()[1]) * 1024  # kB
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def peak_label(device: str) -> str:
    """The table's peak-memory column: what :func:`_peak` measures on ``device`` here."""
    if device.startswith("cuda"):
        return "peak GPU memory in the step"
    return "peak RSS in the step" if _reset_peak(device) else "peak RSS of the process so far"


def _timed(device: str, fn: Callable):
    _reset_peak(device)
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0, _peak(device)


def matmul_tflops(device: str, n: int, dtype: torch.dtype = torch.bfloat16) -> float:
    """Measured ``n x n x n`` matrix-product rate in ``dtype`` on ``device``, TFLOP/s (best of 3 after a
    warm-up; float32 as torch runs it: TF32 only where allowed)."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    best = math.inf
    for _ in range(3):
        _, s, _ = _timed(device, lambda: a @ b)
        best = min(best, s)
    return 2 * n**3 / best / 1e12


def build_hf(shape: dict, device: str, dtype: torch.dtype, tokenizer):
    """A random-init ``LlamaForCausalLM`` of ``shape`` (seed 0) made on ``device`` in ``dtype`` (no
    weights read, no float32 copy of an 8B model on the way)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        **shape,
        bos_token_id=tokenizer.bos_token_id or 0,
        eos_token_id=tokenizer.eos_token_id or 0,
        architectures=["LlamaForCausalLM"],
    )
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(before)


def build(shape: dict, device: str, dtype: torch.dtype, tokenizer):
    """:func:`build_hf`'s model wrapped with ``headprobe.wrap`` (native backend), and its config."""
    import headprobe

    hf = build_hf(shape, device, dtype, tokenizer)
    name = "llama3-8b-shape-random" if shape is BIG else "tiny-llama-random"
    return headprobe.wrap(hf, tokenizer, backend="native", name=name), hf.config


def _tiny_tokenizer(tmp: str, n_words: int):
    from headprobe.probe.model.tokenizers import word_level_tokenizer

    return word_level_tokenizer(tmp, n_words)


def run_steps(
    model,
    name: str,
    device: str,
    s: dict,
    tflops: float,
    text: str | None,
    tmp: str,
    bridge_of: Callable | None,
    d_mlp: int,
) -> list[dict]:
    """Every step's row on one model (see the module docstring)."""
    import headprobe
    from headprobe.analyses.ablation import exact_sweep, head_importance, sweep_loop
    from headprobe.analyses.attribution import atp_star, second_order
    from headprobe.analyses.data import natural_text_tokens
    from headprobe.probe.backends.loading import load_model

    rows: list[dict] = []
    sp = model.spec
    data = dict(text=text, seq_len=s["seq_len"], n_natural=s["n_seqs"], n_repeated=s["n_seqs"], period=s["period"])

    def row(step, seconds, peak, rate=None, unit="", **extra):
        rows.append(dict(model=name, step=step, seconds=seconds, rate=rate, unit=unit, peak_bytes=peak, **extra))

    demo = {"text": text} if s["seq_len"] == FULL["seq_len"] else data  # the demo's settings: scan's defaults
    scored, t_score, peak = _timed(device, lambda: headprobe.scan(model, verify=False, **demo))
    row("scan: scoring", t_score, peak)
    res, t_scan, peak = _timed(device, lambda: headprobe.scan(model, **demo))
    sets = int(res.verification.get("sets_ablated", 0)) if res.verification else 0
    t_verify = res.timings.get("ablate_s", t_scan - t_score)
    row("scan: verification", t_verify, peak, sets / t_verify if t_verify > 0 else None, "sets/s", sets=sets)

    words = Path(text).read_text() if text else None
    tokens = natural_text_tokens(model, s["n_seqs"], s["seq_len"], 0, words).tokens.to(device)
    heads = [(l, h) for l in range(sp.n_layers) for h in range(sp.n_heads)]
    exact_sweep(model, tokens[:, :8], heads=heads[:1])  # warm-up
    sweep, t_sweep, peak = _timed(device, lambda: exact_sweep(model, tokens, heads=heads))
    tflops = tflops if model.dtype == torch.bfloat16 else matmul_tflops(device, s["matmul"], model.dtype)
    flops = sweep_flops(
        sp.n_layers,
        sp.d_model,
        d_mlp,
        sp.n_heads,
        sp.n_kv_heads,
        sp.d_head,
        sp.d_vocab,
        tokens.shape[1],
        tokens.shape[0],
        heads,
    )
    floor_s = flops / (tflops * 1e12)
    row(
        "sweep: exact, all heads",
        t_sweep,
        peak,
        len(heads) / t_sweep,
        "heads/s",
        heads=len(heads),
        flops=flops,
        matmul_tflops=tflops,
        matmul_dtype=str(model.dtype).removeprefix("torch."),
        floor_seconds=floor_s,
        floor_fraction=floor_s / t_sweep,
    )
    if bridge_of is not None:
        bridge = bridge_of()
        sample = heads[:: max(1, len(heads) // s["sample"])][: s["sample"]]
        ref, t_loop, peak = _timed(device, lambda: sweep_loop(bridge, tokens, heads=sample))
        idx = torch.tensor(sample).T
        diff = float((ref.loss[idx[0], idx[1]] - sweep.loss[idx[0], idx[1]]).abs().max())
        row(
            "sweep: TransformerLens hook loop (sample)",
            t_loop,
            peak,
            len(sample) / t_loop,
            "heads/s",
            heads=len(sample),
            engine_speedup=t_loop * (len(heads) + 1) / (len(sample) + 1) / t_sweep,
            max_loss_diff=diff,
        )
        del bridge

    for step, fn in (
        ("gradient importance", lambda: head_importance(model, tokens)),
        ("AtP*", lambda: atp_star(model, tokens)),
        ("second-order estimate", lambda: second_order(model, tokens, seed=0)),
    ):
        _, sec, peak = _timed(device, fn)
        row(step, sec, peak)

    out = Path(tmp) / f"prune-{name}"
    pr, t_prune, peak = _timed(
        device, lambda: headprobe.prune(model, methods="michel,random", save_pruned=True, n_seeds=1, **data)
    )
    pr.save(out, overwrite=True)
    row("prune: curve (michel, random)", t_prune, peak, note=f"{len(pr.table)} curve rows")
    reloaded, t_reload, peak = _timed(device, lambda: load_model(str(out / "pruned_model"), device=device))
    row("prune: reload of --save-pruned", t_reload, peak, note=f"{len(reloaded.spec.removed_heads)} heads removed")

    bound = s["bound_gib"] * 2**30  # everything allocated during the step, the weights included
    held = torch.cuda.memory_allocated() if device.startswith("cuda") else 0
    if bound <= held:
        raise SystemExit(f"--memory-bound {s['bound_gib']} GiB is below the {held / 2**30:.1f} GiB already allocated")
    _, t_circ, peak = _timed(
        device,
        lambda: headprobe.circuit(
            model,
            n_seqs=s["circuit_seqs"],
            period=s["period"],
            method="eap-ig",
            verify=0,
            memory_gb=(bound - held) / 2**30,
        ),
    )
    row(
        f"circuit: EAP-IG {s['circuit_seqs']} x {2 * s['period'] + 1} tokens",
        t_circ,
        peak,
        note=f"bound {s['bound_gib']:g} GiB in all, {(bound - held) / 2**30:.1f} GiB of it working memory",
        within_bound=peak <= bound if device.startswith("cuda") else None,
    )
    _, t_kv, peak = _timed(device, lambda: headprobe.kv(model, seq_len=s["kv_len"], text=text))
    row(f"kv at {s['kv_len']} tokens", t_kv, peak)
    one_layer = [(sp.n_layers - 1, h) for h in range(sp.n_heads)]  # the sweep's cheapest layer: resumed at the last
    for unit, fn in (
        (
            f"exact sweep of layer {sp.n_layers - 1}'s {sp.n_heads} heads",
            lambda: exact_sweep(model, tokens, heads=one_layer),
        ),
        ("gradient importance (one forward and backward)", lambda: head_importance(model, tokens)),
    ):
        try:  # the profiler is a diagnosis: its failure leaves the table whole
            _reset_peak(device)
            prof = profile_step(device, fn)
        except Exception as e:
            prof = {"wall_s": math.nan, "note": f"profile failed: {type(e).__name__}: {e}"}
        row(f"profile: {unit}", prof.pop("wall_s"), _peak(device), **prof)
    return rows


def profile_step(device: str, fn: Callable, top: int = 3) -> dict:
    """Where ``fn``'s wall time goes, from :mod:`torch.profiler` (one warm-up call, then one profiled).

    Returns ``wall_s``; on CUDA ``kernel_s`` (the device's kernel and copy time, summed),
    ``copy_s`` (its memcpy and memset part), ``kernel_share`` (``kernel_s / wall_s``: the rest is
    Python, kernel launches and host work while the device idles) and ``top`` (the ``top`` kernels
    by time: ``name seconds``); on a CPU ``op_s`` (self time inside torch's operators, summed),
    ``op_share`` and ``top`` (operators by self time). Seconds; shares in [0, 1] up to timer error.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    fn()
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        t0 = time.perf_counter()
        fn()
        _sync(device)
        wall = time.perf_counter() - t0
    out: dict = {"wall_s": wall}
    if cuda:
        kernels: dict[str, float] = {}
        for e in prof.events():
            if e.device_type == DeviceType.CUDA:  # a kernel, copy or memset on the device
                kernels[e.name] = kernels.get(e.name, 0.0) + e.time_range.elapsed_us() / 1e6
        if not kernels:
            return {**out, "note": "no device events recorded (CUPTI missing?)"}
        total = sum(kernels.values())
        copies = sum(t for k, t in kernels.items() if "memcpy" in k.lower() or "memset" in k.lower())
        out.update(kernel_s=total, copy_s=copies, kernel_share=total / wall)
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1])
    else:
        ops = {a.key: a.self_cpu_time_total / 1e6 for a in prof.key_averages()}
        out.update(op_s=sum(ops.values()), op_share=sum(ops.values()) / wall)
        ranked = sorted(ops.items(), key=lambda kv: -kv[1])
    out["top"] = ", ".join(f"{name[:60]} {t:.3g} s" for name, t in ranked[:top])
    return out


def goals(rows: list[dict], model: str, tiny: dict | None = None) -> list[dict]:
    """:data:`GOALS` judged on ``model``'s rows: each goal, its measured value and whether it is reached.
    ``tiny``: the tiny settings the rows ran at (:data:`SMALL`); then no goal is judged (``reached``
    None) and each says which settings it was measured at instead (``not_tested``)."""

    def step(prefix: str) -> dict:
        return next(r for r in rows if r["model"] == model and r["step"].startswith(prefix))

    sweep = step("sweep: exact")
    measured = {
        "scan": (step("scan: scoring")["seconds"] + step("scan: verification")["seconds"], "s"),
        "sweep": (sweep["seconds"], "s"),
        "prune": (step("prune: curve")["seconds"], "s"),
        "circuit": (step("circuit:")["peak_bytes"], "bytes"),
    }
    out = []
    for goal, what, limit in GOALS:
        value, unit = measured[what]
        reached = value <= limit and (what != "sweep" or sweep["floor_fraction"] >= 0.5)
        shown = f"{value:.3g} s" if unit == "s" else f"{value / 2**30:.3g} GiB"
        if what == "sweep":
            shown += f" at {100 * sweep['floor_fraction']:.1f}% of the FLOP floor"
        if tiny is None:
            out.append({"goal": goal, "measured": shown, "reached": reached})
        else:
            out.append({"goal": goal, "measured": shown, "reached": None, "not_tested": _tiny_settings(what, tiny)})
    return out


def _tiny_settings(what: str, s: dict) -> str:
    """``not tested (tiny settings: ...)``: what the tiny run of goal ``what`` ran at, from settings ``s``."""
    ran = f"{s['n_seqs']} x {s['seq_len']} tokens"
    if what == "circuit":
        ran = f"{s['circuit_seqs']} x {2 * s['period'] + 1} tokens within {s['bound_gib']:g} GiB"
    return f"not tested (tiny settings: {ran}, a {TINY['num_hidden_layers']}-layer random model)"


def table(rows: list[dict], header: str, peak: str = "peak memory") -> str:
    """The markdown table of ``rows``; ``peak`` heads the peak-memory column (:func:`peak_label`)."""
    lines = [header, "", f"| model | step | seconds | rate | {peak} | notes |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        extra = {
            k: v for k, v in r.items() if k not in ("model", "step", "seconds", "rate", "unit", "peak_bytes", "note")
        }
        notes = "; ".join(
            [
                *([r["note"]] if r.get("note") else []),
                *(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in extra.items()),
            ]
        )
        rate = f"{r['rate']:.3g} {r['unit']}" if r["rate"] is not None else ""
        lines.append(
            f"| {r['model']} | {r['step']} | {r['seconds']:.3f} | {rate} | {r['peak_bytes'] / 2**30:.2f} GiB | {notes} |"
        )
    return "\n".join(lines) + "\n"


def goals_table(met: list[dict], model: str, tiny: bool) -> str:
    """The markdown table of :func:`goals` (tiny: its ``not_tested`` in the last column)."""
    lines = ["", f"## Goals for one H200, judged on {model}", ""]
    if tiny:
        lines += [
            "Tiny settings: the goals are for the 8B shape on an H200; measured here to check the arithmetic only.",
            "",
        ]
    lines += ["| goal | measured | reached |", "|---|---|---|"]
    for g in met:
        verdict = g["not_tested"] if g["reached"] is None else "yes" if g["reached"] else "no"
        lines.append(f"| {g['goal']} | {g['measured']} | {verdict} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for scale.md and scale.json")
    ap.add_argument("--tiny", action="store_true", help="a tiny model and tiny settings (automatic without CUDA)")
    ap.add_argument("--no-reference", action="store_true", help="skip the embedded model's rows")
    ap.add_argument(
        "--memory-bound",
        type=float,
        default=None,
        help="the circuit step's bound on all GPU memory, weights included, in GiB (2^30 bytes; default: 40; tiny: 1)",
    )
    args = ap.parse_args(argv)
    import headprobe
    from headprobe.probe.backends.hf_checkpoint import load_checkpoint
    from headprobe.probe.backends.wrapping import wrap_model

    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiny = args.tiny or device == "cpu"
    s = SMALL if tiny else FULL
    if args.memory_bound:
        s = {**s, "bound_gib": args.memory_bound}
    s = {**s, "matmul": s["matmul"] if not tiny or device == "cpu" else FULL["matmul"]}
    tflops = matmul_tflops(device, s["matmul"])
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        if tiny:
            tok = _tiny_tokenizer(tmp, TINY["vocab_size"] - 1)
            text = Path(tmp) / "text.txt"
            text.write_text(" ".join(f"t{(i * 7919) % (TINY['vocab_size'] - 1)}" for i in range(3000)))
            model, cfg = build(TINY, device, torch.float32, tok)
            hf_of = lambda: build_hf(TINY, device, torch.float32, tok)
            rows += run_steps(
                model,
                model.spec.name,
                device,
                s,
                tflops,
                str(text),
                tmp,
                lambda: wrap_model(hf_of(), tok, backend="transformer-lens"),
                cfg.intermediate_size,
            )
        else:
            ref = load_checkpoint("smollm2-135m")
            model, cfg = build(BIG, device, torch.bfloat16, ref.tokenizer)
            rows += run_steps(
                model,
                "llama3-8b-shape (bf16)",
                device,
                s,
                tflops,
                None,
                tmp,
                lambda: wrap_model(
                    build_hf(BIG, device, torch.bfloat16, ref.tokenizer), ref.tokenizer, backend="transformer-lens"
                ),
                cfg.intermediate_size,
            )
            del model
            torch.cuda.empty_cache()
            if not args.no_reference:
                small = headprobe.load_model("smollm2-135m", device=device)
                rows += run_steps(
                    small,
                    "smollm2-135m (fp32)",
                    device,
                    s,
                    tflops,
                    None,
                    tmp,
                    lambda: headprobe.load_model("smollm2-135m", device=device, backend="transformer-lens"),
                    ref.hf_model.config.intermediate_size,
                )
    gpu = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    header = (
        f"# headprobe at scale: {gpu}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
        f"bf16 matmul {tflops:.3g} TFLOP/s ({'tiny settings' if tiny else 'full settings'})"
    )
    judged = rows[0]["model"]  # the 8B shape (tiny: the tiny model, to check the arithmetic only)
    met = goals(rows, judged, s if tiny else None)
    peak = peak_label(device)
    text = table(rows, header, peak) + goals_table(met, judged, tiny)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.md").write_text(text)
    (out / "scale.json").write_text(
        json.dumps(
            {
                "device": gpu,
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "tiny": tiny,
                "settings": s,
                "matmul_tflops": tflops,
                "peak_memory": peak,
                "rows": rows,
                "goals": met,
            },
            indent=1,
        )
    )
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
