"""The README stands alone: a clone has nothing beside the repository (issue 16)."""
import re

from tests.conftest import ROOT


def test_readme_links_stay_inside_the_repository():
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("#", "http://", "https://")):
            continue
        path = (ROOT / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), target
    assert "shared/" not in text  # ../shared/DESIGN.md and the seeds live beside a checkout, not in it
