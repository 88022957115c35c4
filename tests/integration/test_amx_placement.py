"""Where llama.cpp places the target's weights in a build with AMX kernels (cpu_build's
amx-q6k-outside fix): Q6_K weights stay in the plain CPU buffer, where a one-row product is
faster than over AMX's tile layout. Runs only where AMX's buffer is in use."""

from __future__ import annotations

import pytest
from gguf import GGUFReader

from homespec.llama.kernels import amx_buffer_available
from homespec.llama.runtime import Runtime, RuntimeOptions
from tests.conftest import TARGET, require


def test_the_amx_buffer_holds_no_q6k_weights() -> None:
    if not amx_buffer_available():
        pytest.skip("AMX's buffer is not in use here (no AMX kernels in the build, or no tile state granted)")
    path = require(TARGET)
    by_type: dict[str, int] = {}  # bytes in the file, per tensor type
    for t in GGUFReader(path).tensors:
        by_type[t.tensor_type.name] = by_type.get(t.tensor_type.name, 0) + int(t.n_bytes)
    assert by_type.get("Q6_K", 0) > 100 * 2**20  # the Q4_K_M target has ~340 MiB of them
    rt = Runtime(path, RuntimeOptions(n_ctx=256, n_batch=64))
    buffers = rt.weight_buffers  # MiB, as llama.cpp's load reports them
    rt.close()
    assert "AMX" in buffers, f"llama.cpp reported no AMX buffer: {buffers}"
    # The Q4_K matrices (token_embd, a lookup, stays out) repacked for AMX take ~613 MiB; with the
    # Q6_K ones it would be ~950, more than every Q4_K byte of the file.
    assert 0 < buffers["AMX"] * 2**20 <= by_type["Q4_K"]
