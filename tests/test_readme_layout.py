"""The README's layout section names every module, so that a newcomer finds the room for a change from it.

The section is read as entries: a line indented two spaces starts one, its
name column (``settings``, ``plugins, hookspecs``, ``protocol/wire``,
``storage/``) then its text after two or more spaces; deeper-indented lines
continue it. A module of ``core/`` or ``backends/`` itself must be in an
entry's name column; one in a subfolder (``storage/``, a backend's) must be
named in that folder's entry, and one in ``xla/export/`` after ``export/``
there. A name that only shows up in some other line's prose does not count.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def layout_entries() -> dict[str, str]:
    """Each entry's names (from its name column) mapped to its whole text."""
    readme = (ROOT / "README.md").read_text()
    start = readme.index("## Development")
    section = readme[start:readme.index("The protobuf modules", start)]
    entries: list[tuple[list[str], list[str]]] = []
    current: tuple[list[str], list[str]] | None = None
    for line in section.splitlines():
        entry = re.match(r"^  (\S.*?)(?: {2,}(.*))?$", line)
        if entry is not None:
            current = ([name.strip() for name in entry.group(1).split(",")], [entry.group(2) or ""])
            entries.append(current)
        elif line.startswith("   ") and current is not None:
            current[1].append(line.strip())
        else:
            current = None  # a top-level line (core/, backends/, tests/) and what continues it
    return {name: " ".join(text) for names, text in entries for name in names}


def _named_in(text: str, stem: str) -> bool:
    return re.search(rf"(?<![\w/]){stem}(?![\w/])", text) is not None


def test_every_module_of_both_packages_is_named_in_its_own_entry() -> None:
    entries = layout_entries()
    missing = []
    for path in sorted([*ROOT.glob("core/**/*.py"), *ROOT.glob("backends/**/*.py")]):
        parts = path.relative_to(ROOT).parts
        if path.stem == "__init__" or "_proto" in parts or (parts[0] == "backends" and path.stem == "plugin"):
            continue  # a package is named by its folder; "each with a plugin module"
        inner = parts[1:-1]  # the folders between core/ or backends/ and the module
        if not inner:
            found = path.stem in entries
        elif parts[0] == "core" and inner == ("protocol",):
            found = f"protocol/{path.stem}" in entries
        elif inner[-1] == "export":
            text = entries.get(f"{inner[0]}/", "")
            found = "export/" in text and _named_in(text.split("export/", 1)[1], path.stem)
        else:
            found = _named_in(entries.get(f"{inner[0]}/", ""), path.stem)
        if not found:
            missing.append(str(path.relative_to(ROOT)))
    assert missing == [], f"README's layout section does not name, each in its own entry: {missing}"


def test_every_backend_has_an_entry() -> None:
    entries = layout_entries()
    backends = sorted(path.parent.name for path in ROOT.glob("backends/*/plugin.py"))
    assert [name for name in backends if f"{name}/" not in entries] == []
