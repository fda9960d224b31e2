"""resolve_device when jax's CUDA plugin is there: failing to start (a driver mismatch), left out by JAX_PLATFORMS,
or working. Each case is a fresh interpreter (jax starts its backends once per process) that registers a real
"cuda" backend factory through jax.extend, as jax's CUDA plugin registers its own, then loads models in order."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER_MISMATCH = ("FAILED_PRECONDITION: No visible GPU devices: CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: system has "
                   "unsupported display driver / cuda driver combination")

# argv[1]: "fail" (the CUDA client cannot start) or "two" (a 2-device client; jax's CPU client stands in for it);
# argv[2]: the models to resolve, in load order, as JSON [[name, device], ...]. Prints what each got, as JSON.
LOAD_IN_ORDER = """
import json, sys
from jax._src import hardware_utils
from jax.extend import backend as jax_backend
from nereid.backends.xla.device import resolve_device
from nereid.settings import Device

# jax starts "cuda" only where an NVIDIA device node exists (/dev/nvidia*): make this machine look like one.
hardware_utils.has_visible_nvidia_gpu = lambda: True
mode, models = sys.argv[1], json.loads(sys.argv[2])
started = []

def cuda_client():
    started.append("cuda")
    if mode == "fail":
        raise RuntimeError(%r)
    from jaxlib import xla_client
    return xla_client.make_cpu_client(num_devices=2)

# As jax_plugins.xla_cuda12 registers the real one (xla_bridge.register_plugin).
jax_backend.register_backend_factory("cuda", cuda_client, priority=500, fail_quietly=False)
results = []
for name, device in models:
    try:
        target = resolve_device(Device.parse(device), name, "nereid.yaml: models[0]")
        results.append([name, f"OK {target.platform}:{target.device.id}"])
    except Exception as err:
        results.append([name, f"{type(err).__name__}: {err}"])
print(json.dumps({"results": results, "cuda_started": len(started)}))
""" % DRIVER_MISMATCH

# name: (mode, JAX_PLATFORMS or None, models in load order)
CASES = {
    "cpu_first": ("fail", None, [["a", "cpu"], ["g", "cuda:0"], ["b", "cpu"], ["h", "cuda:1"]]),
    "cuda_first": ("fail", None, [["g", "cuda:0"], ["a", "cpu"]]),
    "jax_platforms_cpu": ("fail", "cpu", [["g", "cuda:0"], ["a", "cpu"]]),
    "two_gpus": ("two", None, [["a", "cpu"], ["g", "cuda:1"], ["h", "cuda:2"]]),
    "cuda_listed_first": ("fail", "cuda,cpu", [["a", "cpu"]]),  # the start stops before cpu: nothing starts
}


def _real_cuda_plugin_installed() -> bool:
    try:
        import jax_plugins
    except ImportError:
        return False
    return any("cuda" in module.name for module in pkgutil.iter_modules(jax_plugins.__path__))


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, dict]:
    """Every case's results, its interpreters run side by side (each spends most of its time importing jax)."""
    if _real_cuda_plugin_installed():
        pytest.skip("jax's own CUDA plugin is installed: its registration would replace the test's factory")
    folder: Path = tmp_path_factory.mktemp("device")
    running = {}
    for case, (mode, platforms, models) in CASES.items():
        env = {key: value for key, value in os.environ.items() if key != "JAX_PLATFORMS"}
        if platforms is not None:
            env["JAX_PLATFORMS"] = platforms
        running[case] = subprocess.Popen([sys.executable, "-c", LOAD_IN_ORDER, mode, json.dumps(models)], cwd=folder,
                                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    found = {}
    for case, process in running.items():
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, f"{case}: {err}"
        found[case] = json.loads(out.splitlines()[-1])
    return found


def results(outcomes: dict[str, dict], case: str) -> dict[str, str]:
    return dict(outcomes[case]["results"])


def assert_cuda_error_is_the_plugins(reason: str, name: str, device: str) -> None:
    assert reason.startswith(f"ConfigError: model '{name}': device {device} (nereid.yaml: models[0]): jax has no "
                             "CUDA GPU backend here: Unable to initialize backend 'cuda': "), reason
    assert DRIVER_MISMATCH in reason, reason
    # Not the alias lookup that ran after the failure, nor advice to install what is installed.
    assert "Unknown backend" not in reason and "pip install" not in reason, reason


def test_a_cpu_model_loads_whatever_the_cuda_plugin_does(outcomes) -> None:
    """Defect: the first model to load got the CUDA plugin's RuntimeError, a cpu model too (without its
    model 'NAME': prefix); later ones loaded."""
    got = results(outcomes, "cpu_first")
    assert got["a"] == got["b"] == "OK cpu:0"
    assert results(outcomes, "cuda_first")["a"] == "OK cpu:0"


def test_a_cuda_model_says_why_the_cuda_plugin_did_not_start_whenever_it_loads(outcomes) -> None:
    """Defect: a cuda model loaded after the failed start was told "Unknown backend: 'gpu' requested" and to
    install jax[cuda12]; one loaded first got the "gpu" alias lookup's error too (the last of its attempts)."""
    got = results(outcomes, "cpu_first")
    assert_cuda_error_is_the_plugins(got["g"], "g", "cuda:0")
    assert_cuda_error_is_the_plugins(got["h"], "h", "cuda:1")
    assert_cuda_error_is_the_plugins(results(outcomes, "cuda_first")["g"], "g", "cuda:0")
    assert outcomes["cpu_first"]["cuda_started"] == 1  # started once, for the whole process


def test_a_cpu_model_that_cannot_load_either_says_which_model_and_why(outcomes) -> None:
    """The CUDA plugin's RuntimeError reached the model's reason as it was, without "model 'NAME': device ..."."""
    reason = results(outcomes, "cuda_listed_first")["a"]
    assert reason.startswith("ConfigError: model 'a': device cpu (nereid.yaml: models[0]): jax could not start any "
                             "backend: Unable to initialize backend 'cuda': "), reason
    assert DRIVER_MISMATCH in reason, reason


def test_jax_platforms_leaving_cuda_out_is_named(outcomes) -> None:
    got = results(outcomes, "jax_platforms_cpu")
    assert got["g"] == ("ConfigError: model 'g': device cuda:0 (nereid.yaml: models[0]): jax has no CUDA GPU "
                        "backend here: JAX_PLATFORMS='cpu' in the server's environment leaves it out (jax starts "
                        "only the platforms listed there); add cuda to it or unset it, or set device: cpu")
    assert got["a"] == "OK cpu:0"
    assert outcomes["jax_platforms_cpu"]["cuda_started"] == 0


def test_cuda_index_picks_the_local_device_and_one_past_them_is_refused(outcomes) -> None:
    got = results(outcomes, "two_gpus")
    assert got["a"] == "OK cpu:0"
    assert got["g"] == "OK cpu:1"  # (the stand-in client's platform is cpu; its device 1 is cuda:1)
    assert got["h"] == ("ConfigError: model 'h': device cuda:2 (nereid.yaml: models[0]): jax sees 2 GPU(s): "
                        "cuda:0 (cpu), cuda:1 (cpu)")


# Resolves a cpu device twice (a second model's load) and prints what each got, then that the process lives on.
RESOLVE_CPU_TWICE = """
from nereid.backends.xla.device import resolve_device
from nereid.settings import Device
for name in ("a", "b"):
    try:
        print(resolve_device(Device.parse("cpu"), name, "nereid.yaml: models[0]").platform)
    except Exception as err:
        print(f"{type(err).__name__}: {err}")
print("still here")
"""


def test_an_xla_flags_xla_aborts_on_or_a_jax_platforms_that_starts_nothing_is_each_models_reason(tmp_path) -> None:
    """Found by the deployment hunt: an XLA_FLAGS with a flag XLA does not know (a typo, one a newer jaxlib
    dropped) ended the server at its first bundle's load, every model with it (XLA's LOG(FATAL)), and nereid check
    too; JAX_PLATFORMS=cuda where jax sees no GPU gave every bundle the reason "AssertionError" alone."""
    if list(Path("/dev").glob("nvidia[0-9]*")):
        pytest.skip("an NVIDIA GPU is visible here: JAX_PLATFORMS=cuda starts (or fails) otherwise")
    cases = {"flags": {"XLA_FLAGS": "--xla_no_such_flag_of_nereids=true"}, "platforms": {"JAX_PLATFORMS": "cuda"}}
    running = {}
    for case, extra in cases.items():
        env = {key: value for key, value in os.environ.items() if key not in ("XLA_FLAGS", "JAX_PLATFORMS")}
        running[case] = subprocess.Popen([sys.executable, "-c", RESOLVE_CPU_TWICE], cwd=tmp_path,
                                         env={**env, **extra}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                         text=True)
    got = {case: process.communicate(timeout=300)[0].splitlines() for case, process in running.items()}
    where = "ConfigError: model '{}': device cpu (nereid.yaml: models[0]): jax could not start any backend: "
    flags = got["flags"]
    assert len(flags) == 3 and flags[2] == "still here", flags
    for name, line in zip("ab", flags):
        assert line.startswith(where.format(name) + "XLA ends any process that starts it with XLA_FLAGS="
                               "'--xla_no_such_flag_of_nereids=true' (a child process that tried died: F"), line
        assert line.endswith("Unknown flag in XLA_FLAGS: --xla_no_such_flag_of_nereids=true); correct or unset "
                             "XLA_FLAGS in the server's environment"), line
    assert got["platforms"] == [where.format(name) + "jax started none of the platforms JAX_PLATFORMS='cuda' lists "
                                "(cuda is skipped where jax sees no NVIDIA GPU: no driver, or none visible to this "
                                "container); add cpu to it (JAX_PLATFORMS=cuda,cpu) or unset it" for name in "ab"] + [
                                    "still here"]


def test_a_check_child_killed_by_another_hand_decides_nothing() -> None:
    """Found by the hunt of this session's changes: a child killed mid-check (an out-of-memory killer) was taken
    for XLA's refusal of valid flags, kept for the server's life."""
    from nereid.backends.xla.device import _UNDECIDED, child_verdict

    fatal = b"F1205 08:17:37.048898   10067 parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS: --x=1\n"
    assert child_verdict("--x=1", 1, b"W0000 a warning\n" + fatal).endswith(
        "Unknown flag in XLA_FLAGS: --x=1); correct or unset XLA_FLAGS in the server's environment")
    assert child_verdict("--x=1", -6, fatal) is not None  # (XLA's abort)
    assert child_verdict("--xla_cpu_enable_fast_math=false", -9, b"") is _UNDECIDED
    assert child_verdict("--xla_cpu_enable_fast_math=false", 1, b"Traceback ...\nImportError: x\n") is None
    assert child_verdict("--xla_cpu_enable_fast_math=false", 0, b"") is None


# Threads named nereid-thread-room cannot start while `refuse` is set; resolve a cpu model, lift it, resolve again.
NO_ROOM_FOR_THE_CLIENT = """
import threading
from nereid.backends.xla.device import resolve_device
from nereid.settings import Device

refuse, real = True, threading.Thread.start

def start(self):
    if refuse and self.name == "nereid-thread-room":
        raise RuntimeError("can't start new thread")
    real(self)

threading.Thread.start = start
try:
    resolve_device(Device.parse("cpu"), "a", "nereid.yaml: models[0]")
except Exception as err:
    print(f"{type(err).__name__}: {err}")
refuse = False
print("then", resolve_device(Device.parse("cpu"), "a", "nereid.yaml: models[0]").platform)
"""


def test_jax_s_client_is_not_started_without_room_for_its_threads() -> None:
    """Found by the exhaustion hunt: at a pids limit, the first bundle's load started jax's CPU client, whose
    thread pools could not start their threads, and an absl CHECK aborted the whole server. The load is refused
    now, naming the limit, and a later one starts the client once there is room."""
    done = subprocess.run([sys.executable, "-c", NO_ROOM_FOR_THE_CLIENT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    refused, then = done.stdout.splitlines()
    assert refused == ("ConfigError: model 'a': device cpu (nereid.yaml: models[0]): jax could not start any backend: "
                       "RuntimeError: can't start new thread: a process or thread limit, such as ulimit -u or a "
                       "container's pids limit, is reached"), refused
    assert then == "then cpu"


# argv[1]: the file XLA_FLAGS names. Prints the flags in force before jax starts, then after the file is edited.
FLAGS_READ_ONCE = """
import sys
from pathlib import Path
from nereid.backends.xla.device import flags_in_force, resolve_device
from nereid.settings import Device

print(flags_in_force())
resolve_device(Device.parse("cpu"), "a", "nereid.yaml: models[0]")
Path(sys.argv[1]).write_text("--xla_cpu_max_isa=AVX2\\n")
print(flags_in_force())
"""


def test_the_compile_cache_is_keyed_by_the_flags_xla_read_when_it_started(tmp_path) -> None:
    """Found by the XLA read hunt: XLA reads XLA_FLAGS once, as its first backend starts, but the cache key read
    the flags file again at each load: after an edit of it (a ConfigMap's), a reload cached programs compiled
    with the old flags under the new ones, and a fresh server with the new flags served them."""
    flags = tmp_path / "flags"
    flags.write_text("--xla_cpu_max_isa=SSE4_2\n")
    done = subprocess.run([sys.executable, "-c", FLAGS_READ_ONCE, str(flags)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "XLA_FLAGS": str(flags)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["--xla_cpu_max_isa=SSE4_2", "--xla_cpu_max_isa=SSE4_2"], done.stdout


# As FLAGS_READ_ONCE, jax started first by a model's own code (a meta model's model.py), after nereid's check.
FLAGS_READ_BY_MODEL_CODE = """
import sys
from pathlib import Path
import jax
from nereid.backends.xla.device import flags_in_force, resolve_device, xla_flags_problem
from nereid.settings import Device

assert xla_flags_problem() is None  # (a load checks before a model.py runs)
jax.devices()  # the model's code starts jax, with the flags as they are
Path(sys.argv[1]).write_text("--xla_cpu_max_isa=AVX2\\n")
resolve_device(Device.parse("cpu"), "a", "nereid.yaml: models[0]")
print(flags_in_force())
"""


def test_the_flags_in_force_are_those_before_a_model_s_code_started_jax(tmp_path) -> None:
    """The review hunt of 76e78e7: jax started by a model.py, then the flags file edited: the flags of nereid's own
    first start, later, were taken for those XLA had read."""
    flags = tmp_path / "flags"
    flags.write_text("--xla_cpu_max_isa=SSE4_2\n")
    done = subprocess.run([sys.executable, "-c", FLAGS_READ_BY_MODEL_CODE, str(flags)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "XLA_FLAGS": str(flags)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["--xla_cpu_max_isa=SSE4_2"], done.stdout


# import_jax twice in a process whose address space has room for little more than it holds: jaxlib's library
# cannot be mapped. Prints each try's exception.
IMPORTS_JAX_WITHOUT_ROOM = r"""
import json, resource
import numpy  # (what the server has imported before any load)
from nereid.backends.xla.device import import_jax

size = int(open("/proc/self/statm").read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (60 << 20), resource.RLIM_INFINITY))
tries = []
for _ in range(2):
    try:
        import_jax("m")
        tries.append("imported")
    except Exception as err:
        tries.append(f"{type(err).__name__}: {err}")
print(json.dumps(tries))
"""


def test_a_second_load_after_jax_failed_to_import_says_why_again() -> None:
    """Defect (a deploy hunt under ulimit -v): the first bundle's load said jax could not be imported
    (libjax_common.so: failed to map segment), and the next one's, meeting the modules that import had left,
    "AttributeError: partially initialized module 'jax' has no attribute 'version'"."""
    done = subprocess.run([sys.executable, "-c", IMPORTS_JAX_WITHOUT_ROOM], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    first, second = json.loads(done.stdout)
    assert first.startswith("ImportError: ") and "failed to map segment" in first, first
    assert second == first
