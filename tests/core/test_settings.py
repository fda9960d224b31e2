"""nereid.yaml parsing: defaults, every documented key, and errors naming file, key path and value."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereid.errors import ConfigError
from nereid.settings import (DEFAULT_BIND_ADDR, DEFAULT_CONFIG_NAME, DEFAULT_HTTP_MAX_JSON_BYTES, Device, Listeners,
                             Settings, address_problem, config_file_name, load_settings, repository_control_allowed)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for name in ("a", "b", ".cache"):
        (tmp_path / "ml-backends" / name).mkdir(parents=True)
    return tmp_path


def write(root: Path, text: str) -> Path:
    path = root / "nereid.yaml"
    path.write_text(text)
    return path


def test_defaults_and_relative_backends_path(root: Path) -> None:
    settings = load_settings(write(root, "server:\n  ml_backends_path: ml-backends\n"))
    assert settings.server.bind_addr == DEFAULT_BIND_ADDR == "[::1]:50051"
    assert settings.server.ml_backends_path == (root / "ml-backends").resolve()
    assert settings.server.strict_readiness is True
    assert settings.models == () and settings.models_listed is False


def test_messages_name_the_configuration_file_by_its_base_name(tmp_path: Path) -> None:
    """`--config /etc/nereid/prod.yaml` is said "prod.yaml" in words (see test_settings_config_name.py), and a file
    called nereid.yaml anywhere as it always was; a mistake at a key keeps the path, which locates it."""
    assert config_file_name(Path("/etc/nereid/prod.yaml")) == "prod.yaml"
    assert config_file_name("cfg/nereid.yaml") == DEFAULT_CONFIG_NAME == "nereid.yaml"
    assert config_file_name("") == DEFAULT_CONFIG_NAME
    assert Settings(tmp_path / "prod.yaml").config_name == "prod.yaml"


def test_every_model_key(root: Path) -> None:
    settings = load_settings(write(root, """
server:
  bind_addr: "127.0.0.1:7000"
  ml_backends_path: "ml-backends"
  strict_readiness: false
  shutdown_grace_s: 5
  shutdown_delay_s: 2.5
models:
  - name: a
    device: "cuda:3"
    queue_capacity: 4
    backend: python
    instances: 2
    timeout_s: 1.5
  - name: b
    device: cuda
    timeout_s: null
"""))
    a, b = settings.models
    assert (a.device, a.queue_capacity, a.backend, a.instances, a.timeout_s) == (Device("cuda", 3), 4, "python", 2, 1.5)
    assert b.device == Device("cuda", 0) and str(b.device) == "cuda:0" and b.timeout_s is None
    assert settings.server.bind_addr == "127.0.0.1:7000" and settings.server.shutdown_grace_s == 5
    assert settings.server.shutdown_delay_s == 2.5
    assert settings.model("a") is a and settings.model("missing") is None


def refusal(root: Path, body: str) -> tuple[Path, str]:
    """The ConfigError message for ``body`` as nereid.yaml (given an ml_backends_path when it has none)."""
    if "ml_backends_path" not in body:
        body = "server:\n  ml_backends_path: ml-backends\n" + body if not body.startswith("server:") else \
            body.replace("server:\n", "server:\n  ml_backends_path: ml-backends\n", 1)
    path = write(root, body)
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    return path, str(caught.value)


@pytest.mark.parametrize("body, key, value", [
    ("server:\n  bind_adr: x\n", "server.bind_adr", "'x'"),
    ("models:\n  - name: a\n    devcie: cpu\n", "models[0].devcie", "'cpu'"),
    ("models:\n  - name: a\n    device: gpu\n", "models[0].device", "'gpu'"),
    ("models:\n  - name: a\n    device: 'cpu:1'\n", "models[0].device", "'cpu:1'"),
    ("models:\n  - name: a\n    device: 'cuda:x'\n", "models[0].device", "'cuda:x'"),
    ("models:\n  - name: a\n    queue_capacity: 0\n", "models[0].queue_capacity", "0"),
    ("models:\n  - name: a\n    queue_capacity: many\n", "models[0].queue_capacity", "'many'"),
    ("models:\n  - name: a\n    instances: 0\n", "models[0].instances", "0"),
    ("models:\n  - name: a\n    timeout_s: 0\n", "models[0].timeout_s", "0"),
    ("models:\n  - name: nope\n", "models[0].name", "'nope'"),
    ('models:\n  - name: "a\\0b"\n', "models[0].name", "'a\\x00b'"),
    ('models:\n  - name: "a\\ud800b"\n', "models[0].name", "'a\\ud800b'"),
    ("models:\n  - device: cpu\n", "models[0].name", "null"),
    ("models:\n  - name: a\n  - name: a\n", "models[1].name", "'a'"),
    ("models: {a: 1}\n", "models", "{'a': 1}"),
    ("server:\n  ml_backends_path: elsewhere\n", "server.ml_backends_path", "'elsewhere'"),
    ("server:\n  strict_readiness: maybe\n", "server.strict_readiness", "'maybe'"),
    ("unknown: 1\n", "unknown", "1"),
    # (The config hunt: keys YAML reads as a boolean or null were named True and None.)
    ("yes: 1\n", "true", "1"),
    ("models:\n  - name: a\n    ~: cpu\n", "models[0].null", "'cpu'"),
    # (Found by a bug hunt: an empty-looking wrong value passed as no defaults at all.)
    ("backends: false\n", "backends", "false"),
    ("backends: []\n", "backends", "[]"),
    ("backends: ''\n", "backends", "''"),
    # (The secrets hunt: a store URL's credentials were dropped unsaid, then shown in every store message.)
    ('server:\n  ml_backends_path: "s3://AKIAX:s3cr3t@models/prod"\n', "server.ml_backends_path",
     "'s3://<user:password>@models/prod'"),
    # (The config hunt: a NUL in a path was a traceback ending "ValueError: embedded null byte".)
    ('server:\n  ml_backends_path: "s3://b/p"\n  cache_dir: "/tmp/x\\0y"\n', "server.cache_dir", "'/tmp/x\\x00y'"),
    ('server:\n  ml_backends_path: "m\\0x"\n', "server.ml_backends_path", "'m\\x00x'"),
    ('server:\n  tls: {cert: "a\\0.crt", key: k}\n', "server.tls.cert", "'a\\x00.crt'"),
])
def test_mistakes_name_file_key_and_value(root: Path, body: str, key: str, value: str) -> None:
    path, message = refusal(root, body)
    assert message.startswith(f"{path}: {key}:"), message
    assert message.endswith(f"got {value}"), message


MODEL_KEYS = "backend, batching, device, instances, name, queue_capacity, runtime, timeout_s"
BATCHING_KEYS = "enabled, max_batch_cost, max_batch_size, max_queue_delay_ms, preferred_batch_sizes"


@pytest.mark.parametrize("body, key, allowed, hint, value", [
    # A misspelling: the allowed key it is closest to.
    ("server:\n  bind_adr: x\n", "server.bind_adr", "bind_addr, ", "did you mean 'bind_addr'?", "'x'"),
    ("models:\n  - name: a\n    batchng: {}\n", "models[0].batchng", MODEL_KEYS, "did you mean 'batching'?", "{}"),
    # Triton's names, with what nereid.yaml takes instead.
    ("models:\n  - name: a\n    dynamic_batching: {max_queue_delay_microseconds: 100}\n", "models[0].dynamic_batching",
     MODEL_KEYS, "dynamic_batching is a field of Triton's config.pbtxt: dynamic batching is nereid.yaml's batching: "
     "(max_queue_delay_ms, preferred_batch_sizes)", "{'max_queue_delay_microseconds': 100}"),
    ("models:\n  - name: a\n    instance_group: [{count: 2}]\n", "models[0].instance_group", MODEL_KEYS,
     "instance_group is a field of Triton's config.pbtxt: instances are nereid.yaml's instances: and device:",
     "[{'count': 2}]"),
    ("models:\n  - name: a\n    max_batch_size: 8\n", "models[0].max_batch_size", MODEL_KEYS,
     "max_batch_size is a field of Triton's config.pbtxt: a model's own is in its model_inference.textproto (a "
     "bundle's manifest.yaml), and nereid.yaml's batching: {max_batch_size: N} caps the rows of the batches it merges",
     "8"),
    ("models:\n  - name: a\n    batching: {max_queue_delay_microseconds: 100}\n",
     "models[0].batching.max_queue_delay_microseconds", BATCHING_KEYS, "max_queue_delay_microseconds is Triton's: "
     "nereid.yaml's is max_queue_delay_ms, in milliseconds (100 microseconds is 0.1)", "100"),
    ("models:\n  - name: a\n    batching: {preferred_batch_size: [4]}\n", "models[0].batching.preferred_batch_size",
     BATCHING_KEYS, "preferred_batch_size is Triton's: nereid.yaml's is preferred_batch_sizes, a list of sizes", "[4]"),
    ("server:\n  grpc_port: 8001\n", "server.grpc_port", "bind_addr, ", "grpc_port is Triton's --grpc-port: "
     'nereid.yaml\'s is bind_addr, a host:port ("[::1]:8001"; nereid serve --bind overrides it)', "8001"),
    ("server:\n  http_port: 8000\n", "server.http_port", "bind_addr, ", "http_port is Triton's --http-port: "
     'nereid.yaml\'s is http_addr, a host:port ("[::1]:8000"; nereid serve --http-bind overrides it)', "8000"),
    ("server:\n  metrics_port: 8002\n", "server.metrics_port", "bind_addr, ", "metrics_port is Triton's "
     '--metrics-port: nereid.yaml\'s is metrics_addr, a host:port ("127.0.0.1:8002"; nereid serve --metrics-bind '
     "overrides it)", "8002"),
    # A key of another section: where it belongs.
    ("server:\n  models:\n    - name: a\n", "server.models", "bind_addr, ",
     "models is a top-level key, not under server:", "[{'name': 'a'}]"),
    ("server:\n  backends: {}\n", "server.backends", "bind_addr, ", "backends is a top-level key, not under server:",
     "{}"),
    ("models:\n  - name: a\n    server: {}\n", "models[0].server", MODEL_KEYS,
     "server is a top-level key, not in a model entry", "{}"),
    ("models:\n  - name: a\n    bind_addr: x\n", "models[0].bind_addr", MODEL_KEYS,
     "bind_addr is a server: setting, not in a model entry", "'x'"),
    ("models:\n  - name: a\n    max_queue_delay_ms: 2\n", "models[0].max_queue_delay_ms", MODEL_KEYS,
     "max_queue_delay_ms is a model's batching: setting, not in a model entry", "2"),
    ("server:\n  cert: x\n", "server.cert", "bind_addr, ", "cert is a server.tls: setting, not under server:", "'x'"),
    ("server:\n  instances: 2\n", "server.instances", "bind_addr, ", "instances is a model entry's key, not under "
     "server:", "2"),
    ("bind_addr: x\n", "bind_addr", "backends, models, server", "bind_addr is a server: setting, not at the top level",
     "'x'"),
])
def test_an_unknown_key_is_told_its_likely_meaning(root: Path, body: str, key: str, allowed: str, hint: str,
                                                     value: str) -> None:
    """Found by a bug hunt: a misspelling, Triton's name for a key or one written in another section was refused
    with the section's keys alone (`server.models: unknown key (allowed: bind_addr, ...)`, a models: list indented
    under server:). The message starts as it did, the hint after the allowed keys."""
    path, message = refusal(root, body)
    assert message.startswith(f"{path}: {key}: unknown key (allowed: {allowed}"), message
    assert message.endswith(f") ({hint}), got {value}"), message


def test_an_unknown_key_like_no_other_gets_the_allowed_keys_alone(root: Path) -> None:
    path, message = refusal(root, "models:\n  - name: a\n    warm_start: true\n")
    assert message == f"{path}: models[0].warm_start: unknown key (allowed: {MODEL_KEYS}), got true"


@pytest.mark.parametrize("written, read_as, hint", [("no", "false", "yes, no, on, off, true or false as a boolean"),
                                                    ("1e5", "100000.0", "number as a number, 1e5 as 100000.0"),
                                                    ("30", "30", "number as a number, 1e5 as 100000.0")])
def test_a_name_yaml_reads_as_a_boolean_or_a_number_is_told_to_be_quoted(root: Path, written: str, read_as: str,
                                                                         hint: str) -> None:
    """From the README walkthrough: `- name: no` was refused as "must be a string, got false", which names
    neither what was written nor what to do."""
    path, message = refusal(root, f"models:\n  - name: {written}\n")
    assert message == (f"{path}: models[0].name: must be a string (YAML reads an unquoted {hint}: put the text in "
                       f"quotes), got {read_as}")


def test_a_backend_yaml_reads_as_a_boolean_is_told_to_be_quoted_too(root: Path) -> None:
    """The README walkthrough: `backend: yes` was refused as `must be a backend name, got true`, without the advice."""
    path, message = refusal(root, "models:\n  - name: a\n    backend: yes\n")
    assert message == (f"{path}: models[0].backend: must be a backend name (YAML reads an unquoted yes, no, on, off, "
                       "true or false as a boolean: put the text in quotes), got true")


def test_a_list_or_mapping_quoted_in_a_message_is_spelled_as_yaml_spells_it(root: Path) -> None:
    """The README walkthrough: `{sclae: [on, null]}` was quoted `[True, None]`; a deep or long one is cut short."""
    from nereid.config_document import yaml_spelling

    path, message = refusal(root, "models:\n  - name: a\n    queue_capacity: [on, null, {x: off}]\n")
    assert message == f"{path}: models[0].queue_capacity: must be an integer, got [true, null, {{'x': false}}]"
    assert yaml_spelling([[[[[[1]]]]]]) == "[[[[[...]]]]]"
    assert yaml_spelling(list(range(40))).endswith(", 31, ...]")


def test_a_model_name_too_long_for_a_folder_is_a_config_error(root: Path) -> None:
    # Looking up its folder raised ENAMETOOLONG: nereid check and serve ended in a traceback.
    path, message = refusal(root, f"models:\n  - name: {'m' * 256}\n")
    assert message.startswith(f"{path}: models[0].name: must be a folder name (not empty or hidden, no '/' or NUL, "
                              "at most 255 bytes), got 'mmm"), message


def test_unreadable_and_invalid_yaml(root: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(root / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(write(root, "server: [unclosed\n"))
    with pytest.raises(ConfigError, match=r"(?s)duplicate key 'bind_addr'.*nereid.yaml\", line 3, column 3"):
        load_settings(write(root, "server:\n  bind_addr: a:1\n  bind_addr: b:2\n"))
    # A list as a key (found by tests/core/test_properties.py in a manifest): the file's error, not a TypeError.
    with pytest.raises(ConfigError, match=r"(?s)not valid YAML: while constructing a mapping.*found unhashable key"):
        load_settings(write(root, "server: {[ml_backends_path]: x}\n"))
    # Found by a bug hunt: a merged key given way to by an explicit one was called a duplicate key; merges need an
    # alias to be of use, and aliases are refused: so are merges, each case alike.
    for text in ("server: {strict_readiness: true, <<: {strict_readiness: false}}\n",
                 "server: {<<: {strict_readiness: false}}\n"):
        with pytest.raises(ConfigError, match=r"(?s)not valid YAML: merge keys \(<<\) are not allowed: write the keys "
                                              r"out.*line 1"):
            load_settings(write(root, text))


def test_a_sub_section_with_its_keys_commented_out_is_one_with_no_keys(root: Path) -> None:
    """Found by a bug hunt: ``batching:`` with every key commented out (YAML's null) stopped the server, where an
    empty ``server:`` or ``models:`` was taken for one with no keys."""
    settings = load_settings(write(root, "models:\n  - name: a\n    batching:\n    #  max_queue_delay_ms: 2\n"
                                         "    runtime:\nbackends:\n  python:\n"))
    assert settings.models[0].batching == load_settings(write(root, "models:\n  - name: a\n")).models[0].batching
    assert settings.models[0].runtime == {} and settings.backend_defaults == {"python": {}}
    for text in ("models:\n  - name: a\n    batching: 0\n", "models:\n  - name: a\n    runtime: ''\n"):
        with pytest.raises(ConfigError, match="must be a mapping"):  # (other values that are no mapping still fail)
            load_settings(write(root, text))
    # tls: too (the README walkthrough: it was "must be a mapping, got null"); a TLS section lacks its files then.
    with pytest.raises(ConfigError, match=r"server\.tls\.cert: is required \(a PEM file\)"):
        load_settings(write(root, "server:\n  tls:\n  #  cert: server.pem\n"))


def test_a_repository_path_starting_with_a_tilde_is_in_the_home_directory(root: Path, monkeypatch) -> None:
    """Found by a bug hunt: ``~/models`` named a folder "~" beside nereid.yaml, where cache_dir's ``~`` was the
    home directory."""
    monkeypatch.setenv("HOME", str(root))
    assert load_settings(write(root, "server:\n  ml_backends_path: ~/ml-backends\n")).server.ml_backends_path == (
        root / "ml-backends")


@pytest.mark.parametrize("text, expected", [("cpu", Device("cpu")), ("cuda", Device("cuda", 0)),
                                            ("cuda:7", Device("cuda", 7))])
def test_device_strings(text: str, expected: Device) -> None:
    assert Device.parse(text) == expected


@pytest.mark.parametrize("text", ["cuda:\u0663", "cuda:\uff13", "cuda\n", "cuda:1\n", "cpu\n", "CUDA", "gpu", "cuda:",
                                  "cuda:-1", "cpu:0", "cuda: 1"])
def test_device_strings_refused(text: str) -> None:
    """Defect: a non-ASCII digit ("cuda:\u0663" read as cuda:3) or a trailing newline was accepted."""
    with pytest.raises(ValueError, match="expected 'cpu', 'cuda' or 'cuda:<index>'"):
        Device.parse(text)


def test_backend_defaults(root: Path) -> None:
    settings = load_settings(write(root, "backends:\n  python: {warm_start: false}\n  xla: {}\n"))
    assert settings.backend_defaults == {"python": {"warm_start": False}, "xla": {}}
    assert load_settings(write(root, "server: {}\n")).backend_defaults == {}


@pytest.mark.parametrize("text, message", [
    ("backends: [python]\n", "backends: must map backend names to their runtime defaults"),
    ("backends:\n  python: true\n", "backends.python: must be a mapping of runtime options"),
])
def test_backend_defaults_errors(root: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(write(root, text))


@pytest.mark.parametrize("body, key, value", [
    ("models:\n  - name: a\n    timeout_s: .nan\n", "models[0].timeout_s", "nan"),
    ("models:\n  - name: a\n    timeout_s: .inf\n", "models[0].timeout_s", "inf"),
    ("models:\n  - name: a\n    batching: {max_queue_delay_ms: .nan}\n", "models[0].batching.max_queue_delay_ms",
     "nan"),
    ("server:\n  shutdown_grace_s: .nan\n", "server.shutdown_grace_s", "nan"),
    ("server:\n  shutdown_grace_s: .inf\n", "server.shutdown_grace_s", "inf"),
    ("server:\n  watch_settle_ms: .nan\n", "server.watch_settle_ms", "nan"),
    ("server:\n  watch_settle_ms: .inf\n", "server.watch_settle_ms", "inf"),
    ("server:\n  watch_poll_s: .NaN\n", "server.watch_poll_s", "nan"),
    ("server:\n  watch_poll_s: 1" + "0" * 400 + "\n", "server.watch_poll_s", "1" + "0" * 400),
], ids=["timeout-nan", "timeout-inf", "delay-nan", "grace-nan", "grace-inf", "settle-nan", "settle-inf", "poll-nan",
        "poll-huge-int"])
def test_nan_and_infinity_are_refused_like_a_wrong_type(root: Path, body: str, key: str, value: str) -> None:
    # NaN passes every "< minimum" check; it used to load, then fail inference, never drain, never settle.
    path, message = refusal(root, body)
    assert message.startswith(f"{path}: {key}: must be a finite number, got "), message
    assert message.endswith(f"got {value}"), message


@pytest.mark.parametrize("body, key, problem, value", [
    ("models:\n  - name: a\n    instances: 2147483648\n", "models[0].instances",
     "must be at most 2147483647 (ModelConfig's instance_group count is an int32)", "2147483648"),
    ("models:\n  - name: a\n    batching: {max_queue_delay_ms: 2.0e+16}\n", "models[0].batching.max_queue_delay_ms",
     "must be at most 86400000 (a day)", "2e+16"),
    ("models:\n  - name: a\n    timeout_s: 1.0e+300\n", "models[0].timeout_s", "must be at most 31536000 (a year)",
     "1e+300"),
    ("server:\n  shutdown_grace_s: 31536001\n", "server.shutdown_grace_s", "must be at most 31536000 (a year)",
     "31536001"),
    ("server:\n  watch_settle_ms: 1.0e+300\n", "server.watch_settle_ms", "must be at most 86400000 (a day)",
     "1e+300"),
    ("server:\n  watch_poll_s: 86401\n", "server.watch_poll_s", "must be at most 86400 (a day)", "86401"),
    ("server:\n  shutdown_delay_s: 86401\n", "server.shutdown_delay_s", "must be at most 86400 (a day)", "86401"),
    ("server:\n  model_load_threads: 1025\n", "server.model_load_threads", "must be at most 1024 (one thread each)",
     "1025"),
    # Defect: exponent form without a dot is YAML 1.2's float but PyYAML's string: "must be a number".
    ("models:\n  - name: a\n    timeout_s: 1e300\n", "models[0].timeout_s", "must be at most 31536000 (a year)",
     "1e+300"),
    # Defect: accepted, then every gRPC ModelConfig of the model failed (its gpus field is an int32).
    ("models:\n  - name: a\n    device: cuda:3000000000\n", "models[0].device",
     "expected a GPU index of at most 2147483647", "'cuda:3000000000'"),
    # Defect (found by a bug hunt): a meta model's gRPC ModelConfig failed (its instance count is its capacity).
    # (Its reason was instances' own, which named nothing a python model's queue has to do with: the README hunt.)
    ("models:\n  - name: a\n    queue_capacity: 4294967296\n", "models[0].queue_capacity",
     "must be at most 2147483647 (a meta model's ModelConfig gives it as its instance_group count, an int32)",
     "4294967296"),
    ("models:\n  - name: a\n    batching: {max_batch_size: 2147483648}\n", "models[0].batching.max_batch_size",
     "must be at most 2147483647 (ModelConfig's max_batch_size is an int32)", "2147483648"),
    ("models:\n  - name: a\n    batching: {preferred_batch_sizes: [4, 2147483648]}\n",
     "models[0].batching.preferred_batch_sizes",
     "must hold sizes of at most 2147483647 (ModelConfig's preferred_batch_size is an int32)", "[4, 2147483648]"),
], ids=["instances", "delay", "timeout", "grace", "settle", "poll", "shutdown-delay", "load-threads",
        "timeout-exponent", "device-index", "queue-capacity", "max-batch-size", "preferred-size"])
def test_values_past_what_the_waits_and_the_wire_take_are_refused(root: Path, body: str, key: str, problem: str,
                                                                  value: str) -> None:
    """Defect: accepted, then every request failed (a timeout poll() overflowed), every ModelConfig failed
    (int32 / uint64 fields), or the watcher fell back to polling (its settle time overflowed)."""
    path, message = refusal(root, body)
    assert message == f"{path}: {key}: {problem}, got {value}"


def test_the_largest_values_allowed_are_taken(root: Path) -> None:
    settings = load_settings(write(root, "server:\n  ml_backends_path: ml-backends\n  shutdown_grace_s: 31536000\n"
                                         "models:\n  - name: a\n    instances: 2147483647\n    timeout_s: 31536000\n"
                                         "    batching: {max_queue_delay_ms: 86400000}\n"))
    (model,) = settings.models
    assert (model.instances, model.timeout_s, model.batching.max_queue_delay_ms) == (2**31 - 1, 31536000, 86400000)
    assert settings.server.shutdown_grace_s == 31536000
    exponents = load_settings(write(root, "models:\n  - name: a\n    timeout_s: 5e2\n    device: cuda:2147483647\n"
                                          "    batching: {max_queue_delay_ms: 2E+1}\n"))
    (model,) = exponents.models
    assert (model.timeout_s, model.batching.max_queue_delay_ms, model.device) == (500, 20, Device("cuda", 2**31 - 1))
    # Quoted, it is a string, as a quoted "30" is: refused alike.
    for quoted in ('"3e1"', '"30"'):
        with pytest.raises(ConfigError, match=f"models\\[0\\].timeout_s: must be a number, got '{quoted[1:-1]}'"):
            load_settings(write(root, f"models:\n  - name: a\n    timeout_s: {quoted}\n"))


@pytest.mark.parametrize("key", ["bind_addr", "metrics_addr", "http_addr"])
@pytest.mark.parametrize("address, problem", [
    ("[::1]:99999", "port must be 0-65535"),
    ("127.0.0.1:65536", "port must be 0-65535"),
    ("127.0.0.1:" + "9" * 5000, "port must be 0-65535"),
    ("127.0.0.1", "must be host:port"),
    # (The config hunt: passed nereid check and the HTTP listener, then failed gRPC's bind.)
    ("[127.0.0.1]:8001", "brackets hold an IPv6 address (127.0.0.1 is none: write it without them)"),
    ("[localhost]:8001", "brackets hold an IPv6 address (localhost is none: write it without them)"),
    ("[::1%lo]:8001", "an IPv6 address with a zone ([::1%lo]) cannot be listened on; give the address without it"),
], ids=["99999", "65536", "5000-digits", "no-port", "bracketed-ipv4", "bracketed-name", "zone"])
def test_listener_addresses_need_a_port_of_0_to_65535(root: Path, key: str, address: str, problem: str) -> None:
    # gRPC used to wrap 99999 to another port silently; metrics and HTTP died with an OverflowError.
    path = write(root, f"server:\n  ml_backends_path: ml-backends\n  {key}: \"{address}\"\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert str(caught.value).startswith(f"{path}: server.{key}: {problem}"), caught.value
    assert f"got '{address[:30]}" in str(caught.value)  # (a 5000-digit value is quoted cut short)


@pytest.mark.parametrize("key", ["bind_addr", "metrics_addr", "http_addr"])
def test_a_listener_address_ending_in_a_newline_is_refused(root: Path, key: str) -> None:
    # Found by a bug hunt: accepted ($ lets a trailing newline through), its log line broken in two.
    path = write(root, f'server:\n  ml_backends_path: ml-backends\n  {key}: "127.0.0.1:8000\\n"\n')
    with pytest.raises(ConfigError, match=rf"server.{key}: must be host:port"):
        load_settings(path)
    assert address_problem("127.0.0.1:8000\n") == "must be host:port"


@pytest.mark.parametrize("key", ["bind_addr", "metrics_addr", "http_addr"])
def test_listener_addresses_need_a_host(root: Path, key: str) -> None:
    # ":50051" passed, then failed in gRPC once serving (exit 1), and meant every interface to HTTP and metrics.
    path = write(root, f'server:\n  ml_backends_path: ml-backends\n  {key}: ":50051"\n')
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert str(caught.value) == (f"{path}: server.{key}: must name a host before the port (0.0.0.0 or [::] for "
                                 f"every interface), got ':50051'")
    assert address_problem(":50051") == "must name a host before the port (0.0.0.0 or [::] for every interface)"


@pytest.mark.parametrize("key", ["bind_addr", "metrics_addr", "http_addr"])
@pytest.mark.parametrize("address", ["[::1]:0", "127.0.0.1:65535", "localhost:8000", "[::]:00080", "0.0.0.0:50051"])
def test_listener_addresses_in_range_are_kept(root: Path, key: str, address: str) -> None:
    path = write(root, f"server:\n  ml_backends_path: ml-backends\n  {key}: \"{address}\"\n")
    assert getattr(load_settings(path).server, key) == address


@pytest.mark.parametrize("first, second, clash", [
    ("127.0.0.1:8000", "127.0.0.1:8000", True),
    ("localhost:8000", "127.0.0.1:8000", True),  # localhost is both loopbacks
    ("[::1]:8000", "[0:0:0:0:0:0:0:1]:8000", True),  # one address, spelled two ways
    ("127.0.0.1:08000", "127.0.0.1:8000", True),  # ports are numbers
    ("127.1:8000", "127.0.0.1:8000", True),  # a short IPv4 form the system takes
    ("[::ffff:127.0.0.1]:8000", "127.0.0.1:8000", True),  # IPv4-mapped: binds the IPv4 address
    ("0.0.0.0:8000", "127.0.0.1:8000", True),  # a wildcard takes the port on every interface of its family
    ("[::]:8000", "127.0.0.1:8000", True),  # [::] takes IPv4's too, as Linux binds it
    ("0.0.0.0:8000", "[::1]:8000", False),
    ("[::1]:8000", "127.0.0.1:8000", False),
    ("127.0.0.1:8000", "127.0.0.1:8001", False),
    ("127.0.0.1:00", "127.0.0.1:0", False),  # port 0: a free port each
    ("models.example:8000", "127.0.0.1:8000", False),  # a name is not resolved (that takes a DNS lookup)
])
def test_two_listeners_on_one_port_of_one_interface_clash_naming_both(root: Path, first: str, second: str,
                                                                     clash: bool) -> None:
    """nereid check passed two listeners on one address, and serve then blamed the system's "Address already in
    use" as though another process held the port."""
    server = load_settings(write(root, f'server:\n  ml_backends_path: ml-backends\n  bind_addr: "{first}"\n'
                                       f'  http_addr: "{second}"\n')).server  # (the file alone is not refused)
    expected = (f"server.http_addr: {second} would take the port that server.bind_addr ({first}) takes; each "
                "listener needs an address of its own")
    assert Listeners().clash(server) == (expected if clash else None)
    # A flag in place of one of the keys is what counts: the file's value is then not listened on.
    assert Listeners(http_addr="127.0.0.1:8999").clash(server) is None


def test_a_clash_names_the_configuration_file_only_when_one_of_its_keys_is_in_it(root: Path) -> None:
    """Noticed by the stop 56 CLI hunt: two command-line flags on one port were said to be the file's mistake
    ("nereid.yaml: --http-bind: ...")."""
    server = load_settings(write(root, 'server:\n  ml_backends_path: ml-backends\n  bind_addr: "127.0.0.1:9000"\n'
                                       '  http_addr: "127.0.0.1:9001"\n')).server
    flags = Listeners(bind_addr="127.0.0.1:8000", http_addr="127.0.0.1:8000")
    assert flags.clash(server, "prod.yaml") == ("--http-bind: 127.0.0.1:8000 would take the port that --bind "
                                                "(127.0.0.1:8000) takes; each listener needs an address of its own")
    # A flag and a key: the file names its key alone ("prod.yaml: --http-bind: ..." read as a key of the file; the
    # CLI hunt).
    assert Listeners(http_addr="127.0.0.1:9000").clash(server, "prod.yaml") == (
        "--http-bind: 127.0.0.1:9000 would take the port that prod.yaml's server.bind_addr (127.0.0.1:9000) takes; "
        "each listener needs an address of its own")
    assert Listeners(bind_addr="127.0.0.1:9001").clash(server, "prod.yaml") == (
        "--bind: 127.0.0.1:9001 would take the port that prod.yaml's server.http_addr (127.0.0.1:9001) takes; "
        "each listener needs an address of its own")


@pytest.mark.parametrize("lines, allowed", [
    ('  bind_addr: "[::1]:50051"\n  http_addr: "127.0.0.1:8000"\n', True),
    ('  bind_addr: "localhost:50051"\n  http_addr: ""\n', True),
    ('  bind_addr: "0.0.0.0:50051"\n  http_addr: "127.0.0.1:8000"\n', False),
    ('  bind_addr: "127.0.0.1:50051"\n  http_addr: "0.0.0.0:8233"\n', False),  # the REST port is public
    ('  bind_addr: "127.0.0.1:50051"\n  http_addr: "[::]:8233"\n', False),
    ('  bind_addr: "127.0.0.1:50051"\n  http_addr: "0.0.0.0:8233"\n  repository_control: true\n', True),
    ('  bind_addr: "127.0.0.1:50051"\n  repository_control: false\n', False),
])
def test_repository_control_unset_is_on_only_when_every_control_port_is_loopback(root: Path, lines: str,
                                                                                  allowed: bool) -> None:
    server = load_settings(write(root, "server:\n  ml_backends_path: ml-backends\n" + lines)).server
    assert repository_control_allowed(server, server.bind_addr) is allowed


def test_a_public_http_port_refuses_unload_when_repository_control_is_unset(repo, serve) -> None:
    import json
    import urllib.error
    import urllib.request

    from tritonclient.utils import InferenceServerException

    repo.python("kept")
    config = repo.write_config()
    config.write_text(config.read_text().replace('http_addr: "127.0.0.1:0"', 'http_addr: "0.0.0.0:0"'))
    server = serve(config)
    request = urllib.request.Request(f"http://127.0.0.1:{server.server.http_port}/v2/repository/models/kept/unload",
                                     data=b"{}", method="POST")
    with pytest.raises(urllib.error.HTTPError) as refused:  # it used to unload the model
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 403, json.loads(refused.value.read())
    with pytest.raises(InferenceServerException) as denied:
        server.client.unload_model("kept")
    assert denied.value.status() == "StatusCode.PERMISSION_DENIED"
    assert server.client.is_model_ready("kept")


def test_a_config_named_through_dotdot_gives_the_paths_its_watcher_rereads(tmp_path, monkeypatch):
    """Named as ../conf/nereid.yaml, ml_backends_path kept the '..', while the watcher re-reads the file by its
    normalized name: every edit of nereid.yaml then warned that ml_backends_path needed a restart."""
    import os

    (tmp_path / "conf" / "ml-backends").mkdir(parents=True)
    (tmp_path / "conf" / "nereid.yaml").write_text('server:\n  ml_backends_path: "ml-backends"\n')
    (tmp_path / "run").mkdir()
    monkeypatch.chdir(tmp_path / "run")
    as_named = load_settings(Path("../conf/nereid.yaml"))
    as_reread = load_settings(Path(os.path.abspath(as_named.source)))
    assert as_named.server == as_reread.server
    assert as_named.server.ml_backends_path == tmp_path / "conf" / "ml-backends"


def test_no_home_directory_stops_only_a_repository_that_needs_the_cache(root: Path, monkeypatch) -> None:
    """Defect: with HOME unset and a user id without a passwd entry (OpenShift's arbitrary uids), every start
    ended in a traceback (`Could not determine home directory`) from the default cache_dir, which only a
    repository in object storage uses."""
    import pwd

    def no_entry(uid: int) -> None:
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_entry)  # (this machine's users all have one)
    settings = load_settings(write(root, "server:\n  ml_backends_path: ml-backends\n"))
    assert settings.server.ml_backends_path == root / "ml-backends" and settings.server.cache_dir is None
    with pytest.raises(ConfigError, match=r"server.cache_dir: a repository in object storage is mirrored under it, "
                                          r"and its default \(~/.cache/nereid\) has no home directory here .*; set "
                                          r"server.cache_dir or XDG_CACHE_HOME"):
        load_settings(write(root, "server:\n  ml_backends_path: s3://bucket/models\n"))
    settings = load_settings(write(root, "server:\n  ml_backends_path: s3://bucket/models\n  cache_dir: cache\n"))
    assert settings.server.cache_dir == root / "cache"
    with pytest.raises(ConfigError, match="server.cache_dir: starts with ~, but that home directory is not known "
                                          "here"):
        load_settings(write(root, "server:\n  ml_backends_path: s3://bucket/models\n  cache_dir: ~/cache\n"))
    with pytest.raises(ConfigError, match="server.ml_backends_path: starts with ~, but that home directory is not "
                                          r"known here \(HOME is unset .*, or ~name names no user\)"):
        load_settings(write(root, "server:\n  ml_backends_path: ~/models\n"))
    # The reference nereid.yaml's ~/.cache/nereid with a local repository: unused, so no reason to stop.
    assert load_settings(write(root, "server:\n  cache_dir: ~/.cache/nereid\n")).server.cache_dir is None


def test_http_max_json_bytes(root: Path) -> None:
    """Defect: HTTP JSON bodies were bounded only by max_message_bytes (64 MiB), which decoded into over 2 GiB of
    Python objects; server.http_max_json_bytes bounds their JSON part, 16 MiB unless set."""
    assert load_settings(write(root, "server:\n  ml_backends_path: ml-backends\n")).server.http_max_json_bytes \
        == DEFAULT_HTTP_MAX_JSON_BYTES == 16 << 20
    for value in (4096, 2**31 - 1):
        settings = load_settings(write(root, "server:\n  ml_backends_path: ml-backends\n"
                                             f"  http_max_json_bytes: {value}\n"))
        assert settings.server.http_max_json_bytes == value
    for value, problem in (("4095", "must be >= 4096, got 4095"), ("2147483648", "must be at most 2147483647 (as "
                                                                                "max_message_bytes), got 2147483648"),
                           # (YAML's true and null as the file spells them: "got True" was Python's word)
                           ("true", "must be an integer, got true"), ("null", "must be an integer, got null"),
                           ('"1M"', "must be an integer, got '1M'")):
        path, message = refusal(root, f"server:\n  http_max_json_bytes: {value}\n")
        assert message == f"{path}: server.http_max_json_bytes: {problem}", value


@pytest.mark.parametrize("text, said", [
    ("backends:\n  ~: {}\n", "backends.null: must be a backend's name, got null"),
    ("backends:\n  1: {}\n", "backends.1: must be a backend's name (YAML reads an unquoted number as a number, 1e5 as "
                              "100000.0: put the text in quotes), got 1"),
    ("models:\n  - name: 2001-12-14\n", "models[0].name: must be a string (YAML reads an unquoted 2001-12-14 as a "
                                         "date: put the text in quotes), got 2001-12-14"),
], ids=["null-backend", "number-backend", "date-name"])
def test_names_yaml_reads_as_no_text_are_refused_as_such(root: Path, text: str, said: str) -> None:
    """Found by the config hunt: `backends: {~: {}}` was "backends.None: no such backend is installed", and a model
    named 2001-12-14 "got datetime.date(2001, 12, 14)", without the advice to quote it."""
    path = write(root, 'server:\n  ml_backends_path: ml-backends\n' + text)
    with pytest.raises(ConfigError) as caught:
        load_settings(path)
    assert str(caught.value) == f"{path}: {said}"
