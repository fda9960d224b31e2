"""nereid.register_model: what a bundle's model.py registers, isolated per bundle and per load."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

import nereid
from nereid.errors import ConfigError
from nereid.model_hooks import identity, load_model_hooks
from nereid.tensors import NamedTensor

DOUBLING = '''
import nereid
from nereid.tensors import NamedTensor

def double(tensors):
    return [NamedTensor(t.name, t.dtype, t.data * 2) for t in tensors]

nereid.register_model(preprocess=double)
'''

NEGATING = '''
import nereid
from nereid.tensors import NamedTensor

def negate(tensors):
    return [NamedTensor(t.name, t.dtype, -t.data) for t in tensors]

nereid.register_model(postprocess=negate)
'''


def tensor() -> list[NamedTensor]:
    return [NamedTensor.from_array("x", np.array([1.0, 2.0], np.float32))]


def test_each_bundle_keeps_its_own_hooks(tmp_path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "model.py").write_text(DOUBLING)
    (tmp_path / "b" / "model.py").write_text(NEGATING)
    a = load_model_hooks(tmp_path / "a" / "model.py", "a")
    b = load_model_hooks(tmp_path / "b" / "model.py", "b")
    assert a.postprocess is identity and b.preprocess is identity
    assert a.preprocess(tensor())[0].data.tolist() == [2.0, 4.0]
    assert b.postprocess(tensor())[0].data.tolist() == [-1.0, -2.0]
    # Nothing outlives the load: no module left behind, and no registration possible outside one.
    import sys

    assert not [name for name in sys.modules if name.startswith("nereid_bundle_")]
    with pytest.raises(RuntimeError, match="call it from the bundle's model.py"):
        nereid.register_model(preprocess=identity)


def test_two_loads_of_one_model_py_at_once_each_run_in_their_own_module(tmp_path) -> None:
    """Found by the meta read hunt: two models served from one symlinked folder loaded at once under one module
    name; the first load's end removed the second's module from sys.modules as it ran, and its dataclass (which
    looks its module up there) failed the load: "AttributeError: 'NoneType' object has no attribute '__dict__'"."""
    import concurrent.futures
    import time

    (tmp_path / "model.py").write_text(
        "from __future__ import annotations\nimport dataclasses, time\nimport nereid\ntime.sleep(0.3)\n"
        "@dataclasses.dataclass\nclass Settings:\n    scale: int = 2\n"
        "nereid.register_model(preprocess=lambda inputs: inputs)\n")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(load_model_hooks, tmp_path / "model.py", "a")
        time.sleep(0.1)
        second = pool.submit(load_model_hooks, tmp_path / "model.py", "b")
        assert first.result(30).preprocess is not identity and second.result(30).preprocess is not identity
    import sys

    assert not [name for name in sys.modules if name.startswith("nereid_bundle_")]


def test_reloads_of_one_model_run_its_model_py_under_one_name(tmp_path) -> None:
    """The review hunt of 631678a: a module name per load left a logging.Logger (and a FileHandler's descriptor,
    for a model.py that adds one to its __name__ logger once) per reload."""
    import logging

    (tmp_path / "model.py").write_text("import logging\nimport nereid\nlog = logging.getLogger(__name__)\n"
                                       "nereid.register_model(preprocess=lambda inputs: inputs)\n")
    before = {name for name in logging.Logger.manager.loggerDict if name.startswith("nereid_bundle_")}
    for _ in range(3):
        load_model_hooks(tmp_path / "model.py", "a")
    made = {name for name in logging.Logger.manager.loggerDict if name.startswith("nereid_bundle_")} - before
    assert len(made) == 1, made


def test_model_py_runs_from_its_source_and_leaves_no_bytecode_in_its_folder(tmp_path, monkeypatch) -> None:
    """Defect: loading model.py wrote __pycache__ into the model folder (a bucket's mirror then no longer
    matched the bucket), and a cached copy would run in place of a same-size model.py replaced in its second."""
    import os
    import sys

    monkeypatch.setattr(sys, "dont_write_bytecode", False)  # as a server run without PYTHONDONTWRITEBYTECODE
    model_py = tmp_path / "model.py"
    model_py.write_text(DOUBLING)
    load_model_hooks(model_py, "m")
    assert sorted(os.listdir(tmp_path)) == ["model.py"]
    stat = model_py.stat()
    model_py.write_text(DOUBLING.replace("* 2", "* 3"))  # the same size, the same mtime
    os.utime(model_py, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert load_model_hooks(model_py, "m").preprocess(tensor())[0].data.tolist() == [3.0, 6.0]


def test_concurrent_loads_do_not_see_each_other(tmp_path) -> None:
    results: dict[int, object] = {}
    for i in range(8):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        (folder / "model.py").write_text(DOUBLING if i % 2 else NEGATING)

    def load(i: int) -> None:
        results[i] = load_model_hooks(tmp_path / f"m{i}" / "model.py", f"m{i}")

    threads = [threading.Thread(target=load, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, hooks in results.items():
        assert (hooks.preprocess is identity) == (i % 2 == 0) and (hooks.postprocess is identity) == (i % 2 == 1)


def test_mistakes_name_the_file(tmp_path) -> None:
    path = tmp_path / "model.py"
    path.write_text("import nereid\nnereid.register_model(preprocess=3)\n")
    with pytest.raises(ConfigError, match=r"model.py:2 failed: TypeError: register_model: preprocess must be"):
        load_model_hooks(path, "m")
    path.write_text("def broken(:\n")
    with pytest.raises(ConfigError, match=r"model.py:1 failed: SyntaxError"):
        load_model_hooks(path, "m")
    path.write_text("import nereid\n")
    with pytest.raises(ConfigError, match="did not call nereid.register_model"):
        load_model_hooks(path, "m")
    path.write_text("import sys\nsys.exit(0)\n")  # a SystemExit must not end the server (or nereid check)
    with pytest.raises(ConfigError, match=r"model.py:2 called sys.exit\(0\) while loading"):
        load_model_hooks(path, "m")
    # Found by a README check: its own KeyboardInterrupt was blamed on the backend, with no file or line.
    path.write_text("x = 1\nraise KeyboardInterrupt('mine')\n")
    with pytest.raises(ConfigError, match=r"model.py:2 failed: KeyboardInterrupt: mine"):
        load_model_hooks(path, "m")


def test_a_model_py_under_a_path_that_is_not_utf8_loads(tmp_path) -> None:
    """Found by the deployment hunt: a repository under a folder named in Latin-1 ('rep\\xe8o') failed every
    bundle with a model.py and every meta model: UnicodeEncodeError, surrogates not allowed."""
    folder = tmp_path / os.fsdecode(b"rep\xe8o")
    folder.mkdir()
    (folder / "model.py").write_text(DOUBLING)
    assert load_model_hooks(folder / "model.py", "m").preprocess(tensor())[0].data.tolist() == [2.0, 4.0]


def test_collections_after_retirements_take_at_most_a_tenth_of_the_loops_time() -> None:
    """Found by the scale hunt: reloading 300 models (a git pull touching every main.py), one collection each 0.2 s
    of 60 ms took 4 of the loop's 17 s; the next one now waits ten times the last one's duration."""
    from nereid.model_hooks import COLLECT_AFTER_RETIREMENT_S, collection_delay

    assert collection_delay(100.0, 0.0, 0.0) == COLLECT_AFTER_RETIREMENT_S  # none before: as soon as ever
    assert collection_delay(100.0, 99.9, 0.06) == pytest.approx(0.5)  # 60 ms, ended 0.1 s ago: 0.6 s after it
    assert collection_delay(100.0, 95.0, 0.06) == COLLECT_AFTER_RETIREMENT_S  # long ago: as soon as ever


def test_model_py_runs_beside_other_loads_and_only_first_imports_take_the_import_lock(tmp_path, monkeypatch,
                                                                                      caplog) -> None:
    """Found by the hunt of the last fixes: one lock held for whole model.py runs made 24 meta models whose
    model.py read a table for 2.5 s start in 50 s instead of 6, and said a model.py had run for over 30 s when a
    load had only waited behind many. Only a model.py's first imports of its leading modules take the lock now,
    given up after CODE_LOCK_WAIT_S (an import that never returns holds no later load for good)."""
    from nereid import model_hooks

    monkeypatch.setattr(model_hooks, "CODE_LOCK_WAIT_S", 0.2)
    site = tmp_path / "site"
    site.mkdir()
    (site / "nereid_test_fresh_module.py").write_text("VALUE = 3\n")
    monkeypatch.syspath_prepend(str(site))
    held, release = threading.Event(), threading.Event()

    def hung_import() -> None:  # (as an import reading a share that never answers holds it)
        with model_hooks.code_lock("hung"):
            held.set()
            release.wait(10)

    hung = threading.Thread(target=hung_import)
    hung.start()
    try:
        assert held.wait(5)
        (tmp_path / "a").mkdir()
        (tmp_path / "a" / "model.py").write_text(DOUBLING)  # (its imports are imported already: no wait)
        assert load_model_hooks(tmp_path / "a" / "model.py", "a").preprocess(tensor())[0].data.tolist() == [2.0, 4.0]
        assert "import lock" not in caplog.text  # (it did not wait for the lock: that says so after 0.2 s)
        (tmp_path / "b").mkdir()
        (tmp_path / "b" / "model.py").write_text("import nereid_test_fresh_module\n" + DOUBLING)
        assert load_model_hooks(tmp_path / "b" / "model.py", "b").preprocess(tensor())[0].data.tolist() == [2.0, 4.0]
    finally:
        release.set()
        hung.join(10)
    assert "model 'b': other loads' first imports of libraries have held the import lock for over 0.2 s; importing " \
           "this one's beside them" in caplog.text


def test_a_model_py_s_leading_imports_are_those_before_any_other_statement() -> None:
    from nereid.model_hooks import leading_imports

    source = b'''"""doc"""
from __future__ import annotations
import numpy as np, json
from jax import numpy as jnp
from . import sibling
import sys
sys.path.insert(0, "elsewhere")
import later
'''
    assert leading_imports(source) == ["numpy", "json", "jax", "sys"]
    assert leading_imports(b"def broken(:\n") == []
