"""mkdocs hooks of the docs site (mkdocs.yml, ``hooks:``).

- The settings page shows README's settings table, so that the table has one copy: README's is the one
  tests/test_settings.py checks against goblin_dask/goblin.yaml.  A settings page without the marker, or a
  README without the table, fails the build.
- The docstrings cross-reference in Sphinx's roles (``:func:`name```), which mkdocstrings shows as text:
  the role's prefix is dropped from the pages, leaving the name as code.
"""

import re
from pathlib import Path

MARKER = "<!-- the settings table from README.md -->"
SPHINX_ROLE = re.compile(r":(?:mod|func|class|meth|attr|data|exc|obj):(?=<code>)")


def readme_settings_table(readme: Path) -> str:
    """The rows of README.md's ``## Settings`` table (its header included)."""
    section = readme.read_text().split("\n## Settings\n", 1)
    if len(section) != 2:
        raise ValueError(f"{readme} has no '## Settings' section")
    rows = [line for line in section[1].split("\n## ", 1)[0].splitlines() if line.startswith("|")]
    if len(rows) < 3:
        raise ValueError(f"{readme}'s '## Settings' section has no table")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri != "settings.md":
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/settings.md lacks the marker {MARKER!r}")
    readme = Path(config["config_file_path"]).parent / "README.md"
    return markdown.replace(MARKER, readme_settings_table(readme))


def on_page_content(html, page, config, files):
    return SPHINX_ROLE.sub("", html)
