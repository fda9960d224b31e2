"""Which modules a python model's warm parent imports: read from ``main.py``, never run."""

from __future__ import annotations

import ast
import threading
from dataclasses import dataclass
from pathlib import Path

from nereid.errors import ConfigError


# CPython 3.11 counts the AST constructor's recursion in interpreter-wide state, so two threads
# parsing at once can fail with "SystemError: AST constructor recursion depth mismatch"
# (python/cpython#106905). Models load on worker threads, side by side: parse one at a time.
_PARSING = threading.Lock()


def imported_modules(main_py: Path, source: bytes) -> list[str]:
    """The modules that ``main.py``'s top-level ``import`` and ``from`` statements name, in order.

    Only statements directly in the module body count (not those inside
    functions, ``if`` or ``try`` blocks: those may be conditional on purpose).
    Relative imports and ``__future__`` are skipped. ``source``: the file's
    bytes, as the caller read them once (``main_py`` names them in errors).
    Raises ConfigError when ``python main.py`` would stop at a SyntaxError:
    the source is compiled too, not only parsed.
    """
    try:
        with _PARSING:
            tree = ast.parse(source, filename=str(main_py))
        # Some errors only the compiler finds ('return' outside a function, 'break' outside a loop, a
        # module-level 'nonlocal', 'await' outside an async function): each run would fail on them, and
        # with a reload the working version would be replaced by one that cannot run. dont_inherit: as
        # the warm parent compiles (this module's own __future__ imports are not main.py's).
        compile(source, str(main_py), "exec", dont_inherit=True)
    except SyntaxError as err:
        raise ConfigError(f"{main_py}: not valid Python (line {err.lineno}: {err.msg})") from None
    except ValueError as err:  # null bytes
        raise ConfigError(f"{main_py}: not valid Python ({err})") from None
    names: list[str] = []
    for statement in tree.body:
        if isinstance(statement, ast.Import):
            names.extend(alias.name for alias in statement.names)
        elif isinstance(statement, ast.ImportFrom) and statement.level == 0 and statement.module:
            names.append(statement.module)
    return [name for name in dict.fromkeys(names) if name != "__future__"]


def lives_in_folder(module: str, folder: Path) -> bool:
    """True when ``module``'s top-level package is a file or package in the model folder.

    Those are the model's own helpers: a child imports them fresh, so an edit
    takes effect on the next request, exactly as with a cold start.
    """
    top = module.split(".", 1)[0]
    return (folder / f"{top}.py").is_file() or (folder / top).is_dir()


@dataclass(frozen=True)
class Preloads:
    """What a warm parent imports before it forks its first child, in order.

    ``imports``: main.py's own top-level imports. One that fails would stop
    every run at that line, so it fails the load. ``extra``: the model's
    ``runtime.preload`` list, imported only to save each run the time; one
    that fails turns warm start off instead.
    """

    imports: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.imports or self.extra)

    def as_json(self) -> dict[str, list[str]]:
        """The warm parent's ``MODULES_JSON`` argument."""
        return {"imports": list(self.imports), "extra": list(self.extra)}


def modules_to_preload(folder: Path, entry_file: str, extra: tuple[str, ...], source: bytes) -> Preloads:
    """``main.py``'s installed and standard-library imports, then ``extra``, minus the folder's own.

    ``source``: ``main.py``'s bytes, as the caller read them once.
    """
    imports = [name for name in imported_modules(folder / entry_file, source) if not lives_in_folder(name, folder)]
    extra = [name for name in dict.fromkeys(extra) if name not in imports and not lives_in_folder(name, folder)]
    return Preloads(tuple(imports), tuple(extra))
