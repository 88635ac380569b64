"""README's "Find induction heads" Python block run as written on SmolLM2 (its scan lines left out: minutes).
Its comment "+ b_O sums to cap['attn_out'][18]" failed literally (``model.b_O(18)`` is None for SmolLM2:
TypeError on ``+``); the block now states the sum with ``cap["b_O"]``, and each ``.item()`` line that
checks an identity gives ~0 here. Reference: the README text itself, executed."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _block() -> list[str]:
    """The lines of README's first ```python block, without those that run or read the scan."""
    text = README.read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block, "README has no python block"
    return [ln for ln in block.group(1).splitlines() if ln.strip() and not re.search(r"\bscan\b", ln.split("#")[0])]


def test_the_readmes_capture_lines_run_as_written():
    lines = _block()
    assert any('cap["b_O"][18]' in ln for ln in lines)  # the sum the comment used to promise
    names: dict = {}
    checks = []
    for line in lines:
        code = line.split("  #", 1)[0].rstrip() if "  #" in line else line
        if code.lstrip().startswith("#"):
            continue
        if code.endswith(".item()"):  # an identity checked by hand: its value, ~0
            checks.append((code, eval(code, names)))
        else:
            exec(code, names)
    assert names["model"].b_O(18) is None  # why the comment's literal "+ b_O" (model.b_O) raised TypeError
    assert len(checks) == 2 and all(abs(v) < 1e-4 for _, v in checks), checks
