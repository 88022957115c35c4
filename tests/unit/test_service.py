"""systemd unit (rendered and shipped) checked by the real `systemd-analyze verify`; the
sd_notify wrapper checked against a real AF_UNIX datagram socket; `homespec service install`."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from homespec.__main__ import main as homespec_main
from homespec.errors import UserError
from homespec.serving import systemd as service
from homespec.serving.systemd import SystemdNotifier, install_unit, render_unit

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "systemd" / "homespec.service"
OPT_EXEC = "/opt/homespec/.venv/bin/homespec"
SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None, reason="systemd-analyze not installed")


# --- helpers ------------------------------------------------------------------------------------


def verify(text: str, folder: Path, *, user: bool = False) -> str:
    """`systemd-analyze verify` on the unit text; returns everything it printed.

    It checks syntax, every key and value, and that ExecStart's binary exists and is executable.
    Success is exit 0 *and* no output: unknown keys and bad values are only warnings (exit 0).
    """
    folder.mkdir(parents=True, exist_ok=True)
    unit = folder / "homespec.service"
    unit.write_text(text)
    env = dict(os.environ)
    cmd = [SYSTEMD_ANALYZE, "--man=no", "--generators=no"]
    if user:
        # A user manager needs a runtime dir; a private one keeps the test off the real session.
        runtime = folder / "runtime"
        runtime.mkdir(mode=0o700, exist_ok=True)
        env.update(XDG_RUNTIME_DIR=str(runtime), HOME=str(folder))
        cmd.append("--user")
    proc = subprocess.run([*cmd, "verify", str(unit)], capture_output=True, text=True, env=env, timeout=60)
    output = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 0, output
    return output


def directives(text: str) -> list[str]:
    """Section headers and key=value lines, without comments and blank lines."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def keys(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in directives(text):
        if "=" in line:
            k, v = line.split("=", 1)
            out.setdefault(k, []).append(v)
    return out


@pytest.fixture
def layout(tmp_path: Path) -> dict[str, Path]:
    """A tmp install: an executable `homespec` script, a config and a models folder."""
    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    exe = bin_dir / "homespec"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    etc = tmp_path / "etc"
    etc.mkdir()
    config = etc / "config.yaml"
    config.write_text("{}\n")
    models = tmp_path / "models"
    models.mkdir()
    return {"exec_path": exe, "config": config, "working_dir": etc, "models_dir": models}


# --- systemd-analyze verify ---------------------------------------------------------------------


@needs_analyze
def test_verify_helper_reports_a_bad_unit(tmp_path: Path, layout: dict[str, Path]) -> None:
    # The checks below assert an empty output: make sure a broken unit would not print nothing.
    text = render_unit(user=False, mlock=False, **layout).replace("WatchdogSec=30", "WatchdogSecs=30")
    assert "Unknown key" in verify(text, tmp_path / "unit")
    missing = render_unit(user=False, mlock=False, **{**layout, "exec_path": tmp_path / "absent"})
    with pytest.raises(AssertionError, match="is not executable"):
        verify(missing, tmp_path / "unit2")


@needs_analyze
@pytest.mark.parametrize("mlock", [False, True])
@pytest.mark.parametrize("gpu", [False, True])
def test_rendered_system_unit_passes_systemd_analyze_verify(
    tmp_path: Path, layout: dict[str, Path], mlock: bool, gpu: bool
) -> None:
    text = render_unit(user=False, mlock=mlock, gpu=gpu, **layout)
    assert verify(text, tmp_path / "unit") == ""


@needs_analyze
@pytest.mark.parametrize("mlock", [False, True])
def test_rendered_user_unit_passes_systemd_analyze_verify(
    tmp_path: Path, layout: dict[str, Path], mlock: bool
) -> None:
    text = render_unit(user=True, mlock=mlock, **layout)
    assert verify(text, tmp_path / "unit", user=True) == ""


@needs_analyze
def test_paths_with_spaces_percent_and_dollar_survive_unit_quoting(tmp_path: Path) -> None:
    # verify resolves ExecStart's first word: it only finds the binary if quoting and %%/$$
    # escaping are right.
    odd = tmp_path / "my models $HOME 100%"
    odd.mkdir()
    exe = odd / "homespec"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    text = render_unit(
        exec_path=exe, config=odd / "c.yaml", working_dir=odd, user=False, mlock=False, models_dir=odd / "m"
    )
    assert verify(text, tmp_path / "unit") == ""
    assert 'ReadOnlyPaths="-' in text and "100%%" in text and "$$HOME" in text


@needs_analyze
def test_shipped_unit_passes_systemd_analyze_verify_for_a_tmp_layout(
    tmp_path: Path, layout: dict[str, Path]
) -> None:
    shipped = SHIPPED.read_text()
    assert OPT_EXEC in shipped
    assert verify(shipped.replace(OPT_EXEC, str(layout["exec_path"])), tmp_path / "unit") == ""


def test_shipped_unit_is_what_render_unit_gives_for_the_opt_layout() -> None:
    rendered = render_unit(
        exec_path=Path(OPT_EXEC),
        config=Path("/etc/homespec/config.yaml"),
        working_dir=Path("/etc/homespec"),
        user=False,
        mlock=False,
        models_dir=Path("/var/lib/homespec/models"),
        drain_timeout_s=20,
    )
    assert directives(SHIPPED.read_text()) == directives(rendered)


# --- what the units contain ---------------------------------------------------------------------


def test_system_unit_runs_sandboxed_as_its_own_user(layout: dict[str, Path]) -> None:
    k = keys(render_unit(user=False, mlock=False, **layout))
    assert k["Type"] == ["notify"] and k["User"] == ["homespec"]
    assert k["ProtectSystem"] == ["strict"] and k["ProtectHome"] == ["yes"]
    assert k["PrivateTmp"] == ["yes"] and k["NoNewPrivileges"] == ["yes"] and k["PrivateDevices"] == ["yes"]
    assert k["StateDirectory"] == ["homespec"] and k["CacheDirectory"] == ["homespec"]
    assert k["Restart"] == ["on-failure"] and k["KillSignal"] == ["SIGTERM"]
    assert "PYTHONUNBUFFERED=1" in k["Environment"][0].split()
    assert k["ReadOnlyPaths"] == [f"-{layout['models_dir']}"]
    assert "LimitMEMLOCK" not in k
    assert k["WantedBy"] == ["multi-user.target"]


def test_timeouts_cover_warm_up_slow_steps_and_the_drain(layout: dict[str, Path]) -> None:
    k = keys(render_unit(user=False, mlock=False, drain_timeout_s=90.5, **layout))
    assert int(k["TimeoutStartSec"][0]) >= 120  # model load + warm-up on 2 cores
    assert int(k["WatchdogSec"][0]) >= 10  # pings every WatchdogSec/2; a verify pass is ~1 s
    assert int(k["TimeoutStopSec"][0]) > 90.5


def test_mlock_raises_the_memlock_limit_in_system_units_only(layout: dict[str, Path]) -> None:
    assert keys(render_unit(user=False, mlock=True, **layout))["LimitMEMLOCK"] == ["infinity"]
    # A user manager cannot raise its own hard limit: the unit would fail with 205/LIMITS.
    assert "LimitMEMLOCK" not in keys(render_unit(user=True, mlock=True, **layout))


def test_user_unit_leaves_out_what_a_user_manager_cannot_apply(layout: dict[str, Path]) -> None:
    k = keys(render_unit(user=True, mlock=True, **layout))
    for key in ("User", "Group", "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices",
                "ReadOnlyPaths", "ProtectKernelTunables", "ProtectControlGroups", "ProtectClock",
                "CapabilityBoundingSet", "LimitMEMLOCK", "After", "Wants"):
        assert key not in k, key
    assert k["NoNewPrivileges"] == ["yes"] and k["Type"] == ["notify"]
    assert k["WantedBy"] == ["default.target"]


def test_sandboxed_user_unit_mounts_the_sandbox_in_a_user_namespace(layout: dict[str, Path]) -> None:
    k = keys(render_unit(user=True, mlock=False, user_sandbox=True, **layout))
    assert k["PrivateUsers"] == ["yes"]
    for key in ("ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "ProtectKernelTunables",
                "ProtectControlGroups", "ProtectProc", "PrivateMounts", "ReadOnlyPaths"):
        assert key in k, key
    # No User=, no cgroup device list (ProtectClock= implies one), no RemoveIPC= (acts on User=).
    for key in ("User", "ProtectClock", "RemoveIPC", "LimitMEMLOCK"):
        assert key not in k, key


@needs_analyze
def test_sandboxed_user_unit_passes_verify_and_scores_far_better_in_systemd_analyze_security(
    tmp_path: Path, layout: dict[str, Path]
) -> None:
    def exposure(text: str, folder: Path) -> float:
        verify(text, folder, user=True)  # writes folder/homespec.service
        proc = subprocess.run([SYSTEMD_ANALYZE, "security", "--offline=true", str(folder / "homespec.service")],
                              capture_output=True, text=True, timeout=60)
        if "--offline" in proc.stderr:
            pytest.skip(f"this systemd-analyze has no --offline: {proc.stderr.strip()}")
        line = next(x for x in proc.stdout.splitlines() if "Overall exposure level" in x)
        return float(line.split(":")[1].split()[0])

    plain = exposure(render_unit(user=True, mlock=False, **layout), tmp_path / "plain")
    sandboxed = exposure(render_unit(user=True, mlock=False, user_sandbox=True, **layout), tmp_path / "sandboxed")
    assert plain > 5.0 and sandboxed <= 2.0, (plain, sandboxed)  # measured: 6.3 and 1.8


def test_user_namespaces_refused_names_the_kernel_switch_that_is_off(tmp_path: Path) -> None:
    def proc_sys(**values: str) -> Path:
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        for name, value in values.items():
            f = root / name.replace("__", "/")
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(value + "\n")
        return root

    assert service.user_namespaces_refused(proc_sys(user__max_user_namespaces="96364")) is None
    assert service.user_namespaces_refused(proc_sys()) is None  # no switches: a kernel that always allows them
    assert "max_user_namespaces is 0" in service.user_namespaces_refused(proc_sys(user__max_user_namespaces="0"))
    assert "unprivileged_userns_clone is 0" in service.user_namespaces_refused(
        proc_sys(user__max_user_namespaces="100", kernel__unprivileged_userns_clone="0"))
    assert "apparmor_restrict_unprivileged_userns is 1" in service.user_namespaces_refused(
        proc_sys(kernel__apparmor_restrict_unprivileged_userns="1"))


def test_models_under_the_state_directory_stay_writable(layout: dict[str, Path]) -> None:
    text = render_unit(user=False, mlock=False, **{**layout, "models_dir": Path("/var/lib/homespec/models")})
    assert "ReadOnlyPaths" not in keys(text)


def test_gpu_unit_keeps_devices_visible(layout: dict[str, Path]) -> None:
    k = keys(render_unit(user=False, mlock=False, gpu=True, **layout))
    assert k["PrivateDevices"] == ["no"]
    assert "ProtectClock" not in k  # it implies DeviceAllow=char-rtc, which denies the GPU
    assert "DeviceAllow" not in k


def test_checkout_under_home_gets_a_read_only_home(layout: dict[str, Path]) -> None:
    paths = {**layout, "exec_path": Path("/home/alice/homespec/.venv/bin/homespec")}
    assert keys(render_unit(user=False, mlock=False, **paths))["ProtectHome"] == ["read-only"]


def test_relative_and_newline_paths_are_refused(layout: dict[str, Path]) -> None:
    with pytest.raises(UserError, match="absolute"):
        render_unit(user=False, mlock=False, **{**layout, "working_dir": Path("etc")})
    with pytest.raises(UserError, match="control characters"):
        render_unit(user=False, mlock=False, **{**layout, "config": Path("/etc/a\nb.yaml")})


# --- install_unit -------------------------------------------------------------------------------


def test_install_unit_replaces_the_file_whole_and_world_readable(tmp_path: Path) -> None:
    dest = tmp_path / "systemd" / "homespec.service"
    assert install_unit("[Unit]\nDescription=old\n", user=False, dest=dest) == dest
    install_unit("[Unit]\nDescription=new\n", user=False, dest=dest)
    assert dest.read_text() == "[Unit]\nDescription=new\n"
    assert stat.S_IMODE(dest.stat().st_mode) == 0o644
    assert [p.name for p in dest.parent.iterdir()] == ["homespec.service"]  # no temp file left


def test_user_install_goes_to_the_xdg_config_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    dest = install_unit("[Unit]\n", user=True)
    assert dest == tmp_path / "cfg" / "systemd" / "user" / "homespec.service" and dest.exists()
    assert service.default_unit_path(False) == Path("/etc/systemd/system/homespec.service")


def test_install_without_permission_is_a_one_line_user_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Root bypasses file modes, so the refusal is simulated where the write starts.
    def refuse(*a: object, **k: object) -> None:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(UserError, match=r"needs root; run with sudo or use --user") as e:
        install_unit("[Unit]\n", user=False, dest=tmp_path / "homespec.service")
    assert "\n" not in str(e.value)


# --- SystemdNotifier ----------------------------------------------------------------------------


@pytest.fixture
def notify_socket(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """A bound AF_UNIX datagram socket standing in for systemd, exported as NOTIFY_SOCKET."""
    # tmp_path_factory's folders are short: AF_UNIX paths are limited to 107 bytes.
    path = tmp_path_factory.mktemp("sd") / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield sock
    sock.close()


def receive(sock: socket.socket, seconds: float) -> list[tuple[float, str]]:
    """Every datagram that arrives within `seconds`, with its arrival time."""
    got: list[tuple[float, str]] = []
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            data = sock.recv(4096)
        except TimeoutError:
            break
        got.append((time.monotonic(), data.decode()))
    return got


def test_ready_sends_ready_and_status_in_one_datagram(notify_socket: socket.socket) -> None:
    n = SystemdNotifier()
    assert n.enabled
    n.ready("serving qwen2.5-coder-1.5b\non 127.0.0.1:8321")
    [(_, msg)] = receive(notify_socket, 0.5)
    assert msg.split("\n") == ["READY=1", "STATUS=serving qwen2.5-coder-1.5b on 127.0.0.1:8321"]
    n.status("warming up")
    n.stopping()
    n.extend_timeout(90)
    msgs = [m for _, m in receive(notify_socket, 0.5)]
    assert msgs == ["STATUS=warming up", "STOPPING=1\nSTATUS=draining requests", "EXTEND_TIMEOUT_USEC=90000000"]
    n.close()
    n.status("after close")  # a no-op, not an error
    assert receive(notify_socket, 0.2) == []


def test_abstract_notify_socket_is_supported(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"homespec-test-{os.getpid()}-{threading.get_ident()}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind("\0" + name)
    try:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        n = SystemdNotifier()
        n.ready()
        n.close()
        assert [m for _, m in receive(sock, 0.5)] == ["READY=1\nSTATUS=ready"]
    finally:
        sock.close()


def test_watchdog_pings_at_half_watchdog_usec_only_while_healthy(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "200000")  # 0.2 s: a ping every 0.1 s
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    healthy = threading.Event()
    healthy.set()
    n = SystemdNotifier()
    assert n.watchdog_interval() == pytest.approx(0.1)
    assert n.start_watchdog(healthy.is_set)
    try:
        pings = receive(notify_socket, 0.75)
        assert {m for _, m in pings} == {"WATCHDOG=1"}
        assert 4 <= len(pings) <= 10
        gaps = [b - a for (a, _), (b, _) in zip(pings, pings[1:])]
        assert 0.07 <= statistics.median(gaps) <= 0.2

        healthy.clear()  # a hung generation loop: systemd must stop hearing from us
        receive(notify_socket, 0.15)  # a ping already past the health check may still land
        assert receive(notify_socket, 0.5) == []

        healthy.set()  # recovered within WatchdogSec: pings resume
        assert len(receive(notify_socket, 0.35)) >= 2
        n.stop_watchdog()
        receive(notify_socket, 0.15)
        assert receive(notify_socket, 0.3) == []  # stop_watchdog stops the thread
        assert not any(t.name == "sd-watchdog" for t in threading.enumerate())
    finally:
        n.close()


def test_a_health_check_that_raises_counts_as_unhealthy(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "100000")

    def broken() -> bool:
        raise RuntimeError("engine state unreadable")

    n = SystemdNotifier()
    assert n.start_watchdog(broken)
    try:
        assert receive(notify_socket, 0.3) == []
    finally:
        n.close()


def test_watchdog_meant_for_another_pid_is_not_ours(
    notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))
    n = SystemdNotifier()
    assert n.watchdog_interval() is None and not n.start_watchdog(lambda: True)
    assert receive(notify_socket, 0.2) == []
    n.close()


def test_without_notify_socket_every_call_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.setenv("WATCHDOG_USEC", "100000")
    n = SystemdNotifier()
    assert not n.enabled and n.watchdog_interval() is None
    n.ready("x")
    n.status("x")
    n.stopping()
    n.extend_timeout(1)
    assert n.start_watchdog(lambda: True) is False
    n.stop_watchdog()
    assert not any(t.name == "sd-watchdog" for t in threading.enumerate())


def test_unreachable_notify_socket_disables_notifications(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "nobody-listens"))
    n = SystemdNotifier()
    assert not n.enabled
    n.ready()  # does not raise


# --- `homespec service install` -----------------------------------------------------------------


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    cfg = tmp_path / "conf" / "config.yaml"
    cfg.parent.mkdir()
    cfg.write_text(
        "models:\n  dir: /srv/homespec-models\n"
        "runtime:\n  use_mlock: true\n"
        "server:\n  drain_timeout_s: 60\n"
    )
    return cfg


def test_cli_print_renders_this_install_paths(config_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert homespec_main(["service", "install", "--print", "--config", str(config_file)]) == 0
    text = capsys.readouterr().out
    k = keys(text)
    exe = Path(sys.executable).parent / "homespec"
    assert k["ExecStart"] == [f"{exe} serve --config {config_file}"]
    assert k["WorkingDirectory"] == [str(config_file.parent)]
    assert k["ReadOnlyPaths"] == ["-/srv/homespec-models"]
    assert k["LimitMEMLOCK"] == ["infinity"]  # runtime.use_mlock
    assert int(k["TimeoutStopSec"][0]) > 60  # server.drain_timeout_s
    if SYSTEMD_ANALYZE:
        assert verify(text, config_file.parent / "check") == ""


def test_cli_print_user_unit_passes_verify(
    config_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert homespec_main(["service", "install", "--user", "--print", "--config", str(config_file)]) == 0
    captured = capsys.readouterr()
    assert "User=" not in captured.out and "LimitMEMLOCK" not in captured.out
    assert "LimitMEMLOCK" in captured.err  # says why mlock will not take effect
    if SYSTEMD_ANALYZE:
        assert verify(captured.out, tmp_path / "check", user=True) == ""


def test_cli_sandbox_is_for_user_units_on_kernels_with_user_namespaces(
    config_file: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert homespec_main(["service", "install", "--sandbox", "--print", "--config", str(config_file)]) == 2
    assert "--sandbox is for --user units" in capsys.readouterr().err
    monkeypatch.setattr(service, "user_namespaces_refused", lambda: "user.max_user_namespaces is 0")
    assert homespec_main(["service", "install", "--user", "--sandbox", "--print", "--config", str(config_file)]) == 2
    err = capsys.readouterr().err
    assert "needs unprivileged user namespaces, and user.max_user_namespaces is 0" in err and "\n" == err[-1:], err
    monkeypatch.setattr(service, "user_namespaces_refused", lambda: None)
    assert homespec_main(["service", "install", "--user", "--sandbox", "--print", "--config", str(config_file)]) == 0
    assert "PrivateUsers=yes" in capsys.readouterr().out


def test_cli_install_writes_the_unit_and_prints_the_systemctl_commands(
    config_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert homespec_main(["service", "install", "--user", "--config", str(config_file)]) == 0
    out = capsys.readouterr().out
    dest = tmp_path / "xdg" / "systemd" / "user" / "homespec.service"
    assert "Type=notify" in dest.read_text()
    assert f"wrote {dest}" in out
    assert "systemctl --user daemon-reload && systemctl --user enable --now homespec" in out
    assert "journalctl --user -u homespec -f" in out


def test_cli_finds_folders_the_service_user_cannot_enter(tmp_path: Path) -> None:
    from homespec.cli.service import _unreadable_ancestor

    closed = tmp_path / "closed"
    closed.mkdir(mode=0o700)
    blocked = _unreadable_ancestor(closed / "models" / "not-pulled-yet", uid=None)
    assert blocked is not None and (blocked == closed or blocked in closed.parents)
    assert not blocked.stat().st_mode & 0o001
    # The owner may enter its own folders whatever their mode.
    assert _unreadable_ancestor(closed / "models", uid=os.getuid()) is None
    assert _unreadable_ancestor(Path("/usr/bin/env"), uid=None) is None


def test_cli_system_install_notes_a_checkout_the_service_user_cannot_reach(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    closed = tmp_path / "private"
    closed.mkdir(mode=0o700)
    cfg = closed / "config.yaml"
    cfg.write_text("{}\n")
    assert homespec_main(["service", "install", "--print", "--config", str(cfg)]) == 0
    assert "closed to other users" in capsys.readouterr().err


def test_cli_without_a_config_fails_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # no ./config.yaml here
    assert homespec_main(["service", "install", "--print"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("homespec service:") and "--config" in err and "\n" not in err
