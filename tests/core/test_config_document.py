"""nereid.config_document: nereid.yaml's YAML reading (plain numbers as YAML 1.2 reads them)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from nereid.config_document import KeyedReader, load_yaml
from nereid.errors import ConfigError
from nereid.settings import load_settings


@pytest.mark.parametrize("text, value", [
    ("010", 10), ("08", 8), ("0o10", 8), ("0x1F", 31), ("-0x10", -16), ("0b101", 5), ("1_000", 1000), ("+4", 4),
    ("5e2", 500.0), ("1.0e+300", 1e300), ("2.5e-3", 0.0025), (".5", 0.5), ("1.", 1.0), ("-.inf", -math.inf),
    ("1:30", "1:30"), ("1:00:00", "1:00:00"), ("'010'", "010"), ("1e5x", "1e5x"),
])
def test_plain_numbers_read_as_yaml_1_2_reads_them(text: str, value: object) -> None:
    """Defect (found by a bug hunt): PyYAML reads YAML 1.1, where 010 is eight and 1:30 is ninety (base 60):
    `instances: 010` gave 8 instances and `shutdown_grace_s: 1:30` a 90 s grace, without a word."""
    read = load_yaml(f"a: {text}\n", Path("x.yaml"))["a"]
    assert read == value and type(read) is type(value)


def test_nan_still_reads_as_a_float_for_the_settings_to_refuse() -> None:
    assert math.isnan(load_yaml("a: .nan\n", Path("x.yaml"))["a"])


def test_a_base_60_value_is_refused_as_a_number_would_be_and_a_leading_zero_is_decimal(tmp_path: Path) -> None:
    (tmp_path / "ml-backends" / "a").mkdir(parents=True)
    config = tmp_path / "nereid.yaml"
    config.write_text("server:\n  shutdown_grace_s: 1:30\n")
    with pytest.raises(ConfigError, match=r"server.shutdown_grace_s: must be a number, got '1:30'"):
        load_settings(config)
    config.write_text("models:\n  - name: a\n    instances: 010\n")
    assert load_settings(config).models[0].instances == 10


def test_yaml_safe_load_elsewhere_keeps_its_own_rules() -> None:
    import yaml

    load_yaml("a: 1\n", Path("x.yaml"))
    assert yaml.safe_load("a: 010\nb: 7\n") == {"a": 8, "b": 7}  # YAML 1.1, as PyYAML reads it


def test_an_integer_too_long_to_read_is_named_with_its_line() -> None:
    """Found by a bug hunt: 5,000 digits were refused with Python's advice to call sys.set_int_max_str_digits()."""
    with pytest.raises(ConfigError, match=r"x.yaml: not valid YAML: an integer of 5000 digits is too long\s+in "
                                          r"\"x.yaml\", line 2"):
        load_yaml("models:\n  - {name: a, queue_capacity: " + "9" * 5000 + "}\n", Path("x.yaml"))


def test_an_empty_server_section_is_no_server_keys_and_an_empty_path_is_refused(tmp_path: Path) -> None:
    """Found by a bug hunt: `server:` with its keys commented out was refused ("must be a mapping, got None"),
    where an empty `models:` is taken; and `ml_backends_path: ''` served nereid.yaml's own folder."""
    (tmp_path / "ml-backends").mkdir()
    config = tmp_path / "nereid.yaml"
    config.write_text("server:\n  # bind_addr: '[::1]:50051'\nmodels:\n")
    assert load_settings(config).server.ml_backends_path == tmp_path / "ml-backends"
    config.write_text("server:\n  ml_backends_path: ''\n")
    with pytest.raises(ConfigError, match="server.ml_backends_path: must name a folder or a bucket, not be empty"):
        load_settings(config)


@pytest.mark.parametrize("text, problem", [("0x" + "f" * 5000, "an integer of 5000 digits is too long"),
                                           ("0x_", "'0x_' is not a number")])
def test_a_hexadecimal_integer_too_long_or_empty_is_refused_too(text: str, problem: str) -> None:
    """Review: Python bounds only decimal conversions; 5,000 hex digits parsed, then a refusal crashed on its
    repr (a traceback from nereid check)."""
    with pytest.raises(ConfigError, match=problem):
        load_yaml(f"a: {text}\n", Path("x.yaml"))


@pytest.mark.parametrize("text, problem", [
    ("!!bool maybe", "'maybe' cannot be read as bool"),
    ('!!float ""', "'' cannot be read as float"),
    ("!!timestamp x", "'x' cannot be read as timestamp"),
    ("[1, !!bool maybe]", "'maybe' cannot be read as bool"),
])
def test_an_explicit_tag_on_a_value_it_cannot_read_is_refused_with_its_line(text: str, problem: str) -> None:
    """Found by a bug hunt: PyYAML's constructors raised KeyError, IndexError or AttributeError, which `nereid
    check` and `nereid serve` printed as a traceback (exit 1, not 2), naming no line."""
    with pytest.raises(ConfigError, match=rf"x.yaml: not valid YAML: {problem}\s+in \"x.yaml\", line 2"):
        load_yaml(f"server: {{}}\na: {text}\n", Path("x.yaml"))


@pytest.mark.parametrize("text", ['!!int "+-5"', '!!int " 7 "', '!!int "٣"', '!!int "1e3"'])
def test_a_tagged_integer_is_read_as_a_plain_one_would_be(text: str) -> None:
    """Found by a bug hunt: int() took "+-5" as 5, and " 7 " or an Arabic-Indic digit as 7 and 3."""
    with pytest.raises(ConfigError, match="is not an integer"):
        load_yaml(f"a: {text}\n", Path("x.yaml"))
    assert load_yaml('a: !!int "-0x1F"\nb: !!int "1_000"\n', Path("x.yaml")) == {"a": -31, "b": 1000}


def refused_key(raw: dict, allowed: set[str], hints: dict[str, str] | None = None) -> str:
    """KeyedReader.mapping's refusal of ``raw`` (a manifest's batching: section) for its unknown key."""
    with pytest.raises(ConfigError) as caught:
        KeyedReader(Path("x.yaml")).mapping(raw, "batching", allowed, hints)
    return str(caught.value)


def test_an_unknown_key_is_told_the_allowed_key_it_is_closest_to() -> None:
    """Found by a bug hunt: a misspelt key was refused with the allowed keys alone, in nereid.yaml and manifests."""
    message = refused_key({"max_bacth_size": 8}, {"max_batch_size", "enabled"})
    assert message == ("x.yaml: batching.max_bacth_size: unknown key (allowed: enabled, max_batch_size) (did you "
                       "mean 'max_batch_size'?), got 8")
    assert refused_key({"zzz": 1}, {"max_batch_size"}) == ("x.yaml: batching.zzz: unknown key (allowed: "
                                                           "max_batch_size), got 1")


def test_a_hint_for_an_unknown_key_comes_before_the_closest_allowed_one() -> None:
    message = refused_key({"preferred_batch_size": [4]}, {"preferred_batch_sizes"},
                          {"preferred_batch_size": "Triton's name"})
    assert message.endswith("(allowed: preferred_batch_sizes) (Triton's name), got [4]"), message


@pytest.mark.parametrize("key", [True, None, 7])
def test_a_key_yaml_read_as_no_text_is_told_no_guess(key: object) -> None:
    # (get_close_matches takes text only: `yes:` read as true would have raised a TypeError.)
    message = refused_key({key: 1}, {"yes", "true", "null", "7"}, {"True": "no hint for text"})
    assert message.endswith("unknown key (allowed: 7, null, true, yes), got 1"), message

