"""pyproject's pins agree with what the code needs: the protobuf gencode, jaxlib's unstable API, grpcio-tools."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]


def _requirements(group: str | None = None) -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    items = project["dependencies"] if group is None else project["optional-dependencies"][group]
    return {Requirement(text).name.lower(): Requirement(text) for text in items}


def test_protobuf_is_pinned_to_the_range_the_generated_code_needs() -> None:
    versions = set()
    for module in sorted((ROOT / "core" / "_proto").glob("*_pb2.py")):
        match = re.search(r"ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,\s*(\d+),\s*(\d+),"
                          r"\s*(\d+),", module.read_text())
        assert match, module
        versions.add(Version(".".join(match.groups())))
    (gencode,) = versions
    spec = _requirements()["protobuf"].specifier
    assert gencode in spec and Version(f"{gencode.major}.999") in spec
    assert Version(f"{gencode.major - 1}.999") not in spec, "an older major runtime would fail at import"
    assert Version(f"{gencode.major}.{gencode.minor}.{gencode.micro - 1}") not in spec or gencode.micro == 0
    assert Version(f"{gencode.major + 1}.0") not in spec, "the next major may drop this gencode"
    assert Version(metadata.version("protobuf")) in spec


def test_jax_and_jaxlib_have_an_upper_bound_that_the_installed_versions_meet() -> None:
    requirements = _requirements()
    for name in ("jax", "jaxlib"):
        spec = requirements[name].specifier
        assert any(s.operator == "<" for s in spec), f"{name} needs an upper bound"
        assert Version(metadata.version(name)) in spec


def test_the_dev_extra_pins_the_grpcio_tools_that_generated_the_code() -> None:
    spec = _requirements("dev")["grpcio-tools"].specifier
    assert [s.operator for s in spec] == ["=="]
