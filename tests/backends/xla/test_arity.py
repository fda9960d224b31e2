"""The arity check (arity.py): each program takes exactly inputs + weights arguments; the report of a bundle, and
the program type check beside it, both never raising."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from nereid.backends.xla.arity import (BundleArity, ModuleArity, arity_mismatch, bundle_entry_arity,
                                       bundle_type_problem, check_bundle, donated_weights_problem)
from nereid.backends.xla.export import assert_bundle_arity, bundle_arity_report, examples
from nereid.backends.xla.program import read_program
from nereid.backends.xla.safetensors import load_weights, write_safetensors
from nereid.errors import ConfigError

# Three parameters, the second donated (as jax.jit(..., donate_argnums=1) exports it).
DONATING = read_program("""
func.func @main(%arg0: tensor<2xf32>, %arg1: tensor<2xf32> {tf.aliasing_output = 0 : i32}, %arg2: tensor<3xi32>)
    -> tensor<2xf32> {
  return %arg0 : tensor<2xf32>
}
""", "model.mlir")
SHOWN = "(tensor<2xf32>, tensor<2xf32>, tensor<3xi32>)"


def test_report_api(tmp_path) -> None:
    good = examples.write_mlp(tmp_path, provenance=False)
    report = assert_bundle_arity(good)
    assert (report.n_inputs, report.n_weights, report.expected) == (1, 4, 5)
    assert [m.file for m in report.modules] == ["model.b1.mlir", "model.b8.mlir", "model.b32.mlir"]
    write_safetensors(good / "weights.safetensors", [*load_weights(good / "weights.safetensors"),
                                                     ("extra", np.zeros(1, np.float32))])
    report = bundle_arity_report(good)
    assert not report.servable and report.n_weights == 5 and report.expected == 5
    (good / "weights.safetensors").unlink()  # named as missing, not as "0 tensor(s)" and a captured value
    report = bundle_arity_report(good)
    assert not report.servable and "no weights (weights.safetensors is missing)" in report.error
    assert "captured" not in report.error
    # Each of the three programs named, the shared cause said once, after them (it was repeated, joined by ".;")
    assert report.error.count("weights.safetensors is missing") == 3 and ".;" not in report.error
    assert report.error.count("The bundle has no weights file") == 1
    assert report.error.endswith("is missing). The bundle has no weights file: a program that takes weights needs "
                                 "its weights.safetensors (or its shards and index) beside it.")


def test_an_arity_that_agrees_is_no_mismatch() -> None:
    assert arity_mismatch("model.mlir", DONATING, 1, 2) is None
    assert arity_mismatch("model.mlir", DONATING, 3, 0, weights_present=False) is None


def test_a_program_wanting_more_than_the_weights_supply_blames_a_captured_value() -> None:
    problem = arity_mismatch("model.mlir", DONATING, 1, 1)
    assert problem.startswith(f"model.mlir: the program takes 3 argument(s) {SHOWN} but the bundle supplies 2: "
                              "1 input(s) from the manifest + 1 tensor(s) in weights.safetensors. The usual cause "
                              "is a value the traced function captured"), problem


def test_a_program_wanting_more_without_a_weights_file_blames_the_missing_file_only() -> None:
    problem = arity_mismatch("model.mlir", DONATING, 1, 0, "w.safetensors", weights_present=False)
    assert problem == (f"model.mlir: the program takes 3 argument(s) {SHOWN} but the bundle supplies 1: 1 input(s) "
                       "from the manifest + no weights (w.safetensors is missing). The bundle has no weights file: a "
                       "program that takes weights needs its w.safetensors (or its shards and index) beside it.")


def test_a_program_wanting_fewer_blames_an_argument_dropped_at_export() -> None:
    problem = arity_mismatch("model.mlir", DONATING, 1, 3)
    assert "supplies 4: 1 input(s) from the manifest + 3 tensor(s) in weights.safetensors" in problem
    assert "keep_unused=True" in problem and "captured" not in problem


def test_a_long_parameter_list_is_shown_cut_after_six() -> None:
    parameters = ", ".join(f"%arg{i}: tensor<{i + 1}xf32>" for i in range(8))
    program = read_program(f"func.func @main({parameters}) -> tensor<1xf32> {{ return %arg0 : tensor<1xf32> }}", "m")
    problem = arity_mismatch("m", program, 1, 2)
    assert "(tensor<1xf32>, tensor<2xf32>, tensor<3xf32>, tensor<4xf32>, tensor<5xf32>, tensor<6xf32>, ...)" in problem
    assert "tensor<7xf32>" not in problem


def test_a_donated_weight_is_named_and_a_donated_input_is_harmless() -> None:
    problem = donated_weights_problem("model.mlir", DONATING, 1, ["w", "v"])
    assert problem.startswith("model.mlir: the program takes over the buffers of weight(s) 'w' (donated: "), problem
    assert problem.endswith("export it without donating the weights")
    assert donated_weights_problem("model.mlir", DONATING, 2, ["v"]) is None  # parameter 1 is an input then


def test_the_entry_arity_of_a_file_and_a_path_it_cannot_read(tmp_path) -> None:
    program = tmp_path / "model.mlir"
    program.write_text("func.func @main(%a: tensor<2xf32>, %b: tensor<2xf32>) -> tensor<2xf32> "
                       "{ return %a : tensor<2xf32> }")
    assert bundle_entry_arity(program) == 2
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: cannot read: Is a directory$"):
        bundle_entry_arity(tmp_path)


def test_report_lines_as_bundle_check_prints_them(tmp_path) -> None:
    modules = (ModuleArity("model.b1.mlir", 5), ModuleArity("model.b8.mlir", 5))
    servable = BundleArity(tmp_path, True, 1, 4, 5, modules)
    assert servable.line() == (f"{tmp_path}: servable: 1 input(s) + 4 weight(s) = 5 argument(s), taken by "
                               "model.b1.mlir, model.b8.mlir")
    sharded = BundleArity(tmp_path, True, 1, 4, 5, modules, weights_source="3 shard(s) (index.json)")
    assert " + 4 weight(s) in 3 shard(s) (index.json) = 5 argument(s)" in sharded.line()
    assert BundleArity(tmp_path, False, None, None, None, error="why").line() == f"{tmp_path}: UNSERVABLE: why"


def test_check_bundle_runs_the_type_check_only_when_asked_and_the_arity_is_right(tmp_path) -> None:
    good = examples.write_mlp(tmp_path, provenance=False)
    report, problem = check_bundle(good)
    assert report.servable and problem is None and bundle_type_problem(good) is None
    wrong_dim = Path(shutil.copytree(good, tmp_path / "wrong_dim"))
    manifest = wrong_dim / "manifest.yaml"
    manifest.write_text(manifest.read_text().replace("dims: {a: 16}", "dims: {a: 15}"))
    report, problem = check_bundle(wrong_dim)
    assert report.servable  # the arity is right: only the types are not
    assert problem == ("model.b1.mlir: parameter 0 (input 'input', manifest shape 'an') is tensor<1x16xf32> in the "
                       "program but the bundle declares tensor<1x15xf32>")
    assert bundle_type_problem(wrong_dim) == problem
    assert check_bundle(wrong_dim, types=False) == (report, None)


def test_check_bundle_never_raises_and_reports_why(tmp_path) -> None:
    report, problem = check_bundle(tmp_path / "absent")
    assert not report.servable and problem is None
    assert report.error == f"{tmp_path / 'absent'}: missing manifest.yaml (a bundle holds manifest.yaml, model*.mlir " \
                           "and usually weights.safetensors)"
    assert bundle_type_problem(tmp_path / "absent") == report.error
    with pytest.raises(ConfigError, match="missing manifest.yaml"):
        assert_bundle_arity(tmp_path / "absent")
