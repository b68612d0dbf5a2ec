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


class LLM:
    """Starts an engine on a private event loop thread; `generate` blocks until every
    prompt is answered. Call `close()` (or use `with LLM(...) as llm:`) to stop workers."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.engine = self._run(self._start(config))

    async def _start(self, config: EngineConfig | None) -> Engine:
        engine = Engine(config)
        await engine.start()
        return engine

    def _run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result()

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: GenerationParams | None = None
    ) -> list[RequestOutput]:
        """Final outputs in prompt order; all prompts are served concurrently."""

        async def all_of() -> list[RequestOutput]:
            return list(await asyncio.gather(*(self.engine.complete(p, params) for p in prompts)))

        return self._run(all_of())

    def close(self) -> None:
        if self._thread.is_alive():
            self._run(self.engine.shutdown())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
