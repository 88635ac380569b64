"""A model family added in one place, this file, and found everywhere it must appear.

A family is one :class:`~headprobe.probe.model.families.base.Family` (config mapping, weight conversion,
tiny zoo checkpoint, the facts the tests check) registered under its Hugging Face ``model_type``
in :data:`~headprobe.probe.model.families.FAMILIES`. Here ``headprobe_toy_llama`` (Llama's conversion
under a new ``model_type``, with 4 query heads on one KV head: MQA) is defined and registered for
this module alone. Then the zoo lists and builds it, ``--backend auto`` loads it natively, every
per-family test of ``tests/test_native_families.py`` runs on it (logits and patterns against
Hugging Face's model, the self-check, the exact sweep against the hook loop, the KV cache,
padding, head removal, ``prune --save-pruned``, the layout against the formulas), the self-check's
decomposition test of ``tests/test_selfcheck.py`` runs on it, a saved directory loads through
:func:`headprobe.load_model`, and the weights cache's description of it rebuilds the same model.

The Hugging Face side (a config and model class for the new ``model_type``) is what transformers
provides for a real family; here it is two subclasses of Llama's, registered with the Auto classes.
"""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
import test_native_families as per_family
import test_selfcheck
import torch
import zoo
from test_native_families import family_dir  # noqa: F401 - the fixture, over this module's family

from headprobe.probe.model.families import FAMILIES
from headprobe.probe.model.families.base import TINY_FIELDS, TinySpec

MODEL_TYPE = "headprobe_toy_llama"

# Every test of test_native_families that takes a family, collected again here on this module's
# `family` fixture (pytest collects the test functions a module holds, wherever they were defined).
for _name, _test in vars(per_family).items():
    if _name.startswith("test_") and {"family", "family_dir"} & set(inspect.signature(_test).parameters):
        globals()[_name] = _test


def _toy_family():
    """The new family: Llama's config mapping and weight conversion, its own tiny model and facts."""
    from headprobe.probe.model.families import llama

    return dataclasses.replace(
        llama.FAMILY,
        tiny=TinySpec(
            fields=dict(TINY_FIELDS, num_key_value_heads=1),
            layout=("MQA", "none", "none", None),
            bridge=False,  # TransformerLens has no adapter for ToyLlamaForCausalLM
        ),
    )


def _register_with_transformers() -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    class ToyLlamaConfig(LlamaConfig):
        model_type = MODEL_TYPE

    class ToyLlamaForCausalLM(LlamaForCausalLM):
        config_class = ToyLlamaConfig

    AutoConfig.register(MODEL_TYPE, ToyLlamaConfig, exist_ok=True)
    AutoModelForCausalLM.register(ToyLlamaConfig, ToyLlamaForCausalLM, exist_ok=True)


@pytest.fixture(scope="module")
def family(tiny_tokenizer):
    """(family name, Hugging Face checkpoint, the model wrap(backend="auto") gives), as in
    test_native_families, with the new family registered while this module runs."""
    from headprobe.probe.backends.wrapping import wrap

    _register_with_transformers()
    FAMILIES.register(MODEL_TYPE, _toy_family())
    try:
        ckpt = zoo.make_checkpoint(MODEL_TYPE, tiny_tokenizer)
        yield MODEL_TYPE, ckpt, wrap(ckpt, backend="auto")
    finally:
        FAMILIES.unregister(MODEL_TYPE)


def test_the_zoo_and_the_converter_find_it(family):
    from headprobe.probe.model import convert

    name, ckpt, model = family
    assert name in zoo.names() and name in zoo.ZOO and name not in zoo.ENCODER_ZOO
    assert zoo.ZOO[name]["num_key_value_heads"] == 1 == ckpt.hf_model.config.num_key_value_heads
    assert type(ckpt.hf_model).__name__ == "ToyLlamaForCausalLM" and ckpt.hf_model.config.model_type == name
    assert convert.supports(ckpt.hf_model.config) and not convert.is_encoder(name)
    assert model.backend == "native" and model.spec.kind == "MQA" and model.spec.n_kv_heads == 1


@pytest.mark.parametrize("backend", ["auto", "transformer-lens"])
def test_the_decomposition_sums_to_what_its_block_adds(family, backend):
    """test_selfcheck's identity against the Hugging Face module; the bridge refuses it in one line."""
    name, ckpt, _ = family
    test_selfcheck.test_decomposition_sums_to_what_the_block_adds({name: ckpt}, name, backend)


def test_a_saved_directory_loads_natively(family, tiny_tokenizer, tmp_path):
    import headprobe

    name, ckpt, _ = family
    model = headprobe.load_model(str(zoo.save_dir(name, tiny_tokenizer, tmp_path / name)), device="cpu", quiet=True)
    assert model.backend == "native" and model.self_check.ok and model.spec.kind == "MQA"
    x = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = zoo.make_checkpoint(name, tiny_tokenizer).hf_model(x).logits  # the same seed: the same weights
        assert (model.model(x) - want).abs().max() < per_family.LOGIT_ATOL


def test_the_weights_cache_description_rebuilds_it(family):
    """What a warm load reads (NativeSource as JSON, then the Hugging Face state dict) gives the same model."""
    from headprobe.probe.model.convert import NativeSource

    name, ckpt, model = family
    source = NativeSource.from_json(json.loads(json.dumps(NativeSource.of(ckpt.hf_model.config).to_json())))
    assert source.model_type == name and source.config == model.model.cfg
    again = source.build(dict(ckpt.hf_model.state_dict()), copy=True)
    x = torch.randint(0, 100, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(again(x), model.model(x))
