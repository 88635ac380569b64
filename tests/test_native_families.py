"""Every family the native transformer loads, against Hugging Face and against itself.

For each tiny zoo checkpoint of a causal family (tests/zoo.py, from the family registry
``headprobe.probe.model.families.FAMILIES``: GPT-2, Llama, Mistral, Qwen2, Qwen3, OLMo-2, Gemma-2,
GPT-NeoX, DeepSeek-V3 with dense MLPs), the independent references are Hugging Face's eager model (logits to 1e-4,
every layer's ``output_attentions`` pattern to 1e-5), the load-time self-check's identity, the
plain per-head hook loop (:func:`sweep_loop`, which :func:`exact_sweep` must equal to 1e-4 nats),
the masked model (which the pruned model must equal), and the model without a KV cache or
without padding. Sequences are longer than the sliding window (8) so that windows matter. What
is known of each tiny model by hand (its layout, post-attention norm, self-check reference, whether
its heads can be removed, its variants and the options refused) is its family's ``TinySpec``.
"""

from __future__ import annotations

import json

import pytest
import torch
import zoo

from headprobe.analyses.ablation import exact_sweep, sweep_loop
from headprobe.probe.backends.native_loading import load_native
from headprobe.probe.backends.wrapping import wrap
from headprobe.probe.model.checkpoint import save_native
from headprobe.probe.model.config import TransformerConfig
from headprobe.probe.model.convert import supports
from headprobe.probe.model.families import FAMILIES as REGISTRY
from headprobe.probe.model.transformer import generate

FAMILIES = zoo.names()
VARIANTS = [(name, v) for name in FAMILIES for v in zoo.tiny(name).variants]
VARIANT_IDS = [f"{name}-{v.why}" for name, v in VARIANTS]
LOGIT_ATOL = 1e-4
PATTERN_ATOL = 1e-5
SWEEP_ATOL = 1e-4  # nats/token


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tiny_tokenizer):
    """(family name, Hugging Face checkpoint, the model wrap(backend="auto") gives)."""
    ckpt = zoo.make_checkpoint(request.param, tiny_tokenizer)
    return request.param, ckpt, wrap(ckpt, backend="auto")


def _tokens(batch=2, pos=20, seed=1):
    return torch.randint(0, zoo.VOCAB - 1, (batch, pos), generator=torch.Generator().manual_seed(seed))


def test_auto_picks_native(family):
    name, ckpt, model = family
    assert supports(ckpt.hf_model.config)
    assert model.backend == "native", name


def test_logits_equal_hugging_face(family):
    name, ckpt, model = family
    x = _tokens()
    with torch.no_grad():
        want = ckpt.hf_model(x).logits
        net = model.model
        fused = net(x)
        net.force_eager = True
        try:
            eager = net(x)
        finally:
            net.force_eager = False
    assert (fused - want).abs().max() < LOGIT_ATOL, name
    assert (eager - want).abs().max() < LOGIT_ATOL, name


def test_every_pattern_equals_hugging_face(family):
    name, ckpt, model = family
    x = _tokens()
    with torch.no_grad():
        want = ckpt.hf_model(x, output_attentions=True).attentions
    got = {}
    hooks = [
        (f"blocks.{l}.attn.hook_pattern", lambda p, hook, l=l: got.__setitem__(l, p.clone()))
        for l in range(model.spec.n_layers)
    ]
    model.forward(x, fwd_hooks=hooks)
    cfg = model.model.cfg
    for l in range(model.spec.n_layers):
        assert got[l].shape == (2, model.spec.n_heads, 20, 20)
        assert (got[l] - want[l]).abs().max() < PATTERN_ATOL, (name, l)
        if model.sink_logits(l) is None:
            assert torch.allclose(got[l].sum(-1), torch.ones(()), atol=1e-5)
        else:  # learned sinks (GPT-OSS): every row gives the sink some weight, as Hugging Face's rows do
            assert (got[l].sum(-1) < 1 - 1e-3).all()
            torch.testing.assert_close(got[l].sum(-1), want[l].sum(-1), atol=1e-5, rtol=0)
        if cfg.is_sliding(l):  # the window is exercised: keys >= window back get exactly 0
            q, k = torch.meshgrid(torch.arange(20), torch.arange(20), indexing="ij")
            assert (got[l][..., q - k >= cfg.sliding_window] == 0).all()
            assert (got[l][..., q - k == cfg.sliding_window - 1] > 0).all()
        if cfg.is_chunked(l):  # chunked attention (Llama-4): keys of another chunk get exactly 0
            q, k = torch.meshgrid(torch.arange(20), torch.arange(20), indexing="ij")
            same = q // cfg.attention_chunk == k // cfg.attention_chunk
            assert (got[l][..., ~same] == 0).all() and (got[l][..., same & (k <= q)] > 0).all()


def test_self_check_passes(family):
    name, ckpt, model = family
    check, tiny = model.self_check, zoo.tiny(name)
    assert check.ok, (name, check)
    assert check.max_relative_error < 1e-5
    assert check.post_attention_norm == tiny.post_attention_norm
    assert check.reference == tiny.self_check_reference
    if tiny.post_attention_norm:  # the weight read off blocks[l].ln1_post is the HF norm's effective weight
        w = ckpt.hf_model.get_submodule(tiny.attention_output.format(l=1)).weight.detach()
        assert torch.allclose(model.post_attention_norm_weight(1), tiny.norm_offset + w, atol=1e-5)


@pytest.mark.parametrize("kind", ["zero", "resample"])
def test_exact_sweep_equals_hook_loop(family, kind):
    name, ckpt, model = family
    x, source = _tokens(seed=1), _tokens(seed=2)
    fast = exact_sweep(model, x, kind=kind, source_tokens=source, first=3, max_batch=4)
    slow = sweep_loop(model, x, kind=kind, source_tokens=source, first=3)
    assert abs(fast.clean_loss - slow.clean_loss) < SWEEP_ATOL
    assert (fast.loss - slow.loss).abs().max() < SWEEP_ATOL, name
    assert slow.effect.abs().max() > 2 * SWEEP_ATOL  # the heads matter, so the comparison can fail


def test_kv_cache_generation_equals_recomputation(family):
    name, ckpt, model = family
    prompt = _tokens(batch=1, pos=6)
    with_cache, _ = generate(model.model, prompt, n_new=10)  # 16 tokens: past the sliding window
    without, _ = generate(model.model, prompt, n_new=10, use_cache=False)
    assert torch.equal(with_cache, without), name


def test_left_padding_equals_unpadded(family):
    name, ckpt, model = family
    x = _tokens(batch=1, pos=14)
    padded = torch.cat([torch.full((1, 5), 100), x], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 14, dtype=torch.long)], dim=1)
    with torch.no_grad():
        want = model.model(x)
        got = model.model(padded, attention_mask=mask)[:, 5:]
    assert (got - want).abs().max() < 1e-4, name


def test_new_config_fields_survive_a_checkpoint(tmp_path, tiny_tokenizer):
    """save_native writes the config as JSON (tuples become lists); load_native rebuilds it."""
    ckpt = zoo.make_checkpoint("gemma2", tiny_tokenizer)
    model = wrap(ckpt, backend="native")
    save_native(model.model, tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model"]["sliding_layers"] == [0]
    again = load_native(tmp_path)
    assert again.model.cfg == model.model.cfg
    x = _tokens()
    with torch.no_grad():
        assert torch.equal(again.model(x), model.model(x))


def test_defaults_are_todays_model():
    """The new fields default to GPT-2's pre-norm, sequential, full-attention block."""
    cfg = TransformerConfig(n_layers=2, d_model=32, n_heads=4, d_vocab=11)
    assert cfg.d_head == 8 and cfg.qkv_bias is True and not cfg.is_sliding(0)
    assert (cfg.pre_norm, cfg.post_norm, cfg.parallel_residual, cfg.embed_scale) == (True, False, False, False)
    assert cfg.qk_norm == "none" and cfg.attn_softcap is None and cfg.final_softcap is None and cfg.rotary_dim is None


@pytest.mark.parametrize(
    "family_name, change", [(name, change) for name in REGISTRY.names() for change in zoo.tiny(name).unsupported]
)
def test_unsupported_options_go_to_the_bridge(family_name, change):
    from transformers import AutoConfig

    assert supports(AutoConfig.for_model(family_name, **zoo.tiny(family_name).fields))  # the change alone refuses
    assert not supports(AutoConfig.for_model(family_name, **{**zoo.tiny(family_name).fields, **change}))


@pytest.fixture(scope="module")
def family_dir(family, tmp_path_factory, tiny_tokenizer):
    name, ckpt, model = family
    d = tmp_path_factory.mktemp(f"tiny-{name}")
    ckpt.hf_model.save_pretrained(d)
    tiny_tokenizer.save_pretrained(d)
    return name, d


def test_pruned_model_equals_masked_model_or_is_refused(family):
    """Real head removal (library): exact where supported; OLMo-2's all-head QK-norm and MLA refused."""
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.model.pruned import keep_mask_from, remove_heads

    name, ckpt, model = family
    net, unprunable = model.model, zoo.tiny(name).unprunable
    keep = keep_mask_from([(0, 0), (0, 1), (1, 2)], net.cfg.n_layers, net.cfg.n_heads)
    if unprunable:
        with pytest.raises(HeadprobeError, match=unprunable):
            remove_heads(net, keep)
        return
    pruned = remove_heads(net, keep)
    x = _tokens()
    with torch.no_grad():
        want = net(x, head_mask=keep.float())
        assert (pruned(x) - want).abs().max() < 1e-5, name
        assert (net(x) - want).abs().max() > 1e-3  # the removed heads mattered


def test_prune_save_pruned_exits_0_or_refuses_in_one_line(family_dir, tmp_path, capsys):
    from headprobe.cli import main

    name, d = family_dir
    text = tmp_path / "text.txt"
    g = torch.Generator().manual_seed(0)
    text.write_text(" ".join(f"t{i}" for i in torch.randint(0, 100, (2000,), generator=g).tolist()))
    out = tmp_path / "prune"
    code = main(
        [
            "prune",
            "--model",
            str(d),
            "--out",
            str(out),
            "--text",
            str(text),
            "--seq-len",
            "16",
            "--n-natural",
            "2",
            "--n-repeated",
            "2",
            "--period",
            "6",
            "--device",
            "cpu",
            "--step-fraction",
            "0.5",
            "--max-fraction",
            "0.5",
            "--save-pruned",
            "--save-fraction",
            "0.5",
            "--method",
            "michel",
        ]
    )
    err = capsys.readouterr().err
    assert code in (0, 2), name
    if code == 2:
        lines = [l for l in err.splitlines() if l.startswith("headprobe: error:")]
        assert len(lines) == 1 and "Traceback" not in err, err[-300:]
        assert not (out / "pruned_model").exists()
    else:
        summary = json.loads((out / "summary.json").read_text())
        assert summary["pruned_model"]["max_abs_logit_diff_vs_masked"] < 1e-4
    unprunable = zoo.tiny(name).unprunable
    if unprunable:
        assert code == 2 and unprunable in lines[0]
    else:
        assert code == 0, (name, err[-300:])


def _variant(family, tokenizer, **change):
    """A tiny ``family`` checkpoint as tests/zoo.py builds it, with config fields changed."""
    return zoo.make_checkpoint(family, tokenizer, **change)


@pytest.mark.parametrize("family_name, variant", VARIANTS, ids=VARIANT_IDS)
def test_variants_equal_hugging_face(tiny_tokenizer, family_name, variant):
    ckpt = _variant(family_name, tiny_tokenizer, **variant.change)
    model = wrap(ckpt, backend="auto")
    assert model.backend == "native" and model.self_check.ok
    hf_cfg = ckpt.hf_model.config  # z's width: MLA's value width (its head_dim is the rotary width), else head_dim
    want_d_head = getattr(hf_cfg, "v_head_dim", None) or getattr(hf_cfg, "head_dim", None)
    assert model.spec.d_head == (want_d_head or hf_cfg.hidden_size // hf_cfg.num_attention_heads)
    x = _tokens()
    with torch.no_grad():
        out = ckpt.hf_model(x, output_attentions=True)
        assert (model.model(x) - out.logits).abs().max() < LOGIT_ATOL
    got = {}
    model.forward(
        x,
        fwd_hooks=[
            (f"blocks.{l}.attn.hook_pattern", lambda p, hook, l=l: got.__setitem__(l, p.detach().clone()))
            for l in range(2)
        ],
    )
    assert max(float((got[l] - out.attentions[l]).abs().max()) for l in range(2)) < PATTERN_ATOL
    fast, slow = exact_sweep(model, x, first=3), sweep_loop(model, x, first=3)
    assert (fast.loss - slow.loss).abs().max() < SWEEP_ATOL


# ---------------------------------------------------------------------------------------------
# One layout: the native config, both loaders' specs and the cost formulas agree
# ---------------------------------------------------------------------------------------------


def _assert_one_layout(ckpt, native, family_name):
    """The native spec's layout is its config's, the bridge's spec reads the same one from
    TransformerLens and the Hugging Face config (for a family the bridge wraps), and the formulas
    count the parameters that are in the native model's and Hugging Face's attention modules;
    ``spec.d_head`` is z's width."""
    from headprobe.probe.layout import cost
    from headprobe.probe.layout.attention import attention_module
    from headprobe.probe.model.convert import config_from_hf

    lay = native.spec.layout
    assert lay == native.model.cfg.layout == config_from_hf(ckpt.hf_model.config).layout
    if zoo.tiny(family_name).bridge:
        assert wrap(ckpt, backend="transformer-lens").spec.layout == lay
    n_params = cost.attention_params_per_layer(lay)
    assert [sum(p.numel() for p in b.attn.parameters()) for b in native.model.blocks] == [n_params] * lay.n_layers
    assert sum(p.numel() for p in attention_module(ckpt.hf_model).parameters()) == n_params
    assert (
        native.model.blocks[0].attn.o_proj.in_features == lay.n_heads * native.spec.d_head == lay.n_heads * lay.d_head
    )
    return lay


def test_one_layout_for_config_spec_and_formulas(family):
    name, ckpt, model = family
    lay, tiny = _assert_one_layout(ckpt, model, name), zoo.tiny(name)
    assert (lay.kind, lay.bias, lay.qk_norm, lay.windows) == tiny.layout
    n_kv_heads = lay.n_heads if lay.kind in ("MHA", "MLA") else tiny.fields["num_key_value_heads"]
    assert (model.spec.kind, model.spec.n_kv_heads) == (lay.kind, n_kv_heads)


@pytest.mark.parametrize("family_name, variant", VARIANTS, ids=VARIANT_IDS)
def test_one_layout_for_variants(tiny_tokenizer, family_name, variant):
    ckpt = _variant(family_name, tiny_tokenizer, **variant.change)
    lay = _assert_one_layout(ckpt, wrap(ckpt, backend="native"), family_name)
    assert {k: getattr(lay, k) for k in variant.layout} == dict(variant.layout)


@pytest.mark.parametrize(
    "fields",
    [
        dict(bias=True),  # GPT-2: "all"
        dict(bias=False, qkv_bias=True),  # "qkv"
        dict(bias=True, qkv_bias=False),  # W_O only: "out"
        dict(bias=False, qk_norm="per_head", d_head=24, n_kv_heads=2),
        dict(bias=False, qk_norm="full", n_kv_heads=1),
        dict(bias=False, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=6, q_lora_rank=12, positional="rotary"),
        dict(bias=False, kv_lora_rank=8),  # MLA without a rotary key (learned positions)
    ],
)
def test_config_layout_counts_the_attention_module(fields):
    """The formula on ``TransformerConfig.layout`` equals the parameters of the module the config
    builds; changing the layout's bias or QK-norm changes the count (the comparison can fail)."""
    from dataclasses import replace

    from headprobe.probe.layout import cost
    from headprobe.probe.model.transformer import Transformer

    cfg = TransformerConfig(n_layers=1, d_model=32, n_heads=4, d_vocab=11, mlp=None, **fields)
    lay = cfg.layout
    counted = sum(p.numel() for p in Transformer(cfg).blocks[0].attn.parameters())
    assert cost.attention_params_per_layer(lay) == counted
    others = [replace(lay, bias=b) for b in ("none", "qkv", "all", "out") if b != lay.bias]
    if not lay.is_mla:
        others += [replace(lay, qk_norm=q) for q in ("none", "per_head", "full") if q != lay.qk_norm]
    assert all(cost.attention_params_per_layer(o) != counted for o in others)


def test_deepseek_mixture_of_experts_is_refused_in_one_line(tiny_tokenizer):
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.model.convert import config_from_hf

    ckpt = _variant("deepseek_v3", tiny_tokenizer, first_k_dense_replace=1)
    with pytest.raises(HeadprobeError, match="mixture-of-experts") as e:
        config_from_hf(ckpt.hf_model.config)
    assert "\n" not in str(e.value)
    with pytest.raises(HeadprobeError, match="mixture-of-experts"):
        wrap(ckpt, backend="native")


@pytest.mark.parametrize(
    "family_name, change",
    [
        ("deepseek_v3", dict(qk_nope_head_dim=12, v_head_dim=28)),  # three different widths
        ("deepseek_v3", dict(qk_nope_head_dim=20, v_head_dim=12)),
        ("gemma2", dict(head_dim=24, query_pre_attn_scalar=20)),  # n_heads * head_dim != d_model
        ("llama", {}),
    ],
)
def test_d_head_is_the_width_of_z_and_d_qk_that_of_queries_and_keys(tiny_tokenizer, family_name, change):
    """One meaning per width, against Hugging Face's config and the shapes the hooks see: ``d_head``
    is the width of z and of the values in the native config, its layout, the native and the
    bridge's spec; ``d_qk`` the width of a query and a key (MLA: ``qk_nope + qk_rope``)."""
    ckpt = _variant(family_name, tiny_tokenizer, **change)
    hf = ckpt.hf_model.config
    mla = family_name == "deepseek_v3"
    want_z = hf.v_head_dim if mla else (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    want_qk = hf.qk_nope_head_dim + hf.qk_rope_head_dim if mla else want_z
    native = wrap(ckpt, backend="native")
    with torch.no_grad():
        _, cache = native.model.run_with_cache(_tokens())
    assert cache["blocks.0.attn.hook_z"].shape[-1] == cache["blocks.0.attn.hook_v"].shape[-1] == want_z
    assert cache["blocks.0.attn.hook_q"].shape[-1] == cache["blocks.0.attn.hook_k"].shape[-1] == want_qk
    cfg, lay = native.model.cfg, native.spec.layout
    bridge_lay = wrap(ckpt, backend="transformer-lens").spec.layout
    assert cfg.d_head == lay.d_head == native.spec.d_head == bridge_lay.d_head == want_z
    assert cfg.d_qk == lay.d_qk == bridge_lay.d_qk == want_qk


# ---------------------------------------------------------------------------------------------
# TransformerConfig speaks the layout's vocabulary, and reads what older headprobe saved
# ---------------------------------------------------------------------------------------------

#: The spellings of ``qk_norm`` before it took the layout's names, by hand: new -> old.
_OLD_QK_NORM_SPELLING = {"none": None, "per_head": "head", "full": "all"}


@pytest.mark.parametrize("new, old", list(_OLD_QK_NORM_SPELLING.items()))
def test_config_takes_the_layouts_qk_norm_names_and_the_old_ones(new, old):
    from headprobe.probe.layout.attention import QK_NORM_KINDS

    cfg = TransformerConfig(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_vocab=11, qk_norm=new)
    assert new in QK_NORM_KINDS and cfg.qk_norm == cfg.layout.qk_norm == new
    assert TransformerConfig(n_layers=1, d_model=32, n_heads=4, n_kv_heads=2, d_vocab=11, qk_norm=old) == cfg


def _in_old_names(fields: dict) -> dict:
    """A config dict as an older headprobe saved it, by hand: ``head_dim`` (None when it is
    ``d_model // n_heads``) instead of ``d_head``, ``qk_norm`` "head"/"all"/None, and MLA's
    ``qk_nope_head_dim`` None when it equals the value width."""
    old = {k: v for k, v in fields.items() if k != "d_head"}
    old["head_dim"] = None if fields["d_head"] * fields["n_heads"] == fields["d_model"] else fields["d_head"]
    old["qk_norm"] = _OLD_QK_NORM_SPELLING[fields["qk_norm"]]
    if fields["qk_nope_head_dim"] == fields["d_head"]:
        old["qk_nope_head_dim"] = None
    return old


def _rewrite_config_in_old_names(directory):
    path = directory / "config.json"
    meta = json.loads(path.read_text(encoding="utf-8"))
    meta["model"] = _in_old_names(meta["model"])
    path.write_text(json.dumps(meta), encoding="utf-8")
    return meta["model"]


@pytest.mark.parametrize(
    "family_name, change",
    [
        ("gemma2", dict(head_dim=24, query_pre_attn_scalar=20)),  # a d_head of its own
        ("qwen3", {}),  # per-head QK-norm ("head")
        ("olmo2", {}),  # whole-projection QK-norm ("all")
        ("deepseek_v3", dict(qk_nope_head_dim=12, v_head_dim=28)),  # MLA, three widths
    ],
)
def test_checkpoints_saved_with_the_old_names_load_the_same_model(tiny_tokenizer, tmp_path, family_name, change):
    """A headprobe checkpoint whose config.json uses the old names loads into the config of
    today's names and gives the same logits as the model that was saved."""
    model = wrap(_variant(family_name, tiny_tokenizer, **change), backend="native")
    save_native(model.model, tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    old = _rewrite_config_in_old_names(tmp_path)
    assert "d_head" not in old and old["qk_norm"] in (None, "head", "all")
    again = load_native(tmp_path)
    assert again.model.cfg == model.model.cfg and again.spec.layout == model.spec.layout
    assert again.model.cfg.qk_norm in ("none", "per_head", "full")
    x = _tokens()
    with torch.no_grad():
        assert torch.equal(again.model(x), model.model(x))


@pytest.mark.parametrize(
    "family_name, change", [("gemma2", dict(head_dim=24, query_pre_attn_scalar=20)), ("qwen3", {})]
)
def test_pruned_models_saved_with_the_old_names_load_the_same_model(tiny_tokenizer, tmp_path, family_name, change):
    """The same for a pruned model directory (``prune --save-pruned``, read small and at full
    shape) and a pruned model file (:func:`~headprobe.probe.model.pruned.save_pruned`)."""
    from headprobe.probe.model.pruned import (
        keep_mask_from,
        load_pruned,
        load_pruned_dir,
        load_pruned_dir_full,
        remove_heads,
        save_pruned,
        save_pruned_dir,
    )

    net = wrap(_variant(family_name, tiny_tokenizer, **change), backend="native").model
    pruned = remove_heads(net, keep_mask_from([(0, 1), (1, 2), (1, 3)], net.cfg.n_layers, net.cfg.n_heads))
    save_pruned_dir(pruned, tmp_path / "dir", tiny_tokenizer)
    _rewrite_config_in_old_names(tmp_path / "dir")
    payload_path = tmp_path / "pruned.pt"
    save_pruned(pruned, payload_path)
    payload = torch.load(payload_path, weights_only=True)
    payload["config"] = _in_old_names(payload["config"])
    torch.save(payload, payload_path)
    x = _tokens()
    with torch.no_grad():
        want = pruned(x)
        for again in (
            load_pruned_dir(tmp_path / "dir"),
            load_pruned_dir_full(tmp_path / "dir")[0],
            load_pruned(payload_path),
        ):
            assert again.cfg == net.cfg
            assert (again(x) - want).abs().max() < 1e-5


def test_a_set_ablation_started_at_its_first_layer_equals_whole_forwards(family):
    """Head-set ablations started at each set's first ablated layer from the clean residual
    (CleanResiduals, scored_losses_from) give the losses of whole forwards with the same hooks, and
    the blocks before that layer do not run again."""
    from headprobe.analyses.ablation import CleanResiduals, set_ablation_losses

    name, _, model = family
    kind, spec = "mean", model.spec
    x = _tokens(2, 16)
    mean_z = torch.randn(spec.n_layers, spec.n_heads, spec.d_head, generator=torch.Generator().manual_seed(0))
    last = spec.n_layers - 1
    sets = [[(last, 0)], [(last, 0), (last, spec.n_heads - 1)], [(0, 1), (last, 0)], [(last, 1)]]
    whole = set_ablation_losses(model, x, sets, kind, mean_z, first=1)
    clean = CleanResiduals(model, x, [last, 0])
    clean.at(last)  # record it now, so that the count below sees only the ablations
    calls = []
    handle = model.model.blocks[0].register_forward_hook(lambda *a: calls.append(1))
    try:
        resumed = set_ablation_losses(
            model, x, [s for s in sets if s[0][0] == last], kind, mean_z, first=1, clean=clean
        )
    finally:
        handle.remove()
    torch.testing.assert_close(resumed, whole[[0, 1, 3]], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        set_ablation_losses(model, x, sets, kind, mean_z, first=1, clean=clean), whole, atol=1e-5, rtol=1e-5
    )  # sets of two first layers, in their order
    assert not calls, name  # no set of these starts before the last layer: block 0 never ran
    assert not torch.allclose(whole[0], whole[3])  # the sets differ, so the comparison can fail


def test_tied_gpt_neox_without_its_unembedding_loads_and_untied_is_refused():
    """safetensors keeps one name of a tied pair; a tied GPT-NeoX saved so has no ``lm_head.weight``
    (this gave ``'NoneType' object has no attribute 'contiguous'``). Reference: Hugging Face's logits."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from headprobe.probe.model.convert import NativeSource

    def state(tied):
        hf_cfg = GPTNeoXConfig(
            vocab_size=64,
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=64,
            tie_word_embeddings=tied,
        )
        torch.manual_seed(0)
        hf = GPTNeoXForCausalLM(hf_cfg).eval()
        sd = {k: v for k, v in hf.state_dict().items() if k not in ("lm_head.weight", "embed_out.weight")}
        return hf_cfg, hf, sd

    hf_cfg, hf, sd = state(tied=True)
    net = NativeSource.of(hf_cfg).build(sd)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(net(tokens), hf(tokens).logits, rtol=1e-4, atol=1e-4)
    hf_cfg, _, sd = state(tied=False)
    with pytest.raises(KeyError, match="lm_head.weight"):
        NativeSource.of(hf_cfg).build(sd)


# ---------------------------------------------------------------------------------------------
# Per-layer rotary (NoPE layers, a base and a linear factor per layer), interleaved pairs, logit scale
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family_name, change, want",
    [
        ("smollm3", {}, dict(rope_thetas=(2e6, None))),  # SmolLM3Config.default_theta 2e6, layer 1 NoPE
        ("cohere2", {}, dict(rope_thetas=(None, 1e4), rotary_interleaved=True, logit_scale=0.3)),
        ("gemma3_text", {}, dict(rope_thetas=(1e4, 1e6), rope_factors=None)),
        (
            "gemma3_text",
            dict(
                rope_parameters={
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                    "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
                }
            ),
            dict(rope_thetas=(1e4, 1e6), rope_factors=(1.0, 8.0)),
        ),
        ("olmo3", {}, dict(rope_thetas=(1e4, 5e5))),
        ("llama", {}, dict(rope_thetas=None, rope_factors=None, rotary_interleaved=False, logit_scale=None)),
    ],
)
def test_per_layer_rotary_fields_read_from_the_config(tiny_tokenizer, tmp_path, family_name, change, want):
    """The fields as read by hand from the tiny Hugging Face configs (NoPE layers None), each
    layer's rotary module built from them, and a JSON round trip (save_native/load_native) that
    gives the same config and logits."""
    from transformers import AutoConfig

    from headprobe.probe.model.convert import config_from_hf

    hf_cfg = AutoConfig.for_model(family_name, **{**zoo.tiny(family_name).fields, **change})
    cfg = config_from_hf(hf_cfg)
    assert {k: getattr(cfg, k) for k in want} == want
    model = wrap(_variant(family_name, tiny_tokenizer, **change), backend="native")
    for l, block in enumerate(model.model.blocks):
        rope = cfg.layer_rope(l)
        assert (block.attn.rotary is None) == (rope is None)
        if rope is not None:
            assert (block.attn.rotary.theta, block.attn.rotary.factor) == rope
    save_native(model.model, tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    again = load_native(tmp_path)
    assert again.model.cfg == model.model.cfg
    x = _tokens()
    with torch.no_grad():
        assert torch.equal(again.model(x), model.model(x))


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(rope_thetas=(1e4,)), "rope_thetas must hold 2"),
        (dict(rope_thetas=(1e4, -1.0)), "rope_thetas must hold 2 positive"),
        (dict(rope_factors=(1.0, 0.0)), "rope_factors must hold 2 positive"),
        (dict(rope_thetas=(1e4, None), positional="learned"), "rope_thetas needs rotary"),
        (dict(rotary_interleaved=True, positional="learned"), "rotary_interleaved needs rotary"),
        (dict(logit_scale=0.0), "logit_scale must be positive"),
    ],
)
def test_per_layer_rotary_fields_are_checked(fields, match):
    from headprobe.probe.core.errors import HeadprobeError

    base = dict(n_layers=2, d_model=32, n_heads=4, d_vocab=11, positional="rotary")
    assert TransformerConfig(**base).layer_rope(1) == (1e4, 1.0)
    with pytest.raises(HeadprobeError, match=match):
        TransformerConfig(**{**base, **fields})


def test_gated_attention_gate_hook_is_hugging_faces_gate(tiny_tokenizer):
    """Qwen3-Next: ``hook_gate`` is sigmoid of the gate half of Hugging Face's own ``q_proj`` output
    (per head ``[query, gate]``), and ``hook_z`` is that gate times ``pattern @ v`` (so the
    decomposition ``sum_h z_h W_O^(h)`` carries the gate); a model without the gate is caught."""
    ckpt = zoo.make_checkpoint("qwen3_next", tiny_tokenizer)
    model = wrap(ckpt, backend="native")
    x = _tokens()
    hf_q = {}
    handles = [
        ckpt.hf_model.model.layers[l].self_attn.q_proj.register_forward_hook(
            lambda m, a, out, l=l: hf_q.__setitem__(l, out.detach())
        )
        for l in range(2)
    ]
    try:
        with torch.no_grad():
            want = ckpt.hf_model(x).logits
    finally:
        for h in handles:
            h.remove()
    with torch.no_grad():
        _, cache = model.model.run_with_cache(x)
    H, d = model.spec.n_heads, model.spec.d_head
    for l in range(2):
        gate = torch.sigmoid(hf_q[l].view(2, 20, H, 2 * d)[..., d:])
        torch.testing.assert_close(cache[f"blocks.{l}.attn.hook_gate"], gate, atol=1e-6, rtol=1e-5)
        v = cache[f"blocks.{l}.attn.hook_v"].repeat_interleave(H // model.model.cfg.n_kv_heads, dim=2)
        ungated = torch.einsum("bhqk,bkhd->bqhd", cache[f"blocks.{l}.attn.hook_pattern"], v)
        torch.testing.assert_close(cache[f"blocks.{l}.attn.hook_z"], gate * ungated, atol=1e-6, rtol=1e-5)
        assert (gate - 1).abs().max() > 0.1  # the gate matters
    no_gate = [(f"blocks.{l}.attn.hook_gate", lambda g, hook: torch.ones_like(g)) for l in range(2)]
    with torch.no_grad():
        assert (model.model.run_with_hooks(x, fwd_hooks=no_gate) - want).abs().max() > 10 * LOGIT_ATOL


# ---------------------------------------------------------------------------------------------
# Hybrid models: linear-attention layers (no heads) among the attention layers
# ---------------------------------------------------------------------------------------------

HYBRIDS = [name for name in FAMILIES if zoo.tiny(name).hybrid is not None]


@pytest.fixture(scope="module", params=HYBRIDS)
def hybrid(request, tiny_tokenizer):
    """(family name, its hybrid Hugging Face checkpoint, the model wrap(backend="auto") gives)."""
    ckpt = zoo.make_checkpoint(request.param, tiny_tokenizer, **zoo.tiny(request.param).hybrid)
    return request.param, ckpt, wrap(ckpt, backend="auto")


def _hybrid_dir_and_text(ckpt, tokenizer, tmp_path):
    """The hybrid checkpoint saved as a model directory, and a seeded text of its word tokens."""
    d = tmp_path / "model"
    ckpt.hf_model.save_pretrained(d)
    tokenizer.save_pretrained(d)
    text = tmp_path / "text.txt"
    g = torch.Generator().manual_seed(0)
    text.write_text(" ".join(f"t{i}" for i in torch.randint(0, 100, (2000,), generator=g).tolist()))
    return d, text


def _heads_by_hand(hf_config):
    """The layers with heads, read off the Hugging Face config's ``layer_types``."""
    return tuple(l for l, t in enumerate(hf_config.layer_types) if t != "linear_attention")


def test_hybrid_loads_natively_with_heads_in_attention_layers_only(hybrid):
    name, ckpt, model = hybrid
    heads = _heads_by_hand(ckpt.hf_model.config)
    assert model.backend == "native" and 0 < len(heads) < model.spec.n_layers, name
    assert model.spec.attention_layers == model.spec.layout.head_layers == heads
    names = set(model.hook_names())
    for l in range(model.spec.n_layers):  # every block keeps its residual hooks; heads' hooks only where heads are
        assert {f"blocks.{l}.hook_resid_pre", f"blocks.{l}.hook_resid_post", f"blocks.{l}.hook_mlp_out"} <= names
        assert (f"blocks.{l}.attn.hook_pattern" in names) == (l in heads)


def test_hybrid_logits_and_patterns_equal_hugging_face(hybrid):
    name, ckpt, model = hybrid
    x = _tokens()
    with torch.no_grad():
        out = ckpt.hf_model(x, output_attentions=True)
        got_logits = model.model(x)
    assert (got_logits - out.logits).abs().max() <= LOGIT_ATOL * out.logits.abs().max(), name
    got = {}
    model.forward(
        x,
        fwd_hooks=[
            (f"blocks.{l}.attn.hook_pattern", lambda p, hook, l=l: got.__setitem__(l, p.detach().clone()))
            for l in model.spec.attention_layers
        ],
    )
    want = [a for a in out.attentions if a is not None]  # Hugging Face gives a pattern per attention layer
    assert len(want) == len(got) == len(model.spec.attention_layers)
    for w, l in zip(want, model.spec.attention_layers):
        assert (got[l] - w).abs().max() < PATTERN_ATOL, (name, l)


def test_hybrid_logits_fail_without_a_linear_layer(hybrid):
    """The comparison above can fail: a linear layer passed through as identity moves the logits."""
    name, ckpt, model = hybrid
    x = _tokens()
    linear = next(l for l in range(model.spec.n_layers) if l not in model.spec.attention_layers)
    block = model.model.blocks[linear]
    with torch.no_grad():
        want = ckpt.hf_model(x).logits
        handle = block.attn.mixer.register_forward_hook(lambda mod, args, out: torch.zeros_like(out))
        try:
            broken = model.model(x)
        finally:
            handle.remove()
    assert (broken - want).abs().max() > 10 * LOGIT_ATOL * want.abs().max(), name


def test_hybrid_self_check_and_decomposition(hybrid):
    name, ckpt, model = hybrid
    check = model.self_check
    assert check.ok and check.max_relative_error < 1e-5, (name, check)
    assert check.worst_layer in model.spec.attention_layers
    from headprobe.probe.hooks.capture import capture_internal

    cap = capture_internal(model, _tokens(), residual=True)
    assert sorted(cap["result"]) == list(model.spec.attention_layers)
    for l in model.spec.attention_layers:  # heads' results sum to what the layer adds, by the layer's own number
        ref = (cap["resid_mid"][l] - cap["resid_pre"][l]).double()
        added = (cap["result"][l].sum(2) + cap["b_O"][l]).double()
        assert float((added - ref).norm() / ref.norm()) < 1e-5, (name, l)


def test_hybrid_scan_scores_attention_layers_only(hybrid, tmp_path, tiny_tokenizer):
    """``headprobe scan`` runs: the linear layers' head slots are NaN, top heads and controls are real heads."""
    import pandas as pd

    from headprobe.cli import main

    name, ckpt, model = hybrid
    d, text = _hybrid_dir_and_text(ckpt, tiny_tokenizer, tmp_path)
    out = tmp_path / "scan"
    assert (
        main(
            [
                "scan",
                "--model",
                str(d),
                "--out",
                str(out),
                "--text",
                str(text),
                "--seq-len",
                "24",
                "--n-natural",
                "4",
                "--n-repeated",
                "4",
                "--n-random",
                "3",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    heads = set(model.spec.attention_layers)
    table = pd.read_csv(out / "head_scores.csv")
    for layer, rows in table.groupby("layer"):
        assert rows["induction"].isna().all() == (layer not in heads), (name, layer)
    summary = json.loads((out / "summary.json").read_text())
    named = [h["head"] for top in summary["top_heads"].values() for h in top]
    named += [h for a in summary["ablations"] for draw in a["random_heads"] for h in draw]
    assert named and all(int(h.split(".")[0]) in heads for h in named), named


def test_hybrid_head_weights_refuse_in_one_line(hybrid):
    from headprobe.analyses.composition import head_weights
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match="hybrid models") as e:
        head_weights(hybrid[2])
    assert "\n" not in str(e.value)


def test_hybrid_kv_cache_refuses_in_one_line(hybrid):
    from headprobe.probe.core.errors import HeadprobeError

    with pytest.raises(HeadprobeError, match="linear-attention layers") as e:
        generate(hybrid[2].model, _tokens(batch=1, pos=4), n_new=2)
    assert "\n" not in str(e.value)


def test_hybrid_costs_count_attention_layers_only(hybrid):
    """Attention parameters and the KV cache are those of Hugging Face's attention layers (counted there)."""
    from headprobe.probe.layout import cost

    name, ckpt, model = hybrid
    lay, layers = model.spec.layout, ckpt.hf_model.model.layers
    attn = [layer.self_attn for layer in layers if hasattr(layer, "self_attn")]
    assert len(attn) == len(model.spec.attention_layers) < len(layers)
    assert cost.attention_params(lay) == sum(p.numel() for a in attn for p in a.parameters())
    per_layer = 2 * lay.n_kv_heads * lay.d_head * lay.bytes_per_element
    assert cost.kv_bytes_per_token(lay) == per_layer * len(attn)
    assert cost.kv_bytes_per_request(lay, seq_len=10) == 10 * per_layer * len(attn)
    assert [p > 0 for p in cost.kv_positions(lay, 10)] == [l in model.spec.attention_layers for l in range(len(layers))]
    assert type(lay)(**lay.to_dict()) == lay  # to_dict keeps head_layers


def test_hybrid_lacks_head_wide_capabilities_and_refuses_in_one_line(hybrid):
    """The flags of ``HYBRID_LACKS`` are off on a hybrid (on only the model, not its backend class) and
    the features gated on them refuse in one line, before any work."""
    from headprobe.analyses.circuit import _check_model
    from headprobe.analyses.kvpolicy import check_kv_backend
    from headprobe.probe.backends.base import HYBRID_LACKS
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.hooks.online_stats import online_head_stats

    name, ckpt, model = hybrid
    for capability in HYBRID_LACKS:
        assert getattr(type(model), capability) and not getattr(model, capability), (name, capability)
    calls = [
        lambda: check_kv_backend(model),
        lambda: _check_model(model),
        model.check_prunable,
        lambda: online_head_stats(model, _tokens(), lambda l, st: None),
    ]
    for call, capability in zip(calls, ("kv_policies", "path_patching", "removes_heads", "streams_statistics")):
        with pytest.raises(HeadprobeError, match=f"linear-attention layers \\[0, 2\\], lacks {capability}") as e:
            call()
        assert "\n" not in str(e.value)


def test_full_attention_model_keeps_its_capabilities(family):
    """The hybrid's refusals come from its layout, not from the family: a model with heads in every layer keeps them."""
    from headprobe.probe.backends.base import HYBRID_LACKS

    name, ckpt, model = family
    assert model.spec.layout.head_layers is None
    assert all(getattr(model, c) == getattr(type(model), c) for c in HYBRID_LACKS), name


def test_hybrid_survives_a_native_checkpoint_and_left_padding(hybrid, tmp_path, tiny_tokenizer):
    """save_native/load_native keep the linear layers (their config and weights); left padding changes nothing."""
    name, ckpt, model = hybrid
    save_native(model.model, tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    again = load_native(tmp_path)
    assert again.model.cfg == model.model.cfg and again.spec.attention_layers == model.spec.attention_layers
    x = _tokens(batch=1, pos=14)
    padded = torch.cat([torch.full((1, 5), 100), x], dim=1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 14, dtype=torch.long)], dim=1)
    with torch.no_grad():
        want = model.model(x)
        assert torch.equal(again.model(x), want), name
        assert (model.model(padded, attention_mask=mask)[:, 5:] - want).abs().max() < 1e-4, name


@pytest.mark.parametrize("kind", ["zero", "resample"])
def test_hybrid_exact_sweep_equals_hook_loop_on_its_heads(hybrid, kind):
    name, ckpt, model = hybrid
    x, source = _tokens(seed=1), _tokens(seed=2)
    fast = exact_sweep(model, x, kind=kind, source_tokens=source, first=3, max_batch=4)
    slow = sweep_loop(model, x, kind=kind, source_tokens=source, first=3)
    has_heads = torch.tensor([l in model.spec.attention_layers for l in range(model.spec.n_layers)])
    assert fast.loss[has_heads].isfinite().all() and fast.loss[~has_heads].isnan().all()  # no head, no score
    assert (fast.loss[has_heads] - slow.loss[has_heads]).abs().max() < SWEEP_ATOL, name
    assert slow.effect[has_heads].abs().max() > 2 * SWEEP_ATOL


def test_hybrid_ablate_runs_and_prune_refuses_in_one_line(hybrid, tmp_path, tiny_tokenizer, capsys):
    """``headprobe ablate`` sweeps the attention layers' heads (the linear layers' rows empty); ``prune`` and a
    head in a linear layer are refused in one line, exit code 2, nothing written."""
    import pandas as pd

    from headprobe.cli import main

    name, ckpt, model = hybrid
    d, text = _hybrid_dir_and_text(ckpt, tiny_tokenizer, tmp_path)
    common = [
        "--model",
        str(d),
        "--text",
        str(text),
        "--seq-len",
        "16",
        "--n-natural",
        "2",
        "--n-repeated",
        "2",
        "--device",
        "cpu",
    ]
    assert main(["ablate", "--out", str(tmp_path / "ab"), *common]) == 0
    table = pd.read_csv(tmp_path / "ab" / "head_ablation.csv")
    for layer, rows in table.groupby("layer"):
        for column in ("natural_loss_delta", "natural_importance", "induction_score"):
            assert rows[column].isna().all() == (layer not in model.spec.attention_layers), (name, layer, column)
    capsys.readouterr()
    for argv, why in (
        (["ablate", "--heads", "0.1", "--out", str(tmp_path / "ab0")], "layer 0 has no heads"),
        (["prune", "--period", "6", "--out", str(tmp_path / "pr")], "not implemented for hybrid models"),
    ):
        assert main([*argv, *common]) == 2, argv
        err = capsys.readouterr().err
        lines = [l for l in err.splitlines() if l.startswith("headprobe: error:")]
        assert len(lines) == 1 and why in lines[0] and "Traceback" not in err, err[-300:]
        assert not (tmp_path / argv[-1]).exists() or not any((tmp_path / argv[-1]).iterdir())


def test_gated_attention_W_Q_is_the_query_half(tiny_tokenizer):
    """Qwen3-Next's ``q_proj`` holds ``[q_h, g_h]`` per head; ``W_Q`` (and so composition and the
    scan's weight metrics) is the query half of Hugging Face's own weight, not the interleaved rows."""
    ckpt = zoo.make_checkpoint("qwen3_next", tiny_tokenizer)
    model = wrap(ckpt, backend="native")
    for layer in model.spec.attention_layers:
        hf = ckpt.hf_model.model.layers[layer].self_attn.q_proj.weight  # [H * 2 d, D]
        H, d = model.spec.n_heads, model.spec.d_head
        want = hf.view(H, 2 * d, -1)[:, :d].transpose(1, 2)  # [H, D, d]
        torch.testing.assert_close(model.W_Q(layer), want)
        assert not torch.equal(want, hf.T.unflatten(1, (-1, d)).transpose(0, 1)[:H])  # the naive split differs


def test_a_pruned_model_with_learned_sinks_reloads_at_full_shape(tiny_tokenizer, tmp_path):
    """``prune --save-pruned`` of a model with learned sinks (GPT-OSS): the directory read back at
    full shape (``--model pruned_model/``) gives the pruned model's logits; a kept head keeps its
    own sink (a shifted sink would change them)."""
    from headprobe.probe.model.pruned import keep_mask_from, load_pruned_dir_full, remove_heads, save_pruned_dir

    net = zoo.with_sinks(wrap(zoo.make_checkpoint("gpt_oss", tiny_tokenizer), backend="native"), scale=2.0).model
    pruned = remove_heads(net, keep_mask_from([(0, 1), (1, 0)], net.cfg.n_layers, net.cfg.n_heads))
    save_pruned_dir(pruned, tmp_path / "dir", tiny_tokenizer)
    full, removed = load_pruned_dir_full(tmp_path / "dir")
    assert removed == [[1], [0]]
    x = _tokens()
    with torch.no_grad():
        assert (full(x) - pruned(x)).abs().max() < 1e-5
        for layer, (head, kept) in enumerate(((1, 0), (0, 1))):
            assert full.blocks[layer].attn.sinks[head] == 0
            assert full.blocks[layer].attn.sinks[kept] == net.blocks[layer].attn.sinks[kept]
