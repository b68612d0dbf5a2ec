"""Executes one denoising step for a batch of requests, each with its own threshold.

DESIGN §1: output is decoded block by block; a step runs the model, and within the current
block commits every masked position whose confidence reaches the request's τ (at least one).
With an approximate KV cache the first step of a block is a *recompute* step over the whole
sequence that refreshes K/V, later steps of the block are *cache* steps over the block's
positions (dual cache) or the block and everything after it (prefix cache).

The runner decides nothing: the engine says which requests step, with which τ and which
step kind. A recompute step may start mid-block: it rebuilds the request's K/V from its
current tokens, which is how a request resumes on an instance that never held its cache.

On a tensor-parallel instance this runner lives on rank 0: it broadcasts each step's model
calls as a packed plan (`step_plan`), every rank runs them on its shard, and the commit
combines the ranks' vocabulary partials instead of logits (`follower`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from dilaserve.kernels import confidence_commit, threshold_commit
from dilaserve.protocol import (
    CacheMode,
    RequestState,
    StepEntry,
    StepKind,
    StepOutput,
    StepReport,
    TokenStateError,
)
from dilaserve.worker.errors import (
    GroupLostError,
    MigrationError,
    RequestNotHeldError,
    StepRejectedError,
)
from dilaserve.worker.follower import make_pool, vocab_parallel_scores
from dilaserve.worker.forward import ForwardGroup, forward_logits
from dilaserve.worker.kv_cache import KVCachePool
from dilaserve.worker.tp_group import TensorParallelGroup


@dataclass
class _Held:
    """A request resident on this runner: its state plus device-side tokens and KV slot."""

    state: RequestState
    tokens: torch.Tensor  # prompt + output ids, 1-D, on the model's device
    slot: int | None
    # The slot holds K/V of the current block's recompute step: a cache step may read it.
    cache_valid: bool = False

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
    ) -> None:
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
        slots = 0 if self.cache_mode is CacheMode.NONE else max_requests
        if self.group is not None:
            self.group.send_pool(slots, self.max_seq_len)
        self.pool: KVCachePool | None = make_pool(model, slots, self.max_seq_len)
        self._held: dict[int, _Held] = {}
        self.forward_tokens = 0

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
        tokens = torch.tensor(state.prompt_ids + state.output_ids, device=self.device)
        slot = self.pool.allocate() if self.pool is not None else None
        self._held[rid] = _Held(state=state.copy(), tokens=tokens, slot=slot)

    def state(self, request_id: int) -> RequestState:
        """A copy of a resident request's current token state."""
        return self._get(request_id).state.copy()

    def next_kind(self, request_id: int) -> StepKind:
        """The step kind that continues a resident request here: a cache step only while
        this runner holds the K/V of its current block."""
        held = self._get(request_id)
        kind = held.state.default_step_kind(self.cache_mode)
        if kind is StepKind.CACHE and not held.cache_valid:
            return StepKind.RECOMPUTE
        return kind

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
        """Drops a request (finished, cancelled or migrating) and frees its KV slot."""
        held = self._held.pop(request_id, None)
        if held is None:
            raise RequestNotHeldError(request_id)
        if held.slot is not None and self.pool is not None:
            self.pool.free(held.slot)
        return held.state

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
        full = [i for i, k in enumerate(kinds) if k is not StepKind.CACHE]
        cached = [i for i, k in enumerate(kinds) if k is StepKind.CACHE]
        order = full + cached
        groups: list[ForwardGroup] = []
        fed = 0
        if full:
            group, group_fed = self._full_inputs(
                [held[i] for i in full], write_cache=self.pool is not None
            )
            groups.append(group)
            fed += group_fed
        if cached:
            group, group_fed = self._cached_inputs([held[i] for i in cached])
            groups.append(group)
            fed += group_fed
        ordered = [held[i] for i in order]
        tau = torch.tensor([batch[i].tau for i in order], dtype=torch.float32, device=self.device)
        with self._group_fatal():
            if self.group is not None:
                self.group.send_step(groups)
            logits = forward_logits(self.model, self.pool, groups)
            outputs = self._commit(ordered, [kinds[i] for i in order], logits, tau)
        self.forward_tokens += fed
        by_id = {o.request_id: o for o in outputs}
        return StepReport(
            step=0,
            outputs=[by_id[e.request_id] for e in batch],
            forward_tokens=fed,
            seconds=time.perf_counter() - started,
        )

    def check_entry(self, entry: StepEntry) -> None:
        """Raises `StepRejectedError` (or `RequestNotHeldError`) if `entry` cannot run here."""
        rid = entry.request_id
        h = self._get(rid)
        if not 0.0 <= entry.tau <= 1.0:
            raise StepRejectedError(f"request {rid}: threshold {entry.tau} is outside [0, 1]")
        if h.state.done:
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

    def _full_inputs(self, rows: list[_Held], *, write_cache: bool) -> tuple[ForwardGroup, int]:
        """No-cache or recompute step: every position of each row goes through the model."""
        lengths = [h.state.seq_length for h in rows]
        ids, positions, valid = self._pack([h.tokens for h in rows], [0] * len(rows), lengths)
        starts = torch.tensor([h.block_start for h in rows], device=self.device)
        logits_index = self._block_index(rows, starts - self.config.logit_shift)
        group = ForwardGroup(ids, positions, valid, logits_index)
        if write_cache:
            group.cache_mode, group.cache_rows = "write", self._slots(rows)
        return group, sum(lengths)

    def _cached_inputs(self, rows: list[_Held]) -> tuple[ForwardGroup, int]:
        """Cache step: the block (dual) or block + suffix (prefix) over stored K/V.

        A model whose logits are shifted (Dream) also needs the hidden state of the position
        before the block, so that one position is fed as well.
        """
        shift = self.config.logit_shift
        begins = [h.block_start - shift for h in rows]
        if self.cache_mode is CacheMode.DUAL:
            ends = [h.block_start + h.state.block_length for h in rows]
        else:
            ends = [h.state.seq_length for h in rows]
        ids, positions, valid = self._pack(
            [h.tokens for h in rows], begins, [e - b for b, e in zip(begins, ends, strict=True)]
        )
        zeros = torch.zeros(len(rows), dtype=torch.long, device=self.device)
        lengths = torch.tensor([h.state.seq_length for h in rows], device=self.device)
        group = ForwardGroup(
            ids,
            positions,
            valid,
            self._block_index(rows, zeros),
            cache_mode="read",
            cache_rows=self._slots(rows),
            cache_len=lengths,
        )
        return group, int(valid.sum())

    def _pack(
        self, tokens: list[torch.Tensor], begins: list[int], lengths: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Right-padded `[b, n]` ids, absolute positions and validity of per-row windows."""
        n = max(lengths)
        ids = torch.full(
            (len(tokens), n), self.config.pad_token_id, dtype=torch.long, device=self.device
        )
        for i, (t, b, length) in enumerate(zip(tokens, begins, lengths, strict=True)):
            ids[i, :length] = t[b : b + length]
        offsets = torch.arange(n, device=self.device)
        valid = offsets[None, :] < torch.tensor(lengths, device=self.device)[:, None]
        begin = torch.tensor(begins, device=self.device)[:, None]
        positions = torch.where(valid, begin + offsets[None, :], 0)
        return ids, positions, valid

    def _block_index(self, rows: list[_Held], first: torch.Tensor) -> torch.Tensor:
        """`[b, Bmax]` indices of each row's block among its fed tokens, starting at `first`.

        Rows with a shorter block repeat their last index; those columns are never candidates.
        """
        sizes = torch.tensor([h.state.block_length for h in rows], device=self.device)
        offsets = torch.arange(int(sizes.max()), device=self.device)[None, :]
        return first[:, None] + torch.minimum(offsets, sizes[:, None] - 1)

    def _slots(self, rows: list[_Held]) -> torch.Tensor:
        return torch.tensor([h.slot for h in rows], device=self.device)

    def _commit(
        self, rows: list[_Held], kinds: list[StepKind], logits: torch.Tensor, tau: torch.Tensor
    ) -> list[StepOutput]:
        width = logits.shape[1]
        mask_id = self.config.mask_token_id
        starts = [h.block_start for h in rows]
        sizes = [h.state.block_length for h in rows]
        ids = torch.full((len(rows), width), mask_id, dtype=torch.long, device=self.device)
        for i, (h, s, size) in enumerate(zip(rows, starts, sizes, strict=True)):
            ids[i, :size] = h.tokens[s : s + size]
        in_block = (
            torch.arange(width, device=self.device)[None, :]
            < torch.tensor(sizes, device=self.device)[:, None]
        )
        candidate = (ids == mask_id) & in_block
        if self.group is None:
            result = confidence_commit(logits, candidate, tau, ids)
        else:
            x0, confidence = vocab_parallel_scores(self.model, self.group, logits)  # type: ignore[arg-type]
            result = threshold_commit(x0, confidence, candidate, tau, ids)
        committed = result.committed.tolist()
        new_ids = ids.tolist()
        stats = result.stats.tolist()
        outputs = []
        for i, h in enumerate(rows):
            size = sizes[i]
            h.tokens[starts[i] : starts[i] + size] = ids[i, :size]
            state = h.state
            out_start = starts[i] - state.prompt_length
            positions = [out_start + j for j in range(size) if committed[i][j]]
            tokens = [new_ids[i][j] for j in range(size) if committed[i][j]]
            state.commit(out_start // size, positions, tokens)
            block_open = state.block_steps != 0
            # Every step writes the fed tokens' K/V; only a recompute step refreshes the rest
            # of the sequence, which a cache step of the same block reads.
            h.cache_valid = (
                block_open
                and kinds[i] is not StepKind.NO_CACHE
                and (h.cache_valid or kinds[i] is StepKind.RECOMPUTE)
            )
            done = state.done
            if done and h.slot is not None and self.pool is not None:
                self.pool.free(h.slot)
                h.slot = None
            outputs.append(
                StepOutput(
                    request_id=state.request_id,
                    kind=kinds[i],
                    block=out_start // size,
                    committed_positions=positions,
                    committed_tokens=tokens,
                    confidence_stats=tuple(stats[i]),  # type: ignore[arg-type]
                    num_masked=state.num_masked,
                    done=done,
                )
            )
        return outputs
