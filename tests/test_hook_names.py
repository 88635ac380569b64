"""headprobe.probe.hooks.names against the hook points the native model declares (probe/model/transformer.py), for
every registered family's tiny config: each hook point is a name the module builds, and each name it
builds (but TransformerLens' ``hook_scale`` and the bridge's ``unembed.hook_in``) is a hook point of one."""

from __future__ import annotations

import pytest

from headprobe.probe.hooks import names as hn

LAYERS = range(2)


def _built() -> set[str]:
    """Every name the module builds for the zoo's two layers."""
    names = {
        hn.EMBED,
        hn.POS_EMBED,
        hn.EMBED_NORM,
        hn.UNEMBED_IN,
        *(hn.final_norm_hook(n) for n in hn.FINAL_NORM_HOOKS),
    }
    for l in LAYERS:
        names |= {hn.block_hook(l, n) for n in hn.BLOCK_HOOKS} | {hn.attn_hook(l, n) for n in hn.ATTN_HOOKS}
        names |= {hn.norm_hook(l, norm, n) for norm, hooks in hn.NORMS.items() for n in hooks}
        names |= {hn.mlp_hook(l, n) for n in hn.MLP_HOOKS}
    return names


@pytest.fixture(scope="module")
def native_nets():
    from transformers import AutoConfig

    from headprobe.probe.model.families import FAMILIES
    from headprobe.probe.model.transformer import Transformer

    nets = {}
    for name in FAMILIES.names():
        family = FAMILIES.get(name)
        nets[name] = Transformer(family.config(AutoConfig.for_model(name, **family.tiny.fields)))
        assert nets[name].cfg.n_layers == len(LAYERS)
    return nets


def test_every_native_hook_point_is_built(native_nets):
    built = _built()
    for name, net in native_nets.items():
        assert set(net.hook_dict) <= built, (name, sorted(set(net.hook_dict) - built))


def test_every_built_name_is_a_native_hook_point(native_nets):
    declared = set().union(*(net.hook_dict for net in native_nets.values()))
    elsewhere = {hn.UNEMBED_IN, hn.final_norm_hook("scale")} | {
        hn.norm_hook(l, n, "scale") for l in LAYERS for n in ("ln1", "ln2")
    }
    assert _built() - elsewhere <= declared, sorted(_built() - elsewhere - declared)


def test_block_paths_name_the_native_modules_and_parameters(native_nets):
    for net in native_nets.values():
        modules, params = dict(net.named_modules()), dict(net.named_parameters())
        assert all(hn.block_path(l) in modules for l in LAYERS)
        assert hn.block_path(1, "attn.o_proj.weight") in params


def test_a_misspelt_name_is_refused():
    assert hn.attn_hook(5, "pattern") == "blocks.5.attn.hook_pattern"
    assert hn.block_hook(0, "resid_pre") == "blocks.0.hook_resid_pre"
    for build, args in (
        (hn.attn_hook, (0, "patern")),
        (hn.block_hook, (0, "resid")),
        (hn.norm_hook, (0, "ln1", "in")),
        (hn.norm_hook, (0, "ln3", "normalized")),
        (hn.mlp_hook, (0, "gate")),
        (hn.final_norm_hook, ("out",)),
    ):
        with pytest.raises(ValueError, match="no hook point"):
            build(*args)
