"""Turning a caller's prompt and parameters into a request's initial token state and SLO,
with every check that can refuse it before it reaches the scheduler."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dilaserve._core import LatencyProfile
from dilaserve.models import encode_prompt, load_tokenizer, read_config
from dilaserve.models.tokenizer import UnrepresentableTextError
from dilaserve.planner import (
    FAST_DLLM_THRESHOLDS,
    Arrival,
    ThresholdOption,
    mean_isolated_latency,
)
from dilaserve.protocol import CacheMode, RequestState, TokenStateError, whole_blocks

from .config import EngineConfig, GenerationParams
from .errors import BadRequestError


class PromptEncoder:
    """A prompt's checked token ids: what a front end needs of the model (its tokenizer
    and sizes), without the engine's latency profile."""

    def __init__(self, model_dir: str) -> None:
        _, self.model_config = read_config(model_dir)
        self.tokenizer = load_tokenizer(model_dir)
        #: Most characters one token of the vocabulary spells (at least 1).
        self.max_token_chars = max((len(t) for t in self.tokenizer.get_vocab()), default=1)

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids; one that cannot fit the context is refused before it is
        tokenized or scanned (no token covers more than `max_token_chars` characters)."""
        mc = self.model_config
        context = mc.max_position_embeddings
        # Normalisers may merge characters: the bound on a text keeps a factor 2 of slack.
        if isinstance(prompt, str) and len(prompt) >= 2 * context * self.max_token_chars:
            raise BadRequestError(
                f"the prompt's {len(prompt)} characters cannot fit the model's context of "
                f"{context} tokens"
            )
        if not isinstance(prompt, str) and len(prompt) >= context:
            raise BadRequestError(
                f"the prompt's {len(prompt)} tokens leave no room for output in the model's "
                f"context of {context} tokens"
            )
        if isinstance(prompt, str):
            try:
                ids = encode_prompt(self.tokenizer, prompt)
            except UnrepresentableTextError as exc:
                raise BadRequestError(str(exc)) from exc
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise BadRequestError("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < mc.vocab_size or t == mc.mask_token_id]
        if bad:
            raise BadRequestError(
                f"prompt token {bad[0]} is outside the vocabulary [0, {mc.vocab_size}) or "
                "is the mask token"
            )
        return ids


class RequestBuilder:
    def __init__(self, config: EngineConfig, model_dir: str, profile: LatencyProfile) -> None:
        self.config = config
        self.profile = profile
        self.prompts = PromptEncoder(model_dir)
        self.model_config = self.prompts.model_config
        config.cache.check_model(self.model_config.block_size)
        self.tokenizer = self.prompts.tokenizer

    def build(
        self, request_id: int, prompt: str | Sequence[int], params: GenerationParams
    ) -> tuple[RequestState, float]:
        """The request's token state and its SLO in seconds; raises `BadRequestError`.
        Sizes are checked against the model's context before anything is allocated."""
        params.validate()
        ids = self.prompts.prompt_ids(prompt)
        c, mc = self.config, self.model_config
        block_length = params.block_length or c.block_length
        if mc.block_size and block_length != mc.block_size:
            raise BadRequestError(
                f"block_length {block_length}: this block diffusion model decodes blocks of "
                f"{mc.block_size} positions"
            )
        # A block diffusion model's blocks are absolute: its first opens with the prompt's
        # tail (`RequestState.lead`).
        aligned = bool(mc.block_size)
        lead = len(ids) % block_length if aligned else 0
        max_tokens = params.max_tokens or c.default_max_tokens
        positions = whole_blocks(max_tokens + lead, block_length) - lead
        if len(ids) + positions > mc.max_position_embeddings:
            raise BadRequestError(
                f"{len(ids)} prompt tokens plus {positions} output positions exceed the "
                f"model's context of {mc.max_position_embeddings} tokens"
            )
        try:
            state = RequestState.new(
                request_id,
                ids,
                max_tokens,
                block_length=block_length,
                mask_token_id=mc.mask_token_id,
                stop_token_ids=mc.stop_token_ids if c.stop_at_eos else (),
                temperature=params.temperature,
                steps_per_block=params.steps_per_block,
                threshold_floor=params.threshold_floor,
                alg=params.alg,
                alg_temp=params.alg_temp,
                top_p=params.top_p,
                top_k=params.top_k,
                seed=params.seed,
                aligned=aligned,
            )
        except TokenStateError as exc:
            raise BadRequestError(str(exc)) from exc
        slo = params.slo_s or c.slo_scale * self.isolated_latency(len(ids), state.output_length)
        return state, slo

    @property
    def config(self) -> EngineConfig:
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self._config = config
        #: Tokens per step at the top threshold: the rate of the SLO unit (set with the
        #: config, so that an arrival does not interpolate the rate table again).
        self._top_rate = threshold_options(config)[-1].tokens_per_step

    def isolated_latency(self, prompt_len: int, output_len: int) -> float:
        """Estimated seconds of one request alone on a TP-1 instance at the top threshold
        (DESIGN §9's SLO unit)."""
        c = self.config
        return mean_isolated_latency(
            self.profile,
            [Arrival(0.0, prompt_len, output_len)],
            self._top_rate,
            c.cache is not CacheMode.NONE,
            c.block_length,
            exact_cache=c.cache is CacheMode.BLOCK,
        )


def threshold_options(config: EngineConfig) -> list[ThresholdOption]:
    """The scheduler's candidate thresholds with the served model's tokens per step,
    ascending; a threshold the rate table does not list is interpolated in it (a table
    may also list more thresholds than are served)."""
    table = sorted(
        config.predictor_rates or [(t.threshold, t.tokens_per_step) for t in FAST_DLLM_THRESHOLDS]
    )
    taus, rates = zip(*table, strict=True)
    return [ThresholdOption(t, float(np.interp(t, taus, rates))) for t in sorted(config.thresholds)]
