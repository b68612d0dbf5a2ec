"""`LLM`: the engine for synchronous, offline batch use (like vLLM's `LLM.generate`)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

from .config import EngineConfig, GenerationParams
from .engine import Engine
from .requests import RequestOutput

T = TypeVar("T")


class LoopThread:
    """An event loop on a daemon thread: how synchronous code drives the engine, which
    must only ever be touched from its own loop."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Runs `coroutine` on the loop and waits for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class LLM:
    """Starts an engine on a private event loop thread; `generate` blocks until every
    prompt is answered. Call `close()` (or use `with LLM(...) as llm:`) to stop workers."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self._loop = LoopThread()
        self._run = self._loop.run
        self.engine = self._run(self._start(config))

    async def _start(self, config: EngineConfig | None) -> Engine:
        engine = Engine(config)
        await engine.start()
        return engine

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: GenerationParams | None = None
    ) -> list[RequestOutput]:
        """Final outputs in prompt order; all prompts are served concurrently."""

        async def all_of() -> list[RequestOutput]:
            return list(await asyncio.gather(*(self.engine.complete(p, params) for p in prompts)))

        return self._run(all_of())

    def close(self) -> None:
        if self._loop.running:
            self._run(self.engine.shutdown())
            self._loop.stop()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
