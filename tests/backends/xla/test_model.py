"""XlaModel called directly (no server): padding to compiled sizes, and the PadsBatches capability."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from nereid.backend import ModelContext, PadsBatches
from nereid.errors import ConfigError
from nereid.settings import ModelSettings
from nereid.tensors import NamedTensor

from nereid.backends.xla import model as model_module
from nereid.backends.xla.model import XlaModel, check_omitted_hooks, in_declared_order
from nereid.backends.xla.transfer import DeviceTransfer


def load(folder: Path, tmp_path: Path) -> XlaModel:
    model = XlaModel(ModelContext(folder.name, folder, ModelSettings(folder.name), tmp_path, "test"))
    model.load()
    return model


def test_padded_rows_name_the_compiled_size_and_a_prepadded_batch_gives_the_same_rows(tmp_path, add_bundle) -> None:
    model = load(add_bundle(tmp_path, "mlp_bundle"), tmp_path)  # compiled for 1, 8 and 32 rows
    try:
        assert isinstance(model, PadsBatches)
        assert [model.padded_rows(rows) for rows in (1, 2, 8, 9, 32, 33)] == [1, 8, 8, 32, 32, 33]
        x = np.random.default_rng(0).standard_normal((5, 16)).astype(np.float32)
        padded = np.zeros((8, 16), np.float32)
        padded[:5] = x
        own = model.infer([NamedTensor.from_array("input", x)])[0].data  # the model pads it itself
        given = model.infer([NamedTensor.from_array("input", padded)])[0].data
        assert own.shape == (5, 4) and given.shape == (8, 4)
        np.testing.assert_array_equal(own, given[:5])
    finally:
        model.unload()


def test_a_compile_with_no_room_for_xla_s_threads_is_refused_not_aborted(tmp_path, add_bundle, monkeypatch) -> None:
    """Found by the exhaustion hunt: at a pids limit, XLA's compile could not start its threads and aborted the
    whole server (an absl CHECK); the load is refused now, naming the limit, and nothing is compiled."""
    from nereid.daemon_pool import ThreadStartFailed

    asked: list[int] = []

    def no_room(count: int) -> None:
        asked.append(count)
        raise ThreadStartFailed(RuntimeError("can't start new thread"))

    monkeypatch.setattr(model_module, "make_room_for_threads", no_room)
    folder = add_bundle(tmp_path, "mlp_bundle")
    with pytest.raises(ThreadStartFailed, match="a process or thread limit, such as ulimit -u or a container's pids"):
        load(folder, tmp_path)
    assert asked == [model_module.COMPILE_THREADS]


def test_a_loaded_bundles_weights_are_the_host_arrays_it_read_made_read_only(tmp_path, add_bundle,
                                                                             monkeypatch) -> None:
    # On CPU the device buffer is the array read from the file (no second copy of the weights): nothing may
    # write into that array afterwards, or a weight would change under the compiled programs.
    placed: list[tuple[list[np.ndarray], list]] = []
    real_put = DeviceTransfer.put

    def recording_put(self, arrays):
        result = real_put(self, arrays)
        placed.append((list(arrays), result))
        return result

    monkeypatch.setattr(model_module.DeviceTransfer, "put", recording_put)
    model = load(add_bundle(tmp_path, "mlp_bundle"), tmp_path)
    try:
        hosts, weights = placed[0]  # the first transfer is the weights' (no request has run)
        assert len(hosts) == len(weights) == 4
        for host, weight in zip(hosts, weights):
            assert not host.flags.writeable, f"weight {host.shape} is writable after its transfer"
            assert weight.unsafe_buffer_pointer() == host.ctypes.data, f"weight {host.shape} was copied"
            assert weight.is_ready()
        x = np.ones((1, 16), np.float32)
        assert model.infer([NamedTensor.from_array("input", x)])[0].data.shape == (1, 4)
    finally:
        model.unload()


def _image_sums(img, w):
    import jax.numpy as jnp

    return jnp.sum(img * w, axis=(1, 2))


def test_a_shape_no_variant_fits_is_named_row_major_with_the_tensor(tmp_path) -> None:
    """The message listed the variable axes in manifest (column-major) order and named no tensor: a client that
    sent H=6, W=4 read that it sent [4, 6] and that [6, 4] was compiled."""
    import jax
    import pytest
    from jax import export as jax_export

    from nereid.backends.xla.export import IOSpec, write_bundle
    from nereid.errors import InvalidArgument

    variants_hw = [(4, 6), (8, 2)]  # (H, W), row-major; input_shapes lists them in manifest order (W, H)
    modules = [{1: jax_export.export(jax.jit(_image_sums, keep_unused=True), platforms=["cpu"])(
        jax.ShapeDtypeStruct((1, h, w, 3), np.float32), jax.ShapeDtypeStruct((3,), np.float32)).mlir_module_serialized}
        for h, w in variants_hw]
    folder = write_bundle(tmp_path / "img", "img", [IOSpec("img", "f32", (-1, -1, 3), batch_axis=0, letters="hwc")],
                          [IOSpec("s", "f32", (3,), batch_axis=0)], modules, {"w": np.ones(3, np.float32)},
                          batch_sizes=[1], input_shapes=[[w, h] for h, w in variants_hw])
    model = load(folder, tmp_path)
    try:
        assert model.infer([NamedTensor.from_array("img", np.ones((1, 4, 6, 3), np.float32))])[0].data.shape == (1, 3)
        with pytest.raises(InvalidArgument) as caught:
            model.infer([NamedTensor.from_array("img", np.ones((1, 6, 4, 3), np.float32))])
        assert str(caught.value) == ("model 'img': input 'img' has shape [1, 6, 4, 3]; the bundle is compiled for "
                                     "[-1, 4, 6, 3], [-1, 8, 2, 3] (input_shapes in manifest.yaml)")
    finally:
        model.unload()


class _FailsOnTransfer:
    """A device result whose copy to the host raises, as an asynchronous GPU error surfaces there."""

    def __array__(self, dtype=None, copy=None):
        raise RuntimeError("INTERNAL: CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered")


class _ResultsFailOnTransfer:
    """The real executable, its results replaced by ones whose host copy fails."""

    def __init__(self, executable) -> None:
        self.executable = executable

    def execute(self, arguments):
        return [_FailsOnTransfer() for _ in self.executable.execute(arguments)]


def test_an_error_copying_the_outputs_to_the_host_is_an_execution_failure_naming_the_model(tmp_path,
                                                                                         add_bundle) -> None:
    """Defect: np.asarray(result), where a device error of the running program surfaces, was outside the try
    that names the model: the error escaped as an unnamed internal error."""
    import pytest

    from nereid.errors import ModelFailure

    model = load(add_bundle(tmp_path, "mlp_bundle"), tmp_path)
    try:
        model._programs = {key: _ResultsFailOnTransfer(program) for key, program in model._programs.items()}
        with pytest.raises(ModelFailure) as caught:
            model.infer([NamedTensor.from_array("input", np.zeros((5, 16), np.float32))])
        assert str(caught.value) == ("model 'mlp_bundle': execution failed (batch size 8): RuntimeError: INTERNAL: "
                                     "CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory access was encountered")
    finally:
        model.unload()


# A program as jax lowers one for cuda: a call the CPU has no implementation of (cuSOLVER's Cholesky).
CUDA_ONLY_PROGRAM = """
func.func @main(%x: tensor<4x4xf32>, %w: tensor<f32>) -> tensor<4x4xf32> {
  %0 = stablehlo.custom_call @cusolver_potrf_ffi(%x) {api_version = 4 : i32} : (tensor<4x4xf32>) -> tensor<4x4xf32>
  return %0 : tensor<4x4xf32>
}
"""


def test_a_bundle_exported_for_another_platform_is_named_at_load(tmp_path, caplog) -> None:
    """Defect: nothing said that a program was lowered for another platform than the model's device, neither at
    load nor when XLA then could not compile it."""
    import logging

    import pytest

    from nereid.backends.xla.export import IOSpec, export_bundle, write_bundle
    from nereid.errors import ConfigError

    scale = export_bundle(lambda x, w: x * w, [np.zeros(3, np.float32)], {"w": np.float32(2)},
                          directory=tmp_path / "scale", platform="cuda", provenance=False)
    with caplog.at_level(logging.WARNING, logger="nereid.backends.xla.model"):
        model = load(scale, tmp_path)  # XLA compiles this one for the CPU all the same: served, with a warning
    try:
        assert model.infer([NamedTensor.from_array("input", np.ones(3, np.float32))])[0].data.tolist() == [2, 2, 2]
    finally:
        model.unload()
    elsewhere = ("its programs were exported for cuda (manifest.yaml: provenance.export_platform) but run on cpu "
                 "(device cpu): a program lowered for one platform may call what only that platform has and is "
                 "tuned for it; re-export it with export_bundle(..., platform='cpu')")
    assert [r.getMessage() for r in caplog.records] == [f"model 'scale': {elsewhere}"]
    cholesky = write_bundle(tmp_path / "cholesky", "cholesky", [IOSpec("x", "f32", (4, 4))],
                            [IOSpec("l", "f32", (4, 4))], CUDA_ONLY_PROGRAM, {"w": np.float32(0)},
                            provenance={"export_platform": "cuda"})
    with pytest.raises(ConfigError) as caught:
        load(cholesky, tmp_path)
    assert str(caught.value).startswith("model.mlir: XLA could not compile the program for cpu:0 (cpu): ")
    assert str(caught.value).endswith(f"; {elsewhere}")


def test_a_request_no_compiled_variant_takes_is_refused_before_it_queues_with_its_own_shape(tmp_path,
                                                                                           add_bundle) -> None:
    """Found by a bug hunt: such a request waited in the queue and was refused only at execution, in a batch
    of its like quoting the batch's padded shape. ``input_check`` (ChecksInputs) refuses it at admission."""
    import pytest

    from nereid.backend import ChecksInputs
    from nereid.errors import InvalidArgument

    model = load(add_bundle(tmp_path, "variants"), tmp_path)  # compiled for lengths 4 and 8
    plain = load(add_bundle(tmp_path, "mlp_bundle"), tmp_path)
    try:
        assert isinstance(model, ChecksInputs)
        check = model.input_check()
        check([NamedTensor.from_array("x", np.zeros((2, 8), np.float32))])
        with pytest.raises(InvalidArgument) as caught:
            check([NamedTensor.from_array("x", np.zeros((2, 5), np.float32))])
        assert str(caught.value) == ("model 'variants': input 'x' has shape [2, 5]; the bundle is compiled for "
                                     "[-1, 4], [-1, 8] (input_shapes in manifest.yaml)")
        assert plain.input_check() is None  # nothing beyond its signature: no per-request call
    finally:
        model.unload()
        plain.unload()


def _manifest(tmp_path: Path, extra: str):
    from nereid.backends.xla.manifest import load_manifest

    path = tmp_path / "manifest.yaml"
    path.write_text("""format_version: "2.1"
executable_inputs:
- {name: a, dtype: f32, shape: xn, dims: {x: 2}}
- {name: b, dtype: i64, shape: n}
executable_outputs:
- {name: y, dtype: f32, shape: xn, dims: {x: 2}}
batching: {compiled_batch_sizes: [1, 4]}
""" + extra)
    return load_manifest(path)


def test_client_tensors_without_their_hook_must_be_the_executables(tmp_path) -> None:
    """An omitted hook is the identity, so the client tensors it passes on must be the executable's (any order)."""
    import pytest

    from nereid.errors import ConfigError
    from nereid.model_hooks import ModelHooks

    def convert(tensors):
        return tensors

    model_py = tmp_path / "model.py"
    same = _manifest(tmp_path, """client_inputs:
- {name: b, dtype: i64, shape: n}
- {name: a, dtype: f32, shape: xn, dims: {x: 2}}
""")
    check_omitted_hooks(same, ModelHooks(), model_py)
    for client_inputs, difference in [
        ("- {name: a, dtype: f64, shape: xn, dims: {x: 2}}\n- {name: b, dtype: i64, shape: n}\n",
         "'a' is f64 [batch, 2] there and f32 [batch, 2] in executable_inputs"),
        ("- {name: a, dtype: f32, shape: nx, dims: {x: 2}}\n- {name: b, dtype: i64, shape: n}\n",
         "'a' is f32 [2, batch] there and f32 [batch, 2] in executable_inputs"),
        ("- {name: a, dtype: f32, shape: xn, dims: {x: 2}}\n", "lacks executable input 'b'")]:
        manifest = _manifest(tmp_path, f"client_inputs:\n{client_inputs}")
        with pytest.raises(ConfigError) as caught:
            check_omitted_hooks(manifest, ModelHooks(postprocess=convert), model_py)
        assert str(caught.value) == (f"{manifest.path}: client_inputs: {difference}, but {model_py} registers no "
                                     "preprocess hook (an omitted hook is the identity, so client_inputs must be "
                                     "executable_inputs): register preprocess to convert them, or remove "
                                     "client_inputs")
        check_omitted_hooks(manifest, ModelHooks(preprocess=convert), model_py)  # the hook converts them
    outputs = _manifest(tmp_path, "client_outputs:\n- {name: y, dtype: f32, shape: xn, dims: {x: -1}}\n")
    with pytest.raises(ConfigError, match=r"client_outputs: 'y' is f32 \[batch, -1\] there and f32 \[batch, 2\] "
                                          r"in executable_outputs, but .* registers no postprocess hook"):
        check_omitted_hooks(outputs, ModelHooks(preprocess=convert), model_py)


def test_hook_outputs_are_put_in_declared_order_by_name() -> None:
    """A postprocess result in another order failed every request, where a preprocess one is matched by name."""
    t, y = (NamedTensor.from_array(name, np.zeros(1, np.float32)) for name in ("t", "y"))
    assert in_declared_order([t, y], ["y", "t"]) == [y, t]
    assert in_declared_order((t, y), ["y", "t"]) == [y, t]
    same = [y, t]
    assert in_declared_order(same, ["y", "t"]) is same
    # Anything but each declared name once is left as it is, for the check of the hook's result to describe.
    for result in ([t, t], [t], [t, y, y], [t, "y"], {"t": t, "y": y}, None):
        assert in_declared_order(result, ["y", "t"]) is result


def test_a_timeout_s_is_warned_of_as_a_bundle_cannot_apply_it(tmp_path, add_bundle, caplog) -> None:
    """Found by a bug hunt: `timeout_s: 0.001` on a bundle was accepted without a word and did nothing."""
    folder = add_bundle(tmp_path, "mlp_bundle")
    model = XlaModel(ModelContext(folder.name, folder, ModelSettings(folder.name, timeout_s=0.001), tmp_path, "t"))
    model.load()
    model.unload()
    assert [r.getMessage() for r in caplog.records if r.name == "nereid.backend"] == [
        "model 'mlp_bundle': timeout_s: 0.001 does not apply: a bundle's compiled program runs to its end once started (its "
        "requests' deadlines still bound their wait in the queue)"]


def test_a_bundle_of_several_sizes_without_a_batched_input_warns_that_only_its_first_runs(tmp_path, caplog) -> None:
    """From a bundle hunt: sizes [1, 2] with no input batched (a hand-made bundle; the exporter cannot make one)
    compiled both programs and ran only the first, without a word."""
    import jax.numpy as jnp

    from nereid.backends.xla.export import export_bundle

    weights = {"w": np.arange(4, dtype=np.float32)}
    folder = tmp_path / "gen"
    folder.mkdir()
    for rows in (1, 2):  # y = x * w repeated in `rows` rows: the program of each size
        export_bundle(lambda x, w, rows=rows: jnp.broadcast_to(x * w, (rows, 4)), [np.ones((4,), np.float32)],
                      weights, directory=tmp_path / f"b{rows}", input_names=["x"], output_names=["y"],
                      provenance=False)
        (folder / f"model.b{rows}.mlir").write_bytes((tmp_path / f"b{rows}" / "model.mlir").read_bytes())
    (folder / "weights.safetensors").write_bytes((tmp_path / "b1" / "weights.safetensors").read_bytes())
    (folder / "manifest.yaml").write_text(
        "format_version: '2.1'\nname: gen\n"
        "executable_inputs:\n- {name: x, dtype: f32, shape: a, dims: {a: 4}}\n"
        "executable_outputs:\n- {name: y, dtype: f32, shape: an, dims: {a: 4}}\n"
        "batching:\n  compiled_batch_sizes: [1, 2]\n")
    model = load(folder, tmp_path)
    try:
        (y,) = model.infer([NamedTensor.from_array("x", np.ones((4,), np.float32))])
        assert y.data.shape == (1, 4)  # the smallest size, whatever is asked
    finally:
        model.unload()
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        "model 'gen': the manifest lists batch sizes [1, 2], but no input has a batch axis, so no request can "
        "choose among them: only size 1 ever runs (list that one alone)"]


def _times(x, w):
    return x * w


def _twice_times(x, w):
    return 2 * x * w


def _two_releases(tmp_path: Path) -> dict[str, Path]:
    """Two releases of bundle m: release-1 answers 3x, release-2 10x (2x by its program, 5x by its weights), so
    release-1's program with release-2's weights answers 5x and the other way round 6x."""
    from nereid.backends.xla.export import export_bundle

    releases = {}
    for name, fn, scale in (("release-1", _times, 3.0), ("release-2", _twice_times, 5.0)):
        releases[name] = export_bundle(fn, [np.zeros((1, 4), np.float32)], {"w": np.full(4, scale, np.float32)},
                                       directory=tmp_path / name / "m", batch_sizes=[1], provenance=False)
    return releases


def _answer(model: XlaModel) -> np.ndarray:
    [output] = model.infer([NamedTensor.from_array("input", np.ones((1, 4), np.float32))])
    return output.data


def test_a_load_through_a_symlink_flipped_to_another_release_meanwhile_reads_one_release(tmp_path,
                                                                                        monkeypatch) -> None:
    """Found by the hunt of this session's last fixes: a model folder that is a symlink flipped to another release
    during a load (git-sync, a Kubernetes volume) gave the load one release's weights and the other's programs,
    served 200 OK until the next load."""
    releases = _two_releases(tmp_path)
    link = tmp_path / "ml-backends" / "m"
    link.parent.mkdir()
    link.symlink_to(releases["release-1"])
    real_open = model_module.open_local_bundle

    def flipped_after_the_weights(folder, *args, **kwargs):
        opened = real_open(folder, *args, **kwargs)
        flip = tmp_path / "flip"
        flip.symlink_to(releases["release-2"])
        flip.replace(link)  # (atomically, as git-sync swaps its link)
        return opened

    monkeypatch.setattr(model_module, "open_local_bundle", flipped_after_the_weights)
    model = load(link, tmp_path)
    try:
        np.testing.assert_array_equal(_answer(model), np.full((1, 4), 3.0, np.float32))  # release-1's, whole
    finally:
        model.unload()


def _swapped_by_mv(monkeypatch, folder: Path, releases: list[Path]) -> list[Path]:
    """Make each load's open of ``folder``'s bundle swap the folder, once its weights' header is read, for the next
    of ``releases`` by two renames (``mv m .m.old && mv .m.new m``); the releases swapped in, in order."""
    real_open = model_module.open_local_bundle
    swapped = []

    def swapped_after_the_weights(opened_folder, *args, **kwargs):
        opened = real_open(opened_folder, *args, **kwargs)
        if releases:
            folder.rename(folder.with_name(f".m.old{len(swapped)}"))
            swapped.append(releases.pop(0))
            swapped[-1].rename(folder)
        return opened

    monkeypatch.setattr(model_module, "open_local_bundle", swapped_after_the_weights)
    return swapped


def test_a_load_whose_folder_is_swapped_by_mv_meanwhile_reads_the_new_release_whole(tmp_path, monkeypatch,
                                                                                  caplog) -> None:
    """Found by the hunt of the last stop's last fixes: a folder swapped for another release by mv during a load
    gave the load one release's weights and the other's programs (here 6x), served 200 OK until its next load."""
    releases = _two_releases(tmp_path)
    folder = tmp_path / "ml-backends" / "m"
    folder.parent.mkdir()
    releases["release-1"].rename(folder)
    swapped = _swapped_by_mv(monkeypatch, folder, [releases["release-2"]])
    model = load(folder, tmp_path)
    try:
        assert len(swapped) == 1
        np.testing.assert_array_equal(_answer(model), np.full((1, 4), 10.0, np.float32))  # release-2's, whole
    finally:
        model.unload()
    assert [r.getMessage() for r in caplog.records if r.levelname == "WARNING"] == [
        f"model 'm': its folder {folder} was replaced by another during its load (moved away, another moved in); "
        "loading it again"]


def test_a_load_whose_folder_is_swapped_during_every_try_fails_saying_so(tmp_path, monkeypatch) -> None:
    """Three swaps in a row, one in each read: the load fails rather than serve a mix."""
    releases = _two_releases(tmp_path)
    folder = tmp_path / "ml-backends" / "m"
    folder.parent.mkdir()
    releases["release-1"].rename(folder)
    copies = [releases["release-2"]]
    for i in range(2):
        copies.append(copies[0].with_name(f"m{i}"))
        shutil.copytree(copies[0], copies[-1])
    _swapped_by_mv(monkeypatch, folder, copies)
    with pytest.raises(ConfigError) as caught:
        load(folder, tmp_path)
    assert str(caught.value) == (f"model 'm': its folder {folder} was replaced by another during each of 3 loads in "
                                 "a row; load it again once it stays in place")


def _matmul(x, w):
    return x @ w


def test_a_format_2_1_bundle_whose_weights_file_has_no_axis_order_is_refused_not_read_transposed(tmp_path) -> None:
    """Found by the XLA read hunt: a 2.1 bundle's weights rewritten with the safetensors package (no axis_order)
    were read in the legacy layout: a square weight passed every check transposed, and the model answered
    x @ w.T, OK. (The same file with axis_order: xla loads, and answers x @ w.)"""
    import safetensors.numpy

    from nereid.backends.xla.export import export_bundle

    w = np.arange(9, dtype=np.float32).reshape(3, 3)
    folder = export_bundle(_matmul, [np.zeros((1, 3), np.float32)], {"w": w}, directory=tmp_path / "mm",
                           batch_sizes=[1], provenance=False)
    safetensors.numpy.save_file({"w": w}, str(folder / "weights.safetensors"))
    with pytest.raises(ConfigError, match=r"^weights\.safetensors: no axis_order in its metadata, so it would be "
                                          r"read in the legacy layout .* manifest\.yaml says format_version "
                                          r"\"2\.1\""):
        load(folder, tmp_path)
    from nereid.backends.xla.arity import check_bundle  # (nereid bundle check says so too)
    assert "no axis_order in its metadata" in check_bundle(folder)[1]
    # (Nor when the manifest names the file, as weights_file: v2/weights.safetensors; the review hunt.)
    (folder / "v2").mkdir()
    safetensors.numpy.save_file({"w": w}, str(folder / "v2" / "weights.safetensors"))
    manifest = (folder / "manifest.yaml").read_text()
    # (Spelled as a path may be: ./v2/... named "another file" than the one loaded, and was exempt; the review hunt.)
    for spelling in ("v2/weights.safetensors", "./v2/weights.safetensors", "v2//weights.safetensors"):
        (folder / "manifest.yaml").write_text(manifest + f"weights_file: '{spelling}'\n")
        with pytest.raises(ConfigError, match=r"^v2/weights\.safetensors: no axis_order in its metadata"):
            load(folder, tmp_path)
    (folder / "manifest.yaml").write_text(manifest)
    safetensors.numpy.save_file({"w": w}, str(folder / "weights.safetensors"), metadata={"axis_order": "xla"})
    model = load(folder, tmp_path)
    try:
        x = np.array([[1, 0, 0]], np.float32)
        [output] = model.infer([NamedTensor.from_array("input", x)])
        np.testing.assert_array_equal(output.data, x @ w)
    finally:
        model.unload()


def _masked(x, mask):
    import jax.numpy as jnp

    return jnp.where(mask, x, 0.0)


def test_a_bool_weight_holding_a_byte_other_than_0_or_1_is_refused_naming_it(tmp_path) -> None:
    """Found by the XLA read hunt: a BOOL weight of bytes [2, 1, 0, 255] was taken, and XLA read byte 2 as true for
    logical_and and false for select: contradictory answers, OK."""
    from nereid.backends.xla.export import export_bundle
    from nereid.backends.xla.safetensors import read_header

    folder = export_bundle(_masked, [np.zeros((1, 4), np.float32)], {"mask": np.array([1, 1, 0, 1], bool)},
                           directory=tmp_path / "masked", batch_sizes=[1], provenance=False)
    weights = folder / "weights.safetensors"
    header = read_header(weights)
    entry = header.tensors[0]
    data = bytearray(weights.read_bytes())
    data[entry.start:entry.end] = bytes([2, 1, 0, 255])  # (file offsets)
    weights.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"^weights\.safetensors: BOOL weight 'mask' holds byte 2 at element 0; each "
                                          r"element must be 0 \(false\) or 1 \(true\)$"):
        load(folder, tmp_path)
