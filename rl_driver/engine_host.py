"""Hosts one rhyme-sglang ``Engine`` on a private event-loop thread, callable from any thread.

sglang's ``Engine`` drives its tokenizer manager through ``self.loop.run_until_complete``,
which cannot be called from inside another running event loop (a Ray async actor's) or
from two threads at once. ``EngineHost`` builds the engine on a dedicated thread, keeps its
loop running there forever, and swaps ``engine.loop`` for a proxy whose
``run_until_complete`` submits the coroutine to that loop and waits. Every synchronous
engine method then works from any thread, and coroutines (streamed generation) can be
scheduled concurrently with :meth:`submit`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any, Coroutine, Dict

logger = logging.getLogger(__name__)


class _LoopProxy:
    """Stands in for ``engine.loop``: runs coroutines on the host's loop thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop

    def run_until_complete(self, awaitable):
        if not asyncio.iscoroutine(awaitable):
            async def _await(a=awaitable):
                return await a
            awaitable = _await()
        return asyncio.run_coroutine_threadsafe(awaitable, self._loop).result()

    def __getattr__(self, name):
        return getattr(self._loop, name)


class EngineHost:
    """Owns one engine and the thread its event loop runs on."""

    def __init__(self, engine_kwargs: Dict[str, Any], start_timeout_s: float = 600.0):
        self._ready: concurrent.futures.Future = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(dict(engine_kwargs),),
                                        name="rhyme-engine-loop", daemon=True)
        self._thread.start()
        self.engine = self._ready.result(timeout=start_timeout_s)

    def _main(self, engine_kwargs: Dict[str, Any]) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            from rhyme_sglang import Engine

            engine = Engine(**engine_kwargs)
        except BaseException as exc:  # report start failures to the constructor
            self._ready.set_exception(exc)
            loop.close()
            return
        self._loop = loop
        engine.loop = _LoopProxy(loop)
        self._ready.set_result(engine)
        loop.run_forever()

    def submit(self, coro: Coroutine) -> concurrent.futures.Future:
        """Schedule a coroutine on the engine's loop (thread-safe)."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call_soon(self, fn, *args) -> None:
        """Run a plain callable on the loop thread (e.g. ``tokenizer_manager.abort_request``)."""
        self._loop.call_soon_threadsafe(fn, *args)

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
