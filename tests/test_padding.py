"""Padded batches in the Python API (``to_tokens`` of a list, ``capture_heads`` and set ablations with
an attention mask) against each text run alone, unpadded, on every zoo family and both padding
sides; the bridge's one-line refusal; and ``headprobe.wrap`` of a transformers model in memory,
which must leave that model as it was."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import zoo

import headprobe
from headprobe.analyses.ablation import masked_scored_losses, set_ablation_losses
from headprobe.probe.backends.wrapping import wrap
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.capture import capture_heads

TEXTS = ["t5 t17 t3", "t40 t2 t9 t9 t31 t8 t77", "t1 t60 t12 t4 t5"]
ATOL = 1e-5


@pytest.fixture(scope="module", params=zoo.names() + zoo.names(encoder=True))
def zoo_model(request, tiny_tokenizer, tmp_path_factory):
    """Every zoo family, natively (an encoder with its BERT-style tokenizer)."""
    family = request.param
    encoder = family in zoo.names(encoder=True)
    tok = zoo.encoder_tokenizer(tmp_path_factory.mktemp("enc_tok")) if encoder else tiny_tokenizer
    return family, wrap(zoo.make_checkpoint(family, tok), backend="native")


def _real(mask_row: torch.Tensor) -> slice:
    idx = mask_row.nonzero()[:, 0]
    return slice(int(idx[0]), int(idx[-1]) + 1)


def test_to_tokens_of_a_list_gives_rows_and_a_mask(tiny_llama_gqa_native):
    model = tiny_llama_gqa_native
    for side in ("right", "left"):
        tokens, mask = model.to_tokens(TEXTS, padding_side=side)
        assert tokens.shape == mask.shape == (3, 8)  # BOS + the longest text's 7 words
        for b, text in enumerate(TEXTS):
            alone = model.to_tokens(text)[0]
            sl = _real(mask[b])
            assert torch.equal(tokens[b, sl], alone) and int(mask[b].sum()) == len(alone)
            assert (sl.start == 0) if side == "right" else (sl.stop == 8)
    assert model.to_tokens("t1 t2").shape == (1, 3)  # one string: today's tensor


@pytest.mark.parametrize("bad, error", [([], HeadprobeError), ([1, 2], TypeError), (None, TypeError)])
def test_to_tokens_refuses_bad_input(tiny_llama_gqa_native, bad, error):
    with pytest.raises(error):
        tiny_llama_gqa_native.to_tokens(bad)
    with pytest.raises(HeadprobeError, match="padding_side"):
        tiny_llama_gqa_native.to_tokens(["t1"], padding_side="middle")


@pytest.mark.parametrize("side", ["right", "left"])
def test_padded_capture_equals_each_text_alone(zoo_model, side):
    """Patterns (real queries x real keys), z, per-head results, attention outputs and logits of a
    padded batch equal the unpadded run of each text at its real tokens (rotary and learned
    positions count real tokens only; padded keys get no weight)."""
    family, model = zoo_model
    tokens, mask = model.to_tokens(TEXTS, padding_side=side)
    with torch.no_grad():
        cap = capture_heads(model, tokens, attention_mask=mask)
        logits = model.forward(tokens, attention_mask=mask)
    assert int((mask == 0).sum()) > 0  # something is padded
    for b, text in enumerate(TEXTS):
        alone_tokens = model.to_tokens(text)
        with torch.no_grad():
            alone = capture_heads(model, alone_tokens)
            alone_logits = model.forward(alone_tokens)
        sl = _real(mask[b])
        torch.testing.assert_close(logits[b, sl], alone_logits[0], atol=ATOL, rtol=0, msg=f"{family} logits")
        for layer in alone["z"]:
            torch.testing.assert_close(
                cap["pattern"][layer][b][:, sl, sl], alone["pattern"][layer][0], atol=ATOL, rtol=0
            )
            for key in ("z", "result", "attn_out"):
                torch.testing.assert_close(
                    cap[key][layer][b, sl], alone[key][layer][0], atol=ATOL, rtol=0, msg=f"{family} {key} layer {layer}"
                )


def test_padding_is_not_vacuous(tiny_llama_gqa_native):
    """Without the mask the padded rows differ from the texts alone: the check above can fail."""
    model = tiny_llama_gqa_native
    tokens, mask = model.to_tokens(TEXTS, padding_side="left")
    with torch.no_grad():
        logits = model.forward(tokens)  # mask left out: padding is read as tokens
        alone = model.forward(model.to_tokens(TEXTS[0]))
    assert (logits[0, _real(mask[0])] - alone[0]).abs().max() > 1e-3


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("kind", ["zero", "resample"])
def test_padded_set_ablations_equal_each_text_alone(tiny_llama_gqa_native, side, kind):
    """Set ablation losses of a padded batch equal each sequence's own (nats/token; scored from
    the first-th real token on), for a kind without and one with a source input."""
    model = tiny_llama_gqa_native
    sources = ["t9 t9 t1", "t3 t3 t3 t3 t3 t3 t3", "t7 t70 t2 t22 t2"]  # each as long as its text
    tokens, mask = model.to_tokens(TEXTS, padding_side=side)
    source, source_mask = model.to_tokens(sources, padding_side=side)
    assert torch.equal(mask, source_mask)
    sets, first = [[(0, 1)], [(1, 0), (1, 5)], [(0, 3), (1, 7)]], 1
    src = source if kind == "resample" else None
    got = set_ablation_losses(
        model, tokens, sets, kind, None, first, max_batch=4, source_tokens=src, attention_mask=mask
    )
    for b, (text, stext) in enumerate(zip(TEXTS, sources)):
        alone = model.to_tokens(text)
        want = set_ablation_losses(
            model, alone, sets, kind, None, first, source_tokens=model.to_tokens(stext) if kind == "resample" else None
        )
        torch.testing.assert_close(got[:, b], want[:, 0], atol=ATOL, rtol=0)
    with torch.no_grad():
        clean = masked_scored_losses(model, tokens, first, (), mask)
    assert (got - clean[None]).abs().max() > 1e-4  # the ablations do something


# ---------------------------------------------------------------------------------------------
# headprobe.wrap
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["auto", "transformer-lens"])
def test_wrap_leaves_the_callers_model_untouched(tiny_llama_gqa_checkpoint, backend):
    hf = copy.deepcopy(tiny_llama_gqa_checkpoint.hf_model)
    tok = tiny_llama_gqa_checkpoint.tokenizer
    x = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    before = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    with torch.no_grad():
        logits_before = hf(x).logits
    training, modules = hf.training, [type(m) for m in hf.modules()]
    model = headprobe.wrap(hf, tok, backend=backend)
    assert model.backend == ("native" if backend == "auto" else "transformer-lens")
    with torch.no_grad():
        torch.testing.assert_close(model.forward(x), logits_before, atol=1e-4, rtol=0)  # the same model
        for p in model.model.parameters():  # its copy, not the caller's tensors
            p.mul_(0)
        model.forward(x)
        after = hf(x).logits
    assert hf.training == training and [type(m) for m in hf.modules()] == modules
    assert before.keys() == hf.state_dict().keys()
    for k, v in hf.state_dict().items():
        assert torch.equal(v, before[k]), k
    torch.testing.assert_close(after, logits_before, atol=0, rtol=0)


def test_wrap_in_half_precision_checks_in_float32(tiny_llama_gqa_checkpoint):
    hf = copy.deepcopy(tiny_llama_gqa_checkpoint.hf_model).to(torch.bfloat16)
    model = headprobe.wrap(hf, tiny_llama_gqa_checkpoint.tokenizer)
    assert model.dtype == torch.bfloat16 and model.self_check.ok
    assert next(hf.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "args, message", [((torch.nn.Linear(2, 2), None), "transformers model"), (("gpt2", None), "transformers model")]
)
def test_wrap_refuses_what_is_not_a_model(args, message):
    with pytest.raises(HeadprobeError, match=message):
        headprobe.wrap(*args)


def test_wrap_needs_a_tokenizer(tiny_llama_gqa_checkpoint):
    with pytest.raises(HeadprobeError, match="tokenizer"):
        headprobe.wrap(dataclasses.replace(tiny_llama_gqa_checkpoint).hf_model, None)


@pytest.mark.real_model
def test_smollm2_to_tokens_gives_two_rows_and_a_mask(smollm2_native):
    tokens, mask = smollm2_native.to_tokens(["The cat sat", "A much longer sentence about the cat"])
    assert tokens.shape[0] == 2 and mask.shape == tokens.shape and int(mask[0].sum()) < int(mask[1].sum())


def test_bridge_takes_right_padding_exactly_and_refuses_left(tiny_llama_gqa, tiny_gpt2):
    """A causal model's real tokens never read later keys, so the bridge runs a right-padded batch
    exactly at the real tokens; left padding is refused in one line."""
    for model in (tiny_llama_gqa, tiny_gpt2):
        tokens, mask = model.to_tokens(TEXTS, padding_side="right")
        with torch.no_grad():
            cap = capture_heads(model, tokens, attention_mask=mask)
            logits = model.forward(tokens, attention_mask=mask)
            for b, text in enumerate(TEXTS):
                alone = capture_heads(model, model.to_tokens(text))
                sl = _real(mask[b])
                torch.testing.assert_close(logits[b, sl], model.forward(model.to_tokens(text))[0], atol=1e-4, rtol=0)
                for layer in alone["z"]:
                    torch.testing.assert_close(
                        cap["pattern"][layer][b][:, sl, sl], alone["pattern"][layer][0], atol=ATOL, rtol=0
                    )
                    torch.testing.assert_close(cap["z"][layer][b, sl], alone["z"][layer][0], atol=ATOL, rtol=0)
        left, left_mask = model.to_tokens(TEXTS, padding_side="left")
        with pytest.raises(HeadprobeError, match="need right padding") as e:
            capture_heads(model, left, attention_mask=left_mask)
        assert "\n" not in str(e.value)


def test_the_bridges_left_padding_refusal_says_what_works_here(tiny_tokenizer, tiny_llama_gqa):
    """A Llama with attention biases is on the bridge because the native backend refuses it, and the
    refusal of left padding sent the user to ``--backend native``, which refuses it too: the line
    now says right padding first and names the native backend only for a model it loads."""
    biased = wrap(zoo.make_checkpoint("llama", tiny_tokenizer, attention_bias=True), backend="auto")
    assert biased.backend == "transformer-lens"
    for model, native in ((biased, False), (tiny_llama_gqa, True)):
        left, mask = model.to_tokens(TEXTS, padding_side="left")
        with pytest.raises(HeadprobeError) as e:
            capture_heads(model, left, attention_mask=mask)
        line = str(e.value)
        assert "pad on the right instead" in line and "\n" not in line, line
        assert ("--backend native" in line) == native, line
        if native:
            assert line.index("pad on the right") < line.index("--backend native")
