"""The cxx backend's ``runtime:`` options from nereid.yaml, checked once at load.

```yaml
models:
  - name: my_model
    backend: cxx
    runtime:
      library: build/libmy_model.so            # a shared library, or:
      # sources: [ml-backends/my_model/my_model.cpp]   # compiled at load into <model>/.cache/
```

Exactly one of ``library`` and ``sources``: they are alternatives, so a
model's own one replaces the other inherited from ``backends: {cxx: ...}``.
Paths are absolute, relative to
the nereid.yaml that lists the model, or start with ``$MODEL_FOLDER/``: the
model's own folder, wherever it is (a bucket's model runs from its local
mirror, whose path nereid.yaml cannot know).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from nereid.config_document import quoting_hint
from nereid.errors import ConfigError
from nereid.runtime_options import RuntimeOptions
from nereid.settings import DEFAULT_CONFIG_NAME, beside_config

ALLOWED_KEYS = ("library", "sources")
MODEL_FOLDER = "$MODEL_FOLDER"

# ModelContext.settings_origin of a listed model: "<nereid.yaml path>: models[<index>]".
_LISTED_ORIGIN = re.compile(r"^(?P<file>.+): models\[\d+\]$", re.S)


@dataclass(frozen=True)
class CxxOptions:
    """Parsed ``runtime:`` options: a prebuilt ``library``, or ``sources`` to build one from."""

    library: Path | None = None
    sources: tuple[Path, ...] = ()


def config_file(origin: str) -> Path | None:
    """The nereid.yaml named by a settings origin, or None if it names none.

    The core passes where a model's settings came from only as text; a listed
    model's origin starts with the file's path (relative to the working directory
    the server started in, like every path nereid.yaml itself resolves).
    """
    match = _LISTED_ORIGIN.match(origin)
    return Path(match.group("file")) if match else None


def parse_options(model: str, runtime: Mapping[str, Any], origin: str, folder: Path | None = None,
                  config_name: str = DEFAULT_CONFIG_NAME) -> CxxOptions:
    """Check ``runtime``; ConfigError names the model, ``<origin>.runtime.<key>`` and the value.

    ``folder`` (the model's folder) is what ``$MODEL_FOLDER/`` at the start of a path stands for. ``config_name``:
    the configuration file, as a refusal names it in words (ModelContext.config_name).
    """
    options = RuntimeOptions(runtime, origin, "cxx", ALLOWED_KEYS, prefix=f"model '{model}': ")
    fail = options.fail
    chosen = _chosen_alternative(model, runtime, options.origins, origin or config_name)
    config = config_file(origin)

    def resolve(key: str, value: Any) -> Path:
        if not isinstance(value, str) or not value or "\0" in value:  # (no path holds a NUL: the config hunt)
            fail(key, f"must be a path (absolute, relative to {config_name}, or under {MODEL_FOLDER}/)"
                      f"{quoting_hint(value)}", value)
        if value.startswith(MODEL_FOLDER + "/"):
            if folder is None:
                fail(key, f"uses {MODEL_FOLDER}, but no model folder is known here", value)
            return folder / value[len(MODEL_FOLDER) + 1:]
        path = Path(value)
        if not path.is_absolute():
            if config is None:
                fail(key, f"is relative, but the model's settings come from no {config_name}; use an absolute "
                          "path", value)
            # As the core's own paths: next to nereid.yaml as named (a ConfigMap's symlink), else its target.
            path = beside_config(config, path)
        return path

    if chosen == "library":
        return CxxOptions(library=resolve("library", runtime["library"]))
    sources = runtime["sources"]
    if not isinstance(sources, list) or not sources:
        fail("sources", "must be a non-empty list of C++ source files", sources)
    return CxxOptions(sources=tuple(resolve(f"sources[{index}]", item) for index, item in enumerate(sources)))


def _chosen_alternative(model: str, runtime: Mapping[str, Any], inherited: Mapping[str, str], origin: str) -> str:
    """``"library"`` or ``"sources"``, whichever ``runtime`` gives; ConfigError naming where both (or neither) came
    from otherwise.

    ``inherited`` maps each key taken from a ``backends.cxx`` default to where
    that default is; ``origin`` is where the model's own settings are. The two
    are alternatives, not independent keys: a model that names its own library
    under a default of ``sources`` (or the reverse) means its own one, and
    merging key by key would hand it both.
    """
    given = [key for key in ALLOWED_KEYS if key in runtime]
    own = [key for key in given if key not in inherited]
    if len(given) == 1:
        return given[0]
    if len(given) == 2 and len(own) == 1:
        return own[0]
    places = " and ".join(dict.fromkeys(inherited.get(key, origin) for key in given)) or origin
    raise ConfigError(
        f"model '{model}': backend cxx needs exactly one of runtime.library (a shared library) or "
        f"runtime.sources (C++ files to build one from) in {places}, e.g. runtime: {{library: build/libmodel.so}}")
