"""The ablation engine against independent references: the plain per-head hook loop, finite
differences of the loss in the head mask, and hook removal on errors."""

from __future__ import annotations

import pytest
import torch

from headprobe.analyses.ablation import (
    ablate,
    capture_z,
    cross_entropy_inplace,
    exact_sweep,
    first_scored,
    head_importance,
    mean_z_from,
    spearman,
    sweep_loop,
)


@pytest.fixture(scope="module")
def deep_gqa_native(tiny_tokenizer):
    """4 layers x 6 query heads on 3 KV heads (GQA), rotary, SwiGLU, seeded: the prefix skip
    and batching of the sweep need more than two layers to be tested."""
    from headprobe.probe.backends.loading import LoadedModel
    from headprobe.probe.model.config import TransformerConfig
    from headprobe.probe.model.convert import spec_from_native
    from headprobe.probe.model.transformer import Transformer

    torch.manual_seed(1)
    cfg = TransformerConfig(
        n_layers=4,
        d_model=48,
        n_heads=6,
        n_kv_heads=3,
        d_vocab=101,
        d_mlp=96,
        positional="rotary",
        norm="rmsnorm",
        mlp="swiglu",
        bias=False,
        tied_unembed=False,
    )
    net = Transformer(cfg).eval()
    with torch.no_grad():  # larger weights than the default init, so that heads matter
        for p in net.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    return LoadedModel(net, tiny_tokenizer, spec_from_native("deep-gqa", "deep-gqa", "random", cfg))


def _tokens(n=3, T=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 100, (n, T), generator=g)


MODELS = ["tiny_gpt2_native", "tiny_llama_gqa_native", "deep_gqa_native", "tiny_gpt2", "tiny_llama_gqa"]
"""Both backends: the exact sweep runs one algorithm through the LoadedModel interface on each."""


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("kind", ["zero", "mean", "resample"])
@pytest.mark.parametrize("max_batch", [3, 64])
def test_exact_sweep_equals_per_head_loop(request, name, kind, max_batch):
    model = request.getfixturevalue(name)
    tokens = _tokens()
    mean_z = mean_z_from(capture_z(model, _tokens(seed=5)), 1) if kind == "mean" else None
    source = _tokens(seed=7) if kind == "resample" else None
    first = 4
    fast = exact_sweep(model, tokens, kind=kind, mean_z=mean_z, source_tokens=source, first=first, max_batch=max_batch)
    ref = sweep_loop(model, tokens, kind=kind, mean_z=mean_z, source_tokens=source, first=first)
    assert torch.isfinite(fast.loss).all()
    assert abs(fast.clean_loss - ref.clean_loss) < 1e-5
    torch.testing.assert_close(fast.loss, ref.loss, atol=1e-4, rtol=0)
    # the ablations do something, and the two agree far below the size of their effects
    assert (fast.loss - ref.loss).abs().max() < 0.02 * fast.effect.abs().max()


@pytest.mark.parametrize("name", ["deep_gqa_native", "tiny_llama_gqa", "tiny_gpt2"])
@pytest.mark.parametrize("layers_per_chunk", [1, 3])
def test_exact_sweep_in_chunks_of_layers_is_the_same_sweep(request, monkeypatch, name, layers_per_chunk):
    """With a budget of stored activations smaller than all layers' (as for long sequences), the
    sweep records the layers a chunk at a time: one clean pass per chunk, each stopped after its
    last layer. The losses are the one-pass sweep's, bit for bit, and the clean passes (with a
    chunk's hooks each) are counted."""
    from headprobe.analyses import ablation

    model = request.getfixturevalue(name)
    tokens, first = _tokens(), 4
    whole = exact_sweep(model, tokens, first=first, max_batch=6)
    B, T = tokens.shape
    spec = model.spec
    per_layer = B * T * (2 * spec.d_model + spec.n_heads * spec.d_head) * 4
    monkeypatch.setattr(ablation, "STORED_ACTIVATION_BYTES", per_layer * layers_per_chunk)
    calls = []
    real = type(model).scored_losses

    def counting(self, tokens, first, fwd_hooks=()):
        if any(name.endswith("hook_z") for name, _ in fwd_hooks):  # a recording pass, not a resumption
            calls.append(len(fwd_hooks))
        return real(self, tokens, first, fwd_hooks)

    monkeypatch.setattr(type(model), "scored_losses", counting)
    chunked = exact_sweep(model, tokens, first=first, max_batch=6)
    n_chunks = -(-spec.n_layers // layers_per_chunk)
    assert len(calls) == n_chunks and calls[0] == 3 * min(layers_per_chunk, spec.n_layers)
    assert chunked.clean_loss == whole.clean_loss
    assert torch.equal(chunked.loss, whole.loss)


@pytest.mark.parametrize("name", ["deep_gqa_native", "tiny_llama_gqa"])
def test_clean_residuals_over_budget_keep_the_deepest_and_the_rest_run_whole(request, monkeypatch, name):
    """With room for two layers' residuals, CleanResiduals keeps the two deepest of those asked
    for (one clean pass, stopped at the deepest), gives None for the others, and the set ablations
    started from them equal whole forwards (the kept and the dropped alike)."""
    from headprobe.analyses import ablation

    model = request.getfixturevalue(name)
    tokens, spec = _tokens(), model.spec
    B, T = tokens.shape
    layers = list(range(spec.n_layers))
    sets = [[(layer, 1)] for layer in layers]
    whole = ablation.set_ablation_losses(model, tokens, sets, "zero", None, first=2)
    monkeypatch.setattr(ablation, "STORED_ACTIVATION_BYTES", 2 * B * T * spec.d_model * 4)
    clean = ablation.CleanResiduals(model, tokens, layers)
    kept = [layer for layer in layers if clean.at(layer) is not None]
    assert kept == sorted(layer for layer in layers if layer > 0)[-2:]
    pre = {}
    model.scored_losses(
        tokens, 0, [(f"blocks.{l}.hook_resid_pre", lambda x, hook, l=l: pre.__setitem__(l, x.clone())) for l in kept]
    )
    for layer in kept:  # what it kept is the clean residual, recorded independently here
        torch.testing.assert_close(clean.at(layer)[0], pre[layer], atol=0, rtol=0)
    resumed = ablation.set_ablation_losses(model, tokens, sets, "zero", None, first=2, clean=clean)
    torch.testing.assert_close(resumed, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", [1.0, 30.0, 300.0])
def test_cross_entropy_inplace_equals_torch(scale):
    """The engine's in-place loss against F.cross_entropy, up to logits far beyond exp's range."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 1000, generator=g) * scale
    target = torch.randint(0, 1000, (50,), generator=g)
    ref = torch.nn.functional.cross_entropy(logits, target, reduction="none")
    got = cross_entropy_inplace(logits.clone(), target)
    torch.testing.assert_close(got, ref, atol=1e-5 * scale, rtol=1e-6)


def test_sweep_subset_of_heads_on_both_backends(tiny_gpt2, tiny_gpt2_native):
    tokens = _tokens()
    heads = [(1, 2), (0, 3)]
    fast = exact_sweep(tiny_gpt2_native, tokens, heads=heads)
    bridge = exact_sweep(tiny_gpt2, tokens, heads=heads)
    assert torch.isnan(fast.loss[0, 0]) and torch.isnan(bridge.loss[0, 0])
    torch.testing.assert_close(fast.loss[[1, 0], [2, 3]], bridge.loss[[1, 0], [2, 3]], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["tiny_gpt2", "tiny_gpt2_native", "tiny_llama_gqa", "tiny_llama_gqa_native"])
def test_backends_satisfy_the_interface_and_resume_exactly(request, name):
    """Each backend is a LoadedModel; resuming at any layer from the clean residual and attention output
    gives the clean losses, and a changed attention output changes them (the resumption is not a no-op)."""
    from headprobe.probe.backends.base import LoadedModel

    model = request.getfixturevalue(name)
    assert isinstance(model, LoadedModel)
    tokens, first = _tokens(), 2
    pre, attn = {}, {}
    hooks = [(f"blocks.{l}.hook_resid_pre", lambda x, hook, l=l: pre.__setitem__(l, x.clone())) for l in range(2)]
    hooks += [(model.attn_out_hook(l), lambda x, hook, l=l: attn.__setitem__(l, x.clone())) for l in range(2)]
    clean = model.scored_losses(tokens, first, hooks)
    torch.testing.assert_close(
        clean,
        torch.nn.functional.cross_entropy(
            model.forward(tokens)[:, first:-1].flatten(0, 1), tokens[:, first + 1 :].flatten(), reduction="none"
        )
        .view(3, -1)
        .mean(1),
        atol=1e-5,
        rtol=0,
    )
    for layer in range(2):
        two = model.resume_scored_losses(layer, tokens, pre[layer].repeat(2, 1, 1), attn[layer].repeat(2, 1, 1), first)
        torch.testing.assert_close(two, clean.repeat(2), atol=1e-5, rtol=0)
        off = model.resume_scored_losses(layer, tokens, pre[layer], 3 * attn[layer], first)
        assert (off - clean).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["tiny_gpt2", "tiny_llama_gqa_native"])
def test_head_mask_forward_equals_zero_ablation(request, name):
    model = request.getfixturevalue(name)
    tokens = _tokens()
    mask = torch.ones(2, model.spec.n_heads)
    mask[0, 1] = mask[1, 0] = 0
    with ablate(model, [(0, 1), (1, 0)]):
        hooked = model.forward(tokens)
    torch.testing.assert_close(model.forward(tokens, head_mask=mask), hooked, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["tiny_gpt2", "tiny_gpt2_native", "tiny_llama_gqa", "tiny_llama_gqa_native"])
def test_ablate_context_removes_hooks_on_error(request, name):
    model = request.getfixturevalue(name)
    tokens = _tokens()
    clean = model.forward(tokens)
    with ablate(model, [(0, 1), (1, 0)]):
        ablated = model.forward(tokens)
    assert (ablated - clean).abs().max() > 1e-4
    with pytest.raises(RuntimeError):
        with ablate(model, [(0, 1)], "resample", source_z=capture_z(model, _tokens(seed=3))):
            raise RuntimeError("boom")
    torch.testing.assert_close(model.forward(tokens), clean)


def test_ablate_matches_native_head_mask(tiny_llama_gqa_native):
    """Zero ablation by hook equals the native model's head_mask (an independent mechanism)."""
    model = tiny_llama_gqa_native
    tokens = _tokens()
    mask = torch.ones(2, 8)
    mask[0, 3] = mask[1, 5] = 0
    with ablate(model, [(0, 3), (1, 5)]):
        hooked = model.forward(tokens)
    torch.testing.assert_close(hooked, model.model(tokens, head_mask=mask), atol=1e-5, rtol=0)


def _double(model):
    import copy

    from headprobe.probe.backends.loading import LoadedModel

    return LoadedModel(copy.deepcopy(model.model).double(), model.tokenizer, model.spec)


def _loss64(logits, tokens, first):
    """Per-sequence mean cross-entropy in float64 (the library's losses are float32)."""
    logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
    return -logp.gather(-1, tokens[:, 1:, None]).squeeze(-1)[:, first:].mean(1)


@pytest.mark.parametrize("name", ["tiny_gpt2_native", "deep_gqa_native"])
def test_gradient_importance_matches_finite_differences(request, name):
    model = _double(request.getfixturevalue(name))
    tokens = _tokens(n=2)
    first = 2
    imp = head_importance(model, tokens, first)
    L, H = model.spec.n_layers, model.spec.n_heads
    eps = 1e-3  # RMSNorm computes in float32 even in a float64 model: keep eps large enough
    fd = torch.zeros(tokens.shape[0], L, H, dtype=torch.float64)
    layers = sorted({0, L - 1})  # the first and last layer: enough, and float64 on CPU is slow
    for layer in layers:
        for head in range(H):
            up, down = torch.ones(L, H, dtype=torch.float64), torch.ones(L, H, dtype=torch.float64)
            up[layer, head] += eps
            down[layer, head] -= eps
            with torch.no_grad():
                lu, ld = (_loss64(model.model(tokens, head_mask=m), tokens, first) for m in (up, down))
            fd[:, layer, head] = (lu - ld) / (2 * eps)
    torch.testing.assert_close(imp.importance.double()[layers], fd.abs().mean(0)[layers], atol=1e-4, rtol=1e-2)
    # zero-ablation attribution is -mean_x dL(x)/dxi
    torch.testing.assert_close(imp.attribution.double()[layers], -fd.mean(0)[layers], atol=1e-4, rtol=1e-2)
    norm = head_importance(model, tokens, first, normalize=True).importance
    torch.testing.assert_close(norm.norm(dim=1), torch.ones(L), atol=1e-5, rtol=0)


def test_attribution_patching_matches_directional_derivative(deep_gqa_native):
    """Mean-ablation attribution = d/da L(z_h + a (mean_z_h - z_h)) at a = 0, by finite differences."""
    model = _double(deep_gqa_native)
    tokens = _tokens(n=2)
    mean_z = mean_z_from(capture_z(model, _tokens(seed=5)), 0)
    attr = head_importance(model, tokens, kind="mean", mean_z=mean_z).attribution
    eps = 1e-3
    for layer, head in [(0, 2), (2, 5), (3, 0)]:
        losses = []
        for a in (eps, -eps):

            def hook(z, hook, a=a, layer=layer, head=head):
                z = z.clone()
                z[:, :, head] = z[:, :, head] + a * (mean_z[layer, head].to(z) - z[:, :, head])
                return z

            with torch.no_grad():
                logits = model.forward(tokens, fwd_hooks=[(f"blocks.{layer}.attn.hook_z", hook)])
            losses.append(_loss64(logits, tokens, 0).mean())
        fd = float((losses[0] - losses[1]) / (2 * eps))
        assert abs(float(attr[layer, head]) - fd) < 1e-4 + 1e-2 * abs(fd)


def test_attribution_ranks_like_exact_sweep(deep_gqa_native):
    """A first-order estimate, not equal to the exact effect; on this random model it still ranks
    heads alike (the benchmark reports the same correlation on SmolLM2)."""
    tokens = _tokens(n=4, T=16)
    exact = exact_sweep(deep_gqa_native, tokens)
    attr = head_importance(deep_gqa_native, tokens)
    assert abs(attr.clean_loss - exact.clean_loss) < 1e-5
    assert spearman(attr.attribution, exact.effect) > 0.5


def test_gradient_importance_on_bridge_equals_native(tiny_gpt2, tiny_gpt2_native):
    tokens = _tokens()
    a = head_importance(tiny_gpt2, tokens, 1)
    b = head_importance(tiny_gpt2_native, tokens, 1)
    torch.testing.assert_close(a.importance, b.importance, atol=1e-4, rtol=1e-3)


def test_bad_kind_raises(tiny_gpt2_native):
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError):
        exact_sweep(tiny_gpt2_native, _tokens(), kind="mean")
    with pytest.raises(HeadprobeError):
        head_importance(tiny_gpt2_native, _tokens(), kind="bogus")
    with pytest.raises(HeadprobeError):
        first_scored("bogus", 1, None)
