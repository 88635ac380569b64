"""Numbers the docs quote about memory at scale, recomputed from the code that plans them.

docs/scale.md: the exact sweep's per-sequence plan for the Llama-3-8B shape (bfloat16) and SmolLM2
(float32) at 128 and 4,096 tokens, the H200 example and the H100/H200 table, from
:func:`headprobe.analyses.ablation.sweep_plan` on a stand-in model with the presets' shapes (the
plan reads only the spec, the dtype and the device); the 8B weights' sizes from ``budget``'s
parameter count. docs/engine.md: the commands with ``--device-map``, from each command's parser.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from headprobe.analyses.ablation import sweep_plan
from headprobe.cli import build_parser
from headprobe.commands import COMMANDS
from headprobe.probe.backends.base import LoadedModel
from headprobe.probe.core import memory
from headprobe.probe.layout.cost import MODEL_SHAPES, forward_sequence_bytes, model_params, preset
from headprobe.probe.layout.spec import ModelSpec

ROOT = Path(__file__).resolve().parents[1]
MIB, GIB = 2**20, 2**30
SCALE = (ROOT / "docs" / "scale.md").read_text(encoding="utf-8")


@pytest.fixture(autouse=True)
def _room_for_any_budget(monkeypatch):
    """The plans here are sizes, not this machine's: a stated budget above its free memory is
    refused (:func:`~headprobe.probe.core.memory.within_free`), so the free memory reads as 1 PiB."""
    monkeypatch.setattr(memory, "free_bytes", lambda device: 1 << 50)


def _model(name: str, d_vocab: int, dtype: torch.dtype) -> LoadedModel:
    """A model with the preset's shape as :func:`sweep_plan` reads it (its spec with the preset's MLP
    width, dtype and device), without its weights: one 1 x 1 layer in ``dtype`` on the CPU stands in
    for them."""
    model = object.__new__(LoadedModel)
    model.model, model._main_device = torch.nn.Linear(1, 1, bias=False, dtype=dtype), None
    d_mlp = MODEL_SHAPES[name].d_mlp
    model.spec = ModelSpec(name, name, preset(name), d_vocab, 8192, str(dtype), d_mlp=d_mlp)
    return model


LLAMA = ("llama3-8b", 128256, torch.bfloat16)  # meta-llama/Meta-Llama-3-8B's config.json
SMOL = ("smollm2-135m", 49152, torch.float32)


def _plan(which, seq_len: int, budget: int = 1 << 50) -> memory.BatchPlan:
    memory.set_budget(budget)
    try:
        m = _model(*which)
        return sweep_plan(m, 8, seq_len, m.spec.n_layers)
    finally:
        memory.set_budget(None)


def _shown(value: float, text: str) -> bool:
    """``text`` is ``value`` rounded to as many decimals as ``text`` has."""
    decimals = len(text.split(".")[1]) if "." in text else 0
    return f"{value:.{decimals}f}" == text


def _find(pattern: str) -> tuple[str, ...]:
    m = re.search(pattern, re.sub(r"\s+", " ", SCALE))
    assert m is not None, f"docs/scale.md no longer says {pattern!r}"
    return m.groups()


@pytest.mark.usefixtures("no_stated_budget")
def test_the_sweeps_planned_sequence_sizes_are_the_planners():
    big, logits, ratio, smol, big_4k, smol_4k = _find(
        r"is then (\S+) MiB for the 8B shape in bfloat16 \((\S+) MiB of it the float32 logits .*?; (\S+) MiB with "
        r"the MLP taken as 4 x d_model\) and (\S+) MiB for SmolLM2 in float32; at 4,096 tokens (\S+) GiB and (\S+) GiB"
    )
    assert _shown(_plan(LLAMA, 128).per_item / MIB, big)
    assert _shown(8 * 127 * 128256 / MIB, logits)  # float32 logits and their log-softmax at P = T - 1
    lay = preset("llama3-8b")
    assert _shown(forward_sequence_bytes(lay, 128, 128256, 2, 127, d_mlp=4 * 4096, streams=3) / MIB, ratio)
    assert _shown(_plan(SMOL, 128).per_item / MIB, smol)
    assert _shown(_plan(LLAMA, 4096).per_item / GIB, big_4k)
    assert _shown(_plan(SMOL, 4096).per_item / GIB, smol_4k)
    (held,) = _find(r"the 80% default would hold (\d+) sequences per pass at 8 x 128 tokens")
    p = _plan(LLAMA, 128)
    assert p.fixed == 256 * MIB and (int(0.8 * 124 * GIB) - p.fixed) // p.per_item == int(held)


@pytest.mark.usefixtures("no_stated_budget")
@pytest.mark.parametrize("free_gib, column", [(124, 2), (63, 3)])
def test_the_h100_and_h200_table_is_the_planners(free_gib, column):
    rows = re.findall(r"^  \| ([\d,]+) \| (\S+) (MiB|GiB) \| (.*?) \| (.*?) \|$", SCALE, re.M)
    assert [r[0] for r in rows] == ["128", "1,024", "4,096"]
    for tokens, size, unit, *cells in rows:
        T = int(tokens.replace(",", ""))
        per = _plan(LLAMA, T).per_item
        assert _shown(per / (MIB if unit == "MiB" else GIB), size)
        budget = int(memory.HEADROOM * free_gib * GIB)
        n = (budget - 256 * MIB) // per
        cell = cells[column - 2]
        assert int(re.match(r"(\d+):", cell).group(1)) == n, cell
        if n < 8:  # fewer sequences than one head's ablation of the batch: the plan refuses
            assert "refused" in cell
            with pytest.raises(Exception, match="exact ablation sweep"):
                _plan(LLAMA, T, budget)
            continue
        plan = _plan(LLAMA, T, budget)
        heads = min(plan.items, 8 * 32) // 8
        said = re.search(r"(\d+) heads? a pass", cell)
        assert said is not None and int(said.group(1)) == heads, cell


@pytest.mark.usefixtures("no_stated_budget")
def test_the_gradient_scores_one_sequence_sizes_are_the_planners():
    """The 8B shape's gradient-score plan a sequence (ablate's sweep takes them in chunks, one
    sequence of which must fit; prune's Michel importance the same), as
    :func:`~headprobe.analyses.ablation.importance_plan` makes it."""
    from headprobe.analyses.ablation import importance_plan

    said = _find(
        r"the gradient scores plan (\S+) GiB a sequence at 128 tokens, (\S+) GiB at 1,024 and (\S+) GiB at 4,096"
    )
    memory.set_budget(1 << 50)  # a plan, not a refusal: the sizes whatever this machine holds
    try:
        sizes = [importance_plan(_model(*LLAMA), 8, T).per_item for T in (128, 1024, 4096)]
    finally:
        memory.set_budget(None)
    assert all(_shown(size / GIB, text) for size, text in zip(sizes, said)), (sizes, said)


@pytest.mark.usefixtures("no_stated_budget")
def test_the_float32_8b_plans_are_the_planners():
    """The 8B shape in float32 (the default ``--dtype``): the sweep's sequence sizes and what fits an
    H100's 80% of (79.65 - 29.9 - 1) GiB, and the gradient scores' sizes (walk plan8b: only bfloat16 was given)."""
    from headprobe.analyses.ablation import importance_plan

    f32 = ("llama3-8b", 128256, torch.float32)
    (free, held, *said) = _find(
        r"leave an H100 about (\S+) GiB .*?: a sweep sequence takes (\S+) MiB at 128 tokens, (\S+) GiB at 1,024 and "
        r"(\S+) GiB at 4,096 \((\d+), (\d+) and (\d+) sequences a pass: 4,096 refused\), and the gradient scores "
        r"(\S+), (\S+) and (\S+) GiB a sequence"
    )
    assert _shown(79.65 - 8_030_261_248 * 4 / GIB - 1, free)
    sizes = [_plan(f32, T).per_item for T in (128, 1024, 4096)]
    assert _shown(sizes[0] / MIB, held) and _shown(sizes[1] / GIB, said[0]) and _shown(sizes[2] / GIB, said[1])
    budget = int(memory.HEADROOM * float(free) * GIB)
    assert [(budget - 256 * MIB) // per for per in sizes] == [int(n) for n in said[2:5]]
    memory.set_budget(1 << 50)
    try:
        grads = [importance_plan(_model(*f32), 8, T).per_item for T in (128, 1024, 4096)]
    finally:
        memory.set_budget(None)
    assert all(_shown(g / GIB, text) for g, text in zip(grads, said[5:])), (grads, said)
    assert grads[2] > budget and grads[1] <= budget  # 4,096 refused, 1,024 fits once


def test_the_8b_weights_sizes():
    params = model_params(preset("llama3-8b"), MODEL_SHAPES["llama3-8b"]).total  # budget's whole-model count
    assert params == 8_030_261_248  # tests/test_budget_rows.py's hand count
    f32, bf16 = _find(r"that is (\S+) GiB of float32 weights .*? against (\S+) GiB after it in bfloat16")
    assert _shown(params * 4 / GIB, f32) and _shown(params * 2 / GIB, bf16)
    assert math.isclose(memory.HEADROOM, 0.8)


def _flags(command: str) -> set[str]:
    parser = build_parser(command)
    sub = next(a for a in parser._actions if isinstance(getattr(a, "choices", None), dict)).choices[command]
    return {flag for action in sub._actions for flag in action.option_strings}


def test_engine_md_lists_the_commands_with_a_device_map():
    text = re.sub(r"\s+", " ", (ROOT / "docs" / "engine.md").read_text(encoding="utf-8"))
    said = re.search(r"`--max-memory DEVICE=SIZE,\.\.\.` \(on (.*?); not on (.*?);", text)
    assert said is not None, "docs/engine.md no longer says which commands take --device-map and which do not"
    on, off = said.groups()
    named = lambda s: set(re.findall(r"`([a-z]+)`", s))
    have = {c for c in COMMANDS.names() if "--device-map" in _flags(c)}
    assert named(on) == have and named(off) == set(COMMANDS.names()) - have
