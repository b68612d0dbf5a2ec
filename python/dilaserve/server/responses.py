"""OpenAI response bodies (completion, chat, their stream chunks) with usage and the
`dilaserve` object that says how the request was served."""

from __future__ import annotations

import time

from dilaserve.engine import RequestStats


def served(stats: RequestStats | None) -> dict | None:
    if stats is None:
        return None
    return {
        "steps": stats.steps,
        "recompute_steps": stats.recompute_steps,
        "mean_threshold": stats.mean_tau,
        "min_threshold": stats.min_tau,
        "instances": list(stats.instances),
        "migrations": stats.migrations,
        "queue_ms": 1e3 * stats.queue_s,
        "latency_ms": 1e3 * stats.latency_s,
        "slo_ms": 1e3 * stats.slo_s,
        "slo_met": stats.slo_met,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class ResponseShape:
    """Builds the bodies of one request, completion or chat."""

    def __init__(self, chat: bool, request_id: str, model: str) -> None:
        self.chat = chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{request_id}"
        self.model = model
        self.created = int(time.time())

    def _envelope(self, object_: str, choices: list[dict]) -> dict:
        return {
            "id": self.id,
            "object": object_,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def choice(
        self, index: int, text: str, finish_reason: str, stats: RequestStats | None = None
    ) -> dict:
        """One choice of a full response; `stats` (of calls with several choices) says how
        this one was served."""
        if self.chat:
            body = {
                "index": index,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason,
            }
        else:
            body = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return body if stats is None else body | {"dilaserve": served(stats)}

    def full(self, choices: list[dict], use: dict, stats: RequestStats | None) -> dict:
        """The response; `stats` (of the first choice) is the top-level `dilaserve`."""
        object_ = "chat.completion" if self.chat else "text_completion"
        return self._envelope(object_, choices) | {"usage": use, "dilaserve": served(stats)}

    def chunk(
        self, index: int, delta: str, finish_reason: str | None = None, first: bool = False
    ) -> dict:
        if self.chat:
            content: dict = {"role": "assistant"} if first else {}
            if delta or not first:
                content["content"] = delta
            choice = {"index": index, "delta": content, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, use: dict, stats: RequestStats | None) -> dict:
        object_ = "chat.completion.chunk" if self.chat else "text_completion"
        return self._envelope(object_, []) | {"usage": use, "dilaserve": served(stats)}
