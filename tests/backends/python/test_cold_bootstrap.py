"""A cold run (``cold_bootstrap.py``) against a real ``python main.py``: the same output, exit status and
globals, but the bytes the version loaded rather than the file on disk."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from nereid.backends.python.plugin import cold_command

# Each main.py is run both ways; stdout, stderr and the exit status must match exactly.
PROGRAMS = {
    "output": "import sys\nprint('out')\nprint('err', file=sys.stderr)\nprint(sum(range(10)))\n",
    "globals": (
        "import os, sys\n"
        "print(sorted(os.listdir('/proc/self/fd')))\n"
        "print(__name__, __file__, sys.argv, sys.path[0], __spec__, __cached__, type(__loader__).__name__,\n"
        "      __loader__.name, __loader__.path, __package__, __doc__)\n"
        "print(list(globals()), sys.orig_argv[1:])\n"
        "print(any('cold_bootstrap' in str(x) for x in [*sys.path, *sys.argv, *sys.modules]))\n"
        "print(sys.modules['__main__'] is sys.modules[__name__], sys.excepthook is sys.__excepthook__)\n"),
    "dunder_main": "if __name__ == '__main__':\n    print('run as a script')\n",
    "uncaught": ("def inner(values):\n    return values['missing'] + 1\n\n"
                 "def outer():\n    return inner({})\n\nprint('before')\nouter()\n"),
    "chained": ("try:\n    1 / 0\nexcept ZeroDivisionError as e:\n    raise ValueError('again') from e\n"),
    "helper_raises": "import helper\nhelper.fail()\n",
    "syntax_error_at_run_time": "exec('x = (')\n",
    "exit_code": "import sys\nprint('bye')\nsys.exit(3)\n",
    "exit_message": "import sys\nsys.exit('a message')\n",
    "exit_none": "raise SystemExit\n",
    "exit_huge": "import sys\nsys.exit(2 ** 70)\n",
    "keyboard_interrupt": "raise KeyboardInterrupt\n",
    "warning": "import warnings\nwarnings.warn('watch out')\nwarnings.warn('deprecated', DeprecationWarning)\n",
    "pickle": ("import pickle\n\nclass Point:\n    def __init__(self, x):\n        self.x = x\n\n"
               "data = pickle.dumps(Point(3))\nprint(data)\nprint(pickle.loads(data).x, Point.__module__)\n"),
    # (A spawned child imports __main__ again from __file__: the file on disk, here the same bytes.)
    "spawn": ("import multiprocessing\n\ndef square(x):\n    return x * x\n\nif __name__ == '__main__':\n"
              "    with multiprocessing.get_context('spawn').Pool(1) as pool:\n"
              "        print(pool.map(square, [1, 2, 3]))\n"),
    "excepthook": ("import sys\n\ndef hook(kind, value, tb):\n"
                   "    print('hook', kind.__name__, value, tb.tb_frame.f_code.co_filename == __file__)\n"
                   "sys.excepthook = hook\nraise RuntimeError('boom')\n"),
    "broken_excepthook": "import sys\nsys.excepthook = lambda *a: 1 / 0\nraise RuntimeError('boom')\n",
    "atexit": ("import atexit, sys\n\n@atexit.register\ndef bye():\n"
               "    print('at exit', '__file__' in globals(), sys.last_type.__name__)\n\nraise LookupError('x')\n"),
    "shadowing": "import tokenize\nprint(tokenize.__file__.endswith('/tokenize.py'), tokenize.MINE)\n",
    "traceback_in_main": "import traceback\ntry:\n    {}['k']\nexcept KeyError:\n    traceback.print_exc()\n",
    "coding_cookie": "# -*- coding: latin-1 -*-\nprint(repr('caf\xe9'))\nraise ValueError('caf\xe9')\n",
}
HELPER = "def fail():\n    raise OSError('from the helper')\n"
MY_TOKENIZE = "MINE = True\n"


def model_folder(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    folder.mkdir()
    encoding = "latin-1" if name == "coding_cookie" else "utf-8"
    (folder / "main.py").write_bytes(PROGRAMS[name].encode(encoding))
    (folder / "helper.py").write_text(HELPER)
    if name == "shadowing":  # (a folder's tokenize.py also hides the one linecache reads source files with)
        (folder / "tokenize.py").write_text(MY_TOKENIZE)
    return folder


def run(argv: list[str], folder: Path, loaded: Path | None = None) -> tuple[int, str, str]:
    """Exit status, stdout and stderr of ``argv`` run in ``folder``; with ``loaded``, given a descriptor of that
    file as its last argument, as the warm parent execs a cold run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    fds = [os.open(loaded, os.O_RDONLY)] if loaded is not None else []
    try:
        done = subprocess.run([*argv, *map(str, fds)], cwd=folder, env=env, capture_output=True, timeout=30,
                              pass_fds=fds)
    finally:
        for fd in fds:
            os.close(fd)
    return done.returncode, done.stdout.decode("latin-1"), done.stderr.decode("latin-1")


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_a_cold_run_matches_python_main_py(tmp_path, name):
    folder = model_folder(tmp_path, name)
    loaded = tmp_path / "parent" / "main.py.loaded"
    loaded.parent.mkdir()
    loaded.write_bytes((folder / "main.py").read_bytes())
    expected = run([sys.executable, "main.py"], folder)
    assert run(cold_command(), folder, loaded) == expected


def test_a_cold_run_runs_the_loaded_bytes_not_the_file_on_disk(tmp_path):
    """Defect: a cold run execed ``python main.py``: an edit on disk (one whose reload failed) served in place of
    the version that loaded. Its tracebacks and warnings quote the loaded lines, too."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "main.py").write_text("this is not python(\n")
    loaded = tmp_path / "main.py.loaded"
    loaded.write_text("import warnings\nprint('loaded')\nwarnings.warn('loaded warning')\nraise ValueError('loaded')\n")
    status, out, err = run(cold_command(), folder, loaded)
    assert (status, out) == (1, "loaded\n"), err
    assert err == (f"{folder}/main.py:3: UserWarning: loaded warning\n  warnings.warn('loaded warning')\n"
                   f"Traceback (most recent call last):\n  File \"{folder}/main.py\", line 4, in <module>\n"
                   "    raise ValueError('loaded')\nValueError: loaded\n")
