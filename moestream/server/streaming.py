"""Server-sent events in the OpenAI chunk format, and merging the streams of n choices.

`SSEResponse` watches the connection while it streams: when the client goes away (even while
the first token is still being computed, when nothing is being sent) it cancels the stream and
closes the event iterator, whose `finally` blocks abort the engine requests behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Mapping
from typing import Any, TypeVar

from pydantic import BaseModel
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

log = logging.getLogger("moestream.server")
T = TypeVar("T")

DONE = "data: [DONE]\n\n"


def sse(data: BaseModel | Mapping[str, Any]) -> str:
    """One SSE event carrying a JSON object (None fields of models left out)."""
    if isinstance(data, BaseModel):
        body = data.model_dump_json(exclude_none=True)
    else:
        body = json.dumps(data, ensure_ascii=False)
    return f"data: {body}\n\n"


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], headers: Mapping[str, str] | None = None):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(
            {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})}
        )

    async def _stream(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async for event in self.events:
            await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _disconnected(receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(self._disconnected(receive))
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                task.cancel()
            await asyncio.gather(stream, watcher, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.events.aclose()  # type: ignore[attr-defined]
        if stream.done() and not stream.cancelled() and stream.exception() is not None:
            error = stream.exception()
            if not isinstance(error, OSError):
                log.error("streaming failed", exc_info=error)


_END = object()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Items of several async iterators as they come, tagged with the iterator's index.
    An exception in one stops all; closing the merge closes every stream."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    inbox: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[T]) -> None:
        try:
            async with contextlib.aclosing(stream):  # type: ignore[type-var]
                async for item in stream:
                    await inbox.put((i, item, None))
        except Exception as e:
            await inbox.put((i, None, e))
        await inbox.put((i, _END, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item, error = await inbox.get()
            if error is not None:
                raise error
            if item is _END:
                remaining -= 1
                continue
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
