"""Which modules a python model's warm parent imports: read from ``main.py``, never run."""

from __future__ import annotations

import ast
import importlib.machinery
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from nereid import python_source
from nereid.backends.subprocess.model import INHERITED_ENV
from nereid.backends.subprocess.runner import DEFAULT_PATH
from nereid.errors import ConfigError


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
    problem = python_source.undecodable(source)
    if problem is not None:
        raise ConfigError(f"{main_py}: not valid Python ({problem})")
    try:
        tree = python_source.parse(source, filename=str(main_py))
        # Some errors only the compiler finds ('return' outside a function, 'break' outside a loop, a
        # module-level 'nonlocal', 'await' outside an async function): each run would fail on them, and
        # with a reload the working version would be replaced by one that cannot run. dont_inherit: as
        # the warm parent compiles (this module's own __future__ imports are not main.py's).
        compile(source, str(main_py), "exec", dont_inherit=True)
    except SyntaxError as err:
        raise ConfigError(f"{main_py}: not valid Python ({python_source.syntax_error_text(err)})") from None
    except ValueError as err:  # null bytes
        raise ConfigError(f"{main_py}: not valid Python ({err})") from None
    return tree


def _top_level_imports(names: list[tuple[str, bool, bool]]) -> list[tuple[str, bool]]:
    """Each module the body's ``import`` / ``from`` statements name (of :func:`_top_level_names`), first
    occurrence only, with whether only imports and statements that cannot change what they find come before it
    (``__future__`` skipped)."""
    return [(name, leading) for name, leading, taken in names if not taken and name != "__future__"]


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
            leading = leading and _leaves_imports_alone(statement)
            continue
        for name, taken in names:
            if name not in found or (found[name][1] and not taken):
                # (an import of it, or a from-statement naming it as its package, wins over a from-statement's
                # name: that one is imported for itself, as main.py's own import, with its own leading)
                found[name] = (leading if name not in found else found[name][0], taken)
    return [(name, leading, taken) for name, (leading, taken) in found.items()]


# Dunder names a plain constant may be given before an import without ending main.py's leading imports: they
# are only read by tools. Any other (``__builtins__``, which ``import`` itself goes through; ``__path__``,
# ``__spec__``...) ends them.
_INERT_DUNDERS = frozenset({"__all__", "__version__", "__author__", "__doc__"})


def _leaves_imports_alone(statement: ast.stmt) -> bool:
    """Whether a statement of main.py's body (not an import) cannot change what an import after it finds, or
    how the imported module runs: a constant on its own (a docstring), ``pass``, or a plain constant
    assignment (``VERSION = "1.2"``, ``SIZES: tuple = (1, 2)``: names, a literal, no call).

    Anything else may: ``os.environ["JAX_ENABLE_X64"] = "1"`` or
    ``sys.path.insert(0, "vendor")`` before ``import jax`` changes what that
    import loads (libraries read such variables as they are imported), and
    no reading of the source can tell which call does.
    """
    if isinstance(statement, ast.Pass):
        return True
    if isinstance(statement, ast.Expr):
        return isinstance(statement.value, ast.Constant)
    if isinstance(statement, ast.Assign):
        targets, value = statement.targets, statement.value
    elif isinstance(statement, ast.AnnAssign):
        # (the annotation is evaluated too, unless `from __future__ import annotations`: a name or a string only)
        if not isinstance(statement.annotation, (ast.Name, ast.Constant)):
            return False
        targets, value = [statement.target], statement.value
    else:
        return False
    if not all(isinstance(target, ast.Name) and (not _dunder(target.id) or target.id in _INERT_DUNDERS)
               for target in targets):
        return False
    if value is None:
        return True
    try:
        ast.literal_eval(value)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return True


def _dunder(name: str) -> bool:
    return len(name) > 4 and name.startswith("__") and name.endswith("__")


def _first_unsafe_line(tree: ast.Module) -> int | None:
    """The line of main.py's first top-level statement that may change what an import after it finds."""
    for statement in tree.body:
        if isinstance(statement, ast.Import) or (
                isinstance(statement, ast.ImportFrom) and statement.level == 0 and statement.module):
            continue
        if not _leaves_imports_alone(statement):
            return statement.lineno
    return None


# The module of Triton's Python backend, and the class a model of that backend defines (which Triton instantiates).
TRITON_UTILS = "triton_python_backend_utils"
TRITON_MODEL_CLASS = "TritonPythonModel"


def triton_python_model(source: bytes) -> str | None:
    """What in ``main.py``'s ``source`` shows a model of Triton's Python backend, ported as it is (``imports
    triton_python_backend_utils``; ``defines class TritonPythonModel and runs nothing at its top level``); None
    for any other (a port that defines the class and calls it from its top-level code included).

    nereid calls no ``TritonPythonModel``: main.py's top-level code is the run. Said at load and with the runs'
    failures (the new user's hunt: such a model failed every run with "exited 0 without writing its output").
    Most sources pass on a substring test; only those naming either are parsed.
    """
    if TRITON_UTILS.encode() not in source and TRITON_MODEL_CLASS.encode() not in source:
        return None
    try:
        tree = python_source.parse(source)
    except (SyntaxError, ValueError):  # (the load refuses it, saying why: see _checked_tree)
        return None
    for node in ast.walk(tree):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        if any(name == TRITON_UTILS or (name or "").startswith(f"{TRITON_UTILS}.") for name in names):
            return f"imports {TRITON_UTILS}"
    defines = any(isinstance(statement, ast.ClassDef) and statement.name == TRITON_MODEL_CLASS
                  for statement in tree.body)
    if defines and all(_runs_nothing(statement) for statement in tree.body):
        return f"defines class {TRITON_MODEL_CLASS} and runs nothing at its top level"
    return None


def _runs_nothing(statement: ast.stmt) -> bool:
    """Whether a statement of main.py's body only defines (an import, a def, a class, a docstring, a constant): a
    body made of such statements computes and writes nothing."""
    return isinstance(statement, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
        or _leaves_imports_alone(statement)


# The file names import finds a module by in a folder: extensions, sources, then bytecode (as its FileFinder).
MODULE_SUFFIXES = tuple(importlib.machinery.all_suffixes())


def lives_in_folder(module: str, folder: Path) -> bool:
    """True when ``module``'s top-level package is a file or package in the model folder that ``python main.py``
    would import from there.

    Those are the model's own helpers: a child imports them fresh, so an edit
    takes effect on the next request, exactly as with a cold start. A folder
    without ``__init__.py`` (a checkpoint folder ``jax/``, ``numpy/`` of
    ``.npy`` files) is the model's own only when nothing else provides the name:
    a namespace portion, first on ``sys.path`` as it is, loses to any module or
    regular package found later on it.
    """
    top = module.split(".", 1)[0]
    # Any file import finds there: a compiled extension (Cython, pybind11) or a sourceless .pyc too, which were
    # taken for installed modules, preloaded where the folder is not on sys.path, and the load failed.
    if any((folder / f"{top}{suffix}").is_file() for suffix in MODULE_SUFFIXES):
        return True
    package = folder / top
    if not package.is_dir():
        return False
    # A regular package (its __init__ of any kind import takes) comes first on sys.path, as the folder does.
    regular = any((package / f"__init__{suffix}").is_file() for suffix in MODULE_SUFFIXES)
    return regular or not _provided_elsewhere(top, folder)


def server_pythonpath_entry(failure: str) -> str | None:
    """The entry of the server's own ``PYTHONPATH`` that holds the module a ``ModuleNotFoundError`` in ``failure``
    names, or None: model runs do not inherit ``PYTHONPATH`` (the interpreter is started with ``-P`` and without
    it), so a module the server itself imports from there is missing in the runs, with nothing saying why (the
    python-models hunt: an image's ``ENV PYTHONPATH=/app``)."""
    missing = re.search(r"No module named '([^']+)'", failure)
    return None if missing is None else _pythonpath_entry_holding(missing.group(1).partition(".")[0])


def _pythonpath_entry_holding(top: str) -> str | None:
    """The first entry of the server's own ``PYTHONPATH`` where ``import top`` finds it; None when none does."""
    for entry in (entry for entry in os.environ.get("PYTHONPATH", "").split(os.pathsep) if entry):
        try:
            if importlib.machinery.PathFinder.find_spec(top, [entry]) is not None:
                return entry
        except (ImportError, ValueError, OSError):
            continue
    return None


def pythonpath_hint(entry: str) -> str:
    """What to say of a module only the server's ``PYTHONPATH`` entry ``entry`` holds (see
    :func:`server_pythonpath_entry`)."""
    return (f" (the server's PYTHONPATH holds it, in {entry}, but model runs do not inherit PYTHONPATH: install the "
            "package into the interpreter nereid runs under, or list its folder in a .pth file of that interpreter's "
            "site-packages)")


def only_on_server_pythonpath(imports: tuple[str, ...], folder: Path) -> tuple[str, str] | None:
    """The first of main.py's top-level ``imports`` that model runs cannot import, the model folder not holding it
    and the interpreter's own path not finding it, but that the server's ``PYTHONPATH`` holds, with that entry;
    None when there is none. For a cold model, whose load imports nothing: every run would fail on it."""
    for name in imports:
        top = name.partition(".")[0]
        if lives_in_folder(top, folder) or _provided_elsewhere(top, folder):
            continue
        entry = _pythonpath_entry_holding(top)
        if entry is not None and not _runs_find(top):
            return top, entry
    return None


# What a run's interpreter is asked: whether its own import system (sys.path and sys.meta_path: an editable
# install's finder, a .pth file's folder) finds the module named; exit 0 yes, 3 no.
_RUNS_FIND_PROGRAM = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec(sys.argv[1]) else 3)"


def _runs_find(top: str) -> bool:
    """Whether a model run's interpreter finds ``top``, asked of an interpreter started as runs are (``-P``, only
    the variables runs inherit), at each ask: an entry of the server's PYTHONPATH that runs have too
    (site-packages, a .pth file's folder) is in the server's sys.path once, as PYTHONPATH's, and a cold numpy
    model was refused though its runs import numpy (the review hunt); a package an editable install's finder
    serves is on no path at all, and a .pth file written after the refusal, as its hint says, was never looked
    at again until a restart (the next review hunt). True when it cannot be asked (refused only when sure)."""
    env = {key: os.environ[key] for key in INHERITED_ENV if key in os.environ}
    env.setdefault("PATH", DEFAULT_PATH)
    try:
        asked = subprocess.run([sys.executable, "-P", "-c", _RUNS_FIND_PROGRAM, top], env=env,
                               stdin=subprocess.DEVNULL, capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return True
    return asked.returncode != 3


def _provided_elsewhere(top: str, folder: Path) -> bool:
    """Whether ``import top`` finds a module or regular package outside ``folder``: built in, frozen, or on the
    ``sys.path`` the runs have (the server's interpreter started with ``-P`` and without ``PYTHONPATH``)."""
    if importlib.machinery.BuiltinImporter.find_spec(top) or importlib.machinery.FrozenImporter.find_spec(top):
        return True
    try:
        resolved = folder.resolve()
    except OSError:
        resolved = folder
    # Not the server's working directory (``python -m nereid.cli`` puts it first) nor its PYTHONPATH, which runs
    # do not have: a package of the name there made the model's own namespace folder pass for installed, and
    # the parent's copy of it was served, stale, after an edit (found by the session's review).
    server_only = {_resolved(os.curdir), *(_resolved(entry) for entry in os.environ.get("PYTHONPATH", "").split(
        os.pathsep) if entry)}
    path = [entry for entry in sys.path if entry and entry != os.curdir
            and _resolved(entry) not in (resolved, *server_only)]
    try:
        spec = importlib.machinery.PathFinder.find_spec(top, path)
    except (ImportError, ValueError, OSError):
        return False
    return spec is not None and spec.origin is not None  # (a namespace package has none: the folder joins it)


def _resolved(entry: str) -> Path | None:
    try:
        return Path(entry).resolve()
    except OSError:
        return None


@dataclass(frozen=True)
class Preloads:
    """What a warm parent imports before it forks its first child, in order.

    ``imports``: main.py's own top-level imports that nothing but other such
    imports, docstrings and plain constant assignments precedes. One that
    fails would stop every run at that line, so it fails the load. ``extra``:
    the model's ``runtime.preload`` list, imported only to save each run the
    time; one that fails turns warm start off instead.
    """

    imports: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    # ``package.name`` of main.py's ``from package import name`` (of packages above): imported after them when
    # ``name`` is a submodule, not an attribute (``from scipy import signal`` imports scipy.signal, which the
    # package alone does not); one that fails turns warm start off, as an ``extra`` does (one that does not exist
    # fails the load: see warm_parent._no_such_name).
    submodules: tuple[str, ...] = ()
    # main.py's imports that are not preloaded, each run importing them as python main.py does (they come after
    # a statement that may change what they find), and why (empty when none is).
    left: tuple[str, ...] = ()
    left_because: str = ""

    def __bool__(self) -> bool:
        return bool(self.imports or self.extra)

    def as_json(self) -> dict[str, list[str]]:
        """The warm parent's ``MODULES_JSON`` argument."""
        return {"imports": list(self.imports), "extra": list(self.extra), "submodules": list(self.submodules)}


def modules_to_preload(folder: Path, entry_file: str, extra: tuple[str, ...], source: bytes) -> Preloads:
    """``main.py``'s installed and standard-library imports, then ``extra``, minus the folder's own.

    ``imports`` are those the warm parent reaches as ``python main.py`` does:
    with only other such imports, docstrings and plain constant assignments
    before them. An import after any other statement (``os.environ[...] =``,
    ``sys.path.insert``) or after an import of the folder's own modules (which
    may do the same) is left to each run, as ``python main.py`` imports it then
    (``left``): preloaded, it would be imported without what that statement
    did. ``extra`` (``runtime.preload``) is preloaded all the same. ``source``:
    ``main.py``'s bytes, as the caller read them once.
    """
    tree = _checked_tree(folder / entry_file, source)
    names = _top_level_names(tree)  # (read once, for both kinds)
    imports: list[str] = []
    left: list[str] = []
    from_names: list[str] = []  # of the from-statements main.py reaches as the parent does
    because = ""  # why the imports from here on are left to each run
    for name, leading, taken in names:
        if name == "__future__" or name.startswith("__future__."):
            continue
        if not because and not leading:
            because = (f"they come after line {_first_unsafe_line(tree)} of main.py, which may change what they find "
                       "(an environment variable, a sys.path entry)")
        if lives_in_folder(name, folder):
            if not because and not taken:
                because = f"they come after main.py imports its own '{name}', which may change what they find"
        elif taken:
            if not because:
                from_names.append(name)
        elif because:
            left.append(name)
        else:
            imports.append(name)
    extra_kept = tuple(name for name in dict.fromkeys(extra)
                       if name not in imports and not lives_in_folder(name, folder))
    preloaded = {*imports, *extra_kept}
    submodules: list[str] = []
    for name in from_names:  # in order: a submodule's own submodules come after it
        if name.rpartition(".")[0] in preloaded:
            submodules.append(name)
            preloaded.add(name)
    left = [name for name in left if name not in preloaded]
    return Preloads(tuple(imports), extra_kept, tuple(submodules), tuple(left), because if left else "")
