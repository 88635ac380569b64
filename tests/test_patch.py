"""Per-head activation patching (``headprobe patch``): the batched engine against a plain loop of
one forward per head with the engine's own resample hook and the full logits, on both backends;
identities (clean = corrupted patches to no change); the IOI prompts' structure; the CLI's files
and its one-line errors; and the IOI finding on SmolLM2."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch

import headprobe
import zoo
from headprobe.analyses.patching import (
    PromptPair, encode_pairs, ioi_prompts, logit_diff, patch_heads,
)
from headprobe.cli import main
from headprobe.probe.capture import capture_internal
from headprobe.probe.errors import HeadprobeError
from headprobe.probe.heads import all_heads
from headprobe.probe.hooks import head_ablation_hooks
from headprobe.probe.loading import wrap


def _unpadded(model, pairs):
    """Each pair alone, unpadded: ``(clean [1, pos], corrupted [1, pos], answers [1, 2], [index])``
    (the reference every padded batch is compared with)."""
    tok = model.tokenizer
    for i, p in enumerate(pairs):
        ans = torch.tensor([[tok(p.correct, add_special_tokens=False)["input_ids"][0],
                             tok(p.wrong, add_special_tokens=False)["input_ids"][0]]])
        yield model.to_tokens(p.clean), model.to_tokens(p.corrupted), ans, [i]


def _pairs(n: int = 5, seed: int = 0) -> list[PromptPair]:
    """Word-level prompt pairs for the tiny tokenizer (t0..t99): two lengths, so grouping is exercised."""
    g = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = 6 if i % 2 else 9
        clean = " ".join(f"t{j}" for j in g.integers(0, 100, length))
        corrupted = " ".join(f"t{j}" for j in g.integers(0, 100, length))
        a, b = g.choice(100, 2, replace=False)
        out.append(PromptPair(clean, corrupted, f" t{a}", f" t{b}"))
    return out


@pytest.mark.parametrize("fixture", ["tiny_llama_gqa_native", "tiny_gpt2", "tiny_gpt2_native"])
def test_batched_patching_equals_one_forward_per_head(fixture, request):
    model = request.getfixturevalue(fixture)
    pairs = _pairs()
    heads = all_heads(model.spec.n_layers, model.spec.n_heads)
    got = patch_heads(model, pairs, heads, max_batch=8)
    want = np.zeros((len(heads), len(pairs)))
    torch.set_grad_enabled(False)
    for clean, corrupted, answers, idx in _unpadded(model, pairs):
        source = capture_internal(model, corrupted)["z"]
        np.testing.assert_allclose(got.clean_ld[idx], logit_diff(model.forward(clean), answers).numpy(), atol=1e-4)
        np.testing.assert_allclose(got.corrupted_ld[idx], logit_diff(model.forward(corrupted), answers).numpy(), atol=1e-4)
        for i, head in enumerate(heads):
            logits = model.forward(clean, fwd_hooks=head_ablation_hooks([head], "resample", source_z=source))
            want[i, idx] = logit_diff(logits, answers).numpy()
    torch.set_grad_enabled(True)
    np.testing.assert_allclose(got.patched_ld, want, atol=1e-4)
    assert np.abs(got.effect).max() > 1e-3  # patching does something on random weights


def _hf_patched_logit_diff(hf_model, clean, corrupted, answers, layer: int, head: int, d_head: int) -> np.ndarray:
    """The reference for one patched head, on the untouched Hugging Face model: a forward pre-hook
    on layer ``layer``'s ``o_proj`` replaces head ``head``'s slice of its input (that head's z) by
    the corrupted run's; the logit difference of Hugging Face's own logits."""
    o_proj = hf_model.model.layers[layer].self_attn.o_proj
    sl = slice(head * d_head, (head + 1) * d_head)
    kept = {}
    h = o_proj.register_forward_pre_hook(lambda mod, args: kept.__setitem__("z", args[0].detach().clone()))
    try:
        hf_model(corrupted)
    finally:
        h.remove()

    def patch(mod, args):
        z = args[0].clone()
        z[..., sl] = kept["z"][..., sl]
        return (z,)

    h = o_proj.register_forward_pre_hook(patch)
    try:
        return logit_diff(hf_model(clean).logits, answers).numpy()
    finally:
        h.remove()


@pytest.mark.parametrize("backend", ["native", "transformer-lens"])
def test_gemma2_logit_differences_are_those_of_the_soft_capped_logits(backend, tiny_tokenizer):
    """Gemma-2 soft-caps its logits after the unembedding (``30 tanh(x / 30)``): patch's clean,
    corrupted and patched logit differences are those of Hugging Face's own logits, for every
    head, on both backends. The untied LM head is scaled up (x100) so that the logits reach the
    cap's range, as a trained Gemma-2's do (random weights give logits below 1, where the cap is
    the identity); the last line checks that the cap then matters."""
    ckpt = zoo.make_checkpoint("gemma2", tiny_tokenizer, tie_word_embeddings=False)
    hf = ckpt.hf_model
    with torch.no_grad():
        hf.lm_head.weight.mul_(100)
    model = wrap(dataclasses.replace(ckpt, hf_model=copy.deepcopy(hf)), backend=backend)
    pairs = _pairs()
    heads = all_heads(model.spec.n_layers, model.spec.n_heads)
    got = patch_heads(model, pairs, heads, max_batch=8)
    d_head = hf.config.head_dim
    cap_moved = 0.0
    with torch.no_grad():
        for clean, corrupted, answers, idx in _unpadded(model, pairs):
            want_clean = logit_diff(hf(clean).logits, answers).numpy()
            np.testing.assert_allclose(got.clean_ld[idx], want_clean, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(got.corrupted_ld[idx], logit_diff(hf(corrupted).logits, answers).numpy(),
                                       rtol=1e-5, atol=1e-5)
            for i, (layer, head) in enumerate(heads):
                want = _hf_patched_logit_diff(hf, clean, corrupted, answers, layer, head, d_head)
                np.testing.assert_allclose(got.patched_ld[i, idx], want, rtol=1e-5, atol=1e-5)
            c = hf.config.final_logit_softcapping
            pre_cap = c * torch.atanh(hf(clean).logits / c)  # the logits before the cap
            cap_moved = max(cap_moved, float(np.abs(logit_diff(pre_cap, answers).numpy() - want_clean).max()))
    assert cap_moved > 0.5, cap_moved  # the cap changes the metric: the check above is not vacuous


def test_patching_a_prompt_into_itself_changes_nothing(tiny_llama_gqa_native):
    pairs = [PromptPair(p.clean, p.clean, p.correct, p.wrong) for p in _pairs(4)]
    r = patch_heads(tiny_llama_gqa_native, pairs)
    np.testing.assert_allclose(r.effect, 0, atol=1e-5)
    np.testing.assert_allclose(r.corrupted_ld, r.clean_ld, atol=1e-5)


def test_table_normalises_by_the_corrupted_minus_clean_difference(tiny_gpt2_native):
    r = patch_heads(tiny_gpt2_native, _pairs(12))
    t = r.table()
    np.testing.assert_allclose(t["effect"], (r.patched_ld - r.clean_ld[None]).mean(1))
    np.testing.assert_allclose(t["normalized"], t["effect"] / (r.corrupted_ld.mean() - r.clean_ld.mean()))
    assert (t["effect_ci95_lo"] <= t["effect"] + 1e-12).all() and (t["effect"] <= t["effect_ci95_hi"] + 1e-12).all()
    per_pair = t[[f"effect_pair_{i + 1}" for i in range(12)]].to_numpy()
    np.testing.assert_allclose(per_pair, r.patched_ld - r.clean_ld[None])  # each pair's effect, in pair order
    np.testing.assert_allclose(per_pair.mean(1), t["effect"])


def test_fewer_than_ten_pairs_get_no_interval_and_say_so(tiny_gpt2_native):
    t = patch_heads(tiny_gpt2_native, _pairs(9)).table()
    assert not {"effect_ci95_lo", "effect_ci95_hi"} & set(t.columns)
    assert (t["effect_ci95"] == "none: 9 prompt pairs; intervals are given from 10 pairs up").all()
    assert {f"effect_pair_{i}" for i in range(1, 10)} <= set(t.columns)


class _WordTokenizer:
    """One id per word (hash), enough for the IOI builder's single-token check."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [hash(w) % 1000 for w in text.split()]}


def test_ioi_prompts_have_the_indirect_object_as_answer():
    pairs = ioi_prompts(_WordTokenizer(), n=12, seed=3)
    assert len(pairs) == 12 and len({p.template for p in pairs}) == 6
    for p in pairs:
        io, s = p.correct.strip(), p.wrong.strip()
        words = p.clean.replace(",", " ").replace(".", " ").split()
        assert words.count(s) == 2 and words.count(io) == 1  # S repeated, IO once
        names = {w for w in p.corrupted.replace(",", " ").replace(".", " ").split() if w in {io, s}}
        assert not names  # the corrupted prompt uses three other names
        assert len(p.clean.split()) == len(p.corrupted.split())
    first_two = [p.clean.split(" and ")[0].split()[-1] == p.correct.strip() for p in pairs]
    assert 0 < sum(first_two) < len(pairs)  # ABBA and BABA both occur


def test_ioi_needs_single_token_names(tiny_llama_gqa_native):
    with pytest.raises(HeadprobeError, match="one token"):
        ioi_prompts(tiny_llama_gqa_native.tokenizer)


def test_unequal_lengths_and_multi_token_answers_are_refused(tiny_llama_gqa_native):
    with pytest.raises(HeadprobeError, match="same length"):
        patch_heads(tiny_llama_gqa_native, [PromptPair("t1 t2 t3", "t1 t2", " t4", " t5")] * 2)
    with pytest.raises(HeadprobeError, match="2 tokens"):
        patch_heads(tiny_llama_gqa_native, [PromptPair("t1 t2", "t3 t4", " t4 t5", " t5")] * 2)


# ---------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("prompts") / "pairs.jsonl"
    p.write_text("\n".join(json.dumps(vars(x)) for x in _pairs(6)) + "\n", encoding="utf-8")
    return p


@pytest.mark.all_figure_formats  # checks the PDF/SVG files
def test_cli_writes_the_table_the_function_returns(tiny_dir, prompts_file, tmp_path):
    out = tmp_path / "p"
    assert main(["patch", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--out", str(out), "--device", "cpu"]) == 0
    table = pd.read_csv(out / "head_patching.csv")
    ref = headprobe.patch(str(tiny_dir), prompts=str(prompts_file), device="cpu").table
    assert len(table) == 2 * 8 and list(table.columns[:3]) == ["layer", "head", "kv_head"]
    np.testing.assert_allclose(table["effect"], ref["effect"], atol=1e-5)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_prompts"] == 6 and summary["task"] == "custom prompts"
    for stem in ("patching", "patching_top"):
        assert (out / f"{stem}.png").is_file() and (out / f"{stem}.svg").is_file()


@pytest.mark.parametrize("content, message", [
    ('{"clean": "t1"}\n{"clean": "t2"}', "line 1"),
    ("not json", "line 1"),
    (json.dumps({"clean": "t1 t2", "corrupted": "t3 t4", "correct": " t5", "wrong": " t6"}), "at least 2"),
])
def test_bad_prompt_files_are_one_line_and_exit_2(content, message, tmp_path, capsys):
    f = tmp_path / "bad.jsonl"
    f.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["patch", "--model", "smollm2-135m", "--prompts", str(f), "--out", str(tmp_path / "o")]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


@pytest.mark.real_model
def test_smollm2_solves_ioi_and_its_top_head_carries_it(smollm2_native):
    """SmolLM2-135M prefers the indirect object on every IOI prompt, and patching head 23.3 (the
    largest effect of the full 270-head run, docs/patch.md) moves the logit difference toward
    the corrupted run, while a layer-0 head does next to nothing."""
    r = patch_heads(smollm2_native, ioi_prompts(smollm2_native.tokenizer, n=6), heads=[(23, 3), (0, 4)])
    assert (r.clean_ld > 0).all()
    effect = r.effect.mean(1)
    assert effect[0] < -0.5 and abs(effect[1]) < 0.1 * abs(effect[0])


def test_a_multi_token_answer_names_its_pair(tiny_dir, tmp_path, capsys):
    good = {"clean": "t1 t2 t3", "corrupted": "t4 t2 t3", "correct": " t5", "wrong": " t6"}
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in (good, {**good, "correct": " t5 t7"})), encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["patch", "--model", str(tiny_dir), "--prompts", str(f), "--out", str(tmp_path / "o"),
                               "--device", "cpu"]))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("headprobe: error:")]
    assert e.value.code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert "prompt pair 2: answer ' t5 t7' is 2 tokens" in errors[0]
    assert not (tmp_path / "o").exists()
