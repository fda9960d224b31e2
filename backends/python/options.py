"""The python backend's ``runtime:`` options from nereid.yaml, checked once at load.

```yaml
models:
  - name: my_model
    runtime:
      warm_start: true            # default true: fork each run from a warm parent; false: a fresh interpreter
      preload: [torch, sklearn]   # modules to import in the warm parent besides main.py's own imports
```
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from nereid.config_document import quoting_hint
from nereid.runtime_options import RuntimeOptions

# (fullmatch: "$" also matches before a final line break, and "os\n" passed, then failed the warm parent's import.)
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True)
class PythonOptions:
    """Parsed ``runtime:`` options of one python model."""

    warm_start: bool = True
    preload: tuple[str, ...] = ()


def parse_options(runtime: Mapping[str, Any], origin: str) -> PythonOptions:
    """Check ``runtime`` options; ConfigError names ``<origin>.runtime.<key>`` and the value."""
    options = RuntimeOptions(runtime, origin, "python", ("warm_start", "preload"))
    warm_start = options.boolean("warm_start", True)
    preload = options.get("preload", [])
    if not isinstance(preload, list):
        options.fail("preload", "must be a list of module names", preload)
    for index, module in enumerate(preload):
        if not isinstance(module, str) or not _MODULE_NAME.fullmatch(module):  # (the list alone named none: a bug hunt)
            options.fail(f"preload[{index}]", "must be a module name such as numpy or sklearn.linear_model"
                         f"{quoting_hint(module)}", module)
    return PythonOptions(warm_start, tuple(preload))
