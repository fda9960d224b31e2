"""backends/meta/model.py without a server: the manifest keys, claims, load refusals, cycles, nereid check."""

from __future__ import annotations

import asyncio
import textwrap
from pathlib import Path

import numpy as np
import pytest

import nereid
from nereid.backend import ModelContext
from nereid.backends.xla.manifest import parse_manifest_text
from nereid.cli import check
from nereid.dependencies import describe_cycle, find_cycle
from nereid.errors import ConfigError, ModelFailure, Unavailable
from nereid.model_hooks import identity
from nereid.plugins import claim_folder, make_plugin_manager
from nereid.model_building import build_model
from nereid.settings import ModelSettings, load_settings
from nereid.tensors import NamedTensor

TENSORS = ("client_inputs: [{name: x, dtype: f32, shape: an, dims: {a: 4}}]\n"
           "client_outputs: [{name: y, dtype: f32, shape: an, dims: {a: 4}}]\n")
META = f'format_version: "2.1"\nmeta: true\ndepends_on: [a, b]\n{TENSORS}batching: {{max_batch_size: 8}}\n'


def parse(text: str):
    return parse_manifest_text(text, Path("/m/manifest.yaml"))


def test_a_meta_manifest_is_parsed_like_any_other() -> None:
    manifest = parse(META)
    assert manifest.is_meta and manifest.depends_on == ("a", "b")
    assert manifest.executable_inputs == () and manifest.batching.largest == 8
    assert [t.name for t in manifest.client_inputs] == ["x"]
    assert not parse(META.replace("meta: true\ndepends_on: [a, b]\n", "")
                     .replace(TENSORS, "executable_inputs: [{name: x, dtype: f32, shape: an, dims: {a: 4}}]\n"
                                       "executable_outputs: [{name: y, dtype: f32, shape: an, dims: {a: 4}}]\n")
                     .replace("max_batch_size: 8", "compiled_batch_sizes: [8]")).is_meta


@pytest.mark.parametrize("text, fragment", [
    (META.replace("meta: true", "meta: 1"), "meta: must be true or false"),
    (META.replace("meta: true", "meta: false"), "depends_on: lists the models a meta model calls"),
    (META + "executable_inputs: []\n", "executable_inputs: a meta model runs no program of its own"),
    (META + "weights_file: w.safetensors\n", "weights_file: a meta model runs no program"),
    (META.replace("client_outputs", "other_outputs"), "unknown key"),
    (META.replace("depends_on: [a, b]", "depends_on: [a, a]"), "depends_on[1]: is listed twice"),
    (META.replace("depends_on: [a, b]", "depends_on: [../x]"), "depends_on[0]: must be a model name"),
    (META.replace("client_inputs: [{name: x,", "client_inputs: [{name: on,"), "client_inputs[0].name: must be a "
     "non-empty string (YAML reads an unquoted yes, no, on, off, true or false as a boolean: put the text in quotes), "
     "got true"),
    (META.replace("depends_on: [a, b]", "depends_on: [a, yes]"), "depends_on[1]: must be a model name (a folder "
     "name in ml_backends_path) (YAML reads an unquoted yes, no, on, off, true or false as a boolean: put the text in "
     "quotes), got true"),
    (META.replace("max_batch_size: 8", "compiled_batch_sizes: [8]"), "batching.compiled_batch_sizes: unknown key (allowed: max_batch_size)"),
    (META.replace("batching: {max_batch_size: 8}\n", ""), "give batching: {max_batch_size: N}"),
    # Found by a bug hunt: with one tensor unbatched, the cap was silently never applied (max_batch_size 0 served).
    (META.replace("client_inputs: [{name: x, dtype: f32, shape: an, dims: {a: 4}}]",
                  "client_inputs: [{name: x, dtype: f32, shape: an, dims: {a: 4}}, "
                  "{name: mode, dtype: i32, shape: a, dims: {a: 1}}]"),
     "batching.max_batch_size: tensor 'mode' ('a') has no batch axis (n or b): a meta model that batches needs one "
     "in every client tensor"),
])
def test_meta_manifest_mistakes_name_the_key(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError, match="manifest.yaml") as info:
        parse(text)
    assert fragment in str(info.value)


def test_missing_client_outputs_is_refused() -> None:
    text = META.replace("client_outputs: [{name: y, dtype: f32, shape: an, dims: {a: 4}}]\n", "")
    with pytest.raises(ConfigError, match="client_outputs: is required"):
        parse(text)
    empty = META.replace("client_outputs: [{name: y, dtype: f32, shape: an, dims: {a: 4}}]", "client_outputs: []")
    with pytest.raises(ConfigError, match=r"client_outputs: must list at least one tensor .*, got \[\]"):
        parse(empty)


def test_find_cycle() -> None:
    graph = {"a": ["b"], "b": ["c", "d"], "c": ["a"], "d": [], "e": ["e"], "f": ["e"]}
    assert find_cycle("a", lambda n: graph.get(n, [])) == ["a", "b", "c", "a"]
    assert find_cycle("d", lambda n: graph.get(n, [])) is None
    assert find_cycle("e", lambda n: graph.get(n, [])) == ["e", "e"]
    assert find_cycle("f", lambda n: graph.get(n, [])) is None  # e's cycle is e's to report
    assert describe_cycle(["a", "b", "a"]) == "'a' -> 'b' -> 'a'"


ECHO = '''
import nereid

async def orchestrate(inputs, ctx):
    return await ctx.infer("a", inputs)

nereid.register_model(orchestrate=orchestrate)
'''


def meta_folder(root: Path, name: str, model_py: str | None = ECHO, manifest: str = META) -> Path:
    folder = root / name
    folder.mkdir()
    (folder / "manifest.yaml").write_text(manifest)
    if model_py is not None:
        (folder / "model.py").write_text(textwrap.dedent(model_py))
    return folder


def meta_repository(tmp_path: Path, models_yaml: str = ""):
    """A ModelRepository (no server) over ``tmp_path/ml-backends``, which the test fills with meta folders."""
    from nereid.repository import ModelRepository

    (tmp_path / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml-backends"\n  metrics_addr: ""\n'
                                          f'  http_addr: ""\n{models_yaml}')
    (tmp_path / "scratch").mkdir()
    return ModelRepository(load_settings(tmp_path / "nereid.yaml"), make_plugin_manager(load_entry_points=False),
                           tmp_path / "scratch")


def build(folder: Path):
    return build_model(make_plugin_manager(load_entry_points=False),
                       ModelContext(folder.name, folder, ModelSettings(folder.name), folder.parent))


def test_the_meta_backend_claims_meta_manifests_and_xla_declines_them(tmp_path: Path) -> None:
    manager = make_plugin_manager(load_entry_points=False)
    meta = meta_folder(tmp_path, "m")
    assert claim_folder(manager, meta).backend_name == "meta"
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "manifest.yaml").write_text("format_version: '2.1'\n")
    assert claim_folder(manager, bundle).backend_name == "xla"
    built = build(meta)
    assert built.backend.platform == "nereid_meta" and built.backend_name == "meta"
    assert not built.policy.enabled and built.backend.concurrent_executions() == 128
    assert built.signature.max_batch_size == 8


@pytest.mark.parametrize("model_py, fragment", [
    (None, "has no model.py: a meta model's model.py calls nereid.register_model(orchestrate=fn)"),
    ("import nereid\nnereid.register_model(postprocess=lambda t: t)\n", "registered no orchestration"),
    ("import nereid\nasync def f(inputs):\n    return inputs\nnereid.register_model(orchestrate=f)\n",
     "orchestrate must take two arguments (inputs, ctx)"),
    ("import nereid\nnereid.register_model(orchestrate=lambda i, c: i, preprocess=lambda t: t)\n",
     "orchestrate (a meta model) takes no preprocess or postprocess"),
])
def test_load_refusals_name_the_model_and_the_problem(tmp_path: Path, model_py: str | None, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        build(meta_folder(tmp_path, "m", model_py))
    assert "'m'" in str(info.value) and fragment in str(info.value)


def test_a_bundle_model_py_may_not_orchestrate(tmp_path: Path) -> None:
    from nereid.model_hooks import load_model_hooks

    (tmp_path / "model.py").write_text(ECHO)
    with pytest.raises(ConfigError, match="registers orchestrate, which only a meta model has: add meta: true"):
        load_model_hooks(tmp_path / "model.py", "bundle")


def test_weights_next_to_a_meta_manifest_are_refused(tmp_path: Path) -> None:
    folder = meta_folder(tmp_path, "m")
    (folder / "weights.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"holds program or weights files \(weights.safetensors\)") as refused:
        build(folder)
    # (The pipelines hunt: where a meta model's own weights may go was said nowhere.)
    assert str(refused.value).endswith("(weights model.py reads itself may sit in a subfolder: "
                                       "weights/proj.safetensors)")


def test_a_cycle_is_refused_at_load_naming_it(tmp_path: Path) -> None:
    meta_folder(tmp_path, "a", manifest=META.replace("[a, b]", "[b]"))
    meta_folder(tmp_path, "b", manifest=META.replace("[a, b]", "[c]"))
    meta_folder(tmp_path, "c", manifest=META.replace("[a, b]", "[a]"))
    with pytest.raises(ConfigError, match="depends_on forms a cycle 'b' -> 'c' -> 'a' -> 'b'"):
        build(tmp_path / "b")
    with pytest.raises(ConfigError, match="cycle 'm' -> 'm'"):
        build(meta_folder(tmp_path, "m", manifest=META.replace("[a, b]", "[m]")))


def test_outside_a_server_sub_calls_are_unavailable_and_outputs_are_checked(tmp_path: Path) -> None:
    x = [NamedTensor.from_array("x", np.ones((2, 4), np.float32))]
    built = build(meta_folder(tmp_path, "m"))
    with pytest.raises(Unavailable, match="meta model 'm': cannot call 'a': the model was loaded outside a server"):
        asyncio.run(built.backend.infer(x))
    wrong = "import nereid\nasync def f(inputs, ctx):\n    return inputs\nnereid.register_model(orchestrate=f)\n"
    built = build(meta_folder(tmp_path, "w", wrong))
    with pytest.raises(ModelFailure, match=r"meta model 'w': orchestrate returned outputs \['x'\], expected \['y'\]"):
        asyncio.run(built.backend.infer(x))
    with pytest.raises(RuntimeError, match="call it from the bundle's model.py"):
        nereid.register_model(orchestrate=identity)


def test_nereid_check_shows_meta_models(tmp_path: Path, capsys) -> None:
    root = tmp_path / "ml-backends"
    root.mkdir()
    meta_folder(root, "a", manifest=META.replace("[a, b]", "[]"))
    meta_folder(root, "loop", manifest=META.replace("[a, b]", "[loop]"))
    (tmp_path / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml-backends"\n')
    assert check(load_settings(tmp_path / "nereid.yaml")) == 1
    out = capsys.readouterr().out
    assert "a: OK backend=meta device=cpu max_batch_size=8 batching=off inputs=[x FP32[4]] outputs=[y FP32[4]] " \
           "depends_on=- orchestrate=async" in out
    assert "loop: UNAVAILABLE: model 'loop': depends_on forms a cycle 'loop' -> 'loop'" in out


@pytest.mark.parametrize("config_name", ["nereid.yaml", "prod.yaml"])
def test_nereid_check_fails_a_meta_model_a_server_would_keep_unavailable(tmp_path: Path, capsys,
                                                                         config_name: str) -> None:
    """Defect: a meta model calling a model with no folder, one that fails, or one nereid.yaml does not list
    passed the check (OK, exit 0), though the server keeps it UNAVAILABLE and ServerReady false. The file is
    named as given (`nereid check --config prod.yaml`), an unlisted model's state matched by that name too."""
    root = tmp_path / "ml-backends"
    root.mkdir()
    meta_folder(root, "a", manifest=META.replace("[a, b]", "[]"))
    meta_folder(root, "typo", manifest=META.replace("[a, b]", "[a_typo]"))
    meta_folder(root, "loop", manifest=META.replace("[a, b]", "[loop]"))
    meta_folder(root, "above_loop", manifest=META.replace("[a, b]", "[a, loop]"))
    meta_folder(root, "fine", manifest=META.replace("[a, b]", "[a]"))
    meta_folder(root, "above_fine", manifest=META.replace("[a, b]", "[fine]"))

    def checked(models: str = "") -> tuple[int, dict[str, str]]:
        """nereid check's exit code with these nereid.yaml models: lines, and its line per model."""
        (tmp_path / config_name).write_text(f'server:\n  ml_backends_path: "ml-backends"\n{models}')
        code = check(load_settings(tmp_path / config_name))
        return code, {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines()}

    code, lines = checked()
    assert code == 1
    assert lines["typo"].startswith("typo: UNAVAILABLE: dependency 'a_typo' is not a model of this server (no "
                                    "folder 'a_typo' in ml_backends_path); loaded as backend=meta ")
    assert lines["above_loop"].startswith("above_loop: UNAVAILABLE: dependency 'loop' is not ready (UNAVAILABLE: "
                                          "its check failed); loaded as backend=meta ")
    assert lines["fine"].startswith("fine: OK ") and lines["above_fine"].startswith("above_fine: OK ")
    assert lines[str(tmp_path / config_name)].endswith(": 3 model(s) with problems")  # loop, typo, above_loop
    # With a models: key, a dependency that is not listed is not loaded at start: the caller would wait.
    code, lines = checked("models:\n  - name: fine\n  - name: above_fine\n")
    assert code == 1
    assert lines["fine"].startswith("fine: UNAVAILABLE: dependency 'a' is not ready (UNAVAILABLE: not listed in "
                                    f"{config_name})")
    assert lines["above_fine"].startswith("above_fine: UNAVAILABLE: dependency 'fine' is not ready (UNAVAILABLE: "
                                          f"dependency 'a' is not ready (UNAVAILABLE: not listed in {config_name}))")
    # Neither listed: a later load of 'a', then of 'fine', serves both; no problem (a regression of the above).
    _, lines = checked("models:\n  - name: above_fine\n")
    assert lines["fine"].startswith("fine: OK ") and lines["fine"].endswith(f"(not listed in {config_name})")
    assert lines["typo"].startswith("typo: UNAVAILABLE: dependency 'a_typo' is not a model")  # still a problem


def test_nereid_check_shows_a_meta_model_calling_a_model_waiting_for_its_folder_waiting_too(tmp_path: Path,
                                                                                             capsys) -> None:
    """Found by the meta hunt: in dynamic mode, a listed model whose folder has not landed is WAITING (exit 0), but
    a meta model calling it failed the check, though the server makes both READY once the folder lands. One that
    also calls a model with no way to become ready is still a problem."""
    root = tmp_path / "ml-backends"
    root.mkdir()
    meta_folder(root, "pipeline", manifest=META.replace("[a, b]", "[later]"))
    meta_folder(root, "above", manifest=META.replace("[a, b]", "[pipeline]"))
    (tmp_path / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml-backends"\n  watch: true\n'
                                          "models:\n  - name: pipeline\n  - name: above\n  - name: later\n")
    assert check(load_settings(tmp_path / "nereid.yaml")) == 0
    lines = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["pipeline"].startswith("pipeline: WAITING: dependency 'later' is not ready (UNAVAILABLE: waiting for "
                                        "its folder 'later' in ml_backends_path) (it is READY once the folders it "
                                        "waits for land); loaded as backend=meta ")
    assert lines["above"].startswith("above: WAITING: dependency 'pipeline' is not ready")
    assert lines[str(tmp_path / "nereid.yaml")] == (
        f"{tmp_path / 'nereid.yaml'}: OK (1 listed model(s) waiting for their folders, and 2 model(s) calling them: "
        "the server is not ready until they land)")
    # Told by what keeps it unavailable once the folder lands.
    meta_folder(root, "broken", manifest=META.replace("[a, b]", "[later, typo]"))
    assert check(load_settings(tmp_path / "nereid.yaml")) == 1
    lines = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert lines["broken"].startswith("broken: UNAVAILABLE: dependency 'typo' is not a model of this server"), \
        lines["broken"]


def test_readiness_changes_caused_by_dependencies_are_logged_once_each(tmp_path: Path, caplog) -> None:
    # A meta model loaded before what it calls was logged "is READY" while UNAVAILABLE, and its later
    # transitions (its dependency loading, unloading, loading again) were never logged at all.
    import logging

    from nereid.model_entry import ModelState

    root = tmp_path / "ml-backends"
    root.mkdir()
    meta_folder(root, "a", manifest=META.replace("[a, b]", "[]"))
    meta_folder(root, "misc", manifest=META.replace("[a, b]", "[a]"))
    repo = meta_repository(tmp_path, "models:\n  - name: misc\n")
    caplog.set_level(logging.INFO, logger="nereid.repository")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("model 'misc' is ")]

    async def scenario() -> None:
        misc = await repo.load("misc")
        assert misc.state is ModelState.UNAVAILABLE and "dependency 'a' is not ready" in misc.reason
        assert len(lines()) == 1 and lines()[0].startswith("model 'misc' is UNAVAILABLE: dependency 'a' is not ready")
        for step, expected in ((repo.load, "READY"), (repo.unload, "UNAVAILABLE"), (repo.load, "READY")):
            seen = len(lines())
            await step("a")
            assert misc.state.value == expected
            assert [line.split(" ")[3].rstrip(":") for line in lines()[seen:]] == [expected], lines()
        await repo.unload_all()

    asyncio.run(scenario())


def test_a_new_reason_that_is_not_a_loading_model_is_logged(tmp_path: Path, caplog) -> None:
    """Defect: a meta model waiting on a LOADING model (INFO), then on a missing one once that was READY, never
    said so: a changed reason alone was not logged, so the log's last word was the misleading LOADING line."""
    import logging

    root = tmp_path / "ml-backends"
    root.mkdir()
    meta_folder(root, "a", manifest=META.replace("[a, b]", "[]"))
    meta_folder(root, "pair", manifest=META.replace("[a, b]", "[a, ghost]"))
    meta_folder(root, "on_broken", manifest=META.replace("[a, b]", "[broken]"))
    meta_folder(root, "broken", model_py="raise RuntimeError('no weights')\n", manifest=META.replace("[a, b]", "[]"))
    repo = meta_repository(tmp_path)
    caplog.set_level(logging.INFO, logger="nereid.repository")

    async def scenario() -> None:
        await repo.load("pair")
        caplog.clear()
        await repo.load("a")
        lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.getMessage().startswith("model 'pair'")]
        assert lines == [("WARNING", "model 'pair' is UNAVAILABLE: dependency 'ghost' is not a model of this "
                                     "server (no folder 'ghost' in ml_backends_path)")]
        # The same dependency, from LOADING to failed: the last word was the LOADING line (a regression of the
        # fix above, which logged only a change of the dependency named).
        await repo.load("on_broken")
        caplog.clear()
        await repo.load("broken")
        lines = [(r.levelname, r.getMessage()) for r in caplog.records
                 if r.getMessage().startswith("model 'on_broken'")]
        assert [level for level, _ in lines] == ["WARNING"], lines
        assert lines[0][1].startswith("model 'on_broken' is UNAVAILABLE: dependency 'broken' is not ready "
                                      "(UNAVAILABLE: ")
        await repo.unload_all()

    asyncio.run(scenario())


def test_a_clean_shutdown_unloads_callers_first_and_warns_of_nothing(tmp_path: Path, caplog) -> None:
    """Defect: every clean shutdown of a server with meta models logged "model 'top' is UNAVAILABLE:
    dependency 'mid' is not ready (UNLOADING)" at WARNING: what they call was unloaded first."""
    import logging

    root = tmp_path / "ml-backends"
    root.mkdir()
    meta_folder(root, "a", manifest=META.replace("[a, b]", "[]"))
    meta_folder(root, "mid", manifest=META.replace("[a, b]", "[a]"))
    meta_folder(root, "top", manifest=META.replace("[a, b]", "[mid, a]"))
    repo = meta_repository(tmp_path)

    async def scenario() -> None:
        for name in ("a", "mid", "top"):
            await repo.load(name)
        caplog.set_level(logging.INFO, logger="nereid.repository")
        caplog.clear()
        await repo.unload_all(grace_s=0)
        assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
        unloaded = [r.getMessage().split("'")[1] for r in caplog.records if r.getMessage().endswith("unloaded")]
        assert unloaded == ["top", "mid", "a"], caplog.text

    asyncio.run(scenario())


def test_runtime_options_are_refused_naming_where_they_are_written(tmp_path: Path, capsys) -> None:
    """A meta model has no runtime options: `runtime: {typo_option: 1}` and `backends: {meta: ...}` were ignored."""
    folder = meta_folder(tmp_path, "m", manifest=META.replace("[a, b]", "[]"))
    settings = ModelSettings("m", runtime={"typo_option": 1})
    with pytest.raises(ConfigError) as info:
        build_model(make_plugin_manager(load_entry_points=False),
                    ModelContext("m", folder, settings, tmp_path, "nereid.yaml: models[0]"))
    assert str(info.value) == ("nereid.yaml: models[0].runtime.typo_option: unknown option of the meta backend "
                               "(it has no runtime options), got 1")
    root = tmp_path / "ml-backends"
    root.mkdir()
    meta_folder(root, "a", manifest=META.replace("[a, b]", "[]"))
    config = tmp_path / "nereid.yaml"
    config.write_text('server:\n  ml_backends_path: "ml-backends"\nbackends:\n  meta: {x: 1}\n')
    assert check(load_settings(config)) == 1
    assert (f"a: UNAVAILABLE: {config}: backends.meta.x: unknown option of the meta backend (it has no runtime "
            "options), got 1") in capsys.readouterr().out


def test_model_config_counts_the_orchestrations_that_run_at_once_and_instances_is_warned_of(tmp_path: Path,
                                                                                            caplog) -> None:
    """Defect: a meta model's ModelConfig gave instance_group count `instances` (1 by default, or what a ported
    Triton ensemble's instance_group said), while up to queue_capacity orchestrations run at once; and an
    `instances` that does nothing was accepted without a word (batching rules too, found by a later hunt)."""
    import logging

    from nereid.model_info import describe_config

    root = tmp_path / "ml-backends"
    root.mkdir()
    meta_folder(root, "a", manifest=META.replace("[a, b]", "[]"))
    repo = meta_repository(tmp_path, "models:\n  - {name: a, queue_capacity: 8, instances: 4, batching: "
                                     "{max_queue_delay_ms: 200, preferred_batch_sizes: [4]}}\n")

    async def scenario() -> int:
        entry = await repo.load("a")
        count = describe_config("a", entry.loaded, entry.settings).instance_group.count
        await repo.unload_all(grace_s=0)
        return count

    caplog.set_level(logging.WARNING, logger="nereid.repository")
    assert asyncio.run(scenario()) == 8
    assert [r.getMessage() for r in caplog.records] == [
        "model 'a': instances: 4 does not apply to a model that calls models; 8 of its requests run at once (its "
        "backend's count; queue_capacity for a meta model)",
        "model 'a': batching: max_queue_delay_ms, preferred_batch_sizes does not apply to a model that calls "
        "models; each of its requests runs alone, as an orchestration with its own deadline (the models it calls "
        "batch their sub-calls)"]


def test_nereid_check_warns_of_instances_on_a_meta_model_as_the_server_does(tmp_path: Path, caplog, capsys) -> None:
    """Found by a README check: `nereid check` said nothing of an `instances` that does not apply."""
    import logging

    from nereid.cli import main as cli_main

    root = tmp_path / "ml-backends"
    root.mkdir()
    meta_folder(root, "a", manifest=META.replace("[a, b]", "[]"))
    meta_repository(tmp_path, "models:\n  - {name: a, queue_capacity: 8, instances: 4}\n")  # (writes nereid.yaml)
    caplog.set_level(logging.WARNING, logger="nereid.repository")
    assert cli_main(["check", "--config", str(tmp_path / "nereid.yaml")]) == 0
    assert "model 'a': instances: 4 does not apply to a model that calls models; 8 of its requests run at once" in \
        caplog.text, (caplog.text, capsys.readouterr())


def warnings_of_loading(tmp_path: Path, caplog, entry: str, logger: str) -> list[str]:
    """Load a meta model 'a' (calling none) listed as ``entry`` (a flow mapping); the WARNING lines ``logger``
    logged, once it is checked to be READY."""
    import logging

    root = tmp_path / "ml-backends"
    root.mkdir()
    meta_folder(root, "a", manifest=META.replace("[a, b]", "[]"))
    repo = meta_repository(tmp_path, f"models:\n  - {entry}\n")

    async def scenario() -> str:
        loaded = await repo.load("a")
        state = loaded.state.value
        await repo.unload_all(grace_s=0)
        return state

    caplog.set_level(logging.WARNING, logger=logger)
    assert asyncio.run(scenario()) == "READY"
    return [r.getMessage() for r in caplog.records if r.name == logger]


def test_a_device_is_warned_of_and_ignored(tmp_path: Path, caplog) -> None:
    """Defect: `device: cuda:1` on a meta model was accepted without a word, though nothing runs there."""
    assert warnings_of_loading(tmp_path, caplog, "{name: a, device: 'cuda:1'}", "nereid.backends.meta.model") == [
        "model 'a': device: cuda:1 does not apply to a meta model (its orchestration runs on the server's event "
        "loop; each model it calls runs on its own device); ignored"]


def test_a_device_ignored_is_not_reported_as_the_model_s(tmp_path: Path, capsys) -> None:
    """Found by a bug hunt: the device said to be ignored was still the model's in `nereid check` (device=cuda:1)
    and in ModelConfig (KIND_GPU, gpus [1]), on a machine with no GPU."""
    from nereid.cli import main as cli_main
    from nereid.model_info import describe_config

    root = tmp_path / "ml-backends"
    root.mkdir()
    meta_folder(root, "a", manifest=META.replace("[a, b]", "[]"))
    repo = meta_repository(tmp_path, "models:\n  - {name: a, device: 'cuda:1'}\n")  # (writes nereid.yaml)
    assert cli_main(["check", "--config", str(tmp_path / "nereid.yaml")]) == 0
    assert "a: OK backend=meta device=cpu " in capsys.readouterr().out

    async def scenario():
        entry = await repo.load("a")
        try:
            return describe_config("a", entry.loaded, repo.settings.model("a")).instance_group
        finally:
            await repo.unload_all(grace_s=0)
    group = asyncio.run(scenario())
    assert (group.kind, group.gpus) == ("KIND_CPU", ())


@pytest.mark.parametrize("timeout", ["0.5", "null", "60"])
def test_a_timeout_s_is_warned_of_and_ignored(tmp_path: Path, caplog, timeout: str) -> None:
    """Found by a bug hunt: `timeout_s` on a meta model (as on a bundle or a cxx model) was accepted without a
    word, though nothing stops one of its requests at that time (the default, which every entry has, is quiet)."""
    warned = warnings_of_loading(tmp_path, caplog, f"{{name: a, timeout_s: {timeout}}}", "nereid.backend")
    assert warned == ([] if timeout == "60" else [
        f"model 'a': timeout_s: {timeout} does not apply: a meta model's requests are bounded by their deadlines "
        "(the gRPC deadline or the timeout parameter), and the models it calls by their own"])


def test_a_sub_call_to_a_model_gone_is_unavailable_not_not_found(tmp_path: Path) -> None:
    """Found by a bug hunt: a model a meta model calls, its folder deleted while a request ran, made that request
    NOT_FOUND (HTTP 404): a router takes that to mean the meta model itself is unknown, where requests a moment
    later are told UNAVAILABLE."""
    from toy_backends import toy_dataplane

    from nereid.tensors import InferRequest

    plane = toy_dataplane(tmp_path / "server")  # the real data plane, which has no model 'a'
    folder = meta_folder(tmp_path, "m")
    built = build_model(make_plugin_manager(load_entry_points=False),
                        ModelContext("m", folder, ModelSettings("m"), tmp_path, "test", plane))
    x = [NamedTensor.from_array("x", np.ones((2, 4), np.float32))]
    with pytest.raises(Unavailable, match=r"^meta model 'm': sub-call to 'a' failed: unknown model 'a'"):
        asyncio.run(built.backend.call(InferRequest("a", x)))


def test_a_meta_models_reason_follows_a_dependency_that_gets_an_entry(tmp_path: Path) -> None:
    """Found by a bug hunt: a meta model kept saying its dependency "is not a model of this server (no folder
    ...)" after that folder appeared (or nereid.yaml came to list it): a new entry settled no caller again."""
    root = tmp_path / "ml-backends"
    root.mkdir()
    meta_folder(root, "pair", manifest=META.replace("[a, b]", "[ghost]"))
    repo = meta_repository(tmp_path)

    async def scenario() -> None:
        pair = await repo.load("pair")
        assert pair.reason.startswith("dependency 'ghost' is not a model of this server (no folder 'ghost'")
        meta_folder(root, "ghost", manifest=META.replace("[a, b]", "[]"))
        repo.rescan()  # (as RepositoryIndex does)
        assert pair.reason.startswith("dependency 'ghost' is not ready (UNAVAILABLE: "), pair.reason
        await repo.unload_all()

    asyncio.run(scenario())


@pytest.mark.parametrize("raised, problem", [
    ("asyncio.CancelledError()", "CancelledError"),
    ("StopIteration()", "RuntimeError: coroutine raised StopIteration"),
])
def test_an_orchestrations_own_cancel_or_stop_iteration_is_its_fault_with_its_line(tmp_path: Path, raised: str,
                                                                                   problem: str) -> None:
    """Found by a bug hunt: a CancelledError the orchestration raised itself passed as the request's
    cancellation ("model 'm' failed: CancelledError", no meta model, no line); a StopIteration lost its line."""
    model_py = f"import asyncio\nimport nereid\nasync def f(inputs, ctx):\n    raise {raised}\n" \
               "nereid.register_model(orchestrate=f)\n"
    built = build(meta_folder(tmp_path, "m", model_py))
    x = [NamedTensor.from_array("x", np.ones((2, 4), np.float32))]
    with pytest.raises(ModelFailure, match=rf"^meta model 'm': orchestrate failed at model.py:4: {problem}$"):
        asyncio.run(built.backend.infer(x))


def test_a_plain_function_returning_a_coroutine_is_told_to_register_the_async_def(tmp_path: Path) -> None:
    """Found by a bug hunt: register_model(orchestrate=lambda i, c: real(i, c)) ran on a worker thread and failed
    with "got coroutine", and Python's "never awaited" warning surfaced later at an unrelated line."""
    import warnings

    model_py = ("import nereid\nfrom nereid.tensors import NamedTensor\n"
                "async def real(inputs, ctx):\n    return [NamedTensor('y', inputs[0].dtype, inputs[0].data)]\n"
                "nereid.register_model(orchestrate=lambda inputs, ctx: real(inputs, ctx))\n")
    built = build(meta_folder(tmp_path, "m", model_py))
    x = [NamedTensor.from_array("x", np.ones((2, 4), np.float32))]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the coroutine is closed: no "never awaited" warning)
        with pytest.raises(ModelFailure, match=r"^meta model 'm': orchestrate returned a coroutine, which nothing "
                                               r"awaits: it is a plain function .*register the async def itself$"):
            asyncio.run(built.backend.infer(x))
    built.backend.unload()
    # An async def that returns f(...) unawaited is told that, not that it is a plain function (the regression hunt).
    model_py = model_py.replace("orchestrate=lambda inputs, ctx: real(inputs, ctx)", "orchestrate=forgets") + \
        "async def forgets(inputs, ctx):\n    return real(inputs, ctx)\n"
    model_py = model_py.replace("nereid.register_model(orchestrate=forgets)\n", "") + \
        "nereid.register_model(orchestrate=forgets)\n"
    (tmp_path / "second").mkdir()
    built = build(meta_folder(tmp_path / "second", "m", model_py))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ModelFailure, match=r"^meta model 'm': orchestrate returned a coroutine it did not await "
                                               r"\(return await f\(\.\.\.\), not return f\(\.\.\.\)\)$"):
            asyncio.run(built.backend.infer(x))


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # (the slip itself)
@pytest.mark.parametrize("use, complaint", [
    ("(y,) = ctx.infer('m2', inputs)\n    return [y]", "TypeError: cannot unpack non-iterable coroutine object"),
    ("return [NamedTensor('y', x.dtype, ctx.infer('m2', inputs)[0].data)]",
     "TypeError: 'coroutine' object is not subscriptable"),
])
def test_an_orchestration_that_forgets_await_before_ctx_infer_is_asked(tmp_path: Path, use: str,
                                                                      complaint: str) -> None:
    """Defect (the new user's hunt): `(y,) = ctx.infer(...)` in an async def failed with Python's "cannot unpack
    non-iterable coroutine object" alone, where an `async def` returning f(...) unawaited is told so."""
    model_py = ("import nereid\nfrom nereid.tensors import NamedTensor\n"
                f"async def orchestrate(inputs, ctx):\n    (x,) = inputs\n    {use}\n"
                "nereid.register_model(orchestrate=orchestrate)\n")
    built = build(meta_folder(tmp_path, "m", model_py))
    x = [NamedTensor.from_array("x", np.ones((2, 4), np.float32))]
    with pytest.raises(ModelFailure) as failed:
        asyncio.run(built.backend.infer(x))
    assert str(failed.value).endswith(f"{complaint} (did you forget `await` before ctx.infer(...)?)"), failed.value
    built.backend.unload()
    # A plain def's ctx.infer blocks, returning no coroutine: a coroutine of its own is not ctx.infer's.
    model_py = model_py.replace("async def orchestrate", "def orchestrate").replace("ctx.infer('m2', inputs)",
                                                                                    "asyncio.sleep(0)")
    (tmp_path / "plain").mkdir()
    built = build(meta_folder(tmp_path / "plain", "m", "import asyncio\n" + model_py))
    with pytest.raises(ModelFailure) as failed:
        asyncio.run(built.backend.infer(x))
    assert str(failed.value).endswith(complaint), failed.value
    built.backend.unload()


def test_an_orchestration_whose_task_group_caught_a_failure_answers(tmp_path: Path) -> None:
    """Found by the regression hunt: on Python 3.11 a TaskGroup whose child fails cancels its parent task and never
    uncancels it, so a check of task.cancelling() (taken for "the client has gone") refused the orchestration's
    later sub-calls and turned its answer into a cancellation nobody answered (gRPC: no answer until the
    deadline). Such an orchestration answers."""
    model_py = ("import asyncio\nimport nereid\nfrom nereid.tensors import NamedTensor\n"
                "async def fails():\n    raise ValueError('child')\n"
                "async def orchestrate(inputs, ctx):\n"
                "    try:\n        async with asyncio.TaskGroup() as group:\n"
                "            group.create_task(asyncio.sleep(0.01))\n            group.create_task(fails())\n"
                "    except* ValueError:\n        pass\n"
                "    return [NamedTensor('y', inputs[0].dtype, inputs[0].data * 2)]\n"
                "nereid.register_model(orchestrate=orchestrate)\n")
    built = build(meta_folder(tmp_path, "m", model_py))
    x = [NamedTensor.from_array("x", np.ones((2, 4), np.float32))]
    (y,) = asyncio.run(built.backend.infer(x))
    np.testing.assert_array_equal(y.data, np.full((2, 4), 2, np.float32))


@pytest.mark.parametrize("returned, got", [("[None]", "a list whose item 0 is NoneType None"),
                                            ("(y, 3)", "a tuple whose item 1 is int 3"), ("y", "NamedTensor")])
def test_an_orchestration_returning_other_than_named_tensors_is_told_which_item(tmp_path: Path, returned: str,
                                                                               got: str) -> None:
    """The regression hunt: `return [None]` was told only "got list"."""
    model_py = ("import nereid\nfrom nereid.tensors import NamedTensor\nasync def orchestrate(inputs, ctx):\n"
                f"    y = NamedTensor('y', inputs[0].dtype, inputs[0].data)\n    return {returned}\n"
                "nereid.register_model(orchestrate=orchestrate)\n")
    built = build(meta_folder(tmp_path, "m", model_py))
    x = [NamedTensor.from_array("x", np.ones((2, 4), np.float32))]
    with pytest.raises(ModelFailure) as caught:
        asyncio.run(built.backend.infer(x))
    assert str(caught.value) == ("meta model 'm': orchestrate must return a list of nereid.tensors.NamedTensor "
                                 f"(outputs ['y']), got {got}")


def test_a_chain_of_meta_models_reads_each_manifest_it_reaches_once_while_it_is_unchanged(tmp_path: Path,
                                                                                          monkeypatch) -> None:
    """The complexity hunt: each meta model's load walked every manifest it reached, read from disk, so a chain of
    N read N**2 / 2 of them as it loaded (400 took 96 s of CPU). A manifest is read again only once it changes."""
    from nereid.backends.xla import manifest as manifests

    reads: list[str] = []  # the folder of each manifest parsed
    parse_manifest = manifests.parse_manifest
    monkeypatch.setattr(manifests, "parse_manifest", lambda document, path, *rest, **named: (
        reads.append(Path(path).parent.name), parse_manifest(document, path, *rest, **named))[1])
    names = [f"c{i}" for i in range(6)]
    for name, called in zip(names, [*names[1:], "leaf"]):
        meta_folder(tmp_path, name, manifest=META.replace("depends_on: [a, b]", f"depends_on: [{called}]"))
    for name in reversed(names):
        build(tmp_path / name).backend.unload()
    # Each parsed at its own load and once more when first reached (the walks parsed c5 six times, c4 five...).
    assert max(reads.count(name) for name in names) == 2, reads
    reads.clear()
    (tmp_path / "c5" / "manifest.yaml").write_text(META.replace("depends_on: [a, b]", "depends_on: [c0]"))
    with pytest.raises(Exception, match="cycle"):  # changed: read again, so the new cycle is seen
        build(tmp_path / "c0")
    assert "c5" in reads
