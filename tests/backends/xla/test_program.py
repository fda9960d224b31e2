"""Reading a program's parameters and results out of a StableHLO portable artifact (no compiling)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax import export as jax_export

from nereid.backends.xla.arity import bundle_entry_arity
from nereid.backends.xla.program import is_bytecode, read_program, to_portable_artifact
from nereid.dtypes import DType
from nereid.errors import ConfigError


def exported_artifact() -> bytes:
    def f(x, w, flags):
        return (x @ w).astype(jax.numpy.bfloat16), flags.sum()

    exported = jax_export.export(jax.jit(f, keep_unused=True), platforms=["cpu"])(
        jax.ShapeDtypeStruct((8, 3), np.float32), jax.ShapeDtypeStruct((3, 2), np.float32),
        jax.ShapeDtypeStruct((4,), np.int32))
    return exported.mlir_module_serialized


def test_reads_parameters_and_results() -> None:
    artifact = exported_artifact()
    assert is_bytecode(artifact)
    program = read_program(artifact, "model.mlir")
    assert program.arity == 3
    assert [(p.shape, p.dtype) for p in program.parameters] == [
        ((8, 3), DType.FP32), ((3, 2), DType.FP32), ((4,), DType.INT32)]
    assert [(r.shape, r.dtype) for r in program.results] == [((8, 2), DType.BF16), ((), DType.INT32)]
    assert program.parameters[0].describe() == "tensor<8x3xf32>" and program.results[1].describe() == "tensor<i32>"


def test_a_program_is_read_without_starting_mlir_s_thread_pool(monkeypatch) -> None:
    """Found by the exhaustion hunt: the MLIR context a load reads its program in started a thread pool, and at a
    process limit LLVM aborted the whole server ("LLVM ERROR: pthread_create failed")."""
    from jaxlib.mlir import ir

    told: list[bool] = []
    real = ir.Context.enable_multithreading

    def enable_multithreading(context, enabled: bool) -> None:
        real(context, enabled)
        told.append(enabled)

    monkeypatch.setattr(ir.Context, "enable_multithreading", enable_multithreading)
    assert read_program(exported_artifact(), "model.mlir").arity == 3
    # (jaxlib's Context() turns it on, its pool's threads started at the first parallel work: turned off before.)
    assert told == [True, False]


def test_text_modules_are_read_and_converted() -> None:
    text = """
    func.func @main(%arg0: tensor<2xf32>, %arg1: tensor<2xui64>) -> tensor<2xf32> {
      return %arg0 : tensor<2xf32>
    }
    """
    assert read_program(text, "model.mlir").arity == 2
    artifact = to_portable_artifact(text)
    assert is_bytecode(artifact) and read_program(artifact, "x").parameters[1].dtype is DType.UINT64


def test_text_that_does_not_parse_or_serialize_says_why_and_prints_nothing(capfd) -> None:
    undeclared = """
    func.func @main(%arg0: tensor<2xf32>) -> tensor<2xf32> {
      %0 = stablehlo.add %arg0, %arg1 : tensor<2xf32>
      return %0 : tensor<2xf32>
    }
    """
    with pytest.raises(ConfigError, match="model.mlir: not a StableHLO module: error: line 3:33: use of undeclared "
                                          "SSA value name"):
        read_program(undeclared, "model.mlir")
    chlo = """
    func.func @main(%arg0: tensor<2xf32>) -> tensor<2xf32> {
      %0 = chlo.erf_inv %arg0 : tensor<2xf32> -> tensor<2xf32>
      return %0 : tensor<2xf32>
    }
    """
    with pytest.raises(ConfigError, match=r"model.mlir: not a portable StableHLO module \(line \d+:\d+: .*\): it "
                                          "holds operations outside StableHLO"):
        read_program(chlo, "model.mlir")
    assert capfd.readouterr().err == ""  # the reasons are in the errors, not on the server's stderr


def test_unreadable_modules_name_the_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="model.b8.mlir: not a StableHLO module"):
        read_program(b"this is not mlir", "model.b8.mlir")
    with pytest.raises(ConfigError, match="model.mlir: not a readable StableHLO portable artifact"):
        read_program(b"ML\xefR" + b"\x00" * 20, "model.mlir")
    with pytest.raises(ConfigError, match="model.mlir: the module is empty"):
        read_program(b"", "model.mlir")
    with pytest.raises(ConfigError, match=r"model.mlir: neither MLIR bytecode .* nor UTF-8 MLIR text"):
        read_program(b"ML\xef", "model.mlir")  # bytecode cut inside its magic number
    with pytest.raises(ConfigError, match="has no 'main' function .*functions: other"):
        read_program("func.func @other() -> () { return }", "model.mlir")
    path = tmp_path / "model.mlir"
    path.write_bytes(exported_artifact())
    assert bundle_entry_arity(path) == 3
    with pytest.raises(ConfigError, match="cannot read"):
        bundle_entry_arity(tmp_path / "absent.mlir")


def test_a_private_main_is_refused_naming_the_file() -> None:
    """A private main was read as the entry: the check called the bundle servable, and XLA's compile then failed
    with "conversion requires module with `main` function" and an MLIR dump."""
    body = "@main(%arg0: tensor<2xf32>) -> tensor<2xf32> { return %arg0 : tensor<2xf32> }"
    with pytest.raises(ConfigError) as caught:
        read_program(f"func.func private {body}", "model.mlir")
    assert str(caught.value) == ("model.mlir: the entry function 'main' is private (sym_visibility = \"private\"); "
                                 "it must be public")
    assert read_program(f"func.func public {body}", "model.mlir").arity == 1
    assert read_program(f"func.func {body}", "model.mlir").arity == 1  # (no visibility: public)


def test_a_cut_short_artifact_says_why_and_prints_nothing(capfd) -> None:
    # MLIR's reader reports its reason as a diagnostic, which it would print to the server's stderr.
    artifact = exported_artifact()
    for length in (40, len(artifact) // 2, len(artifact) - 3):
        with pytest.raises(ConfigError) as caught:
            read_program(artifact[:length], "model.b8.mlir")
        message = str(caught.value)
        assert message.startswith("model.b8.mlir: not a readable StableHLO portable artifact (")
        assert "failed to deserialize portable artifact" in message  # the reader's own words
        assert "damaged or cut short" in message
    assert capfd.readouterr().err == ""


LAYOUT_PROGRAM = """
func.func public @main(%arg0: tensor<2x3xf32> {mhlo.layout_mode = "MODE"}, %arg1: tensor<2x3xf32>)
    -> tensor<2x3xf32> {
  %0 = stablehlo.multiply %arg0, %arg1 : tensor<2x3xf32>
  return %0 : tensor<2x3xf32>
}
"""


def test_a_parameter_exported_with_a_layout_of_its_own_is_refused_and_the_compilers_choice_is_checked() -> None:
    """Found by a bug hunt: a program exported with a column-major input (jax.jit's in_shardings with a Layout)
    loaded READY and answered wrong numbers, reading nereid's row-major arguments as column-major; `nereid bundle
    check` called it servable. An "auto" layout is the compiler's choice (row-major on CPU, maybe not on a GPU):
    what was compiled is checked."""
    from jax._src.lib import xla_client

    from nereid.backends.xla.program import parameter_layout_problem

    with pytest.raises(ConfigError) as refused:
        read_program(LAYOUT_PROGRAM.replace("MODE", "{0,1}"), "model.mlir")
    assert str(refused.value).startswith("model.mlir: parameter 0 (tensor<2x3xf32>) was exported with a layout of "
                                         "its own (mhlo.layout_mode = {0,1}), but nereid passes every argument in "
                                         "the default row-major layout"), refused.value
    device = jax.devices("cpu")[0]
    for mode in ("default", "auto", "{0,1}"):
        text = LAYOUT_PROGRAM.replace("MODE", mode)
        program = read_program(LAYOUT_PROGRAM.replace("MODE", "default"), "model.mlir")  # (read, not refused)
        executable = device.client.compile_and_load(to_portable_artifact(text), [device],
                                                    xla_client.CompileOptions())
        problem = parameter_layout_problem("model.mlir", program, executable, device.client, device)
        if mode == "{0,1}":  # as a compiler choosing a layout of its own for "auto" would leave it
            assert problem == ("model.mlir: parameter 0 (tensor<2x3xf32>) was compiled for the layout {0,1}, not the "
                               "default {1,0} in which nereid passes its arguments, so the program would read them "
                               "wrongly: export it without a custom or automatic input layout"), problem
        else:
            assert problem is None, (mode, problem)


@pytest.mark.parametrize("mode, shape", [("{1,0}", "2x3"), ("{0}", "5"), ("{}", ""), ("{0,1}", "2x1")],
                         ids=["row-major", "rank-1", "scalar", "size-1-axis"])
def test_a_layout_written_out_that_is_row_major_is_taken(mode: str, shape: str) -> None:
    """The hunt of the layout check: an older exporter writes the default layout out (mhlo.layout_mode = "{1,0}"),
    and such programs, which loaded and answered right, were refused. So is any order differing only in axes of
    one element."""
    tensor = f"tensor<{shape + 'x' if shape else ''}f32>"
    text = (f'func.func public @main(%arg0: {tensor} {{mhlo.layout_mode = "{mode}"}}) -> {tensor} {{\n'
            f"  return %arg0 : {tensor}\n}}\n")
    program = read_program(text, "model.mlir")
    assert program.arity == 1
    # Compiled, the layout XLA keeps for it is taken too (the README walkthrough: a 4x1 input's {0,1} refused).
    from jax._src.lib import xla_client

    from nereid.backends.xla.program import parameter_layout_problem

    device = jax.devices("cpu")[0]
    executable = device.client.compile_and_load(to_portable_artifact(text), [device], xla_client.CompileOptions())
    assert parameter_layout_problem("model.mlir", program, executable, device.client, device) is None
