"""The OpenAI-compatible HTTP front end (aiohttp) on one engine.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as
SSE), `GET /v1/models`, `GET /v1/cluster`, `GET /health` (alive), `GET /ready` (every
instance serving), `GET /metrics` (Prometheus). Bad input is a 4xx with an OpenAI error
body and never reaches the engine; a client that disconnects cancels its request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import jinja2
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dilaserve.engine import (
    BadRequestError,
    Engine,
    EngineClient,
    EngineError,
    RequestOutput,
    RequestStats,
)

from .errors import APIError, bad_request, from_engine
from .metrics import Metrics
from .openai_api import MAX_CHOICES, ChatCompletionRequest, CompletionRequest, decode
from .responses import ResponseShape, usage
from .streaming import StopText, tokens_spelling

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/ready", "/metrics")
#: Bodies smaller than this are parsed on the event loop (a thread hop costs more).
DECODE_ON_LOOP_BYTES = 64 * 1024


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    #: Open connections at once; the next is answered 503 and closed.
    max_connections: int = 2048
    #: A connection's first request head must arrive within this long of connecting, and
    #: every body within this long of its head; slower connections are closed.
    read_timeout_s: float = 10.0
    #: An idle keep-alive connection is closed after this long.
    keepalive_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_body_bytes < 1:
            raise ValueError("max_connections and max_body_bytes must be positive")
        if not (self.read_timeout_s > 0 and self.keepalive_timeout_s > 0):
            raise ValueError("read_timeout_s and keepalive_timeout_s must be positive")


class Server:
    """The state behind the routes: the engine, its metrics and the settings."""

    def __init__(self, engine: Engine | EngineClient, settings: ServerSettings) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = Metrics(engine)
        self._ids = itertools.count(1)

    def app(self) -> web.Application:
        app = web.Application(
            middlewares=[self._errors, self._auth], client_max_size=self.settings.max_body_bytes
        )
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/cluster", self.cluster)
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.prometheus)
        return app

    # -- middlewares -----------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except APIError as exc:
            log.info("%s %s -> %d: %s", request.method, request.path, exc.status, exc.message)
            return exc.response()
        except web.HTTPRequestEntityTooLarge as exc:
            return APIError(413, f"request body too large: {exc.text}").response()
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            return APIError(
                exc.status, exc.reason or "error", type="invalid_request_error"
            ).response()

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        key = self.settings.api_key
        given = request.headers.get("Authorization", "")
        if key and request.path not in OPEN_PATHS and given != f"Bearer {key}":
            raise APIError(
                401, "missing or wrong API key", type="authentication_error", code="invalid_api_key"
            )
        return await handler(request)

    # -- generation ------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._decode(request, CompletionRequest)
        return await self._generate(request, body, body.prompts(), chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._decode(request, ChatCompletionRequest)
        prompt = await asyncio.to_thread(self._chat_prompt, body)
        return await self._generate(request, body, [prompt], chat=True)

    async def _decode(self, request: web.Request, kind: type) -> Any:
        """The checked request body; a large one is parsed off the event loop."""
        body = await self._body(request)
        if len(body) < DECODE_ON_LOOP_BYTES:
            return decode(body, kind)
        return await asyncio.to_thread(decode, body, kind)

    async def _body(self, request: web.Request) -> bytes:
        timeout = self.settings.read_timeout_s
        try:
            async with asyncio.timeout(timeout):
                return await request.read()
        except TimeoutError as exc:
            raise APIError(408, f"the request body did not arrive within {timeout} s") from exc
        except web.HTTPRequestEntityTooLarge as exc:
            limit = self.settings.max_body_bytes
            raise APIError(
                413, f"request body exceeds {limit} bytes", code="request_too_large"
            ) from exc

    def _chat_prompt(self, body: ChatCompletionRequest) -> str:
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template", "messages")
        messages = [
            {"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {})
            for m in body.messages
        ]
        try:
            return tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        except jinja2.TemplateError as exc:  # the template refuses these messages
            raise bad_request(f"the model's chat template: {exc}", "messages") from exc

    async def _generate(
        self, request: web.Request, body, prompts: list[str | list[int]], chat: bool
    ) -> web.StreamResponse:
        """Serves every prompt `n` times, each sample its own engine request; choice
        `i * n + k` is prompt `i`'s sample `k`."""
        if body.model is not None and body.model != self.settings.model_name:
            served = self.settings.model_name
            raise APIError(
                400,
                f"model {body.model!r} is not served here (serving {served!r})",
                param="model",
                code="model_not_found",
            )
        samples = body.samples()
        if len(prompts) * len(samples) > MAX_CHOICES:
            raise bad_request(
                f"{len(prompts)} prompts x n = {len(samples)} exceeds {MAX_CHOICES} choices", "n"
            )
        ids = await self._encode(prompts)
        try:
            reqs = await self.engine.submit([(p, params) for p in ids for params in samples])
        except EngineError as exc:
            self.metrics.ended(type(exc).__name__)
            if isinstance(exc, BadRequestError) and exc.index is not None and len(prompts) > 1:
                raise _prompt_error(exc.index // len(samples), exc) from exc
            raise from_engine(exc) from exc
        rid = request.headers.get("X-Request-Id") or str(next(self._ids))
        log.info("[%s] requests %s admitted (user %s)", rid, [r.id for r in reqs], body.user)
        choices = [
            _Choice(i, self.engine.outputs(req), StopText(body.stops()))
            for i, req in enumerate(reqs)
        ]
        shape = ResponseShape(chat, rid, self.settings.model_name)
        prompt_tokens = sum(len(p) for p in ids)
        try:
            if getattr(body, "echo", False):  # the ids are checked: admitted
                echoes = await self._echoes(prompts, ids)
                for choice in choices:
                    choice.echo = echoes[choice.index // len(samples)]
            if body.streaming:
                return await self._stream(
                    request, shape, choices, prompt_tokens, body.include_usage
                )
            return await self._complete(shape, choices, prompt_tokens)
        finally:  # a choice cut by a stop string, or left by the client, stops here
            for choice, req in zip(choices, reqs, strict=True):
                await choice.outputs.aclose()
                self.engine.cancel(req.id)

    async def _encode(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Each prompt's token ids, text tokenized off the event loop; a bad prompt is a
        400 naming its index when there are several."""
        ids = []
        for index, prompt in enumerate(prompts):
            try:
                if isinstance(prompt, str):
                    ids.append(await asyncio.to_thread(self.engine.encode, prompt))
                else:
                    ids.append(prompt)
            except BadRequestError as exc:
                if len(prompts) > 1:
                    raise _prompt_error(index, exc) from exc
                raise from_engine(exc) from exc
        return ids

    async def _echoes(self, prompts: list[str | list[int]], ids: list[list[int]]) -> list[str]:
        """The text `echo` puts before each prompt's completions: the prompt's."""
        decode = self.engine.tokenizer.decode
        return [
            p if isinstance(p, str) else await asyncio.to_thread(decode, i)
            for p, i in zip(prompts, ids, strict=True)
        ]

    async def _sendable(self, choice: _Choice) -> AsyncIterator[tuple[str, RequestOutput]]:
        """Each update of a choice with the text it lets us send (cut at stop strings),
        until its request ends or a stop string is reached; an engine error is counted and
        raised."""
        stop = choice.stop
        while not ((choice.last is not None and choice.last.finished) or stop.stopped):
            try:
                choice.last = await anext(choice.outputs)
            except EngineError as exc:
                self.metrics.ended(type(exc).__name__)
                raise
            yield stop.feed(choice.last.delta, final=choice.last.finished), choice.last
        if stop.stopped and not choice.last.finished:
            self.metrics.ended("stop_string")  # its statistics, while the request still runs
            stats = await self.engine.request_stats(choice.last.request_id)
            if stats is None:  # it ended meanwhile: its last output, queued, has them
                stats = await _final_stats(choice.outputs)
            choice.ending = "stop", stats
            await choice.outputs.aclose()  # which cancels its remaining steps

    async def _complete(
        self, shape: ResponseShape, choices: list[_Choice], prompt_tokens: int
    ) -> web.Response:
        async def run(choice: _Choice) -> None:
            async for _ in self._sendable(choice):
                pass

        try:
            await _all(run(c) for c in choices)
        except EngineError as exc:
            raise from_engine(exc) from exc
        endings = [self._ending(c) for c in choices]
        bodies = [
            shape.choice(c.index, c.echo + c.stop.text, reason, stats if len(choices) > 1 else None)
            for c, (reason, stats) in zip(choices, endings, strict=True)
        ]
        use = await self._usage(prompt_tokens, choices)
        return web.json_response(shape.full(bodies, use, endings[0][1]))

    async def _stream(
        self,
        request: web.Request,
        shape: ResponseShape,
        choices: list[_Choice],
        prompt_tokens: int,
        include_usage: bool,
    ) -> web.StreamResponse:
        """Server-sent events, the choices' chunks interleaved as their blocks complete;
        each choice's first chunk names the role, its last the finish reason."""
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        # Each choice's task queues its chunks, then None, or the error that ended it.
        events: asyncio.Queue[dict | Exception | None] = asyncio.Queue()

        async def run(choice: _Choice) -> None:
            first = True
            try:
                async for delta, _ in self._sendable(choice):
                    text = choice.echo + delta if first else delta
                    if first or text:
                        events.put_nowait(shape.chunk(choice.index, text, first=first))
                    first = False
                reason, _ = self._ending(choice)
            except Exception as exc:  # handed to the writer below
                events.put_nowait(exc)
                return
            events.put_nowait(shape.chunk(choice.index, "", finish_reason=reason))
            events.put_nowait(None)

        tasks = [asyncio.get_running_loop().create_task(run(c)) for c in choices]
        try:
            running = len(tasks)
            while running:
                item = await events.get()
                if item is None:
                    running -= 1
                elif isinstance(item, EngineError):  # headers are sent: report in the stream
                    await _event(response, from_engine(item).body())
                    await response.write(b"data: [DONE]\n\n")
                    return response
                elif isinstance(item, Exception):
                    raise item
                else:
                    await _event(response, item)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if include_usage:
            stats = self._ending(choices[0])[1] if len(choices) == 1 else None
            use = await self._usage(prompt_tokens, choices)
            await _event(response, shape.usage_chunk(use, stats))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _ending(self, choice: _Choice) -> tuple[str, RequestStats | None]:
        """Finish reason and statistics of a choice whose request finished (one cut by a
        stop string has its ending already). Counted once per choice."""
        if choice.ending is not None:
            return choice.ending
        last = choice.last
        assert last is not None and last.finished
        self.metrics.finished(last.stats)
        choice.ending = ("stop" if choice.stop.stopped else last.finish_reason), last.stats
        return choice.ending

    async def _usage(self, prompt_tokens: int, choices: list[_Choice]) -> dict:
        """Token counts: a completion's tokens as its statistics count them, or, cut by a
        stop string, the generated tokens that spell the text it kept (counted off the
        event loop from the ids the engine sent, never by tokenizing the text again)."""
        completion = 0
        for c in choices:
            if c.stop.stopped:
                ids, kept = c.last.token_ids, len(c.stop.text)
                completion += await asyncio.to_thread(tokens_spelling, self._spell, ids, kept)
            else:
                completion += self._ending(c)[1].completion_tokens
        return usage(prompt_tokens, completion)

    def _spell(self, ids: list[int]) -> str:
        return self.engine.tokenizer.decode(ids, skip_special_tokens=True)

    # -- information -----------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        name = self.settings.model_name
        model = {"id": name, "object": "model", "created": 0, "owned_by": "dilaserve"}
        return web.json_response({"object": "list", "data": [model]})

    async def cluster(self, request: web.Request) -> web.Response:
        status = self.engine.status()
        instances = [
            {k: v for k, v in dataclasses.asdict(i).items() if v is not None and k != "registered"}
            for i in status.instances
        ]
        return web.json_response(
            {
                "instances": instances,
                "active_requests": status.active_requests,
                "overloaded": status.overloaded,
                "plan": None if status.plan is None else dataclasses.asdict(status.plan),
                "step_times": status.step_times,
                "tokens_per_step": status.tokens_per_step,
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        up = self.engine.status().ready
        return web.json_response({"ready": up}, status=200 if up else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )


@dataclass
class _Choice:
    """One choice of a call: its request's updates and what has been sent of them."""

    index: int
    outputs: AsyncIterator[RequestOutput]
    stop: StopText
    #: Text sent before the completion (`echo`).
    echo: str = ""
    last: RequestOutput | None = None
    ending: tuple[str, RequestStats | None] | None = None


def _prompt_error(index: int, error: EngineError) -> APIError:
    """A refused prompt of several fails the whole call, naming its index (as OpenAI)."""
    return bad_request(f"prompt {index}: {error}", "prompt")


async def _final_stats(outputs: AsyncIterator[RequestOutput]) -> RequestStats | None:
    """The statistics of an ended request's last output (None if an error ended it)."""
    stats = None
    try:
        async for output in outputs:
            stats = output.stats
    except EngineError:
        return None
    return stats


async def _all(runs) -> None:
    """Runs every coroutine; the first to fail cancels the rest and its error is raised."""
    try:
        async with asyncio.TaskGroup() as group:
            for run in runs:
                group.create_task(run)
    except BaseExceptionGroup as group:
        raise group.exceptions[0] from None


async def _event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())
