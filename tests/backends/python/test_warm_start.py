"""Warm start: what is preloaded, what a child sees, and every safety rule (real servers, real forks)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from nereid.backends.python.preload import Preloads, imported_modules, lives_in_folder, modules_to_preload
from nereid.cli import main as cli_main

from support import nereid_serve, process_alive, textproto_single, wait_until, zombie_children

REPORT = textproto_single("BYTES", input_shape="[1]", output_shape="[1]", max_batch_size=8)


def reply_main(expression: str, prelude: str = "") -> str:
    """A main.py that answers one BYTES element: the JSON of ``expression``."""
    return f'''
import json, os, sys
{prelude}
sys.stdin.buffer.read()
answer = json.dumps({expression}).encode()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(b"bytes 1,1\\n" + len(answer).to_bytes(4, "little") + answer)
'''


# With a file "slow" in the model folder: write the pid to running.pid, then sleep.
SLOW_IF_ASKED = ("import time\nif os.path.exists('slow'):\n"
                 "    open('running.pid', 'w').write(str(os.getpid()))\n    time.sleep(30)")


def ask(server, model: str):
    tensor = triton.InferInput("input", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"x"]], dtype=object))
    return json.loads(server.client.infer(model, [tensor]).as_numpy("output")[0, 0])


def backend_of(server, model: str):
    return server.server.repository.entry(model).loaded.backend


# -- what is preloaded --------------------------------------------------------

def test_preload_reads_top_level_imports_only(tmp_path):
    (tmp_path / "helper.py").write_text("X = 1\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "main.py").write_text(
        "from __future__ import annotations\nimport os, json as j\nimport xml.dom\nfrom numpy import linalg\n"
        "from . import sibling\nimport helper\nfrom pkg.sub import thing\n"
        "try:\n    import torch\nexcept ImportError:\n    pass\n"
        "def f():\n    import csv\n"
        "if True:\n    import zlib\n")
    source = (tmp_path / "main.py").read_bytes()
    assert imported_modules(tmp_path / "main.py", source) == ["os", "json", "xml.dom", "numpy", "helper", "pkg.sub"]
    assert modules_to_preload(tmp_path, "main.py", ("sqlite3", "os", "helper", "sqlite3"), source) == Preloads(
        imports=("os", "json", "xml.dom", "numpy"), extra=("sqlite3",),
        submodules=("numpy.linalg",))  # (not pkg.sub.thing: the folder's own; nor __future__.annotations)
    # A module a from-statement names, then imported or named as a package: main.py's own import (it fails the
    # load when it fails); a submodule of a submodule comes after it.
    source = b"from a import b\nimport a.b\nfrom xml import etree\nfrom xml.etree import ElementTree\n"
    assert modules_to_preload(tmp_path, "main.py", (), source) == Preloads(
        imports=("a", "a.b", "xml", "xml.etree"), submodules=("xml.etree.ElementTree",))


def test_child_runs_main_as_a_fresh_script_would(repo, serve):
    folder = repo.python("script", textproto=REPORT, main=reply_main(
        '{"argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0], "cwd": os.getcwd(), '
        '"pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0), '
        '"nereid": sorted(m for m in sys.modules if m.startswith("nereid"))}'))
    server = serve(repo.write_config())
    assert backend_of(server, "script").runtime_report().summary == "warm_start=on"
    first, second = ask(server, "script"), ask(server, "script")
    assert first["argv"] == ["main.py"] and first["name"] == "__main__"
    assert first["file"] == str(folder / "main.py")
    assert os.path.realpath(first["path0"]) == os.path.realpath(folder) == os.path.realpath(first["cwd"])
    assert first["pid"] == first["pgid"] == first["sid"]  # its own session and process group
    assert first["pid"] != second["pid"]  # a fresh process per batch
    assert first["nereid"] == []  # the warm parent imports nothing of the server's


def test_child_state_leaves_no_trace_and_helpers_are_fresh(repo, serve):
    folder = repo.python("stateful", textproto=REPORT, main=reply_main(
        '{"count": json.count, "helper": helper.VALUE}',
        prelude="import helper\njson.count = getattr(json, 'count', 0) + 1"))
    (folder / "helper.py").write_text("VALUE = 'first'\n")
    server = serve(repo.write_config())
    assert backend_of(server, "stateful").runtime_report().summary == "warm_start=on"  # (cold, it proved nothing)
    assert ask(server, "stateful") == {"count": 1, "helper": "first"}
    assert ask(server, "stateful") == {"count": 1, "helper": "first"}  # json is preloaded, yet untouched
    (folder / "helper.py").write_text("VALUE = 'edited'\n")
    assert ask(server, "stateful") == {"count": 1, "helper": "edited"}  # the folder's own modules: never preloaded


def test_numpys_global_random_state_is_drawn_afresh_in_every_run(repo, serve):
    """Defect (found by a bug hunt): numpy's legacy global state, seeded once in the warm parent by a preloaded
    numpy.random, was copied into every fork: np.random.rand() answered the same number in every run, where
    `python main.py` draws a new seed each time (Python's own random module reseeds itself after a fork)."""
    repo.python("sampler", textproto=REPORT, main=reply_main(
        '{"numpy": float(np.random.rand()), "python": random.random()}', prelude="import random\nimport numpy as np\n"
                                                                          "import numpy.random"))
    server = serve(repo.write_config())
    assert backend_of(server, "sampler").runtime_report().summary == "warm_start=on"
    draws = [ask(server, "sampler") for _ in range(3)]
    assert len({draw["numpy"] for draw in draws}) == 3 and len({draw["python"] for draw in draws}) == 3, draws


def test_a_seed_a_preloaded_import_sets_is_what_every_run_starts_with(repo, serve, user_site):
    """Defect (h7 #3): a project package that seeds random and numpy in its __init__ (for reproducible runs) had
    its seed thrown away in every warm run (random reseeds itself after a fork, nereid reseeded numpy); a fresh
    interpreter that imports it is seeded: `python main.py` and cold runs draw the same numbers every time."""
    (user_site / "seeds_everything.py").write_text(
        "import random\nimport numpy as np\nrandom.seed(123)\nnp.random.seed(123)\nDRAWN = random.random()\n")
    repo.python("seeded", textproto=REPORT, main=reply_main(
        "[random.random(), float(np.random.rand())]",
        prelude="import random\nimport numpy as np\nimport seeds_everything"))
    server = serve(repo.write_config())
    assert backend_of(server, "seeded").runtime_report().summary == "warm_start=on"
    python_random = __import__("random").Random(123)
    python_random.random()  # (the package's own draw, DRAWN)
    expected = [python_random.random(), float(np.random.RandomState(123).rand())]
    assert [ask(server, "seeded") for _ in range(3)] == [expected] * 3
    # (Found by the session's review: a package seeding for its own use, then putting the state back, made every
    # warm run draw the same numbers: the global state is as random as before, and runs draw afresh.)
    (user_site / "seeds_and_restores.py").write_text(
        "import random\nimport numpy as np\nsaved, np_saved = random.getstate(), np.random.get_state()\n"
        "random.seed(0)\nnp.random.seed(0)\nrandom.setstate(saved)\nnp.random.set_state(np_saved)\n")
    repo.python("restored", textproto=REPORT, main=reply_main(
        "[random.random(), float(np.random.rand())]",
        prelude="import random\nimport numpy as np\nimport seeds_and_restores"))
    server.client.load_model("restored")
    drawn = [ask(server, "restored") for _ in range(3)]
    assert len({tuple(values) for values in drawn}) == 3, drawn


def test_generators_a_preloaded_import_made_are_drawn_afresh_in_every_run_unless_it_seeded_them(repo, serve,
                                                                                                  user_site):
    """Found by a bug hunt: a generator object made at an installed module's top level (sympy's random.Random(),
    a package's np.random.default_rng()) was copied into every fork as the parent had it: every warm run drew the
    same numbers (randprime gave one prime), where each `python main.py` draws them afresh. One the module
    seeded itself is what every run starts with, as in `python main.py`."""
    (user_site / "makes_generators.py").write_text(
        "import random\nimport numpy as np\n"
        "python_rng, numpy_rng, legacy = random.Random(), np.random.default_rng(), np.random.RandomState()\n"
        "spawned = np.random.default_rng().spawn(1)[0]\n"
        "reseeded = random.Random(); reseeded.seed(5)\n"  # seeded after all: as the module left it
        "python_fixed, numpy_fixed = random.Random(0), np.random.default_rng(42)\n"
        "versioned = random.Random(); versioned.seed(version=2)\n")  # (no seed given: from the OS)
    repo.python("generators", textproto=REPORT, main=reply_main(
        "[g.python_rng.random(), float(g.numpy_rng.random()), float(g.legacy.rand()), float(g.spawned.random()), "
        "g.reseeded.random(), g.python_fixed.random(), float(g.numpy_fixed.random()), g.versioned.random()]",
        prelude="import makes_generators as g"))
    # Beside a lazy proxy whose __class__ raises until configured, as Django's settings do (found by the review of
    # the change: the parent's search for generators read it, and the parent died at each start).
    (user_site / "lazy_settings.py").write_text(
        "import numpy as np\nrng = np.random.default_rng()\n"
        "class LazySettings:\n    @property\n    def __class__(self):\n"
        "        raise RuntimeError('settings are not configured')\nsettings = LazySettings()\n")
    repo.python("lazy", textproto=REPORT, main=reply_main("float(lazy_settings.rng.random())",
                                                          prelude="import lazy_settings"))
    server = serve(repo.write_config())
    assert backend_of(server, "generators").runtime_report().summary == "warm_start=on"
    draws = [ask(server, "generators") for _ in range(3)]
    fresh = [len({draw[i] for draw in draws}) for i in (0, 1, 2, 3, 7)]
    assert fresh == [3, 3, 3, 3, 3], draws
    assert backend_of(server, "lazy").runtime_report().summary == "warm_start=on"
    assert len({ask(server, "lazy") for _ in range(3)}) == 3
    import random
    expected = [random.Random(5).random(), random.Random(0).random(), float(np.random.default_rng(42).random())]
    assert [draw[4:7] for draw in draws] == [expected] * 3


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_main_py_runs_as_loaded_while_the_file_is_rewritten(repo, serve, warm):
    # An edit in place truncates main.py before writing it: runs that start meanwhile must run the
    # loaded version (with watch on, the new one is swapped in once it has loaded).
    # Defect (cold): each cold run execed `python main.py`, so it ran the file on disk, not what loaded.
    repo.python_warm_start = warm
    folder = repo.python("pinned", textproto=REPORT, main=reply_main('"loaded"'))
    server = serve(repo.write_config())
    assert ask(server, "pinned") == "loaded"
    (folder / "main.py").write_text("")
    assert ask(server, "pinned") == "loaded"
    (folder / "main.py").write_text("this is not python(\n")
    assert ask(server, "pinned") == "loaded"
    (folder / "main.py").write_text(reply_main('"edited"'))
    assert ask(server, "pinned") == "loaded"
    server.client.load_model("pinned")  # an explicit reload runs the file as it is now
    assert ask(server, "pinned") == "edited"


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_traceback_quotes_the_loaded_main_py_not_the_file_on_disk(repo, serve, warm):
    # Compiled from what was loaded, a run's traceback quoted the lines of the edited file: a line that never ran.
    repo.python_warm_start = warm
    folder = repo.python("quoted", textproto=REPORT, main="raise ValueError('raised by the loaded version')\n")
    server = serve(repo.write_config())
    (folder / "main.py").write_text("print('the edit, not loaded')\n")
    with pytest.raises(InferenceServerException) as failed:
        ask(server, "quoted")
    message = failed.value.message()
    assert "raise ValueError('raised by the loaded version')" in message and "the edit" not in message, message


@pytest.mark.parametrize("pool", ["ThreadPoolExecutor", "ProcessPoolExecutor"])
def test_an_executor_main_py_never_shuts_down_ends_with_its_run_as_at_interpreter_exit(repo, serve, pool):
    """Defect: warm, a module-level executor that main.py never shuts down (no with, no shutdown()) held every
    run until timeout_s: the interpreter's exit wakes its idle workers through threading's exit hooks, which the
    warm child never called (python main.py ends at once)."""
    repo.python("pooled", textproto=REPORT, main=reply_main(
        "sorted(POOL.map(abs, [-2, 1]))", prelude=f"from concurrent.futures import {pool}\nPOOL = {pool}(2)"))
    server = serve(repo.write_config("- name: pooled\n  timeout_s: 20\n"))
    assert backend_of(server, "pooled").runtime_report().summary == "warm_start=on"
    started = time.monotonic()
    assert ask(server, "pooled") == [1, 2] and ask(server, "pooled") == [1, 2]
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_the_preloads_objects_are_frozen_out_of_the_collector_s_sight_in_a_warm_run_only(repo, serve, warm):
    """What the README tells model authors (the author hunt found it unsaid): a warm run's gc.get_objects() does not
    see what the preloads made, frozen in the parent so that no collection writes to the pages runs share."""
    repo.python_warm_start = warm
    repo.python("gc_view", textproto=REPORT, main=reply_main(
        '{"frozen": gc.get_freeze_count() > 0, "seen": any(o is fractions.Fraction for o in gc.get_objects())}',
        prelude="import gc, fractions"))
    server = serve(repo.write_config())
    assert ask(server, "gc_view") == {"frozen": warm, "seen": not warm}


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_main_py_that_does_not_compile_is_a_load_failure_and_a_reload_keeps_the_old_version(repo, serve, warm):
    """Defect: a main.py that parses but does not compile ('break' outside a loop) loaded READY and failed every
    run; with watch: true, such an edit replaced the working version. Cold (warm_start: false), the index said the
    running version kept serving while every run execed the broken file."""
    repo.python_warm_start = warm
    folder = repo.python("edited", textproto=REPORT, main=reply_main('"v1"'))
    repo.python("broken", textproto=REPORT, main="import json\nreturn 1\n")
    server = serve(repo.write_config(server_extra="  watch: true\n  watch_settle_ms: 100\n"))

    def index() -> dict[str, tuple[str, str]]:
        return {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}

    assert index()["broken"] == ("UNAVAILABLE", "broken/main.py: not valid Python (line 2: 'return' outside function)")
    assert ask(server, "edited") == "v1"
    (folder / "main.py").write_text(reply_main('"v2"', prelude="for i in []:\n    pass\nelse:\n    break"))
    assert wait_until(lambda: "reload failed" in index()["edited"][1])
    assert index()["edited"] == ("READY", "reload failed, the running version keeps serving: "
                                          "edited/main.py: not valid Python (line 6: 'break' outside loop)")
    assert ask(server, "edited") == "v1"


def test_a_renamed_folder_runs_the_loaded_code_under_its_new_name(repo, serve):
    # After a rename the server passes the new path; the code is still the version that loaded,
    # even when the renamed folder's main.py is edited before a reload, and tracebacks name the new path.
    folder = repo.python("before", textproto=REPORT,
                         main=reply_main('[os.getcwd(), __file__, open("main.py").read().count("raise")]',
                                         prelude='if os.path.exists("fail"):\n    raise RuntimeError("asked to")'))
    server = serve(repo.write_config())
    ask(server, "before")
    moved = folder.with_name("after")
    folder.rename(moved)
    server.call(server.server.repository.rename("before", "after"))
    (moved / "main.py").write_text(reply_main('"edited"'))
    cwd, file, raises = ask(server, "after")
    assert (cwd, file, raises) == (str(moved), str(moved / "main.py"), 0)  # the edited file on disk, the loaded code
    (moved / "fail").write_text("")
    error = _error_of(lambda: ask(server, "after"))
    assert error is not None and "RuntimeError: asked to" in error.message()
    assert 'after/main.py", line' in error.message() and "before/" not in error.message()


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
@pytest.mark.parametrize("change", ["renamed", "deleted"])
def test_a_run_that_finds_its_folder_gone_still_runs_the_loaded_code(repo, serve, change, warm):
    # A request queued just before its folder moved or went away is run by a child that finds no
    # folder at the path it was given: it runs in the loaded folder, wherever that is now.
    repo.python_warm_start = warm
    where = "try:\n    where = os.getcwd()\nexcept FileNotFoundError:\n    where = None  # a deleted folder"
    folder = repo.python("moving", textproto=REPORT, main=reply_main("[where, 'loaded']", prelude=where))
    server = serve(repo.write_config())  # no watch: the server never hears of the change
    assert ask(server, "moving") == [str(folder), "loaded"]
    if change == "renamed":
        folder.rename(folder.with_name("elsewhere"))
        assert ask(server, "moving") == [str(folder.with_name("elsewhere")), "loaded"]
    else:
        shutil.rmtree(folder)
        assert ask(server, "moving") == [None, "loaded"]  # in the deleted folder, as any process left in it


# Answers the version.txt found in its working directory and the one next to its __file__ (None: none there).
VERSIONED = reply_main("[read(os.curdir), read(os.path.dirname(__file__))]", prelude="""
def read(folder):
    path = os.path.join(folder, "version.txt")
    return open(path).read() if os.path.exists(path) else None""")


def versioned_model(repo, name: str = "m") -> Path:
    folder = repo.python(name, textproto=REPORT, main=VERSIONED)
    (folder / "version.txt").write_text("v1")
    return folder


def next_version(repo, folder: Path) -> Path:
    """The same model with version.txt "v2", outside the repository (moved under the model's name later)."""
    new = repo.root / "staged"
    shutil.copytree(folder, new)
    (new / "version.txt").write_text("v2")
    return new


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_folder_renamed_away_and_replaced_under_its_name_serves_on_from_where_it_went(repo, serve, warm):
    # mv m old; mv new m: until the server loads the new folder, runs stay in the loaded one, where it went,
    # with its files. They ran in the new folder (the path), the loaded main.py reading the new version's files.
    repo.python_warm_start = warm
    folder = versioned_model(repo)
    server = serve(repo.write_config())  # no watch: the server never hears of the change
    assert ask(server, "m") == ["v1", "v1"]
    new = next_version(repo, folder)
    folder.rename(folder.with_name("old"))
    new.rename(folder)
    assert ask(server, "m") == ["v1", "v1"]


@pytest.mark.parametrize("how", ["rename", "delete"])
def test_a_run_started_just_before_its_folder_is_swapped_imports_its_helpers_from_its_own_folder(repo, serve, how):
    """Defect: with ``mv m .m.old && mv .m.new m`` landing after a warm run of the loaded version had started
    (its folder's path checked then) but before it imported ``helper``, the import went by the path, to the new
    version's ``helper.py``: the old main.py with the new helper (25 failed requests of 5,270 over 60 swaps in
    bench/soak_swap.py). The import now follows the loaded folder to where it is; after ``rm -rf m; mv new m``
    it finds nothing there (the deleted folder is empty), rather than the new version's files."""
    gate = repo.root / "gate"
    gate.mkdir()

    def main_of(version: int) -> str:
        # Says it has started, waits to be let go, then imports its helpers: the swap lands in between.
        return reply_main("report()", prelude=f"""import importlib, time
VERSION = {version}
def report():
    try:
        helper, sub, space = (importlib.import_module(name) for name in ("helper", "pkg.sub", "space.mod"))
    except ImportError as err:
        return type(err).__name__
    return [VERSION, helper.VERSION, sub.VERSION, space.VERSION, os.path.relpath(helper.__file__),
            os.path.relpath(sub.__file__), os.path.relpath(space.__file__),
            os.path.basename(os.path.dirname(helper.__file__))]
open({str(gate / 'started')!r}, 'w').close()
while not os.path.exists({str(gate / 'go')!r}):
    time.sleep(0.01)
""")

    folder = repo.python("m", textproto=REPORT, main=main_of(1))
    new = repo.root / "ml-backends" / ".m.new"  # hidden names are never models
    for version, where in ((1, folder), (2, new)):
        if version == 2:
            shutil.copytree(folder, new)
            (new / "main.py").write_text(main_of(2))
        (where / "pkg").mkdir(exist_ok=True)
        (where / "space").mkdir(exist_ok=True)  # a namespace package (no __init__.py)
        (where / "pkg" / "__init__.py").write_text("")
        for module in ("helper.py", "pkg/sub.py", "space/mod.py"):
            (where / module).write_text(f"VERSION = {version}\n")
    server = serve(repo.write_config())  # no watch: the server serves the loaded version throughout
    answers: list = []
    run = threading.Thread(target=lambda: answers.append(ask(server, "m")))
    run.start()
    try:
        assert wait_until(lambda: (gate / "started").exists(), 30)
        if how == "rename":
            folder.rename(folder.with_name(".m.old"))
        else:
            shutil.rmtree(folder)
        new.rename(folder)
    finally:
        (gate / "go").touch()
        run.join(30)
    if how == "rename":  # its own helpers, named by the paths they have now
        assert answers == [[1, 1, 1, 1, "helper.py", "pkg/sub.py", "space/mod.py", ".m.old"]]
    else:
        assert answers == ["ModuleNotFoundError"]


def test_the_folders_modules_are_named_listed_and_found_as_python_main_py_finds_them(repo, serve):
    """What the loaded-folder finder (the swap above) must keep as it was: a namespace package named by the
    folder's path, not /proc/self/cwd's, and found after main.py changes directory; pkgutil listing the folder
    and a package in it (it found nothing once the folder's finder was no FileFinder)."""
    folder = repo.python("m", textproto=REPORT, main=reply_main("report()", prelude="""import importlib, pkgutil
def report():
    here = os.path.dirname(os.path.abspath(__file__))
    import space.one, plugins
    found = {"file": os.path.relpath(space.one.__file__, here),
             "path": [os.path.relpath(location, here) for location in space.__path__],
             "top": sorted(m.name for m in pkgutil.iter_modules([here])),
             "plugins": sorted(m.name for m in pkgutil.iter_modules(plugins.__path__))}
    os.chdir("/")
    import space.two
    found["after chdir"] = os.path.relpath(space.two.__file__, here)
    return found
"""))
    for module in ("space/one.py", "space/two.py", "plugins/__init__.py", "plugins/alpha.py", "helper.py"):
        (folder / module).parent.mkdir(exist_ok=True)
        (folder / module).write_text("")
    server = serve(repo.write_config())
    assert ask(server, "m") == {"file": "space/one.py", "path": ["space"], "top": ["helper", "main", "plugins"],
                                "plugins": ["alpha"], "after chdir": "space/two.py"}


def test_a_folder_deleted_and_replaced_under_its_name_runs_the_loaded_code_in_the_deleted_folder(repo, serve):
    # rm -rf m; mv new m: the loaded main.py runs in the deleted (empty) folder, never in the new one; its
    # __file__ leads there too, so neither a file next to it nor an import finds the new version's.
    folder = versioned_model(repo)
    server = serve(repo.write_config())
    assert ask(server, "m") == ["v1", "v1"]
    new = next_version(repo, folder)
    shutil.rmtree(folder)
    new.rename(folder)
    assert ask(server, "m") == [None, None]


def test_a_run_in_a_deleted_folder_names_the_model_s_path_in_its_traceback(repo, serve):
    # The traceback named /proc/self/fd/N/main.py: a descriptor number of a process that had ended.
    folder = repo.python("gone", textproto=REPORT, main=reply_main("open('data.txt').read()"))
    (folder / "data.txt").write_text("here")
    server = serve(repo.write_config())
    assert ask(server, "gone") == "here"
    shutil.rmtree(folder)
    with pytest.raises(InferenceServerException) as caught:
        ask(server, "gone")
    assert 'File "gone (deleted)/main.py", line ' in caught.value.message()
    assert "FileNotFoundError" in caught.value.message() and "/proc/self/fd" not in caught.value.message()


def test_a_folder_copied_then_deleted_serves_from_the_copy_once_relocated(repo, serve):
    # cp -r m n; rm -rf m, then the server relocates the model to n: its runs enter the copy (another
    # folder than the one loaded, which is gone), as the server's rename told them.
    folder = versioned_model(repo)
    server = serve(repo.write_config())
    copy = folder.with_name("n")
    shutil.copytree(folder, copy)
    shutil.rmtree(folder)
    server.call(server.server.repository.rename("m", "n"))
    assert ask(server, "n") == ["v1", "v1"]


def test_a_submodule_a_from_import_takes_from_its_package_is_preloaded_and_an_attribute_is_not(repo, serve,
                                                                                               user_site):
    """Defect: `from scipy import signal` preloaded scipy alone, and every run imported scipy.signal again (0.6 s
    a run against 11 ms for `import scipy.signal`)."""
    (user_site / "pkg").mkdir()
    (user_site / "pkg" / "__init__.py").write_text("import os\nPID = os.getpid()\nname = 'an attribute'\n")
    (user_site / "pkg" / "sub.py").write_text("import os\nPID = os.getpid()\n")
    (user_site / "pkg" / "name.py").write_text("raise RuntimeError('imported though the attribute was taken')\n")
    # (main.py's imports come first: an import after another statement is left to each run)
    repo.python("taker", textproto=REPORT, main=reply_main(
        '{"preloaded": [pkg.PID != os.getpid(), sub.PID != os.getpid()], "name": name}',
        prelude="from pkg import sub, name\nimport pkg\n"))
    server = serve(repo.write_config())
    assert backend_of(server, "taker").runtime_report().summary == "warm_start=on"
    # Imported by the parent before the child ran main.py: pkg.name never (the package's attribute is taken).
    assert ask(server, "taker") == {"preloaded": [True, True], "name": "an attribute"}


def test_preloaded_modules_are_already_imported_in_the_child(repo, serve):
    repo.python("preloaded", textproto=REPORT, main=reply_main(
        '{"before": before}', prelude='before = sorted(m for m in ("decimal", "fractions") if m in sys.modules)'))
    server = serve(repo.write_config('- name: preloaded\n  runtime: {preload: [decimal, fractions]}\n'))
    assert ask(server, "preloaded") == {"before": ["decimal", "fractions"]}


def test_a_preload_of_the_model_s_own_module_is_said_to_be_left_to_each_run(repo, serve, caplog):
    """Found by a bug hunt: `preload: [helper]` naming the folder's own helper.py was skipped without a word."""
    folder = repo.python("own", textproto=REPORT, main=reply_main('{"ok": 1}'))
    (folder / "helper.py").write_text("VALUE = 1\n")
    caplog.set_level(logging.WARNING, "nereid.backends.python.plugin")
    server = serve(repo.write_config('- name: own\n  runtime: {preload: [decimal, helper]}\n'))
    assert ask(server, "own") == {"ok": 1}
    assert [r.getMessage() for r in caplog.records if "runtime.preload" in r.getMessage()] == [
        "model 'own': runtime.preload names 'helper' of the model's own folder, which is never preloaded: each run "
        "imports it fresh, so an edit takes effect on the next batch"]


# -- falling back to cold starts ------------------------------------------------

@pytest.fixture
def user_site(tmp_path) -> Path:
    """Installed-looking modules that every interpreter of this Python sees, for this test only.

    A ``.pth`` file in the interpreter's site-packages adds a temporary folder to
    ``sys.path`` (the model's processes inherit no PYTHONPATH), and is removed after.
    """
    site = tmp_path / "site"
    site.mkdir()
    (site / "starts_a_thread.py").write_text(
        "import threading, time\nthreading.Thread(target=time.sleep, args=(60,), name='busy', daemon=True).start()\n")
    (site / "fails_on_import.py").write_text("raise RuntimeError('cannot import me')\n")
    (site / "starts_a_process.py").write_text(
        "import subprocess\nhelper = subprocess.Popen(['sleep', '60'])\n"
        f"open({str(site / 'helper.pid')!r}, 'w').write(str(helper.pid))\n")
    (site / "ran_a_process.py").write_text("import subprocess\nsubprocess.run(['true'], check=True)\n"
                                           "left = subprocess.Popen(['sleep', '0.05'])\n")  # (not waited for)
    # Imported by a warm parent (whose working directory is the model folder) before it compiles main.py.
    (site / "rewrites_main.py").write_text("open('main.py', 'w').write('def broken(:\\n')\n")
    pth = Path(sysconfig.get_paths()["purelib"]) / f"nereid-test-{uuid.uuid4().hex}.pth"
    pth.write_text(f"{site}\n")
    try:
        yield site
    finally:
        pth.unlink(missing_ok=True)


def test_the_parent_compiles_the_main_py_the_server_read_at_load(repo, serve, user_site):
    # main.py rewritten while the model loads (here by a preloaded module, after the server has read
    # and checked the file): the version serves what was checked, not what is on disk by then.
    repo.python("raced", textproto=REPORT, main=reply_main('"as read"'))
    server = serve(repo.write_config("- name: raced\n  runtime: {preload: [rewrites_main]}\n"))
    assert (repo.models_dir / "raced" / "main.py").read_text() == "def broken(:\n"
    assert ask(server, "raced") == "as read"


def test_a_warning_a_preloaded_import_raises_is_logged_by_the_server_and_its_filters_stay(repo, serve, user_site,
                                                                                         caplog):
    """Found by the python-models hunt: a preloaded import's warning (scikit-learn's "unpickle estimator from
    version X ... might lead to invalid results") was emitted once, in the warm parent, and reached only the
    parent's own log: neither nereid serve's log nor nereid check showed it."""
    (user_site / "warns_on_import.py").write_text(
        "import warnings\nwarnings.warn('estimator unpickled from version 0.9', UserWarning)\n"
        "warnings.filterwarnings('ignore', message='noisy')  # (a library silencing what it knows is harmless)\n")
    main = reply_main("sorted(str(w.message) for w in caught)", prelude=(
        "import warnings, warns_on_import\nwith warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.warn('noisy')\n    warnings.warn('kept')\n"))
    repo.python("warned", textproto=REPORT, main=main)
    caplog.set_level(logging.WARNING, logger="py.warnings")
    server = serve(repo.write_config("- name: warned\n"))
    assert backend_of(server, "warned").runtime_report().summary == "warm_start=on"
    logged = [r.getMessage() for r in caplog.records if r.name == "py.warnings"]
    assert len(logged) == 1 and logged[0].startswith("model 'warned': ") and (
        "UserWarning: estimator unpickled from version 0.9" in logged[0]), logged
    assert ask(server, "warned") == ["kept"]  # (the import's filter holds in each run, as under python main.py)


def test_a_run_s_warnings_reach_its_stderr_when_a_preloaded_import_kept_showwarning(repo, serve, user_site):
    """Found by the review hunt of 8af5155: a library that keeps warnings.showwarning to pass on what it does not
    silence (or logging.captureWarnings, which puts it back) kept the preload's recorder, and every warning of
    every run went into a list nobody read. Its replacement of atexit.register stays too."""
    (user_site / "keeps_showwarning.py").write_text(
        "import atexit, warnings\n_shown = warnings.showwarning\n"
        "def _quiet(message, category, *args, **kwargs):\n"
        "    if 'noise' not in str(message):\n        _shown(message, category, *args, **kwargs)\n"
        "warnings.showwarning = _quiet\n"
        "_register = atexit.register\ndef taken(func, *args, **kwargs):\n    return _register(func, *args, **kwargs)\n"
        "atexit.register = taken\n")
    main = reply_main("['UserWarning: real problem' in captured.getvalue(), 'noise' in captured.getvalue(), "
                      "atexit.register is keeps_showwarning.taken]",
                      prelude=("import atexit, io, warnings, keeps_showwarning\ncaptured = io.StringIO()\n"
                               "sys.stderr = captured\nwarnings.warn('noise')\nwarnings.warn('real problem')\n"
                               "sys.stderr = sys.__stderr__\n"))
    repo.python("kept", textproto=REPORT, main=main)
    server = serve(repo.write_config("- name: kept\n"))
    assert backend_of(server, "kept").runtime_report().summary == "warm_start=on"
    assert ask(server, "kept") == [True, False, True]


def test_a_module_only_the_server_s_pythonpath_holds_is_named_as_such(repo, serve, tmp_path, monkeypatch):
    """Found by the python-models hunt: a Docker image's ENV PYTHONPATH=/app lets the server import a module that
    model runs cannot (they do not inherit PYTHONPATH), and the load said only "No module named 'zoo2'"."""
    on_path = tmp_path / "app"
    on_path.mkdir()
    (on_path / "zoo_only_on_pythonpath.py").write_text("VALUE = 1\n")
    # (The interpreter's own site-packages on PYTHONPATH too, as a Dockerfile's ENV may put it: runs have it all the
    # same, so a cold model importing numpy loads; the review hunt.)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "elsewhere"), str(on_path),
                                                      sysconfig.get_paths()["purelib"]]))
    repo.python("np_cold", textproto=REPORT, main=reply_main("1", prelude="import numpy"))
    repo.python("pp", textproto=REPORT, main=reply_main("1", prelude="import zoo_only_on_pythonpath"))
    repo.python("absent", textproto=REPORT, main=reply_main("1", prelude="import nereid_no_such_module"))
    repo.python("pp_cold", textproto=REPORT, main=reply_main("1", prelude="import zoo_only_on_pythonpath"))
    server = serve(repo.write_config("- name: pp\n- name: absent\n- name: pp_cold\n  runtime: {warm_start: false}\n"
                                     "- name: np_cold\n  runtime: {warm_start: false}\n"))
    assert ask(server, "np_cold") == 1
    reasons = {m.name: m.reason for m in server.client.get_model_repository_index().models}
    # (The review hunt: a cold model, whose load imports nothing, loaded READY and failed every run.)
    assert reasons["pp_cold"] == (
        "model 'pp_cold': main.py imports 'zoo_only_on_pythonpath', which model runs cannot import; every run would "
        "stop there (the server's PYTHONPATH holds it, in app, but model runs do not inherit PYTHONPATH: install the "
        "package into the interpreter nereid runs under, or list its folder in a .pth file of that interpreter's "
        "site-packages)"), reasons["pp_cold"]
    assert reasons["pp"].endswith(
        "every run would stop there (the server's PYTHONPATH holds it, in app, but model runs do not inherit "
        "PYTHONPATH: install the package into the interpreter nereid runs under, or list its folder in a .pth file "
        "of that interpreter's site-packages)"), reasons["pp"]
    assert reasons["absent"].endswith("every run would stop there"), reasons["absent"]


def test_a_cold_model_s_import_is_asked_of_the_runs_own_import_system_at_each_load(repo, serve, tmp_path,
                                                                                    monkeypatch):
    """Found by the review hunt of 23203aa: the runs' path was asked once for the server's life, so a .pth file
    written as the refusal's hint says left the model refused until a restart; and a package an editable
    install's finder serves (setuptools' `pip install -e`), on the server's PYTHONPATH too, was refused though
    every run imports it."""
    late, src = tmp_path / "late", tmp_path / "src"
    (src / "zoo_editable").mkdir(parents=True)
    (src / "zoo_editable" / "__init__.py").write_text("VALUE = 2\n")
    late.mkdir()
    (late / "zoo_late.py").write_text("VALUE = 3\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(src), str(late)]))
    purelib = Path(sysconfig.get_paths()["purelib"])
    finder, pth = (purelib / f"nereid-test-{uuid.uuid4().hex}.pth" for _ in range(2))
    # (An editable install's finder: on no sys.path entry, it maps its package's name to its source folder.)
    finder.write_text(
        "import sys, importlib.machinery; sys.meta_path.append(type('Finder', (), {'find_spec': classmethod("
        "lambda cls, name, path=None, target=None: sys.modules['importlib.machinery'].PathFinder.find_spec("
        f"name, [{str(src)!r}]) "
        "if name == 'zoo_editable' else None)}))\n")
    try:
        repo.python("edit", textproto=REPORT, main=reply_main("zoo_editable.VALUE", prelude="import zoo_editable"))
        repo.python("late", textproto=REPORT, main=reply_main("zoo_late.VALUE", prelude="import zoo_late"))
        server = serve(repo.write_config("- name: edit\n  runtime: {warm_start: false}\n"
                                         "- name: late\n  runtime: {warm_start: false}\n"))
        assert ask(server, "edit") == 2
        reasons = {m.name: m.reason for m in server.client.get_model_repository_index().models}
        assert "'zoo_late', which model runs cannot import" in reasons["late"], reasons["late"]
        pth.write_text(f"{late}\n")  # (as the hint says: no restart)
        server.client.load_model("late")
        assert ask(server, "late") == 3
    finally:
        finder.unlink(missing_ok=True)
        pth.unlink(missing_ok=True)


def test_files_a_preloaded_import_made_for_its_process_outlive_each_run(repo, serve, user_site):
    """Found by the python-models hunt: an installed package that unpacks its weights into a TemporaryDirectory at
    import (removed at exit by its weakref.finalize), or matplotlib's mkdtemp folder with atexit.register(
    shutil.rmtree, ...), lost them at the first run's exit, the folder being the parent's, shared by every fork:
    each later run failed for as long as the version served, where python main.py serves every run."""
    (user_site / "unpacks_its_weights.py").write_text(
        "import os, tempfile\nunpacked = tempfile.TemporaryDirectory(prefix='weights-')\n"
        "path = os.path.join(unpacked.name, 'w.txt')\nopen(path, 'w').write('41')\n")
    (user_site / "removes_its_folder_at_exit.py").write_text(
        "import atexit, functools, os, shutil, tempfile\nfolder = tempfile.mkdtemp(prefix='config-')\n"
        "path = os.path.join(folder, 'c.txt')\nopen(path, 'w').write('1')\n"
        "atexit.register(shutil.rmtree, folder)\natexit.register(functools.partial(os.remove, path))\n")
    # (The review hunt: exit functions of a library's own, around the removal, removed them all the same.)
    (user_site / "wraps_its_removals.py").write_text(
        "import atexit, contextlib, os, pathlib, shutil, tempfile\n"
        "made = [tempfile.mkdtemp() for _ in range(2)]\n"
        "atexit.register(lambda: shutil.rmtree(made[0]))\n"
        "@atexit.register\ndef _clean_up():\n    shutil.rmtree(made[1])\n"
        "kept = tempfile.NamedTemporaryFile(delete=True)\natexit.register(kept.close)\n"
        "stack = contextlib.ExitStack()\nheld = stack.enter_context(tempfile.TemporaryDirectory())\n"
        "atexit.register(stack.close)\n"
        "marker = pathlib.Path(made[0]) / 'marker'\nmarker.write_text('1')\natexit.register(marker.unlink)\n"
        "import os as _os\nother = _os.path.join(made[1], 'other')\nopen(other, 'w').close()\n"
        "atexit.register(lambda: _os.remove(other))\n"
        "from os import remove as _rm\nthird = _os.path.join(made[1], 'third')\nopen(third, 'w').close()\n"
        "atexit.register(lambda: _rm(third))\n"
        "fourth = _os.path.join(made[1], 'fourth')\nopen(fourth, 'w').close()\n"
        "def _local_clean():  # (os imported in the function: a local, no global; the review hunt)\n"
        "    import os\n    os.remove(fourth)\n"
        "atexit.register(_local_clean)\n"
        "fifth = _os.path.join(made[1], 'fifth')\nopen(fifth, 'w').close()\n"
        "def _local_from():  # (a local bound to os.remove by its import: the review hunt)\n"
        "    from os import remove as rm\n    rm(fifth)\n"
        "atexit.register(_local_from)\n"
        "def _flush_param(os=[]):  # a parameter named os, a list: no removal (the review hunt)\n"
        "    os.append('x')\n    os.remove('x')\n"
        f"    open({str(user_site / 'param.log')!r}, 'a').write('run\\n')\n"
        "atexit.register(_flush_param)\n"
        "paths = [*made, kept.name, held, str(marker), other, third, fourth, fifth]\n"
        "def remove(items, item):  # a helper of its own named remove: no file removed (the review hunt)\n"
        "    items.remove(item)\n"
        "def _flush_helped():\n    noted = ['run']\n    remove(noted, 'run')\n"
        f"    open({str(user_site / 'helped.log')!r}, 'a').write('run\\n')\n"
        "atexit.register(_flush_helped)\n"
        "_pending = []\n"
        f"def _flush():  # a library's exit function that only flushes what its process recorded: still run\n"
        "    _pending.append('run')\n"
        f"    with open({str(user_site / 'flushed.log')!r}, 'a') as log:\n"
        "        for item in list(_pending):\n"
        "            log.write(item + '\\n')\n"
        "            _pending.remove(item)  # (a list's remove: no file removed; the review hunt)\n"
        "        os.fsync(log.fileno())  # (os beside a list's remove: no file removed either; the next review hunt)\n"
        "atexit.register(_flush)\n")
    prelude = "import os, unpacks_its_weights, removes_its_folder_at_exit, wraps_its_removals\n"
    repo.python("unpacked", textproto=REPORT, main=reply_main(
        "int(open(unpacks_its_weights.path).read()) + int(open(removes_its_folder_at_exit.path).read()) "
        "+ sum(os.path.exists(path) for path in wraps_its_removals.paths)", prelude=prelude))
    server = serve(repo.write_config("- name: unpacked\n"))
    assert backend_of(server, "unpacked").runtime_report().summary == "warm_start=on"
    assert [ask(server, "unpacked") for _ in range(3)] == [51, 51, 51]
    assert wait_until(lambda: (user_site / "param.log").is_file()
                      and (user_site / "param.log").read_text() == "run\n" * 3)
    assert wait_until(lambda: (user_site / "helped.log").is_file()
                      and (user_site / "helped.log").read_text() == "run\n" * 3)
    assert wait_until(lambda: (user_site / "flushed.log").is_file()
                      and (user_site / "flushed.log").read_text() == "run\n" * 3)


@pytest.mark.parametrize("module, reason", [
    # (Found by a bug hunt: the reason named neither the module nor the library that started the threads.)
    ("starts_a_thread", "preloading 'starts_a_thread' started threads (busy); forking a threaded process is unsafe; "
                        "start them in the code that runs per batch (main.py's body or a function it calls), not at "
                        "import"),
    ("fails_on_import", "preloading 'fails_on_import' failed (RuntimeError: cannot import me)"),
    # Found by a bug hunt: the first run after each load worked, every later one broke (the process was swept).
    ("starts_a_process", r"preloading started a process \(sleep \(pid \d+\)\) that every run would share; start it "
                         r"in the code that runs per batch \(main.py's body or a function it calls\), not at import"),
])
def test_unsafe_preload_falls_back_to_cold_starts(repo, serve, user_site, caplog, module, reason):
    repo.python("fallback", textproto=REPORT, main=reply_main('{"ok": True}'))
    config = repo.write_config(f"- name: fallback\n  runtime: {{preload: [{module}]}}\n")
    server = serve(config)
    if module == "starts_a_process":
        # (The read hunt: the process the preload started outlived the fallback, the unload and the server.)
        helper = int((user_site / "helper.pid").read_text())
        assert wait_until(lambda: not process_alive(helper))
    assert re.fullmatch(rf"warm_start=off \({reason if module == 'starts_a_process' else re.escape(reason)}\)",
                        backend_of(server, "fallback").runtime_report().summary)
    assert backend_of(server, "fallback").runtime_report().warm_parent_resident_bytes is None
    assert [r.message for r in caplog.records if "warm start is off" in r.message] != []
    assert ask(server, "fallback") == {"ok": True}  # served, cold


def test_a_process_a_preloaded_import_s_thread_started_ends_with_the_parent_that_falls_back(repo, serve, user_site):
    """The review hunt of f8cf00a: Linux lists a process's children per thread that forked them, so the parent's
    end missed one a preloaded import's thread started (the usual case: threads are why it falls back), and it
    outlived the fallback, every reload and the server."""
    (user_site / "thread_starts_a_process.py").write_text(
        "import subprocess, threading, time\n"
        "def spawn():\n"
        "    helper = subprocess.Popen(['sleep', '60'], start_new_session=True)\n"
        f"    open({str(user_site / 'thread_helper.pid')!r}, 'w').write(str(helper.pid))\n"
        "    time.sleep(60)\n"
        "threading.Thread(target=spawn, daemon=True).start()\n"
        "while True:\n"
        f"    try:\n        open({str(user_site / 'thread_helper.pid')!r}).read() or 1/0\n        break\n"
        "    except Exception:\n        time.sleep(0.01)\n")
    repo.python("spawner", textproto=REPORT, main=reply_main('"ok"'))
    server = serve(repo.write_config("- name: spawner\n  runtime: {preload: [thread_starts_a_process]}\n"))
    assert backend_of(server, "spawner").runtime_report().summary.startswith("warm_start=off")
    helper = int((user_site / "thread_helper.pid").read_text())
    assert wait_until(lambda: not process_alive(helper))


@pytest.mark.parametrize("module, code", [
    ("replaces_stdin", "import os, sys\nsys.stdin = open(os.devnull)\n"),
    ("closes_stdin", "import sys\nsys.stdin.close()\n"),
    ("drops_stdout", "import sys\nsys.stdout = None\n"),
])
def test_a_preload_that_replaces_or_closes_a_standard_stream_serves_warm(repo, serve, user_site, module, code):
    """Found by the read hunt: the warm parent read the server's lifeline from sys.stdin and flushed sys.stdout
    before each fork after the preloads, so an import that replaced or closed them (as python main.py allows)
    left the model READY with every run failing and three parents started per request."""
    (user_site / f"{module}.py").write_text(code)
    main = reply_main("41", prelude=f"import {module}").replace("sys.stdin.buffer.read()\n", "")
    repo.python("streams", textproto=REPORT, main=main)
    server = serve(repo.write_config("- name: streams\n"))
    assert backend_of(server, "streams").runtime_report().summary == "warm_start=on"
    assert [ask(server, "streams") for _ in range(3)] == [41, 41, 41]


def test_a_preload_that_ran_a_process_to_its_end_keeps_warm_start_on(repo, serve, user_site):
    repo.python("ran", textproto=REPORT, main=reply_main('{"ok": True}'))
    server = serve(repo.write_config("- name: ran\n  runtime: {preload: [ran_a_process]}\n"))
    assert backend_of(server, "ran").runtime_report().summary == "warm_start=on"
    assert [ask(server, "ran") for _ in range(2)] == [{"ok": True}] * 2



def test_a_top_level_import_of_main_py_that_fails_is_a_load_failure(repo, serve, user_site):
    """Defect: a main.py whose own top-level import fails (a package not installed, one that raises as it is
    imported) loaded READY, running cold, and every request failed with the import's traceback. `python main.py`
    stops there every time, so it is a load failure, like a SyntaxError; with watch: true such an edit leaves the
    working version serving. A failing `runtime.preload` still only turns warm start off (the test above), and
    `warm_start: false` never imports at load."""
    folder = repo.python("edited", textproto=REPORT, main=reply_main('"v1"'))
    repo.python("missing", textproto=REPORT, main=reply_main("1", prelude="import nereid_no_such_module"))
    repo.python("raising", textproto=REPORT, main=reply_main("1", prelude="from fails_on_import import x"))
    # (Found by a hunt: a name the package neither defines nor has as a submodule loaded READY, warm start on,
    # and every request failed with the ImportError.)
    repo.python("misspelt", textproto=REPORT, main=reply_main("1", prelude="from json import dumpz"))
    repo.python("cold", textproto=REPORT, main=reply_main("1", prelude="import nereid_no_such_module"))
    server = serve(repo.write_config("- name: edited\n- name: missing\n- name: raising\n- name: misspelt\n"
                                     "- name: cold\n  runtime: {warm_start: false}\n",
                                     server_extra="  watch: true\n  watch_settle_ms: 100\n"))

    def index() -> dict[str, tuple[str, str]]:
        return {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}

    assert index()["missing"] == ("UNAVAILABLE", "model 'missing': main.py imports 'nereid_no_such_module', which "
                                  "fails to import (ModuleNotFoundError: No module named 'nereid_no_such_module'); "
                                  "every run would stop there")
    assert index()["raising"] == ("UNAVAILABLE", "model 'raising': main.py imports 'fails_on_import', which fails "
                                  "to import (RuntimeError: cannot import me); every run would stop there")
    assert index()["misspelt"] == ("UNAVAILABLE", "model 'misspelt': main.py imports 'dumpz' from 'json', which "
                                   "fails to import (ImportError: cannot import name 'dumpz' from 'json': neither a "
                                   "name the package defines nor a submodule of it); every run would stop there")
    assert index()["cold"][0] == "READY"
    with pytest.raises(InferenceServerException, match="No module named 'nereid_no_such_module'"):
        ask(server, "cold")
    assert ask(server, "edited") == "v1"
    (folder / "main.py").write_text(reply_main('"v2"', prelude="import nereid_no_such_module"))
    assert wait_until(lambda: "reload failed" in index()["edited"][1])
    assert index()["edited"] == ("READY", "reload failed, the running version keeps serving: model 'edited': "
                                 "main.py imports 'nereid_no_such_module', which fails to import "
                                 "(ModuleNotFoundError: No module named 'nereid_no_such_module'); every run would "
                                 "stop there")
    assert ask(server, "edited") == "v1"
    (folder / "main.py").write_text(reply_main('"v3"'))
    assert wait_until(lambda: index()["edited"] == ("READY", ""))
    assert ask(server, "edited") == "v3"


def test_an_import_after_main_py_changes_sys_path_or_the_environment_is_left_to_each_run(repo, serve, user_site,
                                                                                          caplog):
    """Defect (h7 #1): an import after another statement was preloaded anyway, before any of main.py had run: a
    `sys.path.insert` of a vendored copy then got the installed copy, and an environment variable set for a library
    that reads it as it is imported (JAX_ENABLE_X64, OMP_NUM_THREADS) was not set yet; warm runs computed other
    numbers than cold runs and `python main.py`, silently. Such an import is left to each run, and logged once."""
    (user_site / "vendored_helper.py").write_text("ANSWER = 'installed'\n")
    (user_site / "reads_env.py").write_text("import os\nMODE = os.environ.get('NEREID_TEST_MODE', 'unset')\n")
    folder = repo.python("vendoring", textproto=REPORT, main=reply_main(
        "[vendored_helper.ANSWER, reads_env.MODE]",
        prelude="sys.path.insert(0, 'vendor')\nos.environ['NEREID_TEST_MODE'] = 'set by main.py'\n"
                "import vendored_helper\nimport reads_env"))
    (folder / "vendor").mkdir()
    (folder / "vendor" / "vendored_helper.py").write_text("ANSWER = 'from vendor'\n")
    with caplog.at_level("INFO", logger="nereid.backends.python.warm"):
        server = serve(repo.write_config())
        assert ask(server, "vendoring") == ["from vendor", "set by main.py"]
        assert ask(server, "vendoring") == ["from vendor", "set by main.py"]  # (and so in every run)
    # (nereid check says so too: it said warm_start=on alone, as if all of main.py's imports were preloaded.)
    assert backend_of(server, "vendoring").runtime_report().summary == (
        "warm_start=on (not preloaded: vendored_helper, reads_env)")
    assert [r.message for r in caplog.records if "not preloaded" in r.message] == [
        "model 'vendoring': main.py's imports 'vendored_helper', 'reads_env' are not preloaded, each run imports "
        "them: they come after line 3 of main.py, which may change what they find (an environment variable, a "
        "sys.path entry); name them in runtime.preload to preload them anyway"]


def test_only_imports_docstrings_and_plain_constants_before_an_import_let_it_be_preloaded(tmp_path):
    """Defect (h7 #1), the rule itself: what may come before an import that is preloaded."""
    source = (b'"""A model."""\nfrom __future__ import annotations\n__version__ = "1.0"\nSIZES: tuple = (1, -2)\n'
              b"pass\nimport json\nLIMIT = len('abc')\nimport csv\nfrom xml import dom\nimport zlib\n")
    (tmp_path / "main.py").write_bytes(source)
    # A call (len) ends the leading imports; runtime.preload still names what it wants preloaded.
    assert modules_to_preload(tmp_path, "main.py", ("zlib",), source) == Preloads(
        imports=("json",), extra=("zlib",), left=("csv", "xml"),
        left_because="they come after line 7 of main.py, which may change what they find (an environment variable, "
                     "a sys.path entry)")
    for before in ["__builtins__ = {}\n", "import os\nos.environ['A'] = '1'\n", "x = f()\n", "x: f() = 1\n",
                   "a.b = 1\n", "if True:\n    pass\n", "from . import sibling\n"]:
        source = f"{before}import json\n".encode()
        assert modules_to_preload(tmp_path, "main.py", (), source).left == ("json",), before
    # An import of the folder's own module runs its code first: what comes after it is left to each run too.
    (tmp_path / "helper.py").write_text("")
    source = b"import json\nimport helper\nimport csv\n"
    assert modules_to_preload(tmp_path, "main.py", (), source) == Preloads(
        imports=("json",), left=("csv",),
        left_because="they come after main.py imports its own 'helper', which may change what they find")


def test_a_preloaded_module_is_imported_as_python_main_py_would_import_it(repo, serve, user_site):
    """Defect (h7 #2): the warm parent preloaded without the model folder on sys.path, with its own sys.argv and
    __main__: an installed package that reads its app's settings module from the script's folder, or the program's
    name, as it is imported got the parent's, in every warm run; and a run's sys.orig_argv was the parent's
    command line, with the server's scratch paths in it."""
    (user_site / "reads_its_app.py").write_text(
        "import sys\ntry:\n    import user_settings\n    SCALE = user_settings.SCALE\nexcept ImportError:\n"
        "    SCALE = None\nPROG = sys.argv\nMAIN = getattr(sys.modules['__main__'], '__file__', None)\n"
        "MAIN_MODULE = sys.modules['__main__']\n")
    folder = repo.python("app", textproto=REPORT, main="import reads_its_app\n" + reply_main(
        '{"scale": reads_its_app.SCALE, "prog": reads_its_app.PROG, "main": reads_its_app.MAIN, '
        '"same_main": reads_its_app.MAIN_MODULE is sys.modules["__main__"], "orig_argv": sys.orig_argv[1:], '
        '"path0": sys.path[0], "preloaded": "reads_its_app" in before}',
        prelude="before = sys.modules"))
    (folder / "user_settings.py").write_text("SCALE = 7.0\n")
    server = serve(repo.write_config())
    assert backend_of(server, "app").runtime_report().summary == "warm_start=on"
    for _ in range(2):
        assert ask(server, "app") == {"scale": 7.0, "prog": ["main.py"], "main": str(folder / "main.py"),
                                      "same_main": True, "orig_argv": ["main.py"], "path0": str(folder),
                                      "preloaded": True}


def test_a_data_folder_named_like_an_installed_package_does_not_stop_its_preload(tmp_path):
    """Defect (h7 #4): a checkpoint folder `jax/` (no __init__.py) in the model folder was taken for the model's own
    package, so `import jax` was not preloaded (673 ms a run against 219 ms), and every import after it was left to
    each run. Python imports the installed package there: a namespace portion loses to a module or regular package
    found anywhere on sys.path."""
    (tmp_path / "json").mkdir()  # (a standard-library package, found on sys.path as any installed one)
    (tmp_path / "json" / "params.msgpack").write_bytes(b"\x80")
    (tmp_path / "zlib").mkdir()  # (built into the interpreter)
    (tmp_path / "checkpoints").mkdir()  # provided by nothing else: a namespace package of the folder's own
    source = b"import json\nimport zlib\nimport checkpoints\nimport csv\n"
    (tmp_path / "main.py").write_bytes(source)
    assert lives_in_folder("json", tmp_path) is False and lives_in_folder("json.decoder", tmp_path) is False
    assert lives_in_folder("zlib", tmp_path) is False
    assert lives_in_folder("checkpoints", tmp_path) is True
    preloads = modules_to_preload(tmp_path, "main.py", (), source)
    assert preloads.imports == ("json", "zlib") and preloads.left == ("csv",)
    (tmp_path / "json" / "__init__.py").write_text("")  # a regular package: first on sys.path, it wins
    assert lives_in_folder("json", tmp_path) is True


def test_a_package_on_the_servers_own_path_does_not_make_a_models_namespace_folder_pass_for_installed(
        tmp_path, monkeypatch):
    """Found by the session's review: a server started (python -m) in a folder holding a package `mhelp`, or with
    it on PYTHONPATH, took the model's own `mhelp/` (no __init__.py) for that package: it was preloaded, and an
    edit of the model's helper never served. Runs have neither the server's working directory nor PYTHONPATH."""
    import sys

    model = tmp_path / "model"
    (model / "mhelp").mkdir(parents=True)
    (model / "mhelp" / "calc.py").write_text("VALUE = 1\n")
    for where in ("cwd", "pythonpath"):
        elsewhere = tmp_path / where
        (elsewhere / "mhelp").mkdir(parents=True)
        (elsewhere / "mhelp" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path / "cwd")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "pythonpath"))
    for entry in (str(tmp_path / "cwd"), str(tmp_path / "pythonpath")):
        monkeypatch.setattr(sys, "path", [entry, *sys.path])
        assert lives_in_folder("mhelp.calc", model) is True, entry


def test_a_symlinked_model_folder_is_named_by_its_physical_path_as_python_main_py_names_it(repo, serve, tmp_path):
    """Defect (h7 #5): with `ml-backends/linked -> releases/r1` (a `current -> release-N` deploy) warm runs saw
    __file__ and sys.path[0] under the link path, cold runs and `python main.py` under the physical path: code that
    compares os.path.dirname(__file__) with os.getcwd() behaved differently in the two modes."""
    folder = repo.python("r1", textproto=REPORT, main=reply_main(
        '{"file": __file__, "path0": sys.path[0], "cwd": os.getcwd()}'))
    release = tmp_path / "releases" / "r1"
    release.parent.mkdir()
    folder.rename(release)
    (repo.models_dir / "linked").symlink_to(release, target_is_directory=True)
    server = serve(repo.write_config(server_extra="  follow_symlinks: true\n"))
    assert backend_of(server, "linked").runtime_report().summary == "warm_start=on"
    real = str(release.resolve())
    assert ask(server, "linked") == {"file": os.path.join(real, "main.py"), "path0": real, "cwd": real}


def test_a_preload_that_initialises_cuda_runs_cold_and_one_that_only_loads_it_stays_warm(repo, serve, user_site,
                                                                                         fake_libcuda, caplog):
    """Defect: a preloaded module that initialised CUDA at import (torch.cuda.init(), a tensor moved to the GPU)
    kept warm start on, and every forked child that then used CUDA failed. Loading the driver without cuInit (as
    importing torch does) must not turn warm start off."""
    (user_site / "loads_cuda.py").write_text(f"import ctypes\ndriver = ctypes.CDLL({str(fake_libcuda)!r})\n")
    (user_site / "inits_cuda.py").write_text("from loads_cuda import driver\nassert driver.cuInit(0) == 0\n")
    repo.python("gpu_at_import", textproto=REPORT, main=reply_main('"served"'))
    repo.python("gpu_loaded", textproto=REPORT, main=reply_main('"served"'))
    server = serve(repo.write_config("- name: gpu_at_import\n  runtime: {preload: [inits_cuda]}\n"
                                     "- name: gpu_loaded\n  runtime: {preload: [loads_cuda]}\n"))
    reason = ("preloading 'inits_cuda' initialised CUDA, which a forked child cannot use; initialise CUDA in the "
              "code that runs per batch (main.py's body or a function it calls), not at import")
    assert backend_of(server, "gpu_at_import").runtime_report().summary == f"warm_start=off ({reason})"
    assert [r for r in caplog.records if "'gpu_at_import': warm start is off" in r.message and reason in r.message]
    assert ask(server, "gpu_at_import") == "served"  # cold
    assert backend_of(server, "gpu_loaded").runtime_report().summary == "warm_start=on"
    assert ask(server, "gpu_loaded") == "served"


# Runs an empty GNU OpenMP parallel region on 2 threads (libc's free(NULL) in each), as a torch forward pass or a
# scikit-learn predict does on a batch large enough: the first one starts libgomp's thread pool.
OPENMP_REGION = ("import ctypes\nctypes.CDLL('libgomp.so.1').GOMP_parallel(ctypes.cast(ctypes.CDLL(None).free, "
                 "ctypes.c_void_p), None, 2, 0)\n")


def test_a_preload_that_started_an_openmp_pool_runs_cold_and_one_that_only_loads_libgomp_stays_warm(
        repo, serve, user_site, caplog):
    """Defect (found by a bug hunt of library models): a project module whose warm-up ran at import (a torch
    forward pass, a scikit-learn HistGradientBoosting predict) started libgomp's thread pool in the warm parent,
    which has no fork handler: every forked run that entered a parallel region hung until timeout_s, while nereid
    check said warm_start=on and nothing was logged."""
    (user_site / "starts_openmp.py").write_text(OPENMP_REGION)
    (user_site / "loads_openmp.py").write_text("import ctypes\nctypes.CDLL('libgomp.so.1')\n")
    repo.python("openmp_at_import", textproto=REPORT, main=reply_main('"served"', prelude=OPENMP_REGION))
    repo.python("openmp_loaded", textproto=REPORT, main=reply_main('"served"', prelude=OPENMP_REGION))
    # (timeout_s: a run that hangs fails the test instead of holding it.)
    server = serve(repo.write_config(
        "- name: openmp_at_import\n  timeout_s: 10\n  runtime: {preload: [starts_openmp]}\n"
        "- name: openmp_loaded\n  timeout_s: 10\n  runtime: {preload: [loads_openmp]}\n"))
    assert [ask(server, "openmp_at_import") for _ in range(2)] == ["served"] * 2  # (cold; warm, each hung)
    summary = backend_of(server, "openmp_at_import").runtime_report().summary
    assert re.fullmatch(r"warm_start=off \(preloading started an OpenMP thread pool \(/\S*libgomp[^)]*\), which a "
                        r"forked run cannot use .*, not at import\)", summary), summary
    assert [r for r in caplog.records if "'openmp_at_import': warm start is off" in r.message
            and "OpenMP thread pool" in r.message]
    assert backend_of(server, "openmp_loaded").runtime_report().summary == "warm_start=on"
    assert [ask(server, "openmp_loaded") for _ in range(2)] == ["served"] * 2


def test_a_preload_that_ran_a_jax_operation_runs_cold_and_one_that_only_imports_jax_stays_warm(repo, serve,
                                                                                              user_site, caplog):
    """Defect (found by a bug hunt of library models): a project module that ran a jax operation at import (a
    warm-up jit call) initialised XLA's backend in the warm parent, whose thread pools a fork does not copy: every
    forked run that compiled a new shape hung until timeout_s, while nereid check said warm_start=on."""
    (user_site / "runs_jax.py").write_text("import jax.numpy as jnp\nWARMED = float(jnp.ones(3).sum())\n")
    jax_run = "import jax.numpy as jnp\nsummed = float(jnp.arange(4.0).sum())"
    repo.python("jax_at_import", textproto=REPORT, main=reply_main("summed", prelude=jax_run))
    repo.python("jax_imported", textproto=REPORT, main=reply_main("summed", prelude=jax_run))
    server = serve(repo.write_config("- name: jax_at_import\n  timeout_s: 60\n  runtime: {preload: [runs_jax]}\n"
                                     "- name: jax_imported\n  timeout_s: 60\n  runtime: {preload: [jax]}\n"))
    reason = ("preloading 'runs_jax' initialised JAX's backend (cpu), whose thread pools a forked run cannot use (its "
              "next compile or parallel operation hangs); run JAX operations (jit calls, arrays) in the code that "
              "runs per batch (main.py's body or a function it calls), not at import (importing jax is fine)")
    assert backend_of(server, "jax_at_import").runtime_report().summary == f"warm_start=off ({reason})"
    assert [r for r in caplog.records if "'jax_at_import': warm start is off" in r.message and reason in r.message]
    assert ask(server, "jax_at_import") == 6.0  # cold
    assert backend_of(server, "jax_imported").runtime_report().summary == "warm_start=on"
    assert ask(server, "jax_imported") == 6.0


def test_check_reports_warm_start(repo, user_site, capsys):
    repo.python("warm", textproto=REPORT, main=reply_main("1"))
    repo.python("cold", textproto=REPORT, main=reply_main("1"))
    repo.python("unsafe", textproto=REPORT, main=reply_main("1"))
    # Imports `this`, which prints the Zen of Python: warm start was off, "the warm parent did not start (The Zen
    # of Python, by Tim Peters)".
    repo.python("banner", textproto=REPORT, main=reply_main("1", prelude="import this"))
    config = repo.write_config("- name: warm\n- name: cold\n  runtime: {warm_start: false}\n"
                               "- name: unsafe\n  runtime: {preload: [starts_a_thread]}\n- name: banner\n")
    assert cli_main(["check", "--config", str(config)]) == 0
    lines = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert " warm_start=on warm_parent_rss=" in lines["warm"] and " warm_start=on warm_parent_rss=" in lines["banner"]
    assert lines["cold"].endswith(" warm_start=off (runtime.warm_start is false)")
    assert " warm_start=off (preloading 'starts_a_thread' started threads (busy)" in lines["unsafe"]


def test_bad_runtime_options_make_the_model_unavailable(repo, serve):
    repo.python("typo", textproto=REPORT, main=reply_main("1"))
    repo.python("notbool", textproto=REPORT, main=reply_main("1"))
    server = serve(repo.write_config("- name: typo\n  runtime: {warmstart: false}\n"
                                     "- name: notbool\n  runtime: {warm_start: 'no', preload: [1]}\n"))
    index = {m.name: m.reason for m in server.client.get_model_repository_index().models}
    assert ("runtime.warmstart: unknown option of the python backend (allowed: preload, warm_start; did you mean "
            "'warm_start'?)") in index["typo"]
    assert "runtime.warm_start: must be true or false, got 'no'" in index["notbool"]


# -- a warm parent that dies, unload, memory ---------------------------------------

def test_dead_warm_parent_fails_the_running_request_and_is_restarted(repo, serve, no_zombies):
    folder = repo.python("fragile", textproto=REPORT, main=reply_main("os.getppid()", prelude=SLOW_IF_ASKED))
    server = serve(repo.write_config())
    warm = backend_of(server, "fragile")._parent
    # Killed while idle: the next request is served by a new parent.
    parent = warm.pid
    assert ask(server, "fragile") == parent
    os.kill(parent, signal.SIGKILL)
    assert wait_until(lambda: not process_alive(parent))
    parent = ask(server, "fragile")
    assert parent == warm.pid and process_alive(parent)
    # Killed while a request runs in it: that request fails INTERNAL with the reason, the next succeeds.
    (folder / "slow").write_text("")
    errors = []
    thread = threading.Thread(target=lambda: errors.append(_error_of(lambda: ask(server, "fragile"))))
    thread.start()
    child = running_child(folder)
    assert child in _children_of(parent)
    os.kill(parent, signal.SIGKILL)
    thread.join(20)
    assert errors and errors[0] is not None and errors[0].status() == "StatusCode.INTERNAL"
    assert "model 'fragile': its warm parent process was killed by signal SIGKILL" in errors[0].message()
    assert server.server.repository.ready_model("fragile").stats.snapshot().failures_by_reason == {"killed": 1}
    assert wait_until(lambda: not process_alive(child))  # the running child died with its parent
    (folder / "slow").unlink()
    assert ask(server, "fragile") == warm.pid != parent


def test_a_parent_restarted_for_a_run_does_not_spend_the_run_s_timeout(repo, serve, no_zombies, monkeypatch):
    """Found by the warm-start hunt: the run's timeout_s started before its dead parent was restarted, so a model
    whose preloads take longer than its timeout_s failed the first request after any parent's death ("timed out
    after 0.5 s", its run killed at once). A restart as slow as such preloads: 0.8 s before the run is handed on."""
    from nereid.backends.python import warm

    repo.python("heavy", textproto=REPORT, main=reply_main("os.getppid()"))
    server = serve(repo.write_config("- name: heavy\n  timeout_s: 0.5\n"))
    parent = ask(server, "heavy")
    handed_on = warm.WarmParent._start_run

    def after_a_slow_restart(self, *args):
        time.sleep(0.8)
        return handed_on(self, *args)

    monkeypatch.setattr(warm.WarmParent, "_start_run", after_a_slow_restart)
    os.kill(parent, signal.SIGKILL)
    assert wait_until(lambda: not process_alive(parent))
    assert ask(server, "heavy") == backend_of(server, "heavy")._parent.pid != parent


def test_unload_ends_the_parent_and_its_children_and_removes_its_folder(repo, serve, no_zombies):
    folder = repo.python("longrun", textproto=REPORT, main=reply_main("1", prelude=SLOW_IF_ASKED))
    (folder / "slow").write_text("")
    server = serve(repo.write_config("- name: longrun\n  timeout_s: null\n", server_extra="  shutdown_grace_s: 1\n"))
    warm = backend_of(server, "longrun")._parent
    parent, parent_dir = warm.pid, warm.log_path.parent
    assert parent_dir.is_dir()
    caller = threading.Thread(target=lambda: _error_of(lambda: ask(server, "longrun")))
    caller.start()
    child = running_child(folder)
    # The next child, forked ahead and waiting for a run: the parent forks it after starting this run's,
    # so on a busy machine it may come a moment later.
    assert wait_until(lambda: len([pid for pid in _children_of(parent) if pid != child]) == 1)
    spare = [pid for pid in _children_of(parent) if pid != child]
    server.client.unload_model("longrun")
    caller.join(30)
    assert not caller.is_alive()
    assert wait_until(lambda: not process_alive(parent) and not process_alive(child) and not process_alive(spare[0]))
    assert not parent_dir.exists()
    assert zombie_children() == []


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_run_still_going_past_the_grace_of_an_unload_is_stopped_and_answered_unavailable(repo, serve, warm):
    # It was answered INTERNAL "model 'slowdel' was killed by signal SIGKILL", which reads like a crash.
    repo.python_warm_start = warm
    folder = repo.python("slowdel", textproto=REPORT, main=reply_main("1", prelude=SLOW_IF_ASKED))
    (folder / "slow").write_text("")
    server = serve(repo.write_config("- name: slowdel\n  timeout_s: null\n", server_extra="  shutdown_grace_s: 0.2\n"))
    errors = []
    caller = threading.Thread(target=lambda: errors.append(_error_of(lambda: ask(server, "slowdel"))))
    caller.start()
    running_child(folder)
    server.client.unload_model("slowdel")
    caller.join(30)
    assert not caller.is_alive() and errors[0] is not None
    assert errors[0].status() == "StatusCode.UNAVAILABLE"
    assert errors[0].message() == ("model 'slowdel' was being unloaded (removed, replaced by a new version, or the "
                                   "server stopping) and this run was still going after shutdown_grace_s "
                                   "(nereid.yaml): the run was stopped")


def test_a_run_of_a_version_a_reload_replaced_goes_on_past_the_grace_within_its_timeout(repo, serve):
    """Found by the nereid.yaml hunt: an edit of a model's entry (instances, say) ended its runs still going
    after shutdown_grace_s, though its timeout_s allowed them longer and nothing waited on the old version."""
    prelude = ("import time\nif os.path.exists('slow'):\n"
               "    open('running.pid', 'w').write(str(os.getpid()))\n    time.sleep(1.5)")
    folder = repo.python("steady", textproto=REPORT, main=reply_main("1", prelude=prelude))
    (folder / "slow").write_text("")
    server = serve(repo.write_config("- name: steady\n  timeout_s: 20\n", server_extra="  shutdown_grace_s: 0.2\n"))
    answers, errors = [], []
    caller = threading.Thread(target=lambda: errors.append(_error_of(lambda: answers.append(ask(server, "steady")))))
    caller.start()
    running_child(folder)
    server.client.load_model("steady")  # a reload without downtime: the old version drains
    caller.join(30)
    assert not caller.is_alive() and errors == [None] and answers == [1]


def test_warm_parent_memory_and_warm_start_are_metrics(repo, serve):
    """The warm parent's memory, and whether runs start warm (a model gone cold said so only in its log)."""
    repo.python("measured", textproto=REPORT, main=reply_main("1"))
    repo.python("cold", textproto=REPORT, main=reply_main("1"))
    server = serve(repo.write_config("- name: measured\n- name: cold\n  runtime: {warm_start: false}\n"))
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10).read()
    lines = [line for line in text.decode().splitlines() if line.startswith("nereid_warm_")]
    resident = [line for line in lines if line.startswith('nereid_warm_parent_resident_bytes{model="measured"}')]
    assert len(resident) == 1 and float(resident[0].split()[-1]) > 1 << 20
    assert not [line for line in lines if line.startswith('nereid_warm_parent_resident_bytes{model="cold"}')]
    assert sorted(line for line in lines if line.startswith("nereid_warm_start{")) == [
        'nereid_warm_start{model="cold"} 0.0', 'nereid_warm_start{model="measured"} 1.0']


def running_child(folder: Path) -> int:
    """The pid of the model process now sleeping in SLOW_IF_ASKED."""
    assert wait_until(lambda: (folder / "running.pid").exists() and (folder / "running.pid").read_text())
    return int((folder / "running.pid").read_text())


def _error_of(call) -> InferenceServerException | None:
    try:
        call()
    except InferenceServerException as err:
        return err
    return None


def _children_of(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except (FileNotFoundError, ProcessLookupError):  # the process is gone
        return []


DETACHING_MAIN = reply_main("1", prelude='''import subprocess
daemon = subprocess.Popen(["sleep", "300"], start_new_session=True)  # leaves the run's process group
open("detached.pid", "w").write(str(daemon.pid))''')


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_process_the_model_detaches_ends_with_its_run(repo, serve, no_zombies, warm):
    repo.python_warm_start = warm  # a cold run execs a fresh interpreter, forked by the same parent
    folder = repo.python("detaching", textproto=REPORT, main=DETACHING_MAIN)
    server = serve(repo.write_config())
    assert ask(server, "detaching") == 1
    detached = int((folder / "detached.pid").read_text())
    assert wait_until(lambda: not process_alive(detached))


# A run that creates a shared memory segment (named PREFIX + its pid) and never unlinks it; it fails after that
# when the folder holds a file "fail" (its stderr tail is then the answer).
LEAKING_SHM_MAIN = reply_main("segment.name", prelude='''from multiprocessing import shared_memory
segment = shared_memory.SharedMemory(name=f"{PREFIX}{os.getpid()}", create=True, size=4096)
if os.path.exists("fail"):
    sys.exit("failed after leaking " + segment.name)''')


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm to look into")
@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_shared_memory_segment_a_run_leaks_is_unlinked_when_it_ends(repo, serve, warm):
    """Defect: multiprocessing's resource tracker, which unlinks a leaked SharedMemory at `python main.py`'s exit
    (with a UserWarning), was SIGKILLed with the run's process group before it could: every run left its segment
    in /dev/shm (RAM) for good."""
    repo.python_warm_start = warm
    prefix = f"nereid_test_{uuid.uuid4().hex[:12]}_"
    folder = repo.python("leaky", textproto=REPORT, main=f"PREFIX = {prefix!r}\n" + LEAKING_SHM_MAIN)
    try:
        server = serve(repo.write_config())
        assert ask(server, "leaky").startswith(prefix)
        assert list(Path("/dev/shm").glob(f"{prefix}*")) == []
        (folder / "fail").write_text("")
        error = _error_of(lambda: ask(server, "leaky"))
        assert error is not None and "failed after leaking" in error.message(), error
        # The tracker's warning is part of the run's stderr, as under python main.py.
        assert "There appear to be 1 leaked shared_memory objects to clean up at shutdown" in error.message()
        assert list(Path("/dev/shm").glob(f"{prefix}*")) == []
    finally:
        for leaked in Path("/dev/shm").glob(f"{prefix}*"):
            leaked.unlink(missing_ok=True)


CHAIN_MAIN = reply_main("1", prelude='''import os, time
def link(depth):  # each link: a session of its own, one child, then a long sleep
    os.setsid()
    with open(f"chain.{os.getpid()}.pid", "w"):
        pass
    if depth < 23 and os.fork() == 0:
        link(depth + 1)
    os.closerange(0, 3)
    time.sleep(300)
    os._exit(0)
if os.fork() == 0:
    link(0)
while len([name for name in os.listdir(".") if name.startswith("chain.")]) < 24:
    time.sleep(0.01)''')


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_main_py_s_module_globals_are_those_python_main_py_gives(repo, serve, warm):
    """Defect: warm, reading __annotations__ (typing.get_type_hints on __main__) raised NameError, and __cached__
    and __loader__ differed from python main.py's."""
    repo.python_warm_start = warm
    repo.python("dunders", textproto=REPORT, main=reply_main(
        "[sorted(k for k in globals() if k.startswith('__')), __annotations__, __cached__, type(__loader__).__name__]"))
    server = serve(repo.write_config())
    assert ask(server, "dunders") == [["__annotations__", "__builtins__", "__cached__", "__doc__", "__file__",
                                       "__loader__", "__name__", "__package__", "__spec__"], {}, None,
                                      "SourceFileLoader"]

    # Defect: warm, main.py was compiled under warm_parent.py's own `from __future__ import annotations`:
    # annotations became strings, and one naming a local (functools.singledispatch) raised NameError.
    repo.python("annotated", textproto=REPORT, main=reply_main(
        "[repr(__annotations__), typed(1), typed('a')]",
        prelude="import functools\nx: int = 1\n@functools.singledispatch\ndef typed(v):\n    return 'other'\n"
                "class Local:\n    pass\n@typed.register\ndef _(v: int):\n    return 'int'\n"
                "@typed.register\ndef _(v: Local):\n    return 'local'\n"))
    server.client.load_model("annotated")
    assert ask(server, "annotated") == ["{'x': <class 'int'>}", "int", "other"]


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_a_chain_of_detached_processes_ends_with_its_run(repo, serve, no_zombies, warm):
    """Defect: each sweep round killed one generation of a chain of sessions (each orphaned in turn), for 16
    rounds: the rest lived on after their run, and past unload and shutdown under init."""
    repo.python_warm_start = warm
    folder = repo.python("chained", textproto=REPORT, main=CHAIN_MAIN)
    server = serve(repo.write_config())
    assert ask(server, "chained") == 1
    chain = [int(path.name.split(".")[1]) for path in folder.glob("chain.*.pid")]
    assert len(chain) == 24
    assert wait_until(lambda: not any(process_alive(pid) for pid in chain))


@pytest.mark.parametrize("warm", [True, False], ids=["warm", "cold"])
def test_killing_the_server_ends_the_running_model_process(repo, warm):
    """SIGKILL leaves no cleanup to the server: the parent sees its lifeline close and ends its runs."""
    repo.python_warm_start = warm
    folder = repo.python("orphaned", textproto=REPORT, main=reply_main("1", prelude=SLOW_IF_ASKED))
    (folder / "slow").write_text("")
    with nereid_serve(repo.write_config(metrics_addr="")) as (process, client):
        tensor = triton.InferInput("input", [1, 1], "BYTES")
        tensor.set_data_from_numpy(np.array([[b"x"]], dtype=object))
        client.async_infer("orphaned", [tensor], callback=lambda result, error: None)
        child = running_child(folder)
        process.kill()
        process.wait()
    assert wait_until(lambda: not process_alive(child))


# -- out of descriptors --------------------------------------------------------

# A warm parent started, then the open-file limit lowered to 64: for each number of descriptors left free (all
# others held open), one run; prints [free, returncode or the error, descriptors left open beyond those at
# rest] each, then the returncode of a run once the descriptors are free again.
RUNS_OUT_OF_DESCRIPTORS = r'''
import json, os, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from starved_descriptors import runs_short_of_descriptors
from nereid.backends.python.preload import Preloads
from nereid.backends.python.warm import WarmParent
from nereid.backends.subprocess.runner import ProcessGroups

folder = Path(sys.argv[1])
parent = WarmParent(name="m", folder=folder, env={"PATH": os.environ.get("PATH", "")}, modules=Preloads(),
                    log_path=folder / "parent.log", entry_source=folder / "main.py",
                    entry_bytes=(folder / "main.py").read_bytes())
parent.start()
run = lambda: parent.run(env={}, stdin=b"x", timeout_s=30, groups=ProcessGroups()).returncode
print(json.dumps([runs_short_of_descriptors(run, 7), run()]))
parent.stop()
'''


def test_a_run_out_of_descriptors_closes_those_it_had_opened_and_the_next_one_runs(tmp_path):
    """Defect: two pipes and a socket pair were opened before anything closed them on failure, so a run that got
    EMFILE at the second pipe or the socket pair leaked 2 or 4 descriptors, and a server at its limit never
    recovered."""
    (tmp_path / "main.py").write_text("import sys\nsys.stdin.buffer.read()\n")
    result = subprocess.run([sys.executable, "-c", RUNS_OUT_OF_DESCRIPTORS, str(tmp_path),
                             str(Path(__file__).parents[2])], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    outcomes, afterwards = json.loads(result.stdout)
    assert [leaked for _, _, leaked in outcomes] == [0] * len(outcomes), f"descriptors left open: {outcomes}"
    # Out of descriptors at the first pipe, at the second, at the socket pair; then enough for a whole run.
    failed = {free: outcome for free, outcome, _ in outcomes if outcome != 0}
    assert set(failed.values()) == {"EMFILE"} and {0, 2, 4} <= failed.keys(), outcomes
    assert outcomes[-1][1] == 0 and afterwards == 0, outcomes


EXTENSION_C = r'''
#include <Python.h>
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "fastops", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_fastops(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ANSWER", 42) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
'''


def test_a_compiled_extension_module_in_the_folder_is_the_model_s_own(repo, serve, tmp_path):
    """Found by a bug hunt: a Cython or pybind11 module shipped beside main.py (fastops.<abi>.so) was taken for
    an installed module, preloaded where the folder is not on sys.path, and the load failed ("fails to import"),
    though `python main.py` runs."""
    import shutil
    import subprocess
    import sysconfig

    compiler = shutil.which("cc") or shutil.which("c++")
    include = sysconfig.get_paths()["include"]
    if compiler is None or not Path(include, "Python.h").is_file():
        pytest.skip("no C compiler or no Python headers to build an extension with")
    folder = repo.python("ext", textproto=REPORT, main=reply_main("fastops.ANSWER", prelude="import fastops"))
    (tmp_path / "fastops.c").write_text(EXTENSION_C)
    subprocess.run([compiler, "-shared", "-fPIC", "-x", "c", f"-I{include}", str(tmp_path / "fastops.c"), "-o",
                    str(folder / f"fastops{sysconfig.get_config_var('EXT_SUFFIX')}")], check=True)
    server = serve(repo.write_config())
    assert backend_of(server, "ext").runtime_report().summary == "warm_start=on"
    assert ask(server, "ext") == 42


def test_a_preload_that_ignores_sigchld_leaves_the_runs_working_and_main_py_seeing_it(repo, serve, user_site):
    """Found by a bug hunt: a preloaded import that set SIGCHLD to SIG_IGN had the kernel reap the warm parent's
    children before it waited on them: every run failed ("its warm parent process exited with code 1") while
    the model stayed READY. The run still sees SIG_IGN, as under `python main.py`."""
    (user_site / "ignores_sigchld.py").write_text("import signal\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)\n")
    repo.python("sigchld", textproto=REPORT,
                main=reply_main("signal.getsignal(signal.SIGCHLD) == signal.SIG_IGN",
                                prelude="import signal, ignores_sigchld"))
    server = serve(repo.write_config())
    assert backend_of(server, "sigchld").runtime_report().summary == "warm_start=on"
    assert [ask(server, "sigchld") for _ in range(3)] == [True, True, True]
