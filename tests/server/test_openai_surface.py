"""OpenAI's request surface as clients send it: lists of prompts, `n` samples,
`max_completion_tokens`, `echo`, `null` for defaults, and every field of OpenAI's own
schema for the two operations (a checked-in copy) honoured or refused by name."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import msgspec
import openai
import pytest
from tiny_problems import PINNED_TAU

from dilaserve.server.openai_api import (
    UNSUPPORTED,
    ChatCompletionRequest,
    CompletionRequest,
)
from dilaserve.tiny.tasks import gen_length, make_problems

SCHEMA = json.loads((Path(__file__).parent / "data" / "openai_requests.json").read_text())
ADDITIONS = {"12345+67890=": "80235", "11111+22222=": "33333", "23456+11111=": "34567"}


@pytest.fixture(scope="module")
def live(start_module_server):
    return start_module_server(instances=(1, 1))


async def _post(url: str, body: dict | bytes) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as s, s.post(url, data=data, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def post(live, path: str, body: dict | bytes) -> tuple[int, dict]:
    return asyncio.run(_post(f"{live.url}/v1/{path}", body))


# -- lists of prompts and n ---------------------------------------------------------------


def test_a_list_of_prompts_gets_one_choice_per_prompt_in_order(live):
    prompts = list(ADDITIONS)
    resp = live.client().completions.create(model="dilaserve-tiny", prompt=prompts, max_tokens=8)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == list(ADDITIONS.values())
    assert resp.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert resp.usage.completion_tokens == sum(len(a) for a in ADDITIONS.values())


def test_token_id_prompts_alone_and_in_a_list(live):
    tokenizer = live.engine.tokenizer
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in ADDITIONS]
    client = live.client()
    one = client.completions.create(model="dilaserve-tiny", prompt=ids[0], max_tokens=8)
    assert one.choices[0].text == "80235"
    many = client.completions.create(model="dilaserve-tiny", prompt=ids, max_tokens=8)
    assert [c.text for c in many.choices] == list(ADDITIONS.values())


def test_a_streamed_list_interleaves_choices_by_index(live):
    (tr,) = make_problems(1, 5, tasks=("tr",))
    prompts = [tr.prompt, "12345+67890="]
    stream = live.client().completions.create(
        model="dilaserve-tiny",
        prompt=prompts,
        max_tokens=gen_length(tr, 32),
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, reasons, ended = ["", ""], [None, None], []
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            reasons[choice.index] = reasons[choice.index] or choice.finish_reason
            if choice.finish_reason:
                ended.append(choice.index)
    assert texts[1] == "80235" and tr.answer == texts[0]
    assert reasons == ["stop", "stop"]
    assert ended == [1, 0], "the one-block answer ends while the five-block one streams"
    assert chunk.usage.completion_tokens == len(tr.answer) + 5


def test_a_bad_prompt_in_a_list_fails_the_call_naming_its_index(live):
    before = live.engine._next_request_id
    status, body = post(
        live, "completions", {"prompt": ["12345+67890=", "1" * 5000, "1+1="], "max_tokens": 8}
    )
    assert status == 400 and body["error"]["param"] == "prompt"
    assert body["error"]["message"].startswith("prompt 1:")
    assert live.engine.active_requests == 0 and live.engine._next_request_id == before
    status, body = post(live, "completions", {"prompt": ["12345+67890=", [5, 3]], "max_tokens": 8})
    assert status == 400 and "mix" in body["error"]["message"]


def test_n_samples_are_independent_requests_with_distinct_seeds(live):
    client = live.client()
    args = {
        "model": "dilaserve-tiny",
        "prompt": "draw:ajdhmnff,asxfmnee,kjxfmxef,asxhlfef>",
        "max_tokens": 32,
        "temperature": 1.5,
        "extra_body": {"confidence_threshold": PINNED_TAU},
    }
    together = client.completions.create(n=3, seed=7, **args)
    assert [c.index for c in together.choices] == [0, 1, 2]
    alone = [client.completions.create(seed=s, **args).choices[0].text for s in (7, 8, 9)]
    assert [c.text for c in together.choices] == alone and len(set(alone)) > 1
    greedy = client.completions.create(
        n=2, model="dilaserve-tiny", prompt="12345+67890=", max_tokens=8
    )
    assert [c.text for c in greedy.choices] == ["80235", "80235"]
    both = client.completions.create(
        n=2, model="dilaserve-tiny", prompt=["12345+67890=", "11111+22222="], max_tokens=8
    )
    assert [c.text for c in both.choices] == ["80235", "80235", "33333", "33333"]


def test_best_of_equal_to_n_is_served_and_otherwise_refused(live):
    client = live.client()
    resp = client.completions.create(
        model="dilaserve-tiny", prompt="12345+67890=", max_tokens=8, n=2, best_of=2
    )
    assert len(resp.choices) == 2
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="dilaserve-tiny", prompt="12345+67890=", max_tokens=8, best_of=3
        )
    assert info.value.response.json()["error"]["param"] == "best_of"
    status, body = post(live, "completions", {"prompt": ["1+1="] * 65, "n": 2})
    assert status == 400 and body["error"]["param"] == "n"


def test_chat_n_samples(live):
    resp = live.client().chat.completions.create(
        model="dilaserve-tiny",
        messages=[{"role": "user", "content": "12345+67890="}],
        n=2,
        max_tokens=8,
    )
    assert [(c.index, c.message.content) for c in resp.choices] == [(0, "80235"), (1, "80235")]


# -- output limits, echo, nulls ------------------------------------------------------------


def test_max_completion_tokens_is_honoured_and_wins_over_max_tokens(live):
    (tr,) = make_problems(1, 11, tasks=("tr",))
    messages = [{"role": "user", "content": tr.prompt}]
    client = live.client()
    for extra in ({}, {"max_tokens": 128}):
        resp = client.chat.completions.create(
            model="dilaserve-tiny", messages=messages, max_completion_tokens=32, **extra
        )
        assert resp.choices[0].finish_reason == "length"
        assert resp.choices[0].message.content == tr.answer[:32]


def test_echo_puts_the_prompt_before_the_completion(live):
    client = live.client()
    resp = client.completions.create(
        model="dilaserve-tiny", prompt="12345+67890=", max_tokens=8, echo=True
    )
    assert resp.choices[0].text == "12345+67890=80235"
    stream = client.completions.create(
        model="dilaserve-tiny", prompt="12345+67890=", max_tokens=8, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in stream) == "12345+67890=80235"


def test_echo_of_token_ids_is_checked_before_decoding(live):
    status, body = post(live, "completions", {"prompt": [-1], "echo": True, "max_tokens": 8})
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_chat_messages_are_checked_field_by_field(live):
    for message, why in (
        ({"role": "user", "content": "1+1=", "colour": "red"}, "colour"),
        ({"role": "wizard", "content": "1+1="}, "role"),
        ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}, "text"),
    ):
        status, body = post(live, "chat/completions", {"messages": [message], "max_tokens": 8})
        assert status == 400 and body["error"]["param"] == "messages", body
        assert why in body["error"]["message"]


def test_null_means_the_default(live):
    nulls = {
        "stream": None,
        "n": None,
        "max_tokens": None,
        "temperature": None,
        "top_p": None,
        "stop": None,
        "seed": None,
        "stream_options": None,
        "logprobs": None,
        "echo": None,
        "best_of": None,
        "frequency_penalty": None,
        "presence_penalty": None,
        "logit_bias": None,
        "suffix": None,
        "user": None,
        "priority": None,
    }
    status, body = post(live, "completions", {"prompt": "12345+67890="} | nulls)
    assert status == 200 and body["choices"][0]["text"] == "80235"
    chat_nulls = {k: v for k, v in nulls.items() if k not in ("echo", "best_of", "suffix")}
    chat = {"messages": [{"role": "user", "content": "12345+67890="}]} | chat_nulls
    chat |= {"max_completion_tokens": None, "top_logprobs": None, "tools": None, "store": None}
    status, body = post(live, "chat/completions", chat)
    assert status == 200 and body["choices"][0]["message"]["content"] == "80235"


def test_a_field_outside_the_schema_is_refused_by_name(live):
    status, body = post(live, "completions", {"prompt": "1+1=", "max_tokns": 8})
    assert status == 400 and body["error"]["param"] == "max_tokns"


# -- OpenAI's schema, field by field --------------------------------------------------------


def _properties(name: str) -> dict:
    schemas = SCHEMA["components"]["schemas"]
    props: dict = {}

    def walk(schema: dict) -> None:
        if "$ref" in schema:
            walk(schemas[schema["$ref"].rsplit("/", 1)[1]])
        for part in schema.get("allOf", []):
            walk(part)
        props.update(schema.get("properties", {}))

    walk(schemas[name])
    return props


#: Fields served as OpenAI describes them, each with the test that shows it.
HONOURED = {
    "model": "test_completion_with_usage_and_dilaserve_stats",
    "prompt": "test_a_list_of_prompts_gets_one_choice_per_prompt_in_order",
    "messages": "test_chat_uses_the_models_template",
    "max_tokens": "test_completion_with_usage_and_dilaserve_stats",
    "max_completion_tokens": "test_max_completion_tokens_is_honoured_and_wins_over_max_tokens",
    "n": "test_n_samples_are_independent_requests_with_distinct_seeds",
    "best_of": "test_best_of_equal_to_n_is_served_and_otherwise_refused",
    "echo": "test_echo_puts_the_prompt_before_the_completion",
    "stream": "test_a_streamed_list_interleaves_choices_by_index",
    "stream_options": "test_chat_stream_with_usage",
    "stop": "test_stop_strings_cut_the_text",
    "temperature": "test_a_seeded_request_samples_what_it_samples_alone",
    "top_p": "test_dreams_generation_options_through_the_openai_client",
    "seed": "test_a_seeded_request_samples_what_it_samples_alone",
    "user": "logged with the request",
    "parallel_tool_calls": "meaningless without tools",
    "metadata": "accepted, not stored",
    "service_tier": "no tiers here",
    "prompt_cache_key": "prompts are not cached across requests",
    "prompt_cache_retention": "prompts are not cached across requests",
    "prompt_cache_options": "prompts are not cached across requests",
    "safety_identifier": "accepted, not stored",
}

#: A value of each refused field that asks for something.
ASKING = {
    "frequency_penalty": 0.5,
    "presence_penalty": -0.5,
    "logit_bias": {"5": 10},
    "logprobs": 0,
    "top_logprobs": 3,
    "suffix": "=",
    "response_format": {"type": "json_object"},
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "required",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
    "store": True,
    "moderation": {"model": "omni-moderation-latest"},
}


@pytest.mark.parametrize(
    "schema, kind, path",
    [
        ("CreateCompletionRequest", CompletionRequest, "completions"),
        ("CreateChatCompletionRequest", ChatCompletionRequest, "chat/completions"),
    ],
)
def test_every_field_of_openais_schema_is_honoured_or_refused_by_name(live, schema, kind, path):
    fields = _properties(schema)
    declared = {f.name for f in msgspec.structs.fields(kind)}
    assert set(fields) <= declared, f"undeclared: {set(fields) - declared}"
    assert set(fields) <= set(HONOURED) | set(UNSUPPORTED)
    base = (
        {"messages": [{"role": "user", "content": "1+1="}]}
        if path.startswith("chat")
        else {"prompt": "1+1="}
    ) | {"max_tokens": 8}
    for name in sorted(set(fields) & set(UNSUPPORTED)):
        chat_flag = name == "logprobs" and path.startswith("chat")  # chat's is a flag
        value = True if chat_flag else ASKING[name]
        status, body = post(live, path, base | {name: value})
        assert status == 400, (name, body)
        assert body["error"]["param"] == name, (name, body)
