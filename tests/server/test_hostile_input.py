"""No request can hurt the server or another request: sizes are checked before anything is
allocated, every bad body is a 400 with OpenAI's error JSON, long prompts are refused
before they are tokenized, idle and slow connections are closed, connections are capped,
and a bounded fuzz run of both endpoints leaves the server answering correctly."""

from __future__ import annotations

import asyncio
import json
import socket
import time
import tracemalloc

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dilaserve.engine import BadRequestError, EngineConfig, GenerationParams
from dilaserve.engine.admission import RequestBuilder
from dilaserve.scheduler import LatencyProfile
from dilaserve.server import ServerSettings
from dilaserve.tiny import default_model_dir

HUGE = [2**31, 2**63 - 1, 2**64, 10**30]


@pytest.fixture(scope="module")
def live(start_module_server):
    settings = ServerSettings("dilaserve-tiny", read_timeout_s=0.5, keepalive_timeout_s=0.5)
    return start_module_server(settings, instances=(1,))


async def _post(url: str, data: bytes) -> tuple[int, str, dict]:
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        return r.status, r.content_type, await r.json(content_type=None)


def post(live, path: str, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, content_type, answer = asyncio.run(_post(f"{live.url}/v1/{path}", data))
    assert content_type == "application/json"
    return status, answer


def assert_openai_error(status: int, body: dict, param: str | None = None) -> None:
    assert status == 400, body
    assert set(body["error"]) == {"message", "type", "param", "code"}
    if param is not None:
        assert body["error"]["param"] == param, body


@pytest.fixture(scope="module")
def builder(tiny_profile) -> RequestBuilder:
    config = EngineConfig(profile=tiny_profile)
    return RequestBuilder(config, str(default_model_dir()), LatencyProfile.load(tiny_profile))


@pytest.mark.parametrize(
    "params",
    [
        GenerationParams(max_tokens=10**12),
        GenerationParams(max_tokens=8, block_length=10**12),
        GenerationParams(max_tokens=2**63 - 1, block_length=2**62),
    ],
)
def test_sizes_are_checked_before_anything_is_allocated(builder, params):
    tracemalloc.start()
    try:
        with pytest.raises(BadRequestError, match="context"):
            builder.build(1, [5, 6, 7], params)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(builder, monkeypatch):
    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized a prompt that cannot fit")

    monkeypatch.setattr("dilaserve.engine.admission.encode_prompt", no_tokenizing)
    with pytest.raises(BadRequestError, match="cannot fit"):
        builder.prompts.prompt_ids("1" * 1_000_000)
    with pytest.raises(BadRequestError, match="no room"):
        builder.prompts.prompt_ids([5] * 1_000_000)


@pytest.mark.parametrize("value", HUGE)
@pytest.mark.parametrize("field", ["max_tokens", "block_length", "priority", "n"])
def test_huge_numbers_are_400s_naming_the_field(live, field, value):
    status, body = post(live, "completions", {"prompt": "1+1=", field: value})
    assert_openai_error(status, body)
    assert body["error"]["param"] in (field, None)


@pytest.mark.parametrize("field", ["max_tokens", "block_length"])
def test_sizes_beyond_the_context_are_400s_and_the_server_stays_responsive(live, field):
    status, body = post(live, "completions", {"prompt": "12345+67890=", field: 10**9})
    assert_openai_error(status, body)
    assert "context" in body["error"]["message"]
    status, body = post(live, "completions", {"prompt": "12345+67890=", "max_tokens": 8})
    assert status == 200 and body["choices"][0]["text"] == "80235"


@pytest.mark.parametrize(
    "field, text", [("max_tokens", "1e13"), ("max_tokens", "8.5"), ("slo_ms", "1e400")]
)
def test_floats_where_integers_belong_and_infinities(live, field, text):
    body = f'{{"prompt": "1+1=", "{field}": {text}}}'.encode()
    assert_openai_error(*post(live, "completions", body), field)


def test_deep_nesting_is_a_400_not_a_crash(live):
    deep = b'{"prompt": "1+1=", "metadata": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    status, body = post(live, "completions", deep)
    assert_openai_error(status, body)
    assert "nests deeper" in body["error"]["message"]
    brackets_in_text = json.dumps({"prompt": "[{" * 50 + "1+1=", "max_tokens": 8}).encode()
    _, body = post(live, "completions", brackets_in_text)
    assert "nests deeper" not in json.dumps(body)


def test_a_million_digit_prompt_is_refused_and_others_are_served(live):
    status, body = post(live, "completions", {"prompt": "1" * 1_000_000, "max_tokens": 8})
    assert_openai_error(status, body)
    status, body = post(live, "completions", {"prompt": "12345+67890=", "max_tokens": 8})
    assert status == 200 and body["choices"][0]["text"] == "80235"


def _port(live) -> int:
    return int(live.url.rsplit(":", 1)[1])


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (reads EOF or a reset) within `seconds`."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


@pytest.fixture(scope="module")
def long_keepalive(start_module_server):
    """A server whose keep-alive timeout cannot close anything a test waits for: what
    closes a connection there is the read timeout."""
    settings = ServerSettings("dilaserve-tiny", read_timeout_s=0.5, keepalive_timeout_s=600)
    return start_module_server(settings, instances=(1,))


@pytest.mark.parametrize("opening", [b"", b"\r\n\r\n"], ids=["head", "blank-lines-first"])
def test_slowloris_connections_are_closed_while_they_dribble(long_keepalive, opening):
    slow = socket.create_connection(("127.0.0.1", _port(long_keepalive)))
    slow.sendall(opening + b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    closed = False
    for _ in range(200):  # a header line now and then, never the end of the head
        time.sleep(0.05)
        try:
            slow.sendall(b"X-Slow: 1\r\n")
        except (BrokenPipeError, ConnectionResetError):
            closed = True
            break
    slow.close()
    assert closed, "a connection sending a head for 10 s was still open"


def test_idle_connections_are_closed(long_keepalive):
    idle = socket.create_connection(("127.0.0.1", _port(long_keepalive)))
    assert _closed_within(idle, 30)
    idle.close()


def test_idle_keep_alive_connections_are_closed(live):
    sock = socket.create_connection(("127.0.0.1", _port(live)))
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert b"200 OK" in sock.recv(4096)
    assert _closed_within(sock, 30)
    sock.close()


def test_connections_past_the_cap_get_503_and_the_rest_are_served(start_server):
    live = start_server(ServerSettings("dilaserve-tiny", max_connections=4), instances=(1,))
    port = _port(live)
    held = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
    try:
        extra = socket.create_connection(("127.0.0.1", port))
        extra.settimeout(30)
        answer = extra.recv(4096)
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        extra.close()
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 30
    while True:  # the held connections' slots come back as the server sees them close
        try:
            status, body = post(live, "completions", {"prompt": "12345+67890=", "max_tokens": 8})
            break
        except aiohttp.ClientError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert status == 200 and body["choices"][0]["text"] == "80235"


# -- a bounded fuzz run ---------------------------------------------------------------------

FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "best_of",
    "stream", "stream_options", "stop", "temperature", "top_p", "seed", "echo", "logprobs",
    "top_logprobs", "logit_bias", "suffix", "user", "frequency_penalty", "presence_penalty",
    "response_format", "tools", "slo_ms", "confidence_threshold", "block_length",
    "steps_per_block", "priority", "top_k", "alg", "alg_temp",
]  # fmt: skip
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
bodies = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=10), json_values, max_size=8)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=bodies, chat=st.booleans())
def test_fuzzed_bodies_never_get_a_5xx(live, body, chat):
    data = json.dumps(body, allow_nan=False).encode()
    path = "chat/completions" if chat else "completions"

    async def send() -> tuple[int, str]:
        async with aiohttp.ClientSession() as s, s.post(f"{live.url}/v1/{path}", data=data) as r:
            return r.status, await r.text()

    status, text = asyncio.run(asyncio.wait_for(send(), 120))
    assert status < 500, text
    if status >= 400:
        assert set(json.loads(text)["error"]) == {"message", "type", "param", "code"}


def test_the_server_answers_correctly_after_the_fuzz_run(live):
    status, body = post(live, "completions", {"prompt": "12345+67890=", "max_tokens": 8})
    assert status == 200 and body["choices"][0]["text"] == "80235"
    assert live.engine.active_requests == 0
