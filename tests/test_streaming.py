"""Streamed head statistics (probe/hooks/online_stats.py: the online-softmax recurrence over query and key
blocks from q and k) against the same numbers read from the materialised pattern (the native
model's ``hook_pattern``, the eager path), on every zoo family and on SmolLM2."""

from __future__ import annotations

import pytest
import torch
import zoo

from headprobe.analyses import detectors as det
from headprobe.analyses import metrics
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.capture import patterns_by_layer
from headprobe.probe.hooks.online_stats import online_head_stats, windowed_means

T = 44
PERIOD = 20
BLOCK = 8  # many blocks on a short sequence: every block kind (inside, outside, across a window) occurs
WINDOWS = (3, 8, 16)


def _native(family, tokenizer):
    from headprobe.probe.backends.wrapping import wrap

    return wrap(zoo.make_checkpoint(family, tokenizer), backend="native")


@pytest.fixture(scope="module")
def encoder_tok(tmp_path_factory):
    d = tmp_path_factory.mktemp("enc_tok")
    zoo.encoder_tokenizer(d)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d)


def _tokens(vocab: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    r = torch.randint(0, vocab, (2, PERIOD), generator=g)
    head = torch.randint(0, vocab, (2, T - 2 * PERIOD), generator=g)
    return torch.cat([head, r, r], dim=1)  # two sequences whose end repeats a block: induction is non-trivial


def _materialised(model, tokens):
    kept = {}
    patterns_by_layer(model, tokens, lambda layer, p: kept.__setitem__(layer, p.float().clone()))
    return kept


def _streamed(model, tokens):
    kept = {}

    def on(layer, st):
        start = 1
        out = {name: d.score_stats(st, PERIOD, start) for name, d in det.DETECTORS.items()}
        out["sink_rate"] = st.key_column(0).float().mean(dim=(0, 2))
        out["entropy"] = st.entropy[..., 1:].float().mean(dim=(0, 2))
        out["local"] = windowed_means(st)
        out["argmax"] = st.argmax.clone()
        out["rows"] = st.rows([0, 5, T - 1])
        kept[layer] = out

    online_head_stats(model, tokens, on, windows=WINDOWS, block=BLOCK)
    return kept


def _compare(model, tokens, atol=1e-5):
    pats = _materialised(model, tokens)
    streamed = _streamed(model, tokens)
    assert set(pats) == set(streamed) == set(range(model.spec.n_layers))
    for layer, p in pats.items():
        got = streamed[layer]
        for name, d in det.DETECTORS.items():
            want = d.score(p, PERIOD, 1)
            for col, v in want.items():
                torch.testing.assert_close(got[name][col].float(), v.float(), atol=atol, rtol=0, msg=f"{layer} {col}")
        torch.testing.assert_close(got["sink_rate"], metrics.sink_rate(p), atol=atol, rtol=0)
        torch.testing.assert_close(got["entropy"], metrics.attention_entropy(p), atol=atol, rtol=0)
        for W in WINDOWS:
            torch.testing.assert_close(got["local"][W], metrics.local_fraction(p, W), atol=atol, rtol=0)
        assert torch.equal(got["argmax"], p.argmax(-1))
        torch.testing.assert_close(got["rows"], p[:, :, [0, 5, T - 1]], atol=atol, rtol=0)


REFUSED = {"llama4_text": "chunked attention, QK L2 norm or query temperature"}
"""Families whose layers streaming does not cover: the one-line refusal expected instead."""


@pytest.mark.parametrize("family", zoo.names())
def test_streamed_statistics_equal_the_pattern_on_every_zoo_family(family, tiny_tokenizer):
    model = _native(family, tiny_tokenizer)
    if family in REFUSED:
        with pytest.raises(HeadprobeError, match=REFUSED[family]):
            _compare(model, _tokens(100))
        return
    _compare(model, _tokens(100))


@pytest.mark.parametrize("family", zoo.names(encoder=True))
def test_streamed_statistics_equal_the_pattern_on_encoders(family, encoder_tok):
    model = _native(family, encoder_tok)
    _compare(model, _tokens(100))


def test_a_wrong_scale_is_caught(tiny_tokenizer):
    """The comparison can fail: a streamed geometry with a wrong softmax scale differs."""
    from headprobe.probe.hooks import online_stats as streaming

    model = _native("llama", tiny_tokenizer)
    orig = streaming.geometry_and_hooks

    def wrong(model, layer):
        g, q, k = orig(model, layer)
        g.scale *= 3.0
        return g, q, k

    streaming.geometry_and_hooks = wrong
    try:
        with pytest.raises(AssertionError):
            _compare(model, _tokens(100))
    finally:
        streaming.geometry_and_hooks = orig


def test_local_fraction_on_a_hand_built_pattern():
    """A pattern with known local mass: query i puts 1/2 on itself and 1/2 on key 0."""
    n = 10
    p = torch.zeros(1, 1, n, n)
    for i in range(n):
        p[0, 0, i, i] += 0.5
        p[0, 0, i, 0] += 0.5
    # queries i >= W: key 0 is outside the window of W keys (i - 0 >= W), so the local mass is 1/2
    assert metrics.local_fraction(p, 3).item() == pytest.approx(0.5)
    assert metrics.local_fraction(p, 1).item() == pytest.approx(0.5)


@pytest.mark.real_model
def test_streamed_statistics_equal_the_pattern_on_smollm2(smollm2_native):
    model = smollm2_native
    g = torch.Generator().manual_seed(1)
    r = torch.randint(0, model.spec.d_vocab, (1, PERIOD), generator=g)
    text = model.to_tokens("The cat sat on the mat, and the dog lay down by the door of the house.")[
        :, : T - 2 * PERIOD
    ]
    tokens = torch.cat([text, r, r], dim=1)
    _compare(model, tokens)


@pytest.mark.parametrize("family", ["gpt2", "llama", "mistral", "deepseek_v3"])
def test_scan_streamed_equals_materialised(family, tiny_tokenizer, text_file):
    """The whole scan (scores, metrics, clean losses, example windows) with --streaming on and off,
    on a length both run: MHA, GQA, a sliding window and MLA."""
    import numpy as np

    import headprobe

    model = _native(family, tiny_tokenizer)
    args = dict(text=str(text_file), n_natural=2, seq_len=64, n_repeated=2, period=25, verify=False, pattern_len=0)
    on = headprobe.scan(model, streaming="on", **args)
    off = headprobe.scan(model, streaming="off", **args)
    assert list(on.table.columns) == list(off.table.columns)
    assert "local_16" in on.table and np.isfinite(on.table["distant_mass"]).all()
    for col in on.table.columns:
        if col == "value_share_token0":  # needs the materialised pattern: NaN when streamed
            assert np.isnan(on.table[col]).all() and np.isfinite(off.table[col]).all()
            continue
        np.testing.assert_allclose(
            on.table[col].to_numpy(float), off.table[col].to_numpy(float), atol=1e-5, rtol=0, err_msg=col
        )
    for task in ("natural", "repeated"):
        assert on.clean_loss[task] == pytest.approx(off.clean_loss[task], abs=1e-6)
    for t, ex in on.examples.items():
        np.testing.assert_allclose(ex["pattern"], off.examples[t]["pattern"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt2"])
def test_chunked_losses_equal_the_whole_logits(family, tiny_tokenizer, monkeypatch):
    """Losses unembedded a few positions at a time equal those of the forward's whole logits (1e-6):
    chunked_token_losses, and the native scored losses with a tiny chunk (gemma2: soft-capped logits)."""
    from headprobe.probe.backends import base as backend
    from headprobe.probe.backends import native

    model = _native(family, tiny_tokenizer)
    tokens = _tokens(100)
    logits = model.forward(tokens)
    want = backend.token_losses(logits, tokens)
    resid = model.final_residual(tokens)
    for first, rows in [(0, 7), (3, 1), (5, 1000)]:
        got = backend.chunked_token_losses(model, resid, tokens, first, rows=rows)
        torch.testing.assert_close(got, want[:, first:], atol=1e-6, rtol=0)
    monkeypatch.setattr(native, "LOSS_ROWS", 6)  # 3 positions of 2 sequences per chunk
    for first in (0, 4):
        torch.testing.assert_close(model.scored_losses(tokens, first), want[:, first:].mean(dim=1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_capture_heads_keeps_chosen_layers_heads_and_rows(family, tiny_tokenizer):
    """capture_heads(layers, heads, rows) equals the same slices of the full capture; on the
    native backend the rows come from q and k (no pattern hook fires)."""
    from headprobe.probe.hooks.capture import capture_heads

    model = _native(family, tiny_tokenizer)
    tokens = _tokens(100)
    full = capture_heads(model, tokens)
    part = capture_heads(model, tokens, layers=[1], heads=[2, 0], rows=[0, 7, T - 1])
    assert set(part["pattern"]) == {1}
    torch.testing.assert_close(
        part["pattern"][1], full["pattern"][1][:, [2, 0]][:, :, [0, 7, T - 1]], atol=1e-6, rtol=0
    )
    torch.testing.assert_close(part["result"][1], full["result"][1][:, :, [2, 0]])
    torch.testing.assert_close(part["attn_out"][1], full["attn_out"][1])


@pytest.mark.real_model
def test_scan_streamed_equals_materialised_on_smollm2(smollm2_native):
    """SmolLM2's head scores (every head type) and clean losses, streamed and from the pattern."""
    import numpy as np

    import headprobe

    args = dict(n_natural=1, seq_len=48, n_repeated=1, period=20, verify=False, pattern_len=0, metrics=False)
    on = headprobe.scan(smollm2_native, streaming="on", **args)
    off = headprobe.scan(smollm2_native, streaming="off", **args)
    for col in on.table.columns:
        np.testing.assert_allclose(
            on.table[col].to_numpy(float), off.table[col].to_numpy(float), atol=1e-5, rtol=0, err_msg=col
        )
    for task in (
        "natural",
        "repeated",
    ):  # streamed runs the fused kernel, the pattern path the eager one: float32 apart
        assert on.clean_loss[task] == pytest.approx(off.clean_loss[task], rel=1e-6)


@pytest.mark.parametrize("change", [{}, dict(sliding_window=8)], ids=["full", "sliding window 8"])
def test_streamed_statistics_with_learned_sinks_equal_the_pattern(tiny_tokenizer, change):
    """Learned sinks enter the online softmax's normaliser only: every statistic still equals the real-key
    pattern's, and the streamed sink mass equals 1 - its row sums; sinks of +2 take a large share."""
    model = zoo.with_sinks(_native("llama", tiny_tokenizer), scale=2.0, **change)
    tokens = _tokens(100)
    _compare(model, tokens)
    pats, sinks = _materialised(model, tokens), {}
    online_head_stats(
        model, tokens, lambda layer, st: sinks.__setitem__(layer, st.sink.clone()), windows=WINDOWS, block=BLOCK
    )
    for layer, p in pats.items():
        torch.testing.assert_close(sinks[layer], 1 - p.sum(-1), atol=1e-5, rtol=0)
        assert float(sinks[layer].max()) > 0.3


def test_a_sink_left_out_of_the_normaliser_is_caught(tiny_tokenizer):
    """The comparison can fail: streaming a sink model as if it had no sinks differs from its pattern."""
    from headprobe.probe.hooks import online_stats as streaming

    model = zoo.with_sinks(_native("llama", tiny_tokenizer), scale=2.0)
    orig = streaming.geometry_and_hooks

    def no_sinks(model, layer):
        g, q, k = orig(model, layer)
        g.sinks = None
        return g, q, k

    streaming.geometry_and_hooks = no_sinks
    try:
        with pytest.raises(AssertionError):
            _compare(model, _tokens(100))
    finally:
        streaming.geometry_and_hooks = orig
