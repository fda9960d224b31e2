"""The shipped example bundles are what ``python -m nereid.backends.xla.export.examples`` writes today."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import yaml

from nereid.backends.xla.export import read_bundle_weights
from nereid.backends.xla.export.examples import main

SHIPPED = Path(__file__).resolve().parents[4] / "ml-backends"


def test_regeneration_matches_the_shipped_bundles(tmp_path, capsys) -> None:
    assert main([str(tmp_path)]) == 0
    assert capsys.readouterr().out.splitlines() == [f"wrote {tmp_path / 'mlp_bundle'}",
                                                    f"wrote {tmp_path / 'circle_select'}"]
    for name in ("mlp_bundle", "circle_select"):
        fresh, shipped = tmp_path / name, SHIPPED / name
        documents = [yaml.safe_load((d / "manifest.yaml").read_text()) for d in (fresh, shipped)]
        for document in documents:
            document.pop("provenance")
        assert documents[0] == documents[1], name
        assert sorted(p.name for p in fresh.iterdir()) == sorted(
            p.name for p in shipped.iterdir() if not p.name.startswith(".")), name
        for (n1, a1), (n2, a2) in zip(read_bundle_weights(fresh), read_bundle_weights(shipped)):
            assert n1 == n2 and np.array_equal(a1, a2)
        if name == "circle_select":
            assert (fresh / "model.py").read_text() == (shipped / "model.py").read_text()


def test_mlp_bundle_has_the_documented_sizes() -> None:
    document = yaml.safe_load((SHIPPED / "mlp_bundle" / "manifest.yaml").read_text())
    assert document["batching"]["compiled_batch_sizes"] == [1, 8, 32]
    assert document["format_version"] == "2.1"
