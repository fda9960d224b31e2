"""The README's curl examples, sent as written to the shipped example models, answer what the README shows."""

from __future__ import annotations

import json
import re
import shutil
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
