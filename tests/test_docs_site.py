"""The documentation site (mkdocs.yml) builds with ``mkdocs build --strict``: a broken link, anchor or
API reference, or a docstring mkdocstrings cannot parse, fails it. Its API reference shows the public
functions under their ``headprobe.<name>`` names with their docstrings, and the notebooks are pages."""

from __future__ import annotations

import html
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import headprobe

ROOT = Path(__file__).resolve().parents[1]
API_NAMES = ("scan", "ablate", "prune", "capture_heads", "load_model", "wrap")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    p = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert p.returncode == 0, p.stderr[-4000:]
    return out


def _text(page: Path) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page.read_text(encoding="utf-8"))))


def test_the_api_reference_lists_the_public_functions_with_their_docstrings(site):
    page = site / "docs" / "api" / "index.html"
    source, text = page.read_text(encoding="utf-8"), _text(page)
    for name in API_NAMES:
        assert f'id="headprobe.{name}"' in source, name
        first_line = getattr(headprobe, name).__doc__.strip().splitlines()[0]
        words = re.sub(r"``|:\w+:`~?|`", "", first_line).split()[:6]  # the line as rendered: no markup
        assert " ".join(words) in text, (name, words)


def test_the_pages_and_notebooks_are_in_the_site(site):
    assert (site / "index.html").is_file()  # README.md
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert (site / "docs" / page.stem / "index.html").is_file(), page.name
    for nb in sorted((ROOT / "docs" / "notebooks").glob("*.ipynb")):
        assert (site / "docs" / "notebooks" / nb.stem / "index.html").is_file(), nb.name
    assert (site / "figures" / "smollm2-135m" / "overview.png").is_file()  # README's image, at its place
