"""Every "DESIGN §N" in the code and the docs names a section of docs/DESIGN.md, and nothing in the
repository points at a design outside it (issue 33: a newcomer who clones gemps can read them)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITATION = re.compile(r"DESIGN §(\d+[a-z]?)")
HEADING = re.compile(r"^## (\d+[a-z]?)\. ", re.MULTILINE)


def tracked_text_files() -> list[Path]:
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [ROOT / name for name in listed.split() if name.endswith((".py", ".md", ".toml", ".yml", ".yaml", ".c"))]


def test_every_design_citation_names_a_section_of_docs_design() -> None:
    sections = set(HEADING.findall((ROOT / "docs" / "DESIGN.md").read_text()))
    assert {"1", "2", "3", "3a", "3b", "3c", "4", "5"} <= sections
    cited: dict[str, list[str]] = {}
    for path in tracked_text_files():
        for section in CITATION.findall(path.read_text(errors="replace")):
            cited.setdefault(section, []).append(str(path.relative_to(ROOT)))
    assert cited, "no citation found: the pattern is wrong"
    unresolved = {section: files for section, files in cited.items() if section not in sections}
    assert not unresolved, f"citations of sections docs/DESIGN.md does not have: {unresolved}"


def test_nothing_points_at_a_design_outside_the_repository() -> None:
    outside = [
        str(path.relative_to(ROOT))
        for path in tracked_text_files()
        if "shared/DESIGN" in path.read_text(errors="replace") and path.name != Path(__file__).name
    ]
    assert not outside
