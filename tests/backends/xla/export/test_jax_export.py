"""export_bundle: tracing a JAX function at each batch size into a servable bundle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from nereid.backend import ModelContext
from nereid.backends.xla.arity import bundle_arity_report
from nereid.backends.xla.manifest import load_manifest
from nereid.backends.xla.model import XlaModel
from nereid.backends.xla.export import ExportError, export_bundle
from nereid.settings import ModelSettings
from nereid.tensors import NamedTensor


def serve_once(directory, inputs: list[NamedTensor]) -> list[NamedTensor]:
    model = XlaModel(ModelContext(directory.name, directory, ModelSettings(directory.name), directory, "test"))
    model.load()
    try:
        return model.infer(inputs)
    finally:
        model.unload()


def test_batched_export_round_trips(tmp_path) -> None:
    def f(x, w):
        return jnp.tanh(x @ w), x.sum(axis=1)

    w = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    directory = export_bundle(f, [np.zeros((1, 5), np.float32)], {"w": w}, directory=tmp_path / "f",
                              batch_sizes=[4, 2], output_names=["h", "s"], provenance=False)
    manifest = load_manifest(directory / "manifest.yaml")
    assert manifest.batching.compiled_batch_sizes == (2, 4)
    assert [(t.name, t.shape_string) for t in manifest.executable_outputs] == [("h", "an"), ("s", "n")]
    assert manifest.executable_inputs[0].name == "input"
    x = np.random.default_rng(1).standard_normal((3, 5)).astype(np.float32)
    h, s = serve_once(directory, [NamedTensor.from_array("input", x)])
    expected_h, expected_s = jax.jit(f)(x, w)
    np.testing.assert_allclose(h.data, expected_h, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s.data, expected_s, rtol=1e-6, atol=1e-6)


def test_tensors_are_named_input_and_output_by_default_numbered_when_there_are_several(tmp_path) -> None:
    """The names the README gives for an export without input_names= / output_names= (the new-user hunt found
    them documented nowhere)."""
    one = export_bundle(lambda x: x + 1, [np.zeros((1, 2), np.float32)], {}, directory=tmp_path / "one",
                        batch_sizes=[1], provenance=False)
    two = export_bundle(lambda x, y: (x + y, x - y), [np.zeros((1, 2), np.float32)] * 2, {},
                        directory=tmp_path / "two", batch_sizes=[1], provenance=False)
    names = {d.name: [[t.name for t in tensors] for tensors in (m.executable_inputs, m.executable_outputs)]
             for d in (one, two) for m in [load_manifest(d / "manifest.yaml")]}
    assert names == {"one": [["input"], ["output"]], "two": [["input_0", "input_1"], ["output_0", "output_1"]]}


def test_unused_weights_still_count(tmp_path) -> None:
    # jax.export drops arguments the program never reads unless jitted with keep_unused.
    def f(x, used, unused):
        return x * used

    directory = export_bundle(f, [np.zeros(3, np.float32)], {"used": np.float32(2), "unused": np.zeros(4, np.int8)},
                              directory=tmp_path / "f", provenance=False)
    report = bundle_arity_report(directory)
    assert report.servable and (report.n_inputs, report.n_weights, report.expected) == (1, 2, 3)


def test_output_batch_axes_must_really_be_batch_axes(tmp_path) -> None:
    def f(x):
        return x.sum(axis=0)  # no batch axis left

    with pytest.raises(ExportError, match=r"axis 0 is not its batch axis; pass output_batch_axes"):
        export_bundle(f, [np.zeros((1, 3), np.float32)], {}, directory=tmp_path / "f", batch_sizes=[1, 2],
                      provenance=False)
    directory = export_bundle(f, [np.zeros((1, 3), np.float32)], {}, directory=tmp_path / "f", batch_sizes=[1, 2],
                              output_batch_axes=[None], provenance=False)
    assert load_manifest(directory / "manifest.yaml").executable_outputs[0].batch_axis is None


def test_64_bit_types_are_kept(tmp_path) -> None:
    def f(ids, offset):
        return ids + offset

    directory = export_bundle(f, [np.zeros((1, 2), np.int64)], {"offset": np.int64(2 ** 40)},
                              directory=tmp_path / "f", batch_sizes=[1], provenance=False)
    out, = serve_once(directory, [NamedTensor.from_array("input", np.array([[1, 2]], np.int64))])
    assert out.data.dtype == np.int64 and out.data.tolist() == [[2 ** 40 + 1, 2 ** 40 + 2]]



def _wide_sum(x):
    """1e8 + x - 1e8 in float64, handed back as float32 (0.25 in 32 bits is lost under 1e8), and x as float64."""
    wide = x.astype(jnp.float64)
    return ((wide + 1e8) - 1e8).astype(jnp.float32), wide


def _scaled_shift(x, s, n):
    return x * s + n


def test_python_numbers_and_lists_take_jax_s_width_and_make_no_x64_bundle(tmp_path) -> None:
    """Found by the export hunt: numpy makes 0.5 a float64, so a weight written as a Python number (or a list as
    an example input) made the whole bundle x64, serving FP64 where jax.jit of the same function gives float32."""
    x = np.array([[1.0, 2.0]], np.float32)
    expected = np.asarray(jax.jit(_scaled_shift)(x, 0.5, 2))
    assert expected.dtype == np.float32
    directory = export_bundle(_scaled_shift, [[[0.0, 0.0]]], {"s": 0.5, "n": 2}, directory=tmp_path / "py",
                              batch_sizes=[1], provenance=False)
    manifest = load_manifest(directory / "manifest.yaml")
    assert [t.dtype.numpy for t in (*manifest.executable_inputs, *manifest.executable_outputs)] == [np.float32] * 2
    out, = serve_once(directory, [NamedTensor.from_array("input", x)])
    assert out.data.dtype == np.float32 and out.data.tolist() == expected.tolist() == [[2.5, 3.0]]
    # A numpy float64 still says what it is (x64), as does a session with x64 on for Python numbers.
    wide = export_bundle(_scaled_shift, [np.zeros((1, 2), np.float32)], {"s": np.float64(0.5), "n": 2},
                         directory=tmp_path / "np", batch_sizes=[1], provenance=False)
    assert load_manifest(wide / "manifest.yaml").executable_outputs[0].dtype.numpy == np.float64
    # Under x64 (the session's, or asked for) the numbers are 64-bit, and weakly typed as in jax: a float32
    # input's answer stays float32, as jax.jit's does (the review hunts).
    with jax.enable_x64(True):
        session = export_bundle(_scaled_shift, [np.zeros((1, 2), np.float32)], [("s", 0.5), ("n", 2)],
                                directory=tmp_path / "session", batch_sizes=[1], provenance=False)
        assert np.asarray(jax.jit(_scaled_shift)(x, 0.5, 2)).dtype == np.float32
    assert load_manifest(session / "manifest.yaml").executable_outputs[0].dtype.numpy == np.float32
    # (An int 32 bits cannot hold was stored wrapped around, -1294967296, where jax.jit refuses it.)
    asked = export_bundle(_scaled_shift, [np.zeros((1, 2), np.float32)], {"s": 0.5, "n": 2},
                          directory=tmp_path / "asked", batch_sizes=[1], provenance=False, x64=True)
    assert load_manifest(asked / "manifest.yaml").executable_outputs[0].dtype.numpy == np.float32
    with pytest.raises(ExportError, match=r"^weights: weight 'n' holds an integer that 32 bits cannot hold"):
        export_bundle(_scaled_shift, [np.zeros((1, 2), np.float32)], {"s": 0.5, "n": 3_000_000_000},
                      directory=tmp_path / "big", batch_sizes=[1], provenance=False)


def test_a_session_with_x64_on_gets_an_x64_bundle(tmp_path) -> None:
    """Found by a bug hunt: with float32 examples the default x64 was False, and ``jax.enable_x64(False)`` turned
    the session's own setting off, so the float64 accumulator was traced in 32 bits (0.0 served where jax gives
    0.25) and the float64 output was served as FP32."""
    x = np.array([[0.25, 0.5]], np.float32)
    with jax.enable_x64(True):
        expected = jax.jit(_wide_sum)(x)
        directory = export_bundle(_wide_sum, [np.zeros((1, 2), np.float32)], {}, directory=tmp_path / "on",
                                  batch_sizes=[1], provenance=False)
    outputs = load_manifest(directory / "manifest.yaml").executable_outputs
    assert [t.dtype.numpy for t in outputs] == [np.float32, np.float64]
    total, wide = serve_once(directory, [NamedTensor.from_array("input", x)])
    assert total.data.tolist() == np.asarray(expected[0]).tolist() == [[0.25, 0.5]]
    assert wide.data.dtype == np.float64 and wide.data.tolist() == [[0.25, 0.5]]
    with jax.enable_x64(True), pytest.warns(UserWarning, match="float64 .* truncated to dtype float32"):
        narrow = export_bundle(_wide_sum, [np.zeros((1, 2), np.float32)], {}, directory=tmp_path / "off",
                               batch_sizes=[1], provenance=False, x64=False)  # still 32 bits
    assert [t.dtype.numpy for t in load_manifest(narrow / "manifest.yaml").executable_outputs] == [np.float32] * 2




@pytest.mark.parametrize("inputs,weights,named", [
    ([np.zeros((1, 2), np.float64)], {}, "example input 0 ('input') (float64)"),
    ([np.zeros((1, 2), np.float32)], [("s", np.float32(2)), ("n", np.int64(1))], "weight 'n' (int64)")])
def test_x64_off_with_a_64_bit_value_is_refused_naming_the_value(tmp_path, inputs, weights, named) -> None:
    """Noticed by the stop 56 exporter hunt: a 64-bit example or weight traced with x64=False was narrowed, and the
    export refused by the bundle's own check, "parameter 0 ... is tensor<1x2xf32> in the program but the bundle
    declares tensor<1x2xf64>", which named neither x64 nor the value."""
    with pytest.raises(ExportError) as refused:
        export_bundle(_scaled_shift if weights else (lambda x: x * 2), inputs, weights, directory=tmp_path / "m",
                      batch_sizes=[1], provenance=False, x64=False)
    assert str(refused.value) == (f"x64=False, but {named} is 64-bit: traced in 32 bits it would be narrowed; "
                                  "pass 32-bit arrays, or x64=True (or leave x64 out: a 64-bit value turns it on)")
    assert not (tmp_path / "m").exists()


def _heads(x, w):
    """A dict written in an order other than its sorted keys, with outputs of three dtypes and shapes."""
    logits = x @ w
    return {"logits": logits, "probs": jax.nn.softmax(logits), "argmax": jnp.argmax(logits, -1).astype(jnp.int32)}


@pytest.mark.parametrize("output_names", [None, ["logits", "probs", "argmax"], ["probs", "argmax", "logits"]])
def test_a_dict_result_is_served_under_its_keys(tmp_path, output_names) -> None:
    """Found by a bug hunt: jax flattens a dict by its sorted keys, and the outputs were named by position, so
    'logits' served the argmax, 'probs' the logits and 'argmax' the probabilities."""
    w = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    directory = export_bundle(_heads, [np.zeros((1, 4), np.float32)], {"w": w}, directory=tmp_path / "heads",
                              batch_sizes=[1, 2], output_names=output_names, provenance=False)
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    served = {t.name: t.data for t in serve_once(directory, [NamedTensor.from_array("input", x)])}
    expected = jax.jit(_heads)(x, w)
    assert sorted(served) == sorted(expected)
    for key, value in expected.items():
        assert served[key].dtype == value.dtype and served[key].shape == value.shape, key
        np.testing.assert_allclose(served[key], value, rtol=1e-6, atol=1e-6, err_msg=key)


def test_a_dict_result_refuses_output_names_that_are_not_its_keys(tmp_path) -> None:
    with pytest.raises(ExportError, match=r"^output_names \['logits', 'p', 'argmax'\] are not the keys of the "
                                          r"dict the function returns \(\['argmax', 'logits', 'probs'\]\)"):
        export_bundle(_heads, [np.zeros((1, 4), np.float32)], {"w": np.ones((4, 3), np.float32)},
                      directory=tmp_path / "f", output_names=["logits", "p", "argmax"], provenance=False)
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("fn, structure", [
    (lambda x: ((x, x * 2), x * 3), r"PyTreeDef\(\(\(\*, \*\), \*\)\) \(3 array\(s\)\)"),
    (lambda x: {"a": x, "b": [x, x]}, r"PyTreeDef\(\{'a': \*, 'b': \[\*, \*\]\}\) \(3 array\(s\)\)"),
    (lambda x: None, r"PyTreeDef\(None\) \(0 array\(s\)\)"),
], ids=["nested tuple", "dict holding a list", "None"])
def test_a_nested_result_is_refused_naming_its_structure(tmp_path, fn, structure) -> None:
    """A nested tuple was refused as 'output_names has 2 names for 3 output(s)', which did not say why, and
    without output_names it was exported with its leaves numbered."""
    for output_names in (["pair", "triple"], None):
        with pytest.raises(ExportError, match=rf"^the function returns {structure}, which a bundle cannot name: "
                                              r"return one array, a flat tuple or list of arrays"):
            export_bundle(fn, [np.zeros((1, 2), np.float32)], {}, directory=tmp_path / "f", batch_sizes=[1],
                          output_names=output_names, provenance=False)
    assert not (tmp_path / "f").exists()



def _centered(x, w):
    """Each row less the batch's mean row: its answer depends on every row of the batch (BatchNorm in training)."""
    return (x - x.mean(axis=0, keepdims=True)) @ w


def test_a_function_that_mixes_rows_across_the_batch_is_refused(tmp_path) -> None:
    """Found by a bug hunt: it was exported, and the server's padding and other clients' rows changed each
    client's answer."""
    w = np.eye(3, dtype=np.float32)
    with pytest.raises(ExportError, match=r"^output 0 \('centered'\): its first row changed when only the other "
                                          r"rows of the batch did \(batch size 4, random rows\): the function mixes "
                                          r"rows across the batch axis .* export without batching "
                                          r"\(input_batch_axes=\[None, \.\.\.\] or batch_sizes=\[1\]\); "
                                          r"check_rows=False skips this check$"):
        export_bundle(_centered, [np.zeros((1, 3), np.float32)], {"w": w}, directory=tmp_path / "f",
                      batch_sizes=[1, 4], output_names=["centered"], provenance=False)
    assert not (tmp_path / "f").exists()
    directory = export_bundle(_centered, [np.zeros((1, 3), np.float32)], {"w": w}, directory=tmp_path / "f",
                              batch_sizes=[1, 4], check_rows=False, provenance=False)
    assert load_manifest(directory / "manifest.yaml").batching.compiled_batch_sizes == (1, 4)


def test_row_independent_outputs_of_every_kind_pass_the_row_check(tmp_path) -> None:
    """Integer, boolean and bfloat16 outputs, an integer input used as indices, and an unbatched output that
    sums over the batch (only batched outputs are compared)."""
    def f(ids, x, table):
        rows = table[ids].sum(axis=1) * x
        return rows, jnp.argmax(rows, -1), rows > 0, rows.astype(jnp.bfloat16), rows.sum(axis=0)

    table = np.random.default_rng(0).standard_normal((8, 3)).astype(np.float32)
    directory = export_bundle(f, [np.zeros((1, 2), np.int32), np.zeros((1, 3), np.float32)], {"table": table},
                              directory=tmp_path / "f", batch_sizes=[1, 8],
                              output_batch_axes=[0, 0, 0, 0, None], provenance=False)
    assert load_manifest(directory / "manifest.yaml").batching.compiled_batch_sizes == (1, 8)



def _rnn_over_rows(x):
    """An RNN that scans the batch axis as if it were time: row i carries rows 0..i."""
    def step(h, row):
        h = jnp.tanh(h * 0.5 + row)
        return h, h

    return jax.lax.scan(step, jnp.zeros(x.shape[1:], x.dtype), x)[1]


_BATCH_AXIS_1 = {"input_batch_axes": [1], "output_batch_axes": [1]}
_CARRIES = r"the function carries rows along the batch axis \(as jnp.cumsum\(x, axis=0\), a jax.lax.scan over it or " \
           r"x - x\[0\] do\), so a served answer would depend on the server's padding .* check_rows=False skips " \
           r"this check$"


@pytest.mark.parametrize("fn, example, options, row", [
    (lambda x: jnp.cumsum(x, axis=0), np.zeros((1, 4), np.float32), {}, 1),
    (_rnn_over_rows, np.zeros((1, 4), np.float32), {}, 1),
    (lambda x: x - x[0:1], np.zeros((1, 4), np.float32), {}, 1),
    (lambda x: jnp.concatenate([x[:3], x[3:] - x[:-3]]), np.zeros((1, 4), np.float32), {}, 3),
    (lambda x: jnp.cumsum(x, axis=1), np.zeros((4, 1), np.float32), _BATCH_AXIS_1, 1),
    (lambda b: b ^ b[0:1], np.zeros((1, 1), np.bool_), {}, 1),
], ids=["cumsum", "scan", "minus first row", "shift by 3", "cumsum on batch axis 1", "one-element boolean rows"])
def test_a_function_whose_rows_carry_the_first_row_is_refused_naming_the_row(tmp_path, fn, example, options,
                                                                             row) -> None:
    """Found by a bug hunt: the check compared the first row alone, which a running total, a scan over the batch
    or x - x[0] leave as it is, so they were exported batched and a client's answer carried the rows of the
    clients batched before it. A one-element boolean row is changed, not redrawn: drawn again, it stayed the same
    half the time."""
    with pytest.raises(ExportError, match=rf"^output 0 \('output'\): its row {row} \(counting from 0\) changed "
                                          rf"when only the first row of the batch did \(batch size 8, random rows\): "
                                          + _CARRIES):
        export_bundle(fn, [example], {}, directory=tmp_path / "f", batch_sizes=[1, 8], provenance=False, **options)
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("dtype", [np.bool_, np.int32, np.uint8, np.float32])
def test_the_row_check_changes_every_value_of_the_rows_it_redraws(dtype) -> None:
    """A boolean or small-integer value drawn again came out the same an eighth to half of the time, and a row
    left as it was cannot show that another row depends on it. Batch axis 1: the rows are its columns."""
    from nereid.backends.xla.export.jax_export import _random_array, _rows_redrawn

    rng = np.random.default_rng(0)
    array = _random_array(rng, (64, 3), dtype)
    for rows in (slice(0, 1), slice(1, None)):
        redrawn = _rows_redrawn(rng, array, 1, rows)
        assert redrawn.dtype == array.dtype
        assert (redrawn[:, rows] != array[:, rows]).all()
        np.testing.assert_array_equal(np.delete(redrawn, np.arange(3)[rows], axis=1),
                                      np.delete(array, np.arange(3)[rows], axis=1))
        if array.dtype.kind in "iu":
            assert redrawn.min() >= 0 and redrawn.max() < 8  # still valid indices into a table of 8
    assert _rows_redrawn(rng, array, None, slice(0, 1)) is array  # an unbatched input stays as it is


@pytest.mark.parametrize("fn, example, options", [
    (lambda x, w: jnp.tanh(x) * 2 + w[0], np.zeros((1, 4), np.float32), {}),
    (lambda x, w: jax.nn.relu(x @ w.T @ w), np.zeros((1, 4), np.float32), {}),
    (lambda x, w: w @ x, np.zeros((4, 1), np.float32), _BATCH_AXIS_1),
], ids=["tanh", "matmul with weights", "matmul on batch axis 1"])
def test_row_wise_functions_pass_the_row_check(tmp_path, fn, example, options) -> None:
    w = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    directory = export_bundle(fn, [example], {"w": w}, directory=tmp_path / "f", batch_sizes=[1, 8],
                              provenance=False, **options)
    assert load_manifest(directory / "manifest.yaml").batching.compiled_batch_sizes == (1, 8)



def test_with_a_single_batch_size_an_unbatched_output_of_that_length_is_not_taken_for_batched(tmp_path) -> None:
    """Found by a bug hunt: at batch_sizes=[4], a constant table of length 4 passed as batched, and a 1-row
    request got one entry of it where jax gives all four."""
    def f(x, w, prior):
        return x @ w, prior * 2

    weights = {"w": np.ones((3, 4), np.float32), "prior": np.array([0.1, 0.2, 0.3, 0.4], np.float32)}
    with pytest.raises(ExportError, match=r"^output 1 \(output_1\) has shape \(4,\) at batch size 5 \(traced "
                                          r"there only to tell the batch axes, as there is a single batch size\): "
                                          r"axis 0 is not its batch axis; pass output_batch_axes"):
        export_bundle(f, [np.zeros((1, 3), np.float32)], weights, directory=tmp_path / "f", batch_sizes=[4],
                      provenance=False)
    assert not (tmp_path / "f").exists()
    directory = export_bundle(f, [np.zeros((1, 3), np.float32)], weights, directory=tmp_path / "f",
                              batch_sizes=[4], output_batch_axes=[0, None], provenance=False)
    assert [t.batch_axis for t in load_manifest(directory / "manifest.yaml").executable_outputs] == [1, None]
    scores, table = serve_once(directory, [NamedTensor.from_array("input", np.ones((4, 3), np.float32))])
    assert scores.data.shape == (4, 4)
    np.testing.assert_allclose(table.data, [0.2, 0.4, 0.6, 0.8])


def test_a_single_batch_size_function_that_cannot_trace_at_another_asks_for_output_batch_axes(tmp_path) -> None:
    def f(x):
        return x.reshape(4, 2, 2)  # written for 4 rows only

    with pytest.raises(ExportError, match=r"^with a single batch size the function is traced once more, at batch "
                                          r"size 5, to tell its outputs' batch axes, and that failed \(TypeError: "
                                          r".*\); pass output_batch_axes \(None for an unbatched output\)"):
        export_bundle(f, [np.zeros((1, 4), np.float32)], {}, directory=tmp_path / "f", batch_sizes=[4],
                      provenance=False)
    directory = export_bundle(f, [np.zeros((1, 4), np.float32)], {}, directory=tmp_path / "f", batch_sizes=[4],
                              output_batch_axes=[0], provenance=False)
    assert load_manifest(directory / "manifest.yaml").executable_outputs[0].shape_string == "acn"  # n: batch



_X1, _W = np.zeros((1, 4), np.float32), {"w": np.ones((4, 2), np.float32)}


@pytest.mark.parametrize("fn, examples, options, problem", [
    (lambda a, s, w: a @ w * s, [_X1, np.float32(2)], {"batch_sizes": [1, 2]},
     r"^example input 1 \('input_1'\) has shape \(\): its batch axis 0 is outside it; an input without a batch "
     r"axis \(a scalar\) takes None in input_batch_axes, e.g. input_batch_axes=\[0, None\]$"),
    (lambda d, w: d["a"] @ w, [{"a": _X1, "b": _X1}], {"batch_sizes": [1]},
     r"^example input 0 \('input'\) is a dict \(keys 'a', 'b'\), not an array: pass each array as its own input"),
    (lambda k, a, w: a @ w + jax.random.normal(k, (2,)), [jax.random.key(0), _X1],
     {"batch_sizes": [1], "input_batch_axes": [None, 0]},
     r"^example input 0 \('input_0'\) is a typed PRNG key \(key<fry>\), which a bundle cannot hold: pass "
     r"jax.random.key_data\(key\) \(uint32\) and rebuild the key in the function with jax.random.wrap_key_data$"),
    (lambda a, w: a @ w, [_X1], {"batch_sizes": [1], "input_names": [""]},
     r"^input_names\[0\] is '': each input needs a non-empty name$"),
    (lambda a, w: jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct((a.shape[0], 2), np.float32), a @ w), [_X1],
     {"batch_sizes": [1]}, r"^batch size 1: the function calls back into Python \(jax.pure_callback, io_callback or "
                           r"jax.debug.print; jax: .*host_callbacks.*\), which a bundle cannot hold"),
    (lambda a, w: (jax.debug.print("{}", a), a @ w)[1], [_X1], {},
     r"^the program: the function calls back into Python"),
], ids=["scalar input", "dict input", "typed key", "empty name", "pure_callback", "debug.print"])
def test_common_mistakes_are_export_errors_that_say_what_to_change(tmp_path, fn, examples, options, problem) -> None:
    """Found by a bug hunt: a ValueError (empty name) or jax's NotImplementedError (callbacks), or an ExportError
    naming no input ('batch axis 0 is outside an input of shape ()', 'has dtype object', 'has dtype key<fry>')."""
    with pytest.raises(ExportError, match=problem):
        export_bundle(fn, examples, _W, directory=tmp_path / "f", provenance=False, **options)
    assert not (tmp_path / "f").exists()


def test_argument_mistakes(tmp_path) -> None:
    with pytest.raises(ExportError, match="input_batch_axes has 2 entries for 1 tensor"):
        export_bundle(lambda x: x, [np.zeros((1, 2))], {}, directory=tmp_path / "f", batch_sizes=[1],
                      input_batch_axes=[0, 0], provenance=False)
    with pytest.raises(ExportError, match="output_names has 2 names for 1 output"):
        export_bundle(lambda x: x, [np.zeros((1, 2), np.float32)], {}, directory=tmp_path / "f",
                      output_names=["a", "b"], provenance=False)


def test_a_refused_re_export_leaves_the_bundle_servable(tmp_path) -> None:
    w = np.ones(3, np.float32)
    directory = export_bundle(lambda x, a: x * a, [np.zeros((1, 3), np.float32)], {"a": w},
                              directory=tmp_path / "f", batch_sizes=[1, 2], provenance=False)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    with pytest.raises(ExportError, match="weights: duplicate weight name 'a'"):
        export_bundle(lambda x, a, b: x * a, [np.zeros((1, 3), np.float32)], [("a", w), ("a", w)],
                      directory=directory, batch_sizes=[4], provenance=False)
    with pytest.raises(ExportError, match="model_py: cannot read"):
        export_bundle(lambda x, a: x * a, [np.zeros((1, 3), np.float32)], {"a": w}, directory=directory,
                      batch_sizes=[4], model_py=tmp_path / "missing.py", provenance=False)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert bundle_arity_report(directory).servable


def test_a_weight_named_metadata_is_refused(tmp_path) -> None:
    with pytest.raises(ExportError, match="weights: weight 0 is named '__metadata__'"):
        export_bundle(lambda x, a: x * a, [np.zeros(3, np.float32)], {"__metadata__": np.ones(3, np.float32)},
                      directory=tmp_path / "f", provenance=False)
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("batch_sizes, problem", [
    ([-1, 2], r"batch_sizes \[-1, 2\]: batch sizes must be positive integers, got -1"),
    ([0], r"batch_sizes \[0\]: batch sizes must be positive integers, got 0"),
    ([1.5, 2], r"batch_sizes \[1.5, 2\]: batch sizes must be positive integers, got 1.5"),
    ([True], r"batch_sizes \[True\]: batch sizes must be positive integers, got True"),
    ([], r"batch_sizes is empty: give at least one batch size, or leave batch_sizes out"),
    ([1, 2, 2], r"batch_sizes lists 2 more than once: \[1, 2, 2\]"),
    (4, r"batch_sizes must be a list of positive integers, got 4"),
])
def test_batch_size_mistakes_are_refused_before_tracing(tmp_path, batch_sizes, problem) -> None:
    traced = []

    def f(x):
        traced.append(x.shape)
        return x

    with pytest.raises(ExportError, match=problem):
        export_bundle(f, [np.zeros((1, 3), np.float32)], {}, directory=tmp_path / "f", batch_sizes=batch_sizes,
                      provenance=False)
    assert traced == [] and not (tmp_path / "f").exists()


def test_numpy_integer_batch_sizes_are_taken(tmp_path) -> None:
    directory = export_bundle(lambda x: x, [np.zeros((1, 3), np.float32)], {}, directory=tmp_path / "f",
                              batch_sizes=np.array([4, 2]), provenance=False)
    assert load_manifest(directory / "manifest.yaml").batching.compiled_batch_sizes == (2, 4)


def test_a_list_of_bare_arrays_is_refused(tmp_path) -> None:
    # A 2-element array used to unpack as a pair: a scalar weight named '1.0'.
    with pytest.raises(ExportError, match=r"weights must be a mapping of names to arrays or a list of \(name, array\) "
                                          r"pairs; got a list whose item 0 is a float32 array of shape \(2,\)"):
        export_bundle(lambda x, a: x * a, [np.zeros(2, np.float32)], [np.array([1.0, 2.0], np.float32)],
                      directory=tmp_path / "f", provenance=False)
    with pytest.raises(ExportError, match=r"item 0 is a float32 array of shape \(3,\)"):
        export_bundle(lambda x, a: x * a, [np.zeros(3, np.float32)], [np.ones(3, np.float32)],
                      directory=tmp_path / "f", provenance=False)
    assert not (tmp_path / "f").exists()


@pytest.mark.parametrize("act, problem", [
    ("relu", r"weights: weight 1 \('act'\) is str 'relu', not an array$"),
    (None, r"weights: weight 1 \('act'\) is None, not an array$"),
    (len, r"weights: weight 1 \('act'\) is builtin_function_or_method <built-in function len>, not an array$"),
    ({"w": np.ones((4, 4), np.float32), "b": np.ones(4, np.float32)},
     r"weights: weight 1 \('act'\) is a nested dict \(keys 'w', 'b'\), not an array: flatten nested parameters to "
     r"one dotted name per array \(e.g. 'act.w', from jax.tree_util.tree_flatten_with_path\)"),
    (jnp.ones(4, jnp.int4), r"weights: weight 1 \('act'\) has dtype int4, which nereid does not support "
                            r"\(supported: bool, uint8, .*, bfloat16, float8_e5m2, float8_e4m3fn\)$"),
])
def test_weights_nereid_cannot_hold_are_refused_by_name_before_tracing(tmp_path, act, problem) -> None:
    """These reached jax tracing (a TypeError about dtype_to_ir_type, a matmul error) or iospec's plain
    ValueError naming no weight; an int4 weight only after every batch size was traced."""
    traced = []

    def f(x, w, act):
        traced.append(x.shape)
        return x @ w

    with pytest.raises(ExportError, match=problem):
        export_bundle(f, [np.zeros((1, 4), np.float32)], {"w": np.ones((4, 4), np.float32), "act": act},
                      directory=tmp_path / "f", batch_sizes=[1, 2], provenance=False)
    assert traced == [] and not (tmp_path / "f").exists()


def test_an_output_nereid_cannot_serve_is_refused_by_name_after_one_trace(tmp_path) -> None:
    """A complex64 output gave "ValueError: not a datatype nereid knows: dtype('complex64')" after every size."""
    traced = []

    def f(x, w):
        traced.append(x.shape)
        return x @ w, (x @ w).astype(jnp.complex64)

    with pytest.raises(ExportError, match=r"^output 1 \('phase'\) has dtype complex64, which nereid does not "
                                          r"support \(supported: bool, .*\)$"):
        export_bundle(f, [np.zeros((1, 4), np.float32)], {"w": np.ones((4, 4), np.float32)},
                      directory=tmp_path / "f", batch_sizes=[1, 2, 4], output_names=["y", "phase"],
                      provenance=False)
    assert traced == [(1, 4)] and not (tmp_path / "f").exists()
    with pytest.raises(ExportError, match=r"^example input 0 \('input'\) has dtype complex64"):
        export_bundle(f, [np.zeros((1, 4), np.complex64)], {"w": np.ones((4, 4), np.float32)},
                      directory=tmp_path / "f", batch_sizes=[1], provenance=False)


def test_a_symbolic_example_shape_is_refused_with_the_way_to_batch(tmp_path) -> None:
    """A shape-polymorphic example crashed with jax's InconclusiveDimensionOperation, naming no input."""
    from jax import export as jax_export

    example = jax.ShapeDtypeStruct(jax_export.symbolic_shape("b, 4"), jnp.float32)
    with pytest.raises(ExportError) as caught:
        export_bundle(lambda x, w: x @ w, [example], {"w": np.ones((4, 4), np.float32)}, directory=tmp_path / "f",
                      batch_sizes=[1, 2], input_names=["x"], provenance=False)
    assert str(caught.value).startswith(
        "example input 0 ('x'): axis 0 has the symbolic size b (shape (b, 4)); bundles need static example shapes: "
        "give a concrete example, such as one of shape (1, 4), and the batch sizes to compile as batch_sizes=[...]")
    assert not (tmp_path / "f").exists()


def test_the_platform_the_programs_are_lowered_for_is_recorded_in_the_provenance(tmp_path) -> None:
    """Defect: the manifest did not say which platform jax.export lowered the programs for, so a server could not
    tell a cpu export served on a GPU (or the reverse)."""
    def f(x, w):
        return x * w

    plain = export_bundle(f, [np.zeros(3, np.float32)], {"w": np.float32(2)}, directory=tmp_path / "plain",
                          provenance=False)  # no git fields or versions, but the platform is a fact of the program
    assert load_manifest(plain / "manifest.yaml").provenance == {"export_platform": "cpu"}
    given = export_bundle(f, [np.zeros(3, np.float32)], {"w": np.float32(2)}, directory=tmp_path / "given",
                          platform="cuda", provenance={"built_by": "ci", "export_platform": "cpu"})
    manifest = load_manifest(given / "manifest.yaml")
    assert manifest.provenance == {"built_by": "ci", "export_platform": "cuda"}  # what the export did wins
    assert manifest.export_platform == "cuda"
    # Found by a bug hunt: a misspelt platform was exported (jax lowers for it too), and the server then warned
    # the bundle was "exported for cpux".
    with pytest.raises(ExportError, match=r"^platform must be one of cpu, cuda, rocm, tpu, got 'cpux'$"):
        export_bundle(f, [np.zeros(3, np.float32)], {"w": np.float32(2)}, directory=tmp_path / "typo",
                      platform="cpux", provenance=False)
    assert not (tmp_path / "typo").exists()


def test_a_cuda_export_that_carries_shardy_attributes_is_written_and_read(tmp_path) -> None:
    """Defect: a cholesky exported for cuda carries Shardy (``sdy``) attributes, and the program reader's context
    knew only StableHLO, so export_bundle refused its own artifact ("dialect 'sdy' is unknown")."""
    from nereid.backends.xla.program import read_program

    directory = export_bundle(jnp.linalg.cholesky, [2 * np.eye(4, dtype=np.float32)], {}, directory=tmp_path / "chol",
                              platform="cuda", provenance=False)
    signature = read_program((directory / "model.mlir").read_bytes(), "model.mlir")
    assert [p.describe() for p in signature.parameters] == ["tensor<4x4xf32>"]
    assert [r.describe() for r in signature.results] == ["tensor<4x4xf32>"]


def test_negative_batch_axes_are_refused_naming_the_entry_and_big_endian_arrays_are_their_type(tmp_path) -> None:
    """Found by the export hunt: an output batch axis of -1 went through Python's negative indexing to a garbled
    shape in the row check's message, an input's was told to be None; and a big-endian float32 weight or example
    was refused as no supported dtype, float32 listed among those supported."""
    def f(x, w):
        return (x * w).T

    for axes in ({"input_batch_axes": [-1]}, {"output_batch_axes": [-1]}):
        with pytest.raises(ExportError, match=r"_batch_axes\[0\] is -1: a batch axis is an int counted from 0"):
            export_bundle(f, [np.zeros((2, 3), np.float32)], {"w": np.ones(3, np.float32)},
                          directory=tmp_path / "neg", batch_sizes=[2], provenance=False, **axes)
    directory = export_bundle(lambda x, w: x * w, [np.zeros((1, 3), ">f4")], {"w": np.arange(3, dtype=">f4")},
                              directory=tmp_path / "big", batch_sizes=[1], provenance=False)
    out, = serve_once(directory, [NamedTensor.from_array("input", np.ones((1, 3), np.float32))])
    assert out.data.dtype == np.float32 and out.data.tolist() == [[0.0, 1.0, 2.0]]


def test_an_example_with_an_empty_axis_besides_the_batch_axis_is_refused_naming_it(tmp_path) -> None:
    """Found by the export hunt: an example of shape (1, 0) failed after tracing with IOSpec's bare ValueError,
    naming no example input."""
    with pytest.raises(ExportError, match=r"^example input 0 \('input'\) has shape \(1, 0\): axis 1 is empty"):
        export_bundle(lambda x: x * 2, [np.zeros((1, 0), np.float32)], {}, directory=tmp_path / "empty",
                      batch_sizes=[1], provenance=False)
    directory = export_bundle(lambda x: x * 2, [np.zeros((0, 3), np.float32)], {}, directory=tmp_path / "rows",
                              batch_sizes=[2], provenance=False)  # (an empty batch axis is resized: fine)
    out, = serve_once(directory, [NamedTensor.from_array("input", np.ones((2, 3), np.float32))])
    assert out.data.tolist() == [[2.0] * 3] * 2


def _times(x, w):
    return x * w


def test_a_python_number_weight_is_weakly_typed_as_in_jax(tmp_path) -> None:
    """The review hunt of e975660: a float weight was traced as a float32 (float64 under x64) parameter, so a
    bfloat16 input's answer was float32, and a float32 input's float64 under x64, where jax.jit keeps the
    input's type (a Python number is weakly typed)."""
    x = np.array([[1.0, 2.0]], dtype=jnp.bfloat16)
    directory = export_bundle(_times, [np.zeros((1, 2), jnp.bfloat16)], {"w": 0.5}, directory=tmp_path / "bf16",
                              batch_sizes=[1], provenance=False)
    out, = serve_once(directory, [NamedTensor.from_array("input", x)])
    expected = np.asarray(jax.jit(_times)(x, 0.5))
    assert out.data.dtype == expected.dtype == jnp.bfloat16 and out.data.tolist() == expected.tolist()
    with jax.enable_x64(True):
        wide = export_bundle(_times, [np.zeros((1, 2), np.float32)], {"w": 0.5}, directory=tmp_path / "x64",
                             batch_sizes=[1], provenance=False)
    assert load_manifest(wide / "manifest.yaml").executable_outputs[0].dtype.numpy == np.float32


def test_a_jax_array_weight_of_a_number_is_weakly_typed_as_in_jax(tmp_path) -> None:
    """Found by the exporter hunt: jnp.array(0.5) (jnp.asarray, jax.device_put of a number) is weakly typed in jax,
    as a Python number is, but was exported strongly: a bfloat16 input's answer was float32 where jax.jit keeps
    bfloat16."""
    x = np.array([[1.0, 2.0]], dtype=jnp.bfloat16)
    w = jnp.array(0.5)
    assert w.weak_type
    directory = export_bundle(_times, [np.zeros((1, 2), jnp.bfloat16)], {"w": w}, directory=tmp_path / "bf16",
                              batch_sizes=[1], provenance=False)
    out, = serve_once(directory, [NamedTensor.from_array("input", x)])
    expected = np.asarray(jax.jit(_times)(x, w))
    assert out.data.dtype == expected.dtype == jnp.bfloat16 and out.data.tolist() == expected.tolist()


def test_a_python_number_weight_beside_a_64_bit_example_is_exported_64_bit(tmp_path) -> None:
    """Found by the exporter hunt: a 64-bit example turns the export x64, but a Python number weight had already
    been narrowed to float32: the FP64 bundle served numbers no jax run gives (0.1 as float32, widened)."""
    from nereid.backends.xla.export import read_bundle_weights

    x = np.array([[1.0, 3.0]], np.float64)
    directory = export_bundle(_times, [np.zeros((1, 2), np.float64)], {"w": 0.1}, directory=tmp_path / "x64",
                              batch_sizes=[1], provenance=False)
    assert [(name, array.dtype) for name, array in read_bundle_weights(directory)] == [("w", np.float64)]
    out, = serve_once(directory, [NamedTensor.from_array("input", x)])
    with jax.enable_x64(True):
        expected = np.asarray(jax.jit(_times)(x, 0.1))
    assert out.data.dtype == np.float64 and out.data.tolist() == expected.tolist()
