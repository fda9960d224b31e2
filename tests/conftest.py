"""Fixtures: an empty model repository in tmp_path, servers that stop after the test, zombie checks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from support import ModelRepo, RunningServer, zombie_children


@pytest.fixture
def repo(tmp_path: Path) -> ModelRepo:
    """An empty model repository in tmp_path."""
    return ModelRepo(tmp_path)


@pytest.fixture
def serve() -> Callable[..., RunningServer]:
    """Start a server from a nereid.yaml path; every server started is stopped after the test."""
    started: list[RunningServer] = []

    def start(config: Path, **kwargs: Any) -> RunningServer:
        server = RunningServer(config, **kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def no_zombies():
    """Fails the test if it leaves unreaped child processes behind."""
    yield
    assert zombie_children() == []
