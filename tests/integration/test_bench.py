"""`homespec bench` end to end on the real small target: arms, interleaving, the report."""

from __future__ import annotations

import pytest

from homespec.cli.bench import format_report
from homespec.config import Config, ModelRef, ModelsConfig, RuntimeConfig, SpeculationConfig
from homespec.llama.runtime import ReferenceDecoder
from homespec.models.loader import runtime_options
from homespec.serving.bench import BenchPrompt, Workload, load_workloads, parse_arms, run_bench
from homespec.serving.host import Host
from tests.conftest import ROOT, TARGET, require

pytestmark = pytest.mark.integration

CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"


def test_bench_runs_every_arm_on_every_prompt_and_reports_speedups_against_plain():
    cfg = Config(
        models=ModelsConfig(target=ModelRef(path=require(TARGET)), draft=None),
        runtime=RuntimeConfig(n_ctx=512, n_batch=128),
        speculation=SpeculationConfig(k_max=4),  # warm-up times passes over 1..5 tokens only
        base_dir=ROOT,
    )
    edit = Workload("edit", "copy a file", [
        BenchPrompt([{"role": "user", "content": f"Return this file unchanged:\n```python\n{CODE}```"}]),
        BenchPrompt([{"role": "user", "content": f"Rename `w` to `width` in this file:\n```python\n{CODE}```"}]),
    ])
    arms = parse_arms("off,reference,ngram:2,auto")
    log: list[str] = []
    with Host.open(cfg) as session:
        reference = ReferenceDecoder(session.models.target_path, runtime_options(cfg, 0))
        try:
            report = run_bench(session, [edit], arms, max_tokens=8, reference=reference, progress=log.append, rounds=2)
        finally:
            reference.close()

    # Prompt by prompt, every other one in reverse arm order: no arm is always first or last.
    order = [line.split()[2] for line in log]
    forward = ["off", "llama.cpp", "ngram", "auto"]
    assert order == (forward + forward[::-1]) * 2
    assert [line.split()[1] for line in log[::4]] == ["#1", "#2", "#1", "#2"]  # two rounds
    rows = {r.arm: r for r in report.results}
    assert set(rows) == {"off", "llama.cpp", "ngram k=2", "auto"}
    assert all(r.runs == 4 and r.tokens == 32 for r in rows.values())
    assert rows["off"].speedup == pytest.approx(1.0)
    assert rows["ngram k=2"].tally.proposed > 0  # the copy gives ngram something to propose
    assert rows["auto"].tally.steps > 0 and rows["auto"].expected_gain is not None
    assert all(0 <= r.same_as_plain <= 4 for r in rows.values())
    text = format_report(report)
    assert "== edit" in text and "ngram k=2" in text and "create_completion" in text
    assert "ceiling, every drafted token accepted: ngram " in text
    assert "asked first / again, tok/s (÷ off): off " in text  # two rounds: the repeats apart
    assert all(len(r.by_round) == 2 and r.by_round[1][0] == 14 for r in rows.values())  # 2 prompts x 7 decode tokens
    assert report.calibration["target"] and report.prefill["edit"] > 0


def test_json_and_fim_workloads_run_and_jump_forward_is_measured_against_plain():
    cfg = Config(
        models=ModelsConfig(target=ModelRef(path=require(TARGET)), draft=None),
        runtime=RuntimeConfig(n_ctx=1024, n_batch=256),
        speculation=SpeculationConfig(k_max=4),
        base_dir=ROOT,
    )
    workloads = load_workloads(["json", "fim"])
    arms = parse_arms("off,jump-forward,ngram:2,reference")
    with Host.open(cfg) as session:
        reference = ReferenceDecoder(session.models.target_path, runtime_options(cfg, 0))
        try:
            report = run_bench(session, workloads, arms, max_tokens=24, prompts_per_workload=1, reference=reference)
        finally:
            reference.close()
    rows = {(r.workload, r.arm): r for r in report.results}
    # Under a grammar: the baseline decodes token by token, jump-forward takes the forced tokens
    # as drafts, all accepted, and the greedy text is the baseline's.
    assert rows["json", "off"].forced_tokens == 0 and rows["json", "off"].tally.proposed == 0
    jf = rows["json", "jump-forward"]
    assert jf.forced_tokens > 0 and jf.tally.accepted == jf.tally.proposed == jf.forced_tokens
    assert jf.same_as_plain == 1
    assert ("json", "llama.cpp") not in rows  # llama-cpp-python's loop takes no grammar
    # No grammar in fim: no jump-forward arm; the reference arm runs.
    assert ("fim", "jump-forward") not in rows and ("fim", "llama.cpp") in rows
    assert "jump-forward:" in format_report(report)
