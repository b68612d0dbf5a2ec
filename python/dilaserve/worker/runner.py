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
committed tokens). With a cache, each request holds a contiguous extent of the KV pool,
sized by a memory budget and allocated by tokens (`kv_cache`).

On a tensor-parallel instance this runner lives on rank 0: it broadcasts each step's model
call as a packed plan (`step_plan`), every rank runs it on its shard, and the commit
combines the ranks' vocabulary partials instead of logits (`follower`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dilaserve._core import read_back
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
    CONFIDENCE_STATS,
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
    StepRejectedError,
)
from dilaserve.worker.follower import full_vocab_logits, make_pool, vocab_parallel_scores
from dilaserve.worker.forward import forward_logits
from dilaserve.worker.kv_cache import budget_tokens, bytes_per_token
from dilaserve.worker.tp_group import TensorParallelGroup


@dataclass
class _Held:
    """A request resident on this runner: its state, its tokens, whether it holds a KV
    extent, and whether that extent holds K/V a cache step may read."""

    state: RequestState
    tokens: np.ndarray  # prompt + output ids (int64), the step's host-side source
    extent: bool
    # The extent holds K/V of the current block's recompute step: a cache step may read it.
    cache_valid: bool = False
    # `state.done`, kept by each commit from the committed block alone (`finished_after`).
    done: bool = False

    @property
    def block_start(self) -> int:
        """Sequence index of the current block's first position."""
        return self.state.prompt_length + self.state.current_block * self.state.block_length


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
    ) -> None:
        """`kv_cache_memory` sizes the KV pool: bytes (int), a fraction of free device
        memory (float), or None for `kv_cache.DEFAULT_FRACTION`; the pool never holds
        more than `max_requests` sequences of `max_seq_len` tokens."""
        self.model = model
        self.config = model.config
        self.device = next(model.parameters()).device
        self.cache_mode = CacheMode(cache)
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
        self._held: dict[int, _Held] = {}
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
        vocab = self.config.vocab_size
        if any(not 0 <= t < vocab for t in state.prompt_ids + state.output_ids):
            raise TokenStateError(f"request {rid}: token id outside the vocabulary [0, {vocab})")
        if self.pool is not None:
            self.pool.allocate(rid, state.seq_length)
        tokens = np.array(state.prompt_ids + state.output_ids, dtype=np.int64)
        self._held[rid] = _Held(state.copy(), tokens, extent=self.pool is not None, done=state.done)

    def state(self, request_id: int) -> RequestState:
        """A copy of a resident request's current token state."""
        return self._get(request_id).state.copy()

    def next_kind(self, request_id: int) -> StepKind:
        """The step kind that continues a resident request here, for callers that drive the
        runner without the scheduler (offline decoding, profiling): a cache step exactly
        while this runner holds K/V of the current block (`cache_valid`, which a finished
        block invalidates); the scheduler decides the same from its own count."""
        return ahead_kind(self.cache_mode, self._get(request_id).cache_valid)

    def finished(self, request_id: int) -> bool:
        """Whether a resident request's last step finished it (it waits to be released)."""
        return self._get(request_id).done

    def export(self, request_id: int) -> RequestState:
        """Removes a request for migration; refused while its next step would read K/V held
        here (DESIGN §6: migrate only before a recompute step)."""
        if self.next_kind(request_id) is StepKind.CACHE:
            raise MigrationError(
                f"request {request_id}: its next step is a cache step; migrate it before a "
                "recompute step"
            )
        return self.release(request_id)

    def release(self, request_id: int) -> RequestState:
        """Drops a request (finished, cancelled or migrating) and frees its KV extent."""
        held = self._held.pop(request_id, None)
        if held is None:
            raise RequestNotHeldError(request_id)
        self._free_extent(request_id, held)
        return held.state

    def _free_extent(self, request_id: int, held: _Held) -> None:
        if held.extent and self.pool is not None:
            self.pool.free(request_id)
            held.extent = False

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
        kinds = [e.kind for e in batch]
        starts = [h.block_start for h in held]
        columns = [self._masked_in_block(h, s) for h, s in zip(held, starts, strict=True)]
        padded = candidate_columns(columns)
        packed = self._pack(held, kinds, starts, padded)
        tau = torch.tensor([e.tau for e in batch], dtype=torch.float32).to(self.device)
        # Rows sampled or scored by options need every logit: a TP step gathers them.
        sampling = RowSampling.of([h.state for h in held], self.device)
        with self._group_fatal():
            if self.group is not None:
                self.group.send_step(packed, full_logits=sampling is not None)
            logits = forward_logits(self.model, self.pool, packed)
            if self.group is not None and sampling is not None:
                logits = full_vocab_logits(self.model, self.group, logits)  # type: ignore[arg-type]
            counts = [len(c) for c in columns]
            report = self._commit(batch, held, starts, counts, padded, logits, tau, sampling)
        report.forward_tokens = fed = packed.ids.numel()
        self.forward_tokens += fed
        report.seconds = time.perf_counter() - started
        return report

    def check_entry(self, entry: StepEntry) -> None:
        """Raises `StepRejectedError` (or `RequestNotHeldError`) if `entry` cannot run here."""
        rid = entry.request_id
        h = self._get(rid)
        if not 0.0 <= entry.tau <= 1.0:
            raise StepRejectedError(f"request {rid}: threshold {entry.tau} is outside [0, 1]")
        if h.done:
            raise StepRejectedError(f"request {rid} is already finished")
        if entry.kind not in self.cache_mode.step_kinds():
            raise StepRejectedError(
                f"request {rid}: a {entry.kind} step cannot run with cache mode {self.cache_mode}"
            )
        if entry.kind is StepKind.CACHE and not h.cache_valid:
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

    def _masked_in_block(self, h: _Held, start: int) -> np.ndarray:
        """Block positions still masked: the step's candidates (never empty for a request
        that is not done); `start` is the block's first sequence index."""
        block = h.tokens[start : start + h.state.block_length]
        return (block == self.config.mask_token_id).nonzero()[0]

    def _window(self, h: _Held, kind: StepKind, start: int) -> tuple[int, int]:
        """The sequence positions `[begin, end)` a row feeds: all of them for a full step;
        for a cache step the block (dual) or block + suffix (prefix). A model whose logits
        are shifted (Dream) also needs the hidden state of the position before the block."""
        if kind is not StepKind.CACHE:
            return 0, h.state.seq_length
        begin = start - self.config.logit_shift
        if self.cache_mode is CacheMode.DUAL:
            return begin, start + h.state.block_length
        return begin, h.state.seq_length

    def _pack(
        self,
        rows: list[_Held],
        kinds: list[StepKind],
        starts: list[int],
        padded: np.ndarray,
    ) -> PackedBatch:
        """The step's one packed model call: every row's window, concatenated; logits for
        the block positions `padded` of each row (whose blocks begin at `starts`)."""
        windows = [self._window(h, k, s) for h, k, s in zip(rows, kinds, starts, strict=True)]
        begins = np.array([b for b, _ in windows])
        lengths = np.array([e - b for b, e in windows])
        offsets = np.concatenate(([0], np.cumsum(lengths)))
        ids = np.concatenate([h.tokens[b:e] for h, (b, e) in zip(rows, windows, strict=True)])
        # Fed token t of row i sits at position begin_i + (t - offset_i).
        positions = np.arange(offsets[-1]) + np.repeat(begins - offsets[:-1], lengths)
        # Logits only for the block's still-masked positions (the candidates), in position
        # order; masked position j of row i is fed token offset_i + (start_i - shift -
        # begin_i) + j.
        first = offsets[:-1] + np.array(starts) - self.config.logit_shift - begins
        index = torch.from_numpy(first[:, None] + padded)
        positions_t = torch.from_numpy(positions)
        slots = reads = None
        if self.pool is not None:
            bases = [self.pool.base(h.state.request_id) for h in rows]
            slots = torch.from_numpy(positions + np.repeat(np.array(bases), lengths))
            slots = slots.to(self.device, non_blocking=True)
            reads = tuple((base, h.state.seq_length) for base, h in zip(bases, rows, strict=True))
        return PackedBatch(
            torch.from_numpy(ids).to(self.device, non_blocking=True),
            positions_t.to(self.device, non_blocking=True),
            tuple(lengths.tolist()),
            index.to(self.device, non_blocking=True),
            slots,
            reads,
        )

    def _commit(
        self,
        batch: Sequence[StepEntry],
        rows: list[_Held],
        starts: list[int],
        counts: list[int],
        padded: np.ndarray,
        logits: torch.Tensor,
        tau: torch.Tensor,
        sampling: RowSampling | None,
    ) -> StepReport:
        """Commits by the threshold rule; logits column j of row i is its block position
        `padded[i, j]`, a candidate for j below `counts[i]` (lowest position first)."""
        width = logits.shape[1]
        on_host = np.arange(width)[None, :] < np.array(counts)[:, None]
        candidate = torch.from_numpy(on_host).to(self.device, non_blocking=True)
        ids = torch.full(
            (len(rows), width), self.config.mask_token_id, dtype=torch.long, device=self.device
        )
        schedule = RowSchedule([h.state for h in rows], self.device)
        result, timesteps = self._scores_and_commit(logits, sampling, schedule, candidate, tau, ids)
        # The step's one device read: committed flags, new ids, confidences and grid steps.
        host = (
            torch.cat(
                [
                    result.committed.double(),
                    ids.double(),
                    result.confidence.double(),
                    timesteps[:, None].double(),
                ],
                dim=1,
            )
            .cpu()
            .numpy()
        )
        committed, positions, tokens, stats, passed = read_back(host, counts, padded)
        report = StepReport(step=0)
        offset = 0
        for i, (e, h) in enumerate(zip(batch, rows, strict=True)):
            end = offset + committed[i]
            self._advance(
                report,
                e,
                h,
                starts[i],
                positions[offset:end],
                tokens[offset:end],
                stats[CONFIDENCE_STATS * i : CONFIDENCE_STATS * (i + 1)],
                passed[i],
            )
            offset = end
        return report

    def _scores_and_commit(
        self,
        logits: torch.Tensor,
        sampling: RowSampling | None,
        schedule: RowSchedule,
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
        return schedule.commit(result, rank, candidate, tau, ids, self.config.mask_token_id)

    def _advance(
        self,
        report: StepReport,
        entry: StepEntry,
        h: _Held,
        start: int,
        picked: list[int],
        tokens: list[int],
        stats: list[float],
        timesteps: int,
    ) -> None:
        """Applies one row's commit — block positions `picked` (from the block's first
        sequence index `start`) take `tokens`, and the steps of Dream's grid it passed — to
        its host-side state (no device work), and adds its row to `report`."""
        state = h.state
        h.tokens[[start + p for p in picked]] = tokens
        out_start = start - state.prompt_length
        block = out_start // state.block_length
        positions = [p + out_start for p in picked]
        state.commit(block, positions, tokens, timesteps)
        # Every step writes the fed tokens' K/V; only a recompute step refreshes the rest
        # of the sequence, which a cache step of the same block reads.
        h.cache_valid = (
            state.block_steps != 0
            and entry.kind is not StepKind.NO_CACHE
            and (h.cache_valid or entry.kind is StepKind.RECOMPUTE)
        )
        h.done = done = finished_after(state, block)
        if done:
            self._free_extent(state.request_id, h)
        report.add_row(
            state.request_id, entry.kind, block, positions, tokens, stats, done, timesteps
        )


def candidate_columns(columns: list[np.ndarray]) -> np.ndarray:
    """`[rows, widest]` block positions of each row's candidates (`columns`, never empty),
    a row with fewer repeating its last one; those columns are no candidates."""
    padded = np.empty((len(columns), max(len(c) for c in columns)), dtype=np.int64)
    for row, c in zip(padded, columns, strict=True):
        row[: len(c)] = c
        row[len(c) :] = c[-1]
    return padded


def finished_after(state: RequestState, block: int) -> bool:
    """`state.done` after a commit to output block `block`, from that block alone: decoding
    goes block by block, so the blocks before it are complete and hold no stop token (the
    request would have ended there), and those after it are still masked."""
    size = state.block_length
    start = block * size
    window = state.output_ids[start : start + size]
    stops = state.stop_token_ids
    if state.mask_token_id in window:
        unmasked = window[: window.index(state.mask_token_id)]
        return any(t in stops for t in unmasked)
    return start + size >= len(state.output_ids) or any(t in stops for t in window)
