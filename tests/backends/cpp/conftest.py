"""Fixtures of the cpp backend's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from nereid.backends.cpp import compiler


@pytest.fixture
def cache_files() -> Callable[[Path], list[str]]:
    """The names in a model folder's .cache/, the records beside its builds (``<build>.deps``) left out."""
    def names(folder: Path) -> list[str]:
        cache = folder / ".cache"
        found = sorted(p.name for p in cache.iterdir()) if cache.is_dir() else []
        return [name for name in found if not name.endswith(compiler.RECORD_SUFFIX)]
    return names
