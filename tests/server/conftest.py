"""A server on a loopback port, serving the embedded dilaserve-tiny, run on a background
event loop; tests talk to it over real HTTP (the official `openai` client, aiohttp)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import openai
import pytest

from dilaserve.engine import Engine, EngineClient, EngineConfig, Launcher
from dilaserve.engine.offline import LoopThread
from dilaserve.server import ServerSettings, bind, serve

API_KEY = "test-key"  # test_server.py uses the same


class LiveServer(LoopThread):
    """With `core_process`, the engine core runs in its own process (`EngineClient`, as
    `dilaserve serve` runs it); else in the server's (`Engine`), where tests can reach it."""

    def __init__(
        self,
        config: EngineConfig,
        settings: ServerSettings,
        launcher: Launcher | None = None,
        core_process: bool = False,
    ) -> None:
        super().__init__()
        if core_process:
            assert launcher is None, "a core process makes its own launcher"
            self.engine: Engine | EngineClient = EngineClient(config)
        else:
            self.engine = Engine(config, launcher)
        sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.settings = settings
        started = asyncio.Event()
        self.stopping = asyncio.Event()
        self.task = asyncio.run_coroutine_threadsafe(
            serve(self.engine, settings, sock, started=started, stop=self.stopping), self.loop
        )
        self.run(asyncio.wait_for(started.wait(), 300))

    def run(self, coroutine, timeout: float | None = 300):
        return super().run(coroutine, timeout)

    def client(self, api_key: str | None = None, **kw) -> openai.OpenAI:
        key = api_key if api_key is not None else (self.settings.api_key or "none")
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, **kw)

    def close(self) -> None:
        if not self.task.done():  # one that ended (its engine core died) was checked
            self.loop.call_soon_threadsafe(self.stopping.set)
            self.task.result(120)
        self.stop()


def _start_servers(tiny_profile: str) -> Iterator:
    started: list[LiveServer] = []

    def start(
        settings: ServerSettings | None = None,
        launcher: Launcher | None = None,
        core_process: bool = False,
        **config,
    ) -> LiveServer:
        engine_config = EngineConfig(**{"profile": tiny_profile, "threads_per_worker": 1, **config})
        settings = settings or ServerSettings("dilaserve-tiny")
        live = LiveServer(engine_config, settings, launcher, core_process)
        started.append(live)
        return live

    yield start
    for live in started:
        live.close()


@pytest.fixture
def start_server(tiny_profile) -> Iterator:
    """`start_server(settings, launcher, core_process, **config)` starts a server that is
    stopped after the test."""
    yield from _start_servers(tiny_profile)


@pytest.fixture(scope="module")
def start_module_server(tiny_profile) -> Iterator:
    """`start_server` for a server that the tests of one module share."""
    yield from _start_servers(tiny_profile)


@pytest.fixture(scope="module")
def server(tiny_profile) -> Iterator[LiveServer]:
    """One two-instance server with an API key and a small body limit, shared by a module."""
    config = EngineConfig(profile=tiny_profile, threads_per_worker=1, instances=(1, 1))
    settings = ServerSettings("dilaserve-tiny", api_key=API_KEY, max_body_bytes=64 * 1024)
    live = LiveServer(config, settings)
    yield live
    live.close()
