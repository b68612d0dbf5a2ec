"""The decoding options of one step's rows, gathered once on the host into per-row tensors,
so every row's rule — LLaDA's or one of Dream's, under the threshold rule or the fixed
schedule — applies with batched ops and no per-row device work.

`RowSampling` scores every candidate position of rows that sample, filter or use a Dream
score (its token, the confidence τ is compared with, the rank that orders positions); the
threshold rule commits on the confidence; `RowSchedule` then replaces what the other rules
decide: the fixed schedule's best `k` by rank, Dream's `alg_temp` fallback, and the random
rule's positions that fire first on Dream's grid.

A row with its own `seed` draws its noise from a generator seeded by (seed, steps done,
which draw): what it samples depends on nothing else in the step, so it repeats in any
batch and on any instance. Only those rows are visited one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dilaserve.decoding import ConfidenceRule, dream_timesteps
from dilaserve.kernels import CommitResult
from dilaserve.protocol import RequestState
from dilaserve.worker.sampling import (
    dream_scores,
    first_fired,
    gumbel,
    kept_tokens,
    sample_tokens,
    token_probability,
    top_k_commit,
)

# Per-row rule codes on the device; LLaDA's rule (no `alg`) is -1.
RULE_CODES = {rule: code for code, rule in enumerate(ConfidenceRule)}
LLADA_RULE = -1


# The draws of a step, each from its own stream of a seeded row.
TOKEN_NOISE, POSITION_NOISE = 0, 1


def row_generator(seed: int, step: int, draw: int, device: torch.device) -> torch.Generator:
    """A generator for one draw of one step of a seeded request: numpy's `SeedSequence`
    mixes the three into a well-spread 63-bit seed."""
    entropy = (seed % 2**64, step, draw)
    mixed = int(np.random.SeedSequence(entropy).generate_state(1, np.uint64)[0]) >> 1
    return torch.Generator(device).manual_seed(mixed)


@dataclass(frozen=True)
class SeededRow:
    """A row (of a `RowSampling`'s) that draws from its own stream: at its `step`-th step,
    `candidates` positions."""

    row: int
    seed: int
    step: int
    candidates: int

    def redraw(self, noise: torch.Tensor, draw: int) -> None:
        """Overwrites this row's candidate positions of `noise` `[b, m, ...]` (uniforms)."""
        g = row_generator(self.seed, self.step, draw, noise.device)
        shape = (self.candidates, *noise.shape[2:])
        noise[self.row, : self.candidates] = torch.rand(
            shape, dtype=noise.dtype, device=noise.device, generator=g
        )


def _rows(flags: list[bool], device: torch.device) -> torch.Tensor | None:
    """Row flags on the device, None when no row is flagged (the step skips that rule)."""
    return torch.tensor(flags).to(device) if any(flags) else None


@dataclass(frozen=True)
class RowSampling:
    """Sampling options of a step's rows that need the full logits (`rows`, an index into
    the step's batch); the step's other rows keep the fused kernel's argmax and
    probability, so the full-vocabulary work — float64 noise, sorts, scores — is theirs
    alone, not the whole batch's."""

    rows: torch.Tensor  # [r] int64 indices of the rows with options
    temperature: torch.Tensor  # [r] float32, as temperatures always were: seeded runs repeat
    top_p: torch.Tensor  # [r] float32, 1: no filter
    top_k: torch.Tensor  # [r] int64, 0: no filter
    rule: torch.Tensor  # [r] int64 rule codes
    alg_temp: torch.Tensor  # [r] float32, 0: best first
    rules: frozenset[ConfidenceRule]
    any_temperature: bool
    filters: bool
    any_alg_temp: bool
    seeded: tuple[SeededRow, ...]  # rows numbered among the `r`

    @classmethod
    def of(cls, states: Sequence[RequestState], device: torch.device) -> RowSampling | None:
        """The step's options; None when every row takes the argmax and its probability
        (the fused kernel's commit)."""
        picked = [i for i, s in enumerate(states) if s.needs_full_logits]
        if not picked:
            return None
        states = [states[i] for i in picked]
        codes = [LLADA_RULE if s.alg is None else RULE_CODES[s.alg] for s in states]
        return cls(
            rows=torch.tensor(picked).to(device),
            temperature=torch.tensor([s.temperature for s in states]).to(device),
            top_p=torch.tensor([s.top_p for s in states]).to(device),
            top_k=torch.tensor([s.top_k or 0 for s in states]).to(device),
            rule=torch.tensor(codes).to(device),
            alg_temp=torch.tensor([s.alg_temp for s in states]).to(device),
            rules=frozenset(s.alg for s in states if s.alg is not None),
            any_temperature=any(s.temperature > 0 for s in states),
            filters=any(s.top_p < 1.0 or s.top_k is not None for s in states),
            any_alg_temp=any(s.alg_temp > 0 for s in states),
            seeded=tuple(
                SeededRow(i, s.seed, s.steps_done, s.masked_in_block)
                for i, s in enumerate(states)
                if s.seed is not None
            ),
        )

    def apply(
        self,
        logits: torch.Tensor,
        x0: torch.Tensor,
        confidence: torch.Tensor,
        generator: torch.Generator,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's tokens, confidences and ranks `[b, m]`: every row's argmax `x0` and
        its `confidence` (the fused kernel's, which also rank them), with the rows that
        have options scored over their own logits instead."""
        tokens, scored, rank = self.scores(logits.index_select(0, self.rows), generator)
        return (
            x0.index_copy(0, self.rows, tokens),
            confidence.index_copy(0, self.rows, scored.to(confidence.dtype)),
            confidence.index_copy(0, self.rows, rank.to(confidence.dtype)),
        )

    def scores(
        self, logits: torch.Tensor, generator: torch.Generator
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Tokens `[r, m]` of the rows with options (`logits` are theirs), the confidences
        τ is compared with, and the ranks that order positions (Dream's scale: negative
        entropy, not its exponential)."""
        noise = None
        if self.any_temperature:
            noise = self._draw(logits.shape, torch.float64, logits.device, generator, TOKEN_NOISE)
        scaled = keep = None
        if self.filters or self.rules:
            # Dream divides the logits by the temperature before filtering and scoring.
            divisor = torch.where(self.temperature > 0, self.temperature, 1.0)
            scaled = logits.float() / divisor[:, None, None]
        if self.filters:
            keep = kept_tokens(scaled, self.top_p, self.top_k)  # type: ignore[arg-type]
        x0 = sample_tokens(logits, self.temperature, keep, noise)
        confidence = token_probability(logits, x0)
        if not self.rules:
            return x0, confidence, confidence
        probability, margin, neg_entropy = dream_scores(scaled, keep, x0)  # type: ignore[arg-type]
        uniform = None
        if ConfidenceRule.RANDOM in self.rules or self.any_alg_temp:
            uniform = self._draw(x0.shape, torch.float32, x0.device, generator, POSITION_NOISE)
        by_rule = {
            ConfidenceRule.PROBABILITY: probability,
            ConfidenceRule.MARGIN: margin,
            ConfidenceRule.ENTROPY: neg_entropy,
            ConfidenceRule.RANDOM: uniform,
        }
        rank = self._per_rule(confidence, by_rule)
        by_rule[ConfidenceRule.ENTROPY] = torch.exp(neg_entropy)
        confidence = self._per_rule(confidence, by_rule)
        if self.any_alg_temp:
            # Gumbel-top-k: the best k of score / alg_temp + Gumbel noise are a draw of k
            # positions without replacement from softmax(score / alg_temp), as Dream's
            # `torch.multinomial` draws them.
            spread = self.alg_temp[:, None]
            drawn = rank / spread + gumbel(uniform)  # type: ignore[arg-type]
            rank = torch.where(spread > 0, drawn, rank)
        return x0, confidence, rank

    def _draw(
        self,
        shape: torch.Size,
        dtype: torch.dtype,
        device: torch.device,
        generator: torch.Generator,
        draw: int,
    ) -> torch.Tensor:
        """Uniforms `[b, m, ...]` from the shared `generator`, seeded rows' from their own."""
        noise = torch.rand(shape, dtype=dtype, device=device, generator=generator)
        for row in self.seeded:
            row.redraw(noise, draw)
        return noise

    def _per_rule(
        self, default: torch.Tensor, by_rule: dict[ConfidenceRule, torch.Tensor | None]
    ) -> torch.Tensor:
        """Each row's value under its own rule (`default` under LLaDA's)."""
        out = default
        for rule in self.rules:
            out = torch.where(self.rule[:, None] == RULE_CODES[rule], by_rule[rule], out)  # type: ignore[arg-type]
        return out


class RowSchedule:
    """What the step commits beside the threshold rule, row by row: the fixed schedule's
    counts, the random rule's grid and the rows whose fallback `alg_temp` draws."""

    @classmethod
    def of(cls, states: Sequence[RequestState], device: torch.device) -> RowSchedule | None:
        """The step's schedule; None when every row follows the threshold rule alone (no
        fixed schedule, no `alg_temp` fallback)."""
        if all(s.steps_per_block is None and s.alg_temp == 0 for s in states):
            return None
        return cls(states, device)

    def __init__(self, states: Sequence[RequestState], device: torch.device) -> None:
        self.device = device
        fixed = [s.steps_per_block is not None for s in states]
        # Rows whose schedule is a floor under the threshold rule, not the rule itself.
        self.floor_rows = _rows([s.threshold_floor for s in states], device)
        random = [f and s.alg is ConfidenceRule.RANDOM for s, f in zip(states, fixed, strict=True)]
        ranked = [f and not r for f, r in zip(fixed, random, strict=True)]
        counts, timesteps = [0] * len(states), [1] * len(states)
        for i, state in enumerate(states):
            if ranked[i] and state.alg is not None:
                index, counts[i] = state.dream_step()
                timesteps[i] = index - state.timestep + 1
            elif ranked[i]:
                counts[i] = state.transfer_count()
        self.timesteps = torch.tensor(timesteps).to(device, non_blocking=True)
        self.ranked_rows = _rows(ranked, device)
        self.counts = torch.tensor(counts).to(device) if self.ranked_rows is not None else None
        self.random_rows = _rows(random, device)
        self.survival = self._survival(states, random) if self.random_rows is not None else None
        fallback = [s.alg_temp > 0 and not f for s, f in zip(states, fixed, strict=True)]
        self.fallback_rows = _rows(fallback, device)

    def _survival(self, states: Sequence[RequestState], random: list[bool]) -> torch.Tensor:
        """`[b, S]` ratios t_(j+1) / t_now of each random-rule row's grid steps left but
        the last (`first_fired`), −inf beyond a row's own."""
        tails: list[list[float]] = []
        for state, r in zip(states, random, strict=True):
            tail: list[float] = []
            if r:
                grid = dream_timesteps(state.steps_per_block)  # type: ignore[arg-type]
                tail = [t / grid[state.timestep] for t in grid[state.timestep + 1 : -1]]
            tails.append(tail)
        width = max(1, *(len(t) for t in tails))
        padded = [t + [-torch.inf] * (width - len(t)) for t in tails]
        return torch.tensor(padded, dtype=torch.float32).to(self.device)

    def commit(
        self,
        result: CommitResult,
        rank: torch.Tensor,
        candidate: torch.Tensor,
        tau: torch.Tensor,
        ids: torch.Tensor,
        mask_token_id: int,
    ) -> tuple[CommitResult, torch.Tensor]:
        """The threshold rule's `result` with every other rule's rows replaced (`ids`
        rewritten to match), and the grid steps `[b]` each row's step passed."""
        committed = result.committed
        if self.fallback_rows is not None:
            # A row with no candidate at τ takes one position by its (drawn) rank.
            above = candidate & (result.confidence >= tau[:, None])
            first = top_k_commit(rank, candidate, torch.ones_like(tau, dtype=torch.long))
            drawn = torch.where(above.any(dim=1, keepdim=True), above, first)
            committed = torch.where(self.fallback_rows[:, None], drawn, committed)
        if self.ranked_rows is not None:
            scheduled = top_k_commit(rank, candidate, self.counts)  # type: ignore[arg-type]
            if self.floor_rows is not None:  # the threshold's commit, at least the share
                scheduled = torch.where(self.floor_rows[:, None], scheduled | committed, scheduled)
            committed = torch.where(self.ranked_rows[:, None], scheduled, committed)
        timesteps = self.timesteps
        if self.random_rows is not None:
            fired, passed = first_fired(rank, self.survival, candidate)  # type: ignore[arg-type]
            committed = torch.where(self.random_rows[:, None], fired, committed)
            timesteps = torch.where(self.random_rows, passed, timesteps)
        if committed is result.committed:
            return result, timesteps
        ids.copy_(torch.where(committed, result.x0, mask_token_id))
        return result._replace(committed=committed, counts=committed.sum(dim=1)), timesteps
