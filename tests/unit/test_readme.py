"""The README stands alone: a clone has nothing beside the repository (issue 16)."""
import re

import pytest

from tests.conftest import ROOT


def test_readme_links_stay_inside_the_repository():
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("#", "http://", "https://")):
            continue
        path = (ROOT / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), target
    assert "shared/" not in text  # ../shared/DESIGN.md and the seeds live beside a checkout, not in it


DOCS = ("README.md", "docs/ARCHITECTURE.md")


def test_readme_is_a_user_guide_with_its_quickstarts_first():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 450, f"README.md has {len(lines)} lines (issue 37: at most 450)"
    heads = {line: i for i, line in enumerate(lines) if line.startswith("## ")}
    for head in ("## Install", "## Use it from PyTorch", "## Quickstart: the command line"):
        assert heads.get(head, 10**6) < 80, f"{head!r} is not within the first 80 lines"
    cli = heads["## Quickstart: the command line"]
    assert lines.index("```", lines.index("```", cli) + 1) < 80  # the CLI quickstart's block ends there too


@pytest.mark.parametrize("doc", DOCS)
def test_the_seeds_are_cited_by_title_not_by_section(doc):
    text = (ROOT / doc).read_text()
    assert "§" not in text and "DESIGN" not in text, [line for line in text.splitlines() if "§" in line or "DESIGN" in line]


@pytest.mark.parametrize("doc", DOCS)
def test_the_paths_the_documents_name_exist(doc):
    """Every file a document names in backticks exists (from the root, or, for a path written
    relative to its package such as `kernels/split.py`, somewhere below it)."""
    text = (ROOT / doc).read_text()
    names = set(re.findall(r"`([\w./-]+\.(?:py|j2|lark|md|attn|toml))\b", text))
    missing = [n for n in sorted(names) if not (ROOT / n).exists() and not any(ROOT.glob(f"*/**/{n}"))]
    assert not missing, f"{doc} names files that do not exist: {missing}"
