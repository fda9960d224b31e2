"""``nereid bundle check DIR...`` (the plugin's check_bundles): one arity line per bundle, never raising, non-zero
if any is unservable."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import safetensors.numpy

from nereid.backends.xla.safetensors import load_weights, write_safetensors
from nereid.backends.xla.weights import INDEX_FILE
from nereid.cli import main
from nereid.backends.xla.export import bundle_arity_report, examples

SHIPPED = Path(__file__).resolve().parents[3] / "ml-backends"


def test_the_shipped_bundles_are_servable(capsys) -> None:
    assert main(["bundle", "check", str(SHIPPED)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].endswith(" bundle(s), 0 unservable")
    assert any(line.startswith(f"{SHIPPED / 'mlp_bundle'}: servable: 1 input(s) + 4 weight(s) = 5 argument(s)")
               for line in lines)


def test_a_bundle_is_unservable_here_under_xla_flags_xla_refuses(capsys, monkeypatch) -> None:
    """Found by the deployment hunt (carried): with an XLA_FLAGS XLA refuses, nereid bundle check called every
    bundle servable, where the server refuses each at its load naming XLA's line."""
    monkeypatch.setenv("XLA_FLAGS", "--xla_no_such_flag_of_nereids_bundle_check=true")
    assert main(["bundle", "check", str(SHIPPED / "mlp_bundle")]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{SHIPPED / 'mlp_bundle'}: UNSERVABLE: not here: XLA ends any process that starts it "
                          "with XLA_FLAGS="), out
    assert "Unknown flag in XLA_FLAGS: --xla_no_such_flag_of_nereids_bundle_check=true" in out, out


def test_a_meta_model_named_on_its_own_is_skipped_not_unservable(capsys) -> None:
    """Named on its own, the shipped meta model counted as one unservable bundle and the command exited 1."""
    meta = SHIPPED / "circle_score"
    assert main(["bundle", "check", str(meta), str(SHIPPED / "mlp_bundle")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (f"{meta}: skipped: a meta model (meta: true in manifest.yaml) runs no program of its own; "
                        "nereid check loads it")
    assert lines[-1] == "1 bundle(s), 0 unservable"


def test_a_folder_of_meta_models_only_has_no_bundle_to_check(tmp_path, capsys) -> None:
    """Scanned, a folder whose only models are meta models was itself "UNSERVABLE: missing manifest.yaml", and
    the command exited 1; the README says meta folders are skipped, not counted."""
    shutil.copytree(SHIPPED / "circle_score", tmp_path / "circle_score")
    assert main(["bundle", "check", str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == ["0 bundle(s), 0 unservable"]


def test_triage_of_a_directory_of_bundles(tmp_path, capsys) -> None:
    good = examples.write_mlp(tmp_path, provenance=False)
    broken = tmp_path / "broken"
    shutil.copytree(good, broken)
    write_safetensors(broken / "weights.safetensors", load_weights(broken / "weights.safetensors")[:2])
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "manifest.yaml").write_text("format_version: 9\n")
    not_a_bundle = tmp_path / "empty"
    not_a_bundle.mkdir()
    assert main(["bundle", "check", str(tmp_path), str(not_a_bundle)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 5 and lines[-1] == "4 bundle(s), 3 unservable"
    by_bundle = {line.split(": ", 1)[0]: line for line in lines[:-1]}
    assert "UNSERVABLE" in by_bundle[str(broken)] and "takes 5 argument(s)" in by_bundle[str(broken)]
    assert "supplies 3" in by_bundle[str(broken)]
    assert "format_version: unsupported bundle format" in by_bundle[str(garbage)]
    assert "missing manifest.yaml" in by_bundle[str(not_a_bundle)]
    assert ": servable:" in by_bundle[str(good)]


def test_bundles_whose_types_the_load_refuses_are_unservable(tmp_path, capsys) -> None:
    """The arity report called these servable, yet the server's load refuses each: the command now runs the same
    program type check (the report API stays an arity check)."""
    def copy(name: str) -> Path:
        return Path(shutil.copytree(SHIPPED / "mlp_bundle", tmp_path / name, ignore=shutil.ignore_patterns(".cache")))

    wrong_dim = copy("wrong_dim")
    manifest = wrong_dim / "manifest.yaml"
    manifest.write_text(manifest.read_text().replace("dims: {a: 16}", "dims: {a: 15}"))
    wrong_weight = copy("wrong_weight")
    weights = load_weights(wrong_weight / "weights.safetensors")
    write_safetensors(wrong_weight / "weights.safetensors",
                      [(n, a.astype(np.float64) if n == weights[1][0] else a) for n, a in weights])
    transposed = copy("transposed")  # a 2-D weight written the other way round
    first_matrix = next(n for n, a in weights if a.ndim == 2)
    write_safetensors(transposed / "weights.safetensors",
                      [(n, np.ascontiguousarray(a.T) if n == first_matrix else a) for n, a in weights])
    unmarked = copy("unmarked")  # the same weights, the file without its axis_order: read in the legacy layout
    safetensors.numpy.save_file(dict(weights), str(unmarked / "weights.safetensors"),
                                metadata={"argument_order": json.dumps([name for name, _ in weights])})
    # The same weights in the program's axis order, without argument_order: safetensors' save_file writes them
    # sorted by name, not in the program's order (the bundle hunt: the refusal said nothing of order).
    reordered = copy("reordered")
    safetensors.numpy.save_file(dict(weights), str(reordered / "weights.safetensors"), metadata={"axis_order": "xla"})
    swapped = copy("swapped")
    shutil.copyfile(swapped / "model.b1.mlir", swapped / "model.b8.mlir")
    good = copy("good")
    assert all(bundle_arity_report(b).servable for b in (wrong_dim, wrong_weight, swapped))
    assert main(["bundle", "check", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "7 bundle(s), 6 unservable"
    by_bundle = {line.split(": ", 1)[0]: line for line in lines[:-1]}
    assert by_bundle[str(wrong_dim)] == (
        f"{wrong_dim}: UNSERVABLE: model.b1.mlir: parameter 0 (input 'input', manifest shape 'an') is "
        "tensor<1x16xf32> in the program but the bundle declares tensor<1x15xf32>")
    assert by_bundle[str(wrong_weight)].startswith(
        f"{wrong_weight}: UNSERVABLE: model.b1.mlir: parameter 2 (weight '{weights[1][0]}') is ")
    assert by_bundle[str(wrong_weight)].endswith("xf64>")
    # (The config hunt: a weight's shape was said to be the bundle's declaration, with the manifest's hint.)
    assert "in the program but the weights file holds tensor<" in by_bundle[str(transposed)]
    # (The README walkthrough: the legacy-layout hint was given of this file, which has axis_order: xla.)
    assert by_bundle[str(transposed)].endswith(
        "(the shapes are reversed: the weights file, in the program's axis order, holds this weight transposed; "
        "export it again)"), by_bundle[str(transposed)]
    # (A 2.1 bundle's weights without axis_order are refused as such, before any shape: read in the legacy layout,
    # a square weight passed every check transposed; the XLA read hunt.)
    assert by_bundle[str(unmarked)] == (
        f"{unmarked}: UNSERVABLE: weights.safetensors: no axis_order in its metadata, so it would be read in the "
        "legacy layout (column-major shapes), but manifest.yaml says format_version \"2.1\", whose weights are in "
        "the program's order: add {\"axis_order\": \"xla\"} to its metadata if its shapes are the program's, "
        "with {\"argument_order\": \"[...]\"}, the weights' names in the program's order as a JSON list "
        "(safetensors' save_file(..., metadata=...) writes them sorted by dtype and name, and weights of one shape "
        "would be passed swapped, unseen), or write it with nereid.backends.xla.export.write_safetensors")
    assert by_bundle[str(reordered)].endswith(
        "of the file is of that type: the weights go to the program in the order of their data in the file, or of "
        "its metadata's argument_order, a JSON list of their names in the program's order; safetensors' save_file "
        "writes them sorted by dtype and name, so give it argument_order, or write the file with "
        "nereid.backends.xla.export.write_safetensors)"), by_bundle[str(reordered)]
    assert by_bundle[str(swapped)] == (
        f"{swapped}: UNSERVABLE: model.b8.mlir: parameter 0 (input 'input', manifest shape 'an') is "
        "tensor<1x16xf32> in the program but the bundle declares tensor<8x16xf32>")
    assert by_bundle[str(good)].startswith(f"{good}: servable: 1 input(s) + 4 weight(s) = 5 argument(s)")


def test_a_private_main_is_unservable(tmp_path, capsys) -> None:
    """The check called a bundle whose main is private servable; the server's compile then failed with XLA's dump."""
    bundle = Path(shutil.copytree(SHIPPED / "mlp_bundle", tmp_path / "private_main",
                                  ignore=shutil.ignore_patterns(".cache")))
    (bundle / "model.b1.mlir").write_text(
        "func.func private @main(%arg0: tensor<1x16xf32>) -> tensor<1x16xf32> { return %arg0 : tensor<1x16xf32> }")
    assert main(["bundle", "check", str(bundle)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{bundle}: UNSERVABLE: ")
    assert f"{bundle / 'model.b1.mlir'}: the entry function 'main' is private" in lines[0]


def test_a_bundle_s_model_py_that_does_not_compile_is_unservable_and_one_that_does_is_said_not_run(
        tmp_path, capsys) -> None:
    """Found by a bug hunt: a bundle whose model.py had a syntax error was "servable" (exit 0), though the server
    refuses it at load; bundle check runs no bundle's code, but compiling it costs nothing."""
    good = examples.write_mlp(tmp_path, provenance=False)
    hooked = tmp_path / "hooked"
    shutil.copytree(good, hooked)
    (hooked / "model.py").write_text("import nereid\n")
    broken = tmp_path / "broken_hooks"
    shutil.copytree(good, broken)
    (broken / "model.py").write_text("import nereid\ndef preprocess(inputs)\n    return inputs\n")
    # Found by a bug hunt: an UNSERVABLE line (its weights missing) ended with the note of servable ones.
    no_weights = tmp_path / "no_weights"
    shutil.copytree(broken, no_weights)
    (no_weights / "weights.safetensors").unlink()
    assert main(["bundle", "check", str(hooked), str(broken), str(no_weights)]) == 1
    first, second, third, total = capsys.readouterr().out.splitlines()
    assert first.startswith(f"{hooked}: servable: ") and first.endswith(
        " (model.py compiled, not run: nereid check loads it)"), first
    assert second == f"{broken}: UNSERVABLE: model.py: not valid Python (line 2: expected ':')", second
    assert third.startswith(f"{no_weights}: UNSERVABLE: ") and "not run" not in third, third
    assert total == "3 bundle(s), 2 unservable"


def test_a_bundle_s_model_py_holding_a_null_byte_is_unservable_without_a_line_of_none(tmp_path, capsys) -> None:
    """Found by the error hunt: Python 3.11 tells of a null byte as a SyntaxError with no line ("line None")."""
    bundle = examples.write_mlp(tmp_path, provenance=False)
    (bundle / "model.py").write_bytes(b"import nereid\n\0\n")
    assert main(["bundle", "check", str(bundle)]) == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert line == f"{bundle}: UNSERVABLE: model.py: not valid Python (source code string cannot contain null bytes)"


def test_a_scanned_folder_holding_a_program_but_no_manifest_is_reported_not_skipped(tmp_path, capsys) -> None:
    """Found by a bug hunt: scanning a folder passed over a bundle that had lost its manifest.yaml (exit 0), though
    named on its own it was UNSERVABLE."""
    good = examples.write_mlp(tmp_path, provenance=False)
    lost = tmp_path / "lost"
    shutil.copytree(good, lost)
    (lost / "manifest.yaml").unlink()
    (tmp_path / "python_model").mkdir()  # a folder of another kind: still not a bundle
    (tmp_path / "python_model" / "main.py").write_text("")
    assert main(["bundle", "check", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "2 bundle(s), 1 unservable"
    assert any(line.startswith(f"{lost}: UNSERVABLE") and "missing manifest.yaml" in line for line in lines), lines


def test_bundle_check_understands_shards(sharded, capsys) -> None:
    report = bundle_arity_report(sharded)
    assert report.servable and report.n_weights == 4, report.error
    assert main(["bundle", "check", str(sharded)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert line.startswith(f"{sharded}: servable: 1 input(s) + 4 weight(s) in 3 shard(s) ({INDEX_FILE}) = 5 "
                           "argument(s)"), line


def test_bundle_check_warns_of_an_undecodable_index_once(sharded, caplog, capsys) -> None:
    """The check read the bundle twice (arity, then types), so it printed the index's warning twice."""
    (sharded / INDEX_FILE).write_text("{not json")
    with caplog.at_level(logging.WARNING):
        assert main(["bundle", "check", str(sharded)]) == 0
    assert caplog.text.count("reading every *.safetensors file in name order instead") == 1
    assert capsys.readouterr().out.splitlines()[-1] == "1 bundle(s), 0 unservable"
