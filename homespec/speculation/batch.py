"""Several generations decoded together: each round packs every running generation's next target
pass (its last token plus its draft, or a chunk of its prompt) into one llama_decode.

The engine yields its passes (target.Pass) instead of running them; this driver collects one from
each generation, runs them as one batch through `eval_many` (llama/runtime.py: per-sequence ids
and positions in one llama_decode), and sends each generation its own rows. Verification,
sampling and stop conditions stay inside each generation, so exactness is per request, as alone.

A prompt is prefilled in chunks of at most `prefill_chunk` tokens per round, oldest request first,
beside the running decodes: a 1,000-token prompt takes ~6 s to read on 2 cores, and in one piece
it would stall every other request for that long. Alone in its pass, it is read in chunks of
`prefill_chunk_alone`, fewer passes, each of which costs a little beyond its rows; but in chunks
of `prefill_chunk` still once a request of higher priority has come, since one may come again
and would wait for the pass in flight.

The steps of a pass are chosen together (`plan`, Controller.plan): after a pass, each generation
that goes on decoding offers its next step (engine.Ask: plain, or each proposer at each draft
length, with their expected tokens and drafting time), and once all have, the plan picks the
steps that make the next pass most productive, priced as the target runs it (`graphs`,
Runtime.graphs). Decided one request at a time instead, each request's draft is worth only what
its rows add beside the others', and a request cannot know whether the others will draft too.
A generation alone in the batch decides alone, as it does outside one.

Narrow passes (`max_rows`, exact mode): a row's logits are the same in any decode pass on
llama.cpp's reference kernels, or, without them, below ggml's tiled-matmul threshold
(llama/kernels.py), so decode steps share a pass only up to max_rows rows together, those that
waited longest first, and a prompt is read in passes of its own (its kernels), cut at
n_batch as a lone request's prompt is, taking turns with the decode rounds of its priority (a
prompt of lower priority waits until no higher decode runs: a chunk of n_batch tokens holds the
pass for seconds). Every request then computes exactly the rows it would compute alone. With a
KV stream per sequence (the default; exact mode needs it) llama.cpp runs a pass as one graph per
run of neighbouring slots with steps of equal length (runtime.py eval_many). A narrow pass
often holds steps of unequal length, so its time is no measure of one pass of its rows and
teaches the cost model nothing; nor, with streams (`split_steps`), does a wide pass of steps of
unequal length: the plan prices each of its graphs, and the shared curve learns from passes of
one graph. Narrow passes are not planned: each request decides beside the rows the others bring
(`Beside.rows`), and the controller prices a draft that splits the pass as the pass of its own
it makes (controller.py, split_steps).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from homespec.speculation.engine import Ask, Beside, Decision, Event, Steps
from homespec.speculation.target import Output, Pass, Target

# (target, tokens, output) per part -> logits per part; Runtime.eval_many.
EvalMany = Callable[[Sequence[tuple[Target, Sequence[int], Output]]], list[np.ndarray]]
# (target, rows) per part -> the graphs the pass runs as, (sequences, rows) each; Runtime.graphs.
Graphs = Callable[[Sequence[tuple[Target, int]]], Sequence[tuple[int, int]]]
# The offers of the requests asking (Ask.offer), and graphs(rows) of the next pass when they bring
# rows[i] each -> a Decision each; Controller.plan.
Plan = Callable[[Sequence[object], Callable[[Sequence[int]], Sequence[tuple[int, int]]]], list[Decision]]
# Takes a generation's event as soon as it is produced; may remove() that generation (its
# client left). An exception it raises ends that generation alone, as one of its own would.
Deliver = Callable[[Hashable, Event], None]


@dataclass
class _Running:
    key: Hashable
    steps: Steps
    priority: int
    order: int  # admission order: among equal priorities, the older request's prompt goes first
    pending: Pass | None = None
    asking: Ask | None = None  # its next step waits for the round's plan (Batch._plan)
    done: int = 0  # tokens of `pending` already evaluated (a prompt read in chunks)
    waited: int = 0  # rounds its decode step was left out of (narrow passes)
    rows: list[np.ndarray] = field(default_factory=list)  # logits of those chunks (output "all")


@dataclass
class RoundStats:
    rows: int  # tokens in the pass
    sequences: int  # generations in it
    prefill_rows: int  # of which prompt chunks
    seconds: float


class Batch:
    """The running generations of one target; not thread-safe (the daemon's worker drives it)."""

    def __init__(self, eval_many: EvalMany, n_batch: int, prefill_chunk: int, max_rows: int | None = None,
                 split_steps: bool = False, plan: Plan | None = None, graphs: Graphs | None = None,
                 prefill_chunk_alone: int | None = None, top_priority: int | None = None) -> None:
        self.eval_many = eval_many
        # Wide passes: the steps of the requests in the next pass are chosen together (plan),
        # priced as the target runs them (graphs). None: each request decides its own.
        self.plan = plan if max_rows is None and graphs is not None else None
        self.graphs = graphs
        self.n_batch = n_batch  # tokens per llama_decode at most
        self.prefill_chunk = prefill_chunk  # prompt tokens per round at most (all prompts together)
        # ... with no decode in the pass, and no request of higher priority seen (None: prefill_chunk)
        self.prefill_chunk_alone = prefill_chunk_alone or prefill_chunk
        # The highest priority of any request added so far, or of one an earlier batch of the daemon
        # saw (top_priority: it may come again after the models were reloaded); none: below all.
        self._top_priority = -sys.maxsize if top_priority is None else top_priority
        self.max_rows = max_rows  # decode rows per pass at most, prompts in passes of their own; None: wide
        # A KV stream per sequence: a pass of steps of different lengths runs as several graphs
        # (runtime.py eval_many) and its time is no pass of its rows (module docstring).
        self.split_steps = split_steps
        self._read_last = False  # narrow passes: the last round read a prompt (decodes go next)
        self._running: dict[Hashable, _Running] = {}
        self._admitted = 0
        self.last: RoundStats | None = None
        self._failed: list[tuple[Hashable, Exception]] = []  # generations that raised, not yet reported

    def __len__(self) -> int:
        return len(self._running)

    @property
    def top_priority(self) -> int | None:
        """The highest priority of a request added so far (or handed in); None: none yet."""
        return None if self._top_priority == -sys.maxsize else self._top_priority

    def __contains__(self, key: Hashable) -> bool:
        return key in self._running

    def add(self, key: Hashable, steps: Steps, priority: int = 0) -> list[Event]:
        """Start a generation (engine.Engine.steps); returns the events it produced before its
        first pass (none, today: a generation starts by reading its prompt)."""
        r = _Running(key, steps, priority, self._admitted)
        self._admitted += 1
        self._top_priority = max(self._top_priority, priority)
        self._running[key] = r
        events: list[Event] = []
        self._advance(r, None, lambda _, ev: events.append(ev))
        return events

    def remove(self, key: Hashable) -> None:
        """Stop a generation (its client left, its deadline passed): its caches stay consistent."""
        r = self._running.pop(key, None)
        if r is not None:
            r.steps.close()

    def close(self) -> None:
        for key in list(self._running):
            self.remove(key)

    def take_failures(self) -> list[tuple[Hashable, Exception]]:
        """Generations that raised since the last call (removed; the others run on)."""
        out, self._failed = self._failed, []
        return out

    def step(self, deliver: Deliver) -> None:
        """One round: one target pass for the running generations (all of them, but for narrow
        passes and prompts of lower priority, `_pack`). Each event goes to
        deliver(key, event) as soon as its generation produces it: a first token does not wait
        for the drafts of the generations after it in the round, nor for its own proposers'
        prefill (engine.py). A generation that ended (its last event has a finish_reason) is
        removed."""
        self._draft(deliver)  # (none left from the round before, unless a generation joined midway)
        parts = self._pack()
        if not parts:
            return
        t0 = time.perf_counter()
        if len(parts) == 1:  # one generation: its own pass, exactly as it runs alone (engine.run_alone)
            r, toks, out = parts[0]
            outs = [r.pending.target.eval(toks, out)]  # type: ignore[union-attr]
        else:
            outs = self.eval_many([(r.pending.target, toks, out) for r, toks, out in parts])  # type: ignore[union-attr]
        seconds = time.perf_counter() - t0
        rows = sum(len(toks) for _, toks, _ in parts)
        prefill = sum(len(toks) for r, toks, _ in parts if _is_prefill(r.pending))  # type: ignore[arg-type]
        self.last = RoundStats(rows, len(parts), prefill, seconds)
        # Each generation decides its next step (or, planned, its first draft's prefill)
        # knowing the rows beside it in the next pass: of those that decided before it this
        # round, their new steps; of the rest, what they are expected to bring (_next_rows).
        # Counting the last pass's rows instead, three requests beside a free fourth row would
        # each take it.
        read = {r.key: len(toks) for r, toks, _ in parts}
        planned = {o.key: self._next_rows(o, read.get(o.key, 0)) for o in self._running.values()}
        teaches = not self.split_steps or len({len(toks) for _, toks, _ in parts}) == 1  # one graph (see p.timed)
        for (r, toks, _), logits in zip(parts, outs):
            p = r.pending
            assert p is not None
            r.done += len(toks)
            if p.output == "all" or r.done == len(p.tokens):
                r.rows.append(logits)
            if r.done < len(p.tokens):
                continue  # more of the prompt next round
            # A pass that also read prompt chunks is not a verify pass of `rows` (a prompt row costs
            # less and emits nothing), nor is a narrow pass of several sequences (module docstring):
            # their time teaches the cost model nothing. Every other pass teaches it once, through
            # the first generation it replies to: four requests reporting the same pass would
            # weigh it four times against the passes around it.
            p.rows, p.seconds, p.timed = rows, seconds, teaches and not prefill and (self.max_rows is None or len(parts) == 1)
            teaches = False
            reply = r.rows[0] if len(r.rows) == 1 else np.concatenate(r.rows)
            r.pending, r.done, r.rows = None, 0, []
            self._advance(r, reply, deliver, self._beside(r.key, planned))
            planned[r.key] = self._next_rows(r) if r.key in self._running else 0
        self._plan(deliver)
        self._draft(deliver)

    def _draft(self, deliver: Deliver) -> None:
        """Run the proposers' passes (Pass.draft: a draft model's) the next target pass waits
        for: those that name the same `together` as one pass (all requests' next drafted token
        at once, rather than one pass per request and token), until every generation has its
        target pass again."""
        while True:
            groups: dict[object, list[tuple[_Running, Pass]]] = {}
            for r in self._running.values():
                if r.pending is not None and r.pending.draft:
                    groups.setdefault(r.pending.together or id(r), []).append((r, r.pending))
            if not groups:
                return
            for group in groups.values():
                passes = [p for _, p in group]
                together = passes[0].together
                if len(passes) == 1 or together is None:
                    outs = [p.run() for p in passes]
                else:
                    t0 = time.perf_counter()
                    outs = together([(p.target, p.tokens, p.output) for p in passes])
                    seconds, rows = time.perf_counter() - t0, sum(len(p.tokens) for p in passes)
                    for p in passes:
                        p.rows, p.seconds = rows, seconds
                for (r, _), logits in zip(group, outs):
                    r.pending = None
                    self._advance(r, logits, deliver)

    def _plan(self, deliver: Deliver) -> None:
        """The steps of the generations that asked (Ask), chosen together by `plan` beside the
        rest of the next pass (prompt chunks, fixed steps); a lone one decides alone. (A decode
        that sits out while a prompt of higher priority is read, `_pack`, is planned as if it
        ran: the plan is for the passes of decodes.)"""
        asking = [r for r in self._running.values() if r.asking is not None]
        if not asking:
            return
        rest = [(o.pending.target, n) for o in self._running.values()
                if o.pending is not None and (n := self._next_rows(o)) > 0]
        replies: Sequence[Decision | Beside]
        if (len(asking) == 1 and not rest) or self.plan is None or self.graphs is None:
            replies = [Beside(sum(n for _, n in rest))] * len(asking)
        else:
            targets = [r.asking.target for r in asking]  # type: ignore[union-attr]
            graphs = self.graphs
            replies = self.plan([r.asking.offer for r in asking],  # type: ignore[union-attr]
                                lambda rows: graphs([*zip(targets, rows), *rest]))
        for r, reply in zip(asking, replies):
            r.asking = None
            if r.key in self._running:
                self._advance(r, reply, deliver)

    def _next_rows(self, r: _Running, reading: int = 0) -> int:
        """Rows a generation is expected to bring to the next pass, once `reading` more tokens
        of its pending pass are read: a decode step as long as this one, the next chunk of its
        prompt (narrow passes: none, a prompt is read in passes of its own), or, with its prompt
        read, its first decode row."""
        p = r.pending
        if p is None:
            return 1 if r.asking is not None else 0  # its step, at least its plain row
        if p.draft:  # its step is being drafted
            return p.verify_rows
        if not _is_prefill(p):
            return len(p.tokens)
        left = len(p.tokens) - r.done - reading
        if left <= 0:
            return 1
        return 0 if self.max_rows is not None else min(left, self.prefill_chunk)

    def _beside(self, key: Hashable, planned: dict[Hashable, int]) -> Beside:
        """What the others bring to a generation's next pass: their rows, and whether the pass
        is planned (then it asks rather than decides)."""
        rows = sum(n for o, n in planned.items() if o != key)
        return Beside(rows, joint=self.plan is not None and rows > 0)

    def _pack(self) -> list[tuple[_Running, list[int], Output]]:
        """This round's parts: every decode step whole, then prompt chunks, highest priority and
        oldest first, within prefill_chunk and n_batch (narrow passes: `_pack_narrow`). While a
        prompt of higher priority than some running decodes is read, those decodes sit out: its
        first token comes as fast as on an idle daemon (a voice command beside long chat
        answers), at the cost of a round or two for them."""
        waiting = [r for r in self._running.values() if r.pending is not None]
        decoding = [r for r in waiting if not _is_prefill(r.pending)]  # type: ignore[arg-type]
        reading = sorted((r for r in waiting if _is_prefill(r.pending)), key=lambda r: (-r.priority, r.order))  # type: ignore[arg-type]
        if reading:
            urgent = reading[0].priority
            decoding = [r for r in decoding if r.priority >= urgent]
            reading = [r for r in reading if r.priority == urgent]
        if self.max_rows is not None:
            return self._pack_narrow(decoding, reading, self.max_rows)
        parts: list[tuple[_Running, list[int], Output]] = []
        room = self.n_batch
        for r in decoding:
            p = r.pending
            assert p is not None
            if len(p.tokens) > room:
                break
            parts.append((r, p.tokens, p.output))
            room -= len(p.tokens)
        # Alone in the pass, a prompt is read in longer chunks: fewer passes, each of which costs
        # beyond its rows (config.py, prefill_chunk_alone). But once a request of higher priority
        # has come (a voice command beside a chat's long prompt), one may come again, and it
        # waits for the pass in flight: then at most one short chunk.
        alone = not parts and bool(reading) and reading[0].priority >= self._top_priority
        chunk = min(self.prefill_chunk_alone if alone else self.prefill_chunk, room)
        for r in reading:
            if chunk <= 0:
                break
            p = r.pending
            assert p is not None
            toks = p.tokens[r.done : r.done + chunk]
            last = r.done + len(toks) == len(p.tokens)
            parts.append((r, toks, p.output if (last or p.output == "all") else "none"))
            chunk -= len(toks)
        return parts

    def _pack_narrow(
        self, decoding: list[_Running], reading: list[_Running], max_rows: int
    ) -> list[tuple[_Running, list[int], Output]]:
        """Narrow passes (module docstring): a prompt chunk alone, or decode steps of at most
        max_rows rows together (a longer step, when it waited longest, alone)."""
        if reading and any(r.priority > reading[0].priority for r in decoding):
            reading = []  # a higher request decodes: this prompt waits for it to end
        if reading and (not decoding or not self._read_last):
            self._read_last = True
            r = reading[0]
            p = r.pending
            assert p is not None
            # Alone: the whole prompt in one eval, as run_alone; else n_batch, as Runtime.eval cuts it.
            toks = p.tokens[r.done : r.done + self.n_batch] if decoding else p.tokens[r.done :]
            last = r.done + len(toks) == len(p.tokens)
            return [(r, toks, p.output if (last or p.output == "all") else "none")]
        self._read_last = False
        parts: list[tuple[_Running, list[int], Output]] = []
        rows = 0
        for r in sorted(decoding, key=lambda r: (-r.waited, r.order)):
            p = r.pending
            assert p is not None
            if parts and rows + len(p.tokens) > max_rows:
                r.waited += 1
                continue
            parts.append((r, p.tokens, p.output))
            rows += len(p.tokens)
            r.waited = 0
        return parts

    def _advance(self, r: _Running, reply: np.ndarray | Decision | Beside | None, deliver: Deliver,
                 beside: Beside = Beside()) -> None:
        """Run a generation from its last pass (or its plan) to its next pass (or ask), delivering
        its events."""
        msg: np.ndarray | Decision | Beside | None = reply
        while True:
            try:
                item = r.steps.send(msg)
            except StopIteration:
                self._running.pop(r.key, None)
                return
            except Exception as e:  # one request's bug (a grammar, a proposer) ends only it
                self._running.pop(r.key, None)
                self._failed.append((r.key, e))
                return
            if isinstance(item, Pass):
                r.pending = item
                return
            if isinstance(item, Ask):
                r.asking = item
                return
            last = item.finish_reason is not None  # the generation's last event
            if last:
                self._running.pop(r.key, None)
                r.steps.close()
            try:
                deliver(r.key, item)
            except Exception as e:
                if self._running.pop(r.key, None) is not None:
                    r.steps.close()
                self._failed.append((r.key, e))
                return
            if last:
                return
            msg = beside  # (if `deliver` removed it, it is closed: the next send ends it)


def _is_prefill(p: Pass) -> bool:
    """A prompt read (output "last"/"none") rather than a verify step (output "all")."""
    return p.output != "all"
