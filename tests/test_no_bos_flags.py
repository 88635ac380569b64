"""``ablate``, ``prune`` and ``kv`` take ``--no-bos`` as ``scan`` does (their Python functions took
``prepend_bos=False``; the commands had no flag): the command with it writes the same files as
the function with ``prepend_bos=False``, and other files than without it."""

from __future__ import annotations

import json

import pytest

import headprobe
from headprobe.cli import main

SMALL = dict(n_natural=2, seq_len=12, n_repeated=2, period=5, device="cpu")
SMALL_FLAGS = ["--n-natural", "2", "--seq-len", "12", "--n-repeated", "2", "--period", "5", "--device", "cpu"]
KV = dict(seq_len=48, block_len=6, sink=2, window=6, budgets=(0.5,), n_random=1, device="cpu")
KV_FLAGS = ["--seq-len", "48", "--block-len", "6", "--sink", "2", "--window", "6", "--budgets", "0.5"]
KV_FLAGS += ["--n-random", "1", "--device", "cpu"]

COMMANDS = {
    "ablate": (dict(heads="1.3,0.0", **SMALL), ["--heads", "1.3,0.0", *SMALL_FLAGS], "head_ablation.csv"),
    "prune": (
        dict(methods="michel", step_fraction=0.5, **SMALL),
        ["--method", "michel", "--step-fraction", "0.5", *SMALL_FLAGS],
        "pruning_curve.csv",
    ),
    "kv": (KV, KV_FLAGS, "curve.csv"),
}


def _summary(path):
    s = json.loads((path / "summary.json").read_text())
    s.pop("timings_s", None)
    s.pop("peak_memory", None)  # the process's, as the wall time
    s.pop("command")  # the CLI's words, null from Python (test_json_outputs.py)
    s["config"].pop("model")
    return s


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_no_bos_on_the_command_line_equals_prepend_bos_false_in_python(command, tiny_dir, text_file, tmp_path):
    """Old code: ``--no-bos`` was an unrecognized argument of these commands (exit 2)."""
    fields, flags, table = COMMANDS[command]
    argv = [command, "--model", str(tiny_dir), "--text", str(text_file), "--formats", "none", *flags]
    assert main([*argv, "--no-bos", "--out", str(tmp_path / "cli")]) == 0
    assert main([*argv, "--out", str(tmp_path / "bos")]) == 0
    result = getattr(headprobe, command)(str(tiny_dir), text=str(text_file), prepend_bos=False, **fields)
    result.save(tmp_path / "api")
    cli, api, bos = ((tmp_path / d / table).read_bytes() for d in ("cli", "api", "bos"))
    assert cli == api and cli != bos
    s = _summary(tmp_path / "cli")
    assert s == _summary(tmp_path / "api") and s["config"]["prepend_bos"] is False
