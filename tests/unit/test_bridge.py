"""The bridge that carries a job's events from the worker thread into the request's event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from homespec.config import Config
from homespec.serving.daemon import Job, JobEvent
from homespec.serving.host import build_request
from homespec.serving.openai_api import ApiError
from homespec.serving.routes.common import Bridge, ClientGone


def test_events_posted_together_from_another_thread_arrive_in_order_in_one_wake_up() -> None:
    async def main() -> tuple[list[list[int]], int]:
        loop = asyncio.get_running_loop()
        bridges = [Bridge() for _ in range(3)]
        wakeups = 0
        real = loop.call_soon_threadsafe

        def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal wakeups
            wakeups += 1
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        def post(tokens: range) -> None:  # one pass of the worker: a token for each request
            for tok in tokens:
                for b in bridges:
                    b.sink(tok)  # type: ignore[arg-type]

        # The loop is held (this thread blocks in join) while the worker posts four passes' events.
        worker = threading.Thread(target=post, args=(range(4),))
        worker.start()
        worker.join(5)
        got = [[await asyncio.wait_for(b.queue.get(), 5) for _ in range(4)] for b in bridges]
        # Posts after that delivery wake the loop again.
        worker = threading.Thread(target=post, args=(range(9, 10),))
        worker.start()
        worker.join(5)
        for i, b in enumerate(bridges):
            got[i].append(await asyncio.wait_for(b.queue.get(), 5))
        return got, wakeups

    got, wakeups = asyncio.run(main())
    assert got == [[0, 1, 2, 3, 9]] * 3
    assert wakeups == 2


class _Request:
    """What Bridge.next asks of a request: its app's drain deadline, and its ASGI receive (with
    the body read, only http.disconnect is left to come, once the client has gone)."""

    app = type("App", (), {"state": type("State", (), {})()})()

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


def _job() -> Job:
    return Job(build_request(Config()), sink=lambda ev: None, encode=None)


def test_first_output_waits_for_the_first_event_and_leaves_it_for_next() -> None:
    async def main() -> list[str]:
        bridge = Bridge()
        bridge.sink(JobEvent("delta", text="Hel"))
        bridge.sink(JobEvent("delta", text="lo"))
        request, job = _Request(), _job()
        await bridge.first_output(request, job)  # type: ignore[arg-type]
        return [(await bridge.next(request, job)).text, (await bridge.next_or_cut(request)).text]  # type: ignore[arg-type, union-attr]

    assert asyncio.run(main()) == ["Hel", "lo"]


def test_an_error_before_the_first_token_is_raised_as_its_http_status() -> None:
    async def main() -> None:
        bridge = Bridge()
        bridge.sink(JobEvent("error", text="prompt too long", status=400, code="context_length_exceeded"))
        await bridge.first_output(_Request(), _job())  # type: ignore[arg-type]

    with pytest.raises(ApiError) as e:
        asyncio.run(main())
    assert (e.value.status, e.value.code) == (400, "context_length_exceeded")


def test_a_stream_with_keep_alive_pings_starts_without_waiting() -> None:
    async def main() -> bool:
        bridge = Bridge()
        await asyncio.wait_for(bridge.first_output(_Request(), _job(), pings=True), 1)  # type: ignore[arg-type]
        return bridge.queue.empty() and bridge._held is None

    assert asyncio.run(main())


def test_a_hang_up_ends_the_wait_for_the_next_event_and_cancels_the_job(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seen as it happens, not at the next look: with the drain check a minute apart, the wait
    must still end on the hang-up."""
    monkeypatch.setattr(Bridge, "CHECK_S", 60.0)
    job = _job()

    async def main() -> None:
        bridge, request = Bridge(), _Request()
        bridge.sink(JobEvent("delta", text="Hel"))
        assert (await bridge.next(request, job)).text == "Hel"  # type: ignore[arg-type]
        asyncio.get_running_loop().call_later(0.05, request.gone.set)
        await asyncio.wait_for(bridge.next(request, job), 10)  # type: ignore[arg-type]

    with pytest.raises(ClientGone):
        asyncio.run(main())
    assert job.cancelled.is_set()


def test_a_cancelled_wait_leaves_no_task_waiting_on_the_queue_or_the_hang_up() -> None:
    """n_cmpl's completions wait side by side; when one fails the others are cancelled, and
    their waits must not linger (a pending queue.get and a hang-up watcher per completion)."""
    async def main() -> set[asyncio.Task]:
        bridge, request = Bridge(), _Request()
        waiting = asyncio.ensure_future(bridge.next(request, _job()))  # type: ignore[arg-type]
        await asyncio.sleep(0.05)
        before = asyncio.all_tasks() - {asyncio.current_task(), waiting}
        assert before, "next() waits on the queue and the hang-up beside it"
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await asyncio.sleep(0)  # let the cancellations land
        return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    assert asyncio.run(main()) == set()
