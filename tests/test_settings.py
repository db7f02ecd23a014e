"""Settings: every ``goblin.*`` key has its default in goblin_dask/goblin.yaml, the docs' settings page lists
them all.

``python tests/test_settings.py`` prints docs/settings.md's table from goblin.yaml.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import dask
import pytest
import scheduler_plugins
from goblin_dask import settings

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: The docs' settings page, which holds the table (``.ci/run`` copies docs/ next to tests/).
SETTINGS_PAGE = ROOT / "docs" / "settings.md"
#: Where the package's source is (the installed one under CI).
SOURCES = [Path(settings.__file__).parent, Path(scheduler_plugins.__file__).parent]
#: A read of a goblin key: dask.config.get("goblin.x") or settings.get("goblin.x").
READ = re.compile(r"""(?:config|settings)\.get\(\s*f?["'](goblin[^"']*)["']""")
HEADER = "| key | default | meaning |"


def yaml_rows(text: str) -> list[tuple[str, str, str]]:
    """(key, default as written, comment) of every leaf of goblin.yaml, in file order."""
    rows, groups = [], []  # groups: (indent, name) of the enclosing mappings
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        indent = len(line) - len(line.lstrip())
        body, _, comment = line.strip().partition("  # ")
        name, _, value = body.partition(":")
        while groups and groups[-1][0] >= indent:
            groups.pop()
        if not value.strip():
            groups.append((indent, name))
            continue
        rows.append((".".join([g for _, g in groups] + [name]), value.strip(), comment.strip()))
    return rows


def settings_table() -> str:
    rows = yaml_rows(Path(settings.PATH).read_text())
    return "\n".join([HEADER, "| --- | --- | --- |", *(f"| `{k}` | `{v}` | {c} |" for k, v, c in rows)])


def _leaves(d: dict, prefix: str = "") -> dict[str, object]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def _page_table() -> str:
    assert SETTINGS_PAGE.is_file(), f"{SETTINGS_PAGE} is missing (.ci/run copies docs/ next to tests/)"
    lines = SETTINGS_PAGE.read_text().splitlines()
    assert HEADER in lines, f"{SETTINGS_PAGE} has no settings table (its header: {HEADER})"
    start = lines.index(HEADER)
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return "\n".join(lines[start:end])


def test_goblin_yaml_every_key_documented_and_loaded():
    rows = yaml_rows(Path(settings.PATH).read_text())
    leaves = _leaves(settings.defaults)
    assert [k for k, _, _ in rows] == list(leaves)  # the line parser reads what yaml reads
    assert all(comment for _, _, comment in rows), [k for k, _, c in rows if not c]
    for key, value in leaves.items():  # importing goblin_dask loaded them
        assert dask.config.get(key) == value == settings.get(key), key


def test_settings_page_table_matches_goblin_yaml():
    page = {line.split("|")[1].strip().strip("`"): line for line in _page_table().splitlines()[2:]}
    generated = {line.split("|")[1].strip().strip("`"): line for line in settings_table().splitlines()[2:]}
    assert set(page) - set(generated) == set(), "docs/settings.md lists keys goblin.yaml lacks"
    assert set(generated) - set(page) == set(), "docs/settings.md lacks keys of goblin.yaml"
    assert _page_table() == settings_table(), "docs/settings.md's table differs: python tests/test_settings.py prints it"


def test_readme_and_docs_mention_only_known_keys():
    keys = set(_leaves(settings.defaults))
    groups = {k.rsplit(".", i)[0] for k in keys for i in range(1, k.count(".") + 1)}
    pages = [README, *sorted((ROOT / "docs").glob("**/*.md"))]
    pages = [p for p in pages if "session-notes" not in p.parts]
    mentioned = {}
    for page in pages:
        for key in set(re.findall(r"`(goblin\.[a-z][a-z0-9.-]*[a-z0-9])", page.read_text())) - {"goblin.yaml"}:
            mentioned.setdefault(key, []).append(page.name)
    assert len(mentioned) > 10
    unknown = {k: v for k, v in mentioned.items() if k not in keys | groups}
    assert unknown == {}, f"pages mention settings goblin.yaml lacks: {unknown}"


def test_every_key_read_is_in_goblin_yaml_and_back():
    keys = set(_leaves(settings.defaults))
    read = {}
    for root in SOURCES:
        for path in root.rglob("*.py"):
            for key in READ.findall(path.read_text()):
                read.setdefault(key, []).append(path.name)
    assert read, "the scan found no reads: the pattern is out of date"
    groups = {k.rsplit(".", i)[0] + "." for k in keys for i in range(1, k.count(".") + 1)}  # "goblin.signin." + name
    unknown = {k: v for k, v in read.items() if k not in keys | groups and k != "goblin"}
    assert unknown == {}, f"keys read but missing from goblin.yaml: {unknown}"
    assert not [k for k in read if "{" in k], "read keys literally, so that this scan sees them"
    unread = {k for k in keys if k not in read and not any(k.startswith(p) for p in read if p.endswith("."))}
    assert unread == set(), "goblin.yaml keys that no module reads"


def test_partial_group_keeps_the_other_defaults():
    from goblin_dask.access.signin import SignInLimits

    with dask.config.set({"goblin.faults": {"cooldown": 1}}):
        assert settings.get("goblin.faults.cooldown") == 1
        assert settings.get("goblin.faults.max-attempts") == settings.default("goblin.faults.max-attempts")
    assert {f.name.replace("_", "-") for f in fields(SignInLimits)} == set(settings.defaults["goblin"]["signin"])
    assert SignInLimits() == SignInLimits.from_config()
    with pytest.raises(KeyError):
        settings.default("goblin.no-such-key")


def test_scheduler_preload_gets_the_defaults(tmp_path):
    """``dask scheduler --preload scheduler_plugins`` imports goblin_dask, which loads goblin.yaml."""
    code = ("import dask, scheduler_plugins; "
            "print(dask.config.get('goblin.link.standby'), dask.config.get('goblin.verification.deadline'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=tmp_path,
                         env={**os.environ, "DASK_GOBLIN__LINK__STANDBY": "5"})
    assert out.stdout.split() == ["5", str(settings.default("goblin.verification.deadline"))]


if __name__ == "__main__":
    print(settings_table())
