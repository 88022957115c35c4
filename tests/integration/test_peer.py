"""The bench's peer arm with the real llama-server (serving/peer.py): it reads the same prompt
tokens as homespec and, greedy and plain, says what homespec's plain decoding says (or differs
only at a near-tie), and its own speculation reports draft counts.

llama-server is built by `homespec bench --peer llama-server` (~10-15 min on 2 cores, cached
per CPU); `make test` does not build it, so these tests run where it has been built (or where
HOMESPEC_PEER_BIN names one) and are skipped, saying so, elsewhere. The protocol itself is
tested without the build in tests/unit/test_peer.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from homespec.serving import peer_build
from homespec.serving.peer import LlamaServer, PeerSetting
from tests.conftest import TARGET, require
from tests.integration.exactness import Recording, encode, first_divergence, margin

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def peer_bin() -> Path:
    path = Path(os.environ["HOMESPEC_PEER_BIN"]) if os.environ.get("HOMESPEC_PEER_BIN") else peer_build.binary()
    if path is None:
        pytest.skip("llama-server not built for this CPU (homespec bench --peer llama-server builds it)")
    return path


@pytest.mark.integration
def test_plain_llama_server_says_what_homespec_plain_decoding_says(peer_bin, target_rt, epsilon) -> None:
    prompt = encode(target_rt, "Write a Python function that checks whether a string is a palindrome.")
    with LlamaServer(peer_bin, require(TARGET), PeerSetting("ls plain"), n_ctx=1024, threads=target_rt.n_threads) as ls:
        run = ls.complete(prompt, MAX_TOKENS)
    assert run.tokens == MAX_TOKENS and run.decode_s > 0 and run.drafted == 0
    rec = Recording(target_rt)
    target_rt.reset()
    row = rec.sync(prompt)[0]  # [vocab]
    ours: list[int] = []
    rows = []
    for _ in range(MAX_TOKENS):  # homespec's plain decoding, one token a pass
        rows.append(row)
        ours.append(int(np.argmax(row)))
        row = rec.eval(ours[-1:], "all")[0]
    if target_rt.detokenize(ours) == run.text:
        return
    theirs = target_rt.tokenize(run.text, add_special=False, parse_special=False)
    j = first_divergence(ours, theirs)
    assert j is not None and margin(rows[j]) < 2 * epsilon, f"llama-server diverged at token {j} without a near-tie"


@pytest.mark.integration
def test_llama_servers_ngram_speculation_reports_its_drafts_on_a_copying_prompt(peer_bin, target_rt) -> None:
    code = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"
    prompt = encode(target_rt, f"Rename w to width and h to height in this code, and output only the code:\n{code}")
    # Its default key is 12 tokens, longer than this example's repeats: 3.
    setting = PeerSetting("ls ngram-simple", ("--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3"))
    with LlamaServer(peer_bin, require(TARGET), setting, n_ctx=1024, threads=target_rt.n_threads) as ls:
        run = ls.complete(prompt, 48)
    assert "width" in run.text and run.drafted > 0 and 0 < run.accepted <= run.drafted
