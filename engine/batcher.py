"""The resident engine's scheduler: one thread runs every request in flight (up to `max_batch`) one denoising step at a
time, their canvases sharing each decoder forward (iteration-level scheduling); background requests run only while
nothing else waits or runs. `service.EngineService` submits to it and awaits the futures."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future

from .canvas import InfillCancelled
from .engine import Engine, EngineBatch, InfillRequest


class Batcher:
    """The scheduler: one thread runs every request in flight (up to `max_batch`) one denoising step at a time,
    their canvases sharing each decoder forward. Between steps, requests that arrived join the batch and the ones
    that ended leave it (iteration-level scheduling): nobody waits for a whole batch to finish. Background requests
    wait while any other request waits or runs, and one that arrives cancels those running (`on_preempt`)."""

    def __init__(self, engine: Engine, max_batch: int, on_step: Callable[[int, float], None] | None = None,
                 on_preempt: Callable[[], None] | None = None):  # fmt: skip
        self.engine = engine
        self.max_batch = max_batch
        self.on_step = on_step
        self.on_preempt = on_preempt
        self.waiting: queue.Queue[tuple[InfillRequest, Future]] = queue.Queue()
        self.ready: deque[tuple[InfillRequest, Future]] = deque()  # read from `waiting`, not yet in the batch
        self.held: deque[tuple[InfillRequest, Future]] = deque()  # background requests waiting for an idle batch
        self.thread = threading.Thread(target=self._loop, name="canvas-batcher", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        """The scheduler thread still runs (a team deployment's health check restarts a replica where it does not)."""
        return self.thread.is_alive()

    def submit(self, request: InfillRequest) -> Future:
        future: Future = Future()
        self.waiting.put((request, future))
        return future

    def _loop(self) -> None:
        batch = self.engine.batch()
        futures: dict[int, Future] = {}  # id(request) -> its future, for the requests in `batch`
        running: dict[int, InfillRequest] = {}  # id(request) -> request, for every request in `batch`
        while True:
            self._admit(batch, futures, running)
            if not batch:
                continue
            rows, started = len(batch), time.perf_counter()
            try:
                ended = batch.step()
            except Exception as exc:  # a failing step fails the requests in it, not the scheduler
                for future in futures.values():
                    future.set_exception(exc)
                batch, futures, running = self.engine.batch(), {}, {}
                continue
            if self.on_step is not None:
                self.on_step(rows, time.perf_counter() - started)
            for request, outcome in ended:
                running.pop(id(request), None)
                future = futures.pop(id(request), None)
                if future is not None and not future.done():
                    future.set_result(outcome)

    def _take(self, pending: deque[tuple[InfillRequest, Future]], arrived: list[tuple[InfillRequest, Future]],
              batch: EngineBatch) -> None:  # fmt: skip
        """Move requests from `pending` to `arrived`, in order, while the batch has room; stop at the first one of
        another LoRA adapter than the batch's: one forward computes with one adapter, so it waits for the batch to
        drain (and the requests behind it too: no adapter waits behind a stream of another's)."""
        adapter = batch.adapter
        while pending and len(batch) + len(arrived) < self.max_batch:
            request, future = pending[0]
            if request.cancel is not None and request.cancel.is_set():
                pending.popleft()
                future.set_result(InfillCancelled(0))  # cancelled while it waited
                continue
            if (batch or arrived) and request.adapter != adapter:
                break
            adapter = request.adapter
            arrived.append(pending.popleft())

    def _admit(self, batch: EngineBatch, futures: dict[int, Future], running: dict[int, InfillRequest]) -> None:
        """Take waiting requests into the batch (blocking only when nothing runs or waits); the ones that arrived
        together are encoded together. Every waiting request is read at once, so that a real request is seen even
        when the batch is full: it stops the background requests in the batch before the next step, and background
        requests join only a batch without other requests, when none waits."""
        block = not batch and not self.ready and not self.held
        while True:
            try:
                request, future = self.waiting.get(block=block)
            except queue.Empty:
                break
            block = False
            if request.cancel is not None and request.cancel.is_set():
                future.set_result(InfillCancelled(0))  # gone before it started
            else:
                (self.held if request.background else self.ready).append((request, future))
        if self.ready:
            for request in running.values():
                if request.background and request.cancel is not None and not request.cancel.is_set():
                    request.cancel.set()  # dropped at the next step, before its forward
                    if self.on_preempt is not None:
                        self.on_preempt()
        arrived: list[tuple[InfillRequest, Future]] = []
        self._take(self.ready, arrived, batch)
        if not arrived and not self.ready and all(request.background for request in running.values()):
            self._take(self.held, arrived, batch)
        for request, future in arrived:
            futures[id(request)] = future
            running[id(request)] = request
        try:
            failed = batch.add_many([request for request, _ in arrived])
        except Exception as exc:  # whatever goes wrong, the scheduler stays up and these requests get the error
            failed = [(request, exc) for request, _ in arrived]
        for request, error in failed:  # a bad request must not take the scheduler down
            running.pop(id(request), None)
            future = futures.pop(id(request), None)
            if future is not None and not future.done():
                future.set_exception(error)
