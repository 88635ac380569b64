"""Sizes as text, read and printed the same way on every floor: the memory budget
(``--memory-budget``, ``$HEADPROBE_MEMORY_BUDGET``) and ``budget``'s ``--kv-limit`` and tables.

References: sizes worked out by hand (1 KiB = 2**10 bytes, 1 kB = 10**3, IEC 80000-13), and
the documented one-line errors of docs/budget.md and docs/scale.md.
"""

from __future__ import annotations

import random

import pytest

from headprobe.cli import main
from headprobe.probe.core import memory
from headprobe.probe.core.errors import HeadprobeError
from headprobe.probe.layout import cost

KIB, MIB, GIB, TIB = 2**10, 2**20, 2**30, 2**40

# text -> bytes, by hand
SIZES = {
    "4GiB": 4 * GIB,
    "500 MB": 500 * 10**6,
    "1.5KiB": 1536,
    "0.5 mib": MIB // 2,
    "2e3": 2000,
    "7.5e2 KiB": 750 * KIB,
    ".25GiB": GIB // 4,
    "12 b": 12,
    "1000": 1000,
}


pytestmark = pytest.mark.usefixtures("no_stated_budget")


@pytest.mark.parametrize("text, n", SIZES.items())
def test_the_budget_and_the_cost_floor_read_a_size_alike(text, n):
    assert memory.parse_bytes(text) == n
    assert cost.parse_bytes(text) == n


@pytest.mark.parametrize("text", ["0.1B", "0.4 B", "0", "0 KiB", "-1GiB", "GiB", "4 gigs", "", "2XB"])
def test_no_size_below_one_byte_and_no_unknown_unit(text):
    for parse in (memory.parse_bytes, cost.parse_bytes):
        with pytest.raises(HeadprobeError):
            parse(text)


def test_the_budget_prints_sizes_as_the_cost_tables_do():
    memory.set_budget(4096)
    assert memory.stated() == (4096, "stated budget 4 KiB")
    memory.set_budget("1.5 GiB")
    assert memory.stated() == (3 * GIB // 2, "stated budget 1.5 GiB")


@pytest.mark.parametrize("n, text", [(TIB - 1, "1 TiB"), (GIB - 1, "1 GiB"), (KIB - 0.001, "1 KiB")])
def test_a_size_that_rounds_up_to_1024_of_a_unit_prints_in_the_next(n, text):
    assert cost.format_bytes(n) == text


def test_a_printed_size_reads_back_within_its_rounding():
    """``parse_bytes(format_bytes(n))`` is within half a unit of the last printed digit of ``n``."""
    rng = random.Random(0)
    for _ in range(2000):
        n = int(rng.uniform(1, 2**50) ** rng.uniform(0.1, 1))
        text = cost.format_bytes(n)
        unit = {"B": 1, "KiB": KIB, "MiB": MIB, "GiB": GIB, "TiB": TIB}[text.split()[1]]
        assert abs(memory.parse_bytes(text) - n) <= 0.005 * unit + 1, (n, text)


def test_kv_limit_keeps_its_documented_unit_guard(capsys):
    """docs/budget.md: "`--kv-limit` needs a unit; a bare number is bytes and must be at least 1024"."""
    argv = ["budget", "--recommend", "--d-model", "576", "--n-layers", "30", "--seq-len", "8192", "--kv-limit"]
    assert main([*argv, "100"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == "headprobe: error: '100' would be 100 bytes; give a unit, e.g. 100GiB or 100MiB\n"
    assert main([*argv, "2048"]) in (0, 1)  # a bare number of 1024 or more is bytes (here nothing fits: 1)
    out = capsys.readouterr().out
    # not "at most 0 tokens fit; shorten the context": no context fits 2 KiB, the limit is what to change
    assert "Nothing fits: one token's KV cache (" in out and "give one (e.g. 2048MiB or 2GiB)" in out
    assert "at most 0 tokens" not in out


def test_memory_budget_takes_bare_bytes():
    memory.set_budget("1000")
    assert memory.stated() == (1000, "stated budget 1000 B")
