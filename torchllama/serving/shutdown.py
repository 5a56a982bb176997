"""A graceful way out: SIGTERM/SIGINT drain the server, then it exits 0.

    signal ─▶ draining: new requests 503 + Retry-After, /health 503 "draining"
           ─▶ running and queued requests finish, up to `drain_timeout` seconds
           ─▶ those still running end with a final error event (503, "the server shut down")
           ─▶ uvicorn closes the connections, the engine stops, exit status 0
    a second signal cuts the wait short; an engine that fails makes the server exit 1

uvicorn's own handling closes the listening socket at once (new clients see "connection
refused", not an answer a load balancer can act on), cancels what has not finished after
`timeout_graceful_shutdown` (a cut stream) and re-raises the signal at the end (the process
dies by it: exit −15). `Server` keeps uvicorn and replaces those three.

Source: Kubernetes' pod termination (SIGTERM, a grace period, then SIGKILL; a failing
readiness probe takes the pod out of the service), uvicorn's `Server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from typing import Iterator

import uvicorn

from torchllama.serving.engine import Engine
from torchllama.serving.guard import Drain

log = logging.getLogger("torchllama.serving.shutdown")

#: the signals that drain the server
SIGNALS = (signal.SIGINT, signal.SIGTERM)

#: seconds the final events of aborted requests get to reach their clients
FLUSH_SECONDS = 2.0


class Server(uvicorn.Server):
    """uvicorn's server with a drain on SIGTERM/SIGINT (see the module docstring).

    Args:
        config: uvicorn's Config of the app (`torchllama.serving.app.create_app`).
        engine: the app's engine.
        drain: the app's `Drain`.
        drain_timeout: seconds running requests get to finish.

    Attributes:
        exit_code: 0 after a drain, 1 when the engine failed.
    """

    def __init__(self, config: uvicorn.Config, engine: Engine, drain: Drain,
                 drain_timeout: float):
        super().__init__(config)
        self.engine, self.drain, self.drain_timeout = engine, drain, drain_timeout
        self.signals = 0
        self.exit_code = 0
        self._draining: asyncio.Task | None = None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """Our handlers while serving, the previous ones after; the signal is not re-raised
        (a drained server exits 0)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame) -> None:
        """A signal: the first starts the drain (at the next tick), the next cuts it short."""
        self.signals += 1
        log.warning("%s: %s", signal.Signals(sig).name,
                    "draining" if self.signals == 1 else "ending the drain now")

    async def on_tick(self, counter: int) -> bool:
        if self.signals and self._draining is None:
            self._draining = asyncio.create_task(self.run_drain())
        if self.drain.failed and not self.should_exit:
            log.critical("the engine failed (%s): exiting with status 1", self.drain.failed)
            self.exit_code, self.should_exit = 1, True
        return await super().on_tick(counter)

    async def run_drain(self) -> None:
        """Stop admission, wait for the running requests (up to the timeout or a second
        signal), end the rest in error, then let uvicorn shut down."""
        engine, drain = self.engine, self.drain
        drain.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_timeout
        log.warning("draining: %d running, %d waiting; up to %.0f s (a second signal ends "
                    "it now)", engine.active, engine.waiting, self.drain_timeout)
        while (engine.active or engine.waiting) and loop.time() < deadline and \
                self.signals < 2 and not drain.failed:
            await asyncio.sleep(0.05)
        ended = engine.abort_all(f"the server shut down before this request finished "
                                 f"(drain timeout {self.drain_timeout:g} s)")
        if ended:
            log.warning("ended %d unfinished requests with an error event", ended)
        flush = loop.time() + FLUSH_SECONDS
        while (engine.active or engine.waiting) and loop.time() < flush:
            await asyncio.sleep(0.02)
        await asyncio.sleep(0.1)                     # their final events on the way out
        self.should_exit = True


def run(app, host: str, port: int) -> int:
    """Serve `app` (`create_app`'s) with uvicorn until a signal drains it; the exit status
    (0 after a drain, 1 when the engine failed)."""
    config = uvicorn.Config(app, host=host, port=port, log_level="warning",
                            timeout_graceful_shutdown=FLUSH_SECONDS + 3)
    server = Server(config, app.state.engine, app.state.drain, app.state.drain_timeout)
    server.run()
    return server.exit_code
