"""Executes one denoising step for a batch of requests, each with its own threshold.

DESIGN §1: output is decoded block by block; a step runs the model, and within the current
block commits every masked position whose confidence reaches the request's τ (at least one).
With an approximate KV cache the first step of a block is a *recompute* step over the whole
sequence that refreshes K/V, later steps of the block are *cache* steps over the block's
positions (dual cache) or the block and everything after it (prefix cache).

The runner decides nothing: the engine says which requests step, with which τ and which
step kind. A recompute step may start mid-block: it rebuilds the request's K/V from its
current tokens, which is how a request resumes on an instance that never held its cache.

A step is one packed model call over every row (`models.packed`): fed tokens are
concatenated, not padded, and the index tensors are built once per step from the host-side
token state, so the step path has no per-row device work and one device read (the
committed tokens). That token state lives in the Rust core (`HeldTokens`, the rules of the
engine's own copy): a step's index columns come out of it, and its read-back goes into it,
in one call each, so the host's share of a step has no per-row Python. With a cache, each
request holds a contiguous extent of the KV pool, sized by a memory budget and allocated by
tokens (`kv_cache`); under the exact block cache, one that shares its leading prompt blocks
with another reads them in place from the prefix store (`prefix_cache`) and its extent
holds the rest.

On a tensor-parallel instance this runner lives on rank 0: it broadcasts each step's model
call as a packed plan (`step_plan`), every rank runs it on its shard, and the commit
combines the ranks' vocabulary partials instead of logits (`follower`).
"""

from __future__ import annotations

import contextlib
import time
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from dilaserve._core import STEP_KINDS, HeldTokens
from dilaserve.kernels import (
    CommitResult,
    argmax_confidence,
    confidence_commit,
    partial_ids,
    scatter_kv,
    threshold_commit,
    use_triton,
    vocab_partials,
)
from dilaserve.models.packed import PackedBatch
from dilaserve.protocol import (
    CacheMode,
    RequestState,
    StepEntry,
    StepKind,
    StepReport,
    TokenStateError,
    ahead_kind,
)
from dilaserve.worker.batch_decoding import RowSampling, RowSchedule
from dilaserve.worker.errors import (
    GroupLostError,
    MigrationError,
    RequestNotHeldError,
    StepFailedError,
    StepRejectedError,
)
from dilaserve.worker.follower import full_vocab_logits, make_pool, vocab_parallel_scores
from dilaserve.worker.forward import forward_logits
from dilaserve.worker.kv_cache import budget_tokens, bytes_per_token
from dilaserve.worker.prefix_cache import PrefixCache
from dilaserve.worker.tp_group import TensorParallelGroup

_KIND_CODES = {StepKind(k): code for code, k in enumerate(STEP_KINDS)}


@dataclass
class _Held:
    """A request resident on this runner: its decoding options and whether it holds a KV
    extent. The token fields of `spec` are those it arrived with; the current ones are in
    the runner's `HeldTokens`."""

    spec: RequestState
    extent: bool
    # Its options read its counters (sampling streams, Dream's grid, the fixed schedule):
    # its steps see a current copy of its state.
    reads_counters: bool
    # Leading positions it reads from stored prefix blocks (prefix sharing); its extent
    # holds the positions after them.
    shared: int = 0


class StepRunner:
    """One model instance's step executor (batched, per-request τ, optional KV cache).

    Given a model shard built with a `TensorParallelGroup`, it is rank 0 of that group and
    the other ranks must be running `follower.follow`."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        cache: CacheMode | str = CacheMode.NONE,
        max_requests: int = 64,
        max_seq_len: int | None = None,
        kv_cache_memory: int | float | None = None,
        prefix_caching: bool = True,
    ) -> None:
        """`kv_cache_memory` sizes the KV pool: bytes (int), a fraction of free device
        memory (float), or None for `kv_cache.DEFAULT_FRACTION`; the pool never holds
        more than `max_requests` sequences of `max_seq_len` tokens. `prefix_caching`:
        under the exact block cache, requests share the K/V of the prompt blocks they
        have in common (`prefix_cache`)."""
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.cache_mode = CacheMode(cache)
        self.cache_mode.check_model(self.config.block_size)
        self._step_kinds = self.cache_mode.step_kinds()
        self.max_seq_len = max_seq_len or self.config.max_position_embeddings
        self.group: TensorParallelGroup | None = getattr(model, "group", None)
        if self.group is not None and not isinstance(self.group, TensorParallelGroup):
            raise TypeError("a tensor-parallel runner needs a model built with a worker group")
        if self.group is not None and self.group.rank != 0:
            raise ValueError("only rank 0 runs steps; the other ranks follow its plans")
        capacity = 0
        if self.cache_mode is not CacheMode.NONE:
            per_token = bytes_per_token(
                self.config.num_layers, model.local_kv_heads, self.config.head_dim, model.dtype
            )
            capacity = budget_tokens(
                kv_cache_memory, per_token, self.device, most=max_requests * self.max_seq_len
            )
            if capacity < 1:
                raise ValueError(
                    f"a KV-cache budget of {kv_cache_memory!r} holds no token "
                    f"({per_token} bytes each)"
                )
            self.max_seq_len = min(self.max_seq_len, capacity)
        if self.group is not None:
            self.group.send_pool(capacity)
        self.pool = make_pool(model, capacity)
        if self.pool is not None and self.group is not None:
            self.pool.on_move = self.group.send_moves
        self.prefix: PrefixCache | None = None
        if self.pool is not None and self.cache_mode is CacheMode.BLOCK and prefix_caching:
            self.prefix = PrefixCache(self.pool, self.config.block_size)
        self._held: dict[int, _Held] = {}
        self._tokens = HeldTokens(exact=self.cache_mode is CacheMode.BLOCK)
        self.forward_tokens = 0
        # Noise of sampling and of Dream's random rules; seeded, so a runner's samples repeat.
        self._noise = torch.Generator(self.device).manual_seed(0)

    def warm_up(self) -> None:
        """Compiles the step's Triton kernels now rather than in the first request's step
        (CUDA only). They do not specialise on batch shapes, so this is their one compile."""
        model, device = self.model, self.device
        if not use_triton(torch.empty(0, device=device)):
            return
        logits = torch.zeros((1, 1, model.local_vocab), dtype=model.dtype, device=device)
        candidate = torch.ones((1, 1), dtype=torch.bool, device=device)
        tau = torch.ones(1, dtype=torch.float32, device=device)
        ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        if self.group is None:
            confidence_commit(logits, candidate, tau, ids)
        else:
            partials = vocab_partials(logits, model.vocab_offset)
            threshold_commit(
                partial_ids(partials).long(), partials[..., 1].clone(), candidate, tau, ids
            )
        if self.pool is not None:
            k, _ = self.pool.layer(0)
            # Row 0's K/V is rewritten by whichever request's recompute step comes first.
            scatter_kv(k, torch.zeros(1, dtype=torch.long, device=device), k[:1].clone())
        torch.cuda.synchronize(device)

    @property
    def kv_tokens(self) -> int | None:
        """Sequence tokens the KV pool holds (None without a cache): what the scheduler
        admits against."""
        return None if self.pool is None else self.pool.capacity

    # -- residency -----------------------------------------------------------------------

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def add(self, state: RequestState) -> None:
        """Takes a request in: a new arrival or one migrating from another runner, at any
        point of a block. It holds no K/V here yet, so with a cache its next step must be a
        recompute step."""
        state.validate()
        rid = state.request_id
        if rid in self._held:
            raise TokenStateError(f"request {rid} is already on this runner")
        if state.seq_length > self.max_seq_len:
            raise TokenStateError(
                f"request {rid}: {state.seq_length} tokens exceed this runner's limit of "
                f"{self.max_seq_len}"
            )
        if state.mask_token_id != self.config.mask_token_id:
            raise TokenStateError(
                f"request {rid}: mask token {state.mask_token_id} is not the model's "
                f"({self.config.mask_token_id})"
            )
        block = self.config.block_size
        if block and (state.block_length != block or len(state.prompt_ids) % block):
            raise TokenStateError(
                f"request {rid}: this block diffusion model decodes blocks of {block} "
                f"absolute positions; build the request with block_length={block}, aligned"
            )
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in state.prompt_ids + state.output_ids):
            raise TokenStateError(f"request {rid}: token id outside the vocabulary [0, {vocab})")
        counters = (state.steps_done, state.block_steps, state.timestep)
        try:
            self._tokens.add(
                rid,
                state.prompt_ids,
                state.output_ids,
                state.block_length,
                state.mask_token_id,
                state.stop_token_ids,
                state.steps_per_block is not None and not state.threshold_floor,
                counters,
                state.lead,
            )
        except (ValueError, OverflowError) as exc:  # a counter that is negative or too large
            raise TokenStateError(f"request {rid}: {exc}") from None
        shared = 0
        try:
            if self.prefix is not None:  # whole prompt blocks, read in place
                shared = self.prefix.acquire(rid, state.prompt_ids)
            if self.pool is not None:
                self.pool.allocate(rid, state.seq_length - shared)
            if shared:
                self._tokens.seed_exact(rid, shared)
        except BaseException:
            self._tokens.remove(rid)
            if self.prefix is not None:
                self.prefix.release(rid)
            if self.pool is not None and rid in self.pool:
                self.pool.free(rid)
            raise
        reads = state.needs_full_logits or state.steps_per_block is not None
        self._held[rid] = _Held(
            state.copy(), extent=self.pool is not None, reads_counters=reads, shared=shared
        )

    def state(self, request_id: int) -> RequestState:
        """A copy of a resident request's current token state."""
        spec = self._get(request_id).spec
        steps_done, block_steps, timestep, _ = self._tokens.counters(request_id)
        return replace(
            spec,
            prompt_ids=list(spec.prompt_ids),
            output_ids=self._tokens.output(request_id),
            stop_token_ids=list(spec.stop_token_ids),
            steps_done=steps_done,
            block_steps=block_steps,
            timestep=timestep,
        )

    def next_kind(self, request_id: int) -> StepKind:
        """The step kind that continues a resident request here, for callers that drive the
        runner without the scheduler (offline decoding, profiling): a cache step exactly
        while this runner holds K/V of the current block (`cache_valid`, which a finished
        block invalidates); the scheduler decides the same from its own count."""
        self._get(request_id)
        return ahead_kind(self.cache_mode, self._tokens.cache_valid(request_id))

    def finished(self, request_id: int) -> bool:
        """Whether a resident request's last step finished it (it waits to be released)."""
        self._get(request_id)
        return self._tokens.done(request_id)

    def export(self, request_id: int) -> RequestState:
        """Removes a request for migration; with an approximate cache, refused while its
        next step would read K/V held here (DESIGN §6: migrate only before a recompute
        step). Under the exact block cache a request may leave at any step: its new
        instance rebuilds the exact K/V of its committed prefix in one recompute step."""
        exact = self.cache_mode is CacheMode.BLOCK
        if not exact and self.next_kind(request_id) is StepKind.CACHE:
            raise MigrationError(
                f"request {request_id}: its next step is a cache step; migrate it before a "
                "recompute step"
            )
        return self.release(request_id)

    def release(self, request_id: int) -> RequestState:
        """Drops a request (finished, cancelled or migrating) and frees its KV extent."""
        state = self.state(request_id)
        held = self._held.pop(request_id)
        self._tokens.remove(request_id)
        self._free_extent(request_id, held)
        return state

    def _free_extent(self, request_id: int, held: _Held) -> None:
        if held.extent and self.pool is not None:
            self.pool.free(request_id)
            held.extent = False
            if self.prefix is not None:
                self.prefix.release(request_id)

    def _get(self, request_id: int) -> _Held:
        try:
            return self._held[request_id]
        except KeyError:
            raise RequestNotHeldError(request_id) from None

    # -- one step ------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self, batch: Sequence[StepEntry]) -> StepReport:
        """Runs one denoising step of the given kind for every entry of `batch`."""
        started = time.perf_counter()
        held = self._check_batch(batch)
        ids = [e.request_id for e in batch]
        kinds = [_KIND_CODES[e.kind] for e in batch]
        packed, candidate = self._pack(ids, kinds)
        taus = array("f", [e.tau for e in batch])
        tau = torch.frombuffer(taus, dtype=torch.float32).to(self.device)
        states = [
            self.state(r) if h.reads_counters else h.spec for r, h in zip(ids, held, strict=True)
        ]
        # Rows sampled or scored by options need every logit: a TP step gathers them.
        sampling = RowSampling.of(states, self.device)
        with self._group_fatal():
            if self.group is not None:
                self.group.send_step(packed, full_logits=sampling is not None)
            logits = forward_logits(self.model, self.pool, packed)
            if self.group is not None and sampling is not None:
                logits = full_vocab_logits(self.model, self.group, logits)  # type: ignore[arg-type]
            host = self._read_back(states, logits, candidate, tau, sampling)
            self._store_prefixes(batch, held)
        report = self._commit(batch, ids, kinds, host)
        report.forward_tokens = fed = packed.ids.numel()
        self.forward_tokens += fed
        report.seconds = time.perf_counter() - started
        return report

    def _store_prefixes(self, batch: Sequence[StepEntry], held: list[_Held]) -> None:
        """A request's first step here wrote the final K/V of its prompt blocks: keep
        them for the requests that share them."""
        if self.prefix is None:
            return
        for entry, h in zip(batch, held, strict=True):
            if entry.kind is StepKind.RECOMPUTE:
                self.prefix.store(
                    entry.request_id, h.spec.prompt_ids, self._origin(entry.request_id)
                )

    def check_entry(self, entry: StepEntry) -> None:
        """Raises `StepRejectedError` (or `RequestNotHeldError`) if `entry` cannot run here."""
        rid = entry.request_id
        self._get(rid)
        if not 0.0 <= entry.tau <= 1.0:
            raise StepRejectedError(f"request {rid}: threshold {entry.tau} is outside [0, 1]")
        if self._tokens.done(rid):
            raise StepRejectedError(f"request {rid} is already finished")
        if entry.kind not in self._step_kinds:
            raise StepRejectedError(
                f"request {rid}: a {entry.kind} step cannot run with cache mode {self.cache_mode}"
            )
        if entry.kind is StepKind.CACHE and not self._tokens.cache_valid(rid):
            raise StepRejectedError(
                f"request {rid}: a cache step needs the K/V of this block's recompute step, "
                "which this instance does not hold"
            )

    def _check_batch(self, batch: Sequence[StepEntry]) -> list[_Held]:
        if not batch:
            raise StepRejectedError("a step needs at least one request")
        seen: set[int] = set()
        for entry in batch:
            if entry.request_id in seen:
                raise StepRejectedError(f"request {entry.request_id} appears twice in one step")
            seen.add(entry.request_id)
            self.check_entry(entry)
        return [self._held[e.request_id] for e in batch]

    @contextlib.contextmanager
    def _group_fatal(self) -> Iterator[None]:
        """Once a tensor-parallel step has begun, the other ranks are inside it: any failure
        leaves them waiting in a collective, so it takes the whole instance down."""
        if self.group is None:
            yield
            return
        try:
            yield
        except GroupLostError:
            raise
        except Exception as exc:
            raise GroupLostError(f"rank 0 failed mid-step: {type(exc).__name__}: {exc}") from exc

    def _pack(self, ids: list[int], kinds: list[int]) -> tuple[PackedBatch, torch.Tensor]:
        """The step's one packed model call — every row's window (all of its sequence; for
        a cache step the block under a dual cache, the block and what follows under a
        prefix cache, with the position before it for a model whose logits are shifted),
        concatenated; logits for each row's still-masked block positions — and the
        `[rows, width]` flags of the logit columns that are candidates."""
        origins = None if self.pool is None else [self._origin(r) for r in ids]
        suffix = self.cache_mode is CacheMode.PREFIX
        buffer, lengths, seq_lengths, width = self._tokens.pack(
            ids, kinds, suffix, self.config.logit_shift, origins
        )
        flat = torch.frombuffer(buffer, dtype=torch.int64).to(self.device, non_blocking=True)
        fed, grid = sum(lengths), len(ids) * width
        fed_ids, positions, rest = flat[:fed], flat[fed : 2 * fed], flat[2 * fed :]
        slots = reads = shared = None
        if self.pool is not None:
            slots, rest = rest[:fed], rest[fed:]
            skipped = [self._held[r].shared for r in ids]
            reads = tuple(
                (self.pool.base(r), n - s)
                for r, n, s in zip(ids, seq_lengths, skipped, strict=True)
            )
            if self.prefix is not None and any(skipped):
                shared = tuple(self.prefix.segments(r) for r in ids)
        index = rest[:grid].view(len(ids), width)
        candidate = rest[grid:].view(len(ids), width).bool()
        packed = PackedBatch(fed_ids, positions, tuple(lengths), index, slots, reads, shared)
        return packed, candidate

    def _origin(self, request_id: int) -> int:
        """The pool row of a request's position 0 as its extent counts: its extent starts
        at the first position it does not read shared."""
        return self.pool.base(request_id) - self._held[request_id].shared  # type: ignore[union-attr]

    def _read_back(
        self,
        states: list[RequestState],
        logits: torch.Tensor,
        candidate: torch.Tensor,
        tau: torch.Tensor,
        sampling: RowSampling | None,
    ) -> np.ndarray:
        """Commits by each row's rule on the device (logits column j of a row is its j-th
        candidate where `candidate` says so) and reads the outcome back in the step's one
        device read: `[rows, 3 * width + 1]` of committed flags, new ids, confidences and
        the grid steps passed."""
        tokens = torch.full(
            candidate.shape, self.config.mask_token_id, dtype=torch.long, device=self.device
        )
        schedule = RowSchedule.of(states, self.device)
        result, timesteps = self._scores_and_commit(
            logits, sampling, schedule, candidate, tau, tokens
        )
        columns = [result.committed, tokens, result.confidence, timesteps[:, None]]
        return torch.cat([c.double() for c in columns], dim=1).cpu().numpy()

    def _commit(
        self, batch: Sequence[StepEntry], ids: list[int], kinds: list[int], host: np.ndarray
    ) -> StepReport:
        """Applies the read-back to the token state in one call, which checks every row
        before it changes any and returns the report's columns."""
        try:
            blocks, counts, positions, committed, confidence, done, passed = self._tokens.commit(
                ids, kinds, host
            )
        except ValueError as exc:
            raise StepFailedError(str(exc)) from None
        for rid, finished in zip(ids, done, strict=True):
            if finished:
                self._free_extent(rid, self._held[rid])
        return StepReport(
            step=0,
            requests=ids,
            kinds=[e.kind for e in batch],
            blocks=blocks,
            counts=counts,
            positions=positions,
            tokens=committed,
            confidence=confidence,
            done=done,
            timesteps=passed,
        )

    def _scores_and_commit(
        self,
        logits: torch.Tensor,
        sampling: RowSampling | None,
        schedule: RowSchedule | None,
        candidate: torch.Tensor,
        tau: torch.Tensor,
        ids: torch.Tensor,
    ) -> tuple[CommitResult, torch.Tensor]:
        """Each row's tokens and confidences (the argmax, or sampled and scored by its
        options), its commit — the threshold rule, or its share of the fixed schedule — and
        the steps of Dream's grid it passed. Device work only (the step's kernels after
        the forward), so that a benchmark can tell the host's share of a step."""
        if sampling is None and self.group is None:
            result = confidence_commit(logits, candidate, tau, ids)  # one fused pass
            rank = result.confidence
        elif sampling is None:  # tensor parallel: the ranks' partials, never their logits
            x0, confidence = vocab_parallel_scores(self.model, self.group, logits)  # type: ignore[arg-type]
            result = threshold_commit(x0, confidence, candidate, tau, ids)
            rank = result.confidence
        else:  # every logit is here (a tensor-parallel group's gathered on this rank)
            x0, confidence = argmax_confidence(logits, candidate)
            x0, confidence, rank = sampling.apply(logits, x0, confidence, self._noise)
            result = threshold_commit(x0, confidence, candidate, tau, ids)
        if schedule is None:  # every row the threshold rule, passing one step of no grid
            return result, torch.ones(len(tau), dtype=torch.long, device=self.device)
        return schedule.commit(result, rank, candidate, tau, ids, self.config.mask_token_id)
