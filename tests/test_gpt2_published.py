"""The published GPT-2 small heads, reproduced whenever the real weights are in the local
Hugging Face cache (HF_HOME). The build machine has no cache and no hub: the test is skipped
there with that reason, and runs unchanged on a machine that has them."""

import pytest

from headprobe.probe.backends.loading import ALIASES, _is_cached

GPT2 = ALIASES["gpt2"]

pytestmark = pytest.mark.skipif(not _is_cached(GPT2), reason=f"{GPT2} weights are not in the local Hugging Face cache")


def test_published_gpt2_small_heads():
    """Induction 5.1, 5.5, 6.9, 7.2, 7.10 (Wang et al. 2022's IOI circuit; the score is Olsson et al.
    2022's prefix matching) among the top heads on repeated random tokens; previous-token head 4.11
    at the top on natural text."""
    from headprobe.analyses.ablation import top_heads
    from headprobe.analyses.data import natural_text_tokens, repeated_random_tokens
    from headprobe.analyses.scoring import score_token_set
    from headprobe.probe.backends.loading import load_model

    model = load_model("gpt2")
    assert (model.spec.n_layers, model.spec.n_heads) == (12, 12)
    rep = repeated_random_tokens(model, n_seqs=8, period=50, seed=0)
    nat = natural_text_tokens(model, n_seqs=8, seq_len=128, seed=0)
    rep_scores, _, _ = score_token_set(model, rep, "repeated")
    nat_scores, _, _ = score_token_set(model, nat, "natural")
    induction_top = top_heads(rep_scores["induction"], 10)
    for head in [(5, 1), (5, 5), (6, 9), (7, 2), (7, 10)]:
        assert head in induction_top, (head, induction_top)
    assert (4, 11) in top_heads(nat_scores["previous_token"], 3)
