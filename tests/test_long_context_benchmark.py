"""benchmarks/long_context.py: a length whose half is shorter than 48 + 3 tokens still gets a period
scan accepts (it computed period 2, which scan refuses, so every short length printed 'failed')."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_short_length_is_measured_with_a_period_scan_accepts(tiny_dir):
    from headprobe.analyses.vocabulary import MIN_PERIOD

    spec = importlib.util.spec_from_file_location("long_context_benchmark", ROOT / "benchmarks" / "long_context.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    row = module.one(64, str(tiny_dir), "auto")
    assert row["n"] == 64 and row["period"] == MIN_PERIOD and row["scan_s"] >= 0
