"""The zoo builds each tiny model once per test run (tests/zoo.py): every call returns its own copy,
equal to a fresh build, and leaves torch's global RNG where a fresh build leaves it."""

from __future__ import annotations

import torch
import zoo


def test_each_model_is_built_once_and_every_call_gets_its_own_equal_copy(tiny_tokenizer, monkeypatch):
    from transformers import AutoModelForCausalLM

    built = []
    from_config = AutoModelForCausalLM.from_config
    monkeypatch.setattr(AutoModelForCausalLM, "from_config", lambda *a, **k: built.append(a) or from_config(*a, **k))
    seed = 24_681  # a seed no other test uses: the first call below builds
    first = zoo.make_checkpoint("llama", tiny_tokenizer, seed=seed)
    rng_after_build = torch.get_rng_state()
    torch.rand(3)  # the global RNG moves on
    second = zoo.make_checkpoint("llama", tiny_tokenizer, seed=seed)
    assert len(built) == 1  # built once ...
    assert torch.equal(torch.get_rng_state(), rng_after_build)  # ... and the RNG left as the build left it
    assert second.hf_model is not first.hf_model and second.tokenizer is tiny_tokenizer
    with torch.no_grad():
        first.hf_model.lm_head.weight.mul_(0)  # a test's change to its copy reaches no other copy
    fresh = zoo._build("llama", tiny_tokenizer, seed, {})  # the independent reference: a build of its own
    assert len(built) == 2
    for name, want in fresh.hf_model.state_dict().items():
        assert torch.equal(second.hf_model.state_dict()[name], want), name
    assert second.hf_model.config.to_dict() == fresh.hf_model.config.to_dict()
    x = torch.tensor([[100, 5, 7, 9]])
    with torch.no_grad():
        torch.testing.assert_close(second.hf_model(x).logits, fresh.hf_model(x).logits, rtol=0, atol=0)
    zoo.make_checkpoint("llama", tiny_tokenizer, seed=seed, hidden_size=32, intermediate_size=64)
    assert len(built) == 3  # other config changes: another model
