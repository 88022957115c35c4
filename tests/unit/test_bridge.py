"""The bridge that carries a job's events from the worker thread into the request's event loop."""

from __future__ import annotations

import asyncio
import threading

from homespec.serving.routes.common import Bridge


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
