"""Token state of one request: what the engine keeps, what a migration carries.

The state is plain data (ints and lists) so it crosses process boundaries as msgpack. The
step runner holds a device-side copy while the request lives on its instance.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any


class StepKind(enum.StrEnum):
    """What one denoising step computes; matches `StepKind` of the Rust core."""

    RECOMPUTE = "recompute"
    CACHE = "cache"
    NO_CACHE = "no_cache"


class CacheMode(enum.StrEnum):
    """Approximate KV-cache policy of a runner (Fast-dLLM)."""

    NONE = "none"
    PREFIX = "prefix"
    DUAL = "dual"


def whole_blocks(tokens: int, block_length: int) -> int:
    """Output positions for `tokens` tokens: rounded up to whole blocks, as decoding goes
    block by block."""
    return -(-tokens // block_length) * block_length


class InvalidRequestError(ValueError):
    """A request's token state is malformed or does not fit the runner."""


@dataclass
class RequestState:
    """Authoritative token state of a request between steps."""

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    block_length: int
    mask_token_id: int
    eos_token_id: int | None = None
    steps_done: int = 0
    # Steps already run in the current block; 0 means the next step opens a block (and, with a
    # KV cache, is a recompute step).
    block_steps: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def new(
        cls,
        request_id: str,
        prompt_ids: list[int],
        gen_length: int,
        *,
        block_length: int,
        mask_token_id: int,
        eos_token_id: int | None = None,
    ) -> RequestState:
        """A fresh request: `gen_length` output positions rounded up to whole blocks."""
        if block_length <= 0:
            raise InvalidRequestError(f"block_length must be positive, got {block_length}")
        if gen_length <= 0:
            raise InvalidRequestError(f"gen_length must be positive, got {gen_length}")
        state = cls(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            output_ids=[mask_token_id] * whole_blocks(gen_length, block_length),
            block_length=block_length,
            mask_token_id=mask_token_id,
            eos_token_id=eos_token_id,
        )
        state.validate()
        return state

    def validate(self) -> None:
        if not self.prompt_ids:
            raise InvalidRequestError(f"request {self.request_id!r}: prompt is empty")
        if self.mask_token_id in self.prompt_ids:
            raise InvalidRequestError(
                f"request {self.request_id!r}: prompt contains the mask token {self.mask_token_id}"
            )
        if self.block_length <= 0 or len(self.output_ids) % self.block_length:
            raise InvalidRequestError(
                f"request {self.request_id!r}: output length {len(self.output_ids)} is not a "
                f"positive multiple of block length {self.block_length}"
            )
        if not self.output_ids:
            raise InvalidRequestError(f"request {self.request_id!r}: no output positions")

    @property
    def prompt_length(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_length(self) -> int:
        return len(self.output_ids)

    @property
    def seq_length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_masked(self) -> int:
        return sum(1 for t in self.output_ids if t == self.mask_token_id)

    @property
    def num_committed(self) -> int:
        """Output positions unmasked so far (EOS padding included)."""
        return self.output_length - self.num_masked

    def first_masked(self) -> int | None:
        """Output index of the first masked position, None when all are unmasked."""
        try:
            return self.output_ids.index(self.mask_token_id)
        except ValueError:
            return None

    @property
    def current_block(self) -> int:
        """Index of the first output block that still has a masked position."""
        first = self.first_masked()
        return (self.output_length if first is None else first) // self.block_length

    @property
    def eos_position(self) -> int | None:
        """Output index of the first committed EOS, if stopping at EOS is enabled."""
        if self.eos_token_id is None:
            return None
        try:
            return self.output_ids.index(self.eos_token_id)
        except ValueError:
            return None

    @property
    def done(self) -> bool:
        """Every position unmasked, or an EOS committed with everything before it unmasked."""
        first_mask = self.first_masked()
        if first_mask is None:
            return True
        eos = self.eos_position
        return eos is not None and eos < first_mask

    def next_step_kind(self, cache: CacheMode) -> StepKind:
        if cache is CacheMode.NONE:
            return StepKind.NO_CACHE
        return StepKind.RECOMPUTE if self.block_steps == 0 else StepKind.CACHE

    def generated_ids(self) -> list[int]:
        """Output tokens, cut before the first EOS when stopping at EOS."""
        eos = self.eos_position
        return self.output_ids[:eos] if eos is not None else list(self.output_ids)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RequestState:
        state = cls(**data)
        state.validate()
        return state
