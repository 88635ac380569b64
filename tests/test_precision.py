"""Half precision (``--dtype bfloat16|float16``) against float32 on the same weights.

Each model is wrapped twice from one checkpoint: once kept float32 (the reference), once cast with
:meth:`LoadedModel.to` (as ``--dtype`` does, after the float32 self-check). Compared: every scan
score (patterns on natural text and repeated random tokens) and the exact single-head zero-ablation
sweep's effects (nats/token). Tolerances are the largest differences measured on this machine
(2026-11-29, CPU, torch's CPU kernels) times about 2-3, rounded up; docs/results.md, "Half
precision", records the measurements. Nothing may be NaN in either precision.
"""

from __future__ import annotations

import math

import pytest
import torch
from zoo import ZOO, make_checkpoint

HALF = {"bfloat16": torch.bfloat16, "float16": torch.float16}

# Largest |score difference| (scores in [0, 1]) and |effect difference| (nats/token) allowed.
# Measured maxima over the 9 tiny zoo families (see docs/results.md): bfloat16 scores 3.5e-4,
# effects 8.3e-4; float16 scores 5.7e-5, effects 8.3e-5 (random-init models: near-uniform
# patterns, effects of a few millinats, so these are small).
SCORE_TOL = {"bfloat16": 1e-3, "float16": 2e-4}
EFFECT_TOL = {"bfloat16": 2.5e-3, "float16": 2.5e-4}
# SmolLM2-135M (30 layers, 49,152-token vocabulary; one 41-token sequence, the last 2 layers' heads
# swept): measured bfloat16 scores 0.0096, effects 0.019 nats/token; float16 scores 0.0004, effects 0.002.
SMOL_SCORE_TOL = {"bfloat16": 0.025, "float16": 0.002}
SMOL_EFFECT_TOL = {"bfloat16": 0.05, "float16": 0.01}


def _tokens(vocab: int, batch: int, period: int, seed: int = 0, bos: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(0, vocab, (batch, period), generator=g)
    tokens = torch.cat([block, block], dim=1)
    if bos is not None:
        tokens = torch.cat([torch.full((batch, 1), bos), tokens], dim=1)
    return tokens


def _scores_and_effects(model, tokens):
    """(scores ``{name: [layer, head]}`` from the scan's detectors, exact-sweep effects ``[layer, head]``)."""
    from headprobe.analyses import detectors
    from headprobe.analyses.ablation import exact_sweep
    from headprobe.probe.hooks.capture import capture_internal

    cap: dict = {}
    capture_internal(model, tokens, out=cap, residual=False)
    period = (tokens.shape[1] - 1) // 2
    start = 1
    scores = {}
    for name, fn in (
        ("previous_token", lambda p: detectors.previous_token_score(p)),
        ("first_token", lambda p: detectors.first_token_score(p)),
        ("induction", lambda p: detectors.induction_score(p, period, start)),
        ("duplicate_token", lambda p: detectors.duplicate_token_score(p, period, start)),
    ):
        scores[name] = torch.stack([fn(cap["pattern"][l].float()) for l in range(model.spec.n_layers)])
    patterns = torch.stack([cap["pattern"][l].float() for l in range(model.spec.n_layers)])
    sweep = exact_sweep(model, tokens, first=period)
    return scores, sweep, patterns


def _compare(ref, half, score_tol, effect_tol, tokens):
    s32, w32, p32 = _scores_and_effects(ref, tokens)
    s16, w16, p16 = _scores_and_effects(half, tokens)
    assert not torch.isnan(p16).any() and not torch.isnan(w16.loss).any() and math.isfinite(w16.clean_loss)
    worst_score = max(float((s16[k] - s32[k]).abs().max()) for k in s32)
    worst_effect = float((w16.effect - w32.effect).abs().max())
    for k in s32:
        assert not torch.isnan(s16[k]).any(), k
    assert worst_score <= score_tol, (worst_score, score_tol)
    assert worst_effect <= effect_tol, (worst_effect, effect_tol)
    return worst_score, worst_effect


def _native_pair(family, tokenizer, dtype, **change):
    from headprobe.probe.backends.wrapping import wrap

    ckpt = make_checkpoint(family, tokenizer, **change)
    ref = wrap(ckpt, backend="native")
    half = wrap(ckpt, backend="native").to(dtype)
    return ref, half


@pytest.mark.parametrize("dtype", sorted(HALF))
@pytest.mark.parametrize("family", sorted(ZOO))
def test_half_precision_scores_and_effects_on_the_zoo(family, dtype, tiny_tokenizer):
    """Scan scores and exact-sweep effects in half precision are within the measured tolerance of float32."""
    ref, half = _native_pair(family, tiny_tokenizer, HALF[dtype])
    assert half.dtype == HALF[dtype] and ref.dtype == torch.float32
    assert half.self_check.ok and half.self_check.dtype == "float32"  # judged before the cast
    tokens = _tokens(100, 2, 12, bos=100)
    worst = _compare(ref, half, SCORE_TOL[dtype], EFFECT_TOL[dtype], tokens)
    print(f"{family} {dtype}: score {worst[0]:.2g} effect {worst[1]:.2g}")


def test_float16_large_queries_and_keys_give_no_nan(tiny_tokenizer):
    """A native Llama with q/k weights scaled 1000x: q k^T overflows float16 (65504). The eager (pattern)
    path used to give NaN pattern rows where the fused path gave none; now scores are float32."""
    from headprobe.probe.backends.wrapping import wrap
    from headprobe.probe.hooks.capture import capture_internal

    ckpt = make_checkpoint("llama", tiny_tokenizer)
    with torch.no_grad():
        for name, p in ckpt.hf_model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(1000)
    model = wrap(ckpt, backend="native").to(torch.float16)
    tokens = _tokens(100, 2, 30, bos=100)
    cap: dict = {}
    capture_internal(model, tokens, out=cap)
    for l, pattern in cap["pattern"].items():
        assert pattern.dtype == torch.float16 and not torch.isnan(pattern).any(), l
        assert torch.allclose(pattern.float().sum(-1), torch.ones(()), atol=2e-3)
    with torch.inference_mode():
        assert torch.isfinite(model.forward(tokens)).all()


def test_rotary_frequencies_stay_float32_through_a_cast(tiny_llama_gqa_checkpoint):
    """Cast to bfloat16, the rotary frequencies stay float32 (bfloat16 ones are off by radians at position 8,000)."""
    from headprobe.probe.backends.wrapping import wrap
    from headprobe.probe.model.positions import Rotary

    model = wrap(tiny_llama_gqa_checkpoint, backend="native").to(torch.bfloat16)
    rotaries = [m for m in model.model.modules() if isinstance(m, Rotary)]
    assert rotaries and all(r.inv_freq.dtype == torch.float32 for r in rotaries)
    assert all(torch.equal(r.inv_freq, r.frequencies()) for r in rotaries)
    bridge = wrap(tiny_llama_gqa_checkpoint, backend="transformer-lens").to(torch.bfloat16)
    freqs = [b for n, b in bridge.model.named_buffers() if n.endswith("inv_freq")]
    assert freqs and all(b.dtype == torch.float32 for b in freqs)


def test_self_check_in_half_precision_passes_rounding_and_catches_a_real_failure(tiny_llama_gqa_checkpoint):
    """Checked in bfloat16 (dtype-dependent tolerance, 8 eps), a sound model passes; a 1.5x-rescaled
    attention output (a real decomposition failure) still fails."""
    from headprobe.probe.backends.wrapping import wrap
    from headprobe.probe.hooks.selfcheck import run_self_check, tolerance

    model = wrap(tiny_llama_gqa_checkpoint, backend="native")
    model.model.to(torch.bfloat16)  # cast without LoadedModel.to: the check now runs in bfloat16
    check = run_self_check(model)
    assert check.ok and check.dtype == "bfloat16" and check.tolerance == tolerance(torch.bfloat16) == 0.0625
    handle = model.model.blocks[1].attn.register_forward_hook(lambda mod, args, out: 1.5 * out)
    try:
        broken = run_self_check(model)
    finally:
        handle.remove()
    assert not broken.decomposition_ok and broken.max_relative_error > 0.2


def test_float16_is_refused_on_the_bridge():
    """float16 on TransformerLens' bridge: one line, before any load."""
    from headprobe.options import load_model
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match="float16 runs only on the native backend"):
        load_model("no-such-model", dtype="fp16", backend="transformer-lens")


@pytest.mark.real_model
def test_half_precision_on_smollm2(smollm2_checkpoint):
    """SmolLM2-135M in bfloat16 and float16: scores and exact-sweep effects (the last two layers'
    heads only, to stay short) within the measured tolerances of float32; no NaN."""
    from headprobe.probe.backends.wrapping import wrap

    ref = wrap(smollm2_checkpoint, backend="native")
    tokens = _tokens(10000, 1, 20, bos=ref.bos_token_id)
    from headprobe.analyses.ablation import exact_sweep

    last = ref.spec.n_layers - 2  # the last two layers: each ablation resumes only there (half GEMMs are slow on CPU)
    heads = [(l, h) for l in range(last, ref.spec.n_layers) for h in range(ref.spec.n_heads)]
    worst = {}
    for name, dtype in HALF.items():
        half = wrap(smollm2_checkpoint, backend="native").to(dtype)
        s32, s16 = {}, {}
        import headprobe.analyses.detectors as det
        from headprobe.probe.hooks.capture import capture_internal

        for model, out in ((ref, s32), (half, s16)):
            cap: dict = {}
            capture_internal(model, tokens, out=cap, residual=False)
            p = torch.stack([cap["pattern"][l].float() for l in range(model.spec.n_layers)])
            assert not torch.isnan(p).any()
            out["induction"] = torch.stack([det.induction_score(p[l], 20, 1) for l in range(len(p))])
            out["previous_token"] = torch.stack([det.previous_token_score(p[l]) for l in range(len(p))])
        worst_score = max(float((s16[k] - s32[k]).abs().max()) for k in s32)
        w32 = exact_sweep(ref, tokens, heads, first=20)
        w16 = exact_sweep(half, tokens, heads, first=20)
        picked = torch.tensor([[l, h] for l, h in heads]).T
        e32, e16 = w32.effect[picked[0], picked[1]], w16.effect[picked[0], picked[1]]
        assert not torch.isnan(e16).any()
        worst_effect = float((e16 - e32).abs().max())
        print(f"smollm2 {name}: score {worst_score:.2g} effect {worst_effect:.2g}")
        worst[name] = (worst_score, worst_effect)
        del half
    for name, (worst_score, worst_effect) in worst.items():
        assert worst_score <= SMOL_SCORE_TOL[name] and worst_effect <= SMOL_EFFECT_TOL[name], (
            name,
            worst_score,
            worst_effect,
        )
