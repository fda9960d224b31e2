"""Reading main.py's imports (backends/python/preload.py): what is refused. Parsing from many threads at once, as
concurrent loads do, is tests/core/test_python_source.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereid.backends.python.preload import imported_modules, triton_python_model
from nereid.errors import ConfigError


@pytest.mark.parametrize("body, line, message", [
    ("return data\n", 3, "'return' outside function"),
    ("for i in []:\n    pass\nelse:\n    break\n", 6, "'break' outside loop"),
    ("continue\n", 3, "'continue' not properly in loop"),
    ("nonlocal total\n", 3, "nonlocal declaration not allowed at module level"),
    ("await data\n", 3, "'await' outside function"),
    ("def f(:\n    pass\n", 3, "invalid syntax"),  # found by the parser already
])
def test_main_py_that_python_would_not_run_is_refused_naming_the_file_line_and_error(tmp_path: Path, body: str,
                                                                                    line: int, message: str) -> None:
    # Defect: errors only the compiler finds (not the parser) passed: the model was READY, every run failed,
    # and with watch: true such an edit replaced the working version.
    main_py = tmp_path / "main.py"
    main_py.write_text("import os, sys\ndata = sys.stdin.buffer.read()\n" + body)
    with pytest.raises(ConfigError) as caught:
        imported_modules(main_py, main_py.read_bytes())
    assert str(caught.value) == f"{main_py}: not valid Python (line {line}: {message})"


@pytest.mark.parametrize("source, reason", [
    # Found by the error hunt: compile() of the bytes let a comment that is no UTF-8 pass; the model was READY,
    # each warm run failed inside the tokenizer, and `python main.py` refuses the file.
    ("import sys\n# café\n".encode("latin-1"), "line 2: byte b'\\xe9' is not utf-8 text (PEP 263: a file is UTF-8 "
                                                "unless a coding line, such as '# -*- coding: latin-1 -*-', declares "
                                                "another)"),
    ("# café\n".encode("latin-1"), "line 1: byte b'\\xe9' is not utf-8 text (PEP 263: a file is UTF-8 unless a "
                                    "coding line, such as '# -*- coding: latin-1 -*-', declares another)"),
    (b"# -*- coding: bogus -*-\nimport sys\n", "unknown encoding: bogus"),
    # "line None" was said: Python 3.11 knows no line for a null byte.
    (b"import sys\n\0\n", "source code string cannot contain null bytes"),
])
def test_main_py_whose_bytes_python_would_not_read_is_refused_naming_the_line_and_why(tmp_path: Path, source: bytes,
                                                                                     reason: str) -> None:
    main_py = tmp_path / "main.py"
    main_py.write_bytes(source)
    with pytest.raises(ConfigError) as caught:
        imported_modules(main_py, source)
    assert str(caught.value) == f"{main_py}: not valid Python ({reason})"


def test_main_py_in_a_declared_encoding_loads(tmp_path: Path) -> None:
    source = "# -*- coding: latin-1 -*-\n# café\nimport json\n".encode("latin-1")
    assert imported_modules(tmp_path / "main.py", source) == ["json"]


TRITON_MODEL = "import numpy as np\n\n\nclass TritonPythonModel:\n    def execute(self, requests):\n        return []\n"


@pytest.mark.parametrize("source, sign", [
    ("import triton_python_backend_utils as pb_utils\n" + TRITON_MODEL, "imports triton_python_backend_utils"),
    ("try:\n    from triton_python_backend_utils import Tensor\nexcept ImportError:\n    pass\n",
     "imports triton_python_backend_utils"),
    ('"""A port."""\nVERSION = 2\n' + TRITON_MODEL,
     "defines class TritonPythonModel and runs nothing at its top level"),
    # A port that calls its class from its own top-level code may be right: its runs tell.
    (TRITON_MODEL + "TritonPythonModel().execute([])\n", None),
    (TRITON_MODEL + "if __name__ == '__main__':\n    main()\n", None),
    ("import os, sys\nraw = sys.stdin.buffer.read()\n", None),
    ("# TritonPythonModel was here\nimport sys\n", None),
])
def test_a_main_py_ported_from_triton_as_it_is_is_told_by_its_source(source: str, sign: str | None) -> None:
    assert triton_python_model(source.encode()) == sign
