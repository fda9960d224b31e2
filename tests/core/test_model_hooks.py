"""``nereid.register_model`` and the run of a ``model.py`` (``nereid.model_hooks``): what a meta model's registers,
mistakes in the call refused naming the file and line, first imports, and the collection after retirements.

(A bundle's hooks, isolated per bundle and per load, the import lock and the leading imports are tested in
tests/backends/xla/test_model_hooks.py.)
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest

from nereid import model_hooks
from nereid.errors import ConfigError
from nereid.model_hooks import identity, import_first, load_model_hooks

ORCHESTRATING = """
import nereid

async def orchestrate(inputs, ctx):
    return inputs

nereid.register_model(orchestrate=orchestrate)
"""


def model_py(folder: Path, source: str) -> Path:
    """``folder/model.py`` holding ``source``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.py"
    path.write_text(source)
    return path


def test_a_meta_model_registers_its_orchestration_and_a_bundle_may_not(tmp_path: Path) -> None:
    path = model_py(tmp_path / "pipeline", ORCHESTRATING)
    hooks = load_model_hooks(path, "pipeline", meta=True)
    assert hooks.orchestrate is not None and hooks.orchestrate.__name__ == "orchestrate"
    assert hooks.preprocess is identity and hooks.postprocess is identity
    with pytest.raises(ConfigError) as refused:
        load_model_hooks(path, "pipeline")
    assert str(refused.value) == (f"model 'pipeline': {path} registers orchestrate, which only a meta model has: add "
                                  "meta: true (and depends_on) to its manifest.yaml, or register preprocess / "
                                  "postprocess")


@pytest.mark.parametrize("call, problem", [
    ("nereid.register_model(orchestrate=3)", "TypeError: register_model: orchestrate must be a function fn(inputs, "
                                             "ctx) returning a list of NamedTensor, got 3"),
    ("nereid.register_model(orchestrate=print, preprocess=print)",
     "TypeError: register_model: orchestrate (a meta model) takes no preprocess or postprocess"),
    ("nereid.register_model(7, postprocess=print)", "TypeError: register_model: name must be a string, got 7"),
], ids=["orchestrate not callable", "orchestrate and a hook", "name not a string"])
def test_a_mistaken_registration_fails_the_load_naming_the_file_and_line(tmp_path: Path, call: str,
                                                                         problem: str) -> None:
    path = model_py(tmp_path / "m", f"import nereid\n\n{call}\n")
    with pytest.raises(ConfigError) as refused:
        load_model_hooks(path, "m", meta=True)
    assert str(refused.value).startswith(f"model 'm': {path}:3 failed: {problem}"), str(refused.value)


def test_a_model_py_that_registers_twice_is_refused(tmp_path: Path) -> None:
    path = model_py(tmp_path / "m", "import nereid\nnereid.register_model()\nnereid.register_model()\n")
    with pytest.raises(ConfigError) as refused:
        load_model_hooks(path, "m")
    assert str(refused.value) == f"model 'm': {path} called nereid.register_model 2 times (once per bundle)"


def test_a_name_registered_is_checked_and_dropped(tmp_path: Path) -> None:
    path = model_py(tmp_path / "m", "import nereid\nnereid.register_model('another name')\n")
    hooks = load_model_hooks(path, "m")
    assert (hooks.preprocess, hooks.postprocess, hooks.orchestrate) == (identity, identity, None)


def test_first_imports_import_what_is_not_imported_yet_and_leave_a_failure_to_its_importer(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    name = f"nereid_test_first_import_{id(tmp_path)}"
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    (tmp_path / f"{name}_broken.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        import_first("m", [name, f"{name}_broken", "json"])  # (the broken one is said by model.py's own import)
        assert sys.modules[name].VALUE == 1 and f"{name}_broken" not in sys.modules
        assert _taken_by_another_thread(model_hooks.CODE_LOCK)  # (let go)
    finally:
        sys.modules.pop(name, None)


def _taken_by_another_thread(lock) -> bool:
    """Whether a thread other than this one can take ``lock`` (it lets it go again)."""
    taken: list[bool] = []

    def take() -> None:
        taken.append(lock.acquire(timeout=10))
        if taken[0]:
            lock.release()
    thread = threading.Thread(target=take)
    thread.start()
    thread.join(30)
    return taken == [True]


def test_retirements_close_together_share_one_collection_which_then_runs(tmp_path: Path) -> None:
    load_model_hooks(model_py(tmp_path / "m", "import nereid\nnereid.register_model()\n"), "m")  # code has run

    async def retire_three() -> tuple[object, object]:
        model_hooks.collect_released_code_soon()
        first = model_hooks._collection
        model_hooks.collect_released_code_soon()
        model_hooks.collect_released_code_soon()
        scheduled = model_hooks._collection
        deadline = time.monotonic() + 30
        while model_hooks._collection is not None:  # until it has run
            assert time.monotonic() < deadline, "the collection never ran"
            await asyncio.sleep(0.05)
        return first, scheduled

    ended_before = model_hooks._last_collection[0]
    first, scheduled = asyncio.run(retire_three())
    assert first is not None and scheduled is first  # one for the burst
    assert model_hooks._last_collection[0] > ended_before  # it ran, and its end and duration are noted
