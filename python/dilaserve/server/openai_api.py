"""OpenAI request shapes, decoded and type-checked by `msgspec`, plus DiLaServe's own
fields: `slo_ms`, `confidence_threshold`, `block_length`, `steps_per_block`,
`threshold_floor`, `priority`, and Dream's `alg`, `alg_temp` and `top_k`.

Every field of OpenAI's schema for the two operations is declared here and either
honoured or, set to anything but its neutral value, refused with a 400 that names it
(`UNSUPPORTED`); `null` means the field's default; a field outside the schema is a 400
naming it. Ranges are checked while decoding, so no value reaches the engine unbounded.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Annotated, Any

import msgspec

from dilaserve.decoding import option_problem
from dilaserve.engine import GenerationParams

from .errors import APIError, bad_request

#: Most choices one call may ask for (prompts × `n`).
MAX_CHOICES = 128
#: Deepest JSON nesting a body may have (OpenAI's bodies need 6).
MAX_DEPTH = 32

Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]
Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
Count = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
Choices = Annotated[int, msgspec.Meta(ge=1, le=MAX_CHOICES)]
Penalty = Annotated[float, msgspec.Meta(ge=-2.0, le=2.0)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = None
    #: Random padding of stream chunks: this server sends none (`true` is refused).
    include_obfuscation: bool | None = None

    def check(self) -> None:
        if self.include_obfuscation:
            raise bad_request("stream obfuscation is not supported", "stream_options")


def _off(value: Any) -> bool:
    """The neutral value of a field we do not implement: absent, null, 0, false or empty."""
    return value is None or value is False or value == 0 or value == [] or value == {}


#: Fields of OpenAI's schema this server does not implement, with the values that ask for
#: nothing (anything else is a 400 naming the field) and why.
UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "frequency_penalty": (_off, "a diffusion model commits tokens in parallel; no penalty"),
    "presence_penalty": (_off, "a diffusion model commits tokens in parallel; no penalty"),
    "logit_bias": (_off, "logit_bias is not supported"),
    # Completions' `logprobs: 0` asks for the sampled tokens' log-probabilities.
    "logprobs": (lambda v: v is None or v is False, "log-probabilities are not returned"),
    "top_logprobs": (_off, "log-probabilities are not returned"),
    "suffix": (lambda v: v is None or v == "", "suffix (infilling) is not supported"),
    "response_format": (
        lambda v: v is None or v.get("type") == "text",
        "only the text response format is supported",
    ),
    "tools": (_off, "tool calls are not supported"),
    "tool_choice": (lambda v: v is None or v == "none", "tool calls are not supported"),
    "functions": (_off, "function calls are not supported"),
    "function_call": (lambda v: v is None or v == "none", "function calls are not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only text output is supported"),
    "audio": (_off, "audio output is not supported"),
    "prediction": (_off, "predicted outputs are not supported"),
    "reasoning_effort": (_off, "this model has no reasoning effort setting"),
    "verbosity": (_off, "this model has no verbosity setting"),
    "web_search_options": (lambda v: v is None, "web search is not supported"),
    "store": (_off, "completions are not stored by this server"),
    "moderation": (lambda v: v is None, "moderation is not supported"),
}


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    max_tokens: Count | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    n: Choices | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    seed: Int64 | None = None
    #: An end-user id (OpenAI's abuse monitoring): logged with the request.
    user: str | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    # DiLaServe's fields.
    slo_ms: Annotated[float, msgspec.Meta(gt=0.0, le=1e9)] | None = None
    confidence_threshold: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] | None = None
    block_length: Count | None = None
    steps_per_block: Count | None = None
    threshold_floor: bool | None = None
    priority: Int32 | None = None
    top_k: Count | None = None
    alg: str | None = None
    alg_temp: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] | None = None

    @property
    def choices_per_prompt(self) -> int:
        return self.n or 1

    @property
    def streaming(self) -> bool:
        return bool(self.stream)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if len(stops) > 4 or any(not s for s in stops):
            raise bad_request("stop takes up to 4 non-empty strings", "stop")
        return stops

    def check(self) -> None:
        for name, (neutral, why) in UNSUPPORTED.items():
            if not neutral(getattr(self, name, None)):
                raise bad_request(f"{name}: {why}", name)
        if self.stream_options is not None:
            self.stream_options.check()
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

    def samples(self) -> list[GenerationParams]:
        """The parameters of each of the `n` samples of one prompt: independent requests,
        with distinct seeds when a seed is given (greedy samples are identical)."""
        return [self._params(sample) for sample in range(self.choices_per_prompt)]

    def _params(self, sample: int) -> GenerationParams:
        seed = self.seed
        if seed is not None and sample:
            seed = (seed + sample + 2**63) % 2**64 - 2**63  # stays a signed 64-bit seed
        return GenerationParams(
            max_tokens=self.output_limit,
            slo_s=None if self.slo_ms is None else self.slo_ms / 1e3,
            threshold=self.confidence_threshold,
            block_length=self.block_length,
            priority=self.priority or 0,
            temperature=self.temperature or 0.0,
            steps_per_block=self.steps_per_block,
            threshold_floor=bool(self.threshold_floor),
            alg=self.alg,
            alg_temp=self.alg_temp or 0.0,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            seed=seed,
        )


class CompletionRequest(_Common, kw_only=True):
    #: A string, a list of strings, token ids, or a list of token-id lists.
    prompt: str | list[str | int | list[int]]
    #: Candidates per prompt to choose the `n` best from; only `n` (nothing to rank by).
    best_of: Choices | None = None
    #: The prompt's text before each completion's.
    echo: bool | None = None
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one request each, in order."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise bad_request("prompt must not be an empty list", "prompt")
        if all(isinstance(t, int) for t in prompt):
            return [prompt]  # type: ignore[list-item]
        if all(isinstance(p, str) for p in prompt) or all(isinstance(p, list) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]
        raise bad_request(
            "prompt must be a string, a list of strings, token ids, or a list of token-id "
            "lists (not a mix)",
            "prompt",
        )

    def check(self) -> None:
        super().check()
        if self.best_of is not None and self.best_of != self.choices_per_prompt:
            raise bad_request(
                f"best_of must equal n ({self.choices_per_prompt}): ranking candidates needs "
                "sequence log-probabilities, which this server does not compute",
                "best_of",
            )


class ContentPart(msgspec.Struct, forbid_unknown_fields=True):
    type: str
    text: str | None = None
    # The other part kinds' fields, refused with their kind (only text is served).
    image_url: dict | None = None
    input_audio: dict | None = None
    file: dict | None = None
    refusal: str | None = None
    prompt_cache_breakpoint: dict | None = None


#: Message roles of OpenAI's schema (`function` is its deprecated form of `tool`).
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    content: str | list[ContentPart] | None = None
    #: A participant's name: chat templates may use it.
    name: str | None = None
    tool_calls: list[dict] | None = None
    function_call: dict | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    audio: dict | None = None

    def text(self) -> str:
        if self.role not in ROLES:
            raise bad_request(f"unknown message role {self.role!r}", "messages")
        if self.tool_calls or self.function_call or self.audio:
            raise bad_request("tool calls and audio in messages are not supported", "messages")
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        if any(p.type != "text" for p in self.content):
            raise bad_request("only text content parts are supported", "messages")
        return "".join(p.text or "" for p in self.content)


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    #: Output token limit; wins over the older `max_tokens`.
    max_completion_tokens: Count | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    #: Meaningless without tools: accepted.
    parallel_tool_calls: bool | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict | None = None
    store: bool | None = None
    moderation: dict | None = None
    #: Accepted for compatibility; they do not change how a request is served here (no
    #: tiers; prompts are not cached across requests; identifiers are not stored).
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    safety_identifier: str | None = None

    @property
    def output_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def check(self) -> None:
        super().check()
        if not self.messages:
            raise bad_request("messages must not be empty", "messages")


# The top-level field a msgspec error is about: its path, else the unknown field it names.
_PATH = re.compile(r"at `\$\.?([A-Za-z_][\w]*)")
_UNKNOWN = re.compile(r"unknown field `([^`]*)`")


def decode(body: bytes, kind: type[msgspec.Struct]) -> msgspec.Struct:
    """Parses and type-checks a request body; malformed JSON, nesting deeper than
    `MAX_DEPTH`, a wrongly typed or out-of-range field or an unknown one is a 400 naming
    the field."""
    if _depth_exceeds(body, MAX_DEPTH):
        raise APIError(400, f"the request body nests deeper than {MAX_DEPTH} levels")
    try:
        request = msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        match = _PATH.search(str(exc)) or _UNKNOWN.search(str(exc))
        raise bad_request(str(exc), match.group(1) if match else None) from exc
    except msgspec.DecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from exc
    request.check()  # type: ignore[attr-defined]
    return request


_NESTING = re.compile(rb'[\[{]|[\]}]|"(?:[^"\\]|\\.)*"')


def _depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether the JSON text opens more than `limit` arrays or objects inside each other
    (strings skipped), found before the decoder recurses into them."""
    opens = body.count(b"[") + body.count(b"{")
    if opens <= limit:
        return False
    depth = 0
    for match in _NESTING.finditer(body):
        token = match.group(0)
        if token in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return True
        elif token in (b"]", b"}"):
            depth -= 1
    return False
