"""No figure in the documentation site without its source (issue 48): every image a page shows
exists, is named by the code that draws it (an experiment's report, the bench, a script), and
lies beside the data it was drawn from."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")
# Where the code that draws figures lives.
CODE = [ROOT / folder for folder in ("worker", "benchmarks", "cli", "scripts")]
DATA_SUFFIXES = {".json", ".jsonl", ".csv"}


# Text the experiment report copies into RESULTS.md (mkdocs.yml excludes it: its links are RESULTS.md's).
NOT_A_PAGE = DOCS / "results" / "discussion.md"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted(page for page in DOCS.rglob("*.md") if page != NOT_A_PAGE)]


def shown_figures() -> dict[Path, list[str]]:
    """Each image file a page shows -> the pages that show it."""
    figures: dict[Path, list[str]] = {}
    for page in pages():
        for target in IMAGE.findall(page.read_text()):
            if "://" in target:
                continue
            figures.setdefault((page.parent / target).resolve(), []).append(str(page.relative_to(ROOT)))
    return figures


def drawing_code() -> str:
    return "\n".join(path.read_text() for folder in CODE for path in folder.rglob("*.py"))


def test_the_site_shows_figures() -> None:
    assert len(shown_figures()) >= 10  # the check below is not vacuous


@pytest.mark.parametrize("figure", sorted(shown_figures()), ids=lambda path: str(path.relative_to(ROOT)))
def test_a_shown_figure_has_its_source(figure: Path) -> None:
    shown_by = shown_figures()[figure]
    assert figure.is_file(), f"{figure.relative_to(ROOT)} (shown by {shown_by}) does not exist"
    # A numbered series is named by its pattern (f"fig_compare_n{workers}.png").
    named = re.sub(r"\d+$", "", figure.stem)
    assert named in drawing_code(), f"no code under {[c.name for c in CODE]} names {figure.name}: who draws it?"
    beside = [path for path in figure.parent.iterdir() if path.suffix in DATA_SUFFIXES]
    assert beside, f"{figure.relative_to(ROOT)} has no data beside it ({', '.join(sorted(DATA_SUFFIXES))})"
