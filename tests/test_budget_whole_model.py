"""``headprobe budget --model``'s whole-model rows (``parameters, whole model``, ``forward FLOPs per
token, whole model``) against the model's own exact parameter count: ``sum(p.numel() for p in
model.parameters())``, which counts a tied embedding once, as the row does. The row's convention
excludes nothing a model holds as a parameter (buffers such as rotary frequencies are not
parameters). References: transformers' models of the zoo and SmolLM2, and the native small model
of a pruned checkpoint (removed heads' weights absent)."""

from __future__ import annotations

import json

import pytest
import zoo

from headprobe.cli import main
from headprobe.commands import budget
from headprobe.probe.layout import cost

MOE = {"mixtral", "qwen3_moe", "gpt_oss", "llama4_text", "qwen3_next"}
"""The zoo's families whose MLP is a mixture of experts: no whole-model rows."""


def numel(model) -> int:
    """The model's exact parameter count (tied weights once)."""
    return sum(p.numel() for p in model.parameters())


def whole_model(hf_config):
    """(``parameters, whole model`` of a Hugging Face config, or the reason it has none)."""
    from headprobe.probe.model.convert import config_from_hf

    shape = budget.shape_of_hf_config(hf_config)
    return shape if isinstance(shape, str) else cost.model_params(config_from_hf(hf_config).layout, shape).total


@pytest.mark.parametrize("family", list(zoo.ZOO))
def test_whole_model_params_match_every_zoo_family(family, tiny_tokenizer):
    """Every causal family of the zoo: the count is the transformers model's numel exactly (GPT-2:
    learned positions and biases, LayerNorm; Gemma 2/3: four norms a layer; Cohere 2: one bias-free
    LayerNorm a layer), or, for a mixture of experts, a reason and no number."""
    model = zoo.make_checkpoint(family, tiny_tokenizer).hf_model
    got = whole_model(model.config)
    if family in MOE:
        assert isinstance(got, str) and "mixture-of-experts" in got
    else:
        assert got == numel(model), (family, got, numel(model))


def test_a_hybrid_with_linear_attention_layers_gets_a_reason(tiny_tokenizer):
    """Qwen3.5 with Gated DeltaNet layers (the family's hybrid variant): its linear layers'
    parameters are not the formulas', so no number."""
    from headprobe.probe.model.families.qwen3_next import HYBRID

    model = zoo.make_checkpoint("qwen3_5_text", tiny_tokenizer, **HYBRID).hf_model
    got = whole_model(model.config)
    assert isinstance(got, str) and "linear-attention" in got


def test_smollm2_whole_model_params_are_its_numel(smollm2_hf):
    """The embedded SmolLM2-135M (the session's one load): 134,515,008, the preset's number."""
    model, _ = smollm2_hf
    assert whole_model(model.config) == numel(model) == 134_515_008
    preset = cost.model_params(cost.PRESETS["smollm2-135m"], cost.MODEL_SHAPES["smollm2-135m"]).total
    assert preset == 134_515_008


@pytest.fixture(scope="module")
def zoo_dir(tiny_tokenizer, tmp_path_factory):
    root = tmp_path_factory.mktemp("whole")
    return lambda family: str(zoo.save_dir(family, tiny_tokenizer, root / family))


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_budget_model_prints_the_whole_model_rows(family, zoo_dir, tiny_tokenizer, capsys):
    """``budget --model DIR``: the rows, their numbers the model's numel and 2 N + scores/AV by hand."""
    d, T = zoo_dir(family), 100
    assert main(["budget", "--model", d, "--seq-len", str(T), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    model = zoo.make_checkpoint(family, tiny_tokenizer).hf_model
    cfg = model.config
    embeddings = model.get_input_embeddings().weight.numel()
    if family == "gpt2":  # learned positions are embeddings too (Kaplan et al.'s N leaves them out)
        embeddings += model.transformer.wpe.weight.numel()
    if not cfg.tie_word_embeddings:
        embeddings += model.get_output_embeddings().weight.numel()
    assert r["model_params"] == numel(model)
    assert r["model_params_non_embedding"] == numel(model) - embeddings
    heads, d_head = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    context = cfg.num_hidden_layers * heads * 2 * (d_head + d_head) * T  # QK^T and AV of one token, every layer
    assert r["forward_flops_per_token"] == 2 * (numel(model) - embeddings) + context
    assert main(["budget", "--model", d]) == 0
    out = capsys.readouterr().out
    assert (
        f"parameters, whole model {numel(model):,}".split()
        == next(line for line in out.splitlines() if line.startswith("parameters, whole model")).split()[:4]
    )
    assert "forward FLOPs per token, whole model" in out


def test_a_mixture_of_experts_gets_a_reason_not_rows(zoo_dir, capsys):
    d = zoo_dir("mixtral")
    assert main(["budget", "--model", d]) == 0
    out = capsys.readouterr().out
    assert "whole model" not in out.replace("no whole-model rows", "")
    assert "no whole-model rows: mixture-of-experts MLPs" in out
    assert main(["budget", "--model", d, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert "model_params" not in r and "mixture-of-experts" in r["whole_model_missing"]


def test_resizing_a_model_drops_its_whole_model_rows(zoo_dir, capsys):
    assert main(["budget", "--model", zoo_dir("llama"), "--n-layers", "4", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert "model_params" not in r and "--n-layers" in r["whole_model_missing"]


@pytest.mark.parametrize(
    "family, removed", [("llama", [(0, 0), (0, 1), (0, 2), (1, 3)]), ("gpt2", [(0, 0), (0, 1), (1, 2)])]
)
def test_a_pruned_checkpoint_counts_without_its_removed_heads(family, removed, tiny_tokenizer, tmp_path, capsys):
    """``prune --save-pruned``'s directory: the pruned count is the small model's numel (removed
    heads' weights absent), the unpruned one the full native model's."""
    from headprobe.probe.backends.wrapping import wrap
    from headprobe.probe.model.pruned import keep_mask_from, load_pruned_dir, remove_heads, save_pruned_dir

    full = wrap(zoo.make_checkpoint(family, tiny_tokenizer), backend="native")
    L, H = full.spec.n_layers, full.spec.n_heads
    d, T = tmp_path / "pruned_model", 100
    save_pruned_dir(remove_heads(full.model, keep_mask_from(removed, L, H)), d, tiny_tokenizer)
    assert main(["budget", "--model", str(d), "--seq-len", str(T), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    small = load_pruned_dir(d)
    assert r["pruned"]["model_params"] == numel(small) < numel(full.model) == r["unpruned"]["model_params"]
    embeddings = r["pruned"]["model_params_by_part"]["embeddings"]
    kept = L * H - len(removed)
    d_head = full.spec.layout.d_head
    assert r["pruned"]["forward_flops_per_token"] == 2 * (numel(small) - embeddings) + kept * 2 * 2 * d_head * T
    assert main(["budget", "--model", str(d)]) == 0
    assert "parameters, whole model" in capsys.readouterr().out


def test_a_trained_checkpoint_counts_its_model(tiny_tokenizer, tmp_path, capsys):
    """``headprobe train``'s directory format (the native model saved): its numel."""
    from headprobe.probe.backends.wrapping import wrap

    model = wrap(zoo.make_checkpoint("llama", tiny_tokenizer), backend="native")
    d = tmp_path / "trained"
    d.mkdir()
    model.save(d)
    tiny_tokenizer.save_pretrained(str(d))
    assert main(["budget", "--model", str(d), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_params"] == numel(model.model)
