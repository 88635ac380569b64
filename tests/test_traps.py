"""The known ways head analysis fails silently, each made impossible and tested."""

import pytest
import torch
from conftest import TINY_MODELS

from headprobe.analyses.detectors import DETECTORS, first_token_score, positional_score, previous_token_score
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.hooks.ablation import head_ablation_hooks
from headprobe.probe.hooks.capture import capture_heads, pad_prompts, patterns_by_layer, prompt_patterns_by_layer
from headprobe.probe.hooks.names import attn_hook

# 1. GQA head axes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["tiny_llama_gqa", "tiny_llama_gqa_native"])
def test_gqa_query_head_reads_kv_head_h_div_group(fixture, request):
    """N_heads=8, n_kv_heads=2: perturbing KV head 1's keys changes the patterns of query heads
    4..7 only (h // 4), not of the odd heads (h % 2)."""
    model = request.getfixturevalue(fixture)
    tokens = torch.randint(0, 100, (1, 10), generator=torch.Generator().manual_seed(3))
    shapes = {}

    def record(name):
        def hook(x, hook):
            shapes[name] = tuple(x.shape)

        return hook

    def bump_kv1(k, hook):
        k = k.clone()
        k[:, :, 1] += 3.0 * torch.randn_like(k[:, :, 1])
        return k

    clean = capture_heads(model, tokens, layers=[0])["pattern"][0]
    hooks = [(attn_hook(0, n), record(attn_hook(0, n))) for n in ("k", "v", "z", "pattern")]
    with model.model.hooks(fwd_hooks=[*hooks, (attn_hook(0, "k"), bump_kv1)]):
        bumped = capture_heads(model, tokens, layers=[0])["pattern"][0]
    assert shapes[attn_hook(0, "k")][2] == 2 and shapes[attn_hook(0, "v")][2] == 2
    assert shapes[attn_hook(0, "z")][2] == 8 and shapes[attn_hook(0, "pattern")][1] == 8
    changed = [h for h in range(8) if not torch.allclose(clean[0, h], bumped[0, h])]
    assert changed == [4, 5, 6, 7]


# 2 and 7. Ablation happens before W_O; a fully ablated layer leaves b_O ---------------------------


@pytest.mark.parametrize("fixture", TINY_MODELS)
def test_zero_ablating_every_head_leaves_the_output_bias(fixture, request):
    model = request.getfixturevalue(fixture)
    tokens = torch.randint(0, 100, (2, 7))
    all_heads = [(1, h) for h in range(model.spec.n_heads)]
    with model.model.hooks(fwd_hooks=head_ablation_hooks(all_heads, "zero")):
        out = capture_heads(model, tokens, layers=[1])["attn_out"][1]
    b_O = model.b_O(1)
    expected = torch.zeros_like(out) if b_O is None else b_O.expand_as(out)
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=0)
    if fixture == "tiny_gpt2":
        assert b_O.abs().sum() > 0  # the bias is really there, so "equals b_O" is not "equals 0"


# 4. BOS -----------------------------------------------------------------------------------------------


def test_bos_off_gives_one_position_per_word(tiny_gpt2):
    from headprobe.probe.backends.loading import LoadedModel

    no_bos = LoadedModel(tiny_gpt2.model, tiny_gpt2.tokenizer, tiny_gpt2.spec, prepend_bos=False)
    assert no_bos.to_tokens("t7").tolist() == [[7]]
    assert tiny_gpt2.to_tokens("t7").tolist() == [[100, 7]]


@pytest.mark.real_model
def test_smollm2_hello_is_one_position_without_bos_and_two_with(smollm2_native):
    from headprobe.probe.backends.loading import LoadedModel

    with_bos = smollm2_native.to_tokens("Hello")[0]
    assert len(with_bos) == 2 and with_bos[0] == smollm2_native.bos_token_id
    no_bos = LoadedModel(smollm2_native.model, smollm2_native.tokenizer, smollm2_native.spec, prepend_bos=False)
    assert no_bos.to_tokens("Hello").shape == (1, 1)


# 5. Padding -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("fixture", ["tiny_gpt2_native", "tiny_llama_gqa_native"])
def test_padded_batch_gives_each_prompt_its_own_patterns_and_scores(fixture, side, request):
    model = request.getfixturevalue(fixture)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 100, (n,), generator=g) for n in (9, 4, 13)]
    batched: dict[tuple[int, int], torch.Tensor] = {}
    prompt_patterns_by_layer(model, prompts, lambda layer, i, p: batched.__setitem__((layer, i), p.clone()), side=side)
    for i, prompt in enumerate(prompts):
        alone = capture_heads(model, prompt[None])["pattern"]
        for layer in range(model.spec.n_layers):
            got = batched[(layer, i)]
            torch.testing.assert_close(got, alone[layer][0], atol=1e-5, rtol=0)
            for det in ("previous_token", "first_token"):
                torch.testing.assert_close(
                    DETECTORS[det].score(got[None], None, 1)[det],
                    DETECTORS[det].score(alone[layer], None, 1)[det],
                    atol=1e-5,
                    rtol=0,
                )


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_gets_no_weight_and_no_nan(tiny_llama_gqa_native, side):
    model = tiny_llama_gqa_native
    tokens, mask = pad_prompts([torch.arange(1, 6), torch.arange(1, 3)], pad_id=100, side=side)
    kept = {}
    patterns_by_layer(model, tokens, lambda layer, p: kept.__setitem__(layer, p.clone()), attention_mask=mask)
    for p in kept.values():
        assert torch.isfinite(p).all()
        real = mask.bool()
        rows = p.sum(-1)  # [batch, head, q]
        torch.testing.assert_close(rows[real[:, None, :].expand_as(rows)], torch.ones(int(real.sum()) * 8))
        weight_on_pads = p.masked_select((real[:, None, :, None] & ~real[:, None, None, :]).expand_as(p))
        assert weight_on_pads.abs().max() == 0


def test_bridge_refuses_padding_with_a_clear_error(tiny_gpt2):
    """Left padding: the bridge takes right padding of a causal model only (exact there, tests/test_padding.py)."""
    tokens, mask = pad_prompts([torch.arange(1, 4), torch.arange(1, 3)], pad_id=100, side="left")
    with pytest.raises(HeadprobeError, match="native backend"):
        tiny_gpt2.forward(tokens, attention_mask=mask)


# 6. Kernels that hide patterns ---------------------------------------------------------------------


def test_a_pattern_hook_that_never_fires_is_an_error(tiny_gpt2_native):
    """A fused kernel returns no weights: patterns_by_layer must stop, not score nothing."""

    class FusedOnly:  # the loaded model in every other respect
        def __getattr__(self, name):
            return getattr(tiny_gpt2_native, name)

        def forward(self, tokens, fwd_hooks=(), attention_mask=None):
            return tiny_gpt2_native.model(tokens)  # runs SDPA, ignores the pattern hooks

    with pytest.raises(HeadprobeError, match="fired 0 times.*eager"):
        patterns_by_layer(FusedOnly(), torch.randint(0, 100, (1, 5)), lambda layer, p: None)


@pytest.mark.parametrize("fixture", TINY_MODELS)
def test_every_pattern_hook_fires_exactly_once_per_layer(fixture, request):
    model = request.getfixturevalue(fixture)
    calls = []
    patterns_by_layer(model, torch.randint(0, 100, (1, 6)), lambda layer, p: calls.append(layer))
    assert calls == list(range(model.spec.n_layers))


# 9. Sequence length ----------------------------------------------------------------------------------


def test_length_one_is_refused_and_length_equal_to_context_is_accepted(tiny_gpt2_native, tmp_path):
    from headprobe.analyses.data import natural_text_tokens

    text = " ".join(f"t{i % 100}" for i in range(1000))
    with pytest.raises(HeadprobeError, match="at least 2 positions"):
        natural_text_tokens(tiny_gpt2_native, 2, 1, seed=0, text=text)
    n_ctx = tiny_gpt2_native.spec.n_ctx
    full = natural_text_tokens(tiny_gpt2_native, 2, n_ctx, seed=0, text=text)
    assert full.tokens.shape == (2, n_ctx)
    patterns_by_layer(tiny_gpt2_native, full.tokens, lambda layer, p: None)  # runs at exactly n_ctx
    # a long text is cut into windows (all of them available), not truncated to one
    assert full.n_available == 1000 // (n_ctx - 1)


def test_scan_refuses_sequences_longer_than_the_context(tiny_gpt2_native):
    from headprobe.commands.scan import ScanConfig, run

    n_ctx = tiny_gpt2_native.spec.n_ctx
    with pytest.raises(HeadprobeError, match=f"longer than the model's context .* use --seq-len {n_ctx} or less"):
        run(tiny_gpt2_native, ScanConfig(seq_len=n_ctx + 1), progress=False)
    with pytest.raises(HeadprobeError, match=f"use --period {(n_ctx - 1) // 2} or less"):
        run(tiny_gpt2_native, ScanConfig(period=n_ctx // 2), progress=False)
    n_heads = tiny_gpt2_native.spec.n_layers * tiny_gpt2_native.spec.n_heads
    with pytest.raises(HeadprobeError, match=f"leaves no random control: the model has {n_heads} heads"):
        run(tiny_gpt2_native, ScanConfig(k=n_heads), progress=False)


def test_scan_defaults_shrink_to_a_small_model(tiny_gpt2_native):
    """A model with a short context and few heads gets the largest default sizes that fit it."""
    import dataclasses

    from headprobe.commands.scan import DEFAULT_K, DEFAULT_PERIOD, DEFAULT_SEQ_LEN, ScanConfig, run
    from headprobe.probe.backends.loading import LoadedModel

    spec = dataclasses.replace(tiny_gpt2_native.spec, n_ctx=40)  # the scan reads the context from the spec
    model = LoadedModel(tiny_gpt2_native.model, tiny_gpt2_native.tokenizer, spec)
    assert spec.n_ctx < DEFAULT_SEQ_LEN and spec.n_layers * spec.n_heads // 4 < DEFAULT_K  # else this tests nothing
    result = run(model, ScanConfig(n_natural=2, n_repeated=2, n_random=2), progress=False)
    cfg = result.config
    assert cfg.seq_len == spec.n_ctx and result.natural.tokens.shape[1] == spec.n_ctx
    assert cfg.period == min(DEFAULT_PERIOD, (spec.n_ctx - 1) // 2) and 2 * cfg.period + 1 <= spec.n_ctx
    assert cfg.k == max(1, spec.n_layers * spec.n_heads // 4)


# 10. Detectors never change their inputs --------------------------------------------------------------


def test_scoring_leaves_a_captured_pattern_untouched(tiny_gpt2_native):
    pattern = capture_heads(tiny_gpt2_native, torch.randint(0, 100, (2, 12)))["pattern"][0]
    before = pattern.clone()
    previous_token_score(pattern), first_token_score(pattern), positional_score(pattern)
    for det in DETECTORS.values():
        det.score(pattern, 5, 1)
    assert torch.equal(pattern, before)


# NaN / Inf -----------------------------------------------------------------------------------------------


def test_nan_activations_are_reported_with_their_layer(tiny_llama_gqa_native):
    from headprobe.analyses.data import repeated_random_tokens
    from headprobe.analyses.scoring import score_token_set

    def poison(z, hook):
        z = z.clone()
        z[0, 3, 2] = float("nan")
        return z

    tokens = repeated_random_tokens(tiny_llama_gqa_native, 2, 5, seed=0)
    with tiny_llama_gqa_native.model.hooks(fwd_hooks=[(attn_hook(1, "z"), poison)]):
        with pytest.raises(HeadprobeError, match="NaN or Inf in layer 1"):
            score_token_set(tiny_llama_gqa_native, tokens, "repeated")


def _save_tiny_gpt2(path, tokenizer, poison=False):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=16, vocab_size=101, n_positions=32))
    if poison:
        with torch.no_grad():
            hf.transformer.h[1].attn.c_proj.weight[0, 0] = float("inf")
    hf.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# Bad input on the command line: one line, exit 2, nothing written ------------------------------------


def test_cli_nan_weights_name_the_parameter(tmp_path, tiny_tokenizer):
    from test_loading import assert_one_line_error, run_cli

    model_dir = _save_tiny_gpt2(tmp_path / "m", tiny_tokenizer, poison=True)
    rc, _, err = run_cli("scan", "--model", str(model_dir), "--out", str(tmp_path / "out"))
    assert_one_line_error(rc, err, "not finite", "h.1.attn.c_proj.weight")
    assert not (tmp_path / "out").exists()


def test_cli_truncated_weights_and_unwritable_output(tmp_path, tiny_tokenizer):
    from test_loading import assert_one_line_error, run_cli

    model_dir = _save_tiny_gpt2(tmp_path / "m", tiny_tokenizer)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    rc, _, err = run_cli("scan", "--model", str(model_dir), "--out", str(tmp_path / "out"))
    assert_one_line_error(rc, err, "cannot load model")
    rc, _, err = run_cli("scan", "--out", "/proc/headprobe-out")
    assert_one_line_error(rc, err, "/proc/headprobe-out")
    (tmp_path / "afile").write_text("x")
    rc, _, err = run_cli("scan", "--out", str(tmp_path / "afile"))
    assert_one_line_error(rc, err, "not a directory")


def test_cli_unknown_model_name_offline(tmp_path):
    from test_loading import assert_one_line_error, run_cli

    rc, _, err = run_cli(
        "scan",
        "--model",
        "no-such-org/no-such-model",
        "--out",
        str(tmp_path / "o"),
        env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"},
    )
    assert_one_line_error(rc, err, "no-such-org/no-such-model", "--model PATH")


# Long runs: atomic files, recorded settings, reproducible numbers ------------------------------------------


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path):
    from headprobe.probe.core.io import atomic_path, write_text

    target = tmp_path / "head_scores.csv"
    write_text(target, "complete\n")
    with pytest.raises(KeyboardInterrupt):
        with atomic_path(target) as tmp:
            tmp.write_text("half writ")
            raise KeyboardInterrupt
    assert target.read_text() == "complete\n"
    assert [p.name for p in tmp_path.iterdir()] == ["head_scores.csv"]


def test_sigterm_mid_write_exits_143_and_leaves_no_temporary(tmp_path, monkeypatch, capsys):
    """SIGTERM (e.g. a cluster's time limit) runs the same clean-up as Ctrl-C."""
    import os
    import signal

    import headprobe.commands.budget
    from headprobe.cli import main
    from headprobe.probe.core.io import atomic_path

    def run(args):
        with atomic_path(tmp_path / "summary.json") as tmp:
            tmp.write_text("half")
            os.kill(os.getpid(), signal.SIGTERM)
        return 0

    monkeypatch.setattr(headprobe.commands.budget, "run", run)
    assert main(["budget", "--preset", "gpt2-small"]) == 143
    assert list(tmp_path.iterdir()) == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("headprobe: terminated")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler does not outlive main()


def test_outputs_are_readable_by_others_as_umask_allows(tmp_path):
    import os

    from headprobe.probe.core.io import write_text

    old = os.umask(0o022)
    try:
        write_text(tmp_path / "a.csv", "x\n")
    finally:
        os.umask(old)
    assert (tmp_path / "a.csv").stat().st_mode & 0o777 == 0o644


def test_same_seed_same_numbers_and_settings_recorded(tiny_llama_gqa_native, tmp_path):
    from headprobe.commands.scan import ScanConfig, run

    text = tmp_path / "t.txt"
    text.write_text(" ".join(f"t{(i * 37) % 100}" for i in range(3000)))
    cfg = ScanConfig(n_natural=3, seq_len=20, n_repeated=3, period=6, k=2, n_random=2, text=str(text), seed=7)
    a = run(tiny_llama_gqa_native, cfg, progress=False)
    b = run(tiny_llama_gqa_native, cfg, progress=False)
    assert a.table.equals(b.table)
    assert [v.to_dict() for v in a.verifications] == [v.to_dict() for v in b.verifications]
    s = a.summary()
    assert s["seed"] == 7 and s["device"] == "cpu" and s["dtype"] == "float32" and s["backend"] == "native"
    assert s["weights_precision"] and {"torch", "transformers", "python"} <= set(s["versions"])


# 7. Mean ablation averages real tokens only -----------------------------------------------------------------


def test_mean_z_ignores_padding_and_bos(tiny_llama_gqa_native):
    from headprobe.analyses.ablation import mean_z_from

    model = tiny_llama_gqa_native
    prompts = [torch.tensor([100, 5, 6, 7, 8]), torch.tensor([100, 9, 10])]
    tokens, mask = pad_prompts(prompts, pad_id=100, side="right")
    zs = {}
    with model.model.hooks(
        fwd_hooks=[
            (attn_hook(layer, "z"), lambda z, hook, layer=layer: zs.__setitem__(layer, z.clone())) for layer in range(2)
        ]
    ):
        model.forward(tokens, attention_mask=mask)
    got = mean_z_from(zs, start=1, attention_mask=mask)
    # reference: run each prompt alone and average its real non-BOS positions by hand
    alone = [capture_heads(model, p[None])["z"] for p in prompts]
    for layer in range(2):
        rows = torch.cat([a[layer][0, 1:] for a in alone])  # [real tokens, head, d_head]
        torch.testing.assert_close(got[layer], rows.mean(0), atol=1e-5, rtol=0)


# 8. Gradient importance stays finite while pruning ----------------------------------------------------------


def test_gradient_importance_stays_finite_over_rescoring_rounds(tiny_llama_gqa_native):
    from headprobe.analyses.ablation import head_importance

    model = tiny_llama_gqa_native
    tokens = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    keep = torch.ones(2, 8)
    for round_ in range(8):  # remove the least important head each round, down to a fully pruned layer
        imp = head_importance(model, tokens, 0, head_mask=keep, normalize=True).importance
        assert torch.isfinite(imp).all(), round_
        masked = imp.flatten().clone()
        masked[keep.flatten() == 0] = float("inf")
        keep.view(-1)[masked.argmin()] = 0.0
    keep[0] = 0.0  # a layer with no head left
    assert torch.isfinite(head_importance(model, tokens, 0, head_mask=keep, normalize=True).importance).all()


def test_cli_misspelt_model_name_is_called_unknown_with_a_suggestion(tmp_path):
    from test_loading import assert_one_line_error, run_cli

    rc, _, err = run_cli(
        "scan",
        "--model",
        "gpt-2",
        "--out",
        str(tmp_path / "o"),
        env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"},
    )
    assert_one_line_error(rc, err, "unknown model name gpt-2", "did you mean gpt2")
    rc, _, err = run_cli("scan", "--out", "")
    assert_one_line_error(rc, err, "output directory name is empty")
