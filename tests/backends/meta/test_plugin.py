"""backends/meta/plugin.py's hooks on their own: the meta backend claims a folder whose manifest.yaml says
``meta: true`` (or one declared ``backend: meta``), and refuses any key of nereid.yaml's ``backends.meta``."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereid.backends.meta import plugin
from nereid.backends.meta.model import MetaModel
from nereid.errors import ConfigError

META_MANIFEST = ('format_version: "2.1"\nmeta: true\n'
                 "client_inputs: [{name: x, dtype: f32, shape: an, dims: {a: 4}}]\n"
                 "client_outputs: [{name: y, dtype: f32, shape: an, dims: {a: 4}}]\n")


def test_a_folder_whose_manifest_says_meta_is_claimed(tmp_path: Path) -> None:
    (tmp_path / "manifest.yaml").write_text(META_MANIFEST)
    assert plugin.nereid_claim_model(tmp_path, declared=False).create is MetaModel
    assert plugin.nereid_claim_signs() == "manifest.yaml with meta: true"


@pytest.mark.parametrize("manifest", [None, 'format_version: "2.1"\n', META_MANIFEST.replace("true", "false"),
                                      "meta: [unclosed\n"],
                         ids=["no manifest", "a bundle's", "meta false", "unparsable"])
def test_any_other_folder_is_claimed_only_when_declared(tmp_path: Path, manifest: str | None) -> None:
    """A bundle's manifest is the xla backend's; one that cannot be parsed is reported by whichever backend loads
    it, not claimed here on a guess."""
    if manifest is not None:
        (tmp_path / "manifest.yaml").write_text(manifest)
    assert plugin.nereid_claim_model(tmp_path, declared=False) is None
    assert plugin.nereid_claim_model(tmp_path, declared=True).create is MetaModel


def test_a_folder_named_manifest_yaml_is_not_read_as_one(tmp_path: Path) -> None:
    (tmp_path / "manifest.yaml").mkdir()
    assert plugin.nereid_claim_model(tmp_path, declared=False) is None


def test_any_key_of_backends_meta_is_refused_naming_where_it_is() -> None:
    plugin.nereid_check_defaults({}, "nereid.yaml: backends.meta")
    with pytest.raises(ConfigError) as refused:
        plugin.nereid_check_defaults({"timeout_s": 1}, "nereid.yaml: backends.meta")
    assert str(refused.value) == ("nereid.yaml: backends.meta.timeout_s: unknown option of the meta backend (it has no "
                                  "runtime options; timeout_s is a model entry's key, not a runtime: option), got 1")
