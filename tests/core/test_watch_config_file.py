"""Dynamic mode: what is put in nereid.yaml's place is read as the start-up reads it (a regular file, 4 MiB at most),
and the file a symlinked nereid.yaml leads to is followed.

Found by a bug hunt: a FIFO moved over nereid.yaml blocked the watcher in open() for good (no folder loaded
afterwards, and the process never exited on SIGTERM: the blocked thread is joined at exit); a 45 MB file was
parsed whole for a minute and a half, its bytes kept; a symlink to /dev/zero would have been read without end.
"""

from __future__ import annotations

import hashlib
import logging
import os
import signal
import time
from pathlib import Path

import pytest

import nereid.settings
import nereid.watch
from nereid.settings import MAX_CONFIG_BYTES
from support import nereid_serve, textproto_single, wait_until

SETTLE = "  watch: true\n  watch_settle_ms: 100\n"
REPORT = textproto_single("BYTES", input_shape="[1]", output_shape="[1]", max_batch_size=8)
MAIN = """
import sys
sys.stdin.buffer.read()
"""
# What a test waits for that a working watcher does within a second or so.
PROMPT_S = 5


def write_model(folder: Path) -> None:
    folder.mkdir()
    (folder / "model_inference.textproto").write_text(REPORT)
    (folder / "main.py").write_text(MAIN)


def state(server, name: str) -> str:
    return {m.name: m.state for m in server.client.get_model_repository_index().models}.get(name, "")


def refusals(caplog, text: str) -> list[logging.LogRecord]:
    """The watcher's refusals of nereid.yaml whose message holds ``text``."""
    return [r for r in caplog.records
            if text in r.getMessage() and "keeping the running configuration" in r.getMessage()]


def replace_file(path: Path, text: str) -> None:
    """Write ``path`` as an editor does: a temporary file renamed over it."""
    temporary = path.with_name(f".{path.name}.new")
    temporary.write_text(text)
    os.rename(temporary, path)


def fifo_over(config: Path) -> Path:
    """``mkfifo .fifo && mv .fifo nereid.yaml``; returns a second name of the FIFO, for :func:`let_readers_go`."""
    fifo, held = config.with_name(".fifo"), config.with_name(".fifo-held")
    os.mkfifo(fifo)
    os.link(fifo, held)
    os.rename(fifo, config)
    return held


def blocked_readers(held: Path) -> bool:
    """Whether a reader has the FIFO open (one that waits in open() for a writer, as the watcher did), and let it
    go: without this a test of a watcher that blocks would hang at exit, which joins that thread, and never fail."""
    try:
        fd = os.open(held, os.O_WRONLY | os.O_NONBLOCK)
    except OSError:  # ENXIO: no reader
        return False
    os.close(fd)
    return True


def test_a_fifo_put_in_nereid_yaml_is_refused_once_and_the_watch_goes_on(repo, serve, caplog):
    caplog.set_level(logging.INFO)
    write_model(repo.models_dir / "first")
    config = repo.write_config("- name: first\n", server_extra=SETTLE)
    text = config.read_text()
    server = serve(config)
    held = fifo_over(config)
    try:
        write_model(repo.models_dir / "later")  # dropped in after the FIFO: still loads
        assert wait_until(lambda: state(server, "later") == "READY", PROMPT_S)
        assert wait_until(lambda: refusals(caplog, "is a FIFO"), PROMPT_S)
        write_model(repo.models_dir / "third")  # a later scan looks at the FIFO again: no news, said once
        assert wait_until(lambda: state(server, "third") == "READY", PROMPT_S)
        assert [(r.levelno, r.getMessage()) for r in refusals(caplog, "is a FIFO")] == [
            (logging.ERROR, f"dynamic repository: {config}: is a FIFO, not a regular file; keeping the running "
                            "configuration")]
        # A regular nereid.yaml put back is applied, and folders are still followed.
        replace_file(config, text.replace("  - name: first\n", "  - name: first\n    queue_capacity: 7\n"))
        assert wait_until(lambda: server.server.repository.entry("first").loaded.scheduler.capacity == 7, PROMPT_S)
        assert "dynamic repository: nereid.yaml changed; applying it (it is valid again)" in caplog.messages
        write_model(repo.models_dir / "last")
        assert wait_until(lambda: state(server, "last") == "READY", PROMPT_S)
    finally:
        assert not blocked_readers(held), "a thread waits in open() on the FIFO"


@pytest.mark.parametrize("emptied", [b"", b"\n\n", b"# the configuration follows\n", b"\xef\xbb\xbf  \n"])
def test_a_nereid_yaml_emptied_while_serving_is_refused_and_the_models_serve_on(repo, serve, caplog, emptied):
    """The hunt of live edits: a file truncated, its writer pausing past the settle time, was applied as empty:
    every folder loaded (a broken one too), every listed model reloaded with default settings."""
    caplog.set_level(logging.INFO)
    write_model(repo.models_dir / "first")
    write_model(repo.models_dir / "unlisted")
    config = repo.write_config("- name: first\n  queue_capacity: 7\n", server_extra=SETTLE)
    text = config.read_text()
    server = serve(config)
    config.write_bytes(emptied)
    assert wait_until(lambda: refusals(caplog, "holds nothing (emptied, its writing still under way?)"), PROMPT_S)
    assert state(server, "unlisted") == "UNAVAILABLE"
    assert server.server.repository.entry("first").loaded.scheduler.capacity == 7
    config.write_text(text.replace("queue_capacity: 7", "queue_capacity: 5"))  # (its writing done)
    assert wait_until(lambda: server.server.repository.entry("first").loaded.scheduler.capacity == 5, PROMPT_S)


def test_a_server_with_a_fifo_in_nereid_yaml_exits_promptly_on_sigterm(repo):
    write_model(repo.models_dir / "first")
    config = repo.write_config(server_extra=SETTLE)
    with nereid_serve(config) as (process, client):
        held = fifo_over(config)
        try:
            write_model(repo.models_dir / "later")
            assert wait_until(lambda: client.is_model_ready("later"), PROMPT_S)
            process.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert wait_until(lambda: process.poll() is not None, PROMPT_S), "still running after SIGTERM"
        finally:
            blocked_readers(held)  # (a process left blocked is killed by nereid_serve)
        assert process.returncode == 0 and time.monotonic() - signalled < PROMPT_S
        output = process.stdout.read()
    assert f"{config}: is a FIFO, not a regular file; keeping the running configuration" in output


def test_a_huge_file_put_in_nereid_yaml_is_refused_unparsed_and_the_watch_goes_on(repo, serve, caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    parsed: list[int] = []  # the length of each nereid.yaml text parsed (the watcher's, the start's)
    load_yaml = nereid.settings.load_yaml
    monkeypatch.setattr(nereid.settings, "load_yaml",
                        lambda text, path: parsed.append(len(text)) or load_yaml(text, path))
    write_model(repo.models_dir / "first")
    config = repo.write_config("- name: first\n", server_extra=SETTLE)
    text = config.read_text()
    server = serve(config)
    # A log redirected to the wrong name: 12 MiB of valid YAML (comments), three times the limit.
    big = config.with_name(".big")
    line = "# " + "." * 61 + "\n"
    big.write_text(line * (3 * MAX_CONFIG_BYTES // len(line)))
    size = big.stat().st_size
    os.rename(big, config)
    write_model(repo.models_dir / "later")  # a folder change while it settles (read ahead: was parsed whole)
    assert wait_until(lambda: state(server, "later") == "READY", PROMPT_S)
    assert wait_until(lambda: refusals(caplog, "byte limit"), PROMPT_S)
    assert [r.getMessage() for r in refusals(caplog, "byte limit")] == [
        f"dynamic repository: {config}: is {size} bytes, more than the {MAX_CONFIG_BYTES}-byte limit for this file; "
        "keeping the running configuration"]
    assert not [length for length in parsed if length > MAX_CONFIG_BYTES]
    replace_file(config, text.replace("  - name: first\n", "  - name: first\n    queue_capacity: 7\n"))
    assert wait_until(lambda: server.server.repository.entry("first").loaded.scheduler.capacity == 7, PROMPT_S)
    write_model(repo.models_dir / "last")
    assert wait_until(lambda: state(server, "last") == "READY", PROMPT_S)


@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "huge", "missing"])
def test_a_look_at_nereid_yaml_reads_only_a_regular_file_within_the_limit(tmp_path, kind):
    path = tmp_path / "nereid.yaml"
    expected = {"fifo": f"{path}: is a FIFO, not a regular file",
                "/dev/zero": f"{path}: is a character device, not a regular file",
                "huge": f"{path}: is {MAX_CONFIG_BYTES + 1} bytes, more than the {MAX_CONFIG_BYTES}-byte limit for "
                        "this file",
                "missing": f"{path}: cannot read: No such file or directory"}[kind]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")
    elif kind == "huge":
        with open(path, "wb") as out:
            out.truncate(MAX_CONFIG_BYTES + 1)
    look = nereid.watch.look_at_config(path)  # (returns at once: nothing waited on, nothing read)
    assert (look.refusal, look.data) == (expected, None)
    assert look == nereid.watch.look_at_config(path)  # the same refusal looks the same: no change to settle


def test_a_look_at_nereid_yaml_keeps_its_bytes_and_tells_contents_apart(tmp_path):
    path = tmp_path / "nereid.yaml"
    path.write_bytes(b"models: []\n")
    look = nereid.watch.look_at_config(path)
    assert (look.data, look.refusal) == (b"models: []\n", None)
    assert look.digest == hashlib.sha256(b"models: []\n").hexdigest()  # (all that is kept once it is applied)
    path.write_bytes(b"models: [] \n")
    assert nereid.watch.look_at_config(path) != look


# A symlinked nereid.yaml, as a deployment keeps one: (the link, what it leads to, what it is re-pointed to).
LINKED = {"to another folder": ("etc/nereid.yaml", "../real/nereid.yaml", "../next/nereid.yaml"),
          "to a file beside it": ("nereid.yaml", "nereid.prod.yaml", "nereid.next.yaml")}


def with_capacity(text: str, capacity: int) -> str:
    """nereid.yaml's ``text`` with model first's queue_capacity set."""
    return text.replace("  - name: first\n", f"  - name: first\n    queue_capacity: {capacity}\n")


@pytest.mark.parametrize("layout", list(LINKED))
def test_an_edit_in_place_of_the_file_a_symlinked_nereid_yaml_leads_to_is_applied(repo, serve, caplog, layout):
    """Defect (a bug hunt): with nereid.yaml a symlink, an edit in place of the file it leads to (echo >>)
    was never applied, nor after a ``touch`` of nereid.yaml (which follows the link): the watch saw only the
    folders of nereid.yaml and of the links on its way. A link re-pointed leads the watch to its new target."""
    caplog.set_level(logging.INFO, logger="nereid.watch")
    write_model(repo.models_dir / "first")
    text = repo.write_config("- name: first\n", server_extra=SETTLE).read_text().replace(
        'ml_backends_path: "ml-backends"', f'ml_backends_path: "{repo.models_dir}"')
    (repo.root / "nereid.yaml").unlink()
    name, first, second = LINKED[layout]
    link = repo.root / name
    old, new = link.parent / first, link.parent / second
    for target, capacity in ((old, 5), (new, 9)):
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(with_capacity(text, capacity))
    link.symlink_to(first)
    server = serve(link)

    def capacity() -> int:
        return server.server.repository.entry("first").loaded.scheduler.capacity
    assert capacity() == 5
    old.write_text(with_capacity(text, 7))  # in place: the same file, no name changed
    assert wait_until(lambda: capacity() == 7, PROMPT_S)
    temporary = link.with_name(".nereid.yaml.new")
    temporary.symlink_to(second)
    os.rename(temporary, link)  # ln -sfn's atomic form: the link re-pointed
    assert wait_until(lambda: capacity() == 9, PROMPT_S)
    old.write_text(with_capacity(text, 11))  # no longer what nereid.yaml is
    new.write_text(with_capacity(text, 13))
    assert wait_until(lambda: capacity() == 13, PROMPT_S)
    applied = [m for m in caplog.messages if m.startswith("dynamic repository: nereid.yaml changed; applying it")]
    assert len(applied) == 3, applied  # 7, 9 and 13: never the old target's 11
