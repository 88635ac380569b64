"""The load-time self-check and the per-head W_O decomposition across the architecture zoo.

The reference for "what the attention block adds to the residual stream" is taken from the
untouched Hugging Face model with a plain torch forward hook on the module that produces it
(the attention module, or the post-attention norm where the block has one), not from headprobe's
or TransformerLens' hook points.
"""

from __future__ import annotations

import json

import pytest
import torch
import zoo

from headprobe.probe.core.errors import HeadprobeError

FAMILIES = [*zoo.names(), *zoo.names(encoder=True)]


@pytest.fixture(scope="module")
def checkpoints(tiny_tokenizer):
    return {family: zoo.make_checkpoint(family, tiny_tokenizer) for family in FAMILIES}


def _hf_attention_added(hf_model, family: str, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
    """Layer -> [batch, pos, d_model]: the output of the HF module that the block adds to the residual
    (the family's ``TinySpec.attention_output``)."""
    path = zoo.tiny(family).attention_output
    out: dict[int, torch.Tensor] = {}
    handles = []
    for layer in range(hf_model.config.num_hidden_layers):
        module = hf_model.get_submodule(path.format(l=layer))

        def hook(mod, args, output, layer=layer):
            out[layer] = (output[0] if isinstance(output, tuple) else output).detach().clone()

        handles.append(module.register_forward_hook(hook))
    try:
        with torch.no_grad():
            hf_model(tokens)
    finally:
        for h in handles:
            h.remove()
    return out


def _wrap(ckpt, backend):
    from headprobe.probe.backends.wrapping import wrap

    return wrap(ckpt, backend=backend)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["auto", "transformer-lens"])
def test_decomposition_sums_to_what_the_block_adds(checkpoints, family, backend):
    """sum_h result_h + b_O from the public capture_heads equals the HF module's contribution (1e-4 relative);
    MLA through the bridge (head geometry read wrongly) is refused with one line instead, and so is a
    family the bridge does not wrap (an encoder)."""
    from headprobe.probe.hooks.capture import capture_heads

    ckpt = checkpoints[family]
    if backend == "transformer-lens" and not zoo.tiny(family).bridge:
        with pytest.raises(HeadprobeError) as e:
            _wrap(ckpt, backend)
        assert "\n" not in str(e.value)
        return
    model = _wrap(ckpt, backend)
    check = model.self_check
    assert check.patterns_ok, check
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    if family == "deepseek_v3" and model.backend == "transformer-lens":
        assert not check.decomposition_ok and "head geometry" in check.error
        with pytest.raises(HeadprobeError, match="DeepseekV3ForCausalLM.*self-check") as e:
            capture_heads(model, tokens)
        assert "\n" not in str(e.value)
        return
    assert check.decomposition_ok, check
    assert check.max_relative_error < 1e-5
    cap = capture_heads(model, tokens)
    want = _hf_attention_added(ckpt.hf_model, family, tokens)
    for layer, ref in want.items():
        got = cap["result"][layer].sum(dim=2) + cap["b_O"][layer]
        rel = float((got.double() - ref.double()).norm() / ref.double().norm())
        assert rel < 1e-4, (family, layer, rel)
        assert torch.allclose(cap["attn_out"][layer], ref, atol=1e-5, rtol=1e-4)
    assert check.post_attention_norm == zoo.tiny(family).post_attention_norm


def test_wrap_leaves_the_callers_model_as_it_was(checkpoints):
    """After wrapping in the bridge, the caller's HF model still returns attention weights and the same logits."""
    ckpt = checkpoints["llama"]
    tokens = torch.arange(10)[None]
    with torch.no_grad():
        before = ckpt.hf_model(tokens, output_attentions=True)
    _wrap(ckpt, "transformer-lens")
    with torch.no_grad():
        after = ckpt.hf_model(tokens, output_attentions=True)
    assert after.attentions is not None and len(after.attentions) == 2
    assert torch.equal(before.logits, after.logits)
    for a, b in zip(before.attentions, after.attentions):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fixture", ["tiny_llama_gqa_native", "tiny_gpt2"])
def test_a_rescaled_attention_output_is_caught(request, fixture):
    """A permanent hook that rescales one layer's attention output breaks the identity: the self-check fails,
    per-head results and head ablation refuse with one line naming the architecture."""
    from headprobe.analyses.ablation import ablated_loss
    from headprobe.probe.backends.loading import LoadedModel
    from headprobe.probe.hooks.capture import capture_heads
    from headprobe.probe.hooks.selfcheck import run_self_check

    good = request.getfixturevalue(fixture)
    broken = LoadedModel(good.model, good.tokenizer, good.spec)
    assert broken.self_check.ok
    broken._self_check = None
    good.model.add_hook("blocks.1.hook_attn_out", lambda x, hook: 1.5 * x, is_permanent=True)
    try:
        check = run_self_check(broken)
        assert check.patterns_ok and not check.decomposition_ok
        assert check.worst_layer == 1 and check.max_relative_error > 0.1
        broken._self_check = check
        tokens = torch.arange(8)[None]
        for call in (
            lambda: capture_heads(broken, tokens),
            lambda: ablated_loss(broken, tokens, [(0, 0)], "zero", None, "natural", 1, None),
        ):
            with pytest.raises(HeadprobeError) as e:
                call()
            msg = str(e.value)
            assert "\n" not in msg and broken.architecture in msg and "layer 1" in msg
    finally:
        good.model.reset_hooks(including_permanent=True)
    assert run_self_check(broken).ok


def test_a_pattern_that_reads_the_future_is_caught(tiny_llama_gqa_native):
    """A hook that moves attention onto future keys fails check (a); scores then refuse."""
    from headprobe.probe.backends.loading import LoadedModel
    from headprobe.probe.hooks.selfcheck import run_self_check

    good = tiny_llama_gqa_native
    broken = LoadedModel(good.model, good.tokenizer, good.spec)

    def leak(pattern, hook):
        return 0.9 * pattern + 0.1 * torch.ones_like(pattern) / pattern.shape[-1]

    good.model.add_hook("blocks.0.attn.hook_pattern", leak, is_permanent=True)
    try:
        check = run_self_check(broken)
    finally:
        good.model.reset_hooks(including_permanent=True)
    assert not check.patterns_ok and check.max_future_weight == pytest.approx(0.1 / 16, rel=1e-3)
    broken._self_check = check
    with pytest.raises(HeadprobeError, match="self-check of attention patterns failed"):
        check.require_patterns("head scores")


def test_self_check_record_is_json_ready(tiny_gpt2_native):
    d = tiny_gpt2_native.self_check.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["ok"] and d["n_tokens"] == 16 and d["reference"] == "resid_mid - resid_pre"
    assert d["backend"] == "native" and d["max_relative_error"] < 1e-5


@pytest.fixture(scope="module")
def zoo_dirs(tmp_path_factory, tiny_tokenizer):
    base = tmp_path_factory.mktemp("zoo")
    return {f: zoo.save_dir(f, tiny_tokenizer, base / f) for f in ("gemma2", "deepseek_v3")}


def _text(tmp_path):
    g = torch.Generator().manual_seed(0)
    p = tmp_path / "text.txt"
    p.write_text(" ".join(f"t{i}" for i in torch.randint(0, 100, (1500,), generator=g).tolist()))
    return str(p)


SMALL = ["--seq-len", "16", "--n-natural", "3", "--n-repeated", "2", "--period", "6", "--device", "cpu"]


@pytest.mark.parametrize(
    "family, backend", [("gemma2", "auto"), ("deepseek_v3", "auto"), ("deepseek_v3", "transformer-lens")]
)
def test_commands_on_post_norm_and_mla_checkpoints(zoo_dirs, family, backend, tmp_path, capsys):
    """scan, ablate and prune --save-pruned exit 0, or 2 with one line and no summary; every summary.json has
    self_check. Through the bridge, MLA's per-head results are wrong: only pattern scores run."""
    from headprobe.cli import main

    text = _text(tmp_path)
    runs = {
        "scan": ["scan", "-k", "2", "--n-random", "2"],
        "scan-no-verify": ["scan", "--no-verify"],
        "ablate": ["ablate"],
        "prune": ["prune", "--save-pruned", "--step-fraction", "0.5", "--method", "michel"],
    }
    codes = {}
    for name, args in runs.items():
        out = tmp_path / name
        codes[name] = main(
            [*args, "--model", str(zoo_dirs[family]), "--backend", backend, "--out", str(out), "--text", text, *SMALL]
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert codes[name] in (0, 2), (name, codes[name])
        if codes[name] == 2:
            assert err[-1].startswith("headprobe: error: ") and not (out / "summary.json").exists()
        else:
            summary = json.loads((out / "summary.json").read_text())
            assert summary["self_check"]["patterns_ok"]
            assert summary["self_check"]["decomposition_ok"] == (backend == "auto")
    if backend == "transformer-lens":
        assert codes == {"scan": 2, "scan-no-verify": 0, "ablate": 2, "prune": 2}
    else:
        assert codes["scan"] == codes["ablate"] == 0


def _massive(tokenizer, family: str, value: float):
    """The tiny ``family`` checkpoint with one massive residual feature: embedding column 7 set to
    ``value`` for every token, so every residual entry of that feature is ~``value`` (Sun et al. 2024
    report ~1e3-1e4 in Llama-2 on a few tokens; here every token carries it, a harsher case)."""
    ckpt = zoo.make_checkpoint(family, tokenizer)
    with torch.no_grad():
        ckpt.hf_model.get_input_embeddings().weight[:, 7] = value
    return ckpt


MASSIVE_CASES = [
    (f, v, b)
    for f in ("llama", "gpt2", "gpt_neox", "gemma2")
    for v in (4.3e3, 2.5e4)
    for b in ("native", "transformer-lens")
]


@pytest.mark.parametrize("family, value, backend", MASSIVE_CASES)
def test_a_healthy_model_with_a_massive_residual_feature_passes(tiny_tokenizer, family, value, backend):
    """The float32 residual stores a 2.5e4 entry to within eps * 2.5e4 ~ 3e-3, so resid_mid - resid_pre is
    off by far more than 1e-4 of the attention output: that rounding must not be taken for a failed
    decomposition. The reference that it is healthy: sum_h result_h + b_O equals the output of the untouched
    Hugging Face module (1e-4 relative), as in test_decomposition_sums_to_what_the_block_adds."""
    from headprobe.probe.hooks.capture import capture_heads, capture_internal
    from headprobe.probe.hooks.selfcheck import check_tokens

    ckpt = _massive(tiny_tokenizer, family, value)
    model = _wrap(ckpt, backend)
    tokens = check_tokens(model)
    cap = capture_internal(model, tokens, residual=True)
    assert float(cap["resid_pre"][1][..., 7].abs().min()) > 0.5 * value  # the feature is massive
    check = model.self_check
    assert check.ok, check
    assert check.max_relative_error < 1e-5
    cap = capture_heads(model, tokens)
    for layer, ref in _hf_attention_added(ckpt.hf_model, family, tokens).items():
        got = cap["result"][layer].sum(dim=2) + cap["b_O"][layer]
        assert float((got.double() - ref.double()).norm() / ref.double().norm()) < 1e-4


@pytest.mark.parametrize("backend", ["native", "transformer-lens"])
@pytest.mark.parametrize("family", ["llama", "gpt_neox"])
def test_a_broken_decomposition_with_a_massive_feature_still_fails(tiny_tokenizer, family, backend):
    """With a 2.5e4 residual feature, a rescaled attention output (x 1.5) and a block that adds more than its
    attention output (0.05 on every residual entry: what a norm or term unknown to the backend does) still
    fail check (b) at that layer: the residual's rounding (eps * 2.5e4 per entry) excuses nothing of order 1."""
    from headprobe.probe.backends.loading import LoadedModel
    from headprobe.probe.hooks.selfcheck import run_self_check

    good = _wrap(_massive(tiny_tokenizer, family, 2.5e4), backend)
    assert good.self_check.ok
    after_attention = "hook_resid_post" if family == "gpt_neox" else "hook_resid_mid"
    breaks = {
        "rescaled": ("blocks.1.hook_attn_out", lambda x, hook: 1.5 * x),
        "added": (f"blocks.1.{after_attention}", lambda x, hook: x + 0.05),
    }
    for name, (hook_name, fn) in breaks.items():
        broken = LoadedModel(good.model, good.tokenizer, good.spec)
        good.model.add_hook(hook_name, fn, is_permanent=True)
        try:
            check = run_self_check(broken)
        finally:
            good.model.reset_hooks(including_permanent=True)
        assert check.patterns_ok and not check.decomposition_ok, (name, check)
        assert check.worst_layer == 1 and check.max_relative_error > 0.1, (name, check)
    assert run_self_check(LoadedModel(good.model, good.tokenizer, good.spec)).ok


def test_learned_sinks_rows_plus_the_sink_mass_sum_to_one(tiny_llama_gqa_native):
    """With learned sinks the pattern holds the real keys' weights: rows sum to 1 - sink mass, the sink
    mass being computed apart from the pattern (from the scores and the sink logit); the check passes and
    reports the largest sink mass, which a plain softmax over the real keys' scores does not reproduce."""
    from headprobe.probe.hooks.capture import capture_internal
    from headprobe.probe.hooks.selfcheck import run_self_check, sink_mass

    model = zoo.with_sinks(tiny_llama_gqa_native, scale=2.0)
    check = run_self_check(model)
    assert check.ok and check.max_row_sum_error < 1e-5
    assert check.max_sink_mass is not None and check.max_sink_mass > 0.3
    assert "max_sink_mass" in check.to_dict() and "max_sink_mass" not in tiny_llama_gqa_native.self_check.to_dict()
    cap = capture_internal(model, torch.arange(12)[None], scores=True)
    for layer in range(2):
        rows = cap["pattern"][layer].double().sum(-1)
        mass = sink_mass(cap["attn_scores"][layer], model.sink_logits(layer))
        assert float(rows.max()) < 1 - 1e-3  # the sink takes weight from every row
        torch.testing.assert_close(rows + mass, torch.ones_like(rows), atol=1e-6, rtol=0)
        by_hand = torch.cat(
            [cap["attn_scores"][layer], model.sink_logits(layer)[None, :, None, None].expand(1, -1, 12, 1)], -1
        ).softmax(-1)[..., :-1]
        torch.testing.assert_close(cap["pattern"][layer], by_hand, atol=1e-6, rtol=0)


@pytest.mark.parametrize("how", ["forward drops the sink", "pattern renormalised"])
def test_a_dropped_sink_is_caught(tiny_llama_gqa_native, how):
    """A model whose softmax leaves the sink out (its sink logits -inf in the forward while the weights keep
    them), or a pattern renormalised to rows of 1, fails check (a) by the sink mass, in one line."""
    from headprobe.probe.hooks.selfcheck import run_self_check

    model = zoo.with_sinks(tiny_llama_gqa_native, scale=2.0)
    if how == "forward drops the sink":
        model.model.add_hook(
            "blocks.1.attn.hook_sinks", lambda s, hook: torch.full_like(s, float("-inf")), is_permanent=True
        )
    else:
        model.model.add_hook(
            "blocks.1.attn.hook_pattern", lambda p, hook: p / p.sum(-1, keepdim=True), is_permanent=True
        )
    check = run_self_check(model)
    assert not check.patterns_ok and check.max_row_sum_error > 0.3
    model._self_check = check
    with pytest.raises(HeadprobeError, match="rows plus their sink mass sum to 1 within") as e:
        check.require_patterns("head scores")
    assert "\n" not in str(e.value)
