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
import zoo

import headprobe
from headprobe.analyses.patching import (
    PromptPair,
    encode_pairs,
    ioi_prompts,
    logit_diff,
    patch,
    patch_heads,
)
from headprobe.cli import main
from headprobe.probe.backends.wrapping import wrap
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.core.heads import all_heads
from headprobe.probe.hooks.ablation import head_ablation_hooks
from headprobe.probe.hooks.capture import capture_internal


def _unpadded(model, pairs):
    """Each pair alone, unpadded: ``(clean [1, pos], corrupted [1, pos], answers [1, 2], [index])``
    (the reference every padded batch is compared with)."""
    tok = model.tokenizer
    for i, p in enumerate(pairs):
        ans = torch.tensor(
            [
                [
                    tok(p.correct, add_special_tokens=False)["input_ids"][0],
                    tok(p.wrong, add_special_tokens=False)["input_ids"][0],
                ]
            ]
        )
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
        np.testing.assert_allclose(
            got.corrupted_ld[idx], logit_diff(model.forward(corrupted), answers).numpy(), atol=1e-4
        )
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
            np.testing.assert_allclose(
                got.corrupted_ld[idx], logit_diff(hf(corrupted).logits, answers).numpy(), rtol=1e-5, atol=1e-5
            )
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


def test_one_pair_gets_no_interval_and_says_so(tiny_gpt2_native):
    t = patch_heads(tiny_gpt2_native, _pairs(1)).table()
    assert not {"effect_ci95_lo", "effect_ci95_hi"} & set(t.columns)
    assert (t["effect_ci95"] == "none: 1 prompt pair; intervals are given from 2 pairs up").all()
    assert "effect_pair_1" in t.columns


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


def test_empty_prompts_and_equal_answers_are_refused(tiny_llama_gqa_native):
    """An empty prompt (with BOS only BOS, without it no token at all: the "last token" would be
    padding) and correct = wrong (logit difference 0 on every run) are refused, naming the pair."""
    ok = PromptPair("t1 t2", "t3 t4", " t5", " t6")
    for bad, message in [
        (PromptPair("", "", " t5", " t6"), "prompt pair 2: the clean prompt is empty"),
        (PromptPair("t1 t2", "  ", " t5", " t6"), "prompt pair 2: the corrupted prompt is empty"),
        (PromptPair("t1 t2", "t3 t4", " t5", " t5"), "prompt pair 2: correct ' t5' and wrong ' t5' are the same token"),
    ]:
        with pytest.raises(HeadprobeError, match=message):
            patch_heads(tiny_llama_gqa_native, [ok, bad])


@pytest.mark.parametrize("bos", [[], ["--no-bos"]])
def test_an_empty_prompt_in_a_file_is_one_line_and_exit_2(bos, tiny_dir, tmp_path, capsys):
    good = {"clean": "t1 t2 t3", "corrupted": "t4 t2 t3", "correct": " t5", "wrong": " t6"}
    f = tmp_path / "pairs.jsonl"
    f.write_text("\n".join(json.dumps(p) for p in (good, {**good, "clean": "", "corrupted": ""})), encoding="utf-8")
    argv = ["patch", "--model", str(tiny_dir), "--prompts", str(f), "--out", str(tmp_path / "o"), "--device", "cpu"]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(argv + bos))
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("headprobe: error:")]
    assert e.value.code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert "prompt pair 2: the clean prompt is empty" in errors[0]
    assert not (tmp_path / "o").exists()


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
    assert (
        main(["patch", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--out", str(out), "--device", "cpu"])
        == 0
    )
    table = pd.read_csv(out / "head_patching.csv")
    ref = headprobe.patch(str(tiny_dir), prompts=str(prompts_file), device="cpu").table
    assert len(table) == 2 * 8 and list(table.columns[:3]) == ["layer", "head", "kv_head"]
    np.testing.assert_allclose(table["effect"], ref["effect"], atol=1e-5)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_prompts"] == 6 and summary["task"] == "custom prompts"
    for stem in ("patching", "patching_top"):
        assert (out / f"{stem}.png").is_file() and (out / f"{stem}.svg").is_file()


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"clean": "t1"}\n{"clean": "t2"}', "line 1"),
        ("not json", "line 1"),
        (json.dumps({"clean": "t1 t2", "corrupted": "t3 t4", "correct": " t5", "wrong": " t6"}), "at least 2"),
    ],
)
def test_bad_prompt_files_are_one_line_and_exit_2(content, message, tmp_path, capsys):
    f = tmp_path / "bad.jsonl"
    f.write_text(content, encoding="utf-8")
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["patch", "--model", "smollm2-135m", "--prompts", str(f), "--out", str(tmp_path / "o")]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o").exists()


def test_a_head_named_twice_is_patched_once(tiny_dir, prompts_file, tmp_path):
    """``--heads 1.1,1.1,L1H1`` names one head: one row, as on screen (positions are deduplicated too)."""
    out = tmp_path / "p"
    argv = ["patch", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--out", str(out), "--device", "cpu"]
    assert main([*argv, "--heads", "1.1,0.2,1.1,L1H1", "--formats", "none"]) == 0
    table = pd.read_csv(out / "head_patching.csv")
    assert sorted(zip(table["layer"], table["head"])) == [(0, 2), (1, 1)], table


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
        raise SystemExit(
            main(
                [
                    "patch",
                    "--model",
                    str(tiny_dir),
                    "--prompts",
                    str(f),
                    "--out",
                    str(tmp_path / "o"),
                    "--device",
                    "cpu",
                ]
            )
        )
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("headprobe: error:")]
    assert e.value.code == 2 and "Traceback" not in err and len(errors) == 1, err
    assert "prompt pair 2: answer ' t5 t7' is 2 tokens" in errors[0]
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------
# q/k/v and residual sites, padded batches, forward passes
# ---------------------------------------------------------------------------------------------


def _expanded_kv(model):
    """The GQA ``model`` rebuilt as MHA: each KV head's k and v projections copied once per query
    head of its group (a loop over KV heads), so query head h has a key/value head of its own. Its
    logits equal the GQA model's (checked below); in it, patching one query head's k or v is a plain
    per-head replacement: the independent reference for GQA k/v patching."""
    from headprobe.probe.backends.native import NativeModel
    from headprobe.probe.model.convert import spec_from_native
    from headprobe.probe.model.transformer import Transformer

    net = model.model
    cfg = net.cfg
    G = cfg.n_heads // cfg.n_kv_heads
    state = {}
    for name, w in net.state_dict().items():
        if any(name.endswith(f"attn.{p}_proj.{t}") for p in "kv" for t in ("weight", "bias")):
            per_kv = w.unflatten(0, (cfg.n_kv_heads, -1))  # [kv_head, d, ...]
            w = torch.cat([per_kv[g : g + 1].expand(G, *per_kv.shape[1:]) for g in range(cfg.n_kv_heads)]).flatten(0, 1)
        state[name] = w.clone()
    big_cfg = dataclasses.replace(cfg, n_kv_heads=cfg.n_heads)
    big = Transformer.from_state_dict(big_cfg, state).eval()
    return NativeModel(big, model.tokenizer, spec_from_native("expanded", "expanded", "float32", big_cfg))


def _capture_at(model, tokens, name):
    kept = {}
    model.forward(tokens, fwd_hooks=[(name, lambda x, hook: kept.__setitem__("x", x.clone()))])
    return kept["x"]


def _replace_hook(name, index, value):
    """A hand-made hook: ``x[index] = value[index]`` (index into the activation after ``[:]``)."""

    def hook(x, hook):
        x = x.clone()
        x[index] = value[index]
        return x

    return [(name, hook)]


@pytest.mark.parametrize("site", ["k", "v"])
def test_gqa_kv_patching_equals_the_expanded_model_patched_by_hand(tiny_llama_gqa_native, site):
    """patch(site=k|v) on the GQA model (8 query heads on 2 KV heads) equals, for every query head,
    the MHA-expanded model with that head's own k/v copy replaced by a hand-made hook; and the loop
    over KV heads: replacing KV head g in the GQA model equals replacing all of g's copies."""
    model = tiny_llama_gqa_native
    big = _expanded_kv(model)
    pairs = _pairs(4)
    heads = all_heads(model.spec.n_layers, model.spec.n_heads)
    got = patch(model, pairs, site, heads)
    G = model.spec.n_heads // model.spec.n_kv_heads
    torch.set_grad_enabled(False)
    try:
        for clean, corrupted, answers, idx in _unpadded(model, pairs):
            torch.testing.assert_close(big.forward(clean), model.forward(clean), atol=1e-5, rtol=0)
            for layer in range(model.spec.n_layers):
                name = f"blocks.{layer}.attn.hook_{site}"
                src_big, src = _capture_at(big, corrupted, name), _capture_at(model, corrupted, name)
                for g in range(model.spec.n_kv_heads):  # the loop over KV heads
                    whole = logit_diff(
                        model.forward(clean, _replace_hook(name, (slice(None), slice(None), g), src)), answers
                    )
                    copies = (slice(None), slice(None), slice(g * G, (g + 1) * G))
                    np.testing.assert_allclose(
                        whole.numpy(),
                        logit_diff(big.forward(clean, _replace_hook(name, copies, src_big)), answers).numpy(),
                        atol=1e-5,
                    )
                for head in range(model.spec.n_heads):
                    want = logit_diff(
                        big.forward(clean, _replace_hook(name, (slice(None), slice(None), head), src_big)), answers
                    )
                    i = heads.index((layer, head))
                    np.testing.assert_allclose(
                        got.patched_ld[i, idx], want.numpy(), atol=1e-5, err_msg=f"{layer}.{head}"
                    )
    finally:
        torch.set_grad_enabled(True)
    # not vacuous: one query head's patch is not its whole KV head's
    whole_kv = patch(big, pairs, site, heads)  # on MHA, per head = per KV head copy
    np.testing.assert_allclose(whole_kv.patched_ld, got.patched_ld, atol=1e-5)
    assert np.abs(got.effect).max() > 1e-3


def test_q_and_resid_patching_equal_hand_made_hooks(tiny_llama_gqa_native):
    model = tiny_llama_gqa_native
    pairs = _pairs(4)
    q = patch(model, pairs, "q", [(1, 3), (0, 6)])
    units = [(0, 0), (1, 2), (1, -1), (0, -2)]
    r = patch(model, pairs, "resid", units)
    torch.set_grad_enabled(False)
    try:
        for clean, corrupted, answers, idx in _unpadded(model, pairs):
            for i, (layer, head) in enumerate([(1, 3), (0, 6)]):
                name = f"blocks.{layer}.attn.hook_q"
                hook = _replace_hook(name, (slice(None), slice(None), head), _capture_at(model, corrupted, name))
                np.testing.assert_allclose(
                    q.patched_ld[i, idx], logit_diff(model.forward(clean, hook), answers).numpy(), atol=1e-5
                )
            for i, (layer, pos) in enumerate(units):
                name = f"blocks.{layer}.hook_resid_pre"
                hook = _replace_hook(name, (slice(None), pos), _capture_at(model, corrupted, name))
                np.testing.assert_allclose(
                    r.patched_ld[i, idx], logit_diff(model.forward(clean, hook), answers).numpy(), atol=1e-5
                )
    finally:
        torch.set_grad_enabled(True)
    assert np.abs(r.effect).max() > 1e-3 and np.abs(q.effect).max() > 1e-3
    # the whole residual stream at every position of layer 0 is the corrupted run: LD_corrupted
    n = min(len(model.to_tokens(p.clean)[0]) for p in pairs)
    every = patch(model, pairs, "resid", [(0, pos) for pos in range(n)])
    short = [i for i, p in enumerate(pairs) if len(model.to_tokens(p.clean)[0]) == n]
    assert (
        np.abs(every.patched_ld[:, short].min(0) - every.patched_ld[:, short].max(0)).max() > 1e-3
    )  # positions differ
    sum_check = patch(model, [pairs[i] for i in short], "resid", [(0, pos) for pos in range(n)])
    np.testing.assert_allclose(sum_check.patched_ld, every.patched_ld[:, short], atol=1e-5)


@pytest.mark.parametrize("fixture", ["tiny_llama_gqa_native", "tiny_gpt2_native"])
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("site", ["z", "q", "k", "v", "resid"])
def test_padded_patch_equals_unpadded_runs(fixture, side, site, request):
    """All pairs (two token lengths) in one padded batch give each pair's unpadded numbers (1e-5),
    rotary (Llama) and learned positions (GPT-2), either padding side."""
    model = request.getfixturevalue(fixture)
    pairs = _pairs(4)
    units = [(0, 1), (1, 0), (1, 3)] if site != "resid" else [(0, 1), (1, -1), (1, 3)]
    batches = encode_pairs(model, pairs, side)
    assert len(batches) == 1 and batches[0].mask is not None and int((batches[0].mask == 0).sum()) > 0
    got = patch(model, pairs, site, units, padding_side=side)
    for i, pair in enumerate(pairs):
        alone = patch(model, [pair], site, units)  # one pair: nothing padded
        np.testing.assert_allclose(got.clean_ld[i], alone.clean_ld[0], atol=1e-5)
        np.testing.assert_allclose(got.corrupted_ld[i], alone.corrupted_ld[0], atol=1e-5)
        np.testing.assert_allclose(got.patched_ld[:, i], alone.patched_ld[:, 0], atol=1e-5)


def _repeated_unit_hooks(site, chunk, batch, n_heads, clean, corrupted):
    """The patched pass's hooks as they were built before the sources were broadcast (the reference):
    each layer's corrupted source, and clean ``z``, repeated once per unit along the batch axis."""
    from headprobe.analyses.patching import head_input_hooks, resid_hooks, site_hook_name

    m, n, T = len(chunk), batch.clean.shape[0], batch.clean.shape[1]
    hooks = []
    for layer in sorted({u[0] for u in chunk}):
        name = site_hook_name(site, layer)
        source = corrupted[name].repeat(m, *[1] * (corrupted[name].dim() - 1))
        if site == "resid":
            where = torch.zeros(m, n, T, dtype=torch.bool)
            for j, (lay, pos) in enumerate(chunk):
                if lay == layer:
                    index = batch.first + pos if pos >= 0 else batch.last + 1 + pos
                    where[j, torch.arange(n), index] = True
            hooks += resid_hooks(layer, where.flatten(0, 1), source)
            continue
        sel = torch.zeros(m, n_heads, dtype=torch.bool)
        for j, (lay, head) in enumerate(chunk):
            sel[j, head] = lay == layer
        z = clean.get(f"blocks.{layer}.attn.hook_z")
        repeated_z = None if z is None else z.repeat(m, 1, 1, 1)
        hooks += head_input_hooks(layer, site, sel.repeat_interleave(n, dim=0), source, repeated_z)
    return hooks


@pytest.mark.parametrize("site", ["z", "q", "k", "v", "resid"])
def test_broadcast_sources_equal_repeated_sources_bitwise(site, tiny_llama_gqa_native, monkeypatch):
    """A patched pass reads each layer's corrupted source once for all its units (a broadcast view):
    every logit difference is bitwise the one of the pass that repeated the source per unit, with
    passes of several units spanning both layers, padded pairs of two lengths, and GQA's k/v restore."""
    from headprobe.analyses import patching

    model = tiny_llama_gqa_native
    pairs = _pairs(4)
    units = [(0, 1), (0, 6), (1, 0), (1, 5), (0, 3)] if site != "resid" else [(0, 1), (1, -1), (0, -2), (1, 0)]
    got = {mb: patch(model, pairs, site, units, max_batch=mb) for mb in (4, 12, 64)}  # 1, 3 and every unit a pass
    monkeypatch.setattr(patching, "_unit_hooks", _repeated_unit_hooks)
    for mb, new in got.items():
        old = patch(model, pairs, site, units, max_batch=mb)
        assert np.array_equal(new.patched_ld, old.patched_ld), (site, mb)
        assert np.array_equal(new.clean_ld, old.clean_ld) and new.n_forward == old.n_forward
    assert got[64].n_forward == 2 and np.abs(got[64].effect).max() > 1e-3  # one pass of both layers' units


def _count_passes(model, monkeypatch) -> list[int]:
    calls = [0]
    for name in ("forward", "final_residual"):
        real = getattr(model, name)

        def counted(*args, _real=real, **kwargs):
            calls[0] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(model, name, counted)
    return calls


def test_four_pairs_of_two_lengths_take_half_the_passes(tiny_llama_gqa_native, monkeypatch):
    """4 pairs of 2 token lengths: one padded batch per pass, against today's one batch per length
    (each length run on its own), counted at the model's forward calls."""
    model = tiny_llama_gqa_native
    pairs = _pairs(4)
    calls = _count_passes(model, monkeypatch)
    padded = patch(model, pairs, "z")
    n_padded = calls[0]
    calls[0] = 0
    by_length: dict[int, list] = {}
    for p in pairs:
        by_length.setdefault(len(model.to_tokens(p.clean)[0]), []).append(p)
    assert len(by_length) == 2
    for group in by_length.values():
        patch(model, group, "z")
    n_per_length = calls[0]
    assert n_padded == padded.n_forward == 2 and n_per_length == 4, (n_padded, n_per_length)
    assert 2 * n_padded <= n_per_length


def test_bridge_patches_the_same_sites_as_native(tiny_llama_gqa, tiny_llama_gqa_native):
    """On the bridge (one right-padded batch) q, k, v and resid patching give the native numbers."""
    pairs = _pairs(4)
    assert (
        len(encode_pairs(tiny_llama_gqa, pairs, "right")) == 1 and len(encode_pairs(tiny_llama_gqa, pairs, "left")) == 2
    )
    for site, units in [("q", [(0, 2), (1, 5)]), ("k", [(0, 2), (1, 5)]), ("v", [(1, 0), (1, 7)]), ("resid", [(1, 1)])]:
        native = patch(tiny_llama_gqa_native, pairs, site, units)
        bridge = patch(tiny_llama_gqa, pairs, site, units)
        np.testing.assert_allclose(bridge.patched_ld, native.patched_ld, atol=1e-4, err_msg=site)
        assert np.abs(native.effect).max() > 1e-3


def test_bad_sites_and_units_are_refused(tiny_llama_gqa_native):
    pairs = _pairs(2)
    with pytest.raises(HeadprobeError, match="unknown patching site"):
        patch(tiny_llama_gqa_native, pairs, "x")
    with pytest.raises(HeadprobeError, match="outside the shortest prompt"):
        patch(tiny_llama_gqa_native, pairs, "resid", [(0, 40)])
    with pytest.raises(HeadprobeError, match="does not exist"):
        patch(tiny_llama_gqa_native, pairs, "k", [(0, 8)])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--site", "w"], "invalid choice"),
        (["--site", "resid", "--heads", "0.1"], "--positions"),
        (["--site", "k", "--positions", "1"], "--site resid"),
        (["--site", "resid", "--positions", "a"], "integers"),
        (["--prompts", "pairs.jsonl", "--n-prompts", "10"], "uses every pair of the file"),  # it was ignored
    ],
)
def test_bad_site_flags_are_one_line_and_exit_2(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main(["patch", "--model", "smollm2-135m", *argv, "--out", str(tmp_path / "o")]))
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("site", ["k", "resid"])
def test_cli_site_writes_per_pair_effects_and_t_intervals(tiny_dir, prompts_file, tmp_path, site):
    from scipy import stats

    out = tmp_path / site
    extra = ["--positions", "0,-1"] if site == "resid" else []
    assert (
        main(
            [
                "patch",
                "--model",
                str(tiny_dir),
                "--prompts",
                str(prompts_file),
                "--site",
                site,
                *extra,
                "--out",
                str(out),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    csv = out / ("resid_patching.csv" if site == "resid" else "head_patching.csv")
    table = pd.read_csv(csv)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["site"] == site and summary["n_prompts"] == 6 and "Student-t" in summary["interval_rule"]
    assert "clean_logit_diff_ci95" in summary
    per_pair = table[[f"effect_pair_{i}" for i in range(1, 7)]].to_numpy()
    np.testing.assert_allclose(per_pair.mean(1), table["effect"], atol=1e-4)
    for row, x in zip(table.itertuples(), per_pair):  # scipy's t interval per unit, from the CSV's own pairs
        lo, hi = stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=stats.sem(x)) if x.std() > 0 else (x[0], x[0])
        assert row.effect_ci95_lo == pytest.approx(lo, abs=2e-4) and row.effect_ci95_hi == pytest.approx(hi, abs=2e-4)
    assert list(table.columns[:2]) == (["layer", "pos"] if site == "resid" else ["layer", "head"])
    assert len(table) == (2 * 2 if site == "resid" else 16)
    top = summary["top_positions" if site == "resid" else "top_heads"][0]
    assert set(top) >= ({"layer", "pos"} if site == "resid" else {"head"})


@pytest.mark.real_model
def test_smollm2_padded_ioi_patch_equals_one_batch_per_length(smollm2_native):
    """4 IOI pairs of 2 token lengths on SmolLM2 (GQA, 3 query heads per KV head): one padded batch
    gives the numbers of one unpadded batch per length, at z and at k, in fewer passes."""
    model = smollm2_native
    pairs = ioi_prompts(model.tokenizer, n=4)
    heads = [(23, 3), (17, 4), (17, 3)]
    assert len({len(model.to_tokens(p.clean)[0]) for p in pairs}) == 2
    for site in ("z", "k"):
        padded = patch(model, pairs, site, heads)
        per_length = np.zeros_like(padded.patched_ld)
        passes = 0
        for b in encode_pairs(model, pairs, pad=False):
            r = patch(model, [pairs[i] for i in b.index], site, heads)
            per_length[:, b.index], passes = r.patched_ld, passes + r.n_forward
        np.testing.assert_allclose(padded.patched_ld, per_length, atol=5e-5, rtol=0)
        assert 2 * padded.n_forward <= passes
    assert padded.effect[0].mean() < -0.3  # 23.3's key input matters for IOI (docs/patch.md)


@pytest.mark.parametrize(
    "form", ["0.1,1.3", "L0H1,L1H3", ["0.1", "1.3"], [(0, 1), (1, 3)], ["0.1", (1, 3)], ((0, 1), (1, 3))]
)
def test_every_commands_heads_setting_reads_the_same_forms(form):
    """ablate's and patch's ``heads`` (and show's one ``head``) go through one parser (read_heads):
    each form is the same heads; one pair is one head; a float (18.6 is 18.60 too) is refused."""
    from headprobe.commands.ablate import AblateConfig
    from headprobe.commands.patch import PatchConfig
    from headprobe.probe.core import heads
    from headprobe.probe.core.errors import HeadprobeError

    for config in (AblateConfig, PatchConfig):
        assert config(model="m", heads=form).heads == "0.1,1.3"
        assert config(model="m", heads=(0, 1)).heads == config(model="m", heads="0.1").heads == "0.1"
    # a float passes no type check in the configs' annotations; users without one get this line
    with pytest.raises(HeadprobeError, match=r"write layer\.head as the string '18\.6' or the pair \(18, 6\)"):
        heads.heads_text(18.6)
    with pytest.raises(HeadprobeError, match=r"heads=\[18\.6\]|heads=18\.6"):
        heads.heads_text([18.6])


def test_patch_takes_heads_as_pairs(tiny_llama_gqa_native, prompts_file):
    """``headprobe.patch(model, heads=[(l, h)])`` patches the heads ``heads="l.h,..."`` names."""
    model = tiny_llama_gqa_native
    by_text = headprobe.patch(model, prompts=str(prompts_file), heads="0.1,1.3").table
    by_pairs = headprobe.patch(model, prompts=str(prompts_file), heads=[(0, 1), "1.3"]).table
    assert list(zip(by_pairs["layer"], by_pairs["head"])) == [(0, 1), (1, 3)]
    pd.testing.assert_frame_equal(by_pairs, by_text)


def test_answers_without_their_leading_space_are_noted(tiny_tokenizer):
    """A walker typed "Mary" where the model continues "... to" with " Mary": both are single tokens
    of a byte-level BPE vocabulary, so the run went ahead and measured the unspaced token's logit in
    silence. Noted when the spaced form is another single token; not for a word-level vocabulary
    (the same token either way) nor after a prompt ending in a space."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from headprobe.analyses.patching import PromptPair, answer_space_notes

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["Mary John Mary John gave a drink to Mary to John Mary. John."] * 50, vocab_size=300)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer)
    assert tok(" Mary")["input_ids"] != tok("Mary")["input_ids"] and len(tok(" Mary")["input_ids"]) == 1
    pair = PromptPair(clean="John gave a drink to", corrupted="Mary gave a drink to", correct=" Mary", wrong=" John")
    assert answer_space_notes(tok, [pair]) == []
    unspaced = PromptPair(pair.clean, pair.corrupted, correct="Mary", wrong=" John")
    (note,) = answer_space_notes(tok, [pair, unspaced])
    assert note.startswith("1 of 4 answers have no leading space ('Mary')") and "' Mary'" in note
    after_space = PromptPair(pair.clean + " ", pair.corrupted + " ", correct="Mary", wrong="John")
    assert answer_space_notes(tok, [after_space]) == []
    assert tiny_tokenizer(" t5")["input_ids"] == tiny_tokenizer("t5")["input_ids"]  # word level: one token either way
    assert answer_space_notes(tiny_tokenizer, [PromptPair("t1 t2", "t3 t4", correct="t5", wrong="t6")]) == []


def test_the_leading_space_note_is_printed_before_the_run(tiny_llama_gqa_native, prompts_file, capsys, monkeypatch):
    """The tokenizer alone decides the note, so it is printed before the heads are patched (it came
    after a 270-head run of SmolLM2-135M, too late to fix the answers); the report still ends with it.
    The tiny model's word-level tokenizer never needs it: the note is stubbed, the order is real."""
    from headprobe.analyses import patching

    said, real = [], patching.patch
    monkeypatch.setattr(patching, "answer_space_notes", lambda tokenizer, pairs: ["stub: answers lack a space"])

    def patch_after_reading(*args, **kwargs):
        said.append(capsys.readouterr().out)  # what was printed when the run began
        return real(*args, **kwargs)

    monkeypatch.setattr(patching, "patch", patch_after_reading)
    r = headprobe.patch(tiny_llama_gqa_native, prompts=str(prompts_file), heads="0.1", progress=True)
    assert said and "NOTE: stub: answers lack a space\n" in said[0]
    # printed already: the report does not repeat it (the CLI prints the report), the result keeps it
    assert "NOTE" not in r.report() and r.notes == ["stub: answers lack a space"]
    capsys.readouterr()
    r = headprobe.patch(tiny_llama_gqa_native, prompts=str(prompts_file), heads="0.1")  # progress=False: silent
    assert "NOTE" not in capsys.readouterr().out
    assert r.report().endswith("NOTE: stub: answers lack a space")  # said by the report instead


def test_the_cli_prints_the_leading_space_note_once(tiny_dir, prompts_file, tmp_path, capsys, monkeypatch):
    """The CLI printed the note before the run and again at the end of its report: once now, and
    summary.json keeps it. Stubbed as above (the tiny word-level tokenizer never needs it)."""
    from headprobe.analyses import patching

    monkeypatch.setattr(patching, "answer_space_notes", lambda tokenizer, pairs: ["stub: answers lack a space"])
    out = tmp_path / "p"
    argv = ["patch", "--model", str(tiny_dir), "--prompts", str(prompts_file), "--out", str(out), "--device", "cpu"]
    capsys.readouterr()
    assert main([*argv, "--heads", "0.1", "--formats", "none"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("stub: answers lack a space") == 1, printed
    assert json.loads((out / "summary.json").read_text())["notes"] == ["stub: answers lack a space"]
