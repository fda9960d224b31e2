"""Dynamic mode: folders dropped, edited, renamed and deleted, and nereid.yaml edited, while serving."""

from __future__ import annotations

import json
import logging
import mmap
import os
import queue
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from nereid.storage.mirror import LOCK_SUFFIX
from support import made_deep, removed_deep, textproto_single

EXAMPLES = Path(__file__).resolve().parents[2] / "ml-backends"
SETTLE = "  watch: true\n  watch_settle_ms: 100\n"
REPORT = textproto_single("BYTES", input_shape="[1]", output_shape="[1]", max_batch_size=8)


def version_main(version: str) -> str:
    """A main.py that answers with ``version`` and its parent's pid (the warm parent)."""
    return f'''
import json, os, sys
sys.stdin.buffer.read()
answer = json.dumps({{"version": "{version}", "parent": os.getppid()}}).encode()
with open(os.environ["NEREID_OUTPUT_PATH"], "wb") as out:
    out.write(b"bytes 1,1\\n" + len(answer).to_bytes(4, "little") + answer)
'''


def ask(client, model: str) -> dict:
    tensor = triton.InferInput("input", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"x"]], dtype=object))
    return json.loads(client.infer(model, [tensor]).as_numpy("output")[0, 0])


def index(server) -> dict[str, tuple[str, str]]:
    return {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}


def wait_for(condition, timeout_s: float = 20):
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def generation(server, name: str) -> int:
    return server.server.repository.entry(name).generation


def write_model(folder: Path, version: str) -> None:
    folder.mkdir()
    (folder / "model_inference.textproto").write_text(REPORT)
    (folder / "main.py").write_text(version_main(version))


class Load:
    """Requests sent back to back from a thread; every failure is kept."""

    def __init__(self, url: str, model: str) -> None:
        self.client = triton.InferenceServerClient(url)
        self.model = model
        self.answers: list[dict] = []
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.answers.append(ask(self.client, self.model))
            except InferenceServerException as err:
                self.failures.append(err.message())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.client.close()


# -- a served repository ----------------------------------------------------------------

def test_dropped_folder_loads_and_a_half_copy_is_retried(repo, serve):
    server = serve(repo.write_config("- name: first\n", server_extra=SETTLE))
    write_model(repo.models_dir / "first", "1")
    wait_for(lambda: index(server).get("first", ("",))[0] == "READY")  # listed, so loaded at start
    # Half a copy: the textproto without main.py. Never READY; when the rest lands, it loads.
    half = repo.models_dir / "dropped"
    half.mkdir()
    (half / "model_inference.textproto").write_text(REPORT)
    wait_for(lambda: index(server).get("dropped", ("", ""))[1].startswith("no backend claims the folder"))
    assert index(server)["dropped"][0] == "UNAVAILABLE"
    # Found by a bug hunt: the broken folder took the serving server out of its load balancer (ServerReady
    # false) until it was fixed; a folder the watcher loads by itself counts once it has served.
    assert server.client.is_server_ready()
    (half / "main.py").write_text(version_main("dropped"))
    wait_for(lambda: index(server)["dropped"][0] == "READY")
    assert ask(server.client, "dropped")["version"] == "dropped"
    assert server.client.is_server_ready()


def test_a_folder_nested_too_deep_fails_its_own_load_and_the_others_load_and_are_watched(repo, serve):
    """Defect (the path-safety hunt): one folder of subfolders nested 1,500 deep failed every scan of the
    repository (Python 3.11's os.walk recursing once per level: RecursionError), so no model loaded at start and
    the watcher applied no change. It fails its own load, naming the depth."""
    from nereid.files import MAX_FOLDER_DEPTH

    write_model(repo.models_dir / "first", "1")
    deep = repo.models_dir / "deep"
    write_model(deep, "deep")
    nested = deep / "data"
    nested.mkdir()
    made_deep(nested, 1_500)
    try:
        server = serve(repo.write_config("- name: first\n- name: deep\n", server_extra=SETTLE))
        assert index(server)["first"][0] == "READY" and ask(server.client, "first")["version"] == "1"
        expected = f"nests folders more than {MAX_FOLDER_DEPTH} deep (data/a/a/a/"
        wait_for(lambda: expected in index(server).get("deep", ("", ""))[1])
        assert index(server)["deep"][0] == "UNAVAILABLE"
        write_model(repo.models_dir / "later", "later")
        wait_for(lambda: index(server).get("later", ("",))[0] == "READY")
        assert ask(server.client, "later")["version"] == "later"
    finally:
        removed_deep(nested, 1_500)  # (pytest's cleanup, Python 3.11's rmtree, recurses once per level too)


def test_a_new_folder_asked_for_before_it_settles_says_when_it_will_load(repo, serve):
    # A request (or an index) can see a folder before the watcher has acted on it: the reason says
    # it will load by itself, not that someone must load it.
    server = serve(repo.write_config(server_extra="  watch: true\n  watch_settle_ms: 60000\n"))
    write_model(repo.models_dir / "early", "1")
    expected = "new folder: it loads once it has been unchanged for server.watch_settle_ms (60000 ms)"
    assert index(server)["early"] == ("UNAVAILABLE", expected)  # the index lists the folder at once
    with pytest.raises(InferenceServerException) as raised:
        ask(server.client, "early")
    assert raised.value.status() == "StatusCode.UNAVAILABLE"
    assert expected in raised.value.message() and "RepositoryModelLoad" not in raised.value.message()


def test_edit_under_load_swaps_versions_without_a_failed_request(repo, serve):
    folder = repo.models_dir / "live"
    write_model(folder, "1")
    server = serve(repo.write_config(server_extra=SETTLE))
    first = ask(server.client, "live")
    load = Load(server.url, "live")
    try:
        wait_for(lambda: len(load.answers) > 5)
        (folder / "main.py").write_text(version_main("2"))
        wait_for(lambda: generation(server, "live") == 2)
        count = len(load.answers)
        wait_for(lambda: len(load.answers) > count + 5)
    finally:
        load.stop()
    assert load.failures == []
    second = load.answers[-1]
    assert second["version"] == "2"
    assert second["parent"] != first["parent"]  # a new warm parent for the new version...
    wait_for(lambda: not os.path.exists(f"/proc/{first['parent']}"))  # ...and the old one is gone


def held_model(repo, gate: Path) -> Path:
    """A model 'live' of version 1 whose runs wait until ``gate`` exists; its folder."""
    folder = repo.models_dir / "live"
    write_model(folder, "1")
    (folder / "main.py").write_text(version_main("1").replace(
        "sys.stdin.buffer.read()", f"import time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.01)\n"
                                   "sys.stdin.buffer.read()"))
    return folder


def one_running_three_queued(server) -> queue.Queue:
    """Send 'live' four requests: one running (held at its gate), three queued behind it; the queue of answers."""
    answers: queue.Queue = queue.Queue()
    tensor = triton.InferInput("input", [1, 1], "BYTES")
    tensor.set_data_from_numpy(np.array([[b"x"]], dtype=object))
    for _ in range(4):
        server.client.async_infer("live", [tensor], callback=lambda result, error: answers.put((result, error)))
    wait_for(lambda: server.server.repository.entry("live").loaded.scheduler.queue_depth == 3)
    return answers


ONE_AT_A_TIME = '- name: "live"\n  instances: 1\n  batching: {enabled: false}\n'


def test_a_reload_hands_the_queued_requests_to_the_new_version_and_the_old_finishes_its_running_one(repo, serve):
    """Found by the reload hunt: the replaced version ran its whole queue, one request after another, within its
    grace, while the new version stood idle; a queue of 100 one-second requests had 34 failed at the grace's end.
    The queued requests go to the new version at once; the running one finishes on the old."""
    gate = repo.root / "gate"
    folder = held_model(repo, gate)
    server = serve(repo.write_config(ONE_AT_A_TIME, server_extra=SETTLE))
    answers = one_running_three_queued(server)
    try:
        (folder / "main.py").write_text(version_main("2"))
        queued = [answers.get(timeout=30) for _ in range(3)]  # while the old version's run is still held
    finally:
        gate.write_text("")
    running = answers.get(timeout=30)
    assert [error for _, error in queued + [running]] == [None] * 4
    versions = [json.loads(result.as_numpy("output")[0, 0])["version"] for result, _ in queued + [running]]
    assert versions == ["2", "2", "2", "1"]
    stats = server.client.get_inference_statistics("live").model_stats[0].inference_stats
    assert (stats.success.count, stats.fail.count) == (4, 0)


@pytest.mark.parametrize("change", ["a smaller queue", "another input shape"])
def test_queued_requests_a_reload_could_fail_are_answered_all_the_same(repo, serve, change):
    """Found by the review of the hand-over: requests handed to a version of smaller queue_capacity were refused
    "queue is full", and to one of another input shape "has shape [1, 1], expected ..."; where the old version
    would have run them. A handed-over request waits for room; a new signature keeps the queue on the old version."""
    gate = repo.root / "gate"
    folder = held_model(repo, gate)
    config = repo.write_config(ONE_AT_A_TIME + "  queue_capacity: 8\n", server_extra=SETTLE)
    server = serve(config)
    answers = one_running_three_queued(server)
    try:
        if change == "a smaller queue":  # an edit of nereid.yaml reloads the model
            config.write_text(config.read_text().replace("queue_capacity: 8", "queue_capacity: 1"))
        else:
            (folder / "model_inference.textproto").write_text(REPORT.replace("[1]", "[2]"))
        wait_for(lambda: generation(server, "live") == 2)
    finally:
        gate.write_text("")
    got = [answers.get(timeout=30) for _ in range(4)]
    assert [error for _, error in got] == [None] * 4
    stats = server.client.get_inference_statistics("live").model_stats[0].inference_stats
    assert (stats.success.count, stats.fail.count) == (4, 0)


@pytest.mark.parametrize("how", ["hard link", "mmap"])
def test_an_edit_that_sends_no_file_event_is_found_at_the_next_poll(repo, serve, how):
    """Found by the reload hunt: a local tree was looked at only after a file event, so an edit that sends none (a
    write through mmap, or through a hard link from outside the tree, or by another machine on a network file
    system) was acted on only at some unrelated event, if ever. Each poll looks at the whole tree, as Triton's."""
    folder = repo.models_dir / "live"
    write_model(folder, "1")
    server = serve(repo.write_config(server_extra=SETTLE + "  watch_poll_s: 0.5\n"))
    assert ask(server.client, "live")["version"] == "1"
    edited = version_main("2").encode()
    if how == "hard link":
        outside = repo.root / "main.py"
        os.link(folder / "main.py", outside)
        with open(outside, "r+b") as file:  # the same inode, written under a name no watch follows
            file.truncate(0)
            file.write(edited)
    else:
        assert len(edited) == (folder / "main.py").stat().st_size  # (mmap cannot grow a file)
        with open(folder / "main.py", "r+b") as file, mmap.mmap(file.fileno(), 0) as mapped:
            mapped[:] = edited  # (the kernel moves the mtime at the first write to a page: no event is sent)
            mapped.flush()
    wait_for(lambda: generation(server, "live") == 2, timeout_s=30)
    assert ask(server.client, "live")["version"] == "2"


def test_failed_reload_keeps_the_running_version(repo, serve, caplog):
    folder = repo.models_dir / "steady"
    write_model(folder, "1")
    server = serve(repo.write_config(server_extra=SETTLE))
    (folder / "model_inference.textproto").write_text("input_shape: [1\n")
    state, reason = wait_for(lambda: index(server)["steady"] if "reload failed" in index(server)["steady"][1]
                             else None)
    assert state == "READY" and "the running version keeps serving" in reason and "model_inference.textproto" in reason
    assert ask(server.client, "steady")["version"] == "1"
    (folder / "model_inference.textproto").write_text(REPORT)  # fixed: the next reload succeeds
    wait_for(lambda: index(server)["steady"] == ("READY", ""))
    metrics = _scrape(server)
    assert metrics['nereid_repository_events_total{event="reload_failed",model="steady"}'] == 1
    assert metrics['nereid_model_version{model="steady"}'] == 2


@pytest.mark.parametrize("how", ["mv", "copy then delete"])
def test_rename_moves_the_loaded_model_in_place(repo, serve, how):
    write_model(repo.models_dir / "before", "1")
    # A copy is a rename when the original goes before the copy has settled: 100 ms is too short a margin
    # on a loaded 2-core machine (the copy was once loaded as a model of its own), and so was 1 s once in
    # clean-clone CI. A rename is carried out at once, so a long settle costs the test nothing.
    settle = SETTLE if how == "mv" else SETTLE.replace("watch_settle_ms: 100", "watch_settle_ms: 5000")
    server = serve(repo.write_config(server_extra=settle))
    parent = ask(server.client, "before")["parent"]
    backend = server.server.repository.entry("before").loaded.backend
    if how == "mv":
        os.rename(repo.models_dir / "before", repo.models_dir / "after")
    else:
        shutil.copytree(repo.models_dir / "before", repo.models_dir / "after", copy_function=shutil.copy)
        shutil.rmtree(repo.models_dir / "before")
    wait_for(lambda: index(server).get("after", ("",))[0] == "READY")
    assert "before" not in index(server)
    with pytest.raises(InferenceServerException) as caught:
        ask(server.client, "before")
    assert caught.value.status() == "StatusCode.NOT_FOUND"
    assert ask(server.client, "after") == {"version": "1", "parent": parent}  # the same warm parent
    assert server.server.repository.entry("after").loaded.backend is backend
    assert generation(server, "after") == 1
    metrics = _scrape(server)
    assert metrics['nereid_repository_events_total{event="rename",model="after"}'] == 1
    # The old name is forgotten: none of its series stay (its load, its requests), for ever, per name renamed.
    assert [key for key in metrics if 'model="before"' in key] == []


def test_renamed_bundle_is_not_compiled_or_read_again(repo, serve):
    shutil.copytree(EXAMPLES / "mlp_bundle", repo.models_dir / "mlp", ignore=shutil.ignore_patterns(".cache"))
    server = serve(repo.write_config(server_extra=SETTLE))
    tensor = triton.InferInput("input", [1, 16], "FP32")
    tensor.set_data_from_numpy(np.ones((1, 16), np.float32))
    expected = server.client.infer("mlp", [tensor]).as_numpy("output")
    before = _scrape(server)
    loads = before['nereid_model_load_duration_seconds_count{model="mlp"}']
    os.rename(repo.models_dir / "mlp", repo.models_dir / "mlp2")
    wait_for(lambda: index(server).get("mlp2", ("",))[0] == "READY")
    np.testing.assert_array_equal(server.client.infer("mlp2", [tensor]).as_numpy("output"), expected)
    metrics = _scrape(server)
    # Its one load moved with it (the same count and time: nothing loaded again); none is left under "mlp".
    assert metrics['nereid_model_load_duration_seconds_count{model="mlp2"}'] == loads == 1
    assert metrics['nereid_model_load_duration_seconds_sum{model="mlp2"}'] == \
        before['nereid_model_load_duration_seconds_sum{model="mlp"}']
    assert 'nereid_model_load_duration_seconds_count{model="mlp"}' not in metrics
    assert generation(server, "mlp2") == 1


def test_deleted_folder_finishes_its_requests_then_is_gone(repo, serve):
    folder = repo.models_dir / "doomed"
    _gated_model(folder, "1", repo.root)
    server = serve(repo.write_config(server_extra=SETTLE))
    caller, results = _in_flight(server, "doomed")
    # Running when its folder goes (the review of the tests: a fixed sleep let it start after, or end before).
    wait_for(lambda: (repo.root / "started").exists())
    shutil.rmtree(folder)
    wait_for(lambda: index(server).get("doomed", ("", ""))[0] == "UNLOADING")  # (the removal waits for it)
    (repo.root / "release").touch()
    caller.join(30)
    assert results and results[0]["version"] == "1"  # in flight: answered
    wait_for(lambda: "doomed" not in index(server))
    with pytest.raises(InferenceServerException) as caught:
        ask(server.client, "doomed")
    assert caught.value.status() == "StatusCode.NOT_FOUND"


def test_a_folder_emptied_of_its_model_s_files_is_its_removal_and_its_files_back_load_it(repo, serve):
    """Found by the storm hunt: a `git checkout` (or an `rm -rf m/*`) that removed a model's files left its folder
    holding the .cache/ nereid wrote (git ignores it); taken for an edit, its reload failed, and the removed model
    served on. Its model is unloaded now (the folder still there: its name stays, unloaded); its files back, the
    folder is new again to the watcher, and loads."""
    folder = repo.models_dir / "emptied"
    write_model(folder, "1")
    server = serve(repo.write_config(server_extra=SETTLE))
    assert ask(server.client, "emptied")["version"] == "1"
    (folder / ".cache").mkdir(exist_ok=True)
    (folder / ".cache" / "built").write_text("what a backend kept")
    for name in ("main.py", "model_inference.textproto"):
        (folder / name).unlink()
    wait_for(lambda: index(server).get("emptied") == ("UNAVAILABLE", "unloaded"))
    with pytest.raises(InferenceServerException) as caught:
        ask(server.client, "emptied")
    assert caught.value.status() == "StatusCode.UNAVAILABLE", caught.value.message()
    (folder / "model_inference.textproto").write_text(REPORT)
    (folder / "main.py").write_text(version_main("2"))
    wait_for(lambda: index(server).get("emptied", ("", ""))[0] == "READY")
    assert ask(server.client, "emptied")["version"] == "2"


@pytest.mark.parametrize("emptied", [False, True], ids=["deleted", "emptied"])
def test_a_listed_models_deleted_folder_leaves_it_waiting_for_its_folder(repo, serve, emptied):
    """Found by a README walkthrough: once its removal finished, the listed model was forgotten (NOT_FOUND, and
    its callers said it was no model of this server) until a RepositoryIndex made its entry anew. (Noticed by the
    stop 56 storm hunt: a folder emptied of its files, `rm -rf m/*`, left it `unloaded`, as if it could load.)"""
    write_model(repo.models_dir / "listed", "1")
    server = serve(repo.write_config("- name: listed\n", server_extra=SETTLE))
    if emptied:
        (repo.models_dir / "listed" / ".cache").mkdir(exist_ok=True)  # (kept: git ignores it)
        for path in (repo.models_dir / "listed").iterdir():
            if path.is_file():
                path.unlink()
    else:
        shutil.rmtree(repo.models_dir / "listed")
    repository = server.server.repository
    wait_for(lambda: (entry := repository._entries.get("listed")) is not None and entry.loaded is None
             and entry.reason.startswith("waiting for its folder"))
    with pytest.raises(InferenceServerException) as caught:  # (no RepositoryIndex before it: no rescan)
        ask(server.client, "listed")
    assert caught.value.status() == "StatusCode.UNAVAILABLE"
    assert "waiting for its folder 'listed' in ml_backends_path" in caught.value.message()
    if emptied:  # and it loads once its folder (its files) is back
        (repo.models_dir / "listed" / "model_inference.textproto").write_text(REPORT)
        (repo.models_dir / "listed" / "main.py").write_text(version_main("2"))
    else:
        write_model(repo.models_dir / "listed", "2")
    wait_for(lambda: index(server)["listed"][0] == "READY")
    assert ask(server.client, "listed")["version"] == "2"


def test_nereid_yaml_edits(repo, serve, caplog):
    for name in ("a", "b", "c"):
        write_model(repo.models_dir / name, name)
    config = repo.write_config("- name: a\n- name: b\n", server_extra=SETTLE)
    server = serve(config)
    assert index(server)["c"][0] == "UNAVAILABLE"
    caplog.set_level(logging.INFO)
    text = config.read_text()
    # a changed entry reloads, an added one loads, a removed one unloads
    edited = text.replace("  - name: a\n  - name: b\n",
                          "  - name: a\n    queue_capacity: 7\n  - name: c\n  - name: later\n")
    assert edited != text
    config.write_text(edited)
    wait_for(lambda: index(server)["c"][0] == "READY" and index(server)["b"][0] == "UNAVAILABLE")
    wait_for(lambda: generation(server, "a") == 2)
    assert server.server.repository.entry("a").loaded.scheduler.capacity == 7
    # Found by a bug hunt: an unlisted model showed "unloaded", as if an operator had unloaded it, and an entry
    # added before its folder was not said a word of.
    assert index(server)["b"][1] == "not listed in nereid.yaml; load it with RepositoryModelLoad"
    assert "model 'later' is now listed in nereid.yaml; it loads once its folder 'later' is in ml_backends_path" \
        in caplog.messages
    # a nereid.yaml that no longer parses is refused; the running configuration stays
    config.write_text("models: [\n")
    wait_for(lambda: any("keeping the running configuration" in r.message for r in caplog.records))
    assert ask(server.client, "c")["version"] == "c"
    # so is one that gives defaults to a backend not installed, and it is not said to apply first (it was)
    caplog.clear()
    config.write_text(edited + "backends:\n  pyhton: {}\n")
    wait_for(lambda: _messages(caplog, "backends.pyhton: no such backend is installed"))
    assert not _messages(caplog, "applying it")
    # server keys are logged as needing a restart, and otherwise ignored
    config.write_text(text.replace('bind_addr: "127.0.0.1:0"', 'bind_addr: "127.0.0.1:1"'))
    wait_for(lambda: any("server.bind_addr: needs a restart" in r.message for r in caplog.records))
    assert ask(server.client, "a")["version"] == "a"
    # The fixed file is said to be valid again (nothing else says it took when no model changes).
    assert "dynamic repository: nereid.yaml changed; applying it (it is valid again)" in caplog.messages
    # Found by a bug hunt: the warning came again at every later edit that left the server: section as it was.
    config.write_text(text.replace('bind_addr: "127.0.0.1:0"', 'bind_addr: "127.0.0.1:1"')
                      .replace("  - name: b\n", "  - name: b\n    queue_capacity: 9\n"))
    wait_for(lambda: server.server.repository.entry("b").settings.queue_capacity == 9)
    assert len(_messages(caplog, "needs a restart")) == 1


def test_a_settings_edit_whose_reload_failed_shows_the_running_config_and_undone_reloads_nothing(repo, serve):
    """Found by a bug hunt: after `device: cuda:1` failed to reload on a machine without that GPU, ModelConfig
    said KIND_GPU while the running version served on the CPU; undoing the edit reloaded an identical version."""
    write_model(repo.models_dir / "a", "a")
    config = repo.write_config("- name: a\n", server_extra=SETTLE)
    server = serve(config)
    text = config.read_text()
    config.write_text(text.replace("  - name: a\n", '  - name: a\n    device: "cuda:1"\n'))
    wait_for(lambda: "reload failed" in index(server)["a"][1])
    assert index(server)["a"][0] == "READY" and generation(server, "a") == 1
    group = server.client.get_model_config("a").config.instance_group[0]
    assert (triton.model_config_pb2.ModelInstanceGroup.Kind.Name(group.kind), list(group.gpus)) == ("KIND_CPU", [])
    config.write_text(text)
    wait_for(lambda: index(server)["a"] == ("READY", ""))
    assert generation(server, "a") == 1 and ask(server.client, "a")["version"] == "a"


def test_a_folder_renamed_with_its_nereid_yaml_entry_loads_once_with_the_new_entry(repo, serve, caplog):
    # One git checkout that does `git mv a a2` and renames the entry: the rename needs no settle time, the file
    # does, so a2 was loaded under the running file (default settings; a cxx model not claimed at all, an
    # ERROR), then again once the file settled: two loads for one change.
    write_model(repo.models_dir / "a", "a")
    config = repo.write_config("- name: a\n  queue_capacity: 5\n",
                               server_extra="  watch: true\n  watch_settle_ms: 500\n")
    server = serve(config)
    caplog.set_level(logging.INFO)
    config.write_text(config.read_text().replace("name: a\n", "name: a2\n").replace("capacity: 5", "capacity: 7"))
    os.rename(repo.models_dir / "a", repo.models_dir / "a2")
    wait_for(lambda: index(server).get("a2", ("",))[0] == "READY" and "a" not in index(server))
    assert server.server.repository.entry("a2").loaded.scheduler.capacity == 7
    assert generation(server, "a2") == 1  # loaded once, with the new entry
    assert _scrape(server)['nereid_model_version{model="a2"}'] == 1
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_nereid_yaml_refused_for_a_passing_reason_is_applied_once_it_passes(repo, serve, caplog):
    """Defect (found by a bug hunt): an edit refused while ml_backends_path was moved away a moment was never
    tried again (its text was taken as seen), even once the folder was back and the file touched."""
    for name in ("a", "c"):
        write_model(repo.models_dir / name, name)
    config = repo.write_config("- name: a\n", server_extra=SETTLE)
    server = serve(config)
    caplog.set_level(logging.DEBUG)
    away = repo.models_dir.with_name("away")
    repo.models_dir.rename(away)
    try:
        config.write_text(config.read_text().replace("  - name: a\n", "  - name: a\n  - name: c\n"))
        wait_for(lambda: _messages(caplog, "keeping the running configuration"))
        assert "server.ml_backends_path" in _messages(caplog, "keeping the running configuration")[0]
    finally:
        away.rename(repo.models_dir)
    os.utime(config)  # (any later scan tries it again: a touch starts one)
    wait_for(lambda: index(server)["c"][0] == "READY")
    assert "dynamic repository: nereid.yaml changed; applying it (it is valid again)" in caplog.messages
    assert len([r for r in caplog.records if "keeping the running" in r.message and r.levelno >= logging.ERROR]) == 1


def test_removing_and_adding_the_models_key_serves_what_a_restart_would(repo, serve):
    """Defect (found by a bug hunt): with the models: key removed, a folder it had not listed stayed "not listed"
    (without the key every folder is served); with it added again, that folder kept serving."""
    for name in ("a", "b"):
        write_model(repo.models_dir / name, name)
    config = repo.write_config("- name: a\n", server_extra=SETTLE)
    server = serve(config)
    assert index(server)["b"][0] == "UNAVAILABLE"
    listed = config.read_text()
    config.write_text(listed.split("models:")[0])
    wait_for(lambda: index(server)["b"][0] == "READY")
    assert ask(server.client, "b")["version"] == "b"
    config.write_text(listed)
    wait_for(lambda: index(server)["b"][0] == "UNAVAILABLE")
    assert index(server)["a"][0] == "READY" and generation(server, "a") == 1


def slow_main(started: Path) -> str:
    """:func:`version_main` of a model "slow" whose run says it started (writes ``started``), then takes 2 s."""
    return version_main("slow").replace(
        "sys.stdin.buffer.read()", f"sys.stdin.buffer.read()\nimport time\nopen({str(started)!r}, 'w').close()\n"
                                   "time.sleep(2)")


@pytest.mark.parametrize("entry", ["- name: slow\n", "- name: slow\n  queue_capacity: 7\n"])
def test_a_model_listed_again_while_it_drains_is_loaded_once_it_has(repo, serve, entry, tmp_path):
    """Defect (the hunt of live edits): unlisted while a request ran on it, then listed again before the request
    ended (an edit undone, a flapping ConfigMap), the model stayed unloaded for good, listed, with ServerReady true:
    the edit that listed it again found it still loaded and scheduled nothing (or a reload that found it gone)."""
    write_model(repo.models_dir / "steady", "steady")
    folder = repo.models_dir / "slow"
    write_model(folder, "slow")
    started = tmp_path / "started"
    (folder / "main.py").write_text(slow_main(started))
    listed = f"- name: steady\n{entry}"
    config = repo.write_config(listed, server_extra=SETTLE)
    server = serve(config)
    running = threading.Thread(target=lambda: ask(triton.InferenceServerClient(server.url), "slow"))
    running.start()
    wait_for(started.exists)  # (its request runs)
    repo.write_config("- name: steady\n", server_extra=SETTLE)
    wait_for(lambda: index(server)["slow"][0] == "UNLOADING")
    repo.write_config(listed, server_extra=SETTLE)
    running.join(30)
    wait_for(lambda: index(server)["slow"] == ("READY", ""))
    assert ask(server.client, "slow")["version"] == "slow"


@pytest.mark.parametrize("edit", ["unlisted", "no models key"])
def test_a_model_listed_before_its_folder_is_forgotten_once_unlisted(repo, serve, edit):
    write_model(repo.models_dir / "real", "real")
    config = repo.write_config("- name: real\n- name: ghost\n", server_extra=SETTLE)
    server = serve(config)
    # In the words a live edit listing it gives (found by a bug hunt: "no folder 'ghost' in ml_backends_path
    # (yet)" at start, "waiting for its folder" live, for the same nereid.yaml).
    assert index(server)["ghost"] == ("UNAVAILABLE", "waiting for its folder 'ghost' in ml_backends_path")
    text = config.read_text()
    config.write_text(text.replace("  - name: ghost\n", "") if edit == "unlisted" else text.split("models:")[0])
    wait_for(lambda: "ghost" not in index(server))
    assert index(server)["real"][0] == "READY"


def _scrape(server) -> dict[str, float]:
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{server.server.metrics_port}/metrics", timeout=10).read()
    samples = {}
    for line in text.decode().splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            samples[key] = float(value)
    return samples


# -- hostile names, a vanished repository, a bad or symlinked nereid.yaml -----------------

ODD = b"odd\xffname"  # a folder name that is not UTF-8


def _odd_folder(repo) -> bytes:
    """A copy of a working model under a name that is not UTF-8 (``mkdir $'odd\\xffname'``)."""
    path = os.path.join(os.fsencode(repo.models_dir), ODD)
    os.mkdir(path)
    for name in ("model_inference.textproto", "main.py"):
        shutil.copy(repo.models_dir / "first" / name, os.fsdecode(os.path.join(path, os.fsencode(name))))
    return path


def _messages(caplog, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


def test_a_folder_name_that_is_not_utf8_is_skipped_and_the_watch_goes_on(repo, serve, caplog):
    # It used to end the watch without a word (watchfiles raised) and make RepositoryIndex INTERNAL.
    caplog.set_level(logging.INFO)
    write_model(repo.models_dir / "first", "1")
    config = repo.write_config("- name: first\n", server_extra=SETTLE + "  watch_poll_s: 0.2\n")
    server = serve(config)
    _odd_folder(repo)
    write_model(repo.models_dir / "later", "later")  # dropped after the bad one: still loads
    wait_for(lambda: index(server).get("later", ("",))[0] == "READY")
    assert set(index(server)) == {"first", "later"}
    assert ask(server.client, "later")["version"] == "later"
    config.write_text(config.read_text().replace("  - name: first\n", "  - name: first\n    queue_capacity: 7\n"))
    wait_for(lambda: server.server.repository.entry("first").loaded.scheduler.capacity == 7)  # nereid.yaml too
    skipped = _messages(caplog, "skipping the folder 'odd\\xffname': its name is not UTF-8")
    assert len(skipped) == 1, skipped  # once, however many scans
    assert _messages(caplog, "cannot follow") and not _messages(caplog, "applying a change failed")
    assert not server.server._watching.done()
    # Once the bad folder is gone, events are followed again.
    shutil.rmtree(os.path.join(os.fsencode(repo.models_dir), ODD))
    write_model(repo.models_dir / "last", "last")
    wait_for(lambda: index(server).get("last", ("",))[0] == "READY")


def test_without_watch_a_folder_name_that_is_not_utf8_leaves_the_index_working(repo, serve, caplog):
    write_model(repo.models_dir / "first", "1")
    server = serve(repo.write_config())
    _odd_folder(repo)
    for _ in range(3):
        assert index(server) == {"first": ("READY", "")}
    assert len(_messages(caplog, "skipping the folder 'odd\\xffname'")) == 1


def test_a_removed_ml_backends_path_forgets_nothing(repo, serve, caplog):
    # RepositoryIndex used to answer INTERNAL (FileNotFoundError) once the folder was gone.
    write_model(repo.models_dir / "first", "1")
    server = serve(repo.write_config())
    moved = repo.root / "moved-away"
    os.rename(repo.models_dir, moved)
    assert index(server) == {"first": ("READY", "")}
    assert _messages(caplog, "cannot list it: No such file or directory")
    assert ask(server.client, "first")["version"] == "1"
    os.rename(moved, repo.models_dir)


def test_a_nereid_yaml_that_is_not_utf8_is_refused_and_folders_are_still_handled(repo, serve, caplog):
    # Every later change used to log a traceback ("applying a change failed") and folders stopped loading.
    write_model(repo.models_dir / "first", "1")
    config = repo.write_config(server_extra=SETTLE)
    server = serve(config)
    config.write_bytes(b'server:\n  bind_addr: "\xff"\n')
    wait_for(lambda: _messages(caplog, "keeping the running configuration"))
    refused = _messages(caplog, "keeping the running configuration")[0]
    assert f"{config}: not UTF-8 text (invalid byte at offset 22)" in refused, refused
    write_model(repo.models_dir / "later", "later")
    wait_for(lambda: index(server).get("later", ("",))[0] == "READY")
    assert ask(server.client, "first")["version"] == "1"
    assert not _messages(caplog, "applying")


def test_a_symlinked_nereid_yaml_is_read_again_through_its_links(repo, serve, caplog):
    # A Kubernetes ConfigMap: nereid.yaml -> ..data/nereid.yaml, ..data -> ..v1; an update swaps ..data to
    # ..v2 and removes ..v1. The resolved path used to be kept ("..v1/nereid.yaml: cannot read" forever).
    write_model(repo.models_dir / "first", "1")
    text = repo.write_config("- name: first\n", server_extra=SETTLE).read_text().replace(
        'ml_backends_path: "ml-backends"', f'ml_backends_path: "{repo.models_dir}"')
    cfg = repo.root / "cfg"
    (cfg / "..v1").mkdir(parents=True)
    (cfg / "..v1" / "nereid.yaml").write_text(text)
    os.symlink("..v1", cfg / "..data")
    os.symlink("..data/nereid.yaml", cfg / "nereid.yaml")
    server = serve(cfg / "nereid.yaml")
    assert server.server.repository.entry("first").loaded.scheduler.capacity == 128
    (cfg / "..v2").mkdir()
    (cfg / "..v2" / "nereid.yaml").write_text(text.replace("  - name: first\n", "  - name: first\n"
                                                                                  "    queue_capacity: 7\n"))
    os.symlink("..v2", cfg / "..data_tmp")
    os.rename(cfg / "..data_tmp", cfg / "..data")  # what kubelet does: an atomic swap of the link
    shutil.rmtree(cfg / "..v1")
    wait_for(lambda: server.server.repository.entry("first").loaded.scheduler.capacity == 7)
    assert not _messages(caplog, "cannot read")


def kubelet_update(volume: Path, files: dict[str, str], stamp: str) -> None:
    """Write ``files`` into ``volume`` as kubelet updates a ConfigMap volume: a new hidden ..<stamp> folder, an
    atomic swap of the ..data link to it, top-level links for new names, the old folder removed."""
    (volume / f"..{stamp}").mkdir(parents=True)
    for name, text in files.items():
        (volume / f"..{stamp}" / name).write_text(text)
    old = os.readlink(volume / "..data") if (volume / "..data").is_symlink() else None
    os.symlink(f"..{stamp}", volume / "..data_tmp")
    os.rename(volume / "..data_tmp", volume / "..data")
    for name in files:
        if not (volume / name).is_symlink():
            os.symlink(f"..data/{name}", volume / name)
    if old is not None:
        shutil.rmtree(volume / old)


@pytest.mark.parametrize("mount", ["in place", "symlinked"])
def test_a_model_folder_mounted_as_a_configmap_reloads_once_per_update(repo, serve, caplog, mount):
    # An update changes only hidden names (..data, ..<stamp>/...): every event was dropped, and the model
    # kept its old code until some other folder happened to change. Mounted elsewhere and symlinked into
    # ml_backends_path (follow_symlinks), its events come by the volume's own path.
    caplog.set_level(logging.INFO, logger="nereid.watch")
    volume = repo.models_dir / "mounted" if mount == "in place" else repo.root / "volume"
    kubelet_update(volume, {"main.py": version_main("1"), "model_inference.textproto": REPORT}, "2026_12_02_1")
    if mount == "symlinked":
        os.symlink(volume, repo.models_dir / "mounted")
    server = serve(repo.write_config("- name: mounted\n", server_extra=SETTLE + "  follow_symlinks: true\n"))
    assert ask(server.client, "mounted")["version"] == "1"
    for version in ("2", "3"):
        kubelet_update(volume, {"main.py": version_main(version), "model_inference.textproto": REPORT},
                       f"2026_12_02_{version}")
        wait_for(lambda: ask(server.client, "mounted")["version"] == version)
    time.sleep(0.5)  # (a second reload per update would come within the settle time)
    assert generation(server, "mounted") == 3
    assert len(_messages(caplog, "folder 'mounted' changed; reloading it")) == 2


def test_a_nereid_yaml_seen_half_written_is_not_applied(repo, serve, caplog):
    # An editor that truncates the file, then writes it in two parts: the watcher applied the first part (a
    # listed model unloaded, its requests failing; an empty file reloaded every model with every default).
    caplog.set_level(logging.INFO)
    write_model(repo.models_dir / "first", "1")
    write_model(repo.models_dir / "second", "1")
    config = repo.write_config("- name: first\n- name: second\n",
                               server_extra="  watch: true\n  watch_settle_ms: 1500\n")  # (room for stalls)
    server = serve(config)
    text = config.read_text()
    edited = text.replace("  - name: second\n", "  - name: second\n    queue_capacity: 7\n")
    assert edited != text
    cut = edited.index("  - name: second")
    load = Load(server.url, "second")
    try:
        for first_part in (edited[:cut], ""):
            with open(config, "w") as out:  # truncated, then written in two parts
                out.write(first_part)
                out.flush()
                time.sleep(0.15)  # (well past the watcher's 20 ms event grouping, within the settle time)
                out.write(edited[len(first_part):])
            wait_for(lambda: server.server.repository.entry("second").loaded.scheduler.capacity == 7)
            config.write_text(text)
            wait_for(lambda: server.server.repository.entry("second").loaded.scheduler.capacity == 128)
    finally:
        load.stop()
    assert load.failures == [] and load.answers
    assert not _messages(caplog, "no longer listed") and not _messages(caplog, "keeping the running configuration")
    assert generation(server, "first") == 1  # never reloaded with the defaults of an empty file


def test_a_store_down_at_start_loads_at_its_first_listing_what_a_start_would_have(s3, tmp_path, caplog):
    """Defect: with the first listing failed, every folder of the first good one counted as added, so
    unlisted folders loaded, which a start with the store up never does."""
    import asyncio
    import uuid

    import boto3

    import toy_backends
    from moto_s3 import ACCESS_KEY, REGION, SECRET_KEY
    from nereid.plugins import make_plugin_manager
    from nereid.model_entry import ModelState
    from nereid.repository import ModelRepository
    from nereid.settings import load_settings
    from nereid.storage import StorageError
    from nereid.watch import RepositoryWatcher

    bucket = f"nereid-late-{uuid.uuid4().hex[:12]}"  # absent at start: its listing fails
    config = tmp_path / "nereid.yaml"
    config.write_text(f'server:\n  ml_backends_path: "s3://{bucket}/models"\n  cache_dir: "{tmp_path / "cache"}"\n'
                      '  metrics_addr: ""\n  http_addr: ""\n  watch: true\n  watch_settle_ms: 0\n'
                      'models:\n  - name: listed\n')
    settings = load_settings(config)
    (tmp_path / "scratch").mkdir()
    caplog.set_level(logging.INFO, logger="nereid.watch")

    async def scenario():
        repository = ModelRepository(settings, make_plugin_manager(load_entry_points=False,
                                                                   extra_plugins=(toy_backends,)), tmp_path / "scratch")
        watcher = RepositoryWatcher(repository, settings)
        assert (await repository.load("listed")).state is ModelState.UNAVAILABLE
        await watcher.prime()
        for _ in range(3):  # polls of a store that still cannot be listed
            await watcher.apply()
        for elapsed in ("425.374527", "482.885261"):  # an unreachable store: its client times each try
            watcher._cannot_list(StorageError(f"cannot reach the store (error sending request, in {elapsed}ms, "
                                              "after 3 retries)"))
        client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=ACCESS_KEY,
                              aws_secret_access_key=SECRET_KEY, region_name=REGION)
        client.create_bucket(Bucket=bucket)
        for name in ("listed", "unlisted"):
            folder = toy_backends.write_toy(tmp_path / "source", name)
            for path in folder.iterdir():
                client.put_object(Bucket=bucket, Key=f"models/{name}/{path.name}", Body=path.read_bytes())
        for _ in range(3):  # settled or not, the unlisted folder is no folder added since the start
            await watcher.apply()
            await asyncio.sleep(0.01)
        states = {entry.name: entry.state for entry in repository.entries()}
        await repository.unload_all()
        return states
    states = asyncio.run(scenario())
    assert states["listed"] is ModelState.READY
    assert states.get("unlisted") is not ModelState.READY
    assert "the store can be listed again; loading 'listed'" in caplog.text
    assert caplog.text.count("the store can be listed again") == 1
    # Defect: every poll of a store that could not be listed logged its WARNING again (8,640 lines a day at
    # the default 10 s): the same reason is a WARNING once, then DEBUG.
    failures = [r for r in caplog.records if "nothing changes until it can be listed" in r.getMessage()]
    assert [r.levelname for r in failures] == ["WARNING", "WARNING"], [r.getMessage() for r in failures]
    assert "NoSuchBucket" in failures[0].getMessage() or bucket in failures[0].getMessage()
    assert "425.374527ms" in failures[1].getMessage()  # the second try, whose time differs, is no new reason


# -- a bucket's folder whose load the store failed ------------------------------------------------------------------

class WatchedBucket:
    """A toy repository in this test's prefix of the moto bucket, watched (settle 0, polled every 0.1 s)."""

    def __init__(self, s3, tmp_path: Path) -> None:
        import boto3

        from moto_s3 import ACCESS_KEY, BUCKET, REGION, SECRET_KEY
        from nereid.settings import load_settings

        self.tmp_path, self.bucket, self.prefix = tmp_path, BUCKET, f"{s3.prefix}/models"
        self.client = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=ACCESS_KEY,
                                   aws_secret_access_key=SECRET_KEY, region_name=REGION)
        config = tmp_path / "nereid.yaml"
        config.write_text(f'server:\n  ml_backends_path: "s3://{BUCKET}/{self.prefix}"\n'
                          f'  cache_dir: "{tmp_path / "cache"}"\n  metrics_addr: ""\n  http_addr: ""\n'
                          '  watch: true\n  watch_settle_ms: 0\n  watch_poll_s: 0.1\n')
        self.settings = load_settings(config)

    def upload(self, name: str, **extra: str) -> None:
        """A toy model folder ``name`` (with ``extra`` files: name=text) put into the bucket."""
        import toy_backends

        folder = toy_backends.write_toy(self.tmp_path / "source" / name, name)
        for relative, text in extra.items():
            (folder / relative).write_text(text)
        for path in folder.iterdir():
            self.client.put_object(Bucket=self.bucket, Key=f"{self.prefix}/{name}/{path.name}",
                                   Body=path.read_bytes())

    def repository(self):
        import toy_backends
        from nereid.plugins import make_plugin_manager
        from nereid.repository import ModelRepository

        (self.tmp_path / "scratch").mkdir(exist_ok=True)
        return ModelRepository(self.settings, make_plugin_manager(load_entry_points=False,
                                                                  extra_plugins=(toy_backends,)),
                               self.tmp_path / "scratch")

    async def watched(self):
        """A repository and its watcher, primed with the bucket as it is and watching from now on."""
        from nereid.watch import RepositoryWatcher

        repository = self.repository()
        watcher = RepositoryWatcher(repository, self.settings)
        await watcher.prime()
        repository.watch_started()
        return repository, watcher


def _entry(repository, name: str):
    """The entry of ``name``, None while the repository has none (never a listing of the store)."""
    return next((entry for entry in repository.entries() if entry.name == name), None)


def _store_failed(caplog, name: str) -> list[logging.LogRecord]:
    """The watcher's WARNINGs that the store failed the load of the folder ``name``."""
    return [r for r in caplog.records if r.name == "nereid.watch" and r.levelno >= logging.WARNING
            and r.getMessage().startswith(f"dynamic repository: folder '{name}' did not")]


async def _until(condition, what: str, timeout_s: float = 10.0) -> None:
    import asyncio

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


def test_a_load_the_store_failed_is_tried_again_once_it_serves_and_a_bad_model_is_not(s3, tmp_path, caplog):
    """Defect: with a bucket watched, a load or reload the store failed (its object GETs refused: 403
    AccessDenied) was never tried again once the store served them, since the folder's state was taken as
    done before the load: a new model stayed UNAVAILABLE, an edited one kept serving its old version, until
    an object of the folder changed again. A load that fails for the model's own fault is not tried again."""
    import asyncio

    from nereid.model_entry import ModelState

    store = WatchedBucket(s3, tmp_path)
    # moto enforces a bucket policy's Deny: this test's objects answer 403 AccessDenied, listings still work.
    policy = json.dumps({"Version": "2012-10-17", "Statement": [{
        "Effect": "Deny", "Principal": "*", "Action": "s3:GetObject",
        "Resource": f"arn:aws:s3:::{store.bucket}/{store.prefix}/*"}]})
    store.upload("served")
    caplog.set_level(logging.INFO, logger="nereid")

    async def scenario() -> str:
        repository, watcher = await store.watched()
        await asyncio.gather(*(repository.load(name) for name in repository.startup_models()))
        served = _entry(repository, "served")
        assert (served.state, served.generation) == (ModelState.READY, 1)
        store.client.put_bucket_policy(Bucket=store.bucket, Policy=policy)
        running = asyncio.create_task(watcher.run())
        try:
            store.upload("new")  # a new model, and an edit of a served one, while the store refuses their GETs
            store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/served/toy.txt", Body=b"edited")
            await _until(lambda: _entry(repository, "new") is not None and "403" in _entry(repository, "new").reason
                         and served.reason.startswith("reload failed, the running version keeps serving"),
                         "both loads failed by the store")
            assert (_entry(repository, "new").state, served.state) == (ModelState.UNAVAILABLE, ModelState.READY)
            await asyncio.sleep(0.5)  # polls while the store still refuses: tried again, ever less often
            store.client.delete_bucket_policy(Bucket=store.bucket)  # it serves again; nothing in the bucket changes
            await _until(lambda: _entry(repository, "new").state is ModelState.READY and served.generation == 2,
                         "both loaded once the store served again (neither folder changed)", timeout_s=5)
            assert (served.state, served.reason) == (ModelState.READY, "")
            store.upload("broken", **{"fail.txt": "this model refuses to load"})  # its own fault, not the store's
            await _until(lambda: _entry(repository, "broken") is not None
                         and "refuses" in _entry(repository, "broken").reason, "the broken model failed")
            await asyncio.sleep(0.5)  # five polls, past the tries a store's failure would have had
            return _entry(repository, "broken").reason
        finally:
            watcher.stop()
            await running
            store.client.delete_bucket_policy(Bucket=store.bucket)
            await repository.unload_all()
    assert "this model refuses to load" in asyncio.run(scenario())
    # The store's failure is a WARNING once per folder, not per try (its tries are at DEBUG).
    assert [len(_store_failed(caplog, name)) for name in ("new", "served", "broken")] == [1, 1, 0], caplog.text
    assert "403" in _store_failed(caplog, "new")[0].getMessage()
    loads = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model 'broken' is UNAVAILABLE")]
    assert len(loads) == 1, loads  # never tried again: it would fail the same way


def test_a_bucket_folder_changed_while_a_requested_load_runs_is_loaded_as_changed(s3, tmp_path):
    """Review: the watcher's reload of a folder changed in the bucket, queued behind a RepositoryModelLoad still
    running, found the model "loaded meanwhile" (a bucket's files carry no stamp) and the change was lost."""
    import asyncio

    from nereid.model_entry import ModelState

    store = WatchedBucket(s3, tmp_path)
    release = tmp_path / "release"
    wide = "input_shape: [8]\noutput_shape: [8]\nmax_batch_size: 8\n"

    async def scenario() -> None:
        repository, watcher = await store.watched()
        store.upload("a", **{"gate.txt": str(release)})
        requested = asyncio.create_task(repository.load("a"))  # RepositoryModelLoad
        await _until(lambda: _entry(repository, "a") is not None and _entry(repository, "a").building is not None,
                     "a's load running")
        store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/a/model_inference.textproto",
                                Body=wide.encode())
        await watcher._apply_serialized()  # seen (settle time 0)
        await watcher._apply_serialized()  # its reload waits for the load under way
        release.touch()
        await requested
        while watcher._changes:
            await asyncio.gather(*watcher._changes)
        entry = _entry(repository, "a")
        assert entry.state is ModelState.READY and entry.loaded.signature.inputs[0].dims == (8,)
        watcher.stop()
        await repository.unload_all()
    asyncio.run(scenario())


def test_a_bucket_folder_a_client_loaded_as_it_is_is_not_loaded_again_by_the_watcher(s3, tmp_path, caplog):
    """Found by the repository read hunt: a RepositoryModelLoad of a folder just uploaded to a watched bucket (or
    just edited there) was followed by the watcher's own load of the same objects: every weight fetched again
    and two versions in memory for a swap, as a local folder's is not (a store's version had no stamp)."""
    import asyncio
    import logging

    from nereid.model_entry import ModelState

    store = WatchedBucket(s3, tmp_path)
    caplog.set_level(logging.INFO, logger="nereid")

    async def scenario() -> None:
        repository, watcher = await store.watched()
        store.upload("b")
        await repository.load("b")  # the client's, before the watcher looks
        for _ in range(3):
            await watcher._apply_serialized()
            while watcher._changes:
                await asyncio.gather(*watcher._changes)
        entry = _entry(repository, "b")
        assert entry.state is ModelState.READY and repository.generation("b") == 1
        # Now changed in the bucket, and not loaded: reloaded.
        store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/b/extra.txt", Body=b"an edit")
        for _ in range(3):
            await watcher._apply_serialized()
            while watcher._changes:
                await asyncio.gather(*watcher._changes)
        assert repository.generation("b") == 2
        watcher.stop()
        await repository.unload_all()
    asyncio.run(scenario())
    assert "dynamic repository: folder 'b' is loaded already as it is now" in caplog.text


def test_a_bucket_folder_emptied_but_for_its_folder_objects_unloads_its_model(s3, tmp_path) -> None:
    """The review hunt of a60f3c7: a bucket's folder emptied of its files keeps its folder object (a console's
    delete leaves it, as a nested one), and was taken for an edit: the reload of nothing failed, and the removed
    model served on. Its files back, it loads again; a folder object inside a folder is no file of its stamp."""
    import asyncio

    from nereid.model_entry import ModelState

    store = WatchedBucket(s3, tmp_path)

    async def settle(watcher) -> None:
        for _ in range(3):
            await watcher._apply_serialized()
            while watcher._changes:
                await asyncio.gather(*watcher._changes)

    async def scenario() -> None:
        repository, watcher = await store.watched()
        store.upload("b")
        store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/b/sub/", Body=b"")
        await repository.load("b")  # a client's: the watcher, which then looks, has nothing to load again
        await settle(watcher)
        assert _entry(repository, "b").state is ModelState.READY and repository.generation("b") == 1
        listed = store.client.list_objects_v2(Bucket=store.bucket, Prefix=f"{store.prefix}/b/")["Contents"]
        for item in listed:
            if not item["Key"].endswith("/"):  # (its folder objects stay, a nested one too: the review hunt)
                store.client.delete_object(Bucket=store.bucket, Key=item["Key"])
        store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/b/", Body=b"")  # (the console's)
        await settle(watcher)
        entry = _entry(repository, "b")
        assert entry is None or entry.loaded is None, entry
        for path in (tmp_path / "source" / "b" / "b").iterdir():  # (its files, uploaded again)
            store.client.put_object(Bucket=store.bucket, Key=f"{store.prefix}/b/{path.name}", Body=path.read_bytes())
        await settle(watcher)
        assert _entry(repository, "b").state is ModelState.READY
        watcher.stop()
        await repository.unload_all()
    asyncio.run(scenario())


def test_a_load_failed_by_a_store_that_serves_again_when_the_watcher_looks_is_tried_again(s3, tmp_path, caplog):
    """A fetch that failed every try (HTTP 500) then succeeds at once: the repository recorded the store's
    error as the load's cause, and the watcher tries it again."""
    import asyncio

    from nereid.model_entry import ModelState

    store = WatchedBucket(s3, tmp_path)
    caplog.set_level(logging.INFO, logger="nereid")

    async def scenario() -> None:
        repository, watcher = await store.watched()
        store.upload("new")
        s3.fail(f"{store.prefix}/new/toy.txt", times=4)  # the store client's first try and its 3 retries
        await watcher._apply_serialized()  # seen; then loaded by the scan the watcher schedules once it settled
        await _until(lambda: _entry(repository, "new") is not None and _entry(repository, "new").generation == 1,
                     "'new' loaded at a later scan", timeout_s=5)
        assert _entry(repository, "new").state is ModelState.READY
        watcher.stop()
        await repository.unload_all()
    asyncio.run(scenario())
    failures = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model 'new' is UNAVAILABLE")]
    assert len(failures) == 1 and "500" in failures[0], failures
    [warning] = _store_failed(caplog, "new")
    assert "did not load because of the store" in warning.getMessage() and "500" in warning.getMessage()


# -- a deleted folder's model draining while its name is asked for again ------------------------------------------

def _gated_model(folder: Path, version: str, gate: Path) -> None:
    """A model answering ``version`` once ``gate``/release exists (it writes ``gate``/started first): its request
    is still running when its folder goes, however slow the machine."""
    write_model(folder, version)
    (folder / "main.py").write_text(
        f"import os, time\nopen({str(gate / 'started')!r}, 'w').close()\ndeadline = time.monotonic() + 30\n"
        f"while not os.path.exists({str(gate / 'release')!r}) and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n" + version_main(version))


def _in_flight(server, model: str) -> tuple[threading.Thread, list[dict]]:
    """One request to ``model`` on its own client and thread; its answer lands in the list."""
    answers: list[dict] = []

    def call() -> None:
        client = triton.InferenceServerClient(server.url)
        try:
            answers.append(ask(client, model))
        finally:
            client.close()
    caller = threading.Thread(target=call)
    caller.start()
    return caller, answers


def test_a_load_of_a_deleted_folder_whose_model_still_drains_is_not_found(repo, serve):
    """Defect: RepositoryModelLoad waited for the old model's requests, then answered INTERNAL "unloaded"."""
    from support import expect_grpc_error

    _gated_model(repo.models_dir / "doomed", "1", repo.root)
    server = serve(repo.write_config(server_extra=SETTLE))
    caller, answers = _in_flight(server, "doomed")
    wait_for(lambda: (repo.root / "started").exists())  # the request is running
    shutil.rmtree(repo.models_dir / "doomed")
    wait_for(lambda: index(server)["doomed"][0] == "UNLOADING")  # removed; its request still runs
    expect_grpc_error("NOT_FOUND", lambda: server.client.load_model("doomed"),
                      "unknown model 'doomed' (no folder 'doomed' under ml_backends_path)")
    assert caller.is_alive(), "the load waited for the old model's request"
    (repo.root / "release").touch()
    caller.join(30)
    assert [answer["version"] for answer in answers] == ["1"]  # in flight: answered once
    wait_for(lambda: "doomed" not in index(server))


def test_a_folder_renamed_onto_a_name_whose_model_drains_serves_at_once(repo, serve):
    """Defect: ``rm -r m; mv other m`` while a request ran on the old m answered UNAVAILABLE under m until that
    request ended (up to shutdown_grace_s): the rename waited for the old model's removal."""
    _gated_model(repo.models_dir / "m", "old", repo.root)
    write_model(repo.models_dir / "other", "other")
    server = serve(repo.write_config(server_extra=SETTLE))
    caller, answers = _in_flight(server, "m")
    wait_for(lambda: (repo.root / "started").exists())  # the request is running
    shutil.rmtree(repo.models_dir / "m")
    wait_for(lambda: index(server)["m"][0] == "UNLOADING")
    os.rename(repo.models_dir / "other", repo.models_dir / "m")

    def new_m() -> dict | None:
        try:
            return ask(server.client, "m")
        except InferenceServerException:
            return None
    assert wait_for(new_m, 5)["version"] == "other"
    assert caller.is_alive(), "the new 'm' served only once the old one had finished"
    (repo.root / "release").touch()
    caller.join(30)
    assert [answer["version"] for answer in answers] == ["old"]  # the old m's request: answered once, by it
    assert index(server) == {"m": ("READY", "")}
    assert ask(server.client, "m")["version"] == "other"


def test_a_load_the_stores_listing_failed_before_the_repository_knew_the_folder_is_tried_again(s3, tmp_path):
    """Defects (a review of the retry): a load that could not list the store (UNAVAILABLE, "cannot tell whether its
    folder is in the store", raised from the StorageError) was not taken for the store's fault; and, the folder
    having no entry yet, it was then taken for one unloaded meanwhile and never tried again."""
    import asyncio

    from nereid.errors import Unavailable
    from nereid.storage import StorageError, store_failed

    assert store_failed(Unavailable("model 'n': cannot tell ...")) is False
    try:
        try:
            raise StorageError("s3://models/x: cannot list the model folders: HTTP 500")
        except StorageError as err:
            raise Unavailable("model 'n': cannot tell whether its folder is in the store: ...") from err
    except Unavailable as raised:
        from_store = raised
    assert store_failed(from_store)
    try:
        try:
            raise StorageError("s3://models/x: HTTP 500")
        except StorageError:
            raise ValueError("the model's own fault, raised while handling it") from None
    except ValueError as own:
        assert store_failed(own) is False  # (from None: not the store's doing)

    store = WatchedBucket(s3, tmp_path)

    async def scenario() -> None:
        repository, watcher = await store.watched()
        store.upload("n")
        await watcher._apply_serialized()  # seen, settling: known to the watcher, not yet loaded
        state = watcher._pending.state("n")
        assert _entry(repository, "n") is None

        async def listing_down(retrying: str | None = None):  # the load, as it fails when the store's listing does (asked for all the same)
            repository._exposed.add("n")
            raise from_store
        watcher._accept("n", state)  # settled: taken as known before its load, as the watcher does
        await watcher._from_store("n", state, None, listing_down)
        assert "n" in watcher._store_retries and "n" not in watcher._folders  # to be seen again, after a wait
        repository.rescan()  # (a RepositoryIndex meanwhile: the entry it makes is no model unloaded since)
        polling = asyncio.create_task(watcher.run())
        await _until(lambda: _entry(repository, "n") is not None and _entry(repository, "n").generation == 1,
                     "'n' tried again and loaded", timeout_s=5)
        watcher.stop()
        await polling
        await repository.unload_all()
    asyncio.run(scenario())


# -- a bucket's folder whose load the store failed at start-up -----------------------------------------------------

async def _started(store: WatchedBucket):
    """A repository and its watcher started as ``NereidServer.load_models`` starts them: primed, polling, then the
    start-up loads (every folder: nereid.yaml lists none)."""
    import asyncio

    repository, watcher = await store.watched()
    polling = asyncio.create_task(watcher.run())
    await asyncio.gather(*(repository.load(name) for name in repository.startup_models()))
    return repository, watcher, polling


def test_a_start_up_load_the_store_failed_is_tried_again_though_its_folder_never_changes(s3, tmp_path, caplog):
    """Defect: with `watch`, a model whose load the store failed at start-up (a fetch failing past the store
    client's retries) stayed UNAVAILABLE until its folder changed: only the watcher's own loads were tried
    again. It is now tried again as they are (watch_poll_s, then less often), its first failure a WARNING."""
    import asyncio

    from nereid.model_entry import ModelState

    store = WatchedBucket(s3, tmp_path)
    store.upload("m")
    caplog.set_level(logging.INFO, logger="nereid")

    async def scenario() -> None:
        s3.fail(f"{store.prefix}/m/toy.txt", times=4)  # the store client's first try and its 3 retries
        repository, watcher, polling = await _started(store)
        try:
            assert "500" in _entry(repository, "m").store_fault  # failed at start-up, by the store
            await _until(lambda: _entry(repository, "m").state is ModelState.READY,
                         "'m' loaded by a later poll, its folder unchanged", timeout_s=3)
        finally:
            watcher.stop()
            await polling
            await repository.unload_all()
    asyncio.run(scenario())
    [warning] = _store_failed(caplog, "m")
    assert "did not load because of the store" in warning.getMessage() and "500" in warning.getMessage()
    assert "folder 'm' loaded; the store had failed it 1 time(s)" in caplog.text


def test_a_store_failure_that_repeats_is_an_error_once_then_debug_until_its_reason_changes(s3, tmp_path, caplog):
    """Defect: a load the store fails the same way at every try (here a lock file of the model's cache copy that
    cannot be made; a name too long for the local disk does the same) logged the repository's ERROR at
    every try, every 5 minutes for ever. The first failure is an ERROR; the tries that fail as the last one
    did are DEBUG; another reason is an ERROR (and the watcher's WARNING) again; the load that works says so."""
    import asyncio

    from nereid.model_entry import ModelState

    store = WatchedBucket(s3, tmp_path)
    caplog.set_level(logging.DEBUG, logger="nereid")
    folder = store.settings.server.ml_backends_path / "m"

    def failures(why: str = "") -> list[str]:
        """The levels of the repository's lines for the failed loads of 'm' (for ``why``)."""
        return [r.levelname for r in caplog.records if r.name == "nereid.repository"
                and r.getMessage().startswith("model 'm' is UNAVAILABLE") and why in r.getMessage()]

    async def scenario() -> None:
        import shutil
        import socket
        import subprocess
        import tempfile

        repository, watcher = await store.watched()
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = folder.parent / f".m{LOCK_SUFFIX}"
        # Its lock file cannot be opened: a socket there (No such device or address). (A folder or a symlink there
        # would be removed as damage.)
        with tempfile.TemporaryDirectory() as short, socket.socket(socket.AF_UNIX) as listening:
            listening.bind(os.path.join(short, "s"))  # (moved there: a socket's path is at most 107 bytes)
            shutil.move(os.path.join(short, "s"), lock)
        store.upload("m")
        polling = asyncio.create_task(watcher.run())
        running = None
        try:
            await _until(lambda: len(failures()) >= 3, "'m' failed and was tried again twice", timeout_s=3)
            # Another reason: its lock file a program running (Text file busy).
            lock.unlink()
            shutil.copy("/bin/sleep", lock)
            running = subprocess.Popen([lock, "60"])
            await _until(lambda: failures("Text file busy"), "'m' tried again, failing for another reason", 3)
            running.kill()
            running.wait()
            lock.unlink()
            await _until(lambda: _entry(repository, "m").state is ModelState.READY, "'m' loaded once fixed", 3)
        finally:
            if running is not None:
                running.kill()
                running.wait()
            watcher.stop()
            await polling
            await repository.unload_all()
    asyncio.run(scenario())
    repeated = failures("No such device or address")
    assert len(repeated) >= 3 and repeated == ["ERROR"] + ["DEBUG"] * (len(repeated) - 1), repeated
    assert failures("Text file busy") == ["ERROR"]
    said = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "nereid.watch"
            and r.getMessage().startswith("dynamic repository: folder 'm'")]
    assert [level for level, _ in said if level != "DEBUG"] == ["WARNING", "WARNING", "INFO"], said
    warnings = [message for level, message in said if level == "WARNING"]
    assert "did not load because of the store" in warnings[0] and "No such device or address" in warnings[0]
    assert "failed it again, for another reason" in warnings[1] and "Text file busy" in warnings[1]
    assert f"loaded; the store had failed it {len(repeated) + 1} time(s)" in said[-1][1]


def test_a_broken_folder_renamed_to_a_name_with_other_settings_is_loaded_once(repo, serve, caplog):
    """Defect (found by the soak): the move's new load read the broken files and failed; the rename then took the
    failed load for a model that had not loaded the moved files, and loaded them once more (the ERROR twice)."""
    write_model(repo.models_dir / "a", "a")
    config = repo.write_config("- name: a\n- name: b2\n  queue_capacity: 7\n", server_extra=SETTLE)
    server = serve(config)
    caplog.set_level(logging.INFO)
    (repo.models_dir / "a" / "model_inference.textproto").write_text("not a textproto {")  # (in place: same inode)
    wait_for(lambda: "failed" in index(server)["a"][1] or "textproto" in index(server)["a"][1])
    os.rename(repo.models_dir / "a", repo.models_dir / "b2")
    wait_for(lambda: "textproto" in index(server).get("b2", ("", ""))[1])
    time.sleep(1)  # (a second load would come within the settle time)
    loads = [r for r in caplog.records if r.levelno >= logging.ERROR and "'b2'" in r.getMessage()]
    assert len(loads) == 1, [r.getMessage() for r in loads]
    assert "holds files its model had not loaded" not in caplog.text
