"""`n` choices as n Triton requests for the same prompt, read at once (the engine batches them).

`FanOut` reads the n delta streams on tasks of their own and hands out `(choice, Delta)` in the
order they arrive, and `(choice, None)` when a choice's stream has ended. The first error of any
choice cancels every stream and is raised; so does closing it (a client gone away): a stream
left early aborts its sequence (VolundrTriton.stream).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from volundr.clients.openai_schema import INT64_MAX, INT64_MIN
from volundr.clients.triton import Delta

Item = tuple[int, Delta | None]


def choice_seed(seed: int | None, i: int) -> int | None:
    """Choice i's seed: the request's + i (the choices differ, the request is reproducible),
    wrapped around within INT64 (the tensor it travels in); None stays None (random)."""
    if seed is None:
        return None
    span = INT64_MAX - INT64_MIN + 1
    return (seed + i - INT64_MIN) % span + INT64_MIN


class FanOut:
    def __init__(self, streams: list[AsyncIterator[Delta]]):
        self.streams = streams
        self.q: asyncio.Queue = asyncio.Queue()
        self.open = len(streams)
        self.tasks = [asyncio.ensure_future(self._pump(i, s)) for i, s in enumerate(streams)]

    async def _pump(self, i: int, stream: AsyncIterator[Delta]) -> None:
        try:
            async for d in stream:
                self.q.put_nowait((i, d))
            self.q.put_nowait((i, None))
        except Exception as e:  # TritonRequestError, TritonUnavailable, ...: for the reader
            self.q.put_nowait((i, e))

    def __aiter__(self) -> FanOut:
        return self

    async def __anext__(self) -> Item:
        if self.open == 0:
            raise StopAsyncIteration
        try:
            i, item = await self.q.get()
        except BaseException:  # cancelled: the reader is gone, so are the choices
            self.cancel()
            raise
        if isinstance(item, Exception):
            self.open = 0
            await self.aclose()
            raise item
        if item is None:
            self.open -= 1
        return i, item

    async def first(self) -> list[Item]:
        """The first item (of whichever choice comes first) and all that arrived with it; an
        error among them is raised (the HTTP status of a streamed answer: an error every
        choice shares, such as a prompt too long, is each one's first response)."""
        out = [await self.__anext__()]
        while self.open and not self.q.empty():
            out.append(await self.__anext__())
        return out

    async def collect(self) -> list[list[Delta]]:
        """Every choice's deltas (a non-streamed answer)."""
        out: list[list[Delta]] = [[] for _ in self.streams]
        async for i, d in self:
            if d is not None:
                out[i].append(d)
        return out

    def cancel(self) -> None:
        """Cancels the readers: each stream not yet ended aborts its sequence."""
        for t in self.tasks:
            t.cancel()

    async def aclose(self) -> None:
        self.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for s in self.streams:  # each ended with its reader; this closes one never started
            try:
                await s.aclose()  # type: ignore[attr-defined]
            except RuntimeError:  # still running: its reader's cancellation ends it
                pass
