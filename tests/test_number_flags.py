"""Numbers a researcher may type that no range check catches: NaN and infinity for every flag that
reads a real number, seeds outside what numpy and torch take, sizes and counts that overflow a float.
Each is one line naming the flag and exit status 2 (it was a traceback: AdamW's ``ValueError``,
numpy's ``expected non-negative integer``, ``OverflowError``), from Python a ``HeadprobeError``.
No model is loaded."""

from __future__ import annotations

import argparse
import math

import pytest

from headprobe.cli import build_parser, main
from headprobe.probe.core.errors import HeadprobeError


def _flags(pick) -> list[tuple[str, str]]:
    """``(command, long flag)`` of every flag of every command's parser that ``pick(action)`` selects."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    return [
        (name, next(o for o in action.option_strings if o.startswith("--")))
        for name, sub in commands.items()
        for action in sub._actions
        if action.option_strings and pick(action)
    ]


def _reads_a_real_number(action: argparse.Action) -> bool:
    """Whether the flag's ``type`` turns ``"0.5"`` into a float (``float``, a probability, GiB...)."""
    if not callable(action.type):
        return False
    try:
        return isinstance(action.type("0.5"), float)
    except (argparse.ArgumentTypeError, ValueError, TypeError):
        return False


REAL_FLAGS = _flags(_reads_a_real_number)
SEED_FLAGS = _flags(lambda action: action.dest == "seed")


def test_the_flag_lists_are_not_empty():
    """The selection finds the flags it is about (a parser change must not empty the tests below)."""
    assert {("train", "--lr"), ("train", "--weight-decay"), ("prune", "--step-fraction")} <= set(REAL_FLAGS)
    assert {("diff", "--min-change"), ("kv", "--kv-budget"), ("scan", "--alpha")} <= set(REAL_FLAGS)
    assert {"scan", "train", "patch", "circuit", "kv", "ablate", "diff"} <= {c for c, _ in SEED_FLAGS}


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "1e999"])
@pytest.mark.parametrize("command, flag", REAL_FLAGS)
def test_every_real_number_flag_refuses_nan_and_infinity(command, flag, value, capsys):
    assert main([command, f"{flag}={value}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"headprobe: error: argument {flag}"), err


@pytest.mark.parametrize("value", ["-1", str(2**32), "99999999999999999999999"])
@pytest.mark.parametrize("command, flag", SEED_FLAGS)
def test_every_seed_flag_refuses_seeds_numpy_or_torch_cannot_take(command, flag, value, capsys):
    assert main([command, f"{flag}={value}"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith(f"headprobe: error: argument {flag}"), err


def test_the_seed_range_is_what_numpy_and_torch_take():
    """The bounds are not arbitrary: numpy's ``default_rng`` refuses -1, torch refuses 2**64, and
    the largest seed plus the offsets commands add stays inside both."""
    import numpy as np
    import torch

    from headprobe.analyses.vocabulary import SEED_MAX

    with pytest.raises(ValueError):
        np.random.default_rng(-1)
    with pytest.raises((ValueError, RuntimeError, OverflowError)):
        torch.Generator().manual_seed(2**64)
    np.random.RandomState(SEED_MAX)
    torch.Generator().manual_seed(SEED_MAX + 1000)


def test_python_settings_refuse_nan_and_out_of_range_seeds():
    from headprobe.commands.diff import DiffConfig
    from headprobe.commands.scan import ScanConfig

    with pytest.raises(HeadprobeError, match="seed"):
        ScanConfig(seed=-1)
    with pytest.raises(HeadprobeError, match="alpha"):
        ScanConfig(alpha=math.nan)
    with pytest.raises(HeadprobeError, match="min.change"):
        DiffConfig(model="a", b="b", min_change=math.nan)
    assert ScanConfig(seed=2**32 - 1).seed == 2**32 - 1


def test_train_refuses_a_nan_weight_decay_and_a_seed_out_of_range():
    from headprobe.analyses.train_config import TrainConfig

    with pytest.raises(HeadprobeError, match="--weight-decay"):
        TrainConfig(weight_decay=math.nan).validate()
    with pytest.raises(HeadprobeError, match="--seed"):
        TrainConfig(seed=-1).validate()
    TrainConfig(seed=2**32 - 1).validate()


def test_study_refuses_a_seed_out_of_range(capsys, tmp_path):
    assert main(["study", "heads", "--seeds", f"0,{2**40}", "--steps", "1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "--seeds" in err[0], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("text", ["1e400GiB", "1e309"])
def test_a_size_beyond_a_float_is_refused_in_one_line(text):
    from headprobe.probe.core.sizes import parse_bytes, parse_count

    with pytest.raises(HeadprobeError, match="too large"):
        parse_bytes(text, "--memory-budget")
    with pytest.raises(HeadprobeError, match="too large"):
        parse_count(text.removesuffix("GiB"))
    assert parse_bytes("1e3GiB") == 1000 * 2**30 and parse_count("1e3") == 1000
