"""The backend's one logits function (``LoadedModel.logits_from_residual``) against Hugging Face's own logits.

Every analysis that turns a residual into logits (patching's logit difference, the direct logit
attribution, the exact sweep's losses) goes through it; here it is checked on both
backends against the untouched Hugging Face model, for families whose logits are more than
``final_norm(x) @ W_U + b_U``: Gemma-2's final soft-cap (``30 tanh(x / 30)``, with the LM head
scaled so that the logits reach the cap's range, as a trained Gemma-2's do) and Granite's
``logits_scaling`` (native since Granite is a registered family), next to plain Llama and GPT-2.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import zoo

from headprobe.probe.backends.base import scored_loss
from headprobe.probe.backends.wrapping import wrap
from headprobe.probe.layout.spec import Checkpoint

BACKENDS = ["native", "transformer-lens"]


def _checkpoint(family: str, tokenizer) -> Checkpoint:
    if family == "gemma2":
        ckpt = zoo.make_checkpoint("gemma2", tokenizer, tie_word_embeddings=False)
        with torch.no_grad():
            ckpt.hf_model.lm_head.weight.mul_(100)  # logits of tens: the cap (30) is far from the identity
        return ckpt
    if family == "granite":
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = AutoConfig.for_model(
            "granite", **zoo.TINY_FIELDS, logits_scaling=8.0, architectures=["GraniteForCausalLM"]
        )
        torch.manual_seed(0)
        hf = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
        return Checkpoint("tiny-granite", "tiny-granite", "float32 (random init)", hf, tokenizer)
    return zoo.make_checkpoint(family, tokenizer)


CASES = [
    ("gpt2", "native"),
    ("gpt2", "transformer-lens"),
    ("llama", "native"),
    ("llama", "transformer-lens"),
    ("gemma2", "native"),
    ("gemma2", "transformer-lens"),
    ("granite", "auto"),
]


@pytest.fixture(scope="module")
def models(tiny_tokenizer):
    """(family, backend) -> (the wrapped model, the untouched Hugging Face model)."""
    out = {}
    for family in dict(CASES):
        ckpt = _checkpoint(family, tiny_tokenizer)
        for f, backend in CASES:
            if f == family:
                out[f, backend] = (
                    wrap(dataclasses.replace(ckpt, hf_model=copy.deepcopy(ckpt.hf_model)), backend=backend),
                    ckpt.hf_model,
                )
    return out


def _tokens() -> torch.Tensor:
    return torch.randint(0, zoo.VOCAB - 1, (2, 12), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("family, backend", CASES)
def test_logits_from_residual_give_hugging_faces_logits(models, family, backend):
    """From the final residual (after the norm, ``normed=True``) and from the last block's
    ``resid_post`` (before it): all logits, and the selected tokens' with ``vocab``."""
    model, hf = models[family, backend]
    x = _tokens()
    kept = {}
    last = f"blocks.{model.spec.n_layers - 1}.hook_resid_post"
    with torch.no_grad():
        want = hf(x).logits
        resid = model.final_residual(x, [(last, lambda t, hook: kept.__setitem__("x", t.detach().clone()))])
        torch.testing.assert_close(model.logits_from_residual(resid, normed=True), want, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(model.logits_from_residual(kept["x"]), want, atol=1e-4, rtol=1e-5)
        vocab = torch.stack([x, x.flip(-1), torch.zeros_like(x)], -1)  # [batch, pos, 3]
        torch.testing.assert_close(
            model.logits_from_residual(resid, vocab=vocab, normed=True), want.gather(-1, vocab), atol=1e-4, rtol=1e-5
        )


@pytest.mark.parametrize("family, backend", CASES)
def test_softcap_false_is_the_logit_before_the_cap(models, family, backend):
    """``softcap=False``: Gemma-2's logit before ``30 tanh(x / 30)`` (``30 atanh(logit / 30)`` of
    Hugging Face's); a family without a cap gets its logits unchanged (Granite's scale kept)."""
    model, hf = models[family, backend]
    x = _tokens()
    with torch.no_grad():
        want = hf(x).logits.double()
        cap = getattr(hf.config, "final_logit_softcapping", None)
        if cap is not None:
            want = cap * torch.atanh(want / cap)
            assert (want.abs() > 15).any()  # in the cap's range: the two differ
        got = model.logits_from_residual(model.final_residual(x), normed=True, softcap=False).double()
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("family, backend", [c for c in CASES if c[0] in ("gemma2", "granite")])
def test_scored_losses_are_those_of_hugging_faces_logits(models, family, backend):
    """The exact sweep's losses (``scored_losses``, and ``resume_scored_losses`` from layer 1
    with the clean activations) unembed through the same function: the cross-entropy of
    Hugging Face's logits."""
    model, hf = models[family, backend]
    x = _tokens()
    first = 2
    with torch.no_grad():
        want = scored_loss(hf(x).logits, x, first)
        torch.testing.assert_close(model.scored_losses(x, first), want, atol=1e-5, rtol=1e-5)
        kept = {}
        hooks = [
            ("blocks.1.hook_resid_pre", lambda t, hook: kept.__setitem__("pre", t.detach().clone())),
            (model.attn_out_hook(1), lambda t, hook: kept.__setitem__("attn", t.detach().clone())),
        ]
        model.forward(x, fwd_hooks=hooks)
        resumed = model.resume_scored_losses(1, x, kept["pre"], kept["attn"], first)
    torch.testing.assert_close(resumed, want, atol=1e-5, rtol=1e-5)
