"""QK attribution (analyses/qk_attribution.py) against Hugging Face's own attention patterns.

Independent reference: for one query ``i`` and two keys ``j, j'`` the softmax gives
``log p_ij - log p_ij' = s_ij - s_ij'`` (scores after any soft-cap), so the Hugging Face eager
model's ``output_attentions`` pins down the differences of the scores that the per-component
contributions must sum to, on every causal family of the zoo (tests/zoo.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import zoo

from headprobe.analyses.qk_attribution import qk_attribution
from headprobe.probe.backends.wrapping import wrap
from headprobe.probe.core.errors import HeadprobeError

T = 12
PAIRS = [(7, 3), (7, 6)]  # both keys inside Mistral's/Gemma-2's sliding window of 8


def _tokens(model):
    ids = torch.randint(0, 100, (1, T), generator=torch.Generator().manual_seed(1))
    ids[0, 0] = model.bos_token_id
    return ids


REFUSED = {"llama4_text": "QK L2 norm", "qwen3_next": "gated attention", "qwen3_5_text": "gated attention"}
"""Families whose queries or keys the decomposition does not cover: the one-line refusal expected instead."""


@pytest.mark.parametrize("family", zoo.names())
def test_contributions_sum_to_the_score_of_hugging_face(tiny_tokenizer, family):
    ckpt = zoo.make_checkpoint(family, tiny_tokenizer)
    hf = ckpt.hf_model
    model = wrap(ckpt, backend="native")
    if family in REFUSED:
        with pytest.raises(HeadprobeError, match=REFUSED[family]):
            qk_attribution(model, _tokens(model), 0, 0, *PAIRS[0])
        return
    tokens = _tokens(model)
    with torch.no_grad():
        attentions = hf(tokens, output_attentions=True).attentions
    cap = getattr(hf.config, "attn_logit_softcapping", None)
    n_heads = model.spec.n_heads
    for layer in range(model.spec.n_layers):
        for head in (0, n_heads - 1):
            (i, j), (_, j2) = PAIRS
            a, b = (qk_attribution(model, tokens, layer, head, i, k) for k in (j, j2))
            assert a.identity_error < 1e-4 and b.identity_error < 1e-4
            s, s2 = a.contributions.sum(), b.contributions.sum()
            if cap:
                s, s2 = cap * math.tanh(s / cap), cap * math.tanh(s2 / cap)
            p = attentions[layer][0, head, i].double()
            want = float(p[j].log() - p[j2].log())
            assert abs((s - s2) - want) <= 1e-4 * max(1.0, abs(want)), (family, layer, head)
            # every component appears on both sides, and the biases are separate rows
            assert a.q_labels[-1] == "q bias" and a.k_labels[-1] == "k bias"
            assert a.contributions.shape == (len(a.q_labels), len(a.k_labels))


def test_a_key_rotated_at_the_wrong_position_is_caught(tiny_tokenizer, monkeypatch):
    """The identity can fail: rotating the key as if it sat at the query's position breaks it."""
    model = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")
    tokens = _tokens(model)
    original = type(model).qk_terms

    def wrong(self, layer, head, side, terms, ref, pos):
        return original(self, layer, head, side, terms, ref, 7 if side == "k" else pos)

    monkeypatch.setattr(type(model), "qk_terms", wrong)
    with pytest.raises(HeadprobeError, match="does not sum to its score"):
        qk_attribution(model, tokens, 1, 0, 7, 2)


def test_bad_input_is_one_line(tiny_tokenizer):
    model = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")
    tokens = _tokens(model)
    L, H = model.spec.n_layers, model.spec.n_heads
    for args, match in [
        ((5, 0, 3, 2), f"^layer 5 is out of range: there are {L} \\(0 .. {L - 1}, or -{L} .. -1 from the end\\)$"),
        ((1, 0, 3, 5), "key <= query"),
        ((1, 9, 3, 2), f"^head 9 is out of range: there are {H} \\(0 .. {H - 1}, or -{H} .. -1 from the end\\)$"),
        ((-L - 1, 0, 3, 2), f"^layer {-L - 1} is out of range"),
    ]:
        with pytest.raises(HeadprobeError, match=match) as e:
            qk_attribution(model, tokens, *args)
        assert "\n" not in str(e.value)
    # a negative layer and head count from the end, as capture_heads' and every per-layer method's (refused before)
    last, by_end = qk_attribution(model, tokens, L - 1, H - 1, 3, 2), qk_attribution(model, tokens, -1, -1, 3, 2)
    assert (by_end.layer, by_end.head) == (L - 1, H - 1) and (by_end.contributions == last.contributions).all()


def test_the_bridge_and_encoders_are_refused(tiny_gpt2, tiny_tokenizer, tmp_path):
    tokens = _tokens(tiny_gpt2)
    with pytest.raises(HeadprobeError, match="native backend"):
        qk_attribution(tiny_gpt2, tokens, 1, 0, 5, 2)


def test_soft_capped_scores_far_past_the_cap_are_split_exactly(tiny_tokenizer):
    """Gemma-2 with layer 1's queries scaled x600 and its attention cap lowered to 2 (the tiny model's
    scores stay under the real cap of 50): scores lie far beyond the cap, where undoing it
    (``cap * atanh(s / cap)``) in float32 loses them (or raises at ``s == cap``). Reference: the same
    model with layer 1's cap removed, whose ``hook_attn_scores`` is the raw score."""
    ckpt = zoo.make_checkpoint("gemma2", tiny_tokenizer, attn_logit_softcapping=2.0)
    with torch.no_grad():
        ckpt.hf_model.model.layers[1].self_attn.q_proj.weight.mul_(600)
    model = wrap(ckpt, backend="native")
    tokens = _tokens(model)
    attn = model.model.blocks[1].attn
    cap = attn.softcap
    pairs = [(i, j) for i in range(T) for j in range(max(0, i - 7), i + 1)][:32]
    got = {(h, i, j): qk_attribution(model, tokens, 1, h, i, j) for h in range(model.spec.n_heads) for i, j in pairs}
    attn.softcap = None
    seen = {}
    with model.hooks(
        [("blocks.1.attn.hook_attn_scores", lambda x, hook: seen.setdefault("s", x.detach()[0].double()))]
    ):
        model.forward(tokens)
    raw = torch.stack([seen["s"][h, i, j] for h, i, j in got]).numpy()
    assert len(got) == 128 and (abs(raw) > 6 * cap).sum() >= 10  # far beyond the cap: the case at issue
    for (key, r), want in zip(got.items(), raw):
        assert r.identity_error < 1e-4 and abs(r.contributions.sum() - want) <= 1e-4 * max(1.0, abs(want)), key
