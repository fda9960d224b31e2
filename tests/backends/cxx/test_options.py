"""backends/cxx/options.py: a cxx model's runtime options (library or sources), its paths resolved against
nereid.yaml's folder or the model folder ($MODEL_FOLDER)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.backends.cxx.cxx_support import CXX, ROWS, SCALE_TEXTPROTO, entry, tensor

pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


def test_a_model_folder_in_a_bucket_brings_its_own_library(s3, serve, libs, tmp_path):
    # A bucket's model runs from a local mirror whose path nereid.yaml cannot know: $MODEL_FOLDER names it.
    import obstore

    obstore.put(s3.store, f"{s3.prefix}/tripler/model_inference.textproto", SCALE_TEXTPROTO.encode())
    obstore.put(s3.store, f"{s3.prefix}/tripler/libtriple.so", libs["triple"].read_bytes())
    config = tmp_path / "nereid.yaml"
    config.write_text(f'server:\n  bind_addr: "127.0.0.1:0"\n  metrics_addr: ""\n  http_addr: ""\n'
                      f'  ml_backends_path: "{s3.url()}"\n  cache_dir: "{tmp_path / "cache"}"\nmodels:\n'
                      + "".join(f"  {line}\n" for line in
                                entry("tripler", '{library: "$MODEL_FOLDER/libtriple.so"}').splitlines()))
    server = serve(config)
    assert server.client.infer("tripler", [tensor("input", ROWS)]).as_numpy("output").tolist() == \
        (ROWS * 3).tolist()


def test_model_folder_paths_resolve_per_model_and_need_a_folder(tmp_path):
    from nereid.backends.cxx.options import parse_options
    from nereid.errors import ConfigError

    options = parse_options("m", {"sources": ["$MODEL_FOLDER/src/a.cpp", "/abs/b.cpp"]}, "", tmp_path / "m")
    assert options.sources == (tmp_path / "m" / "src" / "a.cpp", Path("/abs/b.cpp"))
    with pytest.raises(ConfigError, match=r"runtime.library: uses \$MODEL_FOLDER, but no model folder is known"):
        parse_options("m", {"library": "$MODEL_FOLDER/lib.so"}, "")


def test_a_source_yaml_read_as_a_boolean_is_named_by_its_item_with_the_advice_to_quote(tmp_path):
    """Stop 48's walkthrough: `sources: [a.cpp, on]` said only "runtime.sources: must be a path ..., got true",
    with neither the item nor the advice to quote that `backend: on` gets."""
    from nereid.backends.cxx.options import parse_options
    from nereid.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        parse_options("m", {"sources": ["/abs/a.cpp", True]}, "", tmp_path / "m")
    assert "runtime.sources[1]: must be a path" in str(refused.value)
    assert "put the text in quotes" in str(refused.value) and str(refused.value).endswith("got true")


def test_a_path_holding_a_nul_is_refused_naming_its_key(tmp_path):
    """The config hunt: it failed the load as "ValueError: embedded null byte (raised by the load() of built-in
    backend 'cxx')", naming neither the key nor the value."""
    from nereid.backends.cxx.options import parse_options
    from nereid.errors import ConfigError

    for runtime, key in (({"library": "lib\0x.so"}, "library"), ({"sources": ["/abs/a.cpp", "b\0.cpp"]}, "sources[1]")):
        with pytest.raises(ConfigError, match=rf"runtime\.{re.escape(key)}: must be a path .*got '.*\\x00"):
            parse_options("m", runtime, "", tmp_path / "m")


def test_a_models_own_library_or_sources_replaces_the_other_from_backends_cxx(tmp_path):
    """Found by a README check: under `backends: {cxx: {sources: [...]}}` (as the README suggests) a model with its
    own `library:` inherited `sources:` too, and was refused ("needs exactly one of ... in nereid.yaml: models[1]")
    naming only its own entry, which held one."""
    from nereid.backends.cxx.options import parse_options
    from nereid.errors import ConfigError
    from nereid.runtime_options import LayeredRuntime

    folder = tmp_path / "m"
    sources = {"sources": ["$MODEL_FOLDER/model.cpp"]}
    library = {"library": "$MODEL_FOLDER/libm.so"}
    defaults = "nereid.yaml: backends.cxx"
    own_library = parse_options("m", LayeredRuntime(library, sources, defaults), "nereid.yaml: models[1]", folder)
    assert own_library == parse_options("m", library, "", folder)
    own_sources = parse_options("m", LayeredRuntime(sources, library, defaults), "nereid.yaml: models[1]", folder)
    assert own_sources == parse_options("m", sources, "", folder)
    # Both in the default: named there, not under the model that wrote neither.
    with pytest.raises(ConfigError, match=r"needs exactly one of runtime.library .* in nereid.yaml: backends.cxx, "):
        parse_options("m", LayeredRuntime({}, {**library, **sources}, defaults), "nereid.yaml: models[1]", folder)
    with pytest.raises(ConfigError, match=r"needs exactly one of runtime.library .* in nereid.yaml: models\[1\], "):
        parse_options("m", LayeredRuntime({**library, **sources}, {}, defaults), "nereid.yaml: models[1]", folder)


def test_relative_paths_are_taken_next_to_a_symlinked_nereid_yaml_as_named(tmp_path):
    """In a Kubernetes ConfigMap nereid.yaml is a symlink into a versioned folder: a library named relative to it
    was looked for in that folder (where no library is), unlike every relative path the core resolves."""
    from nereid.backends.cxx.options import parse_options

    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "nereid.yaml").write_text("models: []\n")
    (tmp_path / "mounted").mkdir()
    (tmp_path / "mounted" / "nereid.yaml").symlink_to(tmp_path / "cfg" / "nereid.yaml")
    (tmp_path / "mounted" / "build").mkdir()
    (tmp_path / "mounted" / "build" / "libm.so").write_bytes(b"")
    origin = f"{tmp_path / 'mounted' / 'nereid.yaml'}: models[0]"
    assert parse_options("m", {"library": "build/libm.so"}, origin).library == tmp_path / "mounted" / "build" / \
        "libm.so"
    # Nothing there as named: next to the file the link points to, as the core's paths.
    assert parse_options("m", {"sources": ["src/m.cpp"]}, origin).sources == (tmp_path / "cfg" / "src" / "m.cpp",)


def test_the_nereid_yaml_of_a_settings_origin_is_the_file_it_starts_with():
    from nereid.backends.cxx.options import config_file

    assert config_file("deploy/nereid.yaml: models[12]") == Path("deploy/nereid.yaml")
    assert config_file("/a: models[3]/nereid.yaml: models[0]") == Path("/a: models[3]/nereid.yaml")
    assert config_file("nereid.yaml: backends.cxx") is None  # a default, not a listed model
    assert config_file("") is None


@pytest.mark.parametrize("runtime,message", [
    ({"library": "build/libm.so"}, "model 'm': runtime.library: is relative, but the model's settings come from no "
                                   "nereid.yaml; use an absolute path, got 'build/libm.so'"),
    ({"sources": []}, "model 'm': runtime.sources: must be a non-empty list of C++ source files, got []"),
    ({"sources": "a.cpp"}, "model 'm': runtime.sources: must be a non-empty list of C++ source files, got 'a.cpp'"),
    ({}, "model 'm': backend cxx needs exactly one of runtime.library (a shared library) or runtime.sources (C++ "
         "files to build one from) in nereid.yaml, e.g. runtime: {library: build/libmodel.so}"),
], ids=["relative without nereid.yaml", "no sources", "sources not a list", "neither"])
def test_options_that_name_no_library_the_load_can_find_are_refused_saying_what_to_write(runtime, message):
    from nereid.backends.cxx.options import parse_options
    from nereid.errors import ConfigError

    with pytest.raises(ConfigError) as refused:
        parse_options("m", runtime, "")
    assert str(refused.value) == message


def test_refusals_name_the_configuration_file_the_server_was_started_with():
    """`nereid serve --config prod.yaml`: a path was said to be relative to nereid.yaml (ModelContext.config_name)."""
    from nereid.backends.cxx.options import parse_options
    from nereid.errors import ConfigError

    with pytest.raises(ConfigError, match=r"runtime\.library: must be a path \(absolute, relative to prod\.yaml, or "
                                          r"under \$MODEL_FOLDER/\), got ''$"):
        parse_options("m", {"library": ""}, "/etc/nereid/prod.yaml: models[0]", config_name="prod.yaml")
    with pytest.raises(ConfigError, match=r"runtime\.sources \(C\+\+ files to build one from\) in prod\.yaml, "):
        parse_options("m", {}, "", config_name="prod.yaml")  # (a context with no settings origin)


def test_a_library_or_sources_named_in_full_are_taken_as_they_are():
    from nereid.backends.cxx.options import CxxOptions, parse_options

    assert parse_options("m", {"library": "/opt/libm.so"}, "") == CxxOptions(library=Path("/opt/libm.so"))
    assert parse_options("m", {"sources": ["/src/a.cpp", "/src/b.cc"]}, "nereid.yaml: models[0]") == \
        CxxOptions(sources=(Path("/src/a.cpp"), Path("/src/b.cc")))
