"""The python backend's runtime options (backends/python/options.py): each mistake named where it is."""

from __future__ import annotations

import pytest

from nereid.backends.python.options import PythonOptions, parse_options
from nereid.errors import ConfigError


def test_the_defaults_and_a_preload_list() -> None:
    assert parse_options({}, "nereid.yaml: models[0]") == PythonOptions(True, ())
    assert parse_options({"warm_start": False, "preload": ["numpy", "sklearn.linear_model"]}, "f: models[0]") == \
        PythonOptions(False, ("numpy", "sklearn.linear_model"))


@pytest.mark.parametrize("preload, key, value", [
    ("torch", "preload", "'torch'"),
    (["numpy", "os; import sys"], "preload[1]", "'os; import sys'"),
    (["", "numpy"], "preload[0]", "''"),
    (["numpy", "../x"], "preload[1]", "'../x'"),
    (["os\n"], "preload[0]", "'os\\n'"),  # (passed the check, then turned warm start off: the config hunt)
    (["numpy", 3], "preload[1]", "3"),
])
def test_a_bad_preload_entry_is_named_by_its_index(preload, key: str, value: str) -> None:
    """Found by a bug hunt: a bad entry was refused as the whole list, naming none of its items."""
    with pytest.raises(ConfigError) as caught:
        parse_options({"preload": preload}, "f: models[0]")
    assert str(caught.value).startswith(f"f: models[0].runtime.{key}: must be ")
    assert str(caught.value).endswith(f", got {value}")


def test_a_preload_item_yaml_reads_as_a_boolean_is_told_to_be_quoted() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_options({"preload": ["numpy", False]}, "f: models[0]")
    assert str(caught.value) == ("f: models[0].runtime.preload[1]: must be a module name such as numpy or "
                                 "sklearn.linear_model (YAML reads an unquoted yes, no, on, off, true or false as a "
                                 "boolean: put the text in quotes), got false")
