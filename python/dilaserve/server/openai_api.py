"""OpenAI request shapes, decoded and type-checked by `msgspec`, plus DiLaServe's own
fields: `slo_ms`, `confidence_threshold`, `block_length`, `steps_per_block`, `priority`,
and Dream's `alg`, `alg_temp` and `top_k`."""

from __future__ import annotations

import re

import msgspec

from dilaserve.decoding import option_problem

from .errors import APIError, bad_request


class StreamOptions(msgspec.Struct, omit_defaults=True):
    include_usage: bool = False


class _Common(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    user: str | None = None
    # DiLaServe's fields.
    slo_ms: float | None = None
    confidence_threshold: float | None = None
    block_length: int | None = None
    steps_per_block: int | None = None
    priority: int = 0
    top_k: int | None = None
    alg: str | None = None
    alg_temp: float | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if len(stops) > 4 or any(not s for s in stops):
            raise bad_request("stop takes up to 4 non-empty strings", "stop")
        return stops

    def check(self) -> None:
        if self.n != 1:
            raise bad_request("only n = 1 is supported", "n")
        if self.max_tokens is not None and self.max_tokens <= 0:
            raise bad_request(f"max_tokens must be positive, got {self.max_tokens}", "max_tokens")
        if self.slo_ms is not None and not self.slo_ms > 0:
            raise bad_request(f"slo_ms must be positive, got {self.slo_ms}", "slo_ms")
        tau = self.confidence_threshold
        if tau is not None and not 0.0 < tau <= 1.0:
            raise bad_request(
                f"confidence_threshold must be in (0, 1], got {tau}", "confidence_threshold"
            )
        if self.block_length is not None and self.block_length <= 0:
            raise bad_request("block_length must be positive", "block_length")
        if self.steps_per_block is not None and self.steps_per_block <= 0:
            raise bad_request("steps_per_block must be positive", "steps_per_block")
        if self.temperature is not None and not 0.0 <= self.temperature <= 2.0:
            raise bad_request(
                f"temperature must be in [0, 2], got {self.temperature}", "temperature"
            )
        problem = option_problem(
            alg=self.alg,
            alg_temp=self.alg_temp or 0.0,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            seed=self.seed,
        )
        if problem is not None:
            raise bad_request(problem[1], problem[0])
        self.stops()


class CompletionRequest(_Common, kw_only=True):
    # A string, token ids, or a list of one string (OpenAI's batch form, one prompt here).
    prompt: str | list[int | str]

    def prompt_input(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt
        if all(isinstance(t, int) for t in prompt):
            return prompt  # type: ignore[return-value]
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        raise bad_request("prompt must be a string, token ids, or a list of one string", "prompt")


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if any(p.type != "text" for p in self.content):
            raise bad_request("only text content parts are supported", "messages")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")


_PATH = re.compile(r"at `\$\.?([A-Za-z_][\w]*)")


def decode(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    """Parses and type-checks a request body; malformed JSON or a wrongly typed field is a
    400 naming the field."""
    try:
        request = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc))
        raise bad_request(str(exc), match.group(1) if match else None) from exc
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
    request.check()  # type: ignore[attr-defined]
    return request
