"""Detectors on hand-made attention patterns with known answers, and against loops over heads."""

import pytest
import torch

from headprobe.analyses.detectors import (
    DETECTORS,
    duplicate_token_score,
    first_token_score,
    induction_score,
    offset_score,
    positional_score,
    previous_token_score,
)
from headprobe.probe.core.errors import HeadprobeError


def causal_uniform(batch, heads, T):
    mask = torch.tril(torch.ones(T, T))
    return (mask / mask.sum(-1, keepdim=True)).expand(batch, heads, T, T).clone()


def one_hot_pattern(T, key_of_query, heads=1, batch=1):
    p = torch.zeros(batch, heads, T, T)
    for q in range(T):
        p[..., q, key_of_query(q)] = 1.0
    return p


@pytest.mark.parametrize("T", [2, 7, 50])
def test_pure_previous_token_pattern_scores_one_whatever_the_length(T):
    p = one_hot_pattern(T, lambda q: max(q - 1, 0))
    assert previous_token_score(p).item() == pytest.approx(1.0)


def test_uniform_pattern_scores_one_over_i_plus_one_per_query():
    T = 12
    p = causal_uniform(1, 1, T)
    for q in range(1, T):  # per query: attention to i-1 is 1/(i+1) (i+1 keys visible)
        assert p[0, 0, q, q - 1].item() == pytest.approx(1 / (q + 1))
    expected = sum(1 / (q + 1) for q in range(1, T)) / (T - 1)
    assert previous_token_score(p).item() == pytest.approx(expected)
    assert first_token_score(p).item() == pytest.approx(expected)


def test_induction_and_duplicate_on_a_hand_made_pattern():
    S, start = 5, 1
    T = start + 2 * S
    induction = one_hot_pattern(T, lambda q: q - S + 1 if q >= start + S else 0)
    duplicate = one_hot_pattern(T, lambda q: q - S if q >= start + S else 0)
    assert induction_score(induction, S, start).item() == pytest.approx(1.0)
    assert duplicate_token_score(induction, S, start).item() == pytest.approx(0.0)
    assert duplicate_token_score(duplicate, S, start).item() == pytest.approx(1.0)
    assert induction_score(duplicate, S, start).item() == pytest.approx(0.0)
    # half the repeat's queries induct, half attend to BOS: 0.5 (the first half is not counted)
    half = one_hot_pattern(T, lambda q: q - S + 1 if q >= start + S and q % 2 == 0 else 0)
    n_even = sum(1 for q in range(start + S, T) if q % 2 == 0)
    assert induction_score(half, S, start).item() == pytest.approx(n_even / S)


def test_first_token_sink():
    p = one_hot_pattern(9, lambda q: 0)
    assert first_token_score(p).item() == 1.0
    assert previous_token_score(p).item() == pytest.approx(1 / 8)  # only query 1's previous is position 0


@pytest.mark.parametrize("start", [0, 1])
def test_a_pure_sink_head_is_no_duplicate_token_head_with_or_without_bos(start):
    """Without BOS the repeat's first query has its earlier copy at position 0, where a sink head
    attends anyway: that query is not counted (a pure sink head scored 1/S there)."""
    S = 7
    T = start + 2 * S
    sink = one_hot_pattern(T, lambda q: 0)
    assert duplicate_token_score(sink, S, start).item() == 0.0
    duplicate = one_hot_pattern(T, lambda q: q - S if q >= start + S else 0)
    assert duplicate_token_score(duplicate, S, start).item() == pytest.approx(1.0)
    # the streamed path reads the same queries
    from headprobe.analyses.detectors import _stats_scores

    class Stats:  # the two members the streamed duplicate-token score reads
        n_pos = T

        def __init__(self, p):
            self.p = p

        def diagonal(self, off):
            return self.p.diagonal(offset=-off, dim1=-2, dim2=-1)

    for p in (sink, duplicate):
        torch.testing.assert_close(
            _stats_scores("duplicate_token", Stats(p), S, start)["duplicate_token"], duplicate_token_score(p, S, start)
        )


def test_positional_head_offset_and_fraction():
    T = 11
    p = one_hot_pattern(T, lambda q: max(q - 2, 0))  # offset -2 wherever possible
    offset, frac = positional_score(p)
    assert offset.item() == -2
    assert frac.item() == pytest.approx((T - 2) / (T - 1))  # query 1 cannot look back 2


def _loop_reference(pattern, S, start):
    """Independent per-head, per-query loops."""
    B, H, T, _ = pattern.shape
    out = {k: torch.zeros(H) for k in ("prev", "first", "ind", "dup", "pos_off", "pos_frac")}
    for h in range(H):
        prev = [pattern[b, h, q, q - 1] for b in range(B) for q in range(1, T)]
        first = [pattern[b, h, q, 0] for b in range(B) for q in range(1, T)]
        ind = [pattern[b, h, q, q - S + 1] for b in range(B) for q in range(start + S, T)]
        dup = [pattern[b, h, q, q - S] for b in range(B) for q in range(start + S, T) if q - S > 0]
        out["prev"][h], out["first"][h] = sum(prev) / len(prev), sum(first) / len(first)
        out["ind"][h], out["dup"][h] = sum(ind) / len(ind), sum(dup) / len(dup)
        offsets = [int(pattern[b, h, q].argmax()) - q for b in range(B) for q in range(1, T)]
        best = max(sorted(set(offsets), reverse=True), key=offsets.count)
        out["pos_off"][h], out["pos_frac"][h] = best, offsets.count(best) / len(offsets)
    return out


@pytest.mark.parametrize("start", [0, 1])
def test_vectorised_detectors_equal_loops_over_heads(start):
    g = torch.Generator().manual_seed(0)
    S, B, H = 6, 3, 5
    T = start + 2 * S
    scores = torch.randn(B, H, T, T, generator=g) * 3
    scores = scores.masked_fill(~torch.tril(torch.ones(T, T, dtype=torch.bool)), float("-inf"))
    pattern = scores.softmax(-1)
    ref = _loop_reference(pattern, S, start)
    torch.testing.assert_close(previous_token_score(pattern), ref["prev"])
    torch.testing.assert_close(first_token_score(pattern), ref["first"])
    torch.testing.assert_close(induction_score(pattern, S, start), ref["ind"])
    per_seq = induction_score(pattern, S, start, per_sequence=True)  # [batch, head]: each sequence alone
    for b in range(B):
        torch.testing.assert_close(per_seq[b], _loop_reference(pattern[b : b + 1], S, start)["ind"])
    torch.testing.assert_close(duplicate_token_score(pattern, S, start), ref["dup"])
    off, frac = positional_score(pattern)
    torch.testing.assert_close(frac, ref["pos_frac"])
    torch.testing.assert_close(off, ref["pos_off"])


def test_detectors_do_not_modify_their_input():
    p = causal_uniform(2, 3, 9)
    before = p.clone()
    for det in DETECTORS.values():
        det.score(p, 4, 1)
    assert torch.equal(p, before)


def test_length_one_is_a_clear_error():
    with pytest.raises(HeadprobeError, match="at least 2 positions"):
        previous_token_score(torch.ones(1, 1, 1, 1))
    with pytest.raises(HeadprobeError):
        offset_score(torch.ones(1, 1, 3, 3), offset=5, first_query=5)


def test_text_repeat_scores_equal_a_loop_and_the_block_scores_on_a_repeat():
    """``show``'s duplicate-token and induction scores on any text: a plain loop over queries and
    earlier occurrences; on ``[BOS] r r`` of distinct tokens, the scan's block-repeat scores."""
    from headprobe.analyses.detectors import duplicate_token_score, induction_score, text_repeat_scores

    g = torch.Generator().manual_seed(0)
    T = 12
    pattern = torch.rand(2, 3, T, T, generator=g).tril()
    pattern /= pattern.sum(-1, keepdim=True)
    ids = torch.tensor([0, 5, 6, 5, 7, 5, 6, 8, 9, 7, 7, 1])
    got = text_repeat_scores(pattern, ids, start=1)
    for name, after in (("duplicate_token", 0), ("induction", 1)):
        ref = torch.zeros(2, 3)
        for a in range(2):
            for h in range(3):
                per_query = []
                for q in range(1, T):
                    keys = [j + after for j in range(1, q) if ids[j] == ids[q] and j + after < q]
                    if keys:
                        per_query.append(sum(float(pattern[a, h, q, k]) for k in keys))
                ref[a, h] = sum(per_query) / len(per_query)
        torch.testing.assert_close(got[name], ref, rtol=1e-5, atol=1e-6)
    S = 5
    block = torch.tensor([0, *range(10, 10 + S), *range(10, 10 + S)])
    pat = torch.rand(1, 3, 2 * S + 1, 2 * S + 1, generator=g).tril()
    pat /= pat.sum(-1, keepdim=True)
    got = text_repeat_scores(pat[0], block, start=1)
    torch.testing.assert_close(got["duplicate_token"], duplicate_token_score(pat, S, 1))
    torch.testing.assert_close(got["induction"], induction_score(pat, S, 1))
    none = text_repeat_scores(pat[0], torch.arange(2 * S + 1), start=1)  # no token repeats
    assert torch.isnan(none["induction"]).all() and torch.isnan(none["duplicate_token"]).all()


def test_period_2_is_refused_as_its_induction_target_is_the_previous_token(tiny_llama_gqa_native):
    """On ``[BOS] r1 r2 r1 r2`` the token after a query's earlier occurrence is its previous token,
    so a pure previous-token head scores induction 1 there: period 2 cannot tell the two apart and
    is refused (period 3 can: the same head scores 0)."""
    from headprobe.analyses.data import repeated_random_tokens

    for period, expected in [(2, 1.0), (3, 0.0)]:
        T = 1 + 2 * period
        previous = torch.zeros(1, 1, T, T)
        previous[0, 0, 0, 0] = 1.0
        previous[0, 0, torch.arange(1, T), torch.arange(0, T - 1)] = 1.0
        assert induction_score(previous, period, 1).item() == pytest.approx(expected)
    with pytest.raises(HeadprobeError, match="repeat length 2 is too short: induction needs at least 3 tokens"):
        repeated_random_tokens(tiny_llama_gqa_native, 2, 2, seed=0)
    assert repeated_random_tokens(tiny_llama_gqa_native, 2, 3, seed=0).tokens.shape == (2, 7)
