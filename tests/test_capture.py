"""The per-head W_O decomposition and GQA head bookkeeping, against independent references."""

import pytest
import torch
from conftest import TINY_MODELS

from headprobe.probe.hooks.ablation import head_ablation_hooks
from headprobe.probe.hooks.capture import capture_heads, head_results, kv_head_of, patterns_by_layer


@pytest.mark.parametrize("fixture", TINY_MODELS)
def test_results_plus_bias_reproduce_attention_output(fixture, request):
    model = request.getfixturevalue(fixture)
    tokens = torch.randint(0, 100, (3, 17), generator=torch.Generator().manual_seed(1))
    cap = capture_heads(model, tokens)
    for layer in range(model.spec.n_layers):
        total = cap["result"][layer].sum(dim=2)
        if model.b_O(layer) is not None:
            total = total + model.b_O(layer)
        torch.testing.assert_close(total, cap["attn_out"][layer], atol=1e-4, rtol=0)
        assert cap["pattern"][layer].shape == (3, model.spec.n_heads, 17, 17)
        assert cap["result"][layer].shape == (3, 17, model.spec.n_heads, model.spec.d_model)


def test_head_results_match_a_loop_over_heads():
    g = torch.Generator().manual_seed(0)
    z, W_O = torch.randn(2, 5, 3, 4, generator=g), torch.randn(3, 4, 7, generator=g)
    res = head_results(z, W_O)
    for h in range(3):
        torch.testing.assert_close(res[:, :, h], z[:, :, h] @ W_O[h])
    # Concat(heads) W_O == sum_h head_h W_O^(h)
    concat = z.reshape(2, 5, 12) @ W_O.reshape(12, 7)
    torch.testing.assert_close(res.sum(2), concat, atol=1e-5, rtol=1e-5)


def test_gqa_kv_head_is_group_index_not_modulo(tiny_llama_gqa):
    spec = tiny_llama_gqa.spec
    assert (spec.n_heads, spec.n_kv_heads, spec.group_size, spec.kind) == (8, 2, 4, "GQA")
    heads = torch.arange(8)
    assert kv_head_of(heads, 8, 2).tolist() == [0, 0, 0, 0, 1, 1, 1, 1]
    assert spec.kv_head(5) == 1  # h // 4, not h % 2 (= 1 as well for 5, so check 6 too)
    assert spec.kv_head(6) == 1 and 6 % 2 == 0


def test_query_heads_of_one_group_differ_in_gqa_pattern(tiny_llama_gqa):
    """Each query head is its own row even though 4 of them share keys."""
    cap = capture_heads(tiny_llama_gqa, torch.randint(0, 100, (1, 9)), layers=[0])
    p = cap["pattern"][0][0]
    assert not torch.allclose(p[0], p[1])


@pytest.mark.parametrize("fixture", ["tiny_llama_gqa", "tiny_llama_gqa_native"])
def test_zero_ablating_one_head_changes_only_its_contribution(fixture, request):
    model = request.getfixturevalue(fixture)
    tokens = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(2))
    clean = capture_heads(model, tokens, layers=[0])
    with model.model.hooks(fwd_hooks=head_ablation_hooks([(0, 5)], "zero")):
        abl = capture_heads(model, tokens, layers=[0])
    torch.testing.assert_close(abl["result"][0][:, :, 5], torch.zeros_like(abl["result"][0][:, :, 5]))
    others = [h for h in range(8) if h != 5]
    torch.testing.assert_close(abl["result"][0][:, :, others], clean["result"][0][:, :, others])
    # the attention output moves by exactly minus head 5's contribution
    torch.testing.assert_close(
        abl["attn_out"][0], clean["attn_out"][0] - clean["result"][0][:, :, 5], atol=1e-5, rtol=0
    )


def test_stream_patterns_fires_once_per_layer_and_keeps_nothing(tiny_gpt2):
    seen = []
    patterns_by_layer(tiny_gpt2, torch.randint(0, 100, (2, 6)), lambda layer, p: seen.append((layer, tuple(p.shape))))
    assert seen == [(0, (2, 4, 6, 6)), (1, (2, 4, 6, 6))]


# ---- the masked-score sentinel of hook_attn_scores ----------------------------------------------

SENTINEL_CASES = [(f, b) for f in ("gpt2", "mistral", "gemma2") for b in ("native", "transformer-lens")]


@pytest.fixture(scope="module")
def sentinel_models(tiny_tokenizer):
    import copy
    import dataclasses

    import zoo

    from headprobe.probe.backends.wrapping import wrap

    out = {}
    for family in dict(SENTINEL_CASES):
        ckpt = zoo.make_checkpoint(family, tiny_tokenizer)
        for backend in ("native", "transformer-lens"):
            out[family, backend] = (
                wrap(dataclasses.replace(ckpt, hf_model=copy.deepcopy(ckpt.hf_model)), backend=backend),
                ckpt.hf_model,
            )
    return out


def _visible(hf_config, layer: int, T: int) -> torch.Tensor:
    """``[q_pos, k_pos]``: the keys query q reads, from the definitions (causal; a sliding window of
    w reads keys ``q - w < k <= q`` in the layers the config marks sliding)."""
    q, k = torch.arange(T)[:, None], torch.arange(T)[None]
    seen = k <= q
    types = getattr(hf_config, "layer_types", None)
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and (types is None or types[layer] == "sliding_attention"):
        seen = seen & (k > q - window)
    return seen


@pytest.mark.parametrize("family, backend", SENTINEL_CASES)
def test_masked_attention_scores_are_minus_infinity_on_both_backends(sentinel_models, family, backend):
    """``hook_attn_scores`` holds ``-inf`` exactly at the keys a query may not read (the future;
    outside Mistral's and Gemma-2's sliding windows of 8) and finite scores elsewhere, whose softmax
    is Hugging Face's own attention pattern; the same through ``forward(fwd_hooks=...)`` and the
    ``hooks(...)`` context manager; a hook returning these scores leaves the logits unchanged."""
    model, hf = sentinel_models[family, backend]
    T = 14
    tokens = torch.randint(0, 100, (2, T), generator=torch.Generator().manual_seed(2))
    names = [f"blocks.{l}.attn.hook_attn_scores" for l in range(model.spec.n_layers)]
    got, via_hooks = {}, {}
    with torch.no_grad():
        plain = model.forward(tokens)
        returned = model.forward(
            tokens, fwd_hooks=[(n, lambda s, hook, n=n: got.setdefault(n, s.clone())) for n in names]
        )
        with model.hooks([(n, lambda s, hook, n=n: via_hooks.__setitem__(n, s.clone())) for n in names]):
            model.forward(tokens)
        want = hf(tokens, output_attentions=True).attentions
    torch.testing.assert_close(returned, plain, atol=1e-6, rtol=0)  # the hooks returned the -inf scores
    for layer, n in enumerate(names):
        scores, seen = got[n], _visible(hf.config, layer, T)
        assert torch.equal(torch.isneginf(scores), ~seen.expand_as(scores)), (family, backend, layer)
        assert torch.isfinite(scores[..., seen]).all()
        assert torch.equal(via_hooks[n], scores)
        torch.testing.assert_close(scores.softmax(-1), want[layer], atol=1e-6, rtol=0)


@pytest.mark.parametrize("fixture", TINY_MODELS)
def test_captured_tensors_work_with_weights_that_need_grad_and_in_place(fixture, request):
    """README's check z_h W_O^(h) = result_h with a weight that requires grad (an inference tensor
    cannot be saved for backward), on the native model through its own o_proj slice; in-place edits work."""
    model = request.getfixturevalue(fixture)
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    cap = capture_heads(model, tokens, rows=[1, 4])  # rows: the streamed pattern on the native backend
    layer, h = model.spec.n_layers - 1, 1
    W_h = model.W_O(layer)[h].detach().clone().requires_grad_()  # [d_head, d_model]
    product = cap["z"][layer][0, :, h] @ W_h
    torch.testing.assert_close(product.detach(), cap["result"][layer][0, :, h], atol=1e-5, rtol=1e-5)
    if "native" in fixture:
        d = model.spec.d_head
        o_proj = model.model.blocks[layer].attn.o_proj.weight
        assert o_proj.requires_grad
        by_module = cap["z"][layer][0, :, h] @ o_proj[:, h * d : (h + 1) * d].T
        torch.testing.assert_close(by_module.detach(), cap["result"][layer][0, :, h], atol=1e-5, rtol=1e-5)
    for kind in ("z", "result", "pattern", "attn_out"):
        before = cap[kind][layer].clone()
        cap[kind][layer] += 1
        assert torch.equal(cap[kind][layer], before + 1)


def test_capture_heads_refuses_bad_inputs_in_one_line(tiny_llama_gqa_native):
    """Each bad argument gets one line naming it (not an AttributeError, IndexError or reshape error
    from deep inside); one int for ``layers`` is a list of one."""
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.hooks import capture

    check_capture_inputs = lambda *a: capture.check_capture_inputs(*a)  # looked up when called
    model = tiny_llama_gqa_native  # vocabulary 101, n_ctx 128
    tokens = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(4))
    refused = [
        (lambda: capture_heads("smollm2-135m", tokens), TypeError, "model must be a loaded model"),
        (lambda: capture_heads(model, tokens.clone().fill_(101)), HeadprobeError, "tokens has token id 101, outside"),
        (lambda: capture_heads(model, tokens.clone().fill_(-1)), HeadprobeError, "tokens has token id -1,"),
        (lambda: capture_heads(model, tokens[:, :0]), HeadprobeError, "at least one token, got shape \\(2, 0\\)"),
        (lambda: capture_heads(model, torch.zeros(1, 129, dtype=torch.long)), HeadprobeError, "129 positions, more"),
        (lambda: check_capture_inputs(model, tokens.tolist()), TypeError, "tokens must be an integer tensor.*got list"),
        (lambda: check_capture_inputs(model, "t1 t2"), TypeError, "tokens must be an integer tensor.*got str"),
        (lambda: check_capture_inputs(model, tokens.float()), TypeError, "got a torch.float32 tensor"),
        (lambda: check_capture_inputs(model, tokens, tokens[:, :5]), HeadprobeError, "attention_mask \\(2, 5\\) must"),
    ]
    for call, error, message in refused:
        with pytest.raises(error, match=message) as info:
            call()
        assert "\n" not in str(info.value)
    one = capture_heads(model, tokens, layers=1)
    listed = capture_heads(model, tokens, layers=[1])
    assert set(one["z"]) == {1} and torch.equal(one["result"][1], listed["result"][1])


def test_capture_and_patterns_by_layer_refuse_bad_indices_by_name(tiny_llama_gqa_native):
    """``layers=1.0`` raised "'float' object is not iterable" (outside pytest, where jaxtyping's
    hook checks no types: :func:`_as_list` is what a notebook meets); patterns_by_layer checked no
    index (``layers=[5]`` or ``[-1]``: a KeyError of a hook name; ``layers=1``: "'int' object is not
    iterable"). Reference for what it yields: capture_heads, and rows summing to 1."""
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.hooks import capture

    model = tiny_llama_gqa_native
    tokens = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(5))
    seen = {}
    keep = lambda layer, pattern: seen.__setitem__(layer, pattern.clone())
    refused = [
        (lambda: capture._as_list(1.0, "layers"), TypeError, "layers must be an int or a sequence of ints, got 1.0"),
        (lambda: capture._as_list("1", "heads"), TypeError, "heads must be an int or a sequence of ints, got '1'"),
        (lambda: patterns_by_layer(model, tokens, keep, layers=[5]), HeadprobeError, "layer 5 is out of range"),
        (lambda: patterns_by_layer(model, tokens, keep, layers=[True]), HeadprobeError, "not an integer index"),
    ]
    for call, error, message in refused:
        with pytest.raises(error, match=message) as info:
            call()
        assert "\n" not in str(info.value)
    assert not seen
    assert capture._as_list(torch.tensor(1), "rows") == [1]
    patterns_by_layer(model, tokens, keep, layers=-1)
    ref = capture_heads(model, tokens, layers=1)["pattern"][1]
    assert list(seen) == [1] and torch.allclose(seen[1], ref, atol=1e-6)
    assert torch.allclose(seen[1].sum(-1), torch.ones(()), atol=1e-5)


@pytest.mark.parametrize("fixture", ["tiny_gpt2", "tiny_gpt2_native"])
def test_a_layer_out_of_range_is_the_capture_line_for_every_weight(fixture, request):
    """``model.W_O(30)`` raised torch's bare ``IndexError: index 30 is out of range`` (the bridge: a
    ``ModuleList`` error; ``sink_logits(99)`` returned None) where ``capture_heads(layers=99)`` says which
    layers there are: each per-layer accessor now refuses as capture does; a negative layer counts
    from the end, as there (layer -1 is layer 1 of the 2)."""
    from headprobe.probe.core.errors import HeadprobeError

    model = request.getfixturevalue(fixture)
    n = model.spec.n_layers
    accessors = {
        "W_O": model.W_O,
        "W_Q": model.W_Q,
        "W_K": model.W_K,
        "W_V": model.W_V,
        "b_O": model.b_O,
        "sink_logits": model.sink_logits,
        "norm_weights": model.norm_weights,
    }
    for name, get in accessors.items():
        for layer in (n, 99, -n - 1):
            with pytest.raises(HeadprobeError) as e:
                get(layer)
            said = f"layer {layer} is out of range: there are {n} (0 .. {n - 1}, or -{n} .. -1 from the end)"
            assert str(e.value) == said, (name, str(e.value))
        last, by_end = get(n - 1), get(-1)
        if isinstance(last, torch.Tensor):
            assert torch.equal(last, by_end), name
    with pytest.raises(HeadprobeError) as e:
        capture_heads(model, torch.zeros(1, 3, dtype=torch.long), layers=99)
    assert str(e.value) == f"layer 99 is out of range: there are {n} (0 .. {n - 1}, or -{n} .. -1 from the end)"


PER_LAYER_METHODS = [
    "attention_input",
    "attention_scale",
    "qk_terms",
    "forward_from",
    "scored_losses_from",
    "resume_scored_losses",
    "online_stats_geometry",
    "post_attention_norm_hooks",
    "attn_out_hook",
    "post_attention_norm_weight",
]


def _per_layer_calls(model) -> dict:
    """Every other ``LoadedModel`` method that takes a layer, called at ``layer`` with small valid inputs."""
    d, tokens = model.spec.d_model, torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(3)
    resid, attn = torch.randn(1, 5, d, generator=g), torch.randn(1, 5, d, generator=g)
    terms, ref = torch.randn(3, d, generator=g), torch.randn(d, generator=g)
    return {
        "attention_input": lambda layer: model.attention_input(layer, resid),
        "attention_scale": lambda layer: model.attention_scale(layer),
        "qk_terms": lambda layer: model.qk_terms(layer, 0, "q", terms, ref, 2),
        "forward_from": lambda layer: model.forward_from(layer, resid),
        "scored_losses_from": lambda layer: model.scored_losses_from(layer, tokens, resid, 1),
        "resume_scored_losses": lambda layer: model.resume_scored_losses(layer, tokens, resid, attn, 1),
        "online_stats_geometry": lambda layer: model.online_stats_geometry(layer),
        "post_attention_norm_hooks": lambda layer: model.post_attention_norm_hooks(layer),
        "attn_out_hook": lambda layer: model.attn_out_hook(layer),
        "post_attention_norm_weight": lambda layer: model.post_attention_norm_weight(layer),
    }


@pytest.mark.parametrize("fixture", ["tiny_gpt2", "tiny_gpt2_native", "tiny_llama_gqa_native"])
@pytest.mark.parametrize("method", PER_LAYER_METHODS)
def test_every_per_layer_method_refuses_a_layer_out_of_range_as_W_O_does(fixture, method, request):
    """Only the weights (W_O, W_Q, ..., above) checked their layer: ``forward_from(99, ...)`` or
    ``attention_scale(99)`` raised torch's bare ``IndexError``, ``scored_losses_from`` on the bridge and
    ``post_attention_norm_hooks`` took any layer silently, and a negative one picked the wrong
    layer (``resume_scored_losses(-1)`` ran every block again after the last; ``attn_out_hook(-1)``
    named ``blocks.-1``). Each now refuses with :meth:`layer_index`'s line and reads ``-1`` as the
    last layer. A method the backend does not offer (its own refusal at layer 0) is skipped."""
    from headprobe.probe.core.errors import HeadprobeError

    model = request.getfixturevalue(fixture)
    n, call = model.spec.n_layers, _per_layer_calls(model)[method]
    last = None
    if method != "post_attention_norm_weight" or model.has_post_attention_norm:  # no norm to read: range only
        try:
            last = call(n - 1)
        except HeadprobeError as e:
            pytest.skip(f"{method} is refused on {fixture}: {e}")
    for layer in (n, 99, -n - 1):
        with pytest.raises(HeadprobeError) as e:
            call(layer)
        said = f"layer {layer} is out of range: there are {n} (0 .. {n - 1}, or -{n} .. -1 from the end)"
        assert str(e.value) == said, (method, str(e.value))
    if last is not None:
        by_end = call(-1)
        if isinstance(last, torch.Tensor):
            assert torch.equal(last, by_end), method
        else:
            assert repr(last) == repr(by_end), method


@pytest.mark.parametrize("fixture", ["tiny_gpt2_native", "tiny_llama_gqa_native"])
def test_qk_terms_refuses_a_head_out_of_range(fixture, request):
    """``qk_terms(0, 99, ...)`` sliced past the projection and returned an empty ``[n + 1, 0]`` tensor,
    and head -1 the same (``slice(-d, 0)``): now the range line of :func:`capture_heads`' heads, and
    head -1 the last head."""
    from headprobe.probe.core.errors import HeadprobeError

    model = request.getfixturevalue(fixture)
    H, d = model.spec.n_heads, model.spec.d_model
    g = torch.Generator().manual_seed(4)
    terms, ref = torch.randn(3, d, generator=g), torch.randn(d, generator=g)
    for head in (H, 99, -H - 1):
        with pytest.raises(HeadprobeError) as e:
            model.qk_terms(0, head, "k", terms, ref, 2)
        assert str(e.value) == f"head {head} is out of range: there are {H} (0 .. {H - 1}, or -{H} .. -1 from the end)"
    assert torch.equal(model.qk_terms(0, -1, "k", terms, ref, 2), model.qk_terms(0, H - 1, "k", terms, ref, 2))


def _public_per_layer_methods() -> set[str]:
    """Every public method of ``LoadedModel`` whose first argument is ``layer`` (``layer_index``, the check, aside)."""
    import inspect

    from headprobe.probe.backends.base import LoadedModel

    return {
        name
        for name, f in vars(LoadedModel).items()
        if not name.startswith("_")
        and name != "layer_index"
        and inspect.isfunction(f)
        and list(inspect.signature(f).parameters)[1:2] == ["layer"]
    }


def test_a_new_backend_implementing_only_the_hooks_gets_every_range_check(tiny_gpt2_native):
    """Only ``W_O`` and ``sink_logits`` (and ``W_Q``/``W_K``/``W_V``) were templates checking their layer on
    ``LoadedModel``; every other per-layer method checked it inline in each backend (``forward_from``,
    ``qk_terms``, ``resume_scored_losses``, ...), so a new backend had to repeat each check. Now every
    public method taking a layer checks it, and ``qk_terms`` its head, on the base class and then calls the
    backend's ``_`` hook: a backend with only the hooks refuses a layer out of range in ``layer_index``'s
    line without its hook being called, and its hook sees ``-1`` as the last layer (head)."""
    from headprobe.probe.backends.base import LoadedModel
    from headprobe.probe.core.errors import HeadprobeError

    calls: list[tuple] = []

    class Reached(Exception):
        """A hook was called (raised, not returned: the interface's return types are checked at run time)."""

    def hook(name):
        def record(self, layer, *args, **kwargs):
            calls.append((name, layer, args[0]) if name == "_qk_terms" else (name, layer))
            raise Reached(name)

        return record

    hooks = (
        "_W_O _sink_logits _projection _b_O _norm_weights _post_attention_norm_hooks _attn_out_hook "
        "_post_attention_norm_weight _resume_scored_losses _scored_losses_from _forward_from _attention_input "
        "_attention_scale _qk_terms _online_stats_geometry _qkv_bias"
    ).split()
    HooksOnly = type("HooksOnly", (LoadedModel,), {"name": "hooks-only", **{h: hook(h) for h in hooks}})
    spec = tiny_gpt2_native.spec
    model = HooksOnly(None, None, spec)  # no module at all: nothing but the hooks can answer
    n, H, d = spec.n_layers, spec.n_heads, spec.d_model
    x, tokens = torch.zeros(1, 4, d), torch.zeros(1, 4, dtype=torch.long)
    cases = {
        "W_O": (model.W_O, "_W_O"),
        "W_Q": (model.W_Q, "_projection"),
        "W_K": (model.W_K, "_projection"),
        "W_V": (model.W_V, "_projection"),
        "sink_logits": (model.sink_logits, "_sink_logits"),
        "b_O": (model.b_O, "_b_O"),
        "norm_weights": (model.norm_weights, "_norm_weights"),
        "post_attention_norm_hooks": (model.post_attention_norm_hooks, "_post_attention_norm_hooks"),
        "attn_out_hook": (model.attn_out_hook, "_attn_out_hook"),
        "post_attention_norm_weight": (model.post_attention_norm_weight, "_post_attention_norm_weight"),
        "resume_scored_losses": (lambda l: model.resume_scored_losses(l, tokens, x, x, 1), "_resume_scored_losses"),
        "scored_losses_from": (lambda l: model.scored_losses_from(l, tokens, x, 1), "_scored_losses_from"),
        "forward_from": (lambda l: model.forward_from(l, x), "_forward_from"),
        "attention_input": (lambda l: model.attention_input(l, x), "_attention_input"),
        "attention_scale": (model.attention_scale, "_attention_scale"),
        "qk_terms": (lambda l: model.qk_terms(l, -1, "q", x[0], x[0, 0], 1), "_qk_terms"),
        "online_stats_geometry": (model.online_stats_geometry, "_online_stats_geometry"),
        "qkv_bias": (lambda l: model.qkv_bias(l, "q"), "_qkv_bias"),
    }
    assert set(cases) == _public_per_layer_methods()  # a new per-layer method joins this test
    for method, (call, name) in cases.items():
        for layer in (n, 99, -n - 1):
            calls.clear()
            with pytest.raises(HeadprobeError) as e:
                call(layer)
            said = f"layer {layer} is out of range: there are {n} (0 .. {n - 1}, or -{n} .. -1 from the end)"
            assert (str(e.value), calls) == (said, []), method
        calls.clear()
        with pytest.raises(Reached):
            call(-1)
        assert calls == [(name, n - 1, H - 1) if name == "_qk_terms" else (name, n - 1)], method
    for head in (H, 99, -H - 1):
        with pytest.raises(HeadprobeError) as e:
            model.qk_terms(0, head, "k", x[0], x[0, 0], 1)
        assert str(e.value) == f"head {head} is out of range: there are {H} (0 .. {H - 1}, or -{H} .. -1 from the end)"


def test_no_backend_overrides_a_per_layer_template():
    """A backend implements a per-layer method's ``_`` hook, never the public method, so no backend can
    skip the range check (``NativeModel.forward_from`` and ``BridgeModel.resume_scored_losses`` once held
    their own)."""
    from headprobe.probe.core.vocabulary import BACKEND_REGISTRY

    methods = _public_per_layer_methods()
    assert {"W_O", "forward_from", "qk_terms", "resume_scored_losses"} <= methods
    overrides = {name: sorted(methods & set(vars(BACKEND_REGISTRY.get(name)))) for name in BACKEND_REGISTRY.names()}
    assert all(not o for o in overrides.values()), overrides


@pytest.mark.parametrize("backend", ["tiny_gpt2", "tiny_gpt2_native"])
def test_qkv_bias_is_the_checkpoints_bias_split_by_head(backend, tiny_gpt2_checkpoint, request):
    """``qkv_bias(layer, which)`` on both backends is GPT-2's ``c_attn.bias`` (``[q | k | v]``, each
    ``n_heads * d_head``) cut into heads, read from the Hugging Face model itself; a bias-free Llama
    gives None. (The bridge's accessor was reached only through own_weights, never compared.)"""
    model = request.getfixturevalue(backend)
    hf = tiny_gpt2_checkpoint.hf_model
    n_heads, d_model = hf.config.n_head, hf.config.n_embd
    for layer, block in enumerate(hf.transformer.h):
        expected = block.attn.c_attn.bias.detach().split(d_model)
        for i, which in enumerate("qkv"):
            got = model.qkv_bias(layer, which)
            assert got is not None and got.shape == (n_heads, d_model // n_heads), (backend, layer, which)
            torch.testing.assert_close(got.detach().float().cpu(), expected[i].view(n_heads, -1), rtol=0, atol=1e-6)


def test_a_bias_free_model_has_no_qkv_bias(tiny_llama_gqa_native):
    assert all(tiny_llama_gqa_native.qkv_bias(0, which) is None for which in "qkv")
