"""The backend protocols' own checks (core/backend.py)."""

from __future__ import annotations

import pytest

from nereid.backend import what_it_calls
from nereid.errors import ConfigError


class Caller:
    """A model that calls others, answering what it is given."""

    def __init__(self, executions: object, names: object) -> None:
        self.executions, self.names = executions, names

    def concurrent_executions(self) -> object:
        return self.executions

    def dependencies(self) -> object:
        return self.names


@pytest.mark.parametrize("executions, names, problem", [
    (0, (), "concurrent_executions() returned '0' (int), expected an int from 1 to 2147483647"),
    ("2", (), "concurrent_executions() returned '2' (str), expected an int from 1 to 2147483647"),
    (True, (), "concurrent_executions() returned 'True' (bool), expected an int from 1 to 2147483647"),
    # (The plugin hunt: 10**12 loaded READY, and gRPC's ModelConfig, an int32 count, failed on it.)
    (10 ** 12, (), "concurrent_executions() returned '1000000000000' (int), expected an int from 1 to 2147483647"),
    (1, None, "dependencies() returned 'None' (NoneType), expected a tuple of model names"),
    (1, "ab", "dependencies() returned 'ab' (str), expected a tuple of model names"),
    (1, ("a", 2), "dependencies() returned \"('a', 2)\" (tuple), expected a tuple of model names"),
])
def test_what_a_model_calls_is_checked_as_the_server_and_nereid_check_ask_it(executions, names, problem) -> None:
    """Found by a bug hunt: 0 or "2" passed nereid check and failed the server's load with a bare TypeError; None
    failed the check while the server served it READY whatever its dependencies; "ab" was models 'a' and 'b'."""
    with pytest.raises(ConfigError) as refused:
        what_it_calls("m", Caller(executions, names))
    assert str(refused.value) == f"model 'm': its backend's {problem}"
    assert what_it_calls("m", Caller(2, ["a", "b"])) == (2, ("a", "b"))
