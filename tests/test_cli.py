"""The command layer: --version, flag suggestions, case-insensitive model names, one-line usage errors."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version

import pytest


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "headprobe", *args], capture_output=True, text=True, timeout=120)


def test_version_is_the_installed_distributions():
    p = _cli("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"headprobe {version('headprobe')}"


@pytest.mark.parametrize("args, hint", [
    (["scan", "--seq_len", "3", "--out", "x"], "did you mean --seq-len?"),
    (["budget", "--presett", "llama3-8b"], "did you mean --preset?"),
    (["ablate", "--out", "x", "--Heads", "1.1"], "did you mean --heads?"),
])
def test_misspelt_flags_get_a_suggestion_on_one_line(args, hint, tmp_path):
    p = _cli(*args)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("headprobe: error: unrecognized arguments") and hint in lines[0]
    assert lines[0].endswith(f"(see headprobe {args[0]} --help)")


def test_unrelated_flag_gets_no_suggestion():
    p = _cli("budget", "--zzzzzz", "1")
    assert p.returncode == 2 and "did you mean" not in p.stderr


def test_model_short_names_are_case_insensitive():
    from headprobe.probe.loading import SMOLLM2_HF_NAME, _resolve

    assert _resolve("SmolLM2-135M")[0] == _resolve("smollm2-135m")[0] == SMOLLM2_HF_NAME
