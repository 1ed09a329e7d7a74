"""The README and ``docs/``: short enough to read, and every local link lands somewhere.

A link is ``[text](target)`` or ``![alt](target)`` outside code. A local target must be a file or
folder of the repository; a ``#fragment`` on a markdown target must name one of its headings
(GitHub's anchors: lower case, punctuation dropped, spaces to hyphens).
"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
README_MAX_LINES = 250
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

_FENCED_CODE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def _prose(markdown: str) -> str:
  return _INLINE_CODE.sub("", _FENCED_CODE.sub("", markdown))


def links(markdown: str) -> list[str]:
  """The targets of the markdown links and images in ``markdown``, code left out."""
  return _LINK.findall(_prose(markdown))


def anchor(heading: str) -> str:
  """GitHub's anchor of a heading."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
  return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
  return {anchor(h) for h in _HEADING.findall(_FENCED_CODE.sub("", markdown))}


def test_links_and_anchors_are_found():
  text = ("# Results (H200, bf16)\n[a](docs/x.md#y) ![b](fig.png) `[c](no.md)`\n"
          "```\n[d](nor.md)\n## Not a heading\n```\n[e](https://example.org)\n")
  assert links(text) == ["docs/x.md#y", "fig.png", "https://example.org"]
  assert anchors(text) == {"results-h200-bf16"}


def test_readme_fits_in_250_lines():
  n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
  assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail into docs/"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(document: pathlib.Path):
  broken = []
  for target in links(document.read_text(encoding="utf-8")):
    if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
      continue
    path, _, fragment = target.partition("#")
    resolved = (document.parent / path).resolve() if path else document
    if ROOT not in resolved.parents:
      broken.append(f"{target}: outside the repository")
    elif not resolved.exists():
      broken.append(f"{target}: no such file")
    elif fragment and resolved.suffix == ".md" and fragment not in anchors(
        resolved.read_text(encoding="utf-8")):
      broken.append(f"{target}: no heading with anchor #{fragment}")
  assert not broken, f"{document.relative_to(ROOT)}: " + "; ".join(broken)
