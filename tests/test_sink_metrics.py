"""Pattern metrics of a model with learned attention sinks (GPT-OSS), against Hugging Face's own weights.

Hugging Face's GPT-OSS eager attention (``transformers.models.gpt_oss.modeling_gpt_oss.eager_attention_forward``)
takes the softmax over ``[scores, sink]`` and drops the sink's column, so the weights it returns with
``output_attentions=True`` are the real keys' and a row sums to ``1 - s``, ``s`` the sink's mass. By
hand from those weights (plain loops): the mass on keys ``W`` or more back, on the last ``W`` keys and
the entropy of the whole softmax (the sink one of its outcomes); headprobe's columns, streamed or from
the pattern, must equal them, and ``local + distant + sink = 1``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import zoo

from headprobe.analyses import kvpolicy, metrics
from headprobe.analyses.data import TokenSet
from headprobe.probe.backends.wrapping import wrap

T, W, SINK = 40, 16, 2.0


@pytest.fixture(scope="module")
def gpt_oss(tiny_tokenizer):
    """The tiny GPT-OSS (2 layers x 4 heads, layer 0 sliding over 8 keys) with every sink logit 2.0, on the
    native backend; a batch of 2 x 40 tokens; Hugging Face's attention weights of that batch."""
    ckpt = zoo.make_checkpoint("gpt_oss", tiny_tokenizer)
    with torch.no_grad():
        for layer in ckpt.hf_model.model.layers:
            layer.self_attn.sinks.fill_(SINK)
    tokens = torch.randint(0, 100, (2, T), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        attentions = [a.double() for a in ckpt.hf_model(tokens, output_attentions=True).attentions]
    model = wrap(ckpt, backend="native")
    assert all(float(model.sink_logits(l).min()) == SINK == float(model.sink_logits(l).max()) for l in range(2))
    return model, tokens, _by_hand(attentions)


def _by_hand(attentions):
    """Per layer and head: the mean over queries i >= W and the batch of the mass on keys j <= i - W
    (distant), on keys i - W < j <= i (local) and of 1 - the row sum (sink); the entropy -sum p ln p - s ln s
    over queries i >= 1."""
    out = {k: np.zeros((2, 4)) for k in ("distant", "local", "sink", "entropy")}
    for layer, a in enumerate(attentions):
        a = a.tolist()
        for h in range(4):
            rows: dict[str, list[float]] = {k: [] for k in out}
            for b in range(len(a)):
                for i in range(1, T):
                    p = a[b][h][i][: i + 1]
                    s = 1.0 - sum(p)
                    rows["entropy"].append(
                        -sum(x * math.log(x) for x in p if x > 0) - (s * math.log(s) if s > 0 else 0.0)
                    )
                    if i >= W:
                        rows["distant"].append(sum(p[: i - W + 1]))
                        rows["local"].append(sum(p[i - W + 1 :]))
                        rows["sink"].append(s)
            for k in out:
                out[k][layer, h] = np.mean(rows[k])
    return out


@pytest.mark.parametrize("streaming", ["off", "on"])
def test_distant_mass_of_gpt_oss_is_the_mass_on_far_keys(gpt_oss, streaming):
    """distant_mass, local_16 and entropy equal the hand values from Hugging Face's weights to 1e-4; the
    sink's mass is in learned_sink_mass and in neither local nor distant."""
    model, tokens, hand = gpt_oss
    scores, skipped = metrics.scan_metrics(model, TokenSet(tokens, 1, "random"), None, 1, streaming=streaming)
    assert "distant_mass" not in skipped and metrics.distant_window(T) == W
    np.testing.assert_allclose(scores["distant_mass"], hand["distant"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(scores[f"local_{W}"], hand["local"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(scores["entropy"], hand["entropy"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(hand["local"] + hand["distant"] + hand["sink"], 1.0, atol=1e-6)
    # what the test is about: the sinks take a large share, and layer 1 (full attention) reads far keys
    assert hand["sink"].min() > 0.2 and hand["distant"][1].min() > 0.1
    assert np.abs((1 - hand["local"]) - hand["distant"]).min() > 0.2  # "1 - local" would count the sink as far


def test_kv_policy_cost_of_gpt_oss_reads_the_far_keys_only(gpt_oss):
    """The KV policy's estimated cost of streaming with no sink tokens and a window of W (keys 0 <= j <= i - W
    dropped, queries i >= W) is the same hand value: the learned sink is never a dropped key."""
    model, tokens, hand = gpt_oss
    got = kvpolicy.distant_mass(model, tokens, 0, W).numpy()
    np.testing.assert_allclose(got, hand["distant"], atol=1e-4, rtol=0)


def test_entropy_of_a_sink_row_counts_the_sink_as_an_outcome():
    """A row of 0.25 + 0.25 on two keys with the sink taking 0.5: -sum p ln p - s ln s = 1.0397 nats (the
    three outcomes), 0.6931 without the sink's term; a row that sums to 1 has no sink term."""
    p = torch.zeros(1, 1, 2, 2)
    p[0, 0, 0, 0] = 1.0
    p[0, 0, 1] = torch.tensor([0.25, 0.25])
    want = -2 * 0.25 * math.log(0.25) - 0.5 * math.log(0.5)
    assert float(metrics.attention_entropy(p, learned_sink=True)[0]) == pytest.approx(want, abs=1e-6)
    assert float(metrics.attention_entropy(p)[0]) == pytest.approx(-2 * 0.25 * math.log(0.25), abs=1e-6)
    q = torch.zeros(1, 1, 2, 2)
    q[0, 0, 0, 0] = 1.0
    q[0, 0, 1] = torch.tensor([0.5, 0.5])
    assert float(metrics.attention_entropy(q, learned_sink=True)[0]) == pytest.approx(math.log(2), abs=1e-6)


def test_distant_mass_label_counts_token_0():
    """A first-token sink head (every query on key 0) has a distant mass of 1: token 0 is ``W`` or
    more back. The heatmap's colour-bar label must say token 0 is counted, not that the sink is
    left out (only a learned sink is, and it has no key)."""
    T, W = 20, 16
    sink_head = torch.zeros(1, 1, T, T)
    sink_head[..., 0] = 1.0
    assert metrics.distant_fraction(sink_head, W).item() == 1.0
    (style,) = [s for s in metrics.LOCAL_FRACTION.figures if s.column == "distant_mass"]
    label = style.label.format(W=W)
    assert "not the sink" not in label and "token 0 included" in label, label
