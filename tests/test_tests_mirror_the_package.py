"""Every module of ``core/`` and ``backends/`` has its tests at the mirrored path, so that a newcomer who changes
``core/x/y.py`` finds them in ``tests/core/x/test_y.py`` (or ``test_y_<aspect>.py``: ``test_scheduler_batching.py``
tests ``scheduler.py``'s batching).

Generated code and entry points of one line are exempt; a test file that mirrors no module (an end-to-end file
across modules, such as ``test_security.py``) is allowed, but no module may be left without its own.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Modules with no tests of their own, and why.
EXEMPT = {
    "core/__main__.py": "`python -m nereid`: two lines calling the entry point (tests/core/test_entry.py runs it)",
    "core/_proto/regenerate.py": "a developer's script that regenerates the protobuf modules",
}


def _modules() -> list[Path]:
    found = []
    for path in sorted([*ROOT.glob("core/**/*.py"), *ROOT.glob("backends/**/*.py")]):
        relative = path.relative_to(ROOT)
        if path.name == "__init__.py" or relative.parts[:2] == ("core", "_proto") and path.stem.endswith("_pb2"):
            continue
        found.append(relative)
    return found


def _mirrored_tests(module: Path) -> list[Path]:
    folder = ROOT / "tests" / module.parent
    return [*folder.glob(f"test_{module.stem}.py"), *folder.glob(f"test_{module.stem}_*.py")]


def test_every_module_has_a_test_file_at_its_mirrored_path() -> None:
    missing = [str(module) for module in _modules()
               if str(module) not in EXEMPT and not _mirrored_tests(module)]
    assert not missing, ("modules without tests/<same path>/test_<module>[_<aspect>].py: "
                         f"{', '.join(missing)}")


def test_the_exemptions_name_modules_that_exist() -> None:
    assert all((ROOT / name).is_file() for name in EXEMPT)
