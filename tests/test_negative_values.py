"""A negative size or number given to an option (``budget --kv-limit -1GiB``) is refused by the
option's own check in one line naming it, not by argparse's "expected one argument" (argparse
reads a word such as ``-1GiB`` or ``-1e3`` as an unknown option; only plain numerals like ``-1``
reach the option). :func:`headprobe.cli.negative_values_attached`, :func:`headprobe.probe.core.sizes.refuse_negative`."""

from __future__ import annotations

import pytest

from headprobe.cli import main

CASES = [
    (["budget", "--recommend", "--params", "135M", "--kv-limit", "-1GiB"], "--kv-limit must be positive, got -1GiB"),
    (["budget", "--recommend", "--params", "-135M"], "--params must be positive, got -135M"),
    (["budget", "--recommend", "--params", "-1e9"], "--params must be positive, got -1e9"),
    (["budget", "--preset", "gpt2-small", "--seq-len", "-1e3"], "argument --seq-len: must be a positive integer"),
    (["budget", "--preset", "gpt2-small", "--sliding-window", "-4k"], "argument --sliding-window: must be a positive"),
    (["scan", "--memory-budget", "-4GiB", "--out", "OUT"], "--memory-budget must be positive, got -4GiB"),
    (
        ["scan", "--mem", "-4GiB", "--out", "OUT"],
        "unrecognized arguments: --mem -4GiB (did you mean --memory-budget?)",
    ),  # an abbreviation: refused whole (OneLineErrorParser), the value with it
    (["scan", "--n-natural", "-1e2", "--out", "OUT"], "argument --n-natural: must be a positive integer, got '-1e2'"),
    (["scan", "--alpha", "-.5", "--out", "OUT"], "argument --alpha: must be between 0 and 1"),
    (["circuit", "--memory-gb", "-2.5e0", "--out", "OUT"], "argument --memory-gb: '-2.5e0' is not a positive number"),
    (["kv", "--budgets", "-0.5,0.2", "--out", "OUT"], "argument --budgets: budgets are fractions in (0, 1]"),
    (["prune", "--l0-lambdas", "-1,3", "--out", "OUT"], "--l0-lambdas must be non-negative and increasing"),
    (["train", "--lr", "-1e-3", "--out", "OUT"], "--lr must be a positive number, got -0.001"),
    (["diff", "a", "b", "--min-change", "-1e-1", "--out", "OUT"], "--min-change must be a number >= 0"),
]


@pytest.mark.parametrize("argv, said", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_a_negative_value_gets_the_options_own_line(tmp_path, capsys, argv, said):
    """Old code: ``headprobe: error: argument --kv-limit: expected one argument`` (and the like)
    for every case but the plain numerals; now the option's own check, one line, exit 2, no --out."""
    out = tmp_path / "out"
    assert main([str(out) if a == "OUT" else a for a in argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("headprobe: error: ") and said in err[0], err
    assert "expected one argument" not in err[0]
    assert not out.exists()


def test_only_a_value_after_an_option_that_takes_one_is_attached():
    """A switch before the word, ``--``, or a command without such an option leaves argv as it was
    (argparse then refuses an unknown ``-1x`` as it did)."""
    from headprobe.cli import build_parser, negative_values_attached

    parser = build_parser("budget")
    assert negative_values_attached(parser, ["budget", "--kv-limit", "-1GiB"]) == ["budget", "--kv-limit=-1GiB"]
    assert negative_values_attached(parser, ["budget", "--json", "-1GiB"]) == ["budget", "--json", "-1GiB"]
    assert negative_values_attached(parser, ["budget", "--kv-limit=2GiB", "-1"]) == ["budget", "--kv-limit=2GiB", "-1"]
    assert negative_values_attached(parser, ["budget", "--kv-lim", "-1GiB"]) == ["budget", "--kv-lim", "-1GiB"]
    assert negative_values_attached(parser, ["budget", "--", "--kv-limit", "-1"]) == [
        "budget",
        "--",
        "--kv-limit",
        "-1",
    ]


def test_parse_bytes_and_parse_count_name_a_negative_quantity():
    from headprobe.probe.core.errors import HeadprobeError
    from headprobe.probe.core.sizes import parse_bytes, parse_count

    with pytest.raises(HeadprobeError, match="^--kv-limit must be positive, got -2GiB$"):
        parse_bytes("-2GiB", "--kv-limit")
    with pytest.raises(HeadprobeError, match="^--params must be positive, got -7e9$"):
        parse_count("-7e9")
    assert parse_bytes("2GiB") == 2 * 2**30 and parse_count("135M") == 135_000_000


SEVERAL = [
    (["budget", "--flops-table", "1024", "-5k"], "argument --flops-table: must be a positive integer, got '-5k'"),
    (["budget", "--flops-table", "-5k"], "argument --flops-table: must be a positive integer, got '-5k'"),
    (
        ["budget", "--flops-table", "1024", "8192", "-1e3"],
        "argument --flops-table: must be a positive integer, got '-1e3'",
    ),
]


@pytest.mark.parametrize("argv, said", SEVERAL, ids=[" ".join(a) for a, _ in SEVERAL])
def test_a_negative_value_among_several_gets_the_options_own_line(capsys, argv, said):
    """An option that takes several values cannot have one attached with ``=``: the word goes
    through the option's type first. Old code: "unrecognized arguments: -5k"."""
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("headprobe: error: ") and said in err[0], err
    assert "unrecognized" not in err[0]


def test_a_negative_word_after_several_values_of_an_untyped_option_is_left_alone():
    """atlas' --models has no type to read ``-1x`` with: argv is unchanged (argparse refuses it as it did)."""
    from headprobe.cli import build_parser, negative_values_attached

    argv = ["atlas", "--models", "gpt2", "-1x", "--out", "o"]
    assert negative_values_attached(build_parser("atlas"), argv) == argv
