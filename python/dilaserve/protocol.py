"""The contract between the engine and its workers: one definition of each message.

The engine decides, workers execute (DESIGN §10). A `StepCommand` tells an instance which
requests join it (with their full token state), which leave it, and which run one denoising
step with which threshold and *which step kind*: the worker does not derive the kind
itself, so a recompute step may start mid-block (it rebuilds the cache from the current
tokens) and is how a request resumes after a migration or a lost worker. The one exception
is a step sent ahead (`StepKind.AUTO`, with overlap): it follows a step the engine has not
heard back from, so the worker resolves its kind by the rule the scheduler follows, and
skips it for a request that step finished. A `StepReport` says what each step did to each
request, with the kind it ran. Request ids are integers everywhere.

Messages are plain dataclasses encoded as msgpack by `msgspec` (`encode` / `decode_*`), so a
malformed frame fails to decode with a typed error instead of reaching the runner.
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import msgspec

from dilaserve.decoding import ConfidenceRule, dream_step, option_problem


class StepKind(enum.StrEnum):
    """What one denoising step computes; matches `StepKind` of the Rust core."""

    RECOMPUTE = "recompute"
    CACHE = "cache"
    NO_CACHE = "no_cache"
    #: A step ahead (protocol only): the worker runs `ahead_kind` of it, or skips it.
    AUTO = "auto"


def ahead_kind(cache: CacheMode, cache_valid: bool) -> StepKind:
    """The kind a step ahead runs: a cache step while the instance holds K/V of the request's
    current block, else a recompute step (no-cache without a cache) — the scheduler's rule,
    applied by the worker to the state the step before left."""
    if cache is CacheMode.NONE:
        return StepKind.NO_CACHE
    return StepKind.CACHE if cache_valid else StepKind.RECOMPUTE


class CacheMode(enum.StrEnum):
    """KV-cache policy of an instance: Fast-dLLM's approximate caches (`prefix`, `dual`)
    for bidirectional models, or the exact cache of block diffusion models (`block`: a
    finished block's K/V is final, so a step feeds only its block — and, once, the block
    finished before it — and attends to the cached prefix)."""

    NONE = "none"
    PREFIX = "prefix"
    DUAL = "dual"
    BLOCK = "block"

    @classmethod
    def default_for(cls, block_size: int) -> CacheMode:
        """The exact cache for a block diffusion model (`block_size` > 0), else the dual
        cache."""
        return cls.BLOCK if block_size else cls.DUAL

    def check_model(self, block_size: int) -> None:
        """Raises `ValueError` unless this mode fits the model: a block diffusion model
        (`block_size` > 0) runs with its exact cache or none; the block cache needs one."""
        if block_size and self in (CacheMode.PREFIX, CacheMode.DUAL):
            raise ValueError(
                f"cache mode {self} approximates bidirectional attention; a block diffusion "
                f"model caches exactly: use '{CacheMode.BLOCK}' (or '{CacheMode.NONE}')"
            )
        if not block_size and self is CacheMode.BLOCK:
            raise ValueError(
                f"cache mode '{CacheMode.BLOCK}' needs a block diffusion model (LLaDA2.x, SDAR)"
            )

    def step_kinds(self) -> tuple[StepKind, ...]:
        """Step kinds an instance in this mode executes."""
        if self is CacheMode.NONE:
            return (StepKind.NO_CACHE,)
        return (StepKind.RECOMPUTE, StepKind.CACHE)


class TokenStateError(ValueError):
    """A request's token state is malformed or does not fit the instance it is sent to."""


def whole_blocks(tokens: int, block_length: int) -> int:
    """Output positions for `tokens` tokens: rounded up to whole blocks, as decoding goes
    block by block."""
    return -(-tokens // block_length) * block_length


@dataclass
class RequestState:
    """Token state of a request between steps: what the engine keeps authoritatively and
    what a step command carries to an instance that does not hold the request yet."""

    request_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    block_length: int
    mask_token_id: int
    #: The request is done once one of these is committed with everything before it
    #: unmasked (empty: decode every output position).
    stop_token_ids: list[int] = field(default_factory=list)
    #: Sampling temperature: 0 takes each position's argmax; above 0 the token is drawn
    #: with Gumbel noise (LLaDA's and Fast-dLLM's sampler) and its confidence is still the
    #: noiseless softmax probability.
    temperature: float = 0.0
    #: The original fixed schedule: each block takes this many steps (τ is ignored),
    #: committing its best positions in equal shares (LLaDA) or by Dream's timestep grid
    #: under a Dream `alg`. None: threshold rule.
    steps_per_block: int | None = None
    #: With `steps_per_block`: the threshold rule still decides, but each step commits at
    #: least the schedule's share — LLaDA2's `generate(threshold=..., steps=...)`.
    threshold_floor: bool = False
    #: Dream's rule ordering positions (and what τ is compared with); None: LLaDA's and
    #: Fast-dLLM's — the argmax (or Gumbel sample) and its noiseless probability.
    alg: ConfidenceRule | None = None
    #: Above 0, positions are drawn in proportion to softmax(score / alg_temp) rather
    #: than taken best first (Dream's `alg_temp`; confidence rules only).
    alg_temp: float = 0.0
    #: Tokens are drawn from the smallest set of most probable ones reaching this mass
    #: (1: all), and from the `top_k` most probable (None: all).
    top_p: float = 1.0
    top_k: int | None = None
    #: The request's own random stream (OpenAI's `seed`): its sampling and Dream's random
    #: rules draw from (seed, steps done), so it decodes the same in any batch, on any
    #: instance, after any migration. None: the instance's shared stream.
    seed: int | None = None
    steps_done: int = 0
    # Steps already run in the current block; 0 means the next step opens a block.
    block_steps: int = 0
    # Grid steps of Dream's schedule passed in the current block: ahead of block_steps
    # where steps that would commit nothing were skipped.
    timestep: int = 0
    #: Leading output positions that hold the prompt's tail: a block diffusion model's
    #: blocks start at absolute multiples of its block length, so the first output block
    #: may begin inside the prompt (`aligned`). They are never committed or returned.
    lead: int = 0

    @classmethod
    def new(
        cls,
        request_id: int,
        prompt_ids: list[int],
        gen_length: int,
        *,
        block_length: int,
        mask_token_id: int,
        stop_token_ids: Sequence[int] = (),
        temperature: float = 0.0,
        steps_per_block: int | None = None,
        threshold_floor: bool = False,
        alg: ConfidenceRule | str | None = None,
        alg_temp: float = 0.0,
        top_p: float = 1.0,
        top_k: int | None = None,
        seed: int | None = None,
        aligned: bool = False,
    ) -> RequestState:
        """A fresh request: `gen_length` output positions rounded up to whole blocks —
        with `aligned` (block diffusion), blocks of absolute positions, the first holding
        the prompt's tail (`lead`)."""
        if block_length <= 0:
            raise TokenStateError(f"block_length must be positive, got {block_length}")
        if gen_length <= 0:
            raise TokenStateError(f"gen_length must be positive, got {gen_length}")
        problem = option_problem(alg=alg, alg_temp=alg_temp, top_p=top_p, top_k=top_k, seed=seed)
        if problem is not None:
            raise TokenStateError(f"request {request_id}: {problem[1]}")
        prompt = list(prompt_ids)
        lead = len(prompt) % block_length if aligned else 0
        tail = prompt[len(prompt) - lead :]
        state = cls(
            request_id=request_id,
            prompt_ids=prompt[: len(prompt) - lead],
            output_ids=tail
            + [mask_token_id] * (whole_blocks(gen_length + lead, block_length) - lead),
            block_length=block_length,
            mask_token_id=mask_token_id,
            stop_token_ids=list(stop_token_ids),
            temperature=temperature,
            steps_per_block=steps_per_block,
            threshold_floor=threshold_floor,
            alg=None if alg is None else ConfidenceRule(alg),
            alg_temp=alg_temp,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            lead=lead,
        )
        state.validate()
        return state

    def validate(self) -> None:
        rid = self.request_id
        if not self.prompt_ids and not self.lead:
            raise TokenStateError(f"request {rid}: prompt is empty")
        if self.mask_token_id in self.prompt_ids + self.output_ids[: self.lead]:
            raise TokenStateError(
                f"request {rid}: prompt contains the mask token {self.mask_token_id}"
            )
        if not 0 <= self.lead < min(self.block_length, len(self.output_ids)):
            raise TokenStateError(
                f"request {rid}: a lead of {self.lead} prompt tokens does not fit in its "
                f"first block of {self.block_length}"
            )
        if self.block_length <= 0 or len(self.output_ids) % self.block_length:
            raise TokenStateError(
                f"request {rid}: output length {len(self.output_ids)} is not a positive "
                f"multiple of block length {self.block_length}"
            )
        if not self.output_ids:
            raise TokenStateError(f"request {rid}: no output positions")
        if not self.temperature >= 0.0:
            raise TokenStateError(f"request {rid}: temperature {self.temperature} is negative")
        if self.steps_per_block is not None and self.steps_per_block <= 0:
            raise TokenStateError(
                f"request {rid}: steps_per_block must be positive, got {self.steps_per_block}"
            )
        if self.mask_token_id in self.stop_token_ids:
            raise TokenStateError(f"request {rid}: the mask token cannot be a stop token")
        if self.threshold_floor and (self.steps_per_block is None or self.alg is not None):
            raise TokenStateError(
                f"request {rid}: a threshold floor needs steps_per_block and LLaDA's "
                "confidence (no alg)"
            )
        problem = option_problem(
            alg=self.alg,
            alg_temp=self.alg_temp,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
        )
        if problem is not None:
            raise TokenStateError(f"request {rid}: {problem[1]}")
        if (
            self.alg is not None
            and self.steps_per_block is not None
            and self.steps_per_block > self.block_length
        ):
            raise TokenStateError(
                f"request {rid}: steps_per_block {self.steps_per_block} exceeds the block "
                f"length {self.block_length} (Dream's schedule)"
            )

    @property
    def needs_full_logits(self) -> bool:
        """The commit samples or scores with the whole vocabulary's distribution, which a
        tensor-parallel instance gathers for such steps only (top-p / top-k alone change
        nothing: the argmax survives them, and LLaDA's confidence ignores them)."""
        return self.temperature > 0 or self.alg is not None

    def copy(self) -> RequestState:
        return replace(
            self,
            prompt_ids=list(self.prompt_ids),
            output_ids=list(self.output_ids),
            stop_token_ids=list(self.stop_token_ids),
        )

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
        """Output positions unmasked so far (EOS padding included, the lead not)."""
        return self.output_length - self.lead - self.num_masked

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
    def complete_blocks(self) -> int:
        """Leading output blocks with every position unmasked: text that never changes."""
        return self.current_block

    @property
    def stop_position(self) -> int | None:
        """Output index of the first committed stop token, if any."""
        if not self.stop_token_ids:
            return None
        stops = set(self.stop_token_ids)
        output = self.output_ids
        return next((i for i in range(self.lead, len(output)) if output[i] in stops), None)

    @property
    def masked_in_block(self) -> int:
        """Masked positions of the current block."""
        start = self.current_block * self.block_length
        return self.output_ids[start : start + self.block_length].count(self.mask_token_id)

    def transfer_count(self) -> int:
        """Positions the next step commits under the fixed schedule. LLaDA's rule: the
        block's length in `steps_per_block` equal shares, the remainder one each to the
        first steps (`get_num_transfer_tokens`). Under a Dream `alg`: its grid's count
        (`dream_step`)."""
        if self.steps_per_block is None:
            raise TokenStateError(f"request {self.request_id} follows the threshold rule")
        if self.alg is not None:
            return self.dream_step()[1]
        share, extra = divmod(self.block_length, self.steps_per_block)
        return share + (self.block_steps < extra)

    def dream_step(self) -> tuple[int, int]:
        """(grid index, count) of the next step on Dream's grid that commits something,
        for a confidence rule (the random rule draws its count on the device)."""
        if self.steps_per_block is None or self.alg in (None, ConfidenceRule.RANDOM):
            raise TokenStateError(f"request {self.request_id} has no count on Dream's schedule")
        return dream_step(self.steps_per_block, self.timestep, self.masked_in_block)

    @property
    def done(self) -> bool:
        """Every position unmasked, or an EOS committed with everything before it unmasked."""
        first_mask = self.first_masked()
        if first_mask is None:
            return True
        stop = self.stop_position
        return stop is not None and stop < first_mask

    def generated_ids(self) -> list[int]:
        """Output tokens after the lead, cut before the first stop token."""
        stop = self.stop_position
        return self.output_ids[self.lead : stop]

    def commit(
        self, block: int, positions: list[int], tokens: list[int], timesteps: int = 1
    ) -> None:
        """Advances the state by one step that unmasked `positions` of output block
        `block` and passed `timesteps` steps of Dream's grid. The statement of the rules that
        the core's token state follows on a worker (`HeldTokens`) and in the engine, and
        the emulated worker's copy."""
        for position, token in zip(positions, tokens, strict=True):
            self.output_ids[position] = token
        self.steps_done += 1
        start = block * self.block_length
        block_open = self.mask_token_id in self.output_ids[start : start + self.block_length]
        self.block_steps = self.block_steps + 1 if block_open else 0
        self.timestep = self.timestep + timesteps if block_open else 0


@dataclass(frozen=True)
class StepEntry:
    """One request's step in a command: its threshold for this step and the step kind."""

    request_id: int
    tau: float
    kind: StepKind


@dataclass
class StepCommand:
    """What an instance does next. Residency changes apply before the step: `release`
    drops requests that left (finished elsewhere, migrated, cancelled), `admit` takes in
    requests new to this instance with their token state. The step's entries are columns
    (`requests`, `taus`, `kinds`: request i steps at τ `taus[i]` with step kind
    `kinds[i]`), so the engine builds a command from the scheduler's packed decisions
    without an object per entry. No entries: no step (the worker only applies residency
    changes and answers)."""

    step: int
    requests: list[int] = field(default_factory=list)
    taus: list[float] = field(default_factory=list)
    kinds: list[StepKind] = field(default_factory=list)
    admit: list[RequestState] = field(default_factory=list)
    release: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not len(self.requests) == len(self.taus) == len(self.kinds):
            raise ValueError(
                f"step command columns differ in length: {len(self.requests)} requests, "
                f"{len(self.taus)} taus, {len(self.kinds)} kinds"
            )

    @classmethod
    def of(
        cls,
        step: int,
        entries: Sequence[StepEntry] = (),
        *,
        admit: Sequence[RequestState] = (),
        release: Sequence[int] = (),
    ) -> StepCommand:
        """A command from entry objects (tests, tools)."""
        return cls(
            step,
            [e.request_id for e in entries],
            [e.tau for e in entries],
            [e.kind for e in entries],
            list(admit),
            list(release),
        )

    def entries(self) -> list[StepEntry]:
        return [
            StepEntry(r, t, k) for r, t, k in zip(self.requests, self.taus, self.kinds, strict=True)
        ]


#: Confidence statistics a step reports per request: min, q25, median, mean, q75 of the
#: confidences of the current block's positions that were masked when the step began (the
#: step predictor's confidence features). A step that completes its block reports them
#: too; they describe a finished block.
CONFIDENCE_STATS = 5


@dataclass(frozen=True)
class StepOutput:
    """What one step did to one request (a row of a `StepReport`)."""

    request_id: int
    kind: StepKind
    block: int
    committed_positions: list[int]  # output-relative indices
    committed_tokens: list[int]
    confidence_stats: tuple[float, float, float, float, float]
    done: bool
    #: Steps of Dream's grid the step passed (more than one where steps that would commit
    #: nothing were skipped); 1 outside Dream's schedule.
    timesteps: int = 1


@dataclass(frozen=True)
class RequestError:
    """A request the worker refused (bad token state, unknown id, wrong step kind); the
    rest of the command ran."""

    request_id: int
    message: str


def block_key(previous: int, tokens: Sequence[int]) -> int:
    """The key of a prompt block of `tokens` after the block keyed `previous` (0 for the
    first): 64 bits of BLAKE2b over both, so a client cannot craft two prompts whose blocks
    share a key (Python's `hash` of a tuple is easy to collide), and every process computes
    the same key."""
    data = previous.to_bytes(8, "little") + array("Q", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def prompt_block_keys(prompt: Sequence[int], block: int) -> list[int]:
    """Keys of `prompt`'s whole blocks of `block` tokens, each covering its tokens and every
    block before it (a chain, as vLLM's prefix caching keys blocks), as unsigned 64-bit
    ints: how a worker names the stored blocks a request reads (`StepReport.prefix_reads`)
    and the engine the blocks it expects an instance to hold."""
    keys, key = [], 0
    for start in range(0, len(prompt) - len(prompt) % block, block):
        key = block_key(key, prompt[start : start + block])
        keys.append(key)
    return keys


@dataclass
class PrefixUse:
    """Prefix sharing's use, in prompt tokens: those looked up in an instance's prefix store,
    and those found there (their prefill saved). A worker counts its store's; the engine
    sums what the reports carry."""

    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_token_share(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class StepReport:
    """An instance's answer to one `StepCommand`. What the step did to each request is a
    set of columns, one row per request (`StepOutput` is a row): request i committed
    `counts[i]` positions of output block `blocks[i]`, listed in `positions` / `tokens`
    after those of the rows before it, with `CONFIDENCE_STATS` values in `confidence`. The
    engine applies the columns to its token state and its scheduler in one call, which
    checks them against each other and against the batch in flight (a malformed report
    raises `StepReportError` there, and the step is run again)."""

    step: int
    requests: list[int] = field(default_factory=list)
    kinds: list[StepKind] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    done: list[bool] = field(default_factory=list)
    timesteps: list[int] = field(default_factory=list)
    errors: list[RequestError] = field(default_factory=list)
    forward_tokens: int = 0  # tokens that went through the model
    seconds: float = 0.0  # the step's compute time on the worker
    # Prefix sharing: prompt tokens of the requests this command admitted that were looked
    # up in the instance's prefix store, and those found there (their prefill saved).
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    # ... and, per admitted request that found some, the keys of the stored blocks it reads
    # (`prompt_block_keys`): the scheduler counts a block read by several requests once.
    prefix_reads: dict[int, list[int]] = field(default_factory=dict)
    # Set when the whole step failed (e.g. out of memory): nothing of it was applied.
    failure: str | None = None

    def add_row(
        self,
        request_id: int,
        kind: StepKind,
        block: int,
        positions: list[int],
        tokens: list[int],
        confidence: Sequence[float],
        done: bool,
        timesteps: int = 1,
    ) -> None:
        """Appends one request's row (the fields of `StepOutput`)."""
        self.requests.append(request_id)
        self.kinds.append(kind)
        self.blocks.append(block)
        self.counts.append(len(positions))
        self.positions += positions
        self.tokens += tokens
        self.confidence += confidence
        self.done.append(done)
        self.timesteps.append(timesteps)

    def add(self, output: StepOutput) -> None:
        """Appends one request's row."""
        self.add_row(
            output.request_id,
            output.kind,
            output.block,
            output.committed_positions,
            output.committed_tokens,
            output.confidence_stats,
            output.done,
            output.timesteps,
        )

    @property
    def outputs(self) -> list[StepOutput]:
        """The rows as objects (offline tools and tests; the engine reads the columns)."""
        rows, offset = [], 0
        for i, rid in enumerate(self.requests):
            n = self.counts[i]
            stats = self.confidence[CONFIDENCE_STATS * i : CONFIDENCE_STATS * (i + 1)]
            rows.append(
                StepOutput(
                    rid,
                    self.kinds[i],
                    self.blocks[i],
                    self.positions[offset : offset + n],
                    self.tokens[offset : offset + n],
                    tuple(stats),  # type: ignore[arg-type]
                    self.done[i],
                    self.timesteps[i],
                )
            )
            offset += n
        return rows


@dataclass(frozen=True)
class WorkerReady:
    """First message of a worker once its model is loaded: what the instance can hold."""

    instance: int
    rank: int
    pid: int
    cache: CacheMode
    max_requests: int
    kv_tokens: int | None
    max_seq_len: int
    vocab_size: int
    device: str
    #: Ranks of the instance (rank 0 speaks for all of them).
    tp: int = 1


@dataclass(frozen=True)
class WorkerLeaving:
    """The worker was asked to stop (SIGTERM): the engine drains it, then says `Shutdown`."""

    instance: int


@dataclass(frozen=True)
class Shutdown:
    """Engine to worker: release everything and exit."""


# Every frame is one of these, tagged by class name.
EngineMessage = StepCommand | Shutdown
WorkerMessage = WorkerReady | StepReport | WorkerLeaving

_ENGINE_TYPES = {cls.__name__: cls for cls in (StepCommand, Shutdown)}
_WORKER_TYPES = {cls.__name__: cls for cls in (WorkerReady, StepReport, WorkerLeaving)}
_encoder = msgspec.msgpack.Encoder()


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol."""


def encode(message: EngineMessage | WorkerMessage) -> bytes:
    return _encoder.encode((type(message).__name__, message))


#: Decoders made once: a decoder per call rebuilds its type's plan every frame.
_tagged = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
_ENGINE_DECODERS = {tag: msgspec.msgpack.Decoder(cls) for tag, cls in _ENGINE_TYPES.items()}
_WORKER_DECODERS = {tag: msgspec.msgpack.Decoder(cls) for tag, cls in _WORKER_TYPES.items()}


def _decode(frame: bytes, decoders: dict[str, msgspec.msgpack.Decoder]) -> object:
    try:
        tag, body = _tagged.decode(frame)
        return decoders[tag].decode(body)
    except (msgspec.DecodeError, KeyError, ValueError, TypeError) as exc:
        raise ProtocolError(f"undecodable frame: {exc}") from exc


def decode_engine_message(frame: bytes) -> EngineMessage:
    return _decode(frame, _ENGINE_DECODERS)  # type: ignore[return-value]


def decode_worker_message(frame: bytes) -> WorkerMessage:
    return _decode(frame, _WORKER_DECODERS)  # type: ignore[return-value]
