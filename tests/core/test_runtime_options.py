"""A backend's runtime: options read through RuntimeOptions: the refusal of an unknown one."""

from __future__ import annotations

import pytest

from nereid.errors import ConfigError
from nereid.runtime_options import RuntimeOptions


def refusal(runtime: dict, backend: str = "python", allowed: tuple[str, ...] = ("preload", "warm_start")) -> str:
    with pytest.raises(ConfigError) as caught:
        RuntimeOptions(runtime, "nereid.yaml: models[0]", backend, allowed)
    return str(caught.value)


@pytest.mark.parametrize(("key", "place"), [("backend", "a model entry's key"), ("instances", "a model entry's key"),
                                            ("max_queue_delay_ms", "a model's batching: setting"),
                                            ("watch", "a server: setting")])
def test_a_key_nereid_yaml_takes_elsewhere_is_told_where(key, place) -> None:
    """Carried from the yaml hunt: `runtime: {backend: python}` was refused with the backend's options alone."""
    assert refusal({key: 1}) == (f"nereid.yaml: models[0].runtime.{key}: unknown option of the python backend "
                                 f"(allowed: preload, warm_start; {key} is {place}, not a runtime: option), got 1")


def test_another_unknown_key_gets_the_options_and_the_likely_one() -> None:
    assert refusal({"warmstart": True}) == ("nereid.yaml: models[0].runtime.warmstart: unknown option of the python "
                                            "backend (allowed: preload, warm_start; did you mean 'warm_start'?), got "
                                            "true")
    assert refusal({"zzz": True}) == ("nereid.yaml: models[0].runtime.zzz: unknown option of the python backend "
                                      "(allowed: preload, warm_start), got true")
    assert refusal({"backend": "x"}, "cpp", ()) == (
        "nereid.yaml: models[0].runtime.backend: unknown option of the cpp backend (it has no runtime options; "
        "backend is a model entry's key, not a runtime: option), got 'x'")
    # (A key YAML reads as a number raised AttributeError out of the load: "model 'm': AttributeError: 'int' object
    # has no attribute 'partition' (raised by the load() of built-in backend 'python')".)
    assert refusal({1: 2}) == ("nereid.yaml: models[0].runtime.1: unknown option of the python backend (allowed: "
                               "preload, warm_start), got 2")


def test_a_number_key_of_a_backends_defaults_is_blamed_on_the_defaults() -> None:
    from nereid.runtime_options import LayeredRuntime

    with pytest.raises(ConfigError) as caught:
        RuntimeOptions(LayeredRuntime({}, {1: 2}, "nereid.yaml: backends.python"), "nereid.yaml: models[0]",
                       "python", ("warm_start",))
    assert str(caught.value) == ("nereid.yaml: backends.python.1: unknown option of the python backend (allowed: "
                                 "warm_start), got 2")
