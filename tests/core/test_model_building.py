"""build_model: a folder claimed, its backend's object made and loaded, and what core derives from it."""

from __future__ import annotations

import pytest
import toy_backends

from nereid.backend import ModelContext
from nereid.errors import ConfigError
from nereid.model_building import build_model
from nereid.plugins import make_plugin_manager
from nereid.settings import BatchingSettings, ModelSettings


def _context(folder, tmp_path, **settings) -> ModelContext:
    return ModelContext(folder.name, folder, ModelSettings(folder.name, **settings), tmp_path, "nereid.yaml")


def _manager():
    return make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends, toy_backends.FaultyToys()))


def test_a_claimed_folder_is_built_with_its_backends_name_signature_and_batch_policy(tmp_path) -> None:
    folder = toy_backends.write_toy(tmp_path / "ml-backends", "m")
    built = build_model(_manager(), _context(folder, tmp_path, batching=BatchingSettings(max_queue_delay_ms=2)))
    assert built.backend_name == "toy" and isinstance(built.backend, toy_backends.ToyModel)
    assert [t.name for t in built.signature.inputs] == ["input"]
    assert built.batch_signature is built.signature  # the toy has no batch_signature() of its own
    assert (built.policy.enabled, built.policy.max_rows, built.policy.max_delay_ns) == (True, 8, 2_000_000)


def test_an_unclaimed_folder_is_refused_with_the_claims_reason(tmp_path) -> None:
    folder = tmp_path / "ml-backends" / "nobody"
    folder.mkdir(parents=True)
    with pytest.raises(ConfigError, match="no backend claims the folder"):
        build_model(_manager(), _context(folder, tmp_path))


def test_a_model_object_failing_its_checks_after_load_is_unloaded_and_refused_naming_its_backend(tmp_path) -> None:
    folder = toy_backends.write_faulty(tmp_path / "ml-backends", "nosig", "signature_none")
    before = toy_backends.UNLOADS["nosig"]
    with pytest.raises(ConfigError, match=r"^plugin 'faulty': its model object \(SignatureNoneModel\) returned "
                                          r"NoneType None from signature\(\)"):
        build_model(_manager(), _context(folder, tmp_path))
    assert toy_backends.UNLOADS["nosig"] == before + 1  # what its load() acquired is released


@pytest.mark.parametrize("fault, reason", [
    ("key_error", "model 'm': KeyError: 'weights' (raised by the load() of plugin 'faulty')"),
    ("create_fails", "model 'm': AttributeError: 'NoneType' object has no attribute 'device' (raised by the "
                     "create() of plugin 'faulty')"),
    ("refuses", "weights.bin is for another version of this model"),  # a ConfigError: the reason as given
    ("out_of_memory", "model 'm': the server ran out of memory (MemoryError raised by the load() of plugin "
                      "'faulty')"),  # (the server's condition: no bug of the plugin's)
])
def test_what_create_or_load_raises_is_named_with_its_type_and_plugin_unless_it_is_a_reason(tmp_path, fault,
                                                                                            reason) -> None:
    """Defect: a bug in a backend's load() (``{}["weights"]``) made the reason ``'weights'``, naming neither the
    exception nor the plugin, and its traceback was nowhere."""
    folder = toy_backends.write_faulty(tmp_path / "ml-backends", "m", fault)
    with pytest.raises(ConfigError) as caught:
        build_model(_manager(), _context(folder, tmp_path))
    assert str(caught.value) == reason
    assert (caught.value.__cause__ is not None) == (fault != "refuses")  # whose traceback the log line shows


# A load that runs out of memory under an address-space limit of 4 GiB; prints its reason.
LOADS_UNDER_AN_ADDRESS_SPACE_LIMIT = r"""
import resource, sys
from pathlib import Path
sys.path.insert(0, sys.argv[2])
import toy_backends
from nereid.backend import ModelContext
from nereid.errors import ConfigError
from nereid.model_building import build_model
from nereid.plugins import make_plugin_manager
from nereid.settings import ModelSettings

resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))
folder = toy_backends.write_faulty(Path(sys.argv[1]) / "ml-backends", "m", "out_of_memory")
manager = make_plugin_manager(load_entry_points=False, extra_plugins=(toy_backends, toy_backends.FaultyToys()))
try:
    build_model(manager, ModelContext("m", folder, ModelSettings("m"), Path(sys.argv[1]), "nereid.yaml"))
except ConfigError as err:
    print(err)
"""


def test_a_load_out_of_memory_names_the_address_space_limit_where_one_is_set(tmp_path) -> None:
    """The deploy hunt: under ulimit -v a bundle's load said "MemoryError (raised by the load() ...)", no more."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", LOADS_UNDER_AN_ADDRESS_SPACE_LIMIT, str(tmp_path),
                           str(Path(__file__).parents[1])], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == ("model 'm': the server ran out of memory (MemoryError raised by the load() of "
                                   "plugin 'faulty'); the server's address-space limit (ulimit -v) is 4096 MiB")


def test_only_a_permission_denied_on_a_file_of_the_model_s_folder_is_said_to_be_the_operator_s() -> None:
    """The hunt of the rewording: every PermissionError naming a file became "the server's user cannot open it",
    without its traceback: a chmod's EPERM, a library's cache outside the folder, a plugin's own bug."""
    import errno
    from pathlib import Path

    from nereid.model_building import _mode_of_a_model_file

    folder = Path("/srv/models/m")
    assert _mode_of_a_model_file(PermissionError(errno.EACCES, "Permission denied", "/srv/models/m/main.py"), folder)
    assert _mode_of_a_model_file(PermissionError(errno.EACCES, "Permission denied", "/srv/models/m/sub/w.bin"),
                                 folder)
    assert not _mode_of_a_model_file(PermissionError(errno.EPERM, "Operation not permitted", "/srv/models/m/x"),
                                     folder)
    assert not _mode_of_a_model_file(PermissionError(errno.EACCES, "Permission denied", "/var/cache/lib/lock"),
                                     folder)
    assert not _mode_of_a_model_file(PermissionError(errno.EACCES, "Permission denied", "/srv/models/m2/main.py"),
                                     folder)
    assert not _mode_of_a_model_file(PermissionError(errno.EACCES, "Permission denied"), folder)



def test_whose_outputs_are_copied_is_asked_of_the_backend_once(tmp_path) -> None:
    """A plugin's outputs are copied as its infer returns them (see ReturnsFreshOutputs); a python model's are
    read from each run's own output file (as a cpp model's; a cxx library's and a bundle's are made per call),
    used as they are."""
    from support import ECHO_MAIN, textproto_single

    toy = build_model(_manager(), _context(toy_backends.write_toy(tmp_path / "ml-backends", "m"), tmp_path))
    assert toy.fresh_outputs is False
    python = tmp_path / "ml-backends" / "echo"
    python.mkdir()
    (python / "main.py").write_text(ECHO_MAIN)
    (python / "model_inference.textproto").write_text(textproto_single())
    built = build_model(make_plugin_manager(load_entry_points=False),
                        _context(python, tmp_path, runtime={"warm_start": False}))
    try:
        assert built.fresh_outputs is True
    finally:
        built.backend.unload()
