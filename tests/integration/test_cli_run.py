"""`homespec run` as a real process on the real small models: the README's first command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.test_serve_process import clean_env, write_config

pytestmark = pytest.mark.integration


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    config = write_config(tmp_path, 5)
    return subprocess.run([sys.executable, "-m", "homespec", "run", *args, "--config", str(config)],
                          capture_output=True, text=True, env=clean_env(), cwd=tmp_path, timeout=300)


def test_run_streams_the_answer_to_stdout_and_one_stats_line_to_stderr(tmp_path: Path) -> None:
    p = run(tmp_path, "List the days of the week, one per line.", "--max-tokens", "12")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Monday" in p.stdout, p.stdout
    stats = p.stderr.strip().splitlines()[-1]
    assert stats.startswith("12 tokens · TTFT ") and "finish length" in stats, stats


def test_a_bad_flag_is_one_line_naming_the_field_before_any_model_loads(tmp_path: Path) -> None:
    p = run(tmp_path, "hi", "--temperature", "-1")
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr.strip().splitlines() == ["homespec run: temperature: Input should be greater than or equal to 0"], p.stderr
