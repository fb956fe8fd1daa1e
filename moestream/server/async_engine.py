"""`AsyncEngine`: the synchronous `Engine` driven from one background thread, for asyncio.

The engine thread is the only thread that touches the engine (and so torch). The event loop
talks to it through a thread-safe inbox (add, abort, call, stop); the thread steps while any
request is unfinished and sleeps on an event otherwise, and hands each step's outputs back to
the loop with one `call_soon_threadsafe`, which puts them on per-request asyncio queues.

Admission: at most `max_concurrency` requests are in the engine at once; up to `max_queue` more
wait for a slot; beyond that `generate` raises `QueueFullError` at once. A consumer that stops
iterating (client gone) aborts its request, which frees its KV blocks in the engine thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from moestream.engine import Engine, EngineOutput
from moestream.errors import MoestreamError
from moestream.sched.scheduler import SchedulerStats
from moestream.server.constrained import ConstrainedLogits, RequestConstraint
from moestream.types import SamplingParams

log = logging.getLogger("moestream.server")
T = TypeVar("T")


class QueueFullError(Exception):
    """The server already holds `max_concurrency + max_queue` requests."""


class EngineStoppedError(Exception):
    """The engine is shutting down, or its thread died."""


class EngineFailure(Exception):
    """The engine raised while stepping; every request in flight fails with this."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot taken by the engine thread after each step (read from any thread)."""

    scheduler: SchedulerStats
    num_blocks: int
    steps: int
    time: float


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    constraint: RequestConstraint | None


@dataclass
class _Call:
    fn: Callable[[], Any]
    future: concurrent.futures.Future


_STOP = object()
_ACCEPTED = object()


class RequestObserver(Protocol):
    """Hooks for metrics, called on the event loop."""

    def on_output(
        self, out: EngineOutput, arrival: float, prev_time: float | None, now: float
    ) -> None:
        """An output with tokens; `prev_time` is when the previous one came (None: first)."""

    def on_end(self, last: EngineOutput | None, arrival: float, now: float) -> None:
        """The request's stream closed; `last` is its last output (finished or not)."""


class RequestStream:
    """The outputs of one admitted request, as an async iterator (see `AsyncEngine.open`)."""

    def __init__(self, engine: AsyncEngine, request_id: str, arrival: float) -> None:
        self.engine = engine
        self.request_id = request_id
        self.arrival = arrival
        self.queue: asyncio.Queue = asyncio.Queue()
        self.finished = False
        self.accepted = False  # the engine took it (refused requests are not counted)
        self.last: EngineOutput | None = None
        self._last_time: float | None = None  # when the latest output with tokens arrived
        self._closed = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True  # the engine thread dropped it already
            raise item
        self.finished = item.finished
        if item.new_token_ids:
            now = time.monotonic()
            if self.engine.observer is not None:
                self.engine.observer.on_output(item, self.arrival, self._last_time, now)
            self._last_time = now
        self.last = item
        return item

    def close(self) -> None:
        """Release the request's slot; abort it in the engine if it has not finished."""
        if self._closed:
            return
        self._closed = True
        engine = self.engine
        engine._streams.pop(self.request_id, None)
        if not self.finished:
            engine._send(("abort", self.request_id))
        engine._slots.release()
        if engine.observer is not None and self.accepted:
            engine.observer.on_end(self.last, self.arrival, time.monotonic())

    async def aclose(self) -> None:
        self.close()


class AsyncEngine:
    """Runs `engine` in its own thread; see the module docstring. Start and use it from one
    event loop. While it runs it owns the engine: nothing else may call into it."""

    def __init__(
        self,
        engine: Engine,
        *,
        max_concurrency: int = 256,
        max_queue: int = 1024,
        logits_processor: ConstrainedLogits | None = None,
        observer: RequestObserver | None = None,
    ) -> None:
        if max_concurrency < 1 or max_queue < 0:
            raise ValueError("max_concurrency must be >= 1 and max_queue >= 0")
        self.engine = engine
        self.max_concurrency = max_concurrency
        self.max_queue = max_queue
        self.logits_processor = logits_processor
        self.observer = observer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, asyncio.Queue] = {}  # loop side
        self._live: set[str] = set()  # engine side: requests added and not finished
        self._slots: asyncio.Semaphore | None = None
        self._num_admitting = 0
        self._closing = False
        self._steps = 0
        self.stats: EngineStats | None = None
        self.error: BaseException | None = None

    # ---- lifecycle (event loop) ------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._slots = asyncio.Semaphore(self.max_concurrency)
        # The runner applies it between compute_logits and sampling (see constrained.py).
        self.engine.runner.logits_processor = self.logits_processor
        self._snapshot()
        self._thread = threading.Thread(target=self._run, name="moestream-engine", daemon=True)
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closing

    @property
    def num_requests(self) -> int:
        """Requests handed to the engine and not yet finished, as the loop sees them."""
        return len(self._streams)

    @property
    def num_queued(self) -> int:
        """Requests waiting for a concurrency slot."""
        return self._num_admitting

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Refuse new requests, abort the unfinished ones and stop the thread."""
        self._closing = True
        if self._thread is None:
            return
        self._send(_STOP)
        await asyncio.to_thread(self._thread.join, timeout)
        if not self._thread.is_alive():
            self.engine.runner.logits_processor = None
        for q in self._streams.values():
            q.put_nowait(EngineStoppedError("the server is shutting down"))

    # ---- requests (event loop) -------------------------------------------------------------
    async def open(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        constraint: RequestConstraint | None = None,
    ) -> RequestStream:
        """Admit a request and hand it to the engine; returns once the engine has accepted it.

        Raises QueueFullError at once when the queue is full, EngineStoppedError, or the
        MoestreamError with which the engine refused the request. The stream must be closed
        (`close`, or `async with contextlib.aclosing(stream)`); closing it early aborts.
        """
        if not self.is_running or self._slots is None:
            raise EngineStoppedError("the engine is not running")
        if self._slots.locked() and self._num_admitting >= self.max_queue:
            raise QueueFullError(
                f"{self.num_requests} requests in flight and {self._num_admitting} queued"
            )
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is in use")
        arrival = time.monotonic()
        self._num_admitting += 1
        try:
            await self._slots.acquire()
        finally:
            self._num_admitting -= 1
        stream = RequestStream(self, request_id, arrival)
        try:
            if not self.is_running:
                raise EngineStoppedError("the engine is not running")
            self._streams[request_id] = stream.queue
            self._send(_Add(request_id, list(prompt_token_ids), params, constraint))
            accepted = await stream.queue.get()
            if isinstance(accepted, BaseException):
                stream.finished = True  # refused: nothing to abort
                raise accepted
            stream.accepted = True
        except BaseException:
            stream.close()
            raise
        return stream

    def abort(self, request_id: str) -> None:
        self._send(("abort", request_id))

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn()` in the engine thread between two steps (for work that touches torch)."""
        if not self.is_running:
            raise EngineStoppedError("the engine is not running")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._send(_Call(fn, future))
        return await asyncio.wrap_future(future)

    def _send(self, item: object) -> None:
        self._inbox.put(item)
        self._wake.set()

    def _dispatch(self, outputs: list[EngineOutput | tuple[str, object]]) -> None:
        """On the loop: route outputs (or (request id, ACCEPTED or error)) to their streams."""
        for out in outputs:
            if isinstance(out, tuple):
                stream = self._streams.get(out[0])
                if stream is not None:
                    stream.put_nowait(out[1])
                continue
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # the consumer left; its abort is on the way
            stream.put_nowait(out)

    # ---- the engine thread -----------------------------------------------------------------
    def _post(self, items: list) -> None:
        if items:
            # RuntimeError: the loop is closed, nobody is listening any more.
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._dispatch, items)

    def _snapshot(self) -> None:
        self.stats = EngineStats(
            self.engine.scheduler.stats(),
            self.engine.scheduler.allocator.num_blocks,
            self._steps,
            time.monotonic(),
        )

    def _run(self) -> None:
        try:
            while True:
                if not self._drain_inbox():
                    break
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._snapshot()
                    self._wake.wait()
                    self._wake.clear()
        except BaseException as e:  # our own bug: report it, fail everyone, stop
            log.exception("the engine thread died")
            self.error = e
            self._fail_all(EngineFailure(f"the engine thread died: {type(e).__name__}: {e}"))
            raise
        finally:
            try:
                self._abort_all()
                self._snapshot()
            except Exception:
                log.exception("cleaning up the engine failed")
            self._reject_inbox()

    def _drain_inbox(self) -> bool:
        """Apply queued commands; False when asked to stop."""
        replies: list = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                self._post(replies)
                return False
            if isinstance(item, _Add):
                try:
                    self.engine.add_request(item.prompt_token_ids, item.params, item.request_id)
                except MoestreamError as e:
                    replies.append((item.request_id, e))
                    continue
                replies.append((item.request_id, _ACCEPTED))
                self._live.add(item.request_id)
                if item.constraint is not None and self.logits_processor is not None:
                    self.logits_processor.add(item.request_id, item.constraint)
            elif isinstance(item, _Call):
                if item.future.set_running_or_notify_cancel():
                    try:
                        item.future.set_result(item.fn())
                    except BaseException as e:  # handed to the caller
                        item.future.set_exception(e)
            else:
                _, request_id = item
                self._forget(request_id, abort=True)
        self._post(replies)
        return True

    def _reject_inbox(self) -> None:
        """Answer what arrived after the stop: nobody may wait on it forever."""
        stopped = EngineStoppedError("the server is shutting down")
        refused = []
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, _Add):
                refused.append((item.request_id, stopped))
            elif isinstance(item, _Call) and item.future.set_running_or_notify_cancel():
                item.future.set_exception(stopped)
        self._post(refused)

    def _forget(self, request_id: str, abort: bool) -> None:
        if abort and request_id in self._live:
            self.engine.abort(request_id)
        self._live.discard(request_id)
        if self.logits_processor is not None:
            self.logits_processor.remove(request_id)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed; failing the requests in flight")
            self._fail_all(EngineFailure(f"engine step failed: {type(e).__name__}: {e}"))
            self._abort_all()
            return
        self._steps += 1
        for out in outputs:
            if out.finished:
                self._forget(out.request_id, abort=False)
        self._snapshot()
        self._post(list(outputs))

    def _fail_all(self, error: BaseException) -> None:
        self._post([(rid, error) for rid in self._live])

    def _abort_all(self) -> None:
        for rid in list(self._live):
            self._forget(rid, abort=True)
