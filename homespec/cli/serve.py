"""`homespec serve`: the daemon — load, warm up, serve the OpenAI-compatible API on localhost."""

from __future__ import annotations

import argparse
import ipaddress
import math
import os

from homespec.cli.common import add_config_argument, add_config_flags, config_path
from homespec.config import ServerConfig
from homespec.errors import UserError
from homespec.serving.systemd import EXIT_CONFIG, EXIT_TEMPFAIL

# After drain_timeout_s our streams end themselves (an error event, then [DONE]); uvicorn's own
# hard bound comes this much later, only as a backstop.
DRAIN_BACKSTOP_S = 3


def exit_status(e: BaseException) -> int:
    """How `serve` exits when the first load fails, so that systemd retries only what a retry can
    fix. A model that cannot load (corrupt, wrong tokenizer, a build this CPU cannot run) or a
    memory plan that cannot fit even on an empty machine: EX_CONFIG (78), not retried. Memory
    that other programs hold for now: EX_TEMPFAIL (75), retried. Anything else (an I/O error, a
    llama.cpp failure): 1, retried. Exit 2, a usage or config error found before start, is the
    CLI's own (homespec/__main__.py)."""
    from homespec.models.memory import InsufficientMemory

    if isinstance(e, InsufficientMemory):
        return EXIT_CONFIG if e.never_fits else EXIT_TEMPFAIL
    if isinstance(e, UserError):
        return EXIT_CONFIG
    return 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_argument(p)
    add_config_flags(p, ServerConfig, ("host", "port"))


def resolve_api_key(cfg) -> str | None:  # cfg: homespec.config.Config
    """Config value, else $HOMESPEC_API_KEY, else the first line of server.api_key_file."""
    if cfg.server.api_key:
        return cfg.server.api_key  # config.py has checked it is printable ASCII
    if os.environ.get("HOMESPEC_API_KEY"):
        return _checked_key(os.environ["HOMESPEC_API_KEY"], "HOMESPEC_API_KEY")
    if cfg.server.api_key_file:
        path = cfg.resolve(cfg.server.api_key_file)
        try:
            key = path.read_text().splitlines()[0].strip()
        except (OSError, IndexError):
            raise UserError(f"server.api_key_file: cannot read a key from {path}") from None
        if not key:
            raise UserError(f"server.api_key_file: {path} is empty")
        return _checked_key(key, f"server.api_key_file ({path})")
    return None


def _checked_key(key: str, source: str) -> str:
    # Same rule as ServerConfig.api_key: header bytes are read as latin-1, clients send ASCII or
    # UTF-8, so a non-ASCII key would never match and lock every client out.
    if not (key.isascii() and key.isprintable()):
        raise UserError(f"{source}: the API key must be printable ASCII (it travels in an HTTP header)")
    return key


def check_bind(host: str, api_key: str | None, allow_unauthenticated_remote: bool) -> None:
    """Refuse to answer the whole LAN without a key unless the config says so explicitly."""
    if host in ("localhost",):
        return
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        raise UserError(f"server.host: {host!r} is not an IP address (use 127.0.0.1, ::1 or an interface address)") from None
    if not loopback and not api_key and not allow_unauthenticated_remote:
        raise UserError(
            f"server.host {host} is reachable from the network and no API key is set: set server.api_key "
            "(or HOMESPEC_API_KEY), or server.allow_unauthenticated_remote: true"
        )


def main(args: argparse.Namespace) -> int:
    import logging
    import signal
    import threading
    import time

    import uvicorn

    from homespec.config import load_config, override
    from homespec.serving.app import create_app
    from homespec.serving.daemon import Daemon
    from homespec.serving.http_server import ensure_open_files, install_repeat_filter, uvicorn_config
    from homespec.serving.systemd import SystemdNotifier

    log = logging.getLogger("homespec.serve")
    cfg_file = config_path(args.config)
    cfg = load_config(cfg_file)
    override(cfg.server, {"host": args.host, "port": args.port}, "--")
    api_key = resolve_api_key(cfg)
    check_bind(cfg.server.host, api_key, cfg.server.allow_unauthenticated_remote)
    ensure_open_files(cfg.server.max_connections)
    # Fail fast on missing models, before binding the port (the worker would only log it).
    from homespec.models.fetch import resolve_model_path

    resolve_model_path(cfg, cfg.models.target)
    if cfg.models.draft:
        resolve_model_path(cfg, cfg.models.draft)

    notifier = SystemdNotifier()
    daemon = Daemon(cfg)
    address = f"http://{cfg.server.host}:{cfg.server.port}"

    exit_code = 0

    def announce_ready() -> None:
        # READY=1 only once the models are warm AND uvicorn is listening (it binds after the
        # app's startup); the watchdog clock starts with READY, so ping only from then on.
        while not server.should_exit and not (daemon.ready and server.started):
            time.sleep(0.1)
        if server.should_exit:
            return
        log.info("ready on %s", address)
        notifier.ready(f"serving on {address}")
        notifier.start_watchdog(daemon.healthy)

    def on_failed(e: Exception) -> None:
        nonlocal exit_code
        exit_code = exit_status(e)
        notifier.status(f"failed: {e}")
        server.should_exit = True

    daemon.on_ready = lambda: threading.Thread(target=announce_ready, daemon=True).start()
    daemon.on_failed = on_failed
    app = create_app(daemon, api_key=api_key, address=address)
    backstop_s = math.ceil(cfg.server.drain_timeout_s) + DRAIN_BACKSTOP_S
    server = uvicorn.Server(uvicorn_config(app, cfg.server, log_level="info", timeout_graceful_shutdown=backstop_s))
    install_repeat_filter()  # after uvicorn's Config, which (re)configures its loggers

    def handle_exit(sig: int, frame) -> None:
        # SIGTERM/SIGINT: stop taking work first (queued requests get 503), then let uvicorn stop
        # listening and wait for in-flight streams up to drain_timeout_s.
        # uvicorn's own handler is not called on purpose: it records the signal and raises it
        # again after the graceful shutdown, so the process would die by SIGTERM (status -15)
        # before `daemon.shutdown` below runs; and sse-starlette patches it to end every open
        # stream at once, which would cut the answers the drain is meant to let finish.
        log.info("signal %s: draining (up to %.0f s)", signal.Signals(sig).name, cfg.server.drain_timeout_s)
        notifier.stopping()
        if app.state.drain_deadline is None:  # a second signal keeps the first bound
            app.state.drain_deadline = time.monotonic() + cfg.server.drain_timeout_s
        daemon.begin_drain()
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True  # a second Ctrl-C: stop now, as uvicorn does
        server.should_exit = True

    server.handle_exit = handle_exit  # type: ignore[method-assign]
    daemon.start()
    log.info("homespec %s starting on %s (config %s)", daemon.version(), address, cfg_file or "defaults: no config.yaml here")
    try:
        server.run()
    finally:
        finished = daemon.shutdown(timeout_s=cfg.server.drain_timeout_s)
        notifier.close()
        log.info("stopped%s", "" if finished else " (a generation was cancelled at the drain timeout)")
    return exit_code
