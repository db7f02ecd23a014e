"""The docs site (mkdocs.yml, docs/) builds with warnings as errors, shows what it promises, and its
researcher quickstart runs as written.

The builds need the ``docs`` extra (mkdocs, mkdocstrings); without it they skip, except under ``CI=true``
(``.ci/run`` installs it), where they fail, so that CI never passes without building the docs.
"""

from __future__ import annotations

import html
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]



def build(root: Path, site: Path) -> subprocess.CompletedProcess:
    """``mkdocs build --strict`` of the site at ``root``; skipped without the docs extra, except under CI."""
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None:
        if os.environ.get("CI") == "true":
            pytest.fail("the docs tests need the docs extra under CI: pip install '.[docs]'")
        pytest.skip("mkdocs and mkdocstrings are not installed (pip install '.[docs]')")
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(root / "mkdocs.yml"),
                           "-d", str(site)], capture_output=True, text=True, cwd=root)


def page_text(site: Path, page: str) -> str:
    text = re.sub(r"<[^>]+>", " ", (site / page / "index.html").read_text())
    return re.sub(r"\s+", " ", html.unescape(text))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    done = build(ROOT, site)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stderr[-4000:]}"
    return site


def test_every_page_of_the_nav_is_built(site):
    for page in ("quickstart/researcher", "quickstart/lab-admin", "quickstart/volunteer", "deployment", "concepts",
                 "settings", "troubleshooting", "reference/goblin_dask", "reference/array", "reference/volunteer"):
        assert (site / page / "index.html").is_file(), page


def test_settings_page_lists_every_goblin_key_with_its_default(site):
    from tests.test_settings import yaml_rows
    from goblin_dask import settings

    text = page_text(site, "settings")
    rows = yaml_rows(Path(settings.PATH).read_text())
    assert len(rows) > 30
    for key, default, _ in rows:
        assert f"{key} {default}" in text, f"the settings page lacks {key} = {default}"


def test_api_reference_comes_from_the_docstrings(site):
    from goblin_dask.errors import fatal_connect_error
    from goblin_dask.node.local import LabNode, connect

    reference = page_text(site, "reference/goblin_dask") + page_text(site, "reference/errors")
    for obj in (LabNode.local, LabNode.report, connect, fatal_connect_error):
        first = re.sub(r"\s+", " ", obj.__doc__.strip().splitlines()[0]).replace("``", "")
        first = re.sub(r":\w+:`([^`]*)`", r"\1", first).replace("`", "")
        assert first.split(":")[0][:40] in reference, obj.__qualname__
    assert not re.search(r":(mod|func|class|meth|attr|data):", reference), "a Sphinx role left in the page"


def test_a_broken_link_fails_the_build(tmp_path):
    """Strict means strict: a page linking to a page that does not exist stops the build, naming both."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("session-notes", "*.png"))
    page = tmp_path / "docs" / "concepts.md"
    page.write_text(page.read_text() + "\nSee [the missing page](missing.md).\n")
    done = build(tmp_path, tmp_path / "site")
    assert done.returncode != 0
    assert "concepts.md" in done.stderr and "missing.md" in done.stderr


def python_blocks(page: Path, section: str) -> list[str]:
    """The ```python blocks of ``section`` (a ``## `` heading) of a docs page, as written."""
    text = page.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def test_researcher_quickstart_runs_as_written(tmp_path):
    """The local-grid snippet of docs/quickstart/researcher.md, run as a researcher would paste it: real
    volunteer processes compute the product, the lab verifies them, and it matches numpy."""
    (code,) = python_blocks(ROOT / "docs" / "quickstart" / "researcher.md", "On your machine: a local grid")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    error, accepted = done.stdout.split()
    # the reference: numpy's own a @ a.T (float64) of the same a; the blocked sum differs by rounding only
    assert 0 <= float(error) < 1e-9
    assert int(accepted) > 0, "no volunteer result was verified: the product stayed at the lab"


def readme_commands() -> list[str]:
    """README.md's two commands (its first ```bash block): install and run the demo, then run the tests."""
    (block,) = re.findall(r"```bash\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)[:1]
    lines = block.strip().splitlines()
    assert len(lines) == 2, lines
    return lines


def test_ci_runs_exactly_readmes_test_command():
    """``.ci/run`` installs the test extra and runs README's test command, as README writes it."""
    _, tests = readme_commands()
    install, run = tests.split(" && ")
    assert install == "pip install '.[test]'"
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "python -m pip install -q '.[test]'  # as README.md says" in " ".join(ci)
    assert ci[-1] == run == "python -m pytest -q tests"
    assert f"`{run}`" in (ROOT / "docs" / "development.md").read_text()


@pytest.mark.slow
def test_readmes_first_command_runs_the_demo_on_the_embedded_default(tmp_path):
    """README's first command ends in ``goblin demo``: run as written (the installed ``goblin``, in a fresh
    directory), it starts the embedded grid, volunteers compute a verified product, and it matches numpy."""
    first, _ = readme_commands()
    assert first == "python3 -m venv .venv && . .venv/bin/activate && pip install . && goblin demo"
    assert first in (ROOT / "docs" / "index.md").read_text()  # the docs' home page says the same
    goblin = shutil.which("goblin", path=os.path.dirname(sys.executable)) or shutil.which("goblin")
    assert goblin, "the goblin command is not installed (pip install .)"
    done = subprocess.run([goblin, "demo"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    out = done.stdout
    assert "result check: matches numpy's float64 product" in out, out
    accepted = int(re.search(r"(\d+) accepted, 0 rejected", out).group(1))
    assert accepted > 0, out
    sent = int(re.search(r"where tasks ran: (\d+) on volunteers", out).group(1))
    assert sent > 0, out
