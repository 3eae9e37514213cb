"""Where the model runs, seen from the server: off the event loop, cancellable, never fatal.

`LocalBackend` loads the engine in this process on one worker thread and runs every infill there, so the event
loop that answers the editor never waits on the model. (The resident-engine issue adds a backend that talks to a
shared engine process over HTTP; it has the same three methods.)

Only this module imports `engine`, and only inside the worker: the server starts answering before torch is even
imported.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)


class BackendNotReady(Exception):
    """The model is still loading, or failed to load; the message says which."""


class LocalBackend:
    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="canvas-engine")
        self._engine: Any = None
        self._loading: Future[Any] | None = None
        self.state = "idle"  # idle -> loading -> ready | failed
        self.error: str | None = None
        self.model_name: str | None = None
        self.load_seconds: float | None = None
        self.cancelled_after_steps: list[int] = []  # per cancelled request, the denoising steps it had run

    def load(self, model: str | None, device: str, on_done: Callable[[LocalBackend], None] | None = None) -> None:
        """Start loading (in the worker); `on_done` runs in the worker thread when it ends, well or not."""
        self.state, self.error, self._engine = "loading", None, None

        def work() -> None:
            started = time.perf_counter()
            try:
                from engine import Engine

                self._engine = Engine.load(model, None if device == "auto" else device)
                self.model_name = self._engine.name
                self.state = "ready"
            except Exception as exc:  # a load failure is reported, never raised into the server
                self.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                self.state = "failed"
                log.error("model load failed: %s", self.error)
            self.load_seconds = time.perf_counter() - started
            if on_done is not None:
                on_done(self)

        self._loading = self._executor.submit(work)

    async def infill(self, prefix: str, suffix: str, overrides: dict[str, Any], cancel: threading.Event) -> dict | None:
        """The engine's result as a dict, or None when cancelled. Raises BackendNotReady while loading/failed."""
        if self.state != "ready":
            raise BackendNotReady(
                f"the model failed to load: {self.error}" if self.state == "failed" else "the model is still loading"
            )
        from engine import InfillCancelled

        engine = self._engine

        def work() -> dict | None:
            if cancel.is_set():
                return None
            try:
                return engine.infill(prefix, suffix, overrides, cancel=cancel).to_dict()
            except InfillCancelled as stopped:
                self.cancelled_after_steps = [*self.cancelled_after_steps[-99:], stopped.steps]
                return None

        loop = asyncio.get_running_loop()
        future = loop.run_in_executor(self._executor, work)
        try:
            return await future
        except asyncio.CancelledError:
            cancel.set()  # the editor gave up: stop denoising at the next step
            raise

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
