"""Building the plugin manager and asking backends to claim a folder.

One broken installed plugin must cost only itself: a plugin that cannot be
loaded, or that nereid could never call (a misnamed hook, a hook function
without ``@hookimpl``), is left out, and a hook of it that raises (or answers
nonsense) counts as no answer from it; a wrapper of a hook that raises is left
out of that hook from then on. Each such problem is logged once,
naming the plugin and the distribution and entry point it came from; ``nereid
check`` lists the plugins left out, and a model declaring the backend of one
is told why it was left out.
"""

from __future__ import annotations

import difflib
import importlib
import importlib.metadata
import inspect
import logging
import os
import re
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import pluggy
from pluggy._hooks import _SubsetHookCaller  # (pluggy's own subset caller; see subset_hook_caller)

from nereid import hookspecs
from nereid.backend import BackendClaim
from nereid.config_document import closest_key, same_values
from nereid.errors import ConfigError, cap_message, describe_exception, plugin_failures
from nereid.runtime_options import layered_runtime
from nereid.settings import DEFAULT_CONFIG_NAME
from nereid.storage.client import store_failed
from nereid.storage.mirror import StreamedFiles
from nereid.triton_hints import folder_hint

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "nereid.backends"

# Built-in backends, registered exactly like third-party ones: each module is a
# plugin whose ``BACKEND_NAME`` is its registration name.
BUILTIN_BACKENDS: tuple[str, ...] = (
    "nereid.backends.python.plugin",
    "nereid.backends.cpp.plugin",
    "nereid.backends.cxx.plugin",
    "nereid.backends.xla.plugin",
    "nereid.backends.meta.plugin",
)


@dataclass(frozen=True)
class ClaimResult:
    """The outcome of asking the backends about one folder: a claim and its backend's name, or a reason."""

    claim: BackendClaim | None
    reason: str = ""
    backend_name: str = ""


# The hooks asked once, as a command starts: a plugin's failure in one is among the ``problems`` nereid check reports.
_STARTUP_HOOKS = frozenset({"nereid_add_commands"})


@dataclass(frozen=True)
class PluginProblem:
    """An installed plugin that was left out (or one of its start-up hooks that failed), and why."""

    plugin: str  # as :meth:`NereidPluginManager.describe` names it
    what: str  # "left out: <why>", "what its nereid_add_commands adds is left out: <why>"


class NereidPluginManager(pluggy.PluginManager):
    """pluggy's plugin manager, knowing where each installed plugin came from and what went wrong with it.

    ``problems`` lists the plugins left out at start-up and the ``nereid_add_commands``
    hooks (or wrappers of it) that failed (what ``nereid check`` reports); a claim or hint hook that
    fails is only logged, once per plugin and hook, and said in the reason of
    each model it leaves unclaimed.
    """

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.problems: list[PluginProblem] = []
        self._origins: dict[str, str] = {}  # registration name -> "distribution D V, entry point N = M"
        self._distributions: dict[str, str] = {}  # registration name -> its distribution's normalized name
        self._builtins: set[str] = set()
        self._left_out: dict[str, list[str]] = {}  # registration name meant -> "plugin '...' (...) was left out: why"
        self._failed_hooks: set[tuple[str, str]] = set()
        self._failed_hooks_lock = threading.Lock()  # folders are claimed on several loading threads at once
        self._failed_wrappers: set[tuple[str, str]] = set()  # (registration name, hook): left out of that hook

    def subset_hook_caller(self, name: str, remove_plugins: Iterable[object]) -> pluggy.HookCaller:
        """``hook`` called without the implementations of ``remove_plugins``, whatever their functions' names.

        pluggy keeps only the plugins that have an attribute named after the
        hook, so one whose implementation is declared with ``specname=`` was
        never left out: its claim was credited to every backend asked alone,
        and its failing wrapper blamed on each of them.
        """
        orig: pluggy.HookCaller = getattr(self.hook, name)
        plugins = _ByIdentity(remove_plugins)
        return _SubsetHookCaller(orig, plugins) if plugins else orig

    def register_builtin(self, plugin: object, name: str) -> None:
        """Register one of core's own backends under ``name``."""
        self.register(plugin, name=name)
        self._builtins.add(name)

    def describe(self, name: str) -> str:
        """How a log line or a reason names the plugin registered (or meant to be) as ``name``."""
        if name in self._builtins:
            return f"built-in backend '{name}'"
        origin = self._origins.get(name)
        return f"plugin '{name}' ({origin})" if origin else f"plugin '{name}'"

    def load_installed(self, group: str = ENTRY_POINT_GROUP) -> None:
        """Register every plugin installed under the entry-point ``group``, leaving out those that fail.

        What pluggy's ``load_setuptools_entrypoints`` does, except that one
        plugin that cannot be imported or registered no longer stops every
        ``nereid`` command, and a plugin whose name is taken (a built-in's,
        say) is reported instead of silently dropped.
        """
        for dist in importlib.metadata.distributions():
            try:
                entry_points = [point for point in dist.entry_points if point.group == group]
            except Exception as err:  # noqa: BLE001 - one unreadable installed package costs only itself
                # A malformed or non-UTF-8 entry_points.txt of any installed package (not even a plugin) was a
                # traceback of every nereid command (the CLI read hunt); it may hold a nereid plugin: said.
                log.warning("plugins: cannot read the entry points of %s (%s); any nereid plugin it holds is left "
                            "out", getattr(dist, "_path", "an installed distribution"),
                            describe_exception(err, one_line=True))
                continue
            for entry_point in entry_points:
                if not self.is_blocked(entry_point.name):
                    self._load_entry_point(dist, entry_point)

    def _load_entry_point(self, dist: importlib.metadata.Distribution,
                          entry_point: importlib.metadata.EntryPoint) -> None:
        name = entry_point.name
        try:
            # (A dist-info without METADATA has no name: described as such, never a crash of every command; nor
            # is one whose METADATA is no UTF-8: the CLI read hunt.)
            named = dist.metadata.get("Name") or "(no name)"  # (["Name"] of a missing key: deprecated in 3.12)
            version = dist.version
        except Exception:  # noqa: BLE001 - described without them
            named, version = "(unreadable metadata)", "?"
        origin = f"distribution {named} {version}, entry point {name} = {entry_point.value}"
        distribution = _normalized(named)
        if self.has_plugin(name):
            if self._distributions.get(name) == distribution:
                # The same distribution found again further down sys.path (a --user install over a
                # system one, a stale egg-info beside an editable install): the first one is what Python
                # imports, and it is registered; the shadowed copy is no second plugin.
                return
            self._leave_out(name, f"plugin '{name}' ({origin})",
                            f"its name is already taken by the {self.describe(name)}; rename its entry point")
            return
        try:
            plugin = entry_point.load()
            registered_as = self.get_name(plugin)
            if registered_as is not None:
                # pluggy registers an object once: its ValueError would print the whole registry, naming neither
                # entry point. Two entry points naming one module would be one backend answering to two names.
                self._leave_out(name, f"plugin '{name}' ({origin})",
                                f"{entry_point.value} is already registered, as the {self.describe(registered_as)}; "
                                "give each backend a module of its own")
                return
            self.register(plugin, name=name)
        except plugin_failures() as err:  # an import error (or exit), a hookimpl not matching its hookspec, ...
            if self.has_plugin(name):
                self.unregister(name=name)  # pluggy may have added some of its hooks before refusing one
            self._leave_out(name, f"plugin '{name}' ({origin})", error_text(err))
            return
        unusable = hook_problems(self, plugin)
        if unusable:  # pluggy accepts these silently: the plugin would be asked nothing, and nothing would say why
            self.unregister(name=name)
            self._leave_out(name, f"plugin '{name}' ({origin})", "; ".join(unusable))
            return
        self._origins[name] = origin
        self._distributions[name] = distribution

    def _leave_out(self, name: str, plugin: str, reason: str) -> None:
        self._problem(plugin, f"left out: {reason}")
        self._left_out.setdefault(name, []).append(f"{plugin} was left out: {reason}")

    def left_out(self, name: str) -> str:
        """Why the installed plugin(s) meant to be registered as ``name`` were left out, as logged; "" if none was.

        What a model declaring ``backend: NAME`` is told, rather than that no such backend is installed.
        """
        return "; ".join(self._left_out.get(name, ()))

    def left_out_names(self) -> list[str]:
        """The registration names of the installed plugins left out, sorted. A name a registered backend answers
        to all the same (a built-in's, or a plugin's that came first on the path) says so: the folders the
        left-out one was meant to claim go to that backend now, or to none."""
        backends = set(backend_names(self))
        return [name if name not in backends else f"{name} (a name another backend took)"
                for name in sorted(self._left_out)]

    def startup_hook_failed(self, name: str, hook: str, reason: str) -> None:
        """A start-up hook of plugin ``name`` failed: log it and list it among the ``problems``."""
        self._problem(self.describe(name), f"what its {hook} adds is left out: {reason}")

    def _problem(self, plugin: str, what: str) -> None:
        log.error("%s: %s", plugin, what)  # the line nereid check prints, too
        self.problems.append(PluginProblem(plugin, what))

    def hook_failed(self, name: str, hook: str, what: str) -> None:
        """Plugin ``name``'s ``hook`` failed and its answer is ignored: log it, at ERROR the first time only.

        Claims are asked per folder: a broken hook would otherwise log one
        ERROR per model folder, on every rescan.
        """
        with self._failed_hooks_lock:
            first = (name, hook) not in self._failed_hooks
            self._failed_hooks.add((name, hook))
        later = " (its later failures are logged at DEBUG)" if first else ""
        log.log(logging.ERROR if first else logging.DEBUG, "%s: %s %s; its answer is ignored%s",
                self.describe(name), hook, what, later)

    def wrapper_failed(self, name: str, hook: str, what: str) -> None:
        """Plugin ``name``'s wrapper of ``hook`` failed where the backend it wrapped did not: leave it out of ``hook``.

        Logged once, at ERROR (another thread may find the same fault before it
        is left out: DEBUG then). It is left out for good rather than asked
        again: a wrapper runs around every backend's answer, so each of its
        failures would cost every backend a second question, on every folder.
        """
        with self._failed_hooks_lock:
            first = (name, hook) not in self._failed_wrappers
            self._failed_wrappers.add((name, hook))
        log.log(logging.ERROR if first else logging.DEBUG,
                "%s: its %s wrapper %s; it is left out of %s from now on (the backends are asked without it)",
                self.describe(name), hook, what, hook)
        if first and hook in _STARTUP_HOOKS:  # (as the hook's own failure is: nereid check counts it)
            self.problems.append(PluginProblem(self.describe(name), f"its {hook} wrapper {what}; it is left out"))

    def wrapper_left_out(self, name: str, hook: str) -> bool:
        """Whether plugin ``name``'s wrapper of ``hook`` failed, and is no longer called."""
        return (name, hook) in self._failed_wrappers


class _ByIdentity:
    """Plugins compared by identity: a plugin pluggy registers may be unhashable (a dataclass instance), and a
    set of them raised TypeError in every claim."""

    def __init__(self, plugins: Iterable[object]) -> None:
        self._ids = {id(plugin) for plugin in plugins}

    def __contains__(self, plugin: object) -> bool:
        return id(plugin) in self._ids

    def __bool__(self) -> bool:
        return bool(self._ids)


def _normalized(distribution: str) -> str:
    """A distribution name as packaging compares them (PEP 503: case, runs of -_. alike)."""
    return re.sub(r"[-_.]+", "-", distribution).lower()


def error_text(err: BaseException) -> str:
    """``err`` as one capped line, its type first (a plugin's exception may span lines, or say nothing)."""
    return cap_message(describe_exception(err, one_line=True))


def make_plugin_manager(*, load_entry_points: bool = True,
                        extra_plugins: tuple[object, ...] = ()) -> NereidPluginManager:
    """A plugin manager with the built-in backends, installed plugins and ``extra_plugins``.

    Installed packages register backends under the ``nereid.backends``
    entry-point group; the entry-point name becomes the backend's plugin name.
    An installed plugin that cannot be loaded, or implements no hook nereid
    would call (see :func:`hook_problems`), is logged and left out (see
    :attr:`NereidPluginManager.problems`); a model declaring its backend is told why.
    """
    manager = NereidPluginManager()
    manager.add_hookspecs(hookspecs)
    for module_name in BUILTIN_BACKENDS:
        module = importlib.import_module(module_name)
        manager.register_builtin(module, module.BACKEND_NAME)
    if load_entry_points:
        manager.load_installed(ENTRY_POINT_GROUP)
    for plugin in extra_plugins:
        manager.register(plugin, name=getattr(plugin, "BACKEND_NAME", None))
    return manager


def plugin_code(manager: pluggy.PluginManager) -> list[str]:
    """Where the registered backend plugins' code lives, but nereid's own: each plugin's top-level package
    folder (ending in a separator), or its module's file when it is a module alone. An installed plugin lives in
    site-packages, beside the libraries, yet it is model code: the event-loop watch blames a hold in it on it.
    """
    found: list[str] = []
    for _, plugin in manager.list_name_plugin():
        owner = plugin if inspect.ismodule(plugin) or inspect.isclass(plugin) else type(plugin)
        module = inspect.getmodule(owner)
        top_name = getattr(module, "__name__", "").partition(".")[0]
        top = sys.modules.get(top_name)
        if top is None or top_name in ("nereid", "__main__", "builtins"):
            continue
        spec = getattr(top, "__spec__", None)
        locations = list(spec.submodule_search_locations or ()) if spec is not None else []
        if locations:
            found.extend(f"{Path(location)}{os.sep}" for location in locations)
        elif getattr(top, "__file__", None):
            found.append(str(Path(top.__file__)))
    return sorted(set(found))


def add_commands(manager: NereidPluginManager, commands: Any) -> None:
    """Let each plugin add its subcommands to ``commands``; one whose hook fails is left out (and reported).

    A command name already taken makes argparse refuse the plugin's parser
    before adding it, so the core's commands (and earlier plugins') stay.
    """
    impls = _plain_impls(manager.hook.nereid_add_commands)
    for impl in impls:
        before = set(commands.choices)

        def undo() -> None:  # all of the plugin's commands, or none
            _remove_commands(commands, set(commands.choices) - before)

        try:
            _answers_alone(manager, "nereid_add_commands", impl, impls, {"commands": commands}, undo=undo)
        except plugin_failures() as err:
            undo()
            manager.startup_hook_failed(impl.plugin_name, "nereid_add_commands", f"it raised {error_text(err)}")


def _remove_commands(commands: Any, names: set[str]) -> None:
    """Take subcommands back out of an argparse subparsers action (argparse has no public way to)."""
    for name in names:
        del commands.choices[name]  # the name -> parser map that parsing reads
    commands._choices_actions[:] = [a for a in commands._choices_actions if a.dest not in names]  # --help's


def hook_problems(manager: pluggy.PluginManager, plugin: object) -> list[str]:
    """What keeps the registered ``plugin`` from ever being called, each said with what to fix; [] if nothing.

    pluggy registers, without a word, a ``@hookimpl`` whose name is no hookspec
    (a typo: ``nereid_claim_models``) and ignores a hook function that lacks
    ``@hookimpl``: either plugin would claim nothing and be named nowhere.
    """
    specs = sorted(name for name, caller in vars(manager.hook).items()
                   if isinstance(caller, pluggy.HookCaller) and caller.has_spec())
    listed = ", ".join(specs)
    callers = list({id(caller): caller for caller in manager.get_hookcallers(plugin) or []}.values())  # (one per impl)
    problems: list[str] = []
    for caller in callers:
        impls = [impl for impl in caller.get_hookimpls() if impl.plugin is plugin]
        if not caller.has_spec() and not all(impl.optionalhook for impl in impls):  # optionalhook: pluggy's opt-out
            close = difflib.get_close_matches(caller.name, specs, n=1)
            guess = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"unknown hook '{caller.name}'{guess}; nereid's hooks are: {listed}")
        plain = [impl for impl in impls if not (impl.wrapper or impl.hookwrapper)]
        if len(impls) > 1 and caller.has_spec():
            # (pluggy takes a second function for a hook, @hookimpl(specname=...): each of nereid's questions asks
            # a backend alone, leaving the others out by their plugin, so such a plugin was asked nothing (the CLI
            # read hunt); a wrapper beside the plugin's own implementation wrapped only its own answers, and once
            # it raised, the plugin's backend claimed nothing more (the review hunt).)
            wrapping = " (a wrapper goes in a plugin of its own)" if len(plain) < len(impls) else ""
            problems.append(f"it implements {caller.name} {len(impls)} times ("
                            f"{', '.join(sorted(impl.function.__name__ for impl in impls))}); one function per "
                            f"hook{wrapping}")
        for impl in impls:
            # pluggy calls it and takes the coroutine it returns for the answer: a check that never ran passed,
            # commands were never added, a warning named nereid's own file (the config hunt).
            if inspect.iscoroutinefunction(impl.function) or inspect.isasyncgenfunction(impl.function):
                problems.append(f"its {caller.name} is an async def: nereid calls its hooks as plain functions "
                                "(make it a plain def)")
    implemented = {caller.name for caller in callers}
    others: list[str] = []  # its nereid_* functions that are no hook of nereid's
    for name in dir(plugin):
        if not name.startswith("nereid_") or name in implemented:
            continue
        try:
            value = getattr(plugin, name)
        except Exception:  # an odd attribute (a property that raises): pluggy skipped it too
            continue
        if not inspect.isroutine(value):
            continue
        if name in specs:
            problems.append(f"its {name} is not marked @hookimpl (from nereid.hookspecs import hookimpl), "
                            "so nereid never calls it")
        else:
            others.append(name)
    if not problems and not any(caller.has_spec() for caller in callers):
        defines = f" (it defines {', '.join(others)}, which is none of them)" if others else ""
        problems.append(f"it implements none of nereid's hooks: {listed}{defines}; mark each hook function "
                        "@hookimpl (from nereid.hookspecs import hookimpl)")
    return problems


def backend_names(manager: pluggy.PluginManager) -> list[str]:
    """Names of every registered backend plugin (one that claims folders), sorted."""
    return sorted(impl.plugin_name for impl in _plain_impls(manager.hook.nereid_claim_model))


def check_backend_defaults(manager: NereidPluginManager, defaults: Mapping[str, Any], source: object) -> list[str]:
    """ConfigError naming ``backends.<name>`` in ``source`` for defaults given to a backend that is not installed;
    for one installed but left out (it could not be loaded), and for a mistake its backend finds in its defaults
    (see :func:`defaults_problem`), a line saying so is returned instead.

    nereid.yaml is read before plugins are known, so a misspelt backend name
    there would otherwise be taken silently and apply to nothing. A plugin
    left out is the plugin's problem, not the file's: the server serves what
    the others claim (it refused to start, found by a plugin hunt).
    """
    installed = backend_names(manager)
    notes = []
    for name in defaults:
        if name not in installed:
            left_out = manager.left_out(name)
            if not left_out:
                close = closest_key(name, installed) if isinstance(name, str) else None
                meant = f"; did you mean '{close}'?" if close else ""
                raise ConfigError(f"{source}: backends.{name}: no such backend is installed "
                                  f"(installed: {', '.join(installed)}{meant})")
            notes.append(f"{source}: backends.{name}: {left_out}; its defaults apply to nothing")
        elif (problem := defaults_problem(manager, name, defaults[name] or {}, f"{source}: backends.{name}")):
            notes.append(problem)
    return notes


def defaults_problem(manager: NereidPluginManager, name: str, values: Mapping[str, Any], origin: str) -> str:
    """What the backend ``name`` finds wrong in its ``values`` (nereid.yaml's ``backends.<name>``, at ``origin``),
    asked through its ``nereid_check_defaults`` hook alone (inside the hook's wrappers, as every hook a backend
    answers alone: see :func:`_answers_alone`); "" when nothing, or when it has no such hook (its models' loads
    check them). Asked beforehand, a misspelt option is found with no model of that backend served (a bug hunt:
    ``nereid check`` passed it)."""
    impls = _plain_impls(manager.hook.nereid_check_defaults)
    impl = next((impl for impl in impls if impl.plugin_name == name), None)
    if impl is None:
        return ""
    try:
        _answers_alone(manager, "nereid_check_defaults", impl, impls, {"defaults": dict(values), "origin": origin},
                       about=origin)
    except ConfigError as err:
        return str(err)
    except plugin_failures() as err:
        return f"{origin}: the {manager.describe(name)}'s nereid_check_defaults raised {error_text(err)}"
    return ""


@dataclass(frozen=True)
class OptionsAsked:
    """One model of ``backend`` whose backend's defaults an edit of nereid.yaml changed: its ``name``, ``folder``,
    own ``runtime:``, the ``origin`` of its settings, and ``source``, the nereid.yaml the defaults are in."""

    backend: str
    name: str
    folder: Path
    runtime: Mapping[str, Any]
    origin: str
    source: object


def options_change(manager: NereidPluginManager, asked: OptionsAsked, before: Mapping[str, Any] | None,
                   after: Mapping[str, Any] | None) -> bool:
    """Whether the model ``asked`` of would load with other options under its backend's defaults ``after`` than
    under ``before``, as its backend's ``nereid_model_options`` hook reads them (asked alone, as for
    :func:`defaults_problem`).

    Only the backend knows its own defaults: ``warm_start: true`` written out,
    or a key the model's own ``runtime:`` overrides, changes nothing, though the
    two mappings differ (each such edit reloaded every model of the backend; the
    scale hunt). True when the mappings differ and the backend cannot tell: no
    such hook, no answer, or a raise (a ConfigError's mistake is then the
    reload's reason; a plugin's bug is logged too).
    """
    if same_values(before or {}, after or {}):  # (types too: `0` fixed to `false` is a change)
        return False
    impls = _plain_impls(manager.hook.nereid_model_options)
    impl = next((impl for impl in impls if impl.plugin_name == asked.backend), None)
    if impl is None:
        return True
    answers = []
    for defaults in (before, after):
        arguments = {"name": asked.name, "folder": asked.folder, "origin": asked.origin,
                     "runtime": layered_runtime(asked.runtime, defaults, asked.source, asked.backend)}
        try:
            answer = _answers_alone(manager, "nereid_model_options", impl, impls, arguments,
                                    about=f"model '{asked.name}'")
        except ConfigError:
            return True
        except plugin_failures() as err:
            log.warning("model '%s': the %s's nereid_model_options raised %s; reloading it for the edit of its "
                        "backends: defaults", asked.name, manager.describe(asked.backend), error_text(err))
            return True
        if not answer:  # (None: it cannot tell for this one)
            return True
        answers.append(answer[0])
    try:
        return bool(answers[0] != answers[1])
    except Exception:  # (an answer whose == raises cannot tell either)
        return True


def _plain_impls(hook: pluggy.HookCaller) -> list[pluggy.HookImpl]:
    # A plugin that only wraps a hook (tracing claims, say) is not a backend and gives no answer of its own.
    return [impl for impl in hook.get_hookimpls() if not (impl.wrapper or impl.hookwrapper)]


def _wrappers(manager: NereidPluginManager, hook: str, left_out: bool = False) -> list[pluggy.HookImpl]:
    """The wrappers of ``hook`` still called (or, with ``left_out``, those left out of it after failing)."""
    return [impl for impl in getattr(manager.hook, hook).get_hookimpls()
            if (impl.wrapper or impl.hookwrapper) and manager.wrapper_left_out(impl.plugin_name, hook) == left_out]


def _alone(manager: NereidPluginManager, hook: str, impl: pluggy.HookImpl, impls: list[pluggy.HookImpl],
           without: Iterable[pluggy.HookImpl] = ()) -> pluggy.HookCaller:
    """``hook`` calling ``impl`` only, inside the hook's wrappers (bar those ``without`` and those left out)."""
    others = [other for other in impls if other is not impl]
    leave_out = [*others, *_wrappers(manager, hook, left_out=True), *without]
    return manager.subset_hook_caller(hook, remove_plugins=[other.plugin for other in leave_out])


def _answers_alone(manager: NereidPluginManager, hook: str, impl: pluggy.HookImpl, impls: list[pluggy.HookImpl],
                   arguments: dict[str, Any], about: str = "",
                   undo: Callable[[], None] = lambda: None) -> list[Any]:
    """``impl``'s answers to ``hook`` (asked alone, inside the hook's wrappers); a failure raised is its plugin's.

    A wrapper that raises would otherwise pass for the failure of every backend
    it wraps. So when the call raises, the backend is asked again without the
    wrappers: if it fails again, the failure is its own; if it answers, the
    wrappers are put back one at a time, and each one that makes the call fail
    again is logged (naming its plugin) and left out of ``hook`` (see
    :meth:`NereidPluginManager.wrapper_failed`). ``undo`` takes back what a
    call did (the commands it added) before the next is made; ``about`` says,
    in the log, what was asked ("folder ...").
    """
    try:
        return _alone(manager, hook, impl, impls)(**arguments)
    except plugin_failures():
        wrappers = _wrappers(manager, hook)
        if not wrappers:
            raise

    def ask(kept: list[pluggy.HookImpl]) -> list[Any]:  # inside the ``kept`` wrappers only
        undo()
        return _alone(manager, hook, impl, impls, without=[w for w in wrappers if w not in kept])(**arguments)

    answers, current = ask([]), True  # raises: the backend's own failure, whatever its wrappers do
    kept: list[pluggy.HookImpl] = []
    for wrapper in wrappers:
        try:
            answers, current = ask([*kept, wrapper]), True
        except plugin_failures() as err:
            current = False  # (what that call did is undone by the next one)
            where = "; ".join(part for part in (f"around the {manager.describe(impl.plugin_name)}", about) if part)
            manager.wrapper_failed(wrapper.plugin_name, hook, f"raised {error_text(err)} ({where})")
        else:
            kept.append(wrapper)
    return answers if current else ask(kept)


def gone_while_loading(folder: Path) -> str:
    """The reason of a load whose ``folder`` was deleted or moved while it was being loaded."""
    return f"the folder {folder} is gone (deleted or moved while it was being loaded)"


def claim_folder(manager: NereidPluginManager, folder: Path, backend: str | None = None,
                 asking: Callable[[str], None] | None = None, config_name: str = DEFAULT_CONFIG_NAME) -> ClaimResult:
    """Ask the backends about ``folder``; with ``backend`` set, ask only that one.

    Each claim is attributed to the plugin that made it, by its registration
    name. A plugin whose hook raises, or answers something other than a
    BackendClaim or None, is taken as not claiming the folder; when nobody
    claims it, the reason says what went wrong with that plugin. ``asking`` is
    told the registration name of each plugin just before its hook is asked
    (the step a model's build waits for: see :class:`~nereid.model_building.BuildStage`). ``config_name``: the
    configuration file, as the reasons name it (``set backend: in prod.yaml``; see Settings.config_name).
    """
    if backend is not None:
        if backend not in backend_names(manager):
            left_out = manager.left_out(backend)
            if left_out:  # installed, but unusable: "not installed" would send its author looking elsewhere
                return ClaimResult(None, f"backend '{backend}' (from {config_name}) cannot be used: {left_out} "
                                         "(fix the plugin, then restart nereid: plugins are loaded at start-up)")
            installed = backend_names(manager)
            # (Names are case-sensitive: `backend: upper` for an installed UPPER got no hint; the plugin hunt.)
            by_case = {name.lower(): name for name in installed}
            close = ([by_case[backend.lower()]] if backend.lower() in by_case
                     else difflib.get_close_matches(backend, installed, n=1))
            guess = f" (did you mean '{close[0]}'?)" if close else ""
            return ClaimResult(None, f"backend '{backend}' (from {config_name}) is not installed{guess} (no plugin of "
                                     "that name claims model folders); "
                                     f"installed backends: {', '.join(installed)}")
        asked = _ask(manager, folder, declared=True, only=backend, asking=asking)
        if not asked.claims:
            failed = "".join(f": its nereid_claim_model {what}" for _, what in asked.failures)
            triton = folder_hint(folder)
            return ClaimResult(None, f"backend '{backend}' does not recognise the folder {folder}{failed}"
                                     f"{f'; {triton}' if triton else ''}")
        return ClaimResult(asked.claims[0][1], backend_name=backend)
    asked = _ask(manager, folder, declared=False, asking=asking)
    if len(asked.claims) == 1:
        name, claim = asked.claims[0]
        return ClaimResult(claim, backend_name=name)
    if not asked.claims:
        if not folder.is_dir():  # deleted while it was being claimed: that is the reason, not the backends
            return ClaimResult(None, gone_while_loading(folder))
        failures = "".join(f"; {manager.describe(name)} is taken as not claiming it: its nereid_claim_model {what}"
                           for name, what in asked.failures)
        triton = folder_hint(folder)
        hints = "".join(f"; {hint}" for hint in [*_hints(manager, folder, config_name),
                                                  *([triton] if triton else [])])
        left_out = manager.left_out_names()
        unusable = (f"; plugin(s) left out at start-up (the log and nereid check say why): {', '.join(left_out)}"
                    if left_out else "")
        return ClaimResult(None, f"no backend claims the folder {folder} "
                                 f"(installed backends: {', '.join(backend_names(manager))}); "
                                 f"add the files of the backend you mean ({_claim_signs(manager)}) "
                                 f"or set backend: in {config_name}{unusable}{failures}{hints}")
    names = ", ".join(sorted(name for name, _ in asked.claims))
    return ClaimResult(None, f"several backends claim the folder {folder} ({names}); "
                             f"set backend: in {config_name} to choose one")


def streamed_files(manager: NereidPluginManager, name: str, backend: str | None = None) -> StreamedFiles:
    """What the mirror of an object store asks about the model folder ``name`` (a
    :data:`~nereid.storage.mirror.StreamedFiles`): which of its files stay in the store, as the backends say
    through ``nereid_streamed_files`` (of the backend ``backend`` alone, when nereid.yaml names one).

    Each backend is asked on its own, so that a wrong answer is its plugin's:
    one that raises, or answers anything but a tuple (list, set) of str or
    None, is logged (once, naming it) and ignored. When several answer, a file
    stays only if each names it: a file fetched serves a backend that would
    have streamed it, while one left in the store is missing for any other
    (a meta model's model.py reading its own .safetensors found none). A
    store failure of ``read_small`` is the store's: raised, never blamed on
    the plugin.
    """
    def decide(listing: tuple[str, ...], read_small: Callable[[str], bytes | None]) -> frozenset[str]:
        impls = _plain_impls(manager.hook.nereid_streamed_files)
        answers: list[frozenset[str]] = []
        for impl in impls:
            if backend is not None and impl.plugin_name != backend:
                continue
            arguments = {"name": name, "declared": backend is not None, "listing": listing, "read_small": read_small}
            try:
                got = _answers_alone(manager, "nereid_streamed_files", impl, impls, arguments, about=f"model '{name}'")
            except plugin_failures() as err:
                if store_failed(err):
                    raise
                manager.hook_failed(impl.plugin_name, "nereid_streamed_files", f"raised {error_text(err)} "
                                    f"(model '{name}'; every file is fetched)")
                continue
            for answer in got:  # (pluggy drops None: not its folder)
                problem = _not_file_names(answer)
                if problem is None:
                    answers.append(frozenset(answer))
                else:
                    manager.hook_failed(impl.plugin_name, "nereid_streamed_files",
                                        f"{problem} (model '{name}'; every file is fetched)")
        return frozenset.intersection(*answers) if answers else frozenset()

    return decide


def _not_file_names(answer: object) -> str | None:
    """What is wrong with ``answer``, a nereid_streamed_files hook's, as file names; None when it is a tuple (list,
    set) of str. A str alone is refused: taken as a tuple, its characters would be the names."""
    if not isinstance(answer, (tuple, list, set, frozenset)):
        return f"returned {_a(type(answer).__name__)}, not a tuple of file names (str) or None"
    odd = [item for item in answer if not isinstance(item, str)]
    if odd:
        return (f"returned {_a(type(answer).__name__)} holding {_a(type(odd[0]).__name__)}, "
                "not a tuple of file names (str) or None")
    return None


def _claim_signs(manager: NereidPluginManager) -> str:
    """What makes each installed backend claim a folder, in its own words (``nereid_claim_signs``); a backend that
    says nothing (or whose hook fails, logged) is "see its documentation"."""
    said = {name: text.strip() for name, text in _sentences(manager, "nereid_claim_signs") if text.strip()}
    return "; ".join(f"{name}: {said.get(name, 'see its documentation')}" for name in backend_names(manager))


@dataclass(frozen=True)
class _Answers:
    """The claims made for one folder, and the plugins that failed to answer (registration name, what went wrong)."""

    claims: list[tuple[str, BackendClaim]]
    failures: list[tuple[str, str]]  # what its hook did: "raised ...", "returned a bool, ..."


def _ask(manager: NereidPluginManager, folder: Path, declared: bool, only: str | None = None,
         asking: Callable[[str], None] | None = None) -> _Answers:
    """Each claiming plugin's registration name and claim (of plugin ``only``, when given); ``asking`` is told
    each plugin's name before its hook is asked.

    Each backend is asked through pluggy on its own, the other backends left
    out, so that its claim (or its failure) is attributed to it and the hook's
    wrappers run around every question (a wrapper's failure is told from the
    backend's, and costs only the wrapper: see :func:`_answers_alone`).
    """
    backends = _plain_impls(manager.hook.nereid_claim_model)
    claims: list[tuple[str, BackendClaim]] = []
    failures: list[tuple[str, str]] = []
    for impl in backends:
        if only is not None and impl.plugin_name != only:
            continue
        if asking is not None:
            asking(impl.plugin_name)
        try:
            answers = _answers_alone(manager, "nereid_claim_model", impl, backends,
                                     {"folder": folder, "declared": declared}, about=f"folder {folder}")
        except plugin_failures() as err:  # its bug (a sys.exit() too) must not take other backends' folders
            failures.append((impl.plugin_name, f"raised {error_text(err)}"))
            continue
        for answer in answers:  # (pluggy drops None: no claim)
            if isinstance(answer, BackendClaim):
                claims.append((impl.plugin_name, answer))
            elif answer:  # a falsy answer (False, "") only declines, as None does
                failures.append((impl.plugin_name, f"returned {_a(type(answer).__name__)}, not a BackendClaim or None"))
    for name, what in failures:
        manager.hook_failed(name, "nereid_claim_model", f"{what} (folder {folder})")
    return _Answers(claims, failures)


def _a(noun: str) -> str:
    """``noun`` with its indefinite article: "an int", "a str" (the log said "a int")."""
    return f"{'an' if noun[:1].lower() in 'aeiou' else 'a'} {noun}"


def _hints(manager: NereidPluginManager, folder: Path, config_name: str) -> list[str]:
    """The backends' sentences on how to declare ``folder``; a hint hook that fails is logged and skipped."""
    return [text for _, text in _sentences(manager, "nereid_declaration_hint", folder=folder,
                                           config_name=config_name)]


def _sentences(manager: NereidPluginManager, hook: str, **arguments: object) -> list[tuple[str, str]]:
    """Each backend's answer to ``hook``, a str, with its plugin's name: each asked alone (its failure is its
    own); one that raises, or answers anything but a str or None, is logged (once, naming it) and skipped."""
    impls = _plain_impls(getattr(manager.hook, hook))
    about = f"folder {arguments['folder']}" if "folder" in arguments else ""
    sentences: list[tuple[str, str]] = []
    for impl in impls:
        try:
            answers = _answers_alone(manager, hook, impl, impls, arguments, about=about)
        except plugin_failures() as err:
            manager.hook_failed(impl.plugin_name, hook, f"raised {error_text(err)}")
            continue
        for answer in answers:
            if isinstance(answer, str):
                sentences.append((impl.plugin_name, answer))
            elif answer:
                manager.hook_failed(impl.plugin_name, hook, f"returned {_a(type(answer).__name__)}, not a str or None")
    return sentences
