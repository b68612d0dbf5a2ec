"""The OpenAI-compatible HTTP front end (aiohttp) on one engine.

Routes: `POST /v1/completions`, `POST /v1/chat/completions` (both with `stream: true` as
SSE), `GET /v1/models`, `GET /v1/cluster`, `GET /health` (alive), `GET /ready` (every
instance serving), `GET /metrics` (Prometheus). Bad input is a 4xx with an OpenAI error
body and never reaches the engine; a client that disconnects cancels its request.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dilaserve.engine import Engine, EngineError, GenerationParams, RequestOutput

from .errors import APIError, bad_request, from_engine
from .metrics import Metrics
from .openai_api import ChatCompletionRequest, CompletionRequest, decode
from .responses import ResponseShape, usage
from .streaming import StopText

log = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/ready", "/metrics")


@dataclass(frozen=True)
class ServerSettings:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20


class Server:
    """The state behind the routes: the engine, its metrics and the settings."""

    def __init__(self, engine: Engine, settings: ServerSettings) -> None:
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
        body = decode(await self._body(request), CompletionRequest)
        return await self._generate(request, body, body.prompt_input(), chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = decode(await self._body(request), ChatCompletionRequest)
        return await self._generate(request, body, self._chat_prompt(body), chat=True)

    async def _body(self, request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge as exc:
            limit = self.settings.max_body_bytes
            raise APIError(
                413, f"request body exceeds {limit} bytes", code="request_too_large"
            ) from exc

    def _chat_prompt(self, body: ChatCompletionRequest) -> str:
        tokenizer = self.engine.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    async def _generate(
        self, request: web.Request, body, prompt: str | list[int], chat: bool
    ) -> web.StreamResponse:
        if body.model is not None and body.model != self.settings.model_name:
            served = self.settings.model_name
            raise APIError(
                400,
                f"model {body.model!r} is not served here (serving {served!r})",
                param="model",
                code="model_not_found",
            )
        params = GenerationParams(
            max_tokens=body.max_tokens,
            slo_s=None if body.slo_ms is None else body.slo_ms / 1e3,
            threshold=body.confidence_threshold,
            block_length=body.block_length,
            priority=body.priority,
            temperature=body.temperature or 0.0,
            steps_per_block=body.steps_per_block,
            alg=body.alg,
            alg_temp=body.alg_temp or 0.0,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=body.top_k,
            seed=body.seed,
        )
        rid = request.headers.get("X-Request-Id") or str(next(self._ids))
        shape = ResponseShape(chat, rid, self.settings.model_name)
        stop = StopText(body.stops())
        outputs = self.engine.generate(prompt, params)
        async with contextlib.aclosing(outputs):
            try:
                first = await anext(outputs)
            except EngineError as exc:
                self.metrics.ended(type(exc).__name__)
                raise from_engine(exc) from exc
            log.info("[%s] request %d admitted", rid, first.request_id)
            if body.stream:
                include_usage = (
                    body.stream_options is not None and body.stream_options.include_usage
                )
                return await self._stream(request, shape, outputs, first, stop, include_usage)
            return await self._complete(shape, outputs, first, stop)

    async def _sendable(
        self, outputs: AsyncIterator[RequestOutput], first: RequestOutput, stop: StopText
    ) -> AsyncIterator[tuple[str, RequestOutput]]:
        """Each update with the text it lets us send (cut at stop strings), from `first`
        until the request ends or a stop string is reached; an engine error is counted
        and raised."""
        last = first
        yield stop.feed(first.delta, final=first.finished), first
        while not (last.finished or stop.stopped):
            try:
                last = await anext(outputs)
            except EngineError as exc:
                self.metrics.ended(type(exc).__name__)
                raise
            yield stop.feed(last.delta, final=last.finished), last

    async def _complete(
        self, shape: ResponseShape, outputs: AsyncIterator[RequestOutput], first, stop: StopText
    ) -> web.Response:
        try:
            updates = [last async for _, last in self._sendable(outputs, first, stop)]
        except EngineError as exc:
            raise from_engine(exc) from exc
        reason, stats = self._ending(updates[-1], stop)
        body = shape.full(stop.text, reason, self._usage(stats, stop), stats)
        return web.json_response(body)

    async def _stream(
        self,
        request: web.Request,
        shape: ResponseShape,
        outputs: AsyncIterator[RequestOutput],
        first: RequestOutput,
        stop: StopText,
        include_usage: bool,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        last = first
        try:
            async for delta, last in self._sendable(outputs, first, stop):
                if last is first:  # the first chunk names the role, even if empty
                    await _event(response, shape.chunk(delta, first=True))
                elif delta:
                    await _event(response, shape.chunk(delta))
        except EngineError as exc:  # headers are sent: report in the stream
            await _event(response, from_engine(exc).body())
            await response.write(b"data: [DONE]\n\n")
            return response
        reason, stats = self._ending(last, stop)
        await _event(response, shape.chunk("", finish_reason=reason))
        if include_usage:
            await _event(response, shape.usage_chunk(self._usage(stats, stop), stats))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    def _ending(self, last: RequestOutput, stop: StopText):
        """Finish reason and statistics; a request cut by a stop string ends here, and
        leaving the output stream cancels its remaining steps."""
        if last.finished:
            stats = last.stats
            self.metrics.finished(stats)
            return ("stop" if stop.stopped else last.finish_reason), stats
        stats = self.engine.stats_of(last.request_id)
        self.metrics.ended("stop_string")
        return "stop", stats

    def _usage(self, stats, stop: StopText) -> dict:
        tokenizer = self.engine.tokenizer
        completion = len(tokenizer(stop.text, add_special_tokens=False)["input_ids"])
        return usage(stats.prompt_tokens if stats else 0, completion)

    # -- information -----------------------------------------------------------------------

    async def models(self, request: web.Request) -> web.Response:
        name = self.settings.model_name
        model = {"id": name, "object": "model", "created": 0, "owned_by": "dilaserve"}
        return web.json_response({"object": "list", "data": [model]})

    async def cluster(self, request: web.Request) -> web.Response:
        engine = self.engine
        instances = []
        for inst in sorted(engine.instances.values(), key=lambda i: i.id):
            entry = {
                "id": inst.id,
                "tp": inst.tp,
                "gpus": list(inst.gpus),
                "node": inst.node,
                "state": _state(inst),
                "restarts": inst.restarts,
            }
            if inst.registered:
                info = engine.scheduler.instance(inst.id)
                entry |= {
                    "batch_tokens": info.batch_tokens,
                    "residents": info.residents,
                    "resident_tokens": info.resident_tokens,
                    "steps_run": info.steps_run,
                }
            instances.append(entry)
        plan = engine.reconfigurer.last_plan
        if plan is not None:
            degrees = {d.degree: d.instances for d in plan.capacity.degrees}
            plan = {"adopted": plan.adopted, "reason": plan.reason, "degrees": degrees}
        return web.json_response(
            {
                "instances": instances,
                "active_requests": engine.active_requests,
                "overloaded": engine.scheduler.overloaded,
                "plan": plan,
                "step_times": dataclasses.asdict(engine.step_times),
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        instances = self.engine.instances.values()
        up = bool(instances) and all(i.registered for i in instances)
        return web.json_response({"ready": up}, status=200 if up else 503)

    async def prometheus(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )


def _state(inst) -> str:
    if inst.stopping:
        return "stopping"
    return "serving" if inst.registered else "starting"


async def _event(response: web.StreamResponse, payload: dict) -> None:
    await response.write(f"data: {json.dumps(payload)}\n\n".encode())
