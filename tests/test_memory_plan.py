"""Batch sizes planned from the memory budget: the per-sequence estimate by a hand count, the batch
chosen under a stated budget equal to the formula, the one-line refusal before any output folder,
and batching that does not change a number (sweeps and control sets equal across batch sizes)."""

from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pandas as pd
import pytest
import torch

from headprobe.analyses.ablation import (
    STORED_ACTIVATION_BYTES,
    exact_sweep,
    set_ablation_losses,
    set_plan,
    sweep_plan,
)
from headprobe.cli import main
from headprobe.probe.core import memory
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout.attention import AttentionLayout
from headprobe.probe.layout.cost import backward_sequence_bytes, forward_sequence_bytes

pytestmark = pytest.mark.usefixtures("no_stated_budget")


def test_parse_bytes():
    assert memory.parse_bytes("4GiB") == 4 * 2**30
    assert memory.parse_bytes("500 MB") == 500 * 10**6
    assert memory.parse_bytes("1.5KiB") == 1536
    assert memory.parse_bytes("1000") == 1000
    for bad in ("4 gigs", "-1GiB", "0", "GiB"):
        with pytest.raises(HeadprobeError):
            memory.parse_bytes(bad)


def test_forward_sequence_bytes_hand_count():
    layout = AttentionLayout(d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_head=4, bytes_per_element=4)
    # per token: (4 + 3 streams) * 8 + (2 + 2 * 1) * 4 + 3 * 32 (MLP 4 * 8) = 56 + 16 + 96 = 168 numbers
    # 3 tokens * 4 bytes * 168 = 2016; one layer's float32 weights 4 * 2 * 3 * 3 = 72; logits 2 * 4 * 2 * 10 = 160
    assert forward_sequence_bytes(layout, 3, 10, 4, logit_positions=2, streams=3) == 2016 + 72 + 160
    assert forward_sequence_bytes(layout, 3, 10, 2, d_mlp=8) == 3 * 2 * (32 + 16 + 24) + 72 + 2 * 4 * 3 * 10


def test_free_bytes_reads_the_kernel():
    free = memory.free_bytes("cpu")
    with open("/proc/meminfo") as f:
        kernel = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert abs(free - kernel) < 2**28  # read a moment apart
    total, source = memory.budget("cpu")
    assert source.startswith("80% of") and abs(total - memory.HEADROOM * free) < 2**28


def test_free_cuda_memory_counts_the_allocators_unused_blocks(monkeypatch, no_stated_budget):
    """On CUDA, blocks PyTorch's caching allocator holds but no tensor uses are free for the next
    batch: they are released (empty_cache on that device) before the driver's free memory is read
    (fakes of the torch.cuda calls; a fake driver whose free memory grows by the released cache)."""
    import contextlib

    import torch

    calls, cache = [], {"held": 30 * 2**30}

    def empty_cache():
        calls.append(("empty_cache", None))
        cache["held"] = 0

    monkeypatch.setattr(torch.cuda, "device", lambda d: calls.append(("device", d)) or contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda d: (calls.append(("info", d)) or 40 * 2**30 - cache["held"], 141 * 2**30)
    )
    assert memory.free_bytes("cuda") == 40 * 2**30
    assert [c[0] for c in calls] == ["device", "empty_cache", "info"] and calls[0][1] == torch.device("cuda")
    cache["held"] = 30 * 2**30
    total, source = memory.budget(torch.device("cuda", 1))
    assert total == int(memory.HEADROOM * 40 * 2**30) and source == "80% of 40 GiB free on cuda:1"


def test_sweep_plan_equals_formula(tiny_llama_gqa_native, monkeypatch):
    model = tiny_llama_gqa_native
    spec, e = model.spec, model.dtype.itemsize
    B, T, L = 3, 17, spec.n_layers
    mlp = 128  # the tiny Llama's intermediate_size (tests/conftest.py), which the plans read (spec.d_mlp)
    per = forward_sequence_bytes(spec.layout, T, spec.d_vocab, e, logit_positions=T - 1, d_mlp=mlp, streams=3)
    kept = min(STORED_ACTIVATION_BYTES, B * T * L * (2 * spec.d_model + spec.n_heads * spec.d_head) * e)
    monkeypatch.setenv(memory.BUDGET_ENV, "3MiB")
    plan = sweep_plan(model, B, T, L)
    assert plan.items == min((3 * 2**20 - kept) // per, B * spec.n_heads) and plan.budget == 3 * 2**20
    assert plan.total == kept + plan.items * per  # the bytes a full pass holds
    assert "$HEADPROBE_MEMORY_BUDGET" in plan.source
    memory.set_budget("1MiB")  # the setting wins over the environment
    assert sweep_plan(model, B, T, L).items == (2**20 - kept) // per
    assert sweep_plan(model, B, T, L, max_batch=5).items == 5
    per_set = forward_sequence_bytes(spec.layout, T, spec.d_vocab, e, d_mlp=mlp, streams=1)
    assert set_plan(model, B, T).items == 2**20 // per_set
    memory.set_budget("1GiB")  # room for far more than a pass can use: one layer's heads on the batch
    assert sweep_plan(model, B, T, L).items == B * spec.n_heads
    memory.set_budget(kept + B * per - 1)  # one byte short of one ablation of the batch
    with pytest.raises(HeadprobeError, match="working memory"):
        sweep_plan(model, B, T, L)


def test_sweep_equal_across_batch_sizes(tiny_llama_gqa_native):
    model = tiny_llama_gqa_native
    tokens = torch.randint(1, model.spec.d_vocab, (3, 12), generator=torch.Generator().manual_seed(0))
    one = exact_sweep(model, tokens, max_batch=3)  # one ablation per pass
    every = exact_sweep(model, tokens, max_batch=3 * 64)  # every head of a layer in one pass
    memory.set_budget("64MiB")
    planned = exact_sweep(model, tokens)
    assert torch.equal(one.loss, every.loss) and torch.equal(one.loss, planned.loss)
    sets = [[(0, 1)], [(1, 2), (0, 3)], [(1, 7)], [(0, 0), (1, 0)]]
    a = set_ablation_losses(model, tokens, sets, "zero", None, 1, max_batch=3)
    b = set_ablation_losses(model, tokens, sets, "zero", None, 1, max_batch=12)
    assert torch.equal(a, b)


SMALL = ["--seq-len", "16", "--n-natural", "3", "--n-repeated", "2", "--period", "6", "--device", "cpu"]


def _errors(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("headprobe: error: ")]


def _text(tmp_path):
    p = tmp_path / "text.txt"
    p.write_text(" ".join(f"t{i % 97}" for i in range(2000)))
    return str(p)


def test_ablate_refuses_before_the_folder(tiny_dir, tmp_path, capsys):
    out = tmp_path / "ablate"
    with pytest.raises(SystemExit) as e:
        raise SystemExit(
            main(
                [
                    "ablate",
                    "--model",
                    str(tiny_dir),
                    "--out",
                    str(out),
                    "--text",
                    _text(tmp_path),
                    *SMALL,
                    "--memory-budget",
                    "4KiB",
                ]
            )
        )
    err = _errors(capsys)
    assert e.value.code == 2 and len(err) == 1 and "working memory" in err[0] and "stated budget 4 KiB" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("command", ["ablate", "scan", "circuit"])
@pytest.mark.parametrize("how", ["flag", "environment"])
def test_a_budget_above_the_free_memory_is_refused_by_every_command(
    command, how, tiny_dir, tmp_path, capsys, monkeypatch
):
    """``ablate --memory-budget 40GiB`` with 22 GiB free was planned to 40 GiB without a word and
    then ran out of memory (walk-gpu trip 5), while circuit refused it: now every command refuses a
    stated budget (flag or $HEADPROBE_MEMORY_BUDGET) above the free memory, in one line naming both,
    before the output folder (the machine's free memory said to be 512 MiB)."""
    monkeypatch.setattr(memory, "free_bytes", lambda device: 512 * 2**20)
    out = tmp_path / command
    stated = ["--memory-budget", "1GiB"] if how == "flag" else []
    if how == "environment":
        monkeypatch.setenv(memory.BUDGET_ENV, "1GiB")
    if command == "circuit":
        argv = [command, "--model", str(tiny_dir), "--verify", "0", "--steps", "1", "--period", "6", "--device", "cpu"]
    else:
        argv = [command, "--model", str(tiny_dir), "--text", _text(tmp_path), *SMALL]
    assert main([*argv, "--out", str(out), *stated]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and "1 GiB" in err[0] and "is more than the 512 MiB free on cpu" in err[0], err
    assert ("$HEADPROBE_MEMORY_BUDGET" in err[0]) == (how == "environment"), err
    default = (
        "409.6 MiB: 80% of the free memory, at most 1 GiB on a CPU"
        if command == "circuit"
        else "80% of the free memory, 409.6 MiB"
    )
    assert f"or leave it out ({default})" in err[0], err
    assert not out.exists() or not any(out.iterdir())
    monkeypatch.setattr(memory, "free_bytes", lambda device: 2 * 2**30)  # 1 GiB within 2 GiB free: it runs
    assert main([*argv, "--out", str(out), *stated, "--formats", "none"]) == 0


def test_ablate_header_prints_the_plan(tiny_dir, tmp_path, capsys):
    """The sweep's plan and its gradient scores' (the plan that binds at 8B and 1,024 tokens, said
    only when it refused before: walk plan8b), each the larger per-sequence estimate of the two tasks."""
    from headprobe.analyses.ablation import importance_plan
    from headprobe.commands.ablate_core import GRADIENT_WORK
    from headprobe.probe.backends.loading import load_model

    model = load_model(str(tiny_dir), device="cpu")
    expect = sweep_plan  # the header's plan: the larger per-sequence estimate of the two tasks
    memory.set_budget("2MiB")
    plans = [expect(model, 3, 16, model.spec.n_layers), expect(model, 2, 13, model.spec.n_layers)]
    line = max(plans, key=lambda p: p.per_item).line()
    grads = [importance_plan(model, 3, 16, "zero", GRADIENT_WORK), importance_plan(model, 2, 13, "zero", GRADIENT_WORK)]
    gradient_line = max(grads, key=lambda p: p.per_item).line()
    out = tmp_path / "ablate"
    assert (
        main(
            [
                "ablate",
                "--model",
                str(tiny_dir),
                "--out",
                str(out),
                "--text",
                _text(tmp_path),
                *SMALL,
                "--memory-budget",
                "2MiB",
                "--heads",
                "0.1",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert line in lines and gradient_line in lines and lines.index(gradient_line) == lines.index(line) + 1


def test_scan_header_says_how_many_control_sets_a_pass_holds(tiny_dir, tmp_path, capsys):
    """The control-set plan counts sequences; the header also says how many sets of the task's
    batch that is (the larger per-sequence estimate of the two tasks, set_plan's)."""
    from headprobe.analyses.ablation import set_plan
    from headprobe.probe.backends.loading import load_model

    model = load_model(str(tiny_dir), device="cpu")
    memory.set_budget("2MiB")
    (b, plan) = max(((b, set_plan(model, b, t)) for b, t in ((2, 13), (3, 16))), key=lambda x: x[1].per_item)
    args = ["scan", "--model", str(tiny_dir), "--out", str(tmp_path / "s"), "--text", _text(tmp_path), *SMALL]
    assert (
        main([*args, "-k", "2", "--n-random", "2", "--keep-n-random", "--memory-budget", "2MiB", "--no-metrics"]) == 0
    )
    want = f"{plan.line()}: {plan.items // b} control sets of {b} sequences per pass"
    assert want in capsys.readouterr().out and plan.items // b >= 1


def test_scan_header_and_refusal_hold_at_the_default_lengths(tiny_dir, tmp_path, capsys):
    """Without --seq-len and --period the control-set plan read the unresolved None lengths: no header,
    and a budget below one set's ablation was not refused before the run. Reference: set_plan at the
    lengths summary.json records for the run."""
    from headprobe.analyses.ablation import set_plan
    from headprobe.probe.backends.loading import load_model

    base = ["scan", "--model", str(tiny_dir), "--text", _text(tmp_path), "--n-natural", "3", "--n-repeated", "2"]
    base += ["--device", "cpu", "-k", "2", "--n-random", "2", "--keep-n-random", "--no-metrics"]
    assert main([*base, "--out", str(tmp_path / "s"), "--memory-budget", "8MiB"]) == 0
    out = capsys.readouterr().out
    cfg = json.loads((tmp_path / "s" / "summary.json").read_text())["config"]
    model = load_model(str(tiny_dir), device="cpu")
    memory.set_budget("8MiB")
    shapes = ((2, int(model.prepend_bos) + 2 * cfg["period"]), (3, cfg["seq_len"]))
    b, plan = max(((b, set_plan(model, b, t)) for b, t in shapes), key=lambda x: x[1].per_item)
    assert f"{plan.line()}: {plan.items // b} control sets of {b} sequences per pass" in out, out
    # a budget below one sequence's ablation pass (but above the scoring forwards) is refused before the folder
    small = f"{max(plan.fixed + plan.per_item // 2, 1)}B"
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main([*base, "--out", str(tmp_path / "t"), "--memory-budget", small]))
    err = _errors(capsys)
    assert e.value.code == 2 and len(err) == 1 and not (tmp_path / "t").exists(), err


def test_kv_refuses_before_the_folder(tiny_dir, tmp_path, capsys):
    out = tmp_path / "kv"
    with pytest.raises(SystemExit) as e:
        raise SystemExit(
            main(
                [
                    "kv",
                    "--model",
                    str(tiny_dir),
                    "--out",
                    str(out),
                    "--text",
                    _text(tmp_path),
                    "--seq-len",
                    "64",
                    "--device",
                    "cpu",
                    "--memory-budget",
                    "64KiB",
                ]
            )
        )
    err = _errors(capsys)
    assert e.value.code == 2 and len(err) == 1 and "kv's forwards" in err[0] and not out.exists()


def test_bad_budget_is_one_line(tiny_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        raise SystemExit(
            main(["scan", "--model", str(tiny_dir), "--out", str(tmp_path / "s"), "--memory-budget", "lots"])
        )
    err = _errors(capsys)
    assert e.value.code == 2 and len(err) == 1 and "is not a size" in err[0]


ENV_BUDGET_COMMANDS = {  # every command with --memory-budget that loads a model, with the least it runs on
    "scan": [],
    "ablate": [],
    "prune": [],
    "patch": [],
    "circuit": [],
    "kv": [],
    "robustness": [],
    "show": ["--head", "0.0", "--prompt", "a b c"],
    "import": ["--heads-file", "heads.csv"],
}


@pytest.mark.parametrize("command", [*ENV_BUDGET_COMMANDS, "diff", "atlas"])
def test_bad_environment_budget_is_refused_before_the_load(command, tiny_dir, tmp_path, capsys, monkeypatch):
    """``HEADPROBE_MEMORY_BUDGET=lots`` was refused only once the model had loaded (walk-gpu trip 4),
    while ``--memory-budget lots`` is refused at once: now both in the settings' preflight, one line,
    no model loaded (a load here raises ``model loaded``), no output folder."""
    from headprobe.probe.backends import loading

    def no_load(*args, **kwargs):
        raise HeadprobeError("model loaded")

    monkeypatch.setattr(loading, "load_model", no_load)
    monkeypatch.setenv(memory.BUDGET_ENV, "lots")
    out, model = tmp_path / "o", str(tiny_dir)
    if command == "diff":
        argv = ["diff", model, model]
    elif command == "atlas":
        argv = ["atlas", "--models", model, model]
    else:
        argv = [command, "--model", model, *ENV_BUDGET_COMMANDS[command]]
    assert main([*argv, *(["--out", str(out)] if command != "import" else [])]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and "$HEADPROBE_MEMORY_BUDGET 'lots' is not a size" in err[0], err
    assert not out.exists()


def test_kv_splits_its_batch_to_the_budget_and_keeps_its_numbers(tiny_dir, tmp_path, capsys):
    """A budget between one sequence and the whole batch: kv runs in parts of the size the
    formula gives, says so in its header, and writes the numbers of the run in one batch."""
    import json

    import pandas as pd

    from headprobe.commands.kv import KVConfig
    from headprobe.commands.kv_core import forward_plan
    from headprobe.probe.backends.loading import load_model

    flags = ["--text", _text(tmp_path), "--seq-len", "64", "--n-natural", "4", "--device", "cpu", "--n-random", "1"]
    model = load_model(str(tiny_dir), device="cpu")
    cfg = KVConfig(model=str(tiny_dir), seq_len=64, n_natural=4, n_random=1)
    per = forward_plan(model, cfg).per_item
    memory.set_budget(2 * per + per // 2)
    plan = forward_plan(model, cfg)
    assert plan.items == 2 and plan.per_item == per  # (2.5 x per) // per, below the batch of 4
    memory.set_budget(None)
    summaries = {}
    for name, budget in (("whole", []), ("parts", ["--memory-budget", str(2 * per + per // 2)])):
        out = tmp_path / name
        assert main(["kv", "--model", str(tiny_dir), "--out", str(out), *flags, *budget]) == 0
        summaries[name] = json.loads((out / "summary.json").read_text())
        printed = capsys.readouterr().out
        assert ("batch: 2 sequences per pass for kv's forwards" in printed) == (name == "parts")
    for key in ("full", "chosen"):
        for k, v in summaries["whole"][key].items():
            if isinstance(v, float):
                assert summaries["parts"][key][k] == pytest.approx(v, abs=1e-6), (key, k)
    assert summaries["parts"]["full_groups"] == summaries["whole"]["full_groups"]
    costs = [pd.read_csv(tmp_path / name / "group_costs.csv") for name in ("whole", "parts")]
    pd.testing.assert_frame_equal(costs[1], costs[0], atol=1e-6, rtol=0)


def test_backward_sequence_bytes_hand_count():
    layout = AttentionLayout(d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_head=4, bytes_per_element=4)
    # per token and layer: 8 * 8 + 3 * (2 + 2 * 1) * 4 + 3 * 2 * 4 + 4 * 32 = 64 + 48 + 24 + 128 = 264 numbers;
    # 2 layers * (3 tokens * 4 bytes * 264 + two float32 weights 2 * 4 * 2 * 3 * 3) = 2 * (3168 + 144)
    # loss: 6 * 4 * 3 tokens * 10; one layer live: 3 * 4 * (4 * 8 + 4 * 4 + 3 * 32) + 4 * 2 * 3 * 3
    assert backward_sequence_bytes(layout, 3, 10, 4) == 2 * (3168 + 144) + 720 + (1728 + 72)


def test_prune_refuses_before_the_folder(tiny_dir, tmp_path, capsys):
    """A 20 KB budget holds no step of prune: one line before any output folder (it used to run)."""
    out = tmp_path / "prune"
    argv = ["prune", "--model", str(tiny_dir), "--out", str(out), "--text", _text(tmp_path), *SMALL]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main([*argv, "--methods", "random", "--n-seeds", "1", "--memory-budget", "20KB"]))
    err = _errors(capsys)
    assert e.value.code == 2 and len(err) == 1, err
    assert "prune's held-out natural loss (3 x 16 tokens) needs about" in err[0] and "stated budget 19.53 KiB" in err[0]
    assert not out.exists()


def test_prune_takes_its_gradient_importance_in_chunks_that_fit(tiny_dir, tmp_path, capsys):
    """Michel et al.'s importance ran forward and backward over the whole score set, so a budget
    under that pass was refused though every other step fit. Now it takes as many sequences as fit:
    a budget of two sequences' pass gives the unbounded run's curve and removal order; a budget under
    one sequence's pass is refused before the folder, naming the importance. One sequence's pass is
    ablate's (its ablation directions included: prune's plan left them out, and took a budget under it)."""
    from headprobe.analyses.ablation import importance_sequence_bytes
    from headprobe.probe.backends.loading import load_model
    from headprobe.probe.layout.cost import forward_sequence_bytes

    model = load_model(str(tiny_dir), device="cpu")
    one = importance_sequence_bytes(model, 16)
    spec = model.spec  # by hand: the backward plus the float32 directions r - z beside z, every layer
    backward = backward_sequence_bytes(spec.layout, 16, spec.d_vocab, 4, d_mlp=128)  # its intermediate_size
    assert one == backward + spec.n_layers * 16 * spec.n_heads * spec.d_head * (4 + 4)
    forward = forward_sequence_bytes(model.spec.layout, 16, model.spec.d_vocab, model.dtype.itemsize)
    assert 3 * forward < 2 * one  # the held-out forwards fit where two sequences' importance does
    argv = ["prune", "--model", str(tiny_dir), "--text", _text(tmp_path), *SMALL, "--methods", "michel"]
    argv += ["--formats", "none", "--max-fraction", "0.5"]
    out = tmp_path / "small"
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main([*argv, "--out", str(out), "--memory-budget", str(max(3 * forward, one - 1))]))
    err = _errors(capsys)
    assert e.value.code == 2 and len(err) == 1 and "prune's gradient importance (3 x 16 tokens" in err[0], err
    assert not out.exists()
    assert main([*argv, "--out", str(tmp_path / "chunks"), "--memory-budget", str(2 * one)]) == 0
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    chunks, whole = (pd.read_csv(tmp_path / d / "pruning_curve.csv") for d in ("chunks", "whole"))
    assert list(chunks["removed"]) == list(whole["removed"])
    losses = [c for c in whole.columns if c.endswith("_loss")]
    np.testing.assert_allclose(chunks[losses].to_numpy(), whole[losses].to_numpy(), rtol=1e-6)


def _peak_tensor_bytes(fn) -> int:
    """The most bytes of CPU tensors alive at once while ``fn()`` runs, above those alive before it
    (the allocation and free events of torch's profiler, summed in time order)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize(
    "settings",
    [
        {"methods": "michel,l0,random", "l0_steps": 2, "l0_lambdas": "1"},
        {"methods": "random", "save_pruned": True, "save_fraction": 0.5},
    ],
)
def test_prune_estimate_bounds_its_measured_peak(settings, tiny_dir, tmp_path, capsys):
    """The plan's largest step against the tensors a whole prune run holds at once (the profiler's
    count, after a warm-up run): an upper bound, and the header prints it."""
    from headprobe.commands.prune import PruneConfig
    from headprobe.commands.prune_core import memory_plan, run
    from headprobe.probe.backends.loading import load_model

    model = load_model(str(tiny_dir), device="cpu")
    small = {"n_natural": 3, "seq_len": 16, "n_repeated": 2, "period": 6, "n_seeds": 1, "step_fraction": 0.5}
    cfg = PruneConfig(model=str(tiny_dir), text=_text(tmp_path), **small, **settings)
    plan = _plan_bounds_its_measured_peak(memory_plan, run, model, cfg)
    out = tmp_path / "prune"
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in settings.items()]
    argv = ["prune", "--model", str(tiny_dir), "--out", str(out), "--text", _text(tmp_path), *SMALL, "--n-seeds", "1"]
    assert main([*argv, "--step-fraction", "0.5", *flags, "--memory-budget", "64MiB"]) == 0
    assert plan.line() in capsys.readouterr().out


def _plan_bounds_its_measured_peak(memory_plan, run, model, cfg):
    """``memory_plan(model, cfg)`` under a 64 MiB budget, checked as an upper bound within 10x of the
    tensors ``run(model, cfg)`` holds at once (the profiler's count, after a warm-up run); the plan."""
    memory.set_budget("64MiB")  # the header's source is the same text in the plan and the run
    plan = memory_plan(model, cfg)
    estimate = plan.total
    run(model, cfg, progress=False)  # the first run's one-off allocations are not working memory
    peak = _peak_tensor_bytes(lambda: run(model, cfg, progress=False))
    assert peak <= estimate < 10 * peak, (peak, estimate, plan.what)
    return plan


ESTIMATORS = ["gradient", "attribution", "atp", "second-order"]


def _probes(method: str) -> list[str]:
    """``--n-probes 2`` where the estimator takes it (second-order); the others refuse it."""
    return ["--n-probes", "2"] if method == "second-order" else []


@pytest.mark.parametrize("method", ESTIMATORS)
def test_ablate_estimate_refuses_before_the_folder(method, tiny_dir, tmp_path, capsys):
    """A 20 KB budget holds no estimator's forward and backward: one line before any output folder."""
    out = tmp_path / "ablate"
    argv = ["ablate", "--model", str(tiny_dir), "--out", str(out), "--text", _text(tmp_path), *SMALL]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main([*argv, "--estimate", method, *_probes(method), "--memory-budget", "20KB"]))
    err = _errors(capsys)
    assert e.value.code == 2 and len(err) == 1, err
    assert f"ablate's {method} estimate (3 x 16 tokens" in err[0] and "stated budget 19.53 KiB" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize(
    "method, kind",
    [(m, k) for k in ("zero", "resample") for m in ESTIMATORS if k == "zero" or m != "gradient"],  # gradient: no kind
)
def test_ablate_estimate_bounds_its_measured_peak(method, kind, tiny_dir, tmp_path, capsys):
    """The plan of the larger task's estimate against the tensors a whole ``--estimate`` run holds at
    once (the profiler's count, after a warm-up run): an upper bound within 10x, and the header prints it."""
    from headprobe.commands.ablate import AblateConfig
    from headprobe.commands.ablate_core import memory_plan, run
    from headprobe.probe.backends.loading import load_model

    model = load_model(str(tiny_dir), device="cpu")
    cfg = AblateConfig(
        model=str(tiny_dir), text=_text(tmp_path), n_natural=3, seq_len=16, n_repeated=2, period=6,
        estimate=method, n_probes=2, kind=kind,
    )  # fmt: skip
    plan = _plan_bounds_its_measured_peak(memory_plan, run, model, cfg)
    out = tmp_path / "ablate"
    argv = ["ablate", "--model", str(tiny_dir), "--out", str(out), "--text", _text(tmp_path), *SMALL]
    kinds = ["--kind", kind] if method != "gradient" else []  # gradient takes no --kind: given, it is refused
    assert main([*argv, "--estimate", method, *_probes(method), *kinds, "--memory-budget", "64MiB"]) == 0
    assert plan.line() in capsys.readouterr().out


def test_ablate_sweep_takes_its_gradient_scores_in_chunks_that_fit(tiny_dir, tmp_path, capsys):
    """The sweep's gradient scores ran forward and backward over each task's whole batch, so a budget
    that held the sweep but not that pass was refused (Llama-3-8B at 8 x 1,024 tokens: 8 x 18.6 GiB).
    Now they take as many sequences as fit: a budget of two sequences' pass runs the 3-sequence task
    in chunks and gives the unbounded run's scores; a budget under one sequence's pass (but over the
    sweep's) is refused before the folder, naming the gradient scores."""
    from headprobe.analyses.ablation import sweep_plan
    from headprobe.analyses.attribution import estimate_plan
    from headprobe.probe.backends.loading import load_model

    model = load_model(str(tiny_dir), device="cpu")
    shapes = [(3, 16), (2, 2 * 6 + 1)]  # the tasks' batches: --seq-len counts BOS; a repeat of period 6 and BOS
    sweep_need = max(p.fixed + b * p.per_item for b, t in shapes for p in [sweep_plan(model, b, t, 2)])
    one = max(estimate_plan(model, "gradient", b, t).per_item for b, t in shapes)
    whole = max(p.fixed + b * p.per_item for b, t in shapes for p in [estimate_plan(model, "gradient", b, t)])
    assert sweep_need < one and 2 * one < whole  # budgets between them exist
    argv = ["ablate", "--model", str(tiny_dir), "--text", _text(tmp_path), *SMALL, "--formats", "none"]
    out = tmp_path / "small"
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main([*argv, "--out", str(out), "--memory-budget", str((sweep_need + one) // 2)]))
    err = _errors(capsys)
    assert e.value.code == 2 and len(err) == 1 and "the sweep's gradient scores (3 x 16 tokens" in err[0], err
    assert not out.exists()
    assert main([*argv, "--out", str(tmp_path / "chunks"), "--memory-budget", str(2 * one)]) == 0
    assert main([*argv, "--out", str(tmp_path / "whole")]) == 0
    chunks, whole_run = (pd.read_csv(tmp_path / d / "head_ablation.csv") for d in ("chunks", "whole"))
    cols = [c for c in whole_run.columns if "gradient" in c or "attribution" in c]
    assert cols and whole_run[cols].notna().all().all()
    np.testing.assert_allclose(chunks[cols].to_numpy(), whole_run[cols].to_numpy(), rtol=1e-5, atol=1e-7)


def _patch_prompts(tmp_path, n: int = 6) -> str:
    """Prompt pairs for the tiny tokenizer (t0..t99), of two lengths."""
    import json

    lines = []
    for i in range(n):
        length = 6 if i % 2 else 9
        clean = " ".join(f"t{(7 * i + j) % 100}" for j in range(length))
        corrupted = " ".join(f"t{(13 * i + 3 * j + 1) % 100}" for j in range(length))
        lines.append(json.dumps({"clean": clean, "corrupted": corrupted, "correct": f" t{i}", "wrong": f" t{i + 50}"}))
    p = tmp_path / "pairs.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def test_patch_refuses_before_the_folder(tiny_dir, tmp_path, capsys):
    """A 20 KB budget holds no step of patching: one line before any output folder (it used to run)."""
    out = tmp_path / "patch"
    argv = ["patch", "--model", str(tiny_dir), "--out", str(out), "--prompts", _patch_prompts(tmp_path)]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main([*argv, "--device", "cpu", "--memory-budget", "20KB"]))
    err = _errors(capsys)
    assert e.value.code == 2 and len(err) == 1, err
    assert "patching's" in err[0] and "6 x 10 tokens" in err[0] and "stated budget 19.53 KiB" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("site", ["z", "k", "resid"])
def test_patch_estimate_bounds_its_measured_peak(site, tiny_dir, tmp_path, capsys):
    """The plan of patching's larger step (the capture or a patched pass) against the tensors a whole
    patching run holds at once (the profiler's count, after a warm-up run): an upper bound within
    10x, and the header prints it."""
    from headprobe.commands.patch import PatchConfig, memory_plan, run
    from headprobe.probe.backends.loading import load_model

    model = load_model(str(tiny_dir), device="cpu")
    prompts = _patch_prompts(tmp_path)
    cfg = PatchConfig(model=str(tiny_dir), prompts=prompts, site=site)
    plan = _plan_bounds_its_measured_peak(memory_plan, run, model, cfg)
    out = tmp_path / "patch"
    argv = ["patch", "--model", str(tiny_dir), "--out", str(out), "--prompts", prompts, "--site", site]
    assert main([*argv, "--device", "cpu", "--memory-budget", "64MiB"]) == 0
    assert plan.line() in capsys.readouterr().out


@pytest.mark.parametrize("site", ["z", "k", "resid"])
def test_patched_pass_holds_each_source_once(site, tiny_llama_gqa_native, monkeypatch):
    """One patched pass of every unit of both layers reads each layer's corrupted source (and, for
    k/v, clean z) once through a broadcast view: the tensors alive at once (the profiler's count,
    after a warm-up) are at least half the per-unit copies fewer than in the pass that repeated them
    (the old hooks, tests/test_patch.py's reference), and the plan's per-sequence term is the
    forward plus the hook's patched copy alone (it counted the copies too)."""
    from test_patch import _repeated_unit_hooks

    from headprobe.analyses import patching
    from headprobe.analyses.patching import PromptPair, pass_plans, patch, site_width

    model = tiny_llama_gqa_native
    spec, e = model.spec, model.dtype.itemsize
    words = [" ".join(f"t{(7 * i + 3 * j + k) % 100}" for j in range(9)) for i in range(4) for k in (0, 1)]
    pairs = [PromptPair(words[2 * i], words[2 * i + 1], f" t{i}", f" t{i + 50}") for i in range(4)]
    units = (
        [(l, h) for l in range(2) for h in range(spec.n_heads)]
        if site != "resid"
        else [(l, p) for l in range(2) for p in range(8)]
    )
    memory.set_budget("64MiB")
    B, T = patching.encode_pairs(model, pairs, "left")[0].clean.shape
    held = site_width(spec, site) + (spec.n_heads * spec.d_head if site in ("k", "v") else 0)
    per = pass_plans(model, B, T, site, 2, max_batch=B * len(units))[1].per_item
    positions = T if model.residual_with_logits else 1  # the native backend unembeds the answer position only
    fwd = forward_sequence_bytes(spec.layout, T, spec.d_vocab, e, logit_positions=positions, d_mlp=128)  # its MLP width
    assert per == fwd + T * held * e

    def run():
        return patch(model, pairs, site, units, max_batch=B * len(units))

    assert run().n_forward == 2  # the capture and one pass of every unit
    peak = _peak_tensor_bytes(run)
    monkeypatch.setattr(patching, "_unit_hooks", _repeated_unit_hooks)
    repeated = _peak_tensor_bytes(run)
    copies = 2 * len(units) * B * T * held * e  # each layer's source, once per unit of the pass
    assert repeated - peak >= copies // 2, (peak, repeated, copies)


@pytest.mark.parametrize("kind", ["zero", "mean"])
def test_ablate_forwards_beside_the_estimates_bound_their_peaks(kind, tiny_dir, tmp_path):
    """The induction score's forward over the repeated task and, for mean ablation, the mean-z
    capture over the other natural windows each have a plan in ablate's (the largest step is picked
    by total): each bounds the tensors its step holds at once (the profiler's count, after a
    warm-up), within 10x, and neither exceeds the plan a run is checked against."""
    from headprobe.analyses.ablation import capture_z, mean_z_from
    from headprobe.commands.ablate import AblateConfig
    from headprobe.commands.ablate_core import _forward_plans, _induction_score, _task_sets, memory_plan
    from headprobe.probe.backends.loading import load_model

    model = load_model(str(tiny_dir), device="cpu")
    cfg = AblateConfig(
        model=str(tiny_dir), text=_text(tmp_path), n_natural=3, seq_len=16, n_repeated=2, period=6,
        estimate="gradient", kind=kind,
    ).resolved(model.spec, model.trained_periods)  # fmt: skip
    memory.set_budget("64MiB")
    plans = {p.what.split(" (")[0]: p for p in _forward_plans(model, cfg)}
    assert sorted(plans) == ["ablate's induction score"] + (["ablate's mean z capture"] if kind == "mean" else [])
    assert (
        plans["ablate's induction score"].items == 2
        and "(2 x 13 tokens, one forward)" in plans["ablate's induction score"].what
    )
    natural, repeated = _task_sets(model, cfg)[:2]
    steps = {"ablate's induction score": lambda: _induction_score(model, repeated)}
    if kind == "mean":  # as _task_sets: over the natural windows the task does not score
        steps["ablate's mean z capture"] = lambda: mean_z_from(capture_z(model, natural.tokens[3:]), natural.start)
    for name, step in steps.items():
        step()
        peak = _peak_tensor_bytes(step)
        assert peak <= plans[name].total < 10 * peak, (name, peak, plans[name].total)
        assert plans[name].total <= memory_plan(model, cfg).total


def test_scan_refuses_a_budget_its_scoring_forward_exceeds(tiny_dir, tmp_path, capsys):
    """Without verification scan had no plan: a budget below its natural-text scoring forward (3 x 16
    tokens) ran on. Now refused in one line, naming the step, before any output folder."""
    out = tmp_path / "scan"
    argv = ["scan", "--model", str(tiny_dir), "--out", str(out), "--text", _text(tmp_path), *SMALL]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main([*argv, "--no-verify", "--no-metrics", "--memory-budget", "100KB"]))
    err = _errors(capsys)
    assert e.value.code == 2 and len(err) == 1, err
    assert "scan's natural-text scores (3 x 16 tokens, one forward) needs about" in err[0], err
    assert "stated budget 97.66 KiB" in err[0] and not out.exists()


def test_scan_scoring_plans_bound_their_measured_peaks(tiny_dir, tmp_path):
    """Each task's scoring forward (every detector, per-sequence scores, the natural task's mean z)
    against its plan: an upper bound within 10x of the profiler's count after a warm-up."""
    from headprobe.analyses.data import natural_text_tokens, open_text_file, repeated_random_tokens
    from headprobe.analyses.scoring import score_tokens
    from headprobe.commands.scan import ScanConfig
    from headprobe.commands.scan_core import _scoring_plans, first_scored
    from headprobe.probe.backends.loading import load_model

    model = load_model(str(tiny_dir), device="cpu")
    memory.set_budget("64MiB")
    cfg = ScanConfig(model=str(tiny_dir), seq_len=16, n_natural=3, n_repeated=2, period=6)
    natural_plan, repeated_plan = _scoring_plans(model, cfg)
    natural = natural_text_tokens(model, 3, 16, 0, open_text_file(_text(tmp_path)))
    repeated = repeated_random_tokens(model, 2, 6, 0)
    for plan, tokens, task in ((natural_plan, natural, "natural"), (repeated_plan, repeated, "repeated")):
        first = first_scored(task, tokens.start, tokens.period)

        def step(tokens=tokens, task=task, first=first):
            score_tokens(model, tokens, task, first, mean_z=task == "natural", per_sequence={})

        step()
        peak = _peak_tensor_bytes(step)
        assert plan.items == tokens.tokens.shape[0] and f"x {tokens.tokens.shape[1]} tokens" in plan.what
        assert peak <= plan.total < 10 * peak, (task, peak, plan.total)


def test_ablate_sweep_plan_reads_the_runs_repeated_length_without_bos(tiny_dir, tmp_path):
    """On a model that prepends no BOS (``model.prepend_bos`` False: no BOS token, or loaded without)
    the repeated task is 2 * period tokens; the sweep's plan counted 2 * period + 1, a token the run
    never has. Reference: sweep_plan at the shapes of the run's own token sets (--period 8: the
    repeated task's plan, with that extra token, is the larger and the one the header printed)."""
    from headprobe.commands.ablate import AblateConfig
    from headprobe.commands.ablate_core import memory_plan, run
    from headprobe.probe.backends.loading import load_model

    model = load_model(str(tiny_dir), device="cpu", prepend_bos=False)
    assert not model.prepend_bos
    cfg = AblateConfig(
        model=str(tiny_dir), text=_text(tmp_path), n_natural=3, seq_len=16, n_repeated=2, period=8, heads="0.1"
    )
    memory.set_budget("2MiB")
    result = run(model, cfg, progress=False)
    shapes = [tuple(result.natural.tokens[:3].shape), tuple(result.repeated.tokens.shape)]
    assert shapes == [(3, 16), (2, 16)]  # two blocks of 8, no BOS
    want = max((sweep_plan(model, b, t, model.spec.n_layers) for b, t in shapes), key=lambda p: p.per_item)
    assert memory_plan(model, cfg).line() == want.line()


def _metric_steps(model, natural, needles, first: int, streaming: str) -> dict:
    """Step name (as metric_plans names it) -> the work scan_metrics does in that step."""
    from headprobe.analyses import composition
    from headprobe.analyses import metrics as M
    from headprobe.analyses.scoring import use_online_stats

    stream = use_online_stats(model, natural.tokens.shape[1], streaming)
    return {
        "copying score": lambda: composition.copying_score(model),
        "pattern metrics": lambda: M._pattern_metrics(model, natural, stream, M.LOCAL_WINDOWS, {}),
        "retrieval needles": lambda: M.retrieval_score(model, needles, stream),
        "direct logit attribution": lambda: M.direct_logit_attribution(model, natural.tokens, first).mean(dim=(0, 1)),
        "value-weighted attention": lambda: M.value_share_token0(model, natural.tokens),
        "composition scores": lambda: M.scan_composition(model),
    }


def _metric_plans_bound_their_peaks(model, text: str, n: int, T: int, streaming: str) -> dict[str, float]:
    """Each step of scan_metrics over ``n`` windows of ``T`` tokens against its plan
    (metric_plans): an upper bound within 10x of the profiler's count after a warm-up, and the
    largest plan bounds the whole of scan_metrics. Returns step -> plan / peak, and
    ``"all of scan_metrics"`` -> the largest plan / the whole's peak."""
    from headprobe.analyses import metrics as M
    from headprobe.analyses.ablation import first_scored
    from headprobe.analyses.data import natural_text_tokens, open_text_file

    memory.set_budget("64GiB")  # planned as is: the roomy fixture says 1 TiB is free
    natural = natural_text_tokens(model, n, T, 0, open_text_file(text))
    needles = M.scan_needles(model, n, T, 0, open_text_file(text))
    first = first_scored("natural", natural.start, None)  # as scan's
    plans = {p.what.removeprefix("scan's ").split(" (")[0]: p for p in M.metric_plans(model, n, T, first, streaming)}
    steps = _metric_steps(model, natural, needles, first, streaming)
    assert set(plans) <= set(steps) and {"pattern metrics", "retrieval needles", "direct logit attribution"} <= set(
        plans
    )
    ratios = {}
    for name, plan in plans.items():
        steps[name]()
        peak = _peak_tensor_bytes(steps[name])
        assert peak <= plan.total < 10 * peak, (name, peak, plan.total)
        ratios[name] = plan.total / peak

    def whole():
        M.scan_metrics(model, natural, needles, first, streaming)

    whole()
    peak = _peak_tensor_bytes(whole)
    largest = max(p.total for p in plans.values())
    assert peak <= largest, peak
    return ratios | {"all of scan_metrics": largest / peak}


@pytest.fixture
def roomy(monkeypatch):
    """1 TiB free, whatever the machine has: a stated 64 GiB budget (room for every plan) is not refused
    as above the free memory (memory.within_free)."""
    monkeypatch.setattr(memory, "free_bytes", lambda device: 2**40)


@pytest.mark.parametrize("streaming", ["off", "on"])
def test_scan_metric_plans_bound_their_measured_peaks(streaming, tiny_dir, tmp_path, roomy):
    """Each head-metric forward of scan (the pattern pass, the retrieval needles, the direct logit
    attribution's two forwards and gradient, value-weighted attention on materialised patterns) and
    the copying score's weight copies against its plan, streamed and materialised."""
    from headprobe.probe.backends.loading import load_model

    model = load_model(str(tiny_dir), device="cpu")
    ratios = _metric_plans_bound_their_peaks(model, _text(tmp_path), 3, 16, streaming)
    assert ("value-weighted attention" in ratios) == (streaming == "off")


@pytest.fixture(scope="module")
def smollm2_width(tiny_tokenizer):
    """A 2-layer random-init Llama of SmolLM2-135M's width and vocabulary (576 wide, 9 query heads
    on 3 KV heads of 64, MLP 1536, 49,152 tokens; the tiny tokenizer's ids), native backend."""
    from conftest import _checkpoint, _native
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
        intermediate_size=1536, vocab_size=49152, max_position_embeddings=512, bos_token_id=100,
        eos_token_id=100, pad_token_id=100, tie_word_embeddings=True, attn_implementation="eager",
        architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    return _native(_checkpoint(LlamaForCausalLM(cfg), tiny_tokenizer, "smollm2-width", "smollm2-width"))


@pytest.mark.parametrize("streaming", ["off", "on"])
def test_scan_metric_plans_bound_their_peaks_at_smollm2_width(streaming, smollm2_width, tmp_path, roomy):
    """As above at SmolLM2's width and vocabulary (2 x 64 tokens): the logits' and the copying
    score's [d_vocab, d_model] terms dominate there. The steps that unembed (the materialised
    pattern pass, value-weighted attention, the needles' queries) hold their logits once, no loss:
    each plan within 2x of its peak (counted as logits plus a log-softmax they were 2.19x, 2.22x
    and 2.81x)."""
    ratios = _metric_plans_bound_their_peaks(smollm2_width, _text(tmp_path), 2, 64, streaming)
    unembedding = {"retrieval needles"} | (
        {"pattern metrics", "value-weighted attention"} if streaming == "off" else set()
    )
    assert unembedding <= set(ratios)
    assert all(ratios[name] < 2 for name in unembedding), ratios


@pytest.mark.parametrize(
    ("cap", "dtype", "copies"), [(None, torch.float32, 1), (30.0, torch.float32, 3), (30.0, torch.bfloat16, 3)]
)
def test_pattern_pass_plan_counts_the_softcapped_logits_it_holds(cap, dtype, copies, tiny_tokenizer, tmp_path, roomy):
    """logit_entry_bytes on a Gemma-2 with a final logit soft-cap (``tanh(logits / c) * c``: the
    logits, their quotient and its tanh alive at once) against the profiler's peak of scan's
    materialised pattern pass, on a 32,768-token vocabulary (2 x 32 tokens) where the logits are
    nearly all of it: the plan within 10% above the peak (measured 2026-12-06: 1.043x without the
    cap, 1.014x with it, 1.018x in bfloat16; the peak 1.004 and 3.004 logit copies; a factor of 2
    for the cap gives 0.68x, 4 gives 1.35x; docs/memory.md has the RSS at larger sizes)."""
    import zoo
    from conftest import _native

    from headprobe.analyses import metrics as M
    from headprobe.analyses.data import natural_text_tokens, open_text_file

    ckpt = zoo.make_checkpoint("gemma2", tiny_tokenizer, vocab_size=32768, final_logit_softcapping=cap)
    ckpt.hf_model.to(dtype)
    model = _native(ckpt)
    assert model.model.cfg.final_softcap == cap and model.dtype == dtype
    assert model.logit_entry_bytes == dtype.itemsize * copies
    memory.set_budget("64GiB")  # planned as is: the roomy fixture says 1 TiB is free
    natural = natural_text_tokens(model, 2, 32, 0, open_text_file(_text(tmp_path)))
    (plan,) = [p for p in M.metric_plans(model, 2, 32, 1, "off") if "pattern metrics" in p.what]

    def step():
        M._pattern_metrics(model, natural, False, M.LOCAL_WINDOWS, {})

    step()
    peak = _peak_tensor_bytes(step)
    assert peak > 0.9 * copies * dtype.itemsize * 2 * 32 * 32768, peak  # the logits dominate
    assert peak <= plan.total < 1.1 * peak, (peak, plan.total, plan.total / peak)


@pytest.mark.parametrize("weights", [True, False])
def test_scan_refuses_a_budget_its_metrics_exceed(weights, tiny_dir, tmp_path, capsys, monkeypatch, roomy):
    """A budget above both scoring forwards but below a head-metric step: scan ran on (the metrics
    had no plan). Now refused in one line naming the step and --no-metrics, before any output
    folder; with --no-metrics the same budget runs. On the tiny model the copying score's weight
    copies are the largest step and come first; without them (``weights`` False, their size
    patched to 0) a forward is refused (the direct logit attribution's)."""
    from headprobe.analyses import metrics as M
    from headprobe.commands.scan import ScanConfig
    from headprobe.commands.scan_core import _scoring_plans, first_scored
    from headprobe.probe.backends.loading import load_model

    if not weights:
        monkeypatch.setattr(M, "copying_bytes", lambda spec: 0)
    model = load_model(str(tiny_dir), device="cpu")
    memory.set_budget("64GiB")  # planned as is: the roomy fixture says 1 TiB is free
    cfg = ScanConfig(model=str(tiny_dir), seq_len=16, n_natural=3, n_repeated=2, period=6)
    scoring = max(p.total for p in _scoring_plans(model, cfg))
    metrics = M.metric_plans(model, 3, 16, first_scored("natural", int(model.prepend_bos), None))
    forwards = [p for p in metrics if "composition" not in p.what]  # the weights-only composition comes last
    assert scoring < max(p.total for p in forwards)  # a budget between them exists
    budget = (scoring + max(p.total for p in forwards)) // 2
    refused = next(p for p in metrics if p.total > budget)  # the first step over it, in scan's order
    assert refused.what.startswith("scan's copying score" if weights else "scan's direct logit attribution (3 x 16")
    memory.set_budget(None)
    out = tmp_path / "scan"
    argv = ["scan", "--model", str(tiny_dir), "--out", str(out), "--text", _text(tmp_path), *SMALL, "--no-verify"]
    with pytest.raises(SystemExit) as e:
        raise SystemExit(main([*argv, "--memory-budget", str(budget)]))
    err = _errors(capsys)
    assert e.value.code == 2 and len(err) == 1, err
    assert f"{refused.what} needs about" in err[0] and err[0].endswith("or skip this step with --no-metrics"), err
    assert not out.exists()
    assert main([*argv, "--memory-budget", str(budget), "--no-metrics"]) == 0


def test_ablate_max_batch_caps_the_gradient_chunks_too(tiny_dir, tmp_path, monkeypatch):
    """``--max-batch`` (which the out-of-memory line advises) caps the gradient scores' chunks as it
    caps the sweep's passes; the scores equal an uncapped run's."""
    from headprobe.commands import ablate_core

    seen = []
    real = ablate_core.head_importance

    def spy(*args, **kwargs):
        seen.append(kwargs.get("max_batch"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ablate_core, "head_importance", spy)
    argv = ["ablate", "--model", str(tiny_dir), "--text", _text(tmp_path), *SMALL, "--formats", "none"]
    assert main([*argv, "--out", str(tmp_path / "one"), "--max-batch", "1"]) == 0
    assert seen == [1, 1]  # one chunk size per task
    assert main([*argv, "--out", str(tmp_path / "all")]) == 0
    assert seen[2:] == [3, 2]  # the tasks' whole batches fit
    one, full = (pd.read_csv(tmp_path / d / "head_ablation.csv") for d in ("one", "all"))
    cols = [c for c in full.columns if "importance" in c or "attribution" in c]
    np.testing.assert_allclose(one[cols].to_numpy(), full[cols].to_numpy(), rtol=1e-5, atol=1e-7)


def _widest_mlp_activation(model) -> int:
    """A native model's widest per-token MLP activation, read from its modules (not its config): a
    dense MLP's ``fc_out`` input width, a mixture's routed experts (``k`` of ``down``'s width) plus
    its shared expert's; 0 without MLPs."""
    from headprobe.probe.model.feedforward import MoE

    widths = [0]
    for block in model.model.blocks:
        mlp = getattr(block, "mlp", None)
        if isinstance(mlp, MoE):
            shared = 0 if mlp.shared is None else mlp.shared.fc_out.in_features
            widths.append(mlp.cfg.n_experts_per_token * mlp.down.shape[2] + shared)
        elif mlp is not None:
            widths.append(mlp.fc_out.in_features)
    return max(widths)


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral", "qwen3_moe", "qwen3_next", "llama4_text", "gpt_oss"])
def test_the_plans_read_the_models_own_mlp_width(family, tiny_tokenizer):
    """Every memory plan takes a sequence's MLP activations at the model's width (``spec.d_mlp``), a
    mixture of experts' as each token's routed and shared experts: equal to what the modules hold
    (test_sweep_plan_equals_formula: the plans use it). The plans took 4 x d_model whatever the width
    (under Qwen2.5-7B's 5.3 x, an underestimate)."""
    import zoo

    from headprobe.probe.backends.wrapping import wrap

    ckpt = zoo.make_checkpoint(family, tiny_tokenizer)
    model = wrap(ckpt, backend="native")
    assert model.spec.d_mlp == _widest_mlp_activation(model) > 0, family
    spec = model.spec
    if family == "gpt2":  # the bridge reads the same width from TransformerLens' config
        bridge = wrap(dataclasses.replace(ckpt, hf_model=copy.deepcopy(ckpt.hf_model)), backend="transformer-lens")
        assert bridge.spec.d_mlp == spec.d_mlp == 4 * spec.d_model


def test_circuits_refusal_of_a_budget_above_the_free_memory_says_what_its_default_takes(
    tiny_llama_gqa_native, monkeypatch
):
    """circuit's default on a CPU is at most 1 GiB, not 80% of the free memory as the refusal said
    (with 4 GiB free: 1 GiB, where the line promised 3.2 GiB)."""
    from headprobe.analyses.circuit import DEFAULT_BUDGET, plan_rows

    monkeypatch.setattr(memory, "free_bytes", lambda device: 4 * 2**30)
    with pytest.raises(HeadprobeError) as e:
        plan_rows(tiny_llama_gqa_native, 2, 16, budget=8 * 2**30)
    assert "or leave it out (1 GiB: 80% of the free memory, at most 1 GiB on a CPU)" in str(e.value), e.value
    assert DEFAULT_BUDGET == 2**30 and plan_rows(tiny_llama_gqa_native, 2, 16) == plan_rows(
        tiny_llama_gqa_native, 2, 16, budget=DEFAULT_BUDGET
    )  # what it says leaving the flag out takes is what the plan takes
