"""backends/host_cpu: the digest that keys builds for this machine's CPU (xla's executables, cpp's native builds)."""

from __future__ import annotations

from nereid.backends import host_cpu as host_cpu_module
from nereid.backends.host_cpu import host_cpu


def test_the_digest_is_short_stable_and_names_this_machine() -> None:
    fingerprint = host_cpu()
    assert len(fingerprint) == 16 and int(fingerprint, 16) >= 0
    assert host_cpu() == fingerprint


def test_another_cpu_s_model_or_feature_flags_make_another_digest_and_other_processors_lines_do_not(
        tmp_path, monkeypatch) -> None:
    """A build keyed by the first processor's vendor, model and sorted flags: an entry made on a machine with
    AVX-512 is never taken for this one's, while the order of the flags and later processors' lines change
    nothing (every processor of one machine is the same kind)."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: X\nflags\t\t: sse avx2\n\n"
                    "processor\t: 1\nflags\t\t: other\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path,
                                                                           *a, **k))

    def digest() -> str:
        host_cpu_module.host_cpu.cache_clear()
        return host_cpu_module.host_cpu()

    try:
        first = digest()
        info.write_text(info.read_text().replace("sse avx2", "avx2 sse").replace("other", "anything"))
        assert digest() == first
        info.write_text(info.read_text().replace("avx2 sse", "avx2 avx512f sse"))
        assert digest() != first
        info.write_text(info.read_text().replace("model name\t: X", "model name\t: Y"))
        assert digest() != first
    finally:
        monkeypatch.undo()
        host_cpu_module.host_cpu.cache_clear()


def test_a_machine_without_proc_cpuinfo_is_described_by_its_architecture(monkeypatch) -> None:
    """(macOS, a sandbox without /proc): the digest falls back to the machine and processor names."""
    real_open = open

    def no_cpuinfo(path, *args, **kwargs):
        if path == "/proc/cpuinfo":
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_cpuinfo)
    monkeypatch.setattr(host_cpu_module.platform, "machine", lambda: "arm64")
    host_cpu_module.host_cpu.cache_clear()
    try:
        arm = host_cpu_module.host_cpu()
        monkeypatch.setattr(host_cpu_module.platform, "machine", lambda: "x86_64")
        host_cpu_module.host_cpu.cache_clear()
        assert host_cpu_module.host_cpu() != arm and len(arm) == 16
    finally:
        monkeypatch.undo()
        host_cpu_module.host_cpu.cache_clear()
