"""Every relative link in README.md, CONTRIBUTING.md and docs/*.md points at a file that exists,
and every ``#anchor`` at a heading of that file (GitHub's heading slugs)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {_slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def broken_links(doc: Path) -> list[str]:
    """Relative links of ``doc`` (outside code blocks) whose file or heading does not exist."""
    text = FENCE.sub("", doc.read_text(encoding="utf-8"))
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists():
            bad.append(f"{doc.name}: {target} (no such file)")
        elif anchor and (path.suffix != ".md" or anchor not in _anchors(path)):
            bad.append(f"{doc.name}: {target} (no such heading)")
    return bad


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_relative_link_resolves():
    docs = _docs()
    assert (ROOT / "docs" / "scan.md") in docs
    bad = [b for doc in docs for b in broken_links(doc)]
    assert not bad, "\n".join(bad)


def test_a_broken_link_is_reported(tmp_path):
    (tmp_path / "there.md").write_text("# A `code` heading: here\n", encoding="utf-8")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "[ok](there.md) [ok](there.md#a-code-heading-here) [web](https://example.org/x)\n"
        "[gone](missing.md) [bad anchor](there.md#nowhere)\n```\n[in code](ignored.md)\n```\n",
        encoding="utf-8",
    )
    assert broken_links(doc) == ["doc.md: missing.md (no such file)", "doc.md: there.md#nowhere (no such heading)"]


def test_github_slugs():
    assert _slug("`headprobe scan`: find and verify head types") == "headprobe-scan-find-and-verify-head-types"
    assert _slug("Scan of SmolLM2-135M") == "scan-of-smollm2-135m"
