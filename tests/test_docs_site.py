"""The documentation site (mkdocs.yml) builds with ``mkdocs build --strict``: a broken link, anchor or
API reference, or a docstring mkdocstrings cannot parse, fails it. Its API reference shows the public
functions under their ``headprobe.<name>`` names with their docstrings (a command's function with
every setting of its signature and the result it returns), and the notebooks are pages. Its links
name files (``docs/api.html``, not ``docs/api/``), so it can be browsed from disk."""

from __future__ import annotations

import html
import importlib
import inspect
import keyword
import os
import re
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

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
    page = site / "docs" / "api.html"
    source, text = page.read_text(encoding="utf-8"), _text(page)
    for name in API_NAMES:
        assert f'id="headprobe.{name}"' in source, name
        first_line = getattr(headprobe, name).__doc__.strip().splitlines()[0]
        words = re.sub(r"``|:\w+:`~?|`", "", first_line).split()[:6]  # the line as rendered: no markup
        assert " ".join(words) in text, (name, words)


def test_the_pages_and_notebooks_are_in_the_site(site):
    assert (site / "index.html").is_file()  # README.md
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert (site / "docs" / f"{page.stem}.html").is_file(), page.name
    for nb in sorted((ROOT / "docs" / "notebooks").glob("*.ipynb")):
        assert (site / "docs" / "notebooks" / f"{nb.stem}.html").is_file(), nb.name
    assert (site / "figures" / "smollm2-135m" / "overview.png").is_file()  # README's image, at its place


def _section(source: str, ident: str) -> str:
    """The HTML of object ``ident``'s entry on an API page: from its heading to the next object's."""
    start = source.index(f'id="{ident}"')
    end = source.find('class="doc doc-heading"', source.index('class="doc doc-heading"', start) + 1)
    return source[start : end if end > 0 else len(source)]


def test_each_commands_function_shows_its_settings_and_the_result_it_returns(site):
    from headprobe.commands import COMMANDS

    source = (site / "docs" / "api.html").read_text(encoding="utf-8")
    for name in COMMANDS.names():
        fn = getattr(headprobe, name)
        # shown under a name Python can spell: import's function as headprobe.import_heads
        spelt = name if not keyword.iskeyword(name) else next(n for n in headprobe.__all__ if n.startswith(name + "_"))
        assert getattr(headprobe, spelt) is fn, (name, spelt)
        text = _text_of(_section(source, f"headprobe.{spelt}"))
        params = inspect.signature(fn).parameters.values()
        # every setting a keyword (options.command_function): the defaults as help() shows them, not
        # as the source spells them (``model=options.DEFAULT_MODEL`` where a function is written out)
        made = not any(p.kind is p.VAR_KEYWORD for p in params)
        for p in params:  # the signature help() shows
            stars = {p.VAR_POSITIONAL: r"\* ", p.VAR_KEYWORD: r"\*\* "}.get(p.kind, r"\b")
            assert re.search(rf"{stars}{p.name}\b", text), (name, p.name)
            if made and (isinstance(p.default, (bool, int, float, str)) or p.default is None):
                shown = f'"{p.default}"' if isinstance(p.default, str) else repr(p.default)
                assert re.search(rf"\b{p.name} : [^=]*?= {re.escape(shown)} ,", text), (name, p.name, shown)
        result = inspect.signature(fn).return_annotation
        cls = getattr(importlib.import_module(fn.__module__), result) if isinstance(result, str) else result
        if cls.__module__.startswith("headprobe."):  # view returns a pathlib.Path
            ident = f"{cls.__module__}.{cls.__qualname__}"
            assert f'id="{ident}"' in source, (name, ident)
            for method in ("summary", "save"):
                assert not hasattr(cls, method) or f'id="{ident}.{method}"' in source, (name, method)


def _text_of(fragment: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", fragment)))


def _object(path: str):
    """The object an API page's heading id names (``headprobe.commands.scan_core.ScanResult``)."""
    module, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):  # a method or attribute: its class is the owner that counts
        return None


MERGED_KNOWN: set[str] = set()
"""Entries whose docstring still puts two items on one line (none now)."""


def test_each_docstring_table_row_is_one_entry(site):
    """One row per returned value (none of these functions returns a tuple), per exception and per
    attribute: a description continued at the item's indent becomes rows of its own, a second
    ``name: ...`` written on the same line stays inside the first's description, and ``a, b: ...``
    is read as name ``a,`` of type ``b``."""
    source = (site / "docs" / "api.html").read_text(encoding="utf-8")
    sections = re.finditer(
        r'<h[2-4] id="([^"]+)"|<span class="doc-section-title">(Returns|Raises|Attributes):</span></p>\s*'
        r"<table>.*?<tbody>(.*?)</tbody>",
        source,
        re.S,
    )
    owner, seen = "", set()
    for m in sections:
        if m.group(1):
            owner = m.group(1)
            continue
        rows = [
            [_text_of(c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", r, re.S)]
            for r in m.group(3).split("</tr>")
        ]
        rows = [r for r in rows if r]
        seen.add(m.group(2))
        if m.group(2) == "Returns":
            assert len(rows) == 1, (owner, rows)
        if owner in MERGED_KNOWN:
            continue
        names = {r[0] for r in rows} | set(getattr(_object(owner), "__dataclass_fields__", ()))
        for row in rows:
            assert not row[0].endswith(","), (owner, row)  # ``a, b: ...``
            merged = re.findall(r"[.;] (\w+): ", row[-1])  # ``a: ... . b: ...``, b an entry of its own
            assert not [w for w in merged if w in names or w.endswith(("Error", "Exception"))], (owner, row)
            assert not re.search(r"\. [A-Z]\w*(Error|Exception): ", row[-1]), (owner, row)
    assert seen == {"Returns", "Raises", "Attributes"}


def test_the_site_can_be_browsed_from_disk(site):
    """Every relative link of every page names a file of the site (``docs/api.html``): a directory
    URL (``docs/api/``) opens as a directory listing over ``file://``. 404.html alone is served by
    a web server at any depth, so its links are absolute."""
    nav = re.findall(r'href="([^"#]+)" class="md-nav__link', (site / "index.html").read_text(encoding="utf-8"))
    assert "docs/api.html" in nav, nav
    checked = 0
    for page in sorted(site.rglob("*.html")):
        if page.name == "404.html" or "assets" in page.relative_to(site).parts:
            continue
        for url in re.findall(r'(?:href|src)="([^"]*)"', page.read_text(encoding="utf-8")):
            parts = urlsplit(html.unescape(url))
            if parts.scheme or parts.netloc or not parts.path:
                continue
            checked += 1
            assert (page.parent / unquote(parts.path)).resolve().is_file(), (page.relative_to(site), url)
    assert checked > 500
