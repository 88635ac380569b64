"""An empty head list (``heads=[]``) and an ``attention_mask`` holding anything but 0 and 1 are
refused by the Python API with one ValueError naming the argument (also a HeadprobeError: the
CLI's one line): ``capture_heads(heads=[])`` returned tensors with an empty head axis, a sweep of
``heads=[]`` a grid of NaN, and a mask value of 2 ran as 1 (``.to(bool)``)."""

from __future__ import annotations

import pytest
import torch

from headprobe.probe.core.errors import HeadprobeError


def _tokens(model, n=2, pos=10):
    return torch.randint(0, model.spec.d_vocab, (n, pos), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("argument", ["heads", "layers", "rows"])
def test_capture_heads_refuses_an_empty_index_list(tiny_llama_gqa_native, argument):
    """Old code: ``heads=[]`` gave ``pattern [2, 0, 10, 10]``; now a ValueError naming it."""
    from headprobe.probe.hooks.capture import capture_heads

    with pytest.raises(ValueError, match=f"^{argument} is empty") as e:
        capture_heads(tiny_llama_gqa_native, _tokens(tiny_llama_gqa_native), **{argument: []})
    assert isinstance(e.value, HeadprobeError)


def test_sweeps_and_patching_refuse_an_empty_head_list(tiny_llama_gqa_native):
    from headprobe.analyses.ablation import exact_sweep, sweep_loop
    from headprobe.analyses.patching import patch_heads

    tokens = _tokens(tiny_llama_gqa_native)
    for sweep in (exact_sweep, sweep_loop):
        with pytest.raises(ValueError, match="^heads is empty"):
            sweep(tiny_llama_gqa_native, tokens, heads=[], first=1)
    with pytest.raises(ValueError, match="^heads is empty"):
        patch_heads(tiny_llama_gqa_native, [], heads=[])


def test_command_functions_refuse_an_empty_head_list_as_a_value_error():
    """read_heads said "no heads given" as a HeadprobeError only: ``except ValueError`` missed it."""
    import headprobe

    with pytest.raises(ValueError, match="no heads given in heads"):
        headprobe.ablate("smollm2-135m", heads=[])


@pytest.mark.parametrize("model_name", ["tiny_llama_gqa_native", "tiny_llama_gqa"])
@pytest.mark.parametrize("value", [2, -1])
def test_a_mask_value_other_than_0_or_1_is_refused(request, model_name, value):
    """Old code: a 2 counted as a real token (and the native backend took -1 as one too); the
    patterns were those of the all-ones mask. Now refused by capture_heads and by the forward of
    both backends, naming attention_mask and the value."""
    from headprobe.probe.hooks.capture import capture_heads

    model = request.getfixturevalue(model_name)
    tokens = _tokens(model)
    mask = torch.ones_like(tokens)
    mask[0, -1] = value
    with pytest.raises(
        ValueError, match=rf"^attention_mask must hold 1 \(real token\) or 0 \(padding\) only, got {value}$"
    ):
        capture_heads(model, tokens, attention_mask=mask)
    with pytest.raises(ValueError, match="^attention_mask must hold 1"):
        model.forward(tokens, attention_mask=mask)


def test_a_mask_of_0_and_1_still_runs(tiny_llama_gqa_native):
    """Padding still works: the padded sequence's real positions equal its unpadded run."""
    from headprobe.probe.hooks.capture import capture_heads

    tokens = _tokens(tiny_llama_gqa_native)
    mask = torch.ones_like(tokens)
    mask[1, -3:] = 0
    padded = capture_heads(tiny_llama_gqa_native, tokens, attention_mask=mask)["pattern"][0]
    alone = capture_heads(tiny_llama_gqa_native, tokens[1:, :-3])["pattern"][0]
    assert padded.shape[1] == tiny_llama_gqa_native.spec.n_heads
    torch.testing.assert_close(padded[1:, :, :-3, :-3], alone, atol=1e-5, rtol=0)
