"""Bundles that must not become READY: each is UNAVAILABLE with a reason that says what to fix."""

from __future__ import annotations

import numpy as np
import pytest
from tritonclient.utils import InferenceServerException

from nereid.backends.xla.safetensors import load_weights, write_safetensors


def reasons(server) -> dict[str, tuple[str, str]]:
    return {m.name: (m.state, m.reason) for m in server.client.get_model_repository_index().models}


def test_wrong_arity_bundles_are_refused_with_both_numbers(repo, serve, add_bundle) -> None:
    short = add_bundle(repo.models_dir, "mlp_bundle", "too_few_weights")
    weights = load_weights(short / "weights.safetensors")
    write_safetensors(short / "weights.safetensors", weights[:3])
    extra = add_bundle(repo.models_dir, "mlp_bundle", "too_many_weights")
    write_safetensors(extra / "weights.safetensors", [*weights, ("rng", np.zeros(2, np.uint32))])
    # No weights file at all was reported as "0 tensor(s) in weights.safetensors" and a captured value.
    (add_bundle(repo.models_dir, "mlp_bundle", "no_weights") / "weights.safetensors").unlink()
    server = serve(repo.write_config("- name: too_few_weights\n- name: too_many_weights\n- name: no_weights\n"))
    state, reason = reasons(server)["too_few_weights"]
    assert state == "UNAVAILABLE"
    for part in ("takes 5 argument(s)", "supplies 4", "1 input(s)", "3 tensor(s) in weights.safetensors",
                 "captured"):
        assert part in reason, reason
    state, reason = reasons(server)["too_many_weights"]
    assert state == "UNAVAILABLE"
    for part in ("takes 5 argument(s)", "supplies 6", "keep_unused=True"):
        assert part in reason, reason
    state, reason = reasons(server)["no_weights"]
    assert state == "UNAVAILABLE"
    for part in ("supplies 1", "no weights (weights.safetensors is missing)", "has no weights file"):
        assert part in reason, reason
    assert "captured" not in reason


def test_missing_gpu_makes_the_model_unavailable(repo, serve, add_bundle) -> None:
    import jax

    if any(d.platform == "gpu" for d in jax.devices()) or jax.default_backend() != "cpu":
        import pytest

        pytest.skip("a GPU is present: this test covers a machine without one")
    add_bundle(repo.models_dir, "mlp_bundle")
    server = serve(repo.write_config("- name: mlp_bundle\n  device: cuda:1\n"))
    state, reason = reasons(server)["mlp_bundle"]
    assert state == "UNAVAILABLE"
    assert "cuda:1" in reason and "no CUDA GPU backend" in reason and "models[0]" in reason


def test_bad_runtime_options_name_the_setting(repo, serve, add_bundle) -> None:
    add_bundle(repo.models_dir, "mlp_bundle", "a")
    add_bundle(repo.models_dir, "mlp_bundle", "b")
    add_bundle(repo.models_dir, "mlp_bundle", "c")
    server = serve(repo.write_config("""
        - name: a
          runtime: {batch_sizes: smallest}
        - name: b
          runtime: {compile_everything: true}
        - name: c
          runtime: {executable_cache: "yes"}
    """))
    index = reasons(server)
    assert "models[0].runtime.batch_sizes: must be one of all, largest, got 'smallest'" in index["a"][1]
    assert "models[1].runtime.compile_everything: unknown option of the xla backend" in index["b"][1]
    assert "models[2].runtime.executable_cache: must be true or false, got 'yes'" in index["c"][1]


def test_manifest_type_mismatch_is_named(repo, serve, add_bundle) -> None:
    bundle = add_bundle(repo.models_dir, "mlp_bundle")
    manifest = bundle / "manifest.yaml"
    manifest.write_text(manifest.read_text().replace("dims: {a: 16}", "dims: {a: 15}"))
    server = serve(repo.write_config("- name: mlp_bundle\n"))
    state, reason = reasons(server)["mlp_bundle"]
    assert state == "UNAVAILABLE"
    assert "parameter 0 (input 'input'" in reason and "tensor<1x16xf32>" in reason and "tensor<1x15xf32>" in reason
    # The reason named the model, which every place showing it names already: "failed to load model
    # 'mlp_bundle': model 'mlp_bundle': model.b1.mlir: ...".
    assert reason.startswith("model.b1.mlir: parameter 0 (input 'input'"), reason
    with pytest.raises(InferenceServerException) as caught:
        server.client.load_model("mlp_bundle")
    assert caught.value.message().startswith("failed to load model 'mlp_bundle': model.b1.mlir: parameter 0")


def test_reversed_shapes_get_a_hint(repo, serve, add_bundle) -> None:
    bundle = add_bundle(repo.models_dir, "embedding")
    manifest = bundle / "manifest.yaml"
    # ids is row-major [batch, 3], so the manifest says "an" with a: 3; writing it row-major is the classic slip.
    manifest.write_text(manifest.read_text().replace("shape: an\n  dims: {a: 3}", "shape: na\n  dims: {a: 3}", 1))
    server = serve(repo.write_config("- name: embedding\n"))
    state, reason = reasons(server)["embedding"]
    assert state == "UNAVAILABLE" and "column-major" in reason, reason


def test_broken_model_py_is_reported_with_its_line(repo, serve, add_bundle) -> None:
    raises = add_bundle(repo.models_dir, "mlp_hooks", "raises")
    (raises / "model.py").write_text("import nereid\n\nraise RuntimeError('boom')\n")
    silent = add_bundle(repo.models_dir, "mlp_hooks", "silent")
    (silent / "model.py").write_text("x = 1\n")
    twice = add_bundle(repo.models_dir, "mlp_hooks", "twice")
    (twice / "model.py").write_text("import nereid\nnereid.register_model()\nnereid.register_model()\n")
    server = serve(repo.write_config("- name: raises\n- name: silent\n- name: twice\n"))
    index = reasons(server)
    assert "model.py:3 failed: RuntimeError: boom" in index["raises"][1]
    assert "did not call nereid.register_model" in index["silent"][1]
    assert "called nereid.register_model 2 times" in index["twice"][1]


def test_client_specs_without_model_py_are_refused(repo, serve, add_bundle) -> None:
    bundle = add_bundle(repo.models_dir, "mlp_hooks")
    (bundle / "model.py").unlink()
    server = serve(repo.write_config("- name: mlp_hooks\n"))
    state, reason = reasons(server)["mlp_hooks"]
    assert state == "UNAVAILABLE"
    assert "manifest.yaml: client_inputs: allowed only in a bundle with a model.py" in reason
    assert "['pixels']" in reason


def test_hook_returning_the_wrong_type_is_an_internal_error(repo, serve, add_bundle) -> None:
    import pytest
    import tritonclient.grpc as triton
    from tritonclient.utils import InferenceServerException

    bundle = add_bundle(repo.models_dir, "mlp_hooks")
    text = (bundle / "model.py").read_text()
    (bundle / "model.py").write_text(text.replace("return [NamedTensor.from_array(\"input\"",
                                                  "return {\"x\": NamedTensor.from_array(\"input\"").replace(
        "/ 255.0)]", "/ 255.0)}"))
    server = serve(repo.write_config("- name: mlp_hooks\n"))
    tensor = triton.InferInput("pixels", [1, 16], "UINT8")
    tensor.set_data_from_numpy(np.zeros((1, 16), np.uint8))
    with pytest.raises(InferenceServerException) as caught:
        server.client.infer("mlp_hooks", [tensor])
    assert caught.value.status() == "StatusCode.INTERNAL"
    # Named by its type and keys: numpy's printout of the arrays inside spanned lines and was cut mid-token.
    assert caught.value.message() == ("model 'mlp_hooks': the preprocess hook returned dict with 1 key(s) 'x', "
                                      "expected a list of NamedTensor")
    # A tuple of NamedTensor is taken, as plugin hooks' is.
    (bundle / "model.py").write_text(text.replace("return [NamedTensor.from_array(\"input\"",
                                                  "return (NamedTensor.from_array(\"input\"").replace(
        "/ 255.0)]", "/ 255.0),)"))
    server.client.load_model("mlp_hooks")
    assert server.client.infer("mlp_hooks", [tensor]).as_numpy("logits").shape == (1, 4)


def test_a_model_py_that_calls_sys_exit_fails_its_load_and_the_server_serves_on(repo, serve, add_bundle) -> None:
    bundle = add_bundle(repo.models_dir, "mlp_hooks")
    (bundle / "model.py").write_text("import sys\nsys.exit(0)\n")
    add_bundle(repo.models_dir, "mlp_bundle")
    server = serve(repo.write_config("- name: mlp_hooks\n- name: mlp_bundle\n"))
    state, reason = reasons(server)["mlp_hooks"]
    assert state == "UNAVAILABLE" and "model.py:2 called sys.exit(0) while loading" in reason
    assert server.client.is_model_ready("mlp_bundle") and server.client.is_server_live()


def test_a_fifo_manifest_or_a_model_py_folder_is_named_by_nereid_check(repo, add_bundle, capsys) -> None:
    """A FIFO manifest.yaml gave "no backend claims the folder"; a folder named model.py was served without hooks."""
    import os

    from nereid.cli import check
    from nereid.plugins import make_plugin_manager
    from nereid.settings import load_settings

    fifo = add_bundle(repo.models_dir, "mlp_bundle", "fifo_manifest")
    (fifo / "manifest.yaml").unlink()
    os.mkfifo(fifo / "manifest.yaml")
    (add_bundle(repo.models_dir, "mlp_bundle", "folder_model_py") / "model.py").mkdir()
    config = repo.write_config("- name: fifo_manifest\n- name: folder_model_py\n")
    assert check(load_settings(config), make_plugin_manager(load_entry_points=False)) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"fifo_manifest: UNAVAILABLE: {fifo / 'manifest.yaml'}: is a FIFO, not a regular file"
    assert lines[1].startswith("folder_model_py: UNAVAILABLE: ")
    assert lines[1].endswith("model.py: is a directory, not a regular file (a bundle's model.py holds its hooks)")


_TWO_FLOATS = ('format_version: "2.1"\nexecutable_inputs:\n  - {name: x, dtype: f32, shape: "a", dims: {a: 2}}\n'
               'executable_outputs:\n  - {name: y, dtype: f32, shape: "a", dims: {a: 2}}\n')
_DONATED_WEIGHT = """
func.func @main(%arg0: tensor<2xf32>, %arg1: tensor<2xf32> {tf.aliasing_output = 0 : i32}) -> tensor<2xf32> {
  %0 = stablehlo.add %arg0, %arg1 : tensor<2xf32>
  return %0 : tensor<2xf32>
}
"""
_PYTHON_CALLBACK = """
func.func @main(%arg0: tensor<2xf32>, %arg1: tensor<2xf32>) -> tensor<2xf32> {
  %0 = stablehlo.custom_call @xla_ffi_python_cpu_callback(%arg0) {api_version = 4 : i32, backend_config = {index = 0 : ui64}, has_side_effect = true} : (tensor<2xf32>) -> tensor<2xf32>
  return %0 : tensor<2xf32>
}
"""
# Inside the program only: neither a parameter nor a result is too large.
_TOO_LARGE_INSIDE = """
func.func @main(%arg0: tensor<2xf32>, %arg1: tensor<2xf32>) -> tensor<2xf32> {
  %0 = stablehlo.constant dense<0.0> : tensor<f32>
  %1 = stablehlo.broadcast_in_dim %0, dims = [] : (tensor<f32>) -> tensor<3037000500x3037000500xf32>
  %2 = stablehlo.reduce(%1 init: %0) applies stablehlo.add across dimensions = [0, 1]
       : (tensor<3037000500x3037000500xf32>, tensor<f32>) -> tensor<f32>
  %3 = stablehlo.broadcast_in_dim %2, dims = [] : (tensor<f32>) -> tensor<2xf32>
  %4 = stablehlo.add %arg0, %3 : tensor<2xf32>
  return %4 : tensor<2xf32>
}
"""
_TOO_LARGE = """
func.func @main(%arg0: tensor<2xf32>, %arg1: tensor<2xf32>) -> tensor<3037000500x3037000500xf32> {
  %0 = stablehlo.constant dense<0.0> : tensor<f32>
  %1 = stablehlo.broadcast_in_dim %0, dims = [] : (tensor<f32>) -> tensor<3037000500x3037000500xf32>
  return %1 : tensor<3037000500x3037000500xf32>
}
"""


def test_programs_that_would_fail_after_their_first_run_or_crash_the_server_are_refused(repo, serve) -> None:
    """Defects (found by a bug hunt, each reproduced): a program donating a weight's buffer (an export with
    donate_argnums) answered once, then failed every request ('Buffer has been deleted or donated'); one calling
    back into Python loaded READY and its first request killed the server (SIGSEGV); a result too large for XLA to
    size aborted the whole server as it compiled (SIGABRT)."""
    for name, program in (("donated", _DONATED_WEIGHT), ("callback", _PYTHON_CALLBACK), ("too_large", _TOO_LARGE),
                          ("too_large_inside", _TOO_LARGE_INSIDE)):
        folder = repo.models_dir / name
        folder.mkdir()
        (folder / "model.mlir").write_text(program)
        write_safetensors(folder / "weights.safetensors", [("w", np.array([10, 20], np.float32))])
        (folder / "manifest.yaml").write_text(_TWO_FLOATS)
    server = serve(repo.write_config("- name: donated\n- name: callback\n- name: too_large\n"
                                     "- name: too_large_inside\n"))
    found = reasons(server)
    assert found["donated"][0] == "UNAVAILABLE" and "takes over the buffers of weight(s) 'w' (donated" in \
        found["donated"][1]
    assert found["callback"][0] == "UNAVAILABLE" and "calls back into Python (xla_ffi_python_cpu_callback" in \
        found["callback"][1]
    assert found["too_large"][0] == "UNAVAILABLE" and "result 0 is tensor<3037000500x3037000500xf32>" in \
        found["too_large"][1] and "past what XLA can size" in found["too_large"][1]
    # (Found since: a tensor inside the program only aborted the server just the same.)
    assert found["too_large_inside"][0] == "UNAVAILABLE" and "holds tensor<3037000500x3037000500xf32>" in \
        found["too_large_inside"][1] and "past what XLA can size" in found["too_large_inside"][1]
    assert server.client.is_server_live()


@pytest.mark.parametrize("program, refused", [
    (_DONATED_WEIGHT, "model.mlir: the program takes over the buffers of weight(s) 'w' (donated"),
    (_PYTHON_CALLBACK, "model.mlir: the program calls back into Python (xla_ffi_python_cpu_callback: "),
], ids=["donates-a-weight", "calls-back-into-python"])
def test_bundle_check_refuses_a_program_the_server_refuses(tmp_path, program: str, refused: str) -> None:
    """Found by README checks: `nereid bundle check` called such bundles servable (exit 0), which the server then
    refused at load; both now give the same reason."""
    from nereid.backends.xla.arity import bundle_type_problem

    folder = tmp_path / "refused"
    folder.mkdir()
    (folder / "model.mlir").write_text(program)
    write_safetensors(folder / "weights.safetensors", [("w", np.array([10, 20], np.float32))])
    (folder / "manifest.yaml").write_text(_TWO_FLOATS)
    problem = bundle_type_problem(folder)
    assert problem is not None and problem.startswith(refused), problem


CLIENT_INPUTS_PTS = """client_inputs:
- {name: pts, dtype: f64, shape: ac, dims: {a: 2, c: 64}}
"""


def test_client_tensors_that_an_omitted_hook_cannot_convert_are_refused_at_load(repo, serve, add_bundle) -> None:
    """An omitted hook is the identity: circle_select registers only postprocess, so client_inputs that differ from
    executable_inputs loaded READY and every request failed INTERNAL, blaming the preprocess hook it does not
    have. The same for client_outputs without postprocess; equal client tensors (in any order) are fine."""
    no_preprocess = add_bundle(repo.models_dir, "circle_select", "no_preprocess")
    with open(no_preprocess / "manifest.yaml", "a") as manifest:
        manifest.write(CLIENT_INPUTS_PTS)
    same_inputs = add_bundle(repo.models_dir, "circle_select", "same_inputs")
    with open(same_inputs / "manifest.yaml", "a") as manifest:
        manifest.write(CLIENT_INPUTS_PTS.replace("pts, dtype: f64", "points, dtype: f32"))
    no_postprocess = add_bundle(repo.models_dir, "mlp_hooks", "no_postprocess")
    text = (no_postprocess / "model.py").read_text()
    (no_postprocess / "model.py").write_text(text.replace("postprocess=to_class", ""))
    server = serve(repo.write_config("- name: no_preprocess\n- name: same_inputs\n- name: no_postprocess\n"))
    index = reasons(server)
    state, reason = index["no_preprocess"]
    assert state == "UNAVAILABLE"
    # (Paths as the repository index reports them to clients: from the model repository.)
    assert ("no_preprocess/manifest.yaml: client_inputs: 'pts' is not in executable_inputs ('points'), but "
            "no_preprocess/model.py registers no preprocess hook (an omitted hook is the identity, so "
            "client_inputs must be executable_inputs): register preprocess to convert them, or remove "
            "client_inputs") in reason, reason
    assert index["same_inputs"][0] == "READY"
    state, reason = index["no_postprocess"]
    assert state == "UNAVAILABLE"
    assert ("no_postprocess/manifest.yaml: client_outputs: 'class' is not in executable_outputs ('logits'), but "
            "no_postprocess/model.py registers no postprocess hook") in reason, reason
