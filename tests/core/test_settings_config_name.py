"""Messages name the configuration file the server was started with (``Settings.config_name``).

``nereid serve --config /etc/nereid/prod.yaml`` is how operators run nereid in containers (a ConfigMap mounted
under another name). Found by the deployment review: a mistake at a key named the file's path, but every other
message said "nereid.yaml" whatever the file was called ("not listed in nereid.yaml", "set backend: in
nereid.yaml", "model 'b' is no longer listed in nereid.yaml; unloading it"), a file the operator does not have.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

import toy_backends
from nereid.cli import main
from nereid.plugins import make_plugin_manager
from support import ECHO_MAIN, RunningServer, expect_grpc_error, wait_until
from toy_backends import write_toy

# What a working watcher does within a second or so; generous for a loaded CI machine.
PROMPT_S = 30


def manager():
    """The built-in backends and the toy backend."""
    return make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends,))


def prod_yaml(repo, models_yaml: str, server_extra: str = "") -> Path:
    """The repository's configuration, written as ``prod.yaml`` (no nereid.yaml beside it)."""
    written = repo.write_config(models_yaml, server_extra=server_extra)
    return written.rename(written.with_name("prod.yaml"))


def index(server: RunningServer) -> dict[str, tuple[str, str]]:
    return {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}


def test_check_names_the_file_given_with_config(repo, capsys) -> None:
    write_toy(repo.models_dir, "steady")
    write_toy(repo.models_dir, "extra")  # not listed
    (repo.models_dir / "unclaimed").mkdir()  # no backend's files
    (repo.models_dir / "unclaimed" / "notes.txt").write_text("")
    (repo.models_dir / "lonely").mkdir()  # a textproto alone: the cxx backend's hint to declare it (review hunt)
    (repo.models_dir / "lonely" / "model_inference.textproto").write_text("input_shape: [4]\noutput_shape: [4]\n")
    write_toy(repo.models_dir, "misspelt")
    outside = repo.root / "outside.bin"
    outside.write_text("")
    (write_toy(repo.models_dir, "linked") / "weights.bin").symlink_to(outside)
    config = prod_yaml(repo, "- name: steady\n- name: unclaimed\n- name: misspelt\n  backend: toyy\n"
                             "- name: linked\n- name: lonely\n")
    assert main(["check", "--config", str(config)], extra_plugins=(toy_backends,)) == 1
    out = capsys.readouterr().out
    lines = {line.split(":", 1)[0]: line for line in out.splitlines()}
    assert lines["extra"].startswith("extra: OK backend=toy") and lines["extra"].endswith("(not listed in prod.yaml)")
    assert "or set backend: in prod.yaml" in lines["unclaimed"], out
    assert "backend 'toyy' (from prod.yaml) is not installed (did you mean 'toy'?)" in lines["misspelt"], out
    assert "set server.follow_symlinks: true in prod.yaml to allow it" in lines["linked"], out
    assert "declare it in prod.yaml with backend: cxx" in lines["lonely"], out
    assert "nereid.yaml" not in out, out


def test_a_server_names_the_file_at_start_in_its_index_and_in_load_failures(repo, serve, caplog) -> None:
    caplog.set_level(logging.INFO, "nereid.server")
    write_toy(repo.models_dir, "steady")
    write_toy(repo.models_dir, "extra")  # not listed
    (repo.models_dir / "unclaimed").mkdir()  # no backend's files: its load fails
    (repo.models_dir / "unclaimed" / "notes.txt").write_text("")
    server = serve(prod_yaml(repo, "- name: steady\n"), manager=manager())
    assert "not listed in prod.yaml, so not loaded: 'extra', 'unclaimed' (RepositoryModelLoad loads one)" \
        in caplog.messages
    # RepositoryIndex's reason, with how to load it (which was left off: the data plane looked for "nereid.yaml").
    assert index(server)["extra"] == ("UNAVAILABLE", "not listed in prod.yaml; load it with RepositoryModelLoad")
    expect_grpc_error("INTERNAL", lambda: server.client.load_model("unclaimed"), "or set backend: in prod.yaml")
    expect_grpc_error("INVALID_ARGUMENT", lambda: server.client.load_model("steady", config="{}"),
                      "nereid loads a model only from its folder in ml_backends_path and prod.yaml")
    # (A full queue's answer names it too: see test_scheduler.py.)
    assert server.server.repository.entry("steady").loaded.scheduler.config_name == "prod.yaml"
    assert not [message for message in caplog.messages if "nereid.yaml" in message], caplog.messages


def test_an_edit_the_watcher_applies_names_the_file(repo, serve, caplog) -> None:
    caplog.set_level(logging.INFO)
    for name in ("kept", "dropped"):
        write_toy(repo.models_dir, name)
    config = prod_yaml(repo, "- name: kept\n- name: dropped\n", server_extra="  watch: true\n  watch_settle_ms: 50\n")
    server = serve(config, manager=manager())
    assert index(server) == {"kept": ("READY", ""), "dropped": ("READY", "")}
    config.write_text(config.read_text().replace("  - name: dropped\n", "")
                      .replace("  - name: kept\n", "  - name: kept\n    queue_capacity: 7\n"))
    assert wait_until(lambda: index(server)["dropped"][0] == "UNAVAILABLE"
                      and server.server.repository.entry("kept").loaded.scheduler.capacity == 7, PROMPT_S)
    assert "model 'dropped' is no longer listed in prod.yaml; unloading it" in caplog.messages
    assert "model 'kept': its settings in prod.yaml changed; reloading it" in caplog.messages
    assert index(server)["dropped"] == ("UNAVAILABLE", "not listed in prod.yaml; load it with RepositoryModelLoad")
    assert not [message for message in caplog.messages if "nereid.yaml" in message], caplog.messages


def test_a_model_s_run_past_its_timeout_names_the_file_that_sets_it(repo, serve) -> None:
    """Sent to the client (the python backend's run, as ModelContext.config_name gives it the file's name)."""
    repo.python("napper", main="import time\ntime.sleep(30)\n" + ECHO_MAIN)
    server = serve(prod_yaml(repo, "- name: napper\n  timeout_s: 1\n"))
    request = triton.InferInput("input", [1, 4], "FP32")
    request.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(InferenceServerException, match=r"model 'napper' timed out after 1 s \(the model's timeout_s "
                                                       r"in prod\.yaml, default 60 s\); its process group was killed"):
        server.client.infer("napper", [request])
