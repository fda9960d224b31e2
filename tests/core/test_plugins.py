"""Backend discovery through the pluggy hook: built-ins, entry points, conflicts, and the docs."""

from __future__ import annotations

import inspect
import logging
import os
import re
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

import toy_backends
from nereid import hookspecs
from nereid.backend import BackendClaim
from nereid.plugins import (OptionsAsked, backend_names, check_backend_defaults, claim_folder, hook_problems,
                            make_plugin_manager, options_change, plugin_code, streamed_files)

README = Path(__file__).resolve().parents[2] / "README.md"

# A complete third-party backend, as a package author would ship it: an
# in-process model that adds one to its FP32 input, claiming folders that hold
# an `addone.txt`.
THIRD_PARTY_MODULE = '''
from pathlib import Path

from nereid.backend import BackendClaim
from nereid.hookspecs import hookimpl
from nereid.signature import TEXTPROTO_NAME, load_textproto_signature
from nereid.tensors import NamedTensor


class AddOne:
    platform = "addone_platform"

    def __init__(self, context):
        self.context = context
        self.unloaded = False

    def load(self):
        self._signature = load_textproto_signature(self.context.folder / TEXTPROTO_NAME)

    def signature(self):
        return self._signature

    def infer(self, inputs):
        return [NamedTensor("output", inputs[0].dtype, inputs[0].data + 1)]

    def unload(self):
        self.unloaded = True


@hookimpl
def nereid_claim_model(folder: Path, declared: bool):
    if declared or (folder / "addone.txt").is_file():
        return BackendClaim(AddOne)
    return None
'''


@pytest.fixture
def installed_addone(tmp_path: Path):
    """Install the third-party backend the way pip lays it out: a module plus dist-info with an entry point."""
    site = tmp_path / "site"
    (site / "nereid_addone-1.0.dist-info").mkdir(parents=True)
    (site / "nereid_addone.py").write_text(THIRD_PARTY_MODULE)
    (site / "nereid_addone-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nereid-addone\nVersion: 1.0\n")
    (site / "nereid_addone-1.0.dist-info" / "entry_points.txt").write_text(
        "[nereid.backends]\naddone = nereid_addone\n")
    sys.path.insert(0, str(site))
    yield
    sys.path.remove(str(site))
    sys.modules.pop("nereid_addone", None)


def test_builtin_backends_are_registered_like_plugins() -> None:
    assert backend_names(make_plugin_manager(load_entry_points=False)) == ["cpp", "cxx", "meta", "python", "xla"]


def test_plugin_code_names_each_installed_plugin_s_package_or_module_and_none_of_nereid_s(installed_addone,
                                                                                          tmp_path) -> None:
    """What the event-loop watch counts as model code although it lies in site-packages."""
    site = tmp_path / "site"
    (site / "acme_backends").mkdir()
    (site / "acme_backends" / "__init__.py").write_text("")
    (site / "acme_backends" / "plus.py").write_text(THIRD_PARTY_MODULE)
    (site / "acme-1.0.dist-info").mkdir()
    (site / "acme-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: acme\nVersion: 1.0\n")
    (site / "acme-1.0.dist-info" / "entry_points.txt").write_text("[nereid.backends]\nacme = acme_backends.plus\n")
    try:
        manager = make_plugin_manager()
        assert {"addone", "acme"} <= set(backend_names(manager))
        assert plugin_code(manager) == sorted([str(site / "nereid_addone.py"), f"{site / 'acme_backends'}{os.sep}"])
    finally:
        for name in ("acme_backends", "acme_backends.plus"):
            sys.modules.pop(name, None)
    assert plugin_code(make_plugin_manager(load_entry_points=False)) == []


def test_each_backend_checks_its_defaults_with_no_model_of_it_served() -> None:
    """Found by a bug hunt: `backends: {cxx: {bogus: 1}}` passed nereid check (exit 0) and serve said nothing when
    no cxx model was served: the options were read only by a model's load."""
    manager = make_plugin_manager(load_entry_points=False)
    defaults = {"python": {"warm_sart": False}, "xla": {"batch_sizes": "smallest"}, "cxx": {"bogus": 1},
                "cpp": {"flags": "-O3"}, "meta": {"x": 1}}
    assert check_backend_defaults(manager, defaults, "n.yaml") == [
        "n.yaml: backends.python.warm_sart: unknown option of the python backend (allowed: preload, warm_start; "
        "did you mean 'warm_start'?), got false",
        "n.yaml: backends.xla.batch_sizes: must be one of all, largest, got 'smallest'",
        "n.yaml: backends.cxx.bogus: unknown option of the cxx backend (allowed: library, sources), got 1",
        "n.yaml: backends.cpp.flags: unknown option of the cpp backend (it has no runtime options), got '-O3'",
        "n.yaml: backends.meta.x: unknown option of the meta backend (it has no runtime options), got 1"]
    # (The regression hunt: an item's mistake was said to be at "backends.python.runtime.preload[1]".)
    assert check_backend_defaults(manager, {"python": {"preload": ["numpy", "1bad"]}}, "n.yaml") == [
        "n.yaml: backends.python.preload[1]: must be a module name such as numpy or sklearn.linear_model, got '1bad'"]
    good = {"python": {"warm_start": False, "preload": ["numpy"]}, "xla": {"batch_sizes": "largest"},
            "cxx": {"sources": ["a.cpp"]}, "cpp": None, "meta": {}}
    assert check_backend_defaults(manager, good, "n.yaml") == []


def asked(backend: str, runtime: dict, folder: Path = Path("/srv/m")) -> OptionsAsked:
    return OptionsAsked(backend, "m", folder, runtime, "n.yaml: models[0]", "n.yaml")


def test_a_backends_edit_changes_a_models_options_only_as_its_backend_reads_them(tmp_path: Path) -> None:
    """The scale hunt: the defaults were compared as written, so a default written out, or one each model's own
    runtime: overrides, reloaded every model of the backend."""
    manager = make_plugin_manager(load_entry_points=False)
    assert not options_change(manager, asked("python", {}), None, {"warm_start": True, "preload": []})
    assert options_change(manager, asked("python", {}), None, {"warm_start": False})
    assert not options_change(manager, asked("python", {"warm_start": True}), {}, {"warm_start": False})
    assert options_change(manager, asked("python", {}), {"preload": ["json"]}, {"preload": ["json", "csv"]})
    assert not options_change(manager, asked("xla", {}), {"batch_sizes": "all"}, {"weights_read_threads": 8})
    assert options_change(manager, asked("xla", {}), {}, {"batch_sizes": "largest"})
    # A cxx model's own library replaces a default of sources, whatever they are.
    library = {"library": str(tmp_path / "libm.so")}
    assert not options_change(manager, asked("cxx", library), {"sources": ["/a.cpp"]}, {"sources": ["/b.cpp"]})
    assert options_change(manager, asked("cxx", {}), {"sources": ["/a.cpp"]}, {"sources": ["/b.cpp"]})
    # A mistake is the reload's to report (the model's load refuses it, naming where it is).
    assert options_change(manager, asked("python", {}), {}, {"warm_sart": True})
    assert options_change(manager, asked("python", {}), {"warm_sart": True}, {"warm_start": True})


class NoOptions:
    """A backend with defaults of its own and no way to compare them: one that answers nothing."""

    BACKEND_NAME = "silent"

    @hookspecs.hookimpl
    def nereid_claim_model(self, folder, declared):
        return None

    @hookspecs.hookimpl
    def nereid_model_options(self, name, folder, runtime, origin):
        if runtime.get("broken"):
            raise RuntimeError("no options today")
        return None


def test_a_backend_that_cannot_compare_its_options_reloads_at_any_change_of_its_defaults(caplog) -> None:
    """As before nereid_model_options: a third-party backend without it (toy), or whose hook answers nothing or
    raises, reloads its models whenever its defaults change as written, and at no other edit."""
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends, NoOptions()))
    assert options_change(manager, asked("toy", {}), None, {"colour": "blue"})
    assert not options_change(manager, asked("toy", {}), None, {})  # (an empty section is none)
    assert options_change(manager, asked("silent", {}), {"a": 1}, {"a": 2})
    caplog.set_level(logging.WARNING, logger="nereid.plugins")
    assert options_change(manager, asked("silent", {}), {"broken": True}, {"broken": True, "a": 2})
    assert "model 'm': the plugin 'silent'" in caplog.text and "RuntimeError: no options today" in caplog.text


class FussyDefaults:
    """A backend whose defaults check raises what is no ConfigError."""

    BACKEND_NAME = "fussy"

    @hookspecs.hookimpl
    def nereid_claim_model(self, folder, declared):
        return None

    @hookspecs.hookimpl
    def nereid_check_defaults(self, defaults, origin):
        raise RuntimeError("checker bug")


def test_a_defaults_check_that_fails_is_the_plugin_s_named_problem_and_one_without_it_is_not_asked() -> None:
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(FussyDefaults(), toy_backends))
    notes = check_backend_defaults(manager, {"fussy": {"a": 1}, "toy": {"anything": 1}}, "n.yaml")
    assert notes == ["n.yaml: backends.fussy: the plugin 'fussy''s nereid_check_defaults raised RuntimeError: "
                     "checker bug"]


def test_installed_backend_serves_a_model(installed_addone, repo, serve) -> None:
    manager = make_plugin_manager()
    assert "addone" in backend_names(manager)
    folder = repo.add("plus", "input_shape: [3]\noutput_shape: [3]\nmax_batch_size: 4\n")
    (folder / "addone.txt").write_text("")
    server = serve(repo.write_config(), manager=manager)
    x = np.array([[1, 2, 3]], dtype=np.float32)
    tensor = triton.InferInput("input", [1, 3], "FP32")
    tensor.set_data_from_numpy(x)
    assert np.array_equal(server.client.infer("plus", [tensor]).as_numpy("output"), x + 1)
    assert server.client.get_model_metadata("plus").platform == "addone_platform"
    assert server.client.get_model_config("plus").config.backend == "addone"


def test_unclaimed_and_doubly_claimed_folders_name_the_candidates(installed_addone, repo, serve) -> None:
    repo.add("nobody", "input_shape: [1]\noutput_shape: [1]\n")
    both = repo.python("both")
    (both / "addone.txt").write_text("")
    settled = repo.python("settled")
    (settled / "addone.txt").write_text("")
    server = serve(repo.write_config("""
        - name: nobody
        - name: both
        - name: settled
          backend: addone
    """), manager=make_plugin_manager())
    index = {m.name: m for m in server.client.get_model_repository_index().models}
    assert index["nobody"].state == "UNAVAILABLE"
    assert "no backend claims" in index["nobody"].reason and "addone, cpp, cxx, meta, python" in index["nobody"].reason
    assert index["both"].state == "UNAVAILABLE"
    assert "several backends claim" in index["both"].reason and "(addone, python)" in index["both"].reason
    assert index["settled"].state == "READY"
    assert server.client.get_model_config("settled").config.backend == "addone"
    with pytest.raises(InferenceServerException) as caught:
        server.client.get_model_metadata("both")
    assert caught.value.status() == "StatusCode.UNAVAILABLE" and "several backends" in caught.value.message()


def test_declared_backend_checks_only_its_own_files(repo) -> None:
    folder = repo.add("cpp_only", "input_shape: [1]\noutput_shape: [1]\n", main_py="print()")
    manager = make_plugin_manager(load_entry_points=False)
    assert claim_folder(manager, folder).backend_name == "python"
    assert claim_folder(manager, folder, "cpp").backend_name == "cpp"
    missing = claim_folder(manager, folder, "tensorflow")
    assert missing.claim is None and "backend 'tensorflow' (from nereid.yaml) is not installed (no" in missing.reason
    # A misspelling, or another case, is told the installed name (the plugin hunt: `backend: upper` got no hint).
    for written, meant in (("Python", "python"), ("pyhton", "python"), ("XLA", "xla")):
        assert (f"backend '{written}' (from nereid.yaml) is not installed (did you mean '{meant}'?)"
                in claim_folder(manager, folder, written).reason)


class ClaimTracer:
    """A plugin that only observes claims, through both of pluggy's wrapper styles: not a backend."""

    def __init__(self) -> None:
        self.answers: list[list] = []

    @hookspecs.hookimpl(wrapper=True)
    def nereid_claim_model(self, folder, declared):
        answer = yield
        self.answers.append(list(answer))
        return answer


class OldStyleClaimTracer:
    @hookspecs.hookimpl(hookwrapper=True)
    def nereid_claim_model(self, folder, declared):
        yield


def test_a_plugin_that_wraps_the_claim_hook_runs_and_claims_nothing(repo) -> None:
    folder = repo.python("traced")
    manager = make_plugin_manager(load_entry_points=False)
    tracer = ClaimTracer()
    manager.register(tracer, name="tracer")
    manager.register(OldStyleClaimTracer(), name="oldtracer")
    # Before, each wrapper was called as if it were a backend, and its generator counted as a claim.
    claim = claim_folder(manager, folder)
    assert (claim.backend_name, claim.reason) == ("python", "")
    assert sorted(len(answer) for answer in tracer.answers) == [0, 0, 0, 0, 1]  # around each backend's answer
    assert backend_names(manager) == ["cpp", "cxx", "meta", "python", "xla"]
    assert "backend 'tracer' (from nereid.yaml) is not installed" in claim_folder(manager, folder, "tracer").reason
    assert claim_folder(manager, folder, "python").backend_name == "python"


def test_readme_documents_every_hook_and_argument() -> None:
    """The README's plugin section lists each hook with exactly the hookspec's arguments."""
    documented = dict(re.findall(r"^def (nereid_\w+)\(([^)]*)\)", README.read_text(), flags=re.M))
    specs = {name: fn for name, fn in vars(hookspecs).items() if name.startswith("nereid_") and callable(fn)}
    assert set(documented) == set(specs)
    for name, fn in specs.items():
        params = [p.strip().split(":")[0] for p in documented[name].split(",") if p.strip()]
        assert params == list(inspect.signature(fn).parameters), name
        for param in params:
            assert f":param {param}:" in textwrap.dedent(fn.__doc__), f"{name}: {param} undocumented"


@pytest.fixture
def site(tmp_path: Path):
    """A site-packages folder on sys.path, for plugins installed by toy_backends.install_plugin."""
    folder = tmp_path / "broken-site"
    folder.mkdir()
    sys.path.insert(0, str(folder))
    yield folder
    sys.path.remove(str(folder))
    for *_, module, _source in (*toy_backends.BROKEN_AT_STARTUP, *toy_backends.FAULTY_HOOKS):
        sys.modules.pop(module, None)


def _install(site: Path, plugins) -> None:
    for distribution, entry_point, module, source in plugins:
        toy_backends.install_plugin(site, distribution, entry_point, module, source)


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "nereid.plugins" and r.levelno == logging.ERROR]


def test_a_plugin_that_cannot_be_loaded_is_left_out_with_one_error_naming_it(site, repo, caplog) -> None:
    # Each of these used to stop every nereid command with a traceback, or (a built-in's name) vanish silently.
    _install(site, toy_backends.BROKEN_AT_STARTUP[:3])
    caplog.set_level(logging.ERROR, logger="nereid.plugins")
    manager = make_plugin_manager()
    assert backend_names(manager) == ["cpp", "cxx", "meta", "python", "xla"]
    errors = _errors(caplog)
    assert len(errors) == 3 and [p.plugin for p in manager.problems] == [e.split(": left out:")[0] for e in errors]
    by_plugin = {e.split(" ")[1]: e for e in errors}
    assert by_plugin["'broken_import'"].startswith(
        "plugin 'broken_import' (distribution broken-import 1.0, entry point broken_import = broken_import_plugin)"
        ": left out: ModuleNotFoundError: No module named 'nereid_missing_dependency'")
    assert ("(distribution broken-args 1.0, entry point broken_args = broken_args_plugin): left out: "
            "PluginValidationError:") in by_plugin["'broken_args'"] and "{'settings'}" in by_plugin["'broken_args'"]
    assert manager.get_plugin("broken_args") is None  # none of its hooks stays behind
    assert by_plugin["'python'"].endswith("left out: its name is already taken by the built-in backend 'python'; "
                                          "rename its entry point")
    claim = claim_folder(manager, repo.python("echo"))  # the built-in still claims its folders
    assert (claim.backend_name, claim.reason) == ("python", "")
    # A folder no backend claims names every plugin left out, the one whose name another took too (it did not).
    unclaimed = claim_folder(manager, repo.add("nobodys", "input_shape: [1]\noutput_shape: [1]\n"))
    assert ("; plugin(s) left out at start-up (the log and nereid check say why): broken_args, broken_import, "
            "python (a name another backend took)") in unclaimed.reason


def test_a_claim_hook_s_wrong_answer_is_told_with_its_article(repo) -> None:
    """(The log said "returned a int", found by a plugin hunt.)"""
    from nereid.hookspecs import hookimpl

    class Counting:
        BACKEND_NAME = "counting"

        @hookimpl
        def nereid_claim_model(self, folder, declared):
            return 5

    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(Counting(),))
    unclaimed = claim_folder(manager, repo.add("nobodys", "input_shape: [1]\noutput_shape: [1]\n"))
    assert "its nereid_claim_model returned an int, not a BackendClaim or None" in unclaimed.reason, unclaimed.reason


def test_a_claim_hook_that_fails_is_taken_as_not_claiming_and_named(site, repo, caplog) -> None:
    _install(site, toy_backends.FAULTY_HOOKS[:3])
    caplog.set_level(logging.ERROR, logger="nereid.plugins")
    manager = make_plugin_manager()
    # Before, one raising claim hook made every folder unavailable with its bare error, and a plugin
    # declining with False counted as a claim ("several backends claim ... (falsy, python)").
    for name in ("one", "two"):
        claim = claim_folder(manager, repo.python(name))
        assert (claim.backend_name, claim.reason) == ("python", "")
    falsy = repo.add("nobodys", "input_shape: [1]\noutput_shape: [1]\n")  # falsy answers False here
    unclaimed = claim_folder(manager, falsy)
    assert unclaimed.claim is None and unclaimed.reason.startswith(f"no backend claims the folder {falsy}")
    assert ("; plugin 'flaky' (distribution flaky-claims 1.0, entry point flaky = flaky_plugin) is taken as not "
            "claiming it: its nereid_claim_model raised FileNotFoundError: ") in unclaimed.reason
    assert ("; plugin 'classy' (distribution classy-claims 1.0, entry point classy = classy_plugin) is taken as not "
            "claiming it: its nereid_claim_model returned a type, not a BackendClaim or None") in unclaimed.reason
    assert "plugin 'falsy'" not in unclaimed.reason  # declining with False is declining
    errors = _errors(caplog)  # once per plugin, however many folders it failed on
    assert sorted(e.split(" ")[1] for e in errors) == ["'classy'", "'flaky'"]
    declared = claim_folder(manager, falsy, "flaky")
    assert declared.claim is None and declared.reason.startswith(
        f"backend 'flaky' does not recognise the folder {falsy}: its nereid_claim_model raised FileNotFoundError")


def test_a_declaration_hint_that_raises_is_logged_and_ignored(site, repo, caplog) -> None:
    _install(site, toy_backends.FAULTY_HOOKS[3:])
    caplog.set_level(logging.ERROR, logger="nereid.plugins")
    manager = make_plugin_manager()
    folder = repo.add("textproto_only", "input_shape: [1]\noutput_shape: [1]\n")
    reason = claim_folder(manager, folder).reason  # was only "'hinty'"
    assert reason.startswith("no backend claims the folder") and "is a cxx model" in reason
    assert "'hinty'" not in reason and "KeyError" not in reason
    assert _errors(caplog) == ["plugin 'hinty' (distribution hinty-hints 1.0, entry point hinty = hinty_plugin): "
                               "nereid_declaration_hint raised KeyError: 'hinty'; its answer is ignored "
                               "(its later failures are logged at DEBUG)"]


def test_a_failing_add_commands_hook_leaves_out_only_its_commands(site, caplog) -> None:
    import argparse

    from nereid.plugins import add_commands  # (here: an import error would hide which other tests fail)

    _install(site, toy_backends.BROKEN_AT_STARTUP[3:])
    manager = make_plugin_manager()
    commands = argparse.ArgumentParser().add_subparsers()  # (no dest: argparse names it by its choices)
    check = commands.add_parser("check")
    add_commands(manager, commands)
    assert commands.choices["check"] is check and {"bundle", "cxx-header"} <= set(commands.choices)
    assert [p.what.split(": ", 1)[1] for p in manager.problems] == [
        "it raised RuntimeError: tooling bug",
        "it raised ArgumentError: argument {check,cxx-header,bundle,taker-tool}: conflicting subparser: check"]
    # All of a failing plugin's commands are left out, those it added before failing too (one stayed).
    assert "taker-tool" not in commands.choices
    assert "taker-tool" not in [action.dest for action in commands._choices_actions]  # nor listed by --help


def test_a_shadowed_copy_of_an_installed_plugin_is_no_second_plugin(site, tmp_path, caplog) -> None:
    """The same distribution again further down sys.path (a --user install over a system one) was reported
    as a plugin whose name was taken, and nereid check failed; the first copy is the one Python imports."""
    source = "from nereid.hookspecs import hookimpl\n@hookimpl\ndef nereid_claim_model(folder, declared):\n" \
             "    return None\n"
    toy_backends.install_plugin(site, "Twice_Installed", "twice", "twice_plugin", source)
    shadowed = tmp_path / "older-site"
    toy_backends.install_plugin(shadowed, "twice-installed", "twice", "twice_plugin", source)
    sys.path.append(str(shadowed))
    try:
        manager = make_plugin_manager()
    finally:
        sys.path.remove(str(shadowed))
        sys.modules.pop("twice_plugin", None)
    assert manager.has_plugin("twice") and not manager.problems and not _errors(caplog)


def test_two_entry_points_naming_one_module_leave_out_the_second_saying_so(site, repo, caplog) -> None:
    """Defect: the second was left out with pluggy's ValueError, which printed the whole registry (absolute paths,
    ~1.5 KB) and named neither entry point nor what to do."""
    info = site / "twins-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: twins\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[nereid.backends]\ntwin_a = twin_plugin\ntwin_b = twin_plugin\n"
                                           "pyagain = nereid.backends.python.plugin\n")
    (site / "twin_plugin.py").write_text("from nereid.hookspecs import hookimpl\n"
                                         "@hookimpl\ndef nereid_claim_model(folder, declared):\n    return None\n")
    try:
        manager = make_plugin_manager()
    finally:
        sys.modules.pop("twin_plugin", None)
    twin_a = "plugin 'twin_a' (distribution twins 1.0, entry point twin_a = twin_plugin)"
    assert [(p.plugin, p.what) for p in manager.problems] == [
        ("plugin 'twin_b' (distribution twins 1.0, entry point twin_b = twin_plugin)",
         f"left out: twin_plugin is already registered, as the {twin_a}; give each backend a module of its own"),
        ("plugin 'pyagain' (distribution twins 1.0, entry point pyagain = nereid.backends.python.plugin)",
         "left out: nereid.backends.python.plugin is already registered, as the built-in backend 'python'; "
         "give each backend a module of its own")]
    assert len(_errors(caplog)) == 2 and backend_names(manager) == ["cpp", "cxx", "meta", "python", "twin_a", "xla"]
    reason = claim_folder(manager, repo.add("declared", None), "twin_b").reason
    assert f"cannot be used: plugin 'twin_b' (distribution twins 1.0, entry point twin_b = twin_plugin) was left " \
           f"out: twin_plugin is already registered, as the {twin_a}" in reason


# Plugins that only wrap hooks (tracing them), each raising: (distribution, entry point, module, source).
RAISING_WRAPPERS = (
    ("claim-tracer", "tracer", "tracer_plugin",  # raises after the backend answered, on each hook it wraps
     "from nereid.hookspecs import hookimpl\ncalls = []\n"
     "@hookimpl(wrapper=True)\ndef nereid_claim_model(folder, declared):\n"
     "    calls.append(folder.name)\n    yield\n    raise RuntimeError('tracer exploded')\n"
     "@hookimpl(wrapper=True)\ndef nereid_add_commands(commands):\n    yield\n    raise RuntimeError('no commands')\n"),
    ("old-tracer", "oldtracer", "oldtracer_plugin",  # pluggy's old style, raising before the backend is asked
     "from nereid.hookspecs import hookimpl\n"
     "@hookimpl(hookwrapper=True)\ndef nereid_claim_model(folder, declared):\n    raise ValueError('old bug')\n"
     "    yield\n"),
)


def test_a_wrapper_that_raises_is_left_out_of_its_hook_and_named_not_the_backends(site, repo, caplog) -> None:
    """Defect: a claim-tracing wrapper that raised was taken as each backend's failure: every model UNAVAILABLE,
    one ERROR per backend, the wrapper's plugin named nowhere; the same for the backends' nereid_add_commands."""
    import argparse

    from nereid.plugins import add_commands

    _install(site, (*RAISING_WRAPPERS, toy_backends.FAULTY_HOOKS[0]))  # flaky: a backend whose claim hook raises
    caplog.set_level(logging.ERROR, logger="nereid.plugins")
    try:
        manager = make_plugin_manager()
        tracer = ClaimTracer()  # a wrapper that works: kept, and still around each answer
        manager.register(tracer, name="goodtracer")
        claim = claim_folder(manager, repo.python("first"))
        assert (claim.backend_name, claim.reason) == ("python", "")
        assert [claim.claim] in tracer.answers  # it ran around the backend's answer
        errors = {e.split(" ")[1]: e for e in _errors(caplog)}
        assert sorted(errors) == ["'flaky'", "'oldtracer'", "'tracer'"]  # flaky's failure is still its own
        assert errors["'tracer'"].startswith(
            "plugin 'tracer' (distribution claim-tracer 1.0, entry point tracer = tracer_plugin): its "
            "nereid_claim_model wrapper raised RuntimeError: tracer exploded (around the ")
        assert errors["'tracer'"].endswith(f"; folder {repo.models_dir / 'first'}); it is left out of "
                                           "nereid_claim_model from now on (the backends are asked without it)")
        assert "wrapper raised ValueError: old bug" in errors["'oldtracer'"]
        calls, answers = len(sys.modules["tracer_plugin"].calls), len(tracer.answers)
        claim = claim_folder(manager, repo.python("second"))
        assert (claim.backend_name, claim.reason) == ("python", "")
        assert len(sys.modules["tracer_plugin"].calls) == calls  # left out: not asked again
        assert sorted(tracer.answers[answers:]) == [[], [], [], [], [claim.claim]]  # around each backend but flaky
        assert len(_errors(caplog)) == 3  # nothing more logged at ERROR
        # A wrapper of nereid_add_commands: the built-ins' commands stay, and no built-in is blamed.
        commands = argparse.ArgumentParser().add_subparsers()
        add_commands(manager, commands)
        assert {"bundle", "cxx-header"} <= set(commands.choices)
        # (Stop 48: logged, but not among the problems nereid check counts, as the hook's own failure is.)
        assert [(p.plugin.split(" ")[1], p.what) for p in manager.problems] == [
            ("'tracer'", "its nereid_add_commands wrapper raised RuntimeError: no commands (around the built-in "
             "backend 'cxx'); it is left out")], manager.problems
        assert _errors(caplog)[-1].startswith("plugin 'tracer' (distribution claim-tracer 1.0, entry point tracer = "
                                              "tracer_plugin): its nereid_add_commands wrapper raised RuntimeError: "
                                              "no commands (around the built-in backend ")
    finally:
        for *_, module, _source in RAISING_WRAPPERS:
            sys.modules.pop(module, None)


class SpecnameBackend:
    """A backend whose claim function has another name (pluggy's ``specname=``); it claims folders named "mine"."""

    BACKEND_NAME = "mine"

    @hookspecs.hookimpl(specname="nereid_claim_model")
    def claim(self, folder: Path, declared: bool) -> BackendClaim | None:
        return BackendClaim(create=lambda context: None) if folder.name == "mine" else None


class SpecnameTracer:
    """A claim wrapper declared with ``specname=`` that raises."""

    @hookspecs.hookimpl(specname="nereid_claim_model", wrapper=True)
    def trace(self, folder: Path, declared: bool):
        yield
        raise RuntimeError("tracer broke")


def test_hooks_declared_with_specname_are_left_out_like_any_other(repo, caplog) -> None:
    """Defect: pluggy's subset_hook_caller keeps a plugin without an attribute named after the hook, so a backend
    whose claim used specname= was asked with every other backend (its claim credited to all of them: "several
    backends claim (cpp, cxx, meta, mine, python, python, xla)"), and a raising specname wrapper was blamed on
    every backend."""
    caplog.set_level(logging.ERROR, logger="nereid.plugins")
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(SpecnameBackend(), SpecnameTracer()))
    claim = claim_folder(manager, repo.python("mine"))
    assert claim.reason == (f"several backends claim the folder {repo.models_dir / 'mine'} (mine, python); set "
                            "backend: in nereid.yaml to choose one")
    assert (claim_folder(manager, repo.python("other")).backend_name, len(_errors(caplog))) == ("python", 1)
    assert "its nereid_claim_model wrapper raised RuntimeError: tracer broke" in _errors(caplog)[0]


class Unhashable:
    """A backend plugin object that cannot be hashed (a dataclass instance with eq, say)."""

    BACKEND_NAME = "unhashable"
    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:
        return other is self

    @hookspecs.hookimpl
    def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
        return None


def test_an_unhashable_plugin_object_costs_no_backend_its_claims(repo, caplog) -> None:
    """Defect: asking a backend alone put the other plugins in a set, so one unhashable plugin made every claim
    raise TypeError: every model UNAVAILABLE, each backend blamed in turn."""
    caplog.set_level(logging.ERROR, logger="nereid.plugins")
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(Unhashable(),))
    assert (claim_folder(manager, repo.python("m")).backend_name, _errors(caplog)) == ("python", [])


def test_a_triton_model_folder_is_named_as_one(repo) -> None:
    """A Triton user's folder (config.pbtxt, 1/model.py) got only the generic list of each backend's files."""
    folder = repo.add("triton_style", None)
    (folder / "config.pbtxt").write_text('name: "triton_style"\nbackend: "python"\n')
    (folder / "1").mkdir()
    (folder / "1" / "model.py").write_text("class TritonPythonModel: pass\n")
    reason = claim_folder(make_plugin_manager(load_entry_points=False), folder).reason
    assert reason.endswith("; it looks like a Triton model folder (config.pbtxt): nereid reads no config.pbtxt and "
                           "no version folders; the README's 'Coming from Triton' maps each part"), reason


def test_a_plugin_distribution_without_a_name_is_loaded_not_a_crash(site, caplog) -> None:
    """A dist-info without METADATA (no Name) ended every nereid command in a TypeError."""
    info = site / "nameless-1.0.dist-info"
    info.mkdir()
    (info / "entry_points.txt").write_text("[nereid.backends]\nnameless = nameless_plugin\n")
    (site / "nameless_plugin.py").write_text("from nereid.hookspecs import hookimpl\n"
                                             "@hookimpl\ndef nereid_claim_model(folder, declared):\n"
                                             "    return None\n")
    try:
        manager = make_plugin_manager()
    finally:
        sys.modules.pop("nameless_plugin", None)
    assert manager.has_plugin("nameless") and not manager.problems
    assert manager.describe("nameless").startswith("plugin 'nameless' (distribution (no name) ")


@pytest.mark.parametrize("entry_points", [b"[console_scripts]\nbroken\n", b"[nereid.backends]\ncaf\xe9 = x\n"])
def test_an_installed_package_whose_entry_points_cannot_be_read_costs_only_itself(site, caplog, entry_points):
    """Found by the CLI read hunt: one installed package's malformed (or non-UTF-8) entry_points.txt, not even a
    nereid plugin's, ended every nereid command in a traceback."""
    info = site / "broken_ep-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: broken-ep\nVersion: 0.1\n")
    (info / "entry_points.txt").write_bytes(entry_points)
    manager = make_plugin_manager()
    assert manager.has_plugin("python")  # (the built-in backends, and every other plugin, are there)
    assert [r.getMessage() for r in caplog.records if "cannot read the entry points" in r.getMessage()], \
        caplog.text


EXITING_PLUGINS = (
    ("exit-import", "exit_import", "exit_import_plugin", "import sys\nsys.exit('not today')\n"),
    ("exit-hooks", "exit_hooks", "exit_hooks_plugin",
     "import sys\nfrom nereid.backend import BackendClaim\nfrom nereid.hookspecs import hookimpl\n"
     "class Quits:\n"
     "    platform = 'quits'\n"
     "    def __init__(self, context):\n        self.error = (context.folder / 'quit.txt').read_text().strip()\n"
     "    def load(self):\n"
     "        raise {'exit': SystemExit(4), 'interrupt': KeyboardInterrupt()}[self.error]\n"
     "@hookimpl\ndef nereid_claim_model(folder, declared):\n"
     "    if (folder / 'exit.txt').is_file():\n        sys.exit(3)\n"
     "    return BackendClaim(Quits) if (folder / 'quit.txt').is_file() else None\n"),
)


def test_a_plugin_exiting_is_its_failure_and_never_ends_the_process(site, repo, tmp_path) -> None:
    """Defect: sys.exit() in a plugin's module, claim hook or load() ended nereid serve (silently, exit 3) and
    nereid check; over RepositoryModelLoad it left the model LOADING for good."""
    import threading

    from nereid.backend import ModelContext
    from nereid.errors import ConfigError
    from nereid.model_building import build_model
    from nereid.settings import ModelSettings

    _install(site, EXITING_PLUGINS)
    try:
        manager = make_plugin_manager()
        assert [p.what for p in manager.problems] == ["left out: SystemExit: not today"]
        exits = repo.python("exits")
        (exits / "exit.txt").write_text("")
        claim = claim_folder(manager, exits)
        assert (claim.backend_name, claim.reason) == ("python", "")  # taken as not claiming
        for name, how in (("exit", "SystemExit: 4"), ("interrupt", "KeyboardInterrupt")):
            folder = repo.add(f"quits_{name}", None)
            (folder / "quit.txt").write_text(name)
            context = ModelContext(folder.name, folder, ModelSettings(folder.name), tmp_path, "test")
            outcome: list[BaseException] = []

            def build() -> None:
                try:
                    build_model(manager, context)
                except BaseException as err:  # what reaches the repository's load thread
                    outcome.append(err)

            thread = threading.Thread(target=build)  # as the server loads: on a worker thread
            thread.start()
            thread.join(10)
            assert isinstance(outcome[0], ConfigError), outcome
            # (Named as any exception its load() raises is, with the plugin: the plugin hunt found it named neither.)
            assert str(outcome[0]).startswith(f"model '{folder.name}': {how} (raised by the load() of plugin "
                                              "'exit_hooks'"), outcome
        # On the main thread (nereid check), a KeyboardInterrupt may be Ctrl-C: it is not swallowed there.
        with pytest.raises(ConfigError, match=r"SystemExit: 4 \(raised by the load\(\)"):
            build_model(manager, ModelContext("quits_exit", repo.models_dir / "quits_exit", ModelSettings("quits_exit"),
                                              tmp_path, "test"))
        with pytest.raises(KeyboardInterrupt):
            build_model(manager, ModelContext("quits_interrupt", repo.models_dir / "quits_interrupt",
                                              ModelSettings("quits_interrupt"), tmp_path, "test"))
    finally:
        for *_, module, _source in EXITING_PLUGINS:
            sys.modules.pop(module, None)


def test_a_declared_backend_whose_plugin_was_left_out_is_told_why(site, repo, tmp_path, capsys) -> None:
    """Defect: a model declaring backend: NAME whose installed plugin failed to import was told the backend "is
    not installed", in its reason, in nereid check's line and for backends.NAME, while the log said why."""
    from nereid.cli import check
    from nereid.errors import ConfigError
    from nereid.plugins import check_backend_defaults
    from nereid.settings import load_settings

    _install(site, toy_backends.BROKEN_AT_STARTUP[:1])  # broken_import: its module imports a missing package
    manager = make_plugin_manager()
    left_out = ("plugin 'broken_import' (distribution broken-import 1.0, entry point broken_import = "
                "broken_import_plugin) was left out: ModuleNotFoundError: No module named 'nereid_missing_dependency'")
    folder = repo.add("declared", "input_shape: [1]\noutput_shape: [1]\n")
    assert claim_folder(manager, folder, "broken_import").reason == (
        f"backend 'broken_import' (from nereid.yaml) cannot be used: {left_out} "
        "(fix the plugin, then restart nereid: plugins are loaded at start-up)")
    # Its defaults in nereid.yaml are said to apply to nothing, not refused as the file's mistake (`nereid serve`
    # refused to start, serving nothing: found by a plugin hunt); a backend that is not installed at all still is.
    assert check_backend_defaults(manager, ["broken_import"], "nereid.yaml") == [
        f"nereid.yaml: backends.broken_import: {left_out}; its defaults apply to nothing"]
    with pytest.raises(ConfigError, match="nereid.yaml: backends.brokn_import: no such backend is installed"):
        check_backend_defaults(manager, ["brokn_import"], "nereid.yaml")
    # Undeclared, the folder it should have claimed names it among the plugins left out.
    assert claim_folder(manager, folder).reason.endswith(
        "; plugin(s) left out at start-up (the log and nereid check say why): broken_import; if it is a cxx model "
        "(a folder holding only model_inference.textproto may be one), declare it in nereid.yaml with backend: cxx "
        "and runtime: {library: PATH} (or runtime: {sources: [...]})")
    assert check(load_settings(repo.write_config("""
        - name: declared
          backend: broken_import
    """)), manager) == 1
    out = capsys.readouterr().out
    assert f"declared: UNAVAILABLE: backend 'broken_import' (from nereid.yaml) cannot be used: {left_out}" in out
    assert out.rstrip().endswith("1 model(s) with problems, 1 plugin problem(s)")


HOOKLESS_PLUGINS = (  # (distribution, entry point, module, source): registered by pluggy, asked nothing
    ("typo-hook", "typo_hook", "typo_hook_plugin",
     "from nereid.hookspecs import hookimpl\n@hookimpl\ndef nereid_claim_models(folder, declared):\n    return None\n"),
    ("unmarked-hook", "unmarked_hook", "unmarked_hook_plugin",
     "def nereid_claim_model(folder, declared):\n    return None\n"),
    ("no-hooks", "no_hooks", "no_hooks_plugin", "def nereid_claim_modl(folder, declared):\n    return None\n"),
    # (The config hunt: an async def hook was registered, pluggy took its coroutine for the answer: a defaults
    # check that never ran passed, and the commands of an async nereid_add_commands were never added.)
    ("async-hook", "async_hook", "async_hook_plugin",
     "from nereid.hookspecs import hookimpl\n@hookimpl\ndef nereid_claim_model(folder, declared):\n    return None\n"
     "@hookimpl\nasync def nereid_check_defaults(defaults, origin):\n    raise ValueError(defaults)\n"),
    # (The CLI read hunt: a second function for one hook, pluggy's specname=, left the plugin asked nothing.)
    ("twice-hook", "twice_hook", "twice_hook_plugin",
     "from nereid.hookspecs import hookimpl\n@hookimpl\ndef nereid_claim_model(folder, declared):\n    return None\n"
     "@hookimpl(specname='nereid_claim_model')\ndef claim_more(folder, declared):\n    return None\n"),
    # Usable, and kept: a hook pluggy may leave unspecified (optionalhook), and a plugin adding only commands.
    ("optional-hook", "optional_hook", "optional_hook_plugin",
     "from nereid.hookspecs import hookimpl\n@hookimpl(optionalhook=True)\ndef nereid_future_hook():\n    pass\n"
     "@hookimpl\ndef nereid_claim_model(folder, declared):\n    return None\n"),
    # (The review hunts: a wrapper of a hook beside its one implementation wrapped only its own answers, and once it
    # raised, the plugin's backend claimed nothing more: left out, saying where a wrapper goes.)
    ("wraps-too", "wraps_too", "wraps_too_plugin",
     "from nereid.hookspecs import hookimpl\n@hookimpl(wrapper=True)\ndef nereid_claim_model(folder, declared):\n"
     "    return (yield)\n@hookimpl(specname='nereid_claim_model')\ndef claim_mine(folder, declared):\n"
     "    return None\n"),
    ("tooling-only", "tooling_only", "tooling_only_plugin",
     "from nereid.hookspecs import hookimpl\ndef nereid_helper():\n    pass\n"
     "@hookimpl\ndef nereid_add_commands(commands):\n    pass\n"),
)


def test_a_plugin_implementing_no_nereid_hook_is_left_out_saying_what_to_fix(site, repo, caplog) -> None:
    """Defect: a misnamed hook or a forgotten @hookimpl was registered silently: the plugin claimed nothing and
    neither the log nor nereid check named it."""
    _install(site, HOOKLESS_PLUGINS)
    caplog.set_level(logging.ERROR, logger="nereid.plugins")
    try:
        manager = make_plugin_manager()
    finally:
        for *_, module, _source in HOOKLESS_PLUGINS:
            sys.modules.pop(module, None)
    hooks = ("nereid_add_commands, nereid_check_defaults, nereid_claim_model, nereid_claim_signs, "
             "nereid_declaration_hint, nereid_model_options, nereid_streamed_files")
    assert {p.plugin.split(" ")[1]: p.what for p in manager.problems} == {
        "'typo_hook'": f"left out: unknown hook 'nereid_claim_models' (did you mean nereid_claim_model?); "
                       f"nereid's hooks are: {hooks}",
        "'unmarked_hook'": "left out: its nereid_claim_model is not marked @hookimpl (from nereid.hookspecs import "
                           "hookimpl), so nereid never calls it",
        "'no_hooks'": f"left out: it implements none of nereid's hooks: {hooks} (it defines nereid_claim_modl, "
                      "which is none of them); mark each hook function @hookimpl "
                      "(from nereid.hookspecs import hookimpl)",
        "'async_hook'": "left out: its nereid_check_defaults is an async def: nereid calls its hooks as plain "
                        "functions (make it a plain def)",
        "'twice_hook'": "left out: it implements nereid_claim_model 2 times (claim_more, nereid_claim_model); one "
                        "function per hook",
        "'wraps_too'": "left out: it implements nereid_claim_model 2 times (claim_mine, nereid_claim_model); one "
                       "function per hook (a wrapper goes in a plugin of its own)",
    }
    errors = sorted(_errors(caplog))  # one ERROR line each, naming distribution and entry point
    assert len(errors) == 6 and errors[3].startswith(
        "plugin 'typo_hook' (distribution typo-hook 1.0, entry point typo_hook = typo_hook_plugin): left out: "
        "unknown hook 'nereid_claim_models'")
    assert not any(manager.has_plugin(name) for name in ("typo_hook", "unmarked_hook", "no_hooks", "async_hook",
                                                         "twice_hook"))
    assert manager.has_plugin("optional_hook") and manager.has_plugin("tooling_only")
    assert not manager.has_plugin("wraps_too")
    assert backend_names(manager) == ["cpp", "cxx", "meta", "optional_hook", "python", "xla"]
    reason = claim_folder(manager, repo.add("theirs", None)).reason
    assert "; plugin(s) left out at start-up (the log and nereid check say why): async_hook, no_hooks, twice_hook, " \
           "typo_hook, unmarked_hook, wraps_too" in reason


def test_core_bench_and_test_plugins_have_no_hook_problems() -> None:
    """What now leaves an installed plugin out must not be true of any plugin nereid ships or tests with."""
    import importlib.util

    plugins: list[object] = [toy_backends, toy_backends.FaultyToys(), ClaimTracer(), OldStyleClaimTracer()]
    for bench in ("identity_backend", "layer_backend"):
        path = README.parent / "bench" / f"{bench}.py"
        spec = importlib.util.spec_from_file_location(f"_bench_{bench}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        plugins.append(module)
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=tuple(plugins))
    assert len(manager.get_plugins()) == 5 + len(plugins)
    assert {manager.get_name(plugin): hook_problems(manager, plugin) for plugin in manager.get_plugins()} == {
        manager.get_name(plugin): [] for plugin in manager.get_plugins()}


def test_an_unclaimed_folder_says_what_makes_each_backend_claim_one(installed_addone, repo) -> None:
    """Defect: "add the backend's files" did not say which files; each built-in's is named, and is what it claims."""
    manager = make_plugin_manager()
    folder = repo.add("nobody", "input_shape: [1]\noutput_shape: [1]\n")
    (folder / "notes.txt").write_text("")  # (no cxx hint: not a textproto-only folder)
    assert claim_folder(manager, folder).reason == (
        f"no backend claims the folder {folder} (installed backends: addone, cpp, cxx, meta, python, xla); add the "
        "files of the backend you mean (addone: see its documentation; cpp: main.cpp; cxx: only when declared; "
        "meta: manifest.yaml with meta: true; python: main.py; xla: manifest.yaml) or set backend: in nereid.yaml")
    # Each file named is what makes that built-in claim a folder (cxx claims a folder only when declared).
    for backend, file, text in (("cpp", "main.cpp", ""), ("python", "main.py", ""), ("xla", "manifest.yaml", ""),
                                ("meta", "manifest.yaml", "meta: true\n")):
        claimed = repo.add(f"by_{backend}", None)
        (claimed / file).write_text(text)
        assert claim_folder(manager, claimed).backend_name == backend
    assert claim_folder(manager, folder, "cxx").backend_name == "cxx"


class _Streams:
    """A plugin answering nereid_streamed_files with ``answer`` (raised when it is an exception), counting its calls."""

    def __init__(self, name: str, answer: object) -> None:
        self.BACKEND_NAME = name
        self.answer = answer
        self.asked = 0

    @hookspecs.hookimpl
    def nereid_streamed_files(self, name: str, declared: bool, listing: tuple[str, ...], read_small) -> object:
        self.asked += 1
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer


# A bundle's folder: the xla backend streams its weights.
BUNDLE_LISTING = ("manifest.yaml", "model.py", "weights.safetensors", "vocab.bin")


def _bundle_file(path: str) -> bytes | None:
    return b"format_version: '2.1'\n" if path == "manifest.yaml" else None


def test_a_streamed_files_answer_of_the_wrong_type_is_refused_naming_the_plugin(caplog) -> None:
    """Each backend's nereid_streamed_files is asked alone, so that a wrong answer is its plugin's: one that raises,
    or answers other than a tuple (list, set) of str or None, is logged once at ERROR and ignored (those files are
    fetched); a file stays in the store only when every backend that answers streams it."""
    caplog.set_level(logging.ERROR, logger="nereid.plugins")
    plugins = (_Streams("stringy", "weights.safetensors"), _Streams("mixed", ("weights.safetensors", 3)),
               _Streams("raising", RuntimeError("no idea")), _Streams("listy", ["vocab.bin", "weights.safetensors"]))
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=plugins)
    decide = streamed_files(manager, "m")
    assert decide(BUNDLE_LISTING, _bundle_file) == {"weights.safetensors"}  # (xla's and listy's answers)
    assert decide(BUNDLE_LISTING, _bundle_file) == {"weights.safetensors"}  # (logged once only)
    assert sorted(_errors(caplog)) == [
        "plugin 'mixed': nereid_streamed_files returned a tuple holding an int, not a tuple of file names (str) or "
        "None (model 'm'; every file is fetched); its answer is ignored (its later failures are logged at DEBUG)",
        "plugin 'raising': nereid_streamed_files raised RuntimeError: no idea (model 'm'; every file is fetched); its "
        "answer is ignored (its later failures are logged at DEBUG)",
        "plugin 'stringy': nereid_streamed_files returned a str, not a tuple of file names (str) or None (model 'm'; "
        "every file is fetched); its answer is ignored (its later failures are logged at DEBUG)"]
    # Declared: only that backend is asked (the python backend streams nothing: every file fetched).
    assert streamed_files(manager, "m", "listy")(BUNDLE_LISTING, _bundle_file) == {"vocab.bin", "weights.safetensors"}
    assert streamed_files(manager, "m", "python")(BUNDLE_LISTING, _bundle_file) == frozenset()
    assert [plugin.asked for plugin in plugins] == [2, 2, 2, 3]


def test_a_store_failure_reading_a_file_for_streamed_files_is_the_store_s_not_the_plugin_s(caplog) -> None:
    from nereid.storage import StorageError

    caplog.set_level(logging.ERROR, logger="nereid.plugins")

    def failing(path: str) -> bytes | None:
        raise StorageError(f"s3://b/m/{path}: cannot fetch: HTTP 500")

    with pytest.raises(StorageError, match="manifest.yaml: cannot fetch"):
        streamed_files(make_plugin_manager(load_entry_points=False), "m")(BUNDLE_LISTING, failing)
    assert _errors(caplog) == []
