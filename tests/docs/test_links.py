"""Every relative link in README.md and docs/*.md points at a file that exists and, with a `#fragment`, at a
heading of that file (GitHub's anchor rule: lower case, punctuation dropped, spaces to hyphens)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    text = re.sub(r"[`*_]", lambda m: "_" if m.group() == "_" else "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {anchor(line.lstrip("#")) for line in text.splitlines() if re.match(r"#{1,6} ", line)}


def test_anchor_rule():
    assert anchor("Scaling out on one machine: `pagellm bench control`, `bench throughput -tp/-pp`, `serve "
                  "--data-parallel-size`") == \
        "scaling-out-on-one-machine-pagellm-bench-control-bench-throughput--tp-pp-serve---data-parallel-size"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page):
    broken = []
    for target in LINK.findall(re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(target)
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"
