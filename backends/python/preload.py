"""Which modules a python model's warm parent imports: read from ``main.py``, never run."""

from __future__ import annotations

import ast
import importlib.machinery
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
    return [name for name, _ in _top_level_imports(_top_level_names(_checked_tree(main_py, source)))]


def _checked_tree(main_py: Path, source: bytes) -> ast.Module:
    """``main.py`` parsed; ConfigError when ``python main.py`` would stop at a SyntaxError."""
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
    return tree


def _top_level_imports(names: list[tuple[str, bool, bool]]) -> list[tuple[str, bool]]:
    """Each module the body's ``import`` / ``from`` statements name (of :func:`_top_level_names`), first
    occurrence only, with whether only imports and docstrings come before it (``__future__`` skipped)."""
    return [(name, leading) for name, leading, taken in names if not taken and name != "__future__"]


def _from_names(names: list[tuple[str, bool, bool]]) -> list[str]:
    """``package.name`` for each ``from package import name`` of the body (of :func:`_top_level_names`): a
    submodule when the package has no attribute of that name (``from scipy import signal``), which Python then
    imports."""
    return [name for name, _, taken in names if taken and not name.startswith("__future__.")]


def _top_level_names(tree: ast.Module) -> list[tuple[str, bool, bool]]:
    """(module, leading, whether a ``from`` statement takes it from its package) for each import of the body."""
    found: dict[str, tuple[bool, bool]] = {}
    leading = True
    for statement in tree.body:
        if isinstance(statement, ast.Import):
            names = [(alias.name, False) for alias in statement.names]
        elif isinstance(statement, ast.ImportFrom) and statement.level == 0 and statement.module:
            names = [(statement.module, False), *((f"{statement.module}.{alias.name}", True)
                                                  for alias in statement.names if alias.name != "*")]
        else:
            # Anything else may change what an import after it finds (a sys.path entry, an environment variable);
            # a string on its own (a docstring) cannot.
            docstring = isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            leading = leading and docstring
            continue
        for name, taken in names:
            if name not in found or (found[name][1] and not taken):
                # (an import of it, or a from-statement naming it as its package, wins over a from-statement's
                # name: that one is imported for itself, as main.py's own import, with its own leading)
                found[name] = (leading if name not in found else found[name][0], taken)
    return [(name, leading, taken) for name, (leading, taken) in found.items()]


# The file names import finds a module by in a folder: extensions, sources, then bytecode (as its FileFinder).
MODULE_SUFFIXES = tuple(importlib.machinery.all_suffixes())


def lives_in_folder(module: str, folder: Path) -> bool:
    """True when ``module``'s top-level package is a file or package in the model folder.

    Those are the model's own helpers: a child imports them fresh, so an edit
    takes effect on the next request, exactly as with a cold start.
    """
    top = module.split(".", 1)[0]
    # Any file import finds there: a compiled extension (Cython, pybind11) or a sourceless .pyc too, which were
    # taken for installed modules, preloaded where the folder is not on sys.path, and the load failed.
    return (folder / top).is_dir() or any((folder / f"{top}{suffix}").is_file() for suffix in MODULE_SUFFIXES)


@dataclass(frozen=True)
class Preloads:
    """What a warm parent imports before it forks its first child, in order.

    ``imports``: main.py's own top-level imports that nothing but other such
    imports precedes. One that fails would stop every run at that line, so it
    fails the load. ``extra``: main.py's later imports (after a statement that
    may change what they find, such as a ``sys.path.insert``), then the
    model's ``runtime.preload`` list, imported only to save each run the time;
    one that fails turns warm start off instead.
    """

    imports: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    # ``package.name`` of main.py's ``from package import name`` (of packages above): imported after them when
    # ``name`` is a submodule, not an attribute (``from scipy import signal`` imports scipy.signal, which the
    # package alone does not); one that fails turns warm start off, as an ``extra`` does.
    submodules: tuple[str, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.imports or self.extra)

    def as_json(self) -> dict[str, list[str]]:
        """The warm parent's ``MODULES_JSON`` argument."""
        return {"imports": list(self.imports), "extra": list(self.extra), "submodules": list(self.submodules)}


def modules_to_preload(folder: Path, entry_file: str, extra: tuple[str, ...], source: bytes) -> Preloads:
    """``main.py``'s installed and standard-library imports, then ``extra``, minus the folder's own.

    ``imports`` are those the warm parent reaches as ``python main.py`` does:
    with only other such imports and docstrings before them. An import after
    any other statement (a ``sys.path.insert``, say) or after an import of the
    folder's own modules (which the parent leaves to each run) goes with
    ``extra``: it may fail in the parent and work in ``main.py``. ``source``:
    ``main.py``'s bytes, as the caller read them once.
    """
    imports: list[str] = []
    later: list[str] = []
    reached = True  # by the parent as by main.py: no statement it skips has come before
    names = _top_level_names(_checked_tree(folder / entry_file, source))  # (read once, for both kinds)
    for name, leading in _top_level_imports(names):
        if lives_in_folder(name, folder):
            reached = False
        elif leading and reached:
            imports.append(name)
        else:
            later.append(name)
    chosen = [*later, *(name for name in extra if name not in imports)]
    extra_kept = tuple(name for name in dict.fromkeys(chosen) if not lives_in_folder(name, folder))
    preloaded = {*imports, *extra_kept}
    submodules: list[str] = []
    for name in _from_names(names):  # in order: a submodule's own submodules come after it
        if name.rpartition(".")[0] in preloaded:
            submodules.append(name)
            preloaded.add(name)
    return Preloads(tuple(imports), extra_kept, tuple(submodules))
