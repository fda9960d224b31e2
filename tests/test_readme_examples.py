"""The README's examples run as written: its curl examples answer what it shows, its plugin example serves."""

from __future__ import annotations

import json
import re
import shutil
import sys
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# curl -s -X POST 'http://[::1]:8000/v2/models/<model>/infer' -d '<body>'  (continued lines), then "# <answer>"
CURL_EXAMPLE = re.compile(r"^curl -s -X POST 'http://\[::1\]:8000(?P<path>/v2/models/(?P<model>\w+)/infer)' (?:\\\n)?"
                          r"\s*-d '(?P<body>[^']*)'\n# (?P<answer>.*)$", re.M)


def readme_examples() -> list[re.Match]:
    return list(CURL_EXAMPLE.finditer((ROOT / "README.md").read_text()))


def test_the_readme_curl_examples_answer_as_shown(repo, serve) -> None:
    examples = readme_examples()
    assert len(examples) >= 2, "the README's curl examples were not found: has their form changed?"
    for model in {example["model"] for example in examples}:
        shutil.copytree(ROOT / "ml-backends" / model, repo.models_dir / model)
    server = serve(repo.write_config())
    for example in examples:
        request = urllib.request.Request(f"http://127.0.0.1:{server.server.http_port}{example['path']}",
                                         data=example["body"].encode(), method="POST")  # curl -d's form type
        with urllib.request.urlopen(request, timeout=60) as response:
            answer = response.read().decode()
        shown = example["answer"]
        if shown.startswith("... "):  # the README shows the answer's end
            assert answer.endswith(shown[4:]), (example["path"], answer)
        else:
            assert json.loads(answer) == json.loads(shown), (example["path"], answer)


def test_the_readme_plugin_example_serves_a_model(tmp_path, monkeypatch) -> None:
    """The "Writing a backend plugin" example, as written, claims a folder, loads it and answers."""
    import asyncio
    import importlib

    import numpy as np

    from nereid.dataplane import DataPlane
    from nereid.dtypes import DType
    from nereid.plugins import make_plugin_manager
    from nereid.repository import ModelRepository
    from nereid.settings import load_settings
    from nereid.tensors import InferRequest, NamedTensor

    example = re.search(r"```python\n(# nereid_addone\.py\n.*?)```", (ROOT / "README.md").read_text(), re.S)
    assert example, "the README's plugin example was not found: has its form changed?"
    (tmp_path / "nereid_addone.py").write_text(example.group(1))
    monkeypatch.syspath_prepend(str(tmp_path))
    # Imported afresh and forgotten afterwards (monkeypatch records the name as absent, and removes it at the
    # end): tests/core/test_plugins.py installs a nereid_addone of its own.
    monkeypatch.setitem(sys.modules, "nereid_addone", None)
    del sys.modules["nereid_addone"]
    plugin = importlib.import_module("nereid_addone")
    folder = tmp_path / "ml" / "m"
    folder.mkdir(parents=True)
    (folder / "addone.txt").write_text("")
    (folder / "model_inference.textproto").write_text("input_shape: [4]\noutput_shape: [4]\nmax_batch_size: 8\n")
    (tmp_path / "nereid.yaml").write_text("server:\n  ml_backends_path: ml\n")
    (tmp_path / "scratch").mkdir()
    settings = load_settings(tmp_path / "nereid.yaml")
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(plugin,))
    plane = DataPlane(ModelRepository(settings, manager, tmp_path / "scratch"), settings, repository_control=True)

    async def scenario():
        await plane.load("m")
        response = await plane.infer(InferRequest("m", [NamedTensor("input", DType.FP32, np.ones((2, 4), np.float32))]))
        await plane.unload("m")
        return response.outputs[0].data
    assert asyncio.run(scenario()).tolist() == [[2.0] * 4] * 2
