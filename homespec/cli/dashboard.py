"""`homespec dashboard [--url URL] [--api-key KEY]`: live terminal view of a running daemon.

Only argparse and os at module level; Textual and httpx are imported inside `main`.
"""

from __future__ import annotations

import argparse
import os
from urllib.parse import urlsplit

from homespec.errors import UserError

DEFAULT_URL = "http://127.0.0.1:8321"  # the daemon's default address (same as dashboard.client)
API_KEY_ENV = "HOMESPEC_API_KEY"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"the daemon's address (default {DEFAULT_URL})")
    p.add_argument(
        "--api-key",
        default=None,
        help=f"the daemon's API key (default: ${API_KEY_ENV}; none if unset)",
    )
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls (default 1)")


def resolve_api_key(flag: str | None, env: dict[str, str] | os._Environ = os.environ) -> str | None:
    """--api-key, else $HOMESPEC_API_KEY, else no key."""
    return flag or env.get(API_KEY_ENV) or None


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UserError(f"--url {url!r} is not an http(s) address; e.g. {DEFAULT_URL}")
    return url


def main(args: argparse.Namespace) -> int:
    if not 0.1 <= args.interval <= 60:
        raise UserError(f"--interval {args.interval:g} is outside 0.1..60 seconds")
    url = check_url(args.url)
    from homespec.dashboard.app import DashboardApp

    DashboardApp(url, resolve_api_key(args.api_key), poll_s=args.interval).run()
    return 0
