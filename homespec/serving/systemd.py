"""systemd integration: render and install the unit, and talk sd_notify(3) from the daemon.

`render_unit` writes a unit for one install's real paths (the shipped systemd/homespec.service is
its output for the /opt/homespec layout, plus longer comments); `install_unit` puts it where
systemd looks; `SystemdNotifier` sends READY / STATUS / STOPPING / WATCHDOG from `homespec serve`.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import sdnotify

from homespec.errors import UserError

log = logging.getLogger(__name__)

UNIT_NAME = "homespec.service"
SERVICE_USER = "homespec"
# StateDirectory=homespec of a system unit; models kept here belong to the service (writable).
SYSTEM_STATE_DIR = Path("/var/lib/homespec")
SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
# ProtectHome=yes hides these; a checkout, config or models under them needs ProtectHome=read-only.
HOME_DIRS = (Path("/home"), Path("/root"), Path("/run/user"))
# PrivateTmp=yes gives the service an empty /tmp and /var/tmp: a venv or config there vanishes.
TMP_DIRS = (Path("/tmp"), Path("/var/tmp"))
# Each HTTP connection is a file descriptor; systemd's default soft limit (1,024) is reached by
# ~1,000 stalled clients. server.max_connections (512) stays far below this.
NOFILE_LIMIT = 65536
# Exit statuses of `homespec serve` when the first load fails (sysexits.h; see serve's
# exit_status). EX_CONFIG: these files and this config fail the same way again, so the unit
# lists it in RestartPreventExitStatus=. EX_TEMPFAIL: memory that other programs hold now;
# Restart=on-failure tries again after RestartSec.
EXIT_CONFIG = 78
EXIT_TEMPFAIL = 75

# READY=1 comes after model load + warm-up. On a 2-core CPU: mmap + page-in of ~1.6 GB of GGUF
# (40 s from an SD card), then the controller's timed passes (~30 s); 300 leaves room for both.
TIMEOUT_START_S = 300  # seconds
# Pings go out every WatchdogSec/2 from their own thread (llama.cpp calls release the GIL), so a
# slow step (~1 s verify, ~13 s prefill chunk on 2 cores) never delays them; 30 s only has to
# absorb scheduling stalls under memory pressure. Hang detection is the server's health check.
WATCHDOG_S = 30  # seconds
# After drain_timeout_s the server still cancels, writes its prefix cache to disk (at most
# daemon.PERSIST_BUDGET_S, 10 s), unloads and exits: allow this much on top.
STOP_MARGIN_S = 25  # seconds
RESTART_S = 5  # seconds
# Five failed starts in ten minutes: stop retrying (each start re-reads GBs of weights).
START_LIMIT_INTERVAL_S = 600  # seconds
START_LIMIT_BURST = 5


# --- rendering ----------------------------------------------------------------------------------


def _plain(p: Path) -> str:
    """A path for a one-path directive (WorkingDirectory=): no quoting there, only specifiers."""
    s = str(p)
    if not p.is_absolute():
        raise UserError(f"{s}: systemd needs an absolute path")
    if any(ord(c) < 32 or c == "\\" for c in s):
        raise UserError(f"{s!r}: a path with control characters or backslashes cannot go into a unit file")
    return s.replace("%", "%%")  # % starts a specifier (%h, %S, ...)


def _word(s: str, *, exec_argument: bool = False) -> str:
    """One word of ExecStart= or of a path list: quoted when it holds spaces or quotes."""
    if any(ord(c) < 32 for c in s):
        raise UserError(f"{s!r}: control characters cannot go into a unit file")
    s = s.replace("%", "%%")
    if exec_argument:
        s = s.replace("$", "$$")  # $VAR is expanded in ExecStart='s arguments (not in the program)
    if any(c in s for c in " \t\"'\\;"):
        s = '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return s


def _under(p: Path, root: Path) -> bool:
    return p == root or root in p.parents


def _touches_home(paths: list[Path]) -> bool:
    candidates = paths + [p.resolve() for p in paths]
    return any(_under(p, h) for p in candidates for h in HOME_DIRS)


def render_unit(
    *,
    exec_path: Path,
    config: Path,
    working_dir: Path,
    user: bool,
    mlock: bool,
    models_dir: Path,
    drain_timeout_s: float = 20.0,
    gpu: bool = False,
    user_sandbox: bool = False,
) -> str:
    """The homespec.service text for these paths.

    user=False: a system unit running as the dedicated `homespec` user, sandboxed.
    user=True: a `systemctl --user` unit; by default it keeps only the options a user manager can
    apply without privileges (prctl/seccomp ones), since file-system namespacing, User= and
    raising LimitMEMLOCK need root there. user_sandbox=True adds PrivateUsers=yes, and with that
    user namespace the file-system and kernel sandbox too (`systemd-analyze security` 6.3 -> 1.8);
    it needs unprivileged user namespaces (user_namespaces_refused() says when they are off).
    `gpu` keeps /dev visible (PrivateDevices= would hide the GPU).
    """
    exec_start = " ".join(
        [_word(str(exec_path)), "serve", "--config", _word(str(config), exec_argument=True)]
    )
    stop_s = math.ceil(drain_timeout_s) + STOP_MARGIN_S
    kind = "user" if user else "system"
    out = [
        f"# homespec.service ({kind} unit), rendered by `homespec service install` for:",
        f"#   {exec_path} serve --config {config}",
        "# Re-run `homespec service install` after moving the checkout or the config.",
        "",
        "[Unit]",
        "Description=homespec local LLM inference daemon",
    ]
    if not user:
        # A LAN bind address must exist before we bind it; user managers have no such target.
        out += ["Wants=network-online.target", "After=network-online.target"]
    out += [
        f"StartLimitIntervalSec={START_LIMIT_INTERVAL_S}",
        f"StartLimitBurst={START_LIMIT_BURST}",
        "",
        "[Service]",
        "# READY=1 after warm-up; WATCHDOG=1 while the generation loop makes progress.",
        "Type=notify",
        f"ExecStart={exec_start}",
        f"WorkingDirectory={_plain(working_dir)}",
        "# Logs reach the journal as they happen; a watchdog SIGABRT dumps every thread's stack.",
        "Environment=PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1",
    ]
    if not user:
        out += [f"User={SERVICE_USER}", f"Group={SERVICE_USER}"]
    out += [
        "StateDirectory=homespec",
        "CacheDirectory=homespec",
        f"TimeoutStartSec={TIMEOUT_START_S}",
        f"WatchdogSec={WATCHDOG_S}",
        "# SIGTERM drains: in-flight requests get drain_timeout_s, then the server exits.",
        "KillSignal=SIGTERM",
        f"TimeoutStopSec={stop_s}",
        "Restart=on-failure",
        f"RestartSec={RESTART_S}",
        "# Exit 2 is a config or usage error, 78 (EX_CONFIG) a config the models cannot be loaded",
        "# with (corrupt GGUF, memory plan that cannot fit): restarting cannot fix either.",
        f"RestartPreventExitStatus=2 {EXIT_CONFIG}",
        "# One file descriptor per HTTP connection: 1,024 stalled clients would exhaust the default.",
        f"LimitNOFILE={NOFILE_LIMIT}",
    ]
    if mlock and not user:
        out += ["# runtime.use_mlock: llama.cpp locks the weights in RAM.", "LimitMEMLOCK=infinity"]
    if not user:
        out += _namespace_sandbox(exec_path, config, working_dir, models_dir, gpu)
    elif user_sandbox:
        out += ["# --sandbox: a user namespace lets a user manager mount the sandbox below (it fails",
                "# to start with 226/NAMESPACE where unprivileged user namespaces are switched off).",
                "PrivateUsers=yes"]
        out += _namespace_sandbox(exec_path, config, working_dir, models_dir, gpu, user=True)
        out += ["CapabilityBoundingSet="]
    out += _seccomp_sandbox()
    if not user:
        out += ["CapabilityBoundingSet=", "UMask=0027"]
    else:
        out += ["UMask=0077"]  # no homespec group to share files with: private to the user
    out += ["", "[Install]", f"WantedBy={'default.target' if user else 'multi-user.target'}", ""]
    return "\n".join(out)


def _namespace_sandbox(exec_path: Path, config: Path, working_dir: Path, models_dir: Path, gpu: bool,
                    user: bool = False) -> list[str]:
    """File-system and kernel sandboxing; needs mount namespaces: a system manager, or a user
    one with PrivateUsers=yes. A user unit leaves out RemoveIPC= (it acts on User=, which a user
    unit has not) and ProtectClock= (it implies a DeviceAllow= list, a cgroup device policy that
    a user manager cannot set up)."""
    home = _touches_home([exec_path, config, working_dir, models_dir])
    in_tmp = [p for p in (exec_path, config, working_dir, models_dir)
              if any(_under(q, t) for q in (p, p.resolve()) for t in TMP_DIRS)]
    if in_tmp:
        log.warning("%s is under /tmp or /var/tmp, which PrivateTmp=yes hides from the service: "
                    "move it (e.g. to /opt or /var/lib/homespec) before starting the unit", in_tmp[0])
    out = [
        "# Read-only OS; mmap (and mlock) of read-only model files works under it.",
        "ProtectSystem=strict",
    ]
    if home:
        out += ["# The checkout, config or models live under a home directory: read-only, not hidden.",
                "ProtectHome=read-only"]
    else:
        out += ["ProtectHome=yes"]
    if in_tmp:
        out += [f"# WARNING: {in_tmp[0]} is under /tmp or /var/tmp; PrivateTmp=yes hides it from the",
                "# service (status 203/EXEC or a missing config). Move it before starting the unit."]
    out += ["PrivateTmp=yes"]
    if gpu:
        # ProtectClock= is left out too: it implies DeviceAllow=char-rtc, which turns device
        # access into an allow-list without the GPU (CapabilityBoundingSet= already drops
        # CAP_SYS_TIME).
        out += ["# The config offloads layers to a GPU: /dev/nvidia*, /dev/dri and /dev/kfd stay visible.",
                "PrivateDevices=no"]
    else:
        out += ["PrivateDevices=yes"]
    if not _under(models_dir, SYSTEM_STATE_DIR):
        # "-": a missing folder is the daemon's error to report, not a cryptic 226/NAMESPACE.
        out += ["# Models outside the StateDirectory are never written by the daemon.",
                f"ReadOnlyPaths={_word('-' + str(models_dir))}"]
    out += [
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectHostname=yes",
        "# Other users' processes are invisible; SysV IPC objects go with the service user.",
        "ProtectProc=invisible",
        *([] if user else ["RemoveIPC=yes"]),
        "PrivateMounts=yes",
    ]
    if not gpu and not user:
        out += ["ProtectClock=yes"]
    return out


def user_namespaces_refused(proc_sys: Path = Path("/proc/sys")) -> str | None:
    """Why an unprivileged process cannot have a user namespace here, or None when it can: the
    kernel's switches for it (a user unit with --sandbox needs one)."""
    checks = (
        ("user/max_user_namespaces", lambda v: v == "0", "user.max_user_namespaces is 0"),
        ("kernel/unprivileged_userns_clone", lambda v: v == "0", "kernel.unprivileged_userns_clone is 0"),
        # Ubuntu 23.10+: AppArmor lets unconfined programs create one, but without capabilities in it.
        ("kernel/apparmor_restrict_unprivileged_userns", lambda v: v == "1",
         "kernel.apparmor_restrict_unprivileged_userns is 1"),
    )
    for name, refused, why in checks:
        try:
            value = (proc_sys / name).read_text().strip()
        except OSError:
            continue  # the switch does not exist on this kernel
        if refused(value):
            return why
    return None


def _seccomp_sandbox() -> list[str]:
    """prctl/seccomp options: they work in user managers too (NoNewPrivileges is implied there).

    MemoryDenyWriteExecute= is left out: ctypes callbacks (libffi closures) and CUDA's JIT need
    writable+executable pages.
    """
    return [
        "NoNewPrivileges=yes",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "# AF_NETLINK: glibc's getaddrinfo asks the kernel for local addresses over netlink.",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK",
        "SystemCallArchitectures=native",
        "# @system-service includes mlock and sched_setaffinity; EPERM instead of a kill for the rest.",
        "SystemCallFilter=@system-service",
        "# Minus the privileged calls (chown, setuid, chroot...) nothing in the daemon makes.",
        "SystemCallFilter=~@privileged",
        "SystemCallErrorNumber=EPERM",
    ]


# --- installing ---------------------------------------------------------------------------------


def default_unit_path(user: bool) -> Path:
    """Where systemd looks for an administrator's unit: /etc/systemd/system or ~/.config/systemd/user."""
    if not user:
        return SYSTEM_UNIT_DIR / UNIT_NAME
    config_home = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    return config_home / "systemd" / "user" / UNIT_NAME


def install_unit(text: str, user: bool, dest: Path | None = None) -> Path:
    """Write the unit atomically (temp file + rename: systemd never reads half a unit)."""
    dest = Path(dest) if dest is not None else default_unit_path(user)
    how = "use --user, or --dest PATH" if not user else "use --dest PATH"
    tmp: str | None = None
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; systemd and `systemctl cat` read it as others
        os.replace(tmp, dest)
        tmp = None
    except PermissionError:
        raise UserError(f"writing {dest.parent} needs root; run with sudo or {how}") from None
    except OSError as e:
        raise UserError(f"cannot write {dest}: {e.strerror or e}") from None
    finally:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
    return dest


# --- sd_notify ----------------------------------------------------------------------------------


def _one_line(text: str) -> str:
    return " ".join(text.split())  # a newline would end the STATUS= field


class SystemdNotifier:
    """sd_notify(3) messages through the `sdnotify` package; every method is a no-op when
    NOTIFY_SOCKET is unset (not started by systemd, or not Type=notify).

    Thread-safe: each message is one datagram.
    """

    def __init__(self) -> None:
        self._sd: sdnotify.SystemdNotifier | None = None
        self._send_failed = False
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        addr = os.environ.get("NOTIFY_SOCKET")
        if addr:
            try:
                # debug=True: sdnotify raises instead of silently dropping, so we can say why.
                # On a failed connect it drops its socket unclosed; that fd is freed right away,
                # and the ResourceWarning would only repeat the warning logged below.
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", ResourceWarning)
                    self._sd = sdnotify.SystemdNotifier(debug=True)
            except OSError as e:
                log.warning("NOTIFY_SOCKET=%s unusable (%s): no systemd notifications", addr, e)

    @property
    def enabled(self) -> bool:
        return self._sd is not None

    def _send(self, *fields: str) -> None:
        sd = self._sd  # read once: close() may clear it from another thread
        if sd is None:
            return
        try:
            sd.notify("\n".join(fields))
        except OSError as e:
            if not self._send_failed:  # once: the watchdog would repeat it every few seconds
                log.warning("sd_notify failed (%s); systemd may consider the service dead", e)
            self._send_failed = True

    def ready(self, status: str = "ready") -> None:
        """Startup is complete: models loaded, warmed up, HTTP socket listening."""
        self._send("READY=1", f"STATUS={_one_line(status)}")

    def status(self, text: str) -> None:
        """One line shown by `systemctl status homespec`."""
        self._send(f"STATUS={_one_line(text)}")

    def stopping(self, status: str = "draining requests") -> None:
        """Shutdown has begun (on SIGTERM, before draining)."""
        self._send("STOPPING=1", f"STATUS={_one_line(status)}")

    def extend_timeout(self, seconds: float) -> None:
        """Ask for `seconds` more before TimeoutStartSec/TimeoutStopSec (a very slow model load)."""
        self._send(f"EXTEND_TIMEOUT_USEC={max(0, int(seconds * 1_000_000))}")

    def watchdog_interval(self) -> float | None:
        """Seconds between pings (half of WatchdogSec), or None when no watchdog is for us."""
        if self._sd is None:
            return None
        usec, pid = os.environ.get("WATCHDOG_USEC"), os.environ.get("WATCHDOG_PID")
        try:
            if not usec or int(usec) <= 0:
                return None
            if pid and int(pid) != os.getpid():
                return None  # the watchdog is meant for another process (we were forked or exec'd)
        except ValueError:
            log.warning("ignoring malformed WATCHDOG_USEC=%r / WATCHDOG_PID=%r", usec, pid)
            return None
        return int(usec) / 2 / 1_000_000

    def start_watchdog(self, is_healthy: Callable[[], bool]) -> bool:
        """Ping WATCHDOG=1 every WatchdogSec/2 from a daemon thread, but only while
        `is_healthy()` is True: a hung generation loop then stops the pings and systemd restarts
        us. `is_healthy` runs on that thread; keep it cheap and non-blocking. Returns whether a
        watchdog runs (False without systemd or without WatchdogSec=)."""
        interval = self.watchdog_interval()
        if interval is None:
            return False
        self.stop_watchdog()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._watchdog_loop, args=(is_healthy, interval, self._stop), name="sd-watchdog", daemon=True
        )
        self._thread.start()
        return True

    def stop_watchdog(self) -> None:
        thread, self._thread = self._thread, None
        if thread is not None:
            self._stop.set()
            thread.join(timeout=5)  # seconds; a stuck is_healthy() must not block shutdown

    def close(self) -> None:
        """Stop the watchdog and close the socket; later calls are no-ops."""
        self.stop_watchdog()
        sd, self._sd = self._sd, None
        if sd is not None and sd.socket is not None:
            sd.socket.close()

    def _watchdog_loop(self, is_healthy: Callable[[], bool], interval: float, stop: threading.Event) -> None:
        was_healthy = True
        while True:
            error: Exception | None = None
            try:
                healthy = bool(is_healthy())
            except Exception as e:  # a broken health check is an unhealthy daemon, not a dead thread
                healthy, error = False, e
            if healthy:
                self._send("WATCHDOG=1")
            if healthy != was_healthy:  # log transitions only, not every interval
                if healthy:
                    log.info("health check passes again: watchdog pings resumed")
                else:
                    log.warning("health check failing: watchdog pings withheld; systemd restarts us "
                                "if this lasts WatchdogSec", exc_info=error)
                was_healthy = healthy
            if stop.wait(interval):
                return
