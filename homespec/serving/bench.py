"""Benchmark protocol (DESIGN.md, "Measuring"): every arm sees the same target, prompts,
sampling (greedy), output length and warm state, interleaved prompt by prompt (and the arms'
order reversed every other prompt) so that drift of a shared machine hits every arm alike.
Speedups are ratios within one run.

Warm state: for each prompt the target's KV cache is primed once with the prompt (not timed),
and every arm starts from it, so the target's prefill — identical for all arms — is reported
once per workload and TTFT shows what an arm adds (the draft model's own prefill). The draft's
cache is cleared before each arm so that it pays its prefill honestly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any

import numpy as np
import psutil
import yaml

from homespec.errors import PeerError
from homespec.models.loader import ModelSet
from homespec.serving.host import Host
from homespec.serving.peer import LlamaServer, PeerSetting
from homespec.serving.tool_calls import call_grammar, tool_format
from homespec.speculation.constraints import Grammar, json_schema_grammar
from homespec.speculation.controller import Controller
from homespec.speculation.costs import expected_emitted
from homespec.speculation.engine import FORCED, OFF, Decision, FixedPolicy, GenerationStats, SpeculationPolicy, StepStats, StepTally
from homespec.speculation.proposers.base import Proposer
from homespec.speculation.proposers.ngram_memory import NgramMemory
from homespec.speculation.sampling import SamplingParams

WORKLOADS = ("code", "edit", "chat", "json", "fim")
PEER = "peer"  # an arm run by llama-server (serving/peer.py)


@dataclass(frozen=True)
class BenchPrompt:
    """A chat (messages, optionally with tools or a JSON schema) or a fill-in-the-middle."""

    messages: list[dict[str, str]] = field(default_factory=list)
    fim: tuple[str, str] | None = None  # (prefix, suffix) around the cursor
    tools: list[dict[str, Any]] | None = None  # OpenAI function definitions
    tool_choice: str = "auto"
    schema: dict[str, Any] | None = None  # the answer's JSON schema

    def encode(self, models: ModelSet) -> list[int]:
        if self.fim is not None:
            return models.encode_infill(*self.fim, n_predict=128)
        defs = [{"type": "function", "function": t} for t in self.tools] if self.tools else None
        return models.encode_chat(self.messages, tools=defs)

    def grammar(self, models: ModelSet) -> str | None:
        if self.schema is not None:
            return json_schema_grammar(self.schema)
        fmt = tool_format(models.template.source) if self.tools else None
        if self.tools and fmt is not None:
            return call_grammar(fmt, {t["name"]: t.get("parameters") or {} for t in self.tools}, self.tool_choice, True)
        return None


@dataclass(frozen=True)
class Workload:
    name: str
    description: str
    prompts: list[BenchPrompt]


def load_workloads(names: Sequence[str] = WORKLOADS) -> list[Workload]:
    out = []
    for name in names:
        raw = yaml.safe_load(resources.files("homespec.bench_prompts").joinpath(f"{name}.yaml").read_text())
        prompts = []
        for p in raw["prompts"]:
            if "prefix" in p:
                prompts.append(BenchPrompt(fim=(p["prefix"], p["suffix"])))
                continue
            messages = ([{"role": "system", "content": p["system"]}] if p.get("system") else []) + [{"role": "user", "content": p["user"]}]
            prompts.append(BenchPrompt(messages, tools=p.get("tools"), tool_choice=p.get("tool_choice", "auto"), schema=p.get("schema")))
        out.append(Workload(raw["name"], raw["description"], prompts))
    return out


@dataclass(frozen=True)
class Arm:
    name: str
    mode: str  # a Mode (off, auto, a proposer), "reference" (llama-cpp-python's own loop) or "peer" (llama-server)
    k: int = 0
    # Under a grammar, take its forced tokens as free drafts. Off for the baseline (plain
    # decoding, one token a pass) so that "jump-forward" (off with them) shows what they add.
    jump_forward: bool = True


JUMP_FORWARD = Arm("jump-forward", "off", 0, True)  # only on workloads with a grammar


def default_arms(proposers: Sequence[str], reference: bool = True) -> list[Arm]:
    arms = [Arm("off", "off", jump_forward=False), JUMP_FORWARD]
    if reference:
        arms.append(Arm("llama.cpp", "reference"))
    if "draft" in proposers:
        arms += [Arm(f"draft k={k}", "draft", k) for k in (1, 2, 4)]
    arms += [Arm(f"ngram k={k}", "ngram", k) for k in (2, 4, 8)]
    if "mtp" in proposers:
        arms += [Arm(f"mtp k={k}", "mtp", k) for k in (1, 2, 4)]
    arms.append(Arm("auto", "auto"))
    return arms


def peer_arms(settings: Sequence[PeerSetting]) -> list[Arm]:
    return [Arm(s.name, PEER) for s in settings]


def parse_arms(spec: str) -> list[Arm]:
    """'off,draft:2,ngram:4,auto,reference' -> arms."""
    arms = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        mode, _, k = item.partition(":")
        mode = {"llama.cpp": "reference"}.get(mode, mode)
        if mode == "jump-forward":
            arms.append(JUMP_FORWARD)
            continue
        name = {"off": "off", "reference": "llama.cpp", "auto": "auto"}.get(mode, f"{mode} k={k}")
        arms.append(Arm(name, mode, int(k) if k else 0, jump_forward=mode != "off"))
    return arms


@dataclass
class Run:
    """One arm on one prompt."""

    tokens: int  # completion tokens
    seconds: float  # wall time of the whole generation (prompt primed)
    ttft_s: float
    text: str
    steps: list[StepStats] = field(default_factory=list)
    rss_mib: float = 0.0
    expected_gain: float | None = None  # auto: the controller's mean expectation
    drafted: int = 0  # peer arms: llama-server's own draft counts (homespec's are in `steps`)
    accepted: int = 0


@dataclass
class ArmResult:
    arm: str
    workload: str
    runs: int = 0
    tokens: int = 0
    seconds: float = 0.0
    decode_tokens: int = 0
    decode_s: float = 0.0
    ttft_s: list[float] = field(default_factory=list)
    rss_mib: float = 0.0
    same_as_plain: int = 0
    forced_tokens: int = 0  # output tokens that came as a grammar's forced drafts
    drafted: int = 0  # peer arms
    accepted: int = 0
    tally: StepTally = field(default_factory=StepTally)
    expected_gain: float | None = None
    # [round] [decode tokens, decode seconds]: round 0 asks each prompt for the first time, later
    # rounds ask it again (an arm with a memory of answers drafts its own earlier answer there).
    by_round: list[list[float]] = field(default_factory=list)
    # Filled in by finish():
    tok_s: float | None = None  # decode tokens/s (after the first token)
    e2e_tok_s: float | None = None  # completion tokens / whole generation time
    speedup: float | None = None  # tok_s / plain tok_s
    acceptance_rate: float | None = None
    acceptance_length: float | None = None
    draft_ms: float | None = None  # per step
    verify_ms: float | None = None  # per step

    def add(self, run: Run, plain_text: str | None, round_no: int = 0) -> None:
        decode_tokens, decode_s = max(run.tokens - 1, 0), run.seconds - run.ttft_s  # after the first token
        self.runs += 1
        self.tokens += run.tokens
        self.seconds += run.seconds
        self.decode_tokens += decode_tokens
        self.decode_s += decode_s
        while len(self.by_round) <= round_no:
            self.by_round.append([0.0, 0.0])
        self.by_round[round_no][0] += decode_tokens
        self.by_round[round_no][1] += decode_s
        self.ttft_s.append(run.ttft_s)
        self.rss_mib = max(self.rss_mib, run.rss_mib)
        self.same_as_plain += plain_text is not None and run.text == plain_text
        self.drafted += run.drafted
        self.accepted += run.accepted
        for s in run.steps:
            self.tally.add(s)
            self.forced_tokens += s.accepted if s.proposer == FORCED else 0

    def round_tok_s(self, round_no: int) -> float | None:
        """Decode tokens/s of the runs in one round (0: each prompt asked for the first time)."""
        if round_no >= len(self.by_round):
            return None
        tokens, seconds = self.by_round[round_no]
        return tokens / seconds if seconds > 0 else None

    def finish(self, plain_tok_s: float | None) -> None:
        t = self.tally
        self.tok_s = self.decode_tokens / self.decode_s if self.decode_s > 0 else None
        self.e2e_tok_s = self.tokens / self.seconds if self.seconds > 0 else None
        if self.tok_s and plain_tok_s:
            self.speedup = self.tok_s / plain_tok_s
        self.acceptance_rate = t.acceptance_rate if t.steps else (self.accepted / self.drafted if self.drafted else None)
        self.acceptance_length = t.acceptance_length
        if t.steps:
            self.draft_ms = 1000 * t.draft_s / t.steps
            self.verify_ms = 1000 * t.verify_s / t.steps


class _Recorder(FixedPolicy):
    """A fixed policy that keeps the steps, for per-arm statistics."""

    def __init__(self, proposer: Proposer | None, k: int, steps: list[StepStats]) -> None:
        super().__init__(proposer, k)
        self.steps = steps

    def observe(self, step: StepStats) -> None:
        self.steps.append(step)


class _AutoRecorder:
    """Wraps the shared controller: records steps and the gain it expected for each."""

    def __init__(self, controller: Controller, steps: list[StepStats], expected: list[float]) -> None:
        self.c, self.steps, self.expected = controller, steps, expected

    def begin(self, prompt: Sequence[int], sampled: bool, alongside: int = 0, tokens_left: int | None = None) -> list[Proposer]:
        return self.c.begin(prompt, sampled, alongside, tokens_left)

    def decide(self, context: Sequence[int], alongside: int = 0) -> Decision:
        d = self.c.decide(context, alongside)
        gains = self.c.view.gains.get(d.name)
        self.expected.append(gains[d.k - 1] if d.k and gains else 1.0)
        return d

    def offer(self, context: Sequence[int]) -> None:
        return None  # runs alone: it decides each step itself

    def observe(self, step: StepStats) -> None:
        self.c.observe(step)
        self.steps.append(step)

    def end(self, context: Sequence[int], gaps: Sequence[float] = ()) -> None:
        self.c.end(context, gaps)


def predicted_gain(controller: Controller, proposer: str, k: int, position_acceptance: Sequence[float]) -> float | None:
    """What the cost model predicts for a fixed arm, given the acceptance that arm saw: a check
    of the model the controller decides with."""
    if proposer == OFF or k == 0 or not controller.cost.calibrated():
        return None
    rates = np.zeros(k)
    n = min(k, len(position_acceptance))
    rates[:n] = position_acceptance[:n]
    emitted = expected_emitted(rates)[k]
    seconds = controller.cost.verify(k + 1) + controller.cost.propose(proposer, k)
    return float(emitted / seconds * controller.cost.verify(1))


@dataclass
class BenchReport:
    machine: dict
    config: dict
    prefill: dict[str, float]  # workload -> target prefill tokens/s
    results: list[ArmResult]
    calibration: dict
    failed: dict[str, str] = field(default_factory=dict)  # arm -> why it stopped (a peer that crashed)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, default=float)


def run_bench(
    session: Host,
    workloads: Sequence[Workload],
    arms: Sequence[Arm],
    max_tokens: int,
    prompts_per_workload: int | None = None,
    reference=None,  # runtime.ReferenceDecoder | None
    progress: Callable[[str], None] = lambda s: None,
    rounds: int = 1,
    peers: Mapping[str, LlamaServer] | None = None,  # arm name -> a running llama-server
) -> BenchReport:
    """Each arm on each prompt, `rounds` times over (more rounds: less noise, proportionally longer)."""
    models = session.models
    proc = psutil.Process()
    greedy = SamplingParams(temperature=0.0)
    results: list[ArmResult] = []
    prefill: dict[str, float] = {}
    failed: dict[str, str] = {}  # peer arm -> why it stopped
    # Each arm drafts only from answers it gave itself (prompt lookup's memory of earlier
    # requests), as each llama-server arm has only its own ngram-mod pool: an arm that read the
    # answer another arm just gave to the same prompt would be measuring that arm, not itself.
    shared_memory = session.ngram_memory
    memories = {a.name: NgramMemory(shared_memory.capacity) for a in arms} if shared_memory is not None else {}
    for wl in workloads:
        by_arm = {a.name: ArmResult(a.name, wl.name) for a in arms}
        prefill_tokens, prefill_s = 0, 0.0
        prompts = wl.prompts[:prompts_per_workload]
        for n, (i, prompt) in enumerate((i, p) for _ in range(rounds) for i, p in enumerate(prompts)):
            tokens = prompt.encode(models)
            grammar = prompt.grammar(models)
            models.target.reset()
            t0 = time.perf_counter()
            models.target.sync(tokens)  # prime: every arm starts with the prompt cached
            prefill_s += time.perf_counter() - t0
            prefill_tokens += len(tokens)
            if reference is not None and grammar is None:
                # Prime its cache alike. Two tokens, not one: with exactly the prompt cached,
                # llama-cpp-python samples the first token from saved logits without a pass,
                # which would hand it one pass for free against every other arm.
                reference.complete(tokens, 2)
            # Every other prompt runs the arms in reverse: a drift of the machine's pace within
            # one prompt's arms (minutes) then favours no arm for being first or last.
            runs: dict[str, Run] = {}
            for arm in arms if n % 2 == 0 else arms[::-1]:
                # llama-cpp-python's loop takes no grammar, nor does llama-server take ours (llguidance
                # Lark; its build has no llguidance); jump-forward is off without one.
                if (arm.mode in ("reference", PEER) and grammar is not None) or (arm == JUMP_FORWARD and grammar is None):
                    continue
                if arm.mode == PEER:
                    if arm.name in failed:
                        continue
                    try:
                        run = runs[arm.name] = _run_peer(peers[arm.name], tokens, max_tokens)
                    except PeerError as e:  # the peer crashed: the bench goes on without it
                        failed[arm.name] = str(e)
                        progress(str(e))
                        continue
                else:
                    session.use_ngram_memory(memories.get(arm.name))
                    run = runs[arm.name] = _run_arm(session, arm, tokens, greedy, max_tokens, reference, grammar)
                run.rss_mib = proc.memory_info().rss / 2**20
                progress(f"{wl.name} #{i + 1} {arm.name:15s} {run.tokens:4d} tok {run.seconds:6.2f} s")
            plain_text = runs[OFF].text if OFF in runs else None  # the baseline arm, by name
            for arm in (a for a in arms if a.name in runs):
                run, r = runs[arm.name], by_arm[arm.name]
                r.add(run, plain_text if arm.name != OFF else None, n // len(prompts))
                if run.expected_gain is not None:
                    r.expected_gain = run.expected_gain if r.expected_gain is None else (r.expected_gain * (r.runs - 1) + run.expected_gain) / r.runs
        prefill[wl.name] = prefill_tokens / prefill_s if prefill_s else 0.0
        plain = by_arm.get(OFF)
        if plain:
            plain.finish(None)
        for r in by_arm.values():
            r.finish(plain.tok_s if plain else None)
            if r.expected_gain is None:
                arm = next(a for a in arms if a.name == r.arm)
                r.expected_gain = predicted_gain(session.controller, arm.mode, arm.k, r.tally.position_acceptance)
        results.extend(r for r in by_arm.values() if r.runs)
    session.use_ngram_memory(shared_memory)
    return BenchReport(
        machine={"cpu_threads": models.target.n_threads, "cpus": psutil.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1)},
        config={"target": models.target_name, "draft": models.draft_name, "max_tokens": max_tokens, "n_ctx": models.target.n_ctx},
        prefill=prefill,
        results=results,
        calibration={k: {str(n): s for n, s in v.items()} for k, v in session.calibration.items()},
        failed=failed,
    )


def _run_peer(peer: LlamaServer, tokens: list[int], max_tokens: int) -> Run:
    r = peer.complete(tokens, max_tokens)
    return Run(r.tokens, r.ttft_s + r.decode_s, r.ttft_s, r.text, drafted=r.drafted, accepted=r.accepted)


def _run_arm(session: Host, arm: Arm, tokens: list[int], params: SamplingParams, max_tokens: int, reference,
             grammar: str | None = None) -> Run:
    models = session.models
    if arm.mode == "reference":
        text, n, seconds = reference.complete(tokens, max_tokens)
        # No stream: TTFT is taken as one plain pass, the first token's cost with a primed prompt.
        return Run(n, seconds, seconds / max(n, 1), text)
    if models.draft is not None:
        models.draft.reset()  # the draft pays its prefill in every arm that uses it
    steps: list[StepStats] = []
    expected: list[float] = []
    policy: SpeculationPolicy
    if arm.mode == "auto":
        policy = _AutoRecorder(session.controller, steps, expected)
    else:
        proposer = session.controller.proposer(arm.mode) if arm.mode != OFF and arm.k > 0 else None
        policy = _Recorder(proposer, arm.k, steps)
    st = GenerationStats()
    target = models.target
    g = Grammar(grammar, target.grammar_tokenizer(), target.n_vocab, max_forced=session.k_limit if arm.jump_forward else 0) if grammar else None
    t0 = time.perf_counter()
    text = "".join(ev.text for ev in session.engine.generate(tokens, params, max_tokens, (), policy, st, g))
    seconds = time.perf_counter() - t0
    return Run(st.completion_tokens, seconds, st.ttft_s, text, steps, expected_gain=float(np.mean(expected)) if expected else None)
