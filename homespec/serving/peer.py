"""llama-server as a peer in the bench: the same model, the same prompt tokens, its own
speculative decoding, timed by the definition homespec's arms use.

Each peer arm is one llama-server process on loopback (one slot; the same context length and
threads as homespec). A prompt goes in as token ids through `/completion`, so both servers read
exactly the same tokens whatever their chat templates do. Before the timed request the prompt is
read once with one output token (not timed), as homespec's arms start from a primed cache;
llama-server then re-reads the prompt's last token, which is the one pass homespec's first
token costs too.

Decode speed is llama-server's own `timings`: output tokens after the first over the time after
the first (`predicted_per_second`, server-side), the same quantity as the bench's tok/s.
Time to first token is taken by the client.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from homespec.errors import PeerError
from homespec.llama.hugepages import environ_with_huge_pages

START_TIMEOUT_S = 120.0  # loading a 1.5B model takes seconds; a wedged start is reported


@dataclass(frozen=True)
class PeerSetting:
    """One way to run llama-server: its name in reports and the speculation arguments."""

    name: str
    args: tuple[str, ...] = ()


def peer_settings(draft_path: Path | None) -> list[PeerSetting]:
    """llama-server plain, with its two draftless proposers, and with the draft model: each at
    llama-server's own defaults, as a user would run it, and the two that its defaults size for
    long repeats also tuned for a 2-core CPU (our claims stand next to its best, not its default)."""
    settings = [
        PeerSetting("ls plain"),
        PeerSetting("ls ngram-simple", ("--spec-type", "ngram-simple")),
        # A 3-token key (default 12) finds the short repeats of code and chat.
        PeerSetting("ls ngram-simple/3", ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3")),
        PeerSetting("ls ngram-mod", ("--spec-type", "ngram-mod")),
    ]
    if draft_path is not None:
        # The type must be named: without it llama-server looks for a sidecar head in the draft's
        # metadata and, finding none, does not speculate at all.
        draft = ("--spec-type", "draft-simple", "--spec-draft-model", str(draft_path))
        settings.append(PeerSetting("ls draft", draft))
        # At most 4 drafted tokens (default 16): a CPU's verify pass grows with every row.
        settings.append(PeerSetting("ls draft/4", (*draft, "--spec-draft-n-max", "4")))
    return settings


def select_settings(spec: str | None, available: Sequence[PeerSetting]) -> list[PeerSetting]:
    """'plain,ngram-mod' (names without the "ls " of reports) -> those settings; None: all."""
    if spec is None:
        return list(available)
    by_name = {s.name.removeprefix("ls "): s for s in available}
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in by_name]
    if unknown:
        raise PeerError(f"peer settings: unknown {', '.join(unknown)} (choose from {', '.join(by_name)})")
    return [by_name[w] for w in wanted]


@dataclass
class PeerRun:
    tokens: int  # completion tokens (llama-server's predicted_n)
    ttft_s: float  # client-side: request sent -> first content
    decode_s: float  # server-side: time after the first token (predicted_ms)
    client_decode_s: float  # client-side: first content -> last chunk
    text: str
    drafted: int = 0
    accepted: int = 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """A llama-server process for the life of a `with` block."""

    def __init__(self, binary: Path, model: Path, setting: PeerSetting, n_ctx: int, threads: int,
                 parallel: int = 1, extra: Sequence[str] = ()) -> None:
        self.setting = setting
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [
            str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(self.port),
            "-c", str(n_ctx * parallel), "-np", str(parallel), "-t", str(threads), "-tb", str(threads),
            "--no-webui", *setting.args, *extra,
        ]
        self._log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        self._proc: subprocess.Popen | None = None
        self.keep_log = False
        # A connection per request: llama-server (cpp-httplib) drops idle keep-alive connections
        # after 5 s, and a request sent on one it is dropping fails without an answer (seen).
        self._client = httpx.Client(base_url=self.url, timeout=httpx.Timeout(600, connect=5),
                                    limits=httpx.Limits(max_keepalive_connections=0))

    def __enter__(self) -> LlamaServer:
        # The memory homespec runs with: huge pages asked for (llama/hugepages.py; ~10 % of a
        # decode step for either server on a 2-core Xeon VM).
        self._proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=environ_with_huge_pages())
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                why = f"llama-server ({self.setting.name}) exited {self._proc.returncode}:\n{self.log_tail()}"
                self.close()
                raise PeerError(why)
            try:
                if self._client.get("/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        why = f"llama-server ({self.setting.name}) not ready after {START_TIMEOUT_S:.0f} s:\n{self.log_tail()}"
        self.close()
        raise PeerError(why)

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._client.close()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._log.close()
        if not self.keep_log:
            try:
                os.unlink(self._log.name)
            except OSError:
                pass

    def log_tail(self, lines: int = 15) -> str:
        self._log.flush()
        return "\n".join(Path(self._log.name).read_text(errors="replace").splitlines()[-lines:])

    def complete(self, tokens: Sequence[int], max_tokens: int) -> PeerRun:
        """Greedy completion of `tokens`, streamed; the prompt is read first, untimed."""
        body = {"prompt": list(tokens), "temperature": 0.0, "cache_prompt": True, "stream": True}
        self._stream({**body, "n_predict": 1})  # prime the slot's cache with the prompt
        return self._stream({**body, "n_predict": max_tokens})

    def _stream(self, body: dict) -> PeerRun:
        try:
            return self._timed(body)
        except httpx.TransportError as e:
            self.keep_log = True  # a crash's log outlives the process, for whoever reads the error
            raise PeerError(f"llama-server ({self.setting.name}) failed mid-request ({type(e).__name__}; "
                                 f"exit status {self._proc.poll() if self._proc else None}); log {self._log.name}:\n"
                                 f"{self.log_tail()}") from e

    def _timed(self, body: dict) -> PeerRun:
        t0 = time.perf_counter()
        first = last = None
        text: list[str] = []
        final: dict = {}
        with self._client.stream("POST", "/completion", json=body) as r:
            if r.status_code != 200:
                raise PeerError(f"llama-server ({self.setting.name}) answered {r.status_code}: {r.read()[:300]!r}")
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("content"):
                    text.append(chunk["content"])
                    first = first if first is not None else now
                last = now
                if chunk.get("stop"):
                    final = chunk
        timings = final.get("timings") or {}
        n = int(timings.get("predicted_n", final.get("tokens_predicted", 0)))
        first = first if first is not None else (last or t0)
        return PeerRun(
            tokens=n, ttft_s=first - t0, decode_s=float(timings.get("predicted_ms", 0.0)) / 1000,
            client_decode_s=(last or first) - first, text="".join(text),
            drafted=int(timings.get("draft_n", 0)), accepted=int(timings.get("draft_n_accepted", 0)),
        )
