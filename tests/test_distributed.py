"""``torchrun --nproc-per-node 2 -m headprobe ablate`` on CPU (gloo) shards the exact
sweep over ranks and the gradient scores over batch rows, and writes the head_ablation.csv a single
process writes; a killed sharded run resumes from its per-rank checkpoints and re-does only the
missing head ablations. The reference is a one-process run of the same command."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

from headprobe.analyses import distributed
from headprobe.cli import main
from headprobe.probe.core.io import CHECKPOINT_GLOB

SMALL = [
    "--seq-len",
    "16",
    "--n-natural",
    "3",
    "--n-repeated",
    "2",
    "--period",
    "6",
    "--device",
    "cpu",
    "--kind",
    "resample",
]  # 3 and 2 rows: uneven batch shards; resample also splits the source rows
N_JOBS = 2 * 2 * 8  # tasks x layers x heads of the tiny model


def _text(tmp_path):
    words = " ".join(f"t{(7 * i * i + 3 * i) % 100}" for i in range(2000))
    p = tmp_path / "text.txt"
    p.write_text(words)
    return str(p)


def torchrun(*args, nproc=2, env=None):
    """``torchrun --nproc-per-node nproc -m headprobe ...`` with this Python; (exit code, stdout, stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    env.pop("WORLD_SIZE", None)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--standalone",
            "-m",
            "headprobe",
            *args,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    return p.returncode, p.stdout, p.stderr


@pytest.fixture(scope="module")
def one_process(tiny_dir, tmp_path_factory):
    """The reference: ``headprobe ablate`` in this (single) process; (argument list, output directory)."""
    tmp = tmp_path_factory.mktemp("one")
    args = ["--model", str(tiny_dir), "--text", _text(tmp), *SMALL]
    assert main(["ablate", *args, "--out", str(tmp / "out")]) == 0
    return args, tmp / "out"


def _assert_same_csv(a, b):
    a, b = pd.read_csv(a), pd.read_csv(b)
    assert list(a.columns) == list(b.columns) and len(a) == len(b) == N_JOBS // 2
    assert a.notna().all().all() and b.notna().all().all()  # every head swept, every score there
    # loss deltas, importance, attribution: equal to the CSV's 6 decimals
    np.testing.assert_allclose(a.to_numpy(float), b.to_numpy(float), rtol=0, atol=1e-6 + 1e-12)


def test_shards_partition_jobs_and_rows():
    jobs = [(layer, head) for layer in range(3) for head in range(5)]
    for world in (1, 2, 3, 4):
        slices = [distributed.shard_of(jobs, r, world) for r in range(world)]
        assert sorted(sum(slices, [])) == jobs and max(map(len, slices)) - min(map(len, slices)) <= 1
        for n in (0, 1, 3, 7):
            rows = [list(range(n))[distributed.batch_slice(n, r, world)] for r in range(world)]
            assert sum(rows, []) == list(range(n))  # contiguous, in order, nothing twice
    # a single process is rank 0 of 1 and never joins a group
    assert not distributed.active() and distributed.rank() == 0 and distributed.world_size() == 1
    assert distributed.all_gather_objects({"a": 1}) == [{"a": 1}]


def test_killed_sharded_run_resumes_to_the_one_process_csv(one_process, tmp_path):
    """Two torchrun launches (each ~20 s of process start-up and loading on 2 cores): one killed
    after its ranks' first checkpoints, then the resumed run, which sweeps the missing heads over
    both ranks, runs the data-parallel gradient scores on both tasks and must write the one-process
    CSV. (A fresh sharded run takes the same code path with nothing resumed.)"""
    args, ref = one_process
    cut = tmp_path / "cut"
    rc, _, _ = torchrun("ablate", *args, "--out", str(cut), env={"HEADPROBE_KILL_AFTER_SAVES": "1"})
    assert rc != 0  # a rank killed itself (SIGKILL) after its first checkpoint; torchrun stopped the other
    shards = sorted(cut.glob(CHECKPOINT_GLOB))
    assert shards and all(".shard-" in p.name and p.name.endswith("-of-2.json") for p in shards)
    assert not (cut / "head_ablation.csv").exists()
    done = set()
    for p in shards:
        for task, state in json.loads(p.read_text())["state"].items():
            done |= {(task, h) for h in state["loss"]}
    assert 0 < len(done) < N_JOBS
    rc, out, err = torchrun("ablate", *args, "--out", str(cut))
    assert rc == 0, err
    assert "resuming from" in out and "sharded over 2 ranks" in out
    assert out.count("wrote ") == 1 and "head_ablation.csv" in out  # rank 0 alone prints and writes
    assert f"head ablations (one per head and task): {N_JOBS - len(done)} swept on 2 ranks, {len(done)} resumed" in out
    _assert_same_csv(cut / "head_ablation.csv", ref / "head_ablation.csv")
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (ref, cut))
    assert s1["clean_loss"] == pytest.approx(s2["clean_loss"], abs=1e-6)
    assert not list(cut.glob(CHECKPOINT_GLOB))


def test_help_shows_torchrun_usage(capsys):
    assert main(["ablate", "--help"]) == 0
    out = capsys.readouterr().out
    assert "torchrun --nproc-per-node 2 -m headprobe ablate" in out and ".headprobe-checkpoint.shard-R-of-N.json" in out
    for command in ("scan", "prune"):  # what is split over the ranks and what is not
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert f"torchrun --nproc-per-node 2 -m headprobe {command}" in out and "not" in out and "split" in out
    assert main(["scan", "--help"]) == 0  # a killed sharded scan resumes (rank 0's one checkpoint)
    out = capsys.readouterr().out
    assert "Not resumable" not in out and "resumes" in out


SCAN = [
    "--seq-len",
    "16",
    "--n-natural",
    "3",
    "--n-repeated",
    "3",
    "--period",
    "6",
    "--device",
    "cpu",
    "--n-random",
    "5",
    "-k",
    "2",
    "--pattern-len",
    "0",
]  # 5 random + 2-3 top-k sets per task: uneven shards


def _one_and_two_ranks(command, args, tmp_path, says):
    """``headprobe COMMAND ARGS`` in this process (out: tmp_path/one) and under torchrun on 2 ranks
    (tmp_path/two), which must say ``says``, print ``wrote`` once (rank 0) and write the same
    file names; (one, two)."""
    one, two = tmp_path / "one", tmp_path / "two"
    assert main([command, *args, "--out", str(one)]) == 0
    rc, out, err = torchrun(command, *args, "--out", str(two))
    assert rc == 0, err
    assert says in out and out.count("wrote ") == 1
    assert sorted(p.name for p in one.iterdir()) == sorted(p.name for p in two.iterdir())
    return one, two


def test_sharded_scan_writes_the_one_process_outputs(tiny_dir, tmp_path):
    """One torchrun launch (~20 s): scan's verification sets (every task's seeded random draws and
    the top-k sets) are split over 2 gloo ranks and gathered; rank 0 alone writes, and the table,
    the losses, effects, p-values and verdicts are the one-process scan's."""
    one, two = _one_and_two_ranks(
        "scan",
        ["--model", str(tiny_dir), "--text", _text(tmp_path), *SCAN],
        tmp_path,
        "verification sharded over 2 ranks",
    )
    a, b = pd.read_csv(one / "head_scores.csv"), pd.read_csv(two / "head_scores.csv")
    assert list(a.columns) == list(b.columns)
    np.testing.assert_allclose(a.to_numpy(float), b.to_numpy(float), rtol=0, atol=1e-5, equal_nan=True)
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    v1, v2 = s1["ablations"], s2["ablations"]
    assert len(v1) == len(v2) > 0 and s1["confirmed"] == s2["confirmed"]
    for x, y in zip(v1, v2):
        for key in ("head_type", "kind", "task", "top_heads", "random_heads", "confirmed", "p_value"):
            assert x[key] == y[key], key
        for key in ("clean_loss", "top_loss", "top_effect", "random_mean", "random_max"):
            assert x[key] == pytest.approx(y[key], abs=1e-6), key
        for key in ("random_effects", "top_effect_ci95"):
            np.testing.assert_allclose(x[key], y[key], rtol=0, atol=1e-6, err_msg=key)


def test_sharded_prune_writes_the_one_process_curves(tiny_dir, tmp_path):
    """One torchrun launch (~20 s): every rank runs every curve; the gradient importance and the
    held-out losses are data-parallel over rows (3 per set: uneven), the per-layer head sets are
    sharded, the L0 gates are trained alike on both ranks; rank 0 writes the one-process files."""
    args = [
        "--model",
        str(tiny_dir),
        "--text",
        _text(tmp_path),
        "--seq-len",
        "16",
        "--n-natural",
        "3",
        "--n-repeated",
        "3",
        "--period",
        "6",
        "--device",
        "cpu",
        "--step-fraction",
        "0.25",
        "--n-seeds",
        "1",
        "--l0-steps",
        "2",
        "--l0-lambdas",
        "1,10",
        "--per-layer",
    ]
    one, two = _one_and_two_ranks("prune", args, tmp_path, "sharded over 2 ranks")
    for name in ("pruning_curve.csv", "per_layer.csv"):
        a, b = pd.read_csv(one / name), pd.read_csv(two / name)
        assert list(a.columns) == list(b.columns) and len(a) == len(b) > 0
        for c in a.columns:
            if not pd.api.types.is_numeric_dtype(a[c]):  # method, removed heads: the same order of removal
                assert a[c].fillna("").tolist() == b[c].fillna("").tolist(), (name, c)
            else:  # losses written to 5 decimals
                np.testing.assert_allclose(
                    a[c].to_numpy(float), b[c].to_numpy(float), rtol=0, atol=2e-5, equal_nan=True, err_msg=f"{name} {c}"
                )
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (one, two))
    assert s1["removal_order"] == s2["removal_order"]
    for name, curve in s1["curves"].items():
        for r1, r2 in zip(curve, s2["curves"][name], strict=True):
            for key in ("natural_loss", "repeated_loss"):
                assert r1[key] == pytest.approx(r2[key], abs=1e-6), (name, key)
