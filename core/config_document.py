"""Reading YAML configuration documents (nereid.yaml, bundle manifests) with exact errors.

:func:`load_yaml` refuses duplicate keys (PyYAML silently keeps the last);
:class:`KeyedReader` checks values and fails with ``<file>: <key path>:
<problem>, got <value>``.
"""

from __future__ import annotations

import dataclasses
import datetime
import difflib
import io
import math
import re
from pathlib import Path
from typing import AbstractSet, Any, Iterable, Mapping

import yaml

from nereid.errors import ConfigError, cap_message


def same_values(a: Any, b: Any) -> bool:
    """Whether two configuration values are the same, their types included, however deep: YAML's ``1`` and
    ``true`` (or ``4`` and ``4.0``) are equal to Python, and an edit fixing ``warm_start: 1`` to ``true`` was
    taken for no change, its model left failing until a restart (the CLI read hunt). Mappings compare by their
    items (a layered runtime as a dict), sequences item by item, dataclasses field by field."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(same_values(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_values(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a) and not isinstance(a, type):
        return type(a) is type(b) and all(same_values(getattr(a, field.name), getattr(b, field.name))
                                          for field in dataclasses.fields(a) if field.compare)
    return type(a) is type(b) and a == b


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that refuses duplicate mapping keys, anchors, aliases and merge keys.

    Configuration needs neither anchors nor aliases, and aliases are how a 1 KB
    "billion laughs" document expands to gigabytes (one froze the server for
    8.6 s and grew it by 1.2 GB): they are refused before anything is built.
    """

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, f"aliases (*{event.anchor}) are not allowed",
                                              event.start_mark)
        if getattr(event, "anchor", None) is not None:
            raise yaml.composer.ComposerError(None, None, f"anchors (&{event.anchor}) are not allowed",
                                              event.start_mark)
        return super().compose_node(parent, index)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        # An explicit tag on a value its constructor cannot read (!!bool maybe, !!float "", !!timestamp x) made
        # PyYAML's constructors raise KeyError, IndexError or AttributeError: a traceback, naming no line.
        try:
            return super().construct_object(node, deep)
        except (yaml.YAMLError, RecursionError):
            raise
        except (ValueError, KeyError, IndexError, AttributeError, TypeError, OverflowError):
            # (The constructor's own error, "'NoneType' object has no attribute 'groupdict'", tells a reader nothing.)
            shown = cap_message(repr(node.value), 64) if isinstance(node, yaml.ScalarNode) else "this value"
            raise yaml.constructor.ConstructorError(
                None, None, f"{shown} cannot be read as {node.tag.rsplit(':', 1)[-1]}", node.start_mark) from None


def _construct_unique_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    for key_node, _ in node.value:
        # Refused as anchors and aliases are: a merge is of use only with an alias, and an inline one beside the
        # same key (<<: {a: 1} with a: 2), which YAML reads as a: 2, would otherwise be called a duplicate key.
        if key_node.tag == "tag:yaml.org,2002:merge":
            raise yaml.constructor.ConstructorError(None, None, "merge keys (<<) are not allowed: write the keys "
                                                    "out", key_node.start_mark)
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
        except TypeError:  # a list or a mapping as a key (``{[]: 1}``): PyYAML's own words for it
            raise yaml.constructor.ConstructorError("while constructing a mapping", node.start_mark,
                                                    "found unhashable key", key_node.start_mark) from None
        if duplicate:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep)


_MOST_DIGITS = 4300  # Python's own bound on the decimal digits int() converts


# What an integer may be written as, tagged !!int or not (int() alone also took "+-5", " 7 " and non-ASCII digits).
_INTEGER = re.compile(r"[-+]?(?:[0-9][0-9_]*|0o[0-7_]+|0x[0-9a-fA-F_]+|0b[01_]+)", re.ASCII)


def _construct_int(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    """A plain integer as YAML 1.2 reads it: ``010`` is ten, ``0o10`` eight (YAML 1.1 read ``010`` as eight)."""
    written = str(loader.construct_scalar(node))
    if not _INTEGER.fullmatch(written):
        raise yaml.constructor.ConstructorError(None, None, f"{cap_message(repr(written), 64)} is not an integer",
                                                node.start_mark)
    text = written.replace("_", "")
    sign = -1 if text.startswith("-") else 1
    digits = text.lstrip("+-")
    base = {"0o": 8, "0x": 16, "0b": 2}.get(digits[:2], 10)
    body = digits[2:] if base != 10 else digits
    if not body:  # (0x_: underscores alone)
        raise yaml.constructor.ConstructorError(None, None, f"{written!r} is not a number", node.start_mark)
    if len(body) > _MOST_DIGITS:  # no count or size is that long, in any base (Python bounds base 10 alone)
        raise yaml.constructor.ConstructorError(None, None, f"an integer of {len(body)} digits is too long",
                                                node.start_mark)
    return sign * int(body, base)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping)
_StrictLoader.add_constructor("tag:yaml.org,2002:int", _construct_int)
# Plain numbers as YAML 1.2 reads them, where PyYAML reads YAML 1.1: 010 is ten, not eight; 1:30 is text, not YAML
# 1.1's base 60 (a shutdown_grace_s of 1:30 was 90 s, without a word); an exponent without a dot (5e2, 1e300) is a
# float, not text. Quoted, each stays text, as a quoted "30" does. (Underscores as separators, 1_000, still read
# as YAML 1.1 reads them.)
_NUMBER_FIRST = list("-+.0123456789")
# A table of its own (the inherited one is every SafeLoader's, yaml.safe_load's included), without YAML 1.1's rules.
_StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers
            if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:int", re.compile(f"^(?:{_INTEGER.pattern})$", re.ASCII),
                                    list("-+0123456789"))
_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
    r"""^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?[0-9]+[eE][-+]?[0-9]+
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""", re.X), _NUMBER_FIRST)


def load_yaml(text: str, path: Path) -> Any:
    """Parse YAML text from ``path`` safely; ConfigError (with line and column) when it is not valid."""
    stream = io.StringIO(text)
    stream.name = str(path)  # PyYAML names the file in its line/column marks
    try:
        return yaml.load(stream, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as err:
        raise ConfigError(cap_message(f"{path}: not valid YAML: {err}")) from None
    except RecursionError:
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None
    except ValueError as err:  # a constructor's own failure, such as an integer of 100,000 digits
        raise ConfigError(cap_message(f"{path}: not valid YAML: {err}")) from None


def yaml_spelling(value: Any, depth: int = 0) -> str:
    """``value`` as an error message quotes it: the scalars a document spells ``true``, ``false`` and ``null`` as it
    spells them (not Python's ``True`` / ``None``), in lists and mappings too (``[true, null]``, where the README
    walkthrough found ``[True, None]``), anything else by its ``repr``; a few levels and items of a container are
    shown, the rest as ``...`` (a document's values can be deep and long)."""
    if value is True or value is False:
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (datetime.date, datetime.datetime)):
        return value.isoformat()
    if isinstance(value, (list, dict)):
        if depth >= _SPELLED_DEPTH:
            return "[...]" if isinstance(value, list) else "{...}"
        items = list(value.items() if isinstance(value, dict) else value)[:_SPELLED_ITEMS]
        shown = [f"{yaml_spelling(k, depth + 1)}: {yaml_spelling(v, depth + 1)}" for k, v in items] \
            if isinstance(value, dict) else [yaml_spelling(item, depth + 1) for item in items]
        more = ", ..." if len(value) > _SPELLED_ITEMS else ""
        return f"{{{', '.join(shown)}{more}}}" if isinstance(value, dict) else f"[{', '.join(shown)}{more}]"
    return repr(value)


def described(value: Any) -> str:
    """``value`` (a YAML document's) said by its kind and size, never its contents: ``a string of 241
    characters``, ``a list of 2 items``; a number, a boolean or null as written."""
    if isinstance(value, str):
        return f"a string of {len(value)} character{'s' if len(value) != 1 else ''}"
    if isinstance(value, (list, dict)):
        what, unit = ("a list", "item") if isinstance(value, list) else ("a mapping", "key")
        return f"{what} of {len(value)} {unit}{'s' if len(value) != 1 else ''}"
    if value is None or isinstance(value, (bool, int, float)):
        return yaml_spelling(value)
    return f"a value of type {type(value).__name__}"


_SPELLED_DEPTH = 4  # levels of a container an error message shows
_SPELLED_ITEMS = 32  # items of each


class KeyedReader:
    """Typed getters over a loaded document that fail with the file, the key path and the bad value.

    ``key`` arguments are full dotted key paths (``models[0].queue_capacity``);
    the getters read the path's last component from ``section``.
    """

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, key: str, problem: str, value: Any) -> None:
        """Raise ConfigError for ``key``."""
        where = f"{self.path}: {key}" if key else str(self.path)
        # The value is quoted, but cut short: a document's values can be megabytes long.
        raise ConfigError(cap_message(f"{where}: {problem}, got {cap_message(yaml_spelling(value), 512)}"))

    def mapping(self, raw: Any, key: str, allowed: AbstractSet[str],
                hints: Mapping[str, str] | None = None) -> dict[str, Any]:
        """``raw`` as a mapping whose keys are all in ``allowed``; an unknown key's refusal adds ``hints``' words
        for it (where it is written instead: another section, another program's name for it), or else the allowed
        key it is closest to (``(did you mean 'batching'?)``)."""
        if not isinstance(raw, dict):
            if not key:
                # Described, not quoted: a file that is no mapping at all is likely not the document it should be
                # (a key or a credentials file copied or linked in its place), and its quote was the whole file.
                where = f"{self.path}: top level"
                raise ConfigError(f"{where}: must be a mapping of keys to values, got {described(raw)}")
            self.fail(key, "must be a mapping", raw)
        for name in raw:
            if name not in allowed:
                # (A key YAML read as other than text is spelled as the document spells it: `yes:` as true.)
                shown = name if isinstance(name, str) else yaml_spelling(name)
                path = f"{key}.{shown}" if key else shown
                listed = ", ".join(sorted(allowed))
                self.fail(path, f"unknown key (allowed: {listed}){_key_hint(name, allowed, hints)}", raw[name])
        return raw

    def string(self, section: dict[str, Any], key: str, default: str) -> str:
        value = section.get(_last(key), default)
        if not isinstance(value, str):
            self.fail(key, f"must be a string{quoting_hint(value)}", value)
        return value

    def integer(self, section: dict[str, Any], key: str, default: int, *, minimum: int,
                maximum: tuple[int, str] | None = None) -> int:
        """An integer of at least ``minimum`` and, given ``maximum`` (the bound, why), at most its bound."""
        value = section.get(_last(key), default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, "must be an integer", value)
        if value < minimum:
            self.fail(key, f"must be >= {minimum}" if minimum != 1 else "must be > 0", value)
        self._at_most(key, value, value, maximum)
        return value

    def number(self, section: dict[str, Any], key: str, default: float, *, minimum: float,
               exclusive: bool = False, maximum: tuple[float, str] | None = None) -> float:
        """A finite number (an int or a float) of at least ``minimum`` (more than it with ``exclusive``) and,
        given ``maximum`` (the bound, why), at most its bound."""
        value = section.get(_last(key), default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, "must be a number", value)
        try:
            number = float(value)
        except OverflowError:  # an integer of hundreds of digits
            self.fail(key, "must be a finite number", value)
        # YAML spells NaN and infinity .nan and .inf; neither is a timeout or a delay (NaN compares
        # false with everything, so it would pass the minimum check below and break every later wait).
        if not math.isfinite(number):
            self.fail(key, "must be a finite number", value)
        if number < minimum or (exclusive and number == minimum):
            self.fail(key, f"must be {'>' if exclusive else '>='} {minimum}", value)
        self._at_most(key, number, value, maximum)
        return number

    def _at_most(self, key: str, number: float, value: Any, maximum: tuple[float, str] | None) -> None:
        # A value past what the waits, the wire or the OS take would be accepted here and then fail
        # every request (an overflowing timeout) or every ModelConfig call.
        if maximum is not None and number > maximum[0]:
            bound = maximum[0]
            self.fail(key, f"must be at most {int(bound) if bound == int(bound) else bound} ({maximum[1]})", value)


def quoting_hint(value: Any) -> str:
    """A message's advice (with its leading space; "" for none) on a scalar YAML read as other than text where text
    is due (``- name: no``, ``name: 1e5``): the value quoted only shows what it became (false, 100000.0), not what
    was written."""
    if isinstance(value, bool):
        return " (YAML reads an unquoted yes, no, on, off, true or false as a boolean: put the text in quotes)"
    if isinstance(value, (int, float)):
        return " (YAML reads an unquoted number as a number, 1e5 as 100000.0: put the text in quotes)"
    if isinstance(value, (datetime.date, datetime.datetime)):  # (- name: 2001-12-14; the config hunt)
        return " (YAML reads an unquoted 2001-12-14 as a date: put the text in quotes)"
    return ""


def _key_hint(name: Any, allowed: AbstractSet[str], hints: Mapping[str, str] | None) -> str:
    """What an unknown key ``name``'s refusal adds (with its leading space; "" for nothing): ``hints``' words for it,
    or the key of ``allowed`` it is likely a misspelling of."""
    if not isinstance(name, str):
        return ""
    if hints and name in hints:
        return f" ({hints[name]})"
    close = closest_key(name, allowed)
    return f" (did you mean '{close}'?)" if close else ""


def closest_key(name: str, allowed: Iterable[str]) -> str | None:
    """The key of ``allowed`` that ``name`` is likely a misspelling of; None when none is close."""
    allowed = sorted(allowed)
    # get_close_matches' cutoff (a ratio of 0.6) is out of reach for a key over 7/3 times as long as the longest
    # allowed one: one over 3 times is not compared at all, which would only cost (a key can be megabytes long).
    if len(name) > 3 * max(map(len, allowed), default=0):
        return None
    close = difflib.get_close_matches(name, allowed, n=1)
    return close[0] if close else None


def _last(key: str) -> str:
    return key.rsplit(".", 1)[-1]
