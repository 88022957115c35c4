"""`homespec serve` as a real process: start-up, SIGTERM drain, refusal of unsafe binds.

The daemon runs as a subprocess of this interpreter (`python -m homespec serve`), with a config
file that points at the real small models, on a loopback port. Waits are polls with deadlines.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import DRAFT, TARGET, require
from tests.integration.server_fixtures import READY_TIMEOUT_S, free_port, wait_for

pytestmark = pytest.mark.integration

DAYS = "List the days of the week, one per line."
LONG = "Write the numbers from 1 to 500, one per line."
EXIT_MARGIN_S = 60  # after the drain bound: closing the models, interpreter exit, a loaded machine


def write_config(tmp_path: Path, drain_timeout_s: float, **server: object) -> Path:
    cfg = {
        "models": {"target": {"path": str(require(TARGET))}, "draft": {"path": str(require(DRAFT))}},
        "runtime": {"n_ctx": 1024, "n_batch": 256},
        "speculation": {"k_max": 4, "controller": {"warmup_passes": 1}},
        "sampling": {"max_tokens": 64},
        "memory": {"reserve_mib": 0},
        "server": {"drain_timeout_s": drain_timeout_s, "queue_depth": 2, **server},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "HOMESPEC_API_KEY"}
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Daemon:
    """A `homespec serve` subprocess; its output goes to a file (no pipe to fill up)."""

    def __init__(self, tmp_path: Path, config: Path, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "serve.log"
        self._log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "homespec", "serve", "--config", str(config), "--port", str(self.port), *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=clean_env(), cwd=tmp_path,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> None:
        def ready() -> bool:
            if self.proc.poll() is not None:
                raise AssertionError(f"homespec serve exited with {self.proc.returncode}:\n{self.log()[-3000:]}")
            try:
                return httpx.get(f"{self.url}/ready", timeout=5).status_code == 200
            except httpx.TransportError:
                return False

        try:
            wait_for(ready, READY_TIMEOUT_S, "/ready to turn true", interval_s=0.25)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.log()[-3000:]}") from None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=60)
        self._log.close()


@pytest.fixture
def start(tmp_path: Path) -> Iterator:
    started: list[Daemon] = []

    def _start(config: Path, *args: str) -> Daemon:
        d = Daemon(tmp_path, config, *args)
        started.append(d)
        return d

    yield _start
    for d in started:
        d.close()


def chat(prompt: str, max_tokens: int, stream: bool = False) -> dict:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": stream,
        "homespec": {"speculation": "off"},
    }


def read_until_content(lines: Iterator[str]) -> list[dict]:
    """Events up to and including the first one that carries text."""
    events = []
    for line in lines:
        if line.startswith("data:"):
            ev = json.loads(line[5:])
            events.append(ev)
            if ev["choices"] and ev["choices"][0]["delta"].get("content"):
                return events
    raise AssertionError(f"the stream ended before any text: {events}")


def read_rest(lines: Iterator[str]) -> list:
    out: list = []
    for line in lines:
        if line.startswith("data:"):
            data = line[5:].strip()
            out.append("[DONE]" if data == "[DONE]" else json.loads(data))
    return out


def text_of(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e != "[DONE]" and e["choices"])


def refused(url: str) -> bool:
    """A new request is turned away: connection refused/closed, or a 503 with an error object."""
    try:
        r = httpx.post(f"{url}/v1/chat/completions", json=chat(DAYS, 2), timeout=30)
    except httpx.TransportError:
        return True
    assert r.status_code == 503, f"a request after SIGTERM was answered {r.status_code}: {r.text}"
    assert r.json()["error"]["code"] in ("shutting_down", "not_ready"), r.text
    return True


def test_sigterm_lets_the_inflight_stream_finish_refuses_new_work_and_exits_0(tmp_path: Path, start) -> None:
    drain_s = 240  # far more than the stream needs: the property is "it completes"
    d = start(write_config(tmp_path, drain_s))
    d.wait_ready()
    with httpx.Client(base_url=d.url, timeout=300) as c:
        whole = c.post("/v1/chat/completions", json=chat(DAYS, 16))
        assert whole.status_code == 200, whole.text
        want = whole.json()["choices"][0]["message"]["content"]
        with c.stream("POST", "/v1/chat/completions", json=chat(DAYS, 16, stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            head = read_until_content(lines)
            d.proc.send_signal(signal.SIGTERM)  # mid-stream
            assert refused(d.url)
            tail = read_rest(lines)
    assert tail and tail[-1] == "[DONE]", tail[-3:]
    finish = [e["choices"][0]["finish_reason"] for e in tail if e != "[DONE]" and e["choices"]]
    assert finish[-1] in ("stop", "length")
    assert text_of(head + tail) == want  # the whole answer, not a cut one
    assert d.proc.wait(timeout=drain_s + EXIT_MARGIN_S) == 0, d.log()[-3000:]
    log = d.log()
    assert "draining" in log and "homespec.serve: stopped" in log and "Traceback" not in log, log[-3000:]


def test_sigterm_ends_a_stream_longer_than_the_drain_bound_cleanly_and_exits_0(tmp_path: Path, start) -> None:
    drain_s = 3
    d = start(write_config(tmp_path, drain_s))
    d.wait_ready()
    with httpx.Client(base_url=d.url, timeout=300) as c:
        with c.stream("POST", "/v1/chat/completions", json=chat(LONG, 400, stream=True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            read_until_content(lines)
            d.proc.send_signal(signal.SIGTERM)
            tail = read_rest(lines)  # a transport error here would be the old mid-chunk cut
    # 400 tokens take far longer than 3 s on a CPU: the stream was cut, and says so, then [DONE].
    assert tail[-1] == "[DONE]", tail[-3:]
    assert tail[-2]["error"]["code"] == "shutting_down", tail[-3:]
    assert d.proc.wait(timeout=drain_s + EXIT_MARGIN_S) == 0, d.log()[-3000:]
    log = d.log()
    assert log.count("stream cut at the drain timeout") == 1 and "homespec.serve: stopped" in log, log[-3000:]
    assert "Traceback" not in log and "timeout graceful shutdown exceeded" not in log, log[-3000:]


def test_a_model_that_cannot_load_exits_78_and_the_start_line_names_the_found_config(tmp_path: Path) -> None:
    config = write_config(tmp_path, 5)
    raw = yaml.safe_load(config.read_text())
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + b"\x00garbage" * 100)
    raw["models"]["target"]["path"] = str(bad)
    config.write_text(yaml.safe_dump(raw))
    # No --config: ./config.yaml is found in the working directory.
    p = subprocess.run(
        [sys.executable, "-m", "homespec", "serve", "--port", str(free_port())],
        capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=300,
    )
    assert p.returncode == 78, p.stderr[-3000:]  # EX_CONFIG: the unit's RestartPreventExitStatus=
    assert "(config config.yaml)" in p.stderr, p.stderr[-3000:]


def test_non_loopback_bind_without_api_key_is_refused_with_one_line_and_exit_2(tmp_path: Path) -> None:
    config = write_config(tmp_path, 5)
    p = subprocess.run(
        [sys.executable, "-m", "homespec", "serve", "--config", str(config), "--host", "0.0.0.0", "--port", str(free_port())],
        capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=120,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
    assert lines[0].startswith("homespec serve:") and "API key" in lines[0], lines[0]


def test_missing_model_file_is_refused_at_start_with_one_line_and_exit_2(tmp_path: Path) -> None:
    config = write_config(tmp_path, 5)
    raw = yaml.safe_load(config.read_text())
    raw["models"]["target"]["path"] = str(tmp_path / "nope.gguf")
    config.write_text(yaml.safe_dump(raw))
    p = subprocess.run(
        [sys.executable, "-m", "homespec", "serve", "--config", str(config), "--port", str(free_port())],
        capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=120,
    )
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in p.stderr and "nope.gguf" in lines[0], p.stderr


def test_a_restarted_daemon_reads_the_prompts_of_its_last_run_from_disk(tmp_path: Path, start, monkeypatch) -> None:
    """memory.prefix_cache_persist: what the prefix cache held at SIGTERM comes back at the next
    start, so an app's long system prompt is not read again after an update or a reboot."""
    monkeypatch.setenv("HOMESPEC_STATE_DIR", str(tmp_path / "state"))
    config = write_config(tmp_path, 20)
    system = "You control the lights of a house with twelve rooms. " * 20
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": DAYS}], "max_tokens": 8,
            "homespec": {"speculation": "off"}}
    answers = []
    for run in range(2):
        d = start(config)
        d.wait_ready()
        r = httpx.post(f"{d.url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        answers.append(r.json())
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(timeout=20 + EXIT_MARGIN_S) == 0, d.log()[-3000:]
        log = d.log()
        assert "kept for the next start" in log and "Traceback" not in log, log[-3000:]
        assert ("read back" in log) == (run == 1), log[-3000:]
    usage = [a["usage"] for a in answers]
    assert usage[0]["prompt_tokens_details"]["cached_tokens"] == 0, usage
    assert usage[1]["prompt_tokens_details"]["cached_tokens"] == usage[1]["prompt_tokens"] - 1, usage
