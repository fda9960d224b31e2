"""backends/cxx/plugin.py: what the cxx backend claims, its hint and defaults check, and `nereid cxx-header`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nereid.backends.cxx.build import header_dir
from nereid.cli import main as nereid_main
from nereid.errors import ConfigError
from tests.backends.cxx.cxx_support import CXX, SCALE_TEXTPROTO, entry, scale_model

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


def test_check_reports_cxx_models_and_cxx_header_prints_the_header(repo, libs, capsys):
    scale_model(repo, "plain_c")
    scale_model(repo, "noinfer")
    config = repo.write_config(entry("plain_c", f'{{library: "{libs["noload"]}"}}') +
                               entry("noinfer", f'{{library: "{libs["noinfer"]}"}}'))
    assert nereid_main(["check", "--config", str(config)]) == 1
    out = capsys.readouterr().out
    assert "plain_c: OK backend=cxx device=cpu max_batch_size=16 batching=on inputs=[input FP32[8]]" in out
    assert "noinfer: UNAVAILABLE: model 'noinfer': shared library" in out and "nereid_infer" in out
    assert nereid_main(["cxx-header"]) == 0
    header = Path(capsys.readouterr().out.strip())
    assert header.name == "nereid_cxx.h" and header.parent == header_dir()
    text = header.read_text()
    for declaration in ("int nereid_infer(", "int nereid_load(", "void nereid_unload(", "typedef struct nereid_tensor"):
        assert declaration in text


def test_the_backend_claims_a_folder_only_when_nereid_yaml_declares_it(tmp_path):
    """Its folders hold only a textproto, as a python or cpp model's before its main file is written: claiming an
    undeclared one would take them all."""
    from nereid.backends.cxx import plugin
    from nereid.backends.cxx.model import CxxModel

    (tmp_path / "model_inference.textproto").write_text(SCALE_TEXTPROTO)
    assert plugin.nereid_claim_model(tmp_path, declared=True).create is CxxModel
    assert plugin.nereid_claim_model(tmp_path, declared=False) is None
    assert plugin.nereid_claim_signs() == "only when declared"


def test_a_folder_holding_only_a_textproto_gets_the_hint_to_declare_it(tmp_path):
    from nereid.backends.cxx import plugin

    folder = tmp_path / "m"
    assert plugin.nereid_declaration_hint(folder, "nereid.yaml") is None  # (gone meanwhile: the load says so)
    folder.mkdir()
    (folder / "model_inference.textproto").write_text(SCALE_TEXTPROTO)
    (folder / ".cache").mkdir()  # hidden entries are not the model's own files
    hint = plugin.nereid_declaration_hint(folder, "nereid.yaml")
    assert hint is not None and "declare it in nereid.yaml with backend: cxx and runtime: {library: PATH}" in hint
    # With its C++ sources or its library beside it, as the shipped cxx_scale (the error hunt: no hint was given).
    (folder / "scale.cpp").write_text("")
    (folder / "libscale.so.1").write_text("")
    hint = plugin.nereid_declaration_hint(folder, "nereid.yaml")
    assert hint is not None and hint.startswith("if it is a cxx model (a folder holding model_inference.textproto "
                                                "and C or C++ code may be one), declare it in nereid.yaml")
    (folder / "main.py").write_text("")  # something another backend recognises: no cxx hint
    assert plugin.nereid_declaration_hint(folder, "nereid.yaml") is None


def test_an_unknown_key_of_backends_cxx_is_refused_naming_where_it_is():
    from nereid.backends.cxx import plugin

    plugin.nereid_check_defaults({"library": "build/libm.so"}, "nereid.yaml: backends.cxx")  # (checked at a load)
    with pytest.raises(ConfigError, match=re.escape("nereid.yaml: backends.cxx.flavour: unknown option of the cxx "
                                                    "backend (allowed: library, sources), got 1")):
        plugin.nereid_check_defaults({"flavour": 1}, "nereid.yaml: backends.cxx")
