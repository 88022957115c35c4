"""Hardening that needs no server: API key and host-pattern validation at config load, the
repeated-log-line filter, what the systemd unit says about fds, exit 78 and /tmp, and which
load failures exit 78."""

from __future__ import annotations

import logging
import resource
from pathlib import Path

import pytest

from homespec.cli.serve import exit_status, resolve_api_key
from homespec.config import ConfigError, load_config
from homespec.errors import ModelError, UserError
from homespec.models.memory import InsufficientMemory
from homespec.serving.http_server import FD_HEADROOM, RepeatFilter, ensure_open_files
from homespec.serving.systemd import render_unit


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.yaml"
    p.write_text(text, encoding="utf-8")
    return p


@pytest.mark.parametrize("key", ["schlüssel-123", "key with\ttab", " padded ", ""])
def test_an_api_key_that_cannot_travel_in_a_header_is_refused_at_load_naming_the_field(tmp_path: Path, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, f'server:\n  api_key: "{key}"\n'))
    msg = str(e.value)
    assert "server.api_key" in msg and "ASCII" in msg and "\n" not in msg, msg


def test_an_ascii_api_key_loads(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "server:\n  api_key: abc-DEF_123.~\n")).server.api_key == "abc-DEF_123.~"


def test_a_non_ascii_key_from_the_environment_or_a_key_file_is_refused_naming_its_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOMESPEC_API_KEY", "schlüssel")
    with pytest.raises(UserError, match=r"^HOMESPEC_API_KEY: the API key must be printable ASCII"):
        resolve_api_key(load_config(write(tmp_path, "{}\n")))
    monkeypatch.delenv("HOMESPEC_API_KEY")
    (tmp_path / "key").write_text("schlüssel\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"^server.api_key_file \(.*key\): the API key must be printable ASCII"):
        resolve_api_key(load_config(write(tmp_path, "server:\n  api_key_file: key\n")))
    (tmp_path / "key").write_text("abc-123\n")
    assert resolve_api_key(load_config(write(tmp_path, "server:\n  api_key_file: key\n"))) == "abc-123"


@pytest.mark.parametrize("pattern", ["*", "evil*.com", "*example.com", ""])
def test_bad_allowed_host_patterns_are_refused_naming_the_field(tmp_path: Path, pattern: str) -> None:
    with pytest.raises(ConfigError, match=r"server\.allowed_hosts"):
        load_config(write(tmp_path, f'server:\n  allowed_hosts: ["{pattern}"]\n'))


def test_repeat_filter_passes_the_first_line_then_counts_the_suppressed_ones() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("homespec.test_repeat_filter")
    logger.propagate = False
    logger.addHandler(Keep())
    f = RepeatFilter(window_s=3600)
    logger.addFilter(f)
    for _ in range(1000):
        logger.error("socket.accept() out of system resource\nsocket: %s", "<fd 6>")
    logger.error("something else")
    assert [r.getMessage().splitlines()[0] for r in records] == ["socket.accept() out of system resource", "something else"]
    f.window_s = 0  # the window has passed: the next one goes out with the count
    logger.error("socket.accept() out of system resource\nsocket: %s", "<fd 6>")
    assert "999 identical lines suppressed" in records[-1].getMessage()


def unit(tmp: Path | None = None, user: bool = False) -> str:
    root = tmp or Path("/opt/homespec")
    return render_unit(exec_path=root / ".venv/bin/homespec", config=Path("/etc/homespec/config.yaml"),
                       working_dir=Path("/etc/homespec"), user=user, mlock=False, models_dir=Path("/var/lib/homespec/models"))


@pytest.mark.parametrize("user", [False, True])
def test_units_raise_the_fd_limit_and_do_not_restart_on_exit_78(user: bool) -> None:
    lines = unit(user=user).splitlines()
    assert "LimitNOFILE=65536" in lines
    assert "RestartPreventExitStatus=2 78" in lines


@pytest.mark.parametrize("error, status", [
    (ModelError("qwen.gguf: sha256 mismatch"), 78),  # the same file fails the same way: not retried
    (InsufficientMemory("need 40 GiB RAM", never_fits=True), 78),  # more than the machine has
    (InsufficientMemory("need 3 GiB RAM, 1 GiB available"), 75),  # others hold it now: retried
    (OSError("read error on /srv/models/qwen.gguf"), 1),  # a fault, not the config: retried
    (RuntimeError("llama.cpp failed to create a context"), 1),
])
def test_only_a_load_failure_that_a_restart_would_repeat_exits_with_the_unrestarted_status(error: Exception, status: int) -> None:
    assert exit_status(error) == status
    assert (status == 78) == (f" {status}" in next(s for s in unit().splitlines() if s.startswith("RestartPreventExitStatus=")))


def test_a_system_unit_for_a_venv_under_tmp_says_private_tmp_hides_it(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="homespec.serving.systemd"):
        text = unit(Path("/tmp/checkout"))
    assert "# WARNING: /tmp/checkout/.venv/bin/homespec is under /tmp" in text
    assert any("PrivateTmp=yes hides" in r.getMessage() for r in caplog.records)
    assert "WARNING" not in unit()  # /opt: nothing to say


class FakeLimits:
    """resource.getrlimit/setrlimit for RLIMIT_NOFILE, with a soft and a hard limit."""

    def __init__(self, soft: int, hard: int) -> None:
        self.soft, self.hard = soft, hard

    def get(self, which: int) -> tuple[int, int]:
        return self.soft, self.hard

    def set(self, which: int, limits: tuple[int, int]) -> None:
        assert limits[1] == self.hard and (self.hard == resource.RLIM_INFINITY or limits[0] <= self.hard)  # never above it
        self.soft = limits[0]


@pytest.mark.parametrize("soft, hard, max_conn, want", [
    (1024, 524288, 512, 1024),  # enough already: untouched
    (1024, 524288, 5000, 5000 + FD_HEADROOM),  # raised as far as needed, not to the hard limit
    (1024, resource.RLIM_INFINITY, 5000, 5000 + FD_HEADROOM),
])
def test_the_soft_file_limit_is_raised_to_fit_max_connections(monkeypatch, soft, hard, max_conn, want) -> None:
    limits = FakeLimits(soft, hard)
    monkeypatch.setattr(resource, "getrlimit", limits.get)
    monkeypatch.setattr(resource, "setrlimit", limits.set)
    assert ensure_open_files(max_conn) == want == limits.soft


def test_max_connections_beyond_the_hard_file_limit_is_refused_naming_the_setting(monkeypatch) -> None:
    limits = FakeLimits(1024, 2048)
    monkeypatch.setattr(resource, "getrlimit", limits.get)
    monkeypatch.setattr(resource, "setrlimit", limits.set)
    with pytest.raises(UserError, match="server.max_connections is 4000.*2048"):
        ensure_open_files(4000)


def test_this_process_really_fits_the_default_max_connections() -> None:
    assert ensure_open_files(512) >= 512 + FD_HEADROOM
