"""`nereid check` and a model's runtime_report() that returns something other than a usable RuntimeReport."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np

import toy_backends
from nereid.backend import BackendClaim, RuntimeReport
from nereid.hookspecs import hookimpl

# What the ``reporting`` backend's models return from runtime_report(), by the text of their reports.txt.
REPORTS = {
    "none": lambda: None,  # a forgotten return
    "str": lambda: "warm_start=on",
    "bytes_str": lambda: RuntimeReport("warm_start=on", warm_parent_resident_bytes="lots"),
    "summary_int": lambda: RuntimeReport(summary=5),
    "ok": lambda: RuntimeReport("warm_start=on", warm_parent_resident_bytes=3 * 2**20),
    "ok_numpy": lambda: RuntimeReport(warm_parent_resident_bytes=np.int64(2**20)),  # as a library may count it
}
UNLOADS: Counter[str] = Counter()


class ReportingToy(toy_backends.ToyModel):
    """A toy whose ``runtime_report()`` returns what its folder's reports.txt names; counts its unloads."""

    def runtime_report(self):
        return REPORTS[(self.context.folder / "reports.txt").read_text()]()

    def unload(self) -> None:
        UNLOADS[self.context.name] += 1


class ReportingBackend:
    """The ``reporting`` backend: claims folders holding ``reports.txt``."""

    BACKEND_NAME = "reporting"

    @hookimpl
    def nereid_claim_model(self, folder: Path, declared: bool) -> BackendClaim | None:
        return BackendClaim(ReportingToy) if (folder / "reports.txt").is_file() else None


def test_check_reports_a_runtime_report_of_the_wrong_kind_on_its_line_and_goes_on(tmp_path, capsys) -> None:
    """Defect: a runtime_report() returning None (or a str) ended `nereid check` with a traceback
    (AttributeError: 'NoneType' object has no attribute 'summary'): the models after it unchecked, no summary
    line, the model left loaded. A RuntimeReport holding "lots" for its bytes ended it the same way."""
    from nereid.cli import check
    from nereid.plugins import make_plugin_manager
    from nereid.settings import load_settings

    # Named so that the faulty ones come first, as the check goes through the folders sorted.
    names = {fault: f"{index}_{fault}" for index, fault in enumerate(REPORTS)}
    for fault, name in names.items():
        toy_backends.write_toy(tmp_path / "ml-backends", name)
        (tmp_path / "ml-backends" / name / "reports.txt").write_text(fault)
    (tmp_path / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml-backends"\n')
    UNLOADS.clear()
    manager = make_plugin_manager(load_entry_points=False, extra_plugins=(ReportingBackend(),))
    assert check(load_settings(tmp_path / "nereid.yaml"), manager) == 1
    lines = capsys.readouterr().out.splitlines()
    failed = "RUNTIME REPORT FAILED: {}; loaded as backend=reporting "
    bad_bytes = "its warm_parent_resident_bytes is 'lots' (str), expected an int >= 0 or None"
    expected = [
        f"0_none: {failed.format('returned NoneType, expected a nereid RuntimeReport')}",
        f"1_str: {failed.format('returned str, expected a nereid RuntimeReport')}",
        f"2_bytes_str: {failed.format(bad_bytes)}",
        f"3_summary_int: {failed.format('its summary is 5 (int), expected a str')}",
        "4_ok: OK backend=reporting ",
        "5_ok_numpy: OK backend=reporting ",
    ]
    assert len(lines) == len(expected) + 1, lines
    for line, start in zip(lines, expected):
        assert line.startswith(start), (line, start)
        assert line.endswith("outputs=[output FP32[4]]" if "FAILED" in line else "MiB"), line  # nothing of it shown
    assert lines[4].endswith(" warm_start=on warm_parent_rss=3.0MiB"), lines[4]
    assert lines[5].endswith("outputs=[output FP32[4]] warm_parent_rss=1.0MiB"), lines[5]
    assert lines[-1].endswith(": 4 model(s) with problems")
    assert UNLOADS == Counter(names.values())  # each model loaded was unloaded, the faulty ones too
