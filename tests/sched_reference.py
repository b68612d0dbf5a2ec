"""Pure-Python implementation of the scheduler's algorithms (DESIGN §4-§6), the baseline of
`benches/scheduler.py` and an independent check of the Rust core: fed the same events, it
must make bit-identical decisions.

It mirrors the Rust code's data structures (sorted arrival order, per-degree segment trees
over the instances) so the speed comparison is of implementations, not of algorithms, and
evaluates every float expression in the same order so results match exactly.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field

FACTOR_WEIGHT = 0.2
FACTOR_CLAMP = 4.0
IDLE_RELAX = 0.9
BIG = 1 << 62  # an unbounded room
SPEED_PRIOR_TOKENS = 32.0  # MeanRatePredictor::SPEED_PRIOR_TOKENS
FAST_DLLM_GSM8K = ((0.5, 7.01), (0.6, 6.17), (0.7, 5.12), (0.8, 4.24), (0.9, 3.25), (1.0, 1.0))


class Table:
    """One latency table, made non-decreasing by a running maximum."""

    def __init__(self, points: list[tuple[int, float]]) -> None:
        self.tokens = [float(t) for t, _ in points]
        self.seconds: list[float] = []
        worst = 0.0
        for _, s in points:
            worst = max(worst, s)
            self.seconds.append(worst)

    def latency(self, x: float) -> float:
        t, s = self.tokens, self.seconds
        n = len(t)
        if n == 1 or x <= t[0]:
            if n == 1 and x > t[0]:
                return max(s[0] * x / t[0], s[0])
            return s[0]
        hi = min(bisect.bisect_left(t, x), n - 1)
        lo = hi - 1
        slope = (s[hi] - s[lo]) / (t[hi] - t[lo])
        if x > t[n - 1]:
            return s[n - 1] + slope * (x - t[n - 1])
        # Clamped to the segment so that rounding never makes a larger batch cheaper.
        return min(max(s[lo] + slope * (x - t[lo]), s[lo]), s[hi])


class DegreeCosts:
    def __init__(self, profile, tp: int, caching: bool, max_batch: int) -> None:
        self.tp = tp
        self.full_t = Table(profile.points(tp, "recompute" if caching else "no_cache"))
        self.cache_t = Table(profile.points(tp, "cache")) if caching else None
        self.default_budget = max_batch
        self.full_throughput = self.best_full_rate(float(max_batch))

    def best_full_rate(self, budget: float) -> float:
        candidates = [t for t in self.full_t.tokens if t <= budget] + [budget]
        return max([0.0] + [x / self.full_t.latency(x) for x in candidates])

    def full(self, x: float) -> float:
        return self.full_t.latency(x)

    def cache(self, x: float) -> float:
        return (self.cache_t or self.full_t).latency(x)

    def batch(self, full_tokens: int, cache_tokens: int) -> float:
        secs = 0.0
        if full_tokens > 0:
            secs += self.full(float(full_tokens))
        if cache_tokens > 0:
            secs += self.cache(float(cache_tokens))
        return secs

    def throughput(
        self, mean_seq: float, block: int, spb: float, budget: int, kv=None, max_req=None
    ) -> float:
        seq = max(mean_seq, 1.0)
        room = float(budget)
        if kv is not None:
            room = min(room, float(kv))
        if self.cache_t is None:
            if max_req is not None:
                room = min(room, float(max_req) * seq)
            if room == float(self.default_budget):
                return self.full_throughput
            return self.best_full_rate(room)
        b = float(block)
        max_seqs = max(float(math.floor(room / seq)), 1.0)
        if max_req is not None:
            max_seqs = min(max_seqs, float(max_req))
        cache_steps = max(min(spb, b) - 1.0, 0.0)
        tokens = b * max_seqs * cache_steps + max_seqs * seq
        secs = self.cache_t.latency(b * max_seqs) * cache_steps + self.full(max_seqs * seq)
        return tokens / secs


class MeanRatePredictor:
    def __init__(self, points=FAST_DLLM_GSM8K) -> None:
        pts = sorted(points)
        self.taus = [p[0] for p in pts]
        self.rates = [p[1] for p in pts]

    def rate(self, tau: float) -> float:
        taus, rates = self.taus, self.rates
        if tau <= taus[0]:
            return rates[0]
        if tau >= taus[-1]:
            return rates[-1]
        hi = bisect.bisect_left(taus, tau)
        lo = hi - 1
        w = (tau - taus[lo]) / (taus[hi] - taus[lo])
        return rates[lo] + w * (rates[hi] - rates[lo])

    def speed(self, r: Request) -> float:
        if r.steps_done == 0:
            return 1.0
        tau_sum = 0.0
        for tau in r.taus:
            tau_sum += tau
        block = float(r.block_length)
        per_step = block / math.ceil(block / self.rate(tau_sum / r.steps_done))
        prior = SPEED_PRIOR_TOKENS
        return (r.unmasked + prior) / (r.steps_done * per_step + prior)

    def predict(self, r: Request, thresholds: list[float]) -> list[list[float]]:
        masked = float(r.block_length - r.in_block)
        block = float(r.block_length)
        future = float(max(r.output_len // r.block_length - (r.current_block + 1), 0))
        lost = 1.0 if r.needs_recompute() else 0.0
        speed = self.speed(r)
        out = []
        for tau in thresholds:
            rate = max(self.rate(tau) * speed, 1.0)
            current = float(math.ceil(masked / rate))
            per_block = float(math.ceil(block / rate))
            out.append([(current - lost) + future * (per_block - 1.0), future + lost])
        return out


@dataclass
class Request:
    id: int
    seq: int
    arrival: float
    deadline: float
    priority: int
    prompt_len: int
    output_len: int
    block_length: int
    allowed: int
    next_kind: str
    steps_done: int = 0
    unmasked: int = 0
    in_block: int = 0
    current_block: int = 0
    home: int | None = None
    displaced_from: tuple[int, str] | None = None
    in_flight: bool = False
    cap: int = 0
    steps: list[list[float]] = field(default_factory=list)
    last_tau: float = math.nan
    taus: list[float] = field(default_factory=list)
    instances: list[int] = field(default_factory=list)
    recompute_steps: int = 0
    migrations: int = 0
    first_dispatch: float | None = None

    def seq_tokens(self) -> int:
        return self.prompt_len + self.output_len

    def step_tokens(self) -> int:
        return self.block_length if self.next_kind == "cache" else self.seq_tokens()

    def next_estimate(self, caching: bool) -> int:
        return self.block_length if caching else self.seq_tokens()

    def needs_recompute(self) -> bool:
        if self.next_kind == "recompute":
            return True
        if self.next_kind == "cache":
            return False
        return self.in_block == 0


@dataclass
class Instance:
    id: int
    tp: int
    group: int
    budget: int
    kv: int | None = None
    max_req: int | None = None
    alive: bool = True
    draining: bool = False
    busy: bool = False
    inflight: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    next_tokens: int = 0
    started_at: float = 0.0
    predicted_s: float = 0.0
    residents: int = 0
    resident_tokens: int = 0
    factor: float = 1.0

    def predicted_finish(self) -> float:
        return self.started_at + self.predicted_s * self.factor

    def base(self) -> int:
        return self.next_tokens if self.busy else 0


@dataclass
class Decisions:
    """Same content as the Rust decisions, as plain tuples."""

    batches: list[tuple[int, int, float]] = field(default_factory=list)
    entries: list[tuple[int, float, str, bool, int, int, int]] = field(default_factory=list)
    migrations: list[tuple[int, int, int, str]] = field(default_factory=list)
    waiting: list[tuple[int, str]] = field(default_factory=list)
    overloaded: bool = False


def highest_bit(mask: int) -> int:
    return mask.bit_length() - 1


def lowest_bit(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


# A tree entry: (start, factor, tokens, batch room, KV room, request room, steady tokens).
CLOSED = (math.inf, math.inf, BIG, -1, -1, -1, BIG)


@dataclass(frozen=True)
class Lookahead:
    """Further steps earliest-completion choice prices at an instance's steady load."""

    steps: int
    block: int
    caching: bool

    def per_step(self, residents: int, seq: int) -> int:
        if self.caching:
            return residents * self.block + seq // (self.steps + 1)
        return seq

    def key(self, leaf: tuple, n: int, own: int, costs: DegreeCosts) -> float:
        nxt = costs.full(float(leaf[2] + n))
        if self.steps == 0:
            return leaf[0] + leaf[1] * nxt
        return leaf[0] + leaf[1] * (nxt + self.steps * costs.full(float(leaf[6] + own)))


class ChoiceTree:
    """Segment tree over one degree's instances (rust/src/scheduler/choice_tree.rs)."""

    def __init__(self) -> None:
        self.slots: list[int] = []
        self.width = 1
        self.nodes: list[tuple] = []

    def build(self, leaf) -> None:
        w = 1
        while w < len(self.slots):
            w *= 2
        self.width = w
        nodes = [CLOSED] * (2 * w)
        for i, slot in enumerate(self.slots):
            nodes[w + i] = leaf(slot)
        for i in range(w - 1, 0, -1):
            nodes[i] = _merge(nodes[2 * i], nodes[2 * i + 1])
        self.nodes = nodes

    def set(self, index: int, leaf: tuple) -> None:
        nodes = self.nodes
        i = self.width + index
        nodes[i] = leaf
        while i > 1:
            i //= 2
            nodes[i] = _merge(nodes[2 * i], nodes[2 * i + 1])

    def search(self, n: int, seq: int, look: Lookahead | None, costs: DegreeCosts, best):
        """`look`: earliest completion with this lookahead; None: least loaded."""
        bound = self._bound(1, n, seq, look, costs)
        if bound is None:
            return best
        return self._visit(1, 0, self.width, bound, n, seq, look, costs, best)

    def _bound(self, node, n, seq, look, costs):
        if node >= len(self.nodes):
            return None
        agg = self.nodes[node]
        if agg[3] < n or agg[4] < seq or agg[5] < 1:
            return None
        return agg[0] if look is None else look.key(agg, n, look.per_step(1, seq), costs)

    def _visit(self, node, first, span, bound, n, seq, look, costs, best):
        first_slot = self.slots[first]
        if best is not None and (bound > best[0] or (bound == best[0] and first_slot > best[1])):
            return best
        if span == 1:
            return (bound, first_slot)
        half = span // 2
        left, right = 2 * node, 2 * node + 1
        lb = self._bound(left, n, seq, look, costs)
        rb = self._bound(right, n, seq, look, costs)
        if lb is not None and rb is not None and rb < lb:
            best = self._visit(right, first + half, half, rb, n, seq, look, costs, best)
            return self._visit(left, first, half, lb, n, seq, look, costs, best)
        if lb is not None:
            best = self._visit(left, first, half, lb, n, seq, look, costs, best)
        if rb is not None:
            best = self._visit(right, first + half, half, rb, n, seq, look, costs, best)
        return best

    def any_resident_room(self, seq: int) -> bool:
        return bool(self.slots) and self._room(1, seq)

    def _room(self, node: int, seq: int) -> bool:
        agg = self.nodes[node]
        if agg[4] < seq or agg[5] < 1:
            return False
        return node >= self.width or self._room(2 * node, seq) or self._room(2 * node + 1, seq)


def _merge(a: tuple, b: tuple) -> tuple:
    return (
        min(a[0], b[0]),
        min(a[1], b[1]),
        min(a[2], b[2]),
        max(a[3], b[3]),
        max(a[4], b[4]),
        max(a[5], b[5]),
        min(a[6], b[6]),
    )


class Placement:
    """One round's instance accounting (rust/src/scheduler/placement.rs)."""

    def __init__(self, insts: list[Instance], ngroups: int, now: float, least_loaded: bool,
                 look: Lookahead, reserved: int | None) -> None:  # fmt: skip
        self.insts = insts
        self.now = now
        self.least_loaded = least_loaded
        self.look = look
        self.reserved = reserved
        n = len(insts)
        self.tokens = [0] * n
        self.full_tokens = [0] * n
        self.queued = [(0, 0)] * n
        self.open = [i.alive and not i.busy for i in insts]
        self.targets = sum(1 for i in insts if i.alive and not i.draining)
        self.accepting = sum(
            1 for i, o in zip(insts, self.open, strict=True) if o and not i.draining
        )
        self.trees = [ChoiceTree() for _ in range(ngroups)]
        self.leaf_of: list[int | None] = [None] * n

    def fits(self, slot: int, n: int) -> bool:
        inst = self.insts[slot]
        return inst.base() + self.tokens[slot] + n <= inst.budget

    def start(self, inst: Instance) -> float:
        return max(self.now, inst.predicted_finish()) if inst.busy else self.now

    def open_leaf(self, slot: int) -> tuple:
        inst = self.insts[slot]
        if not inst.alive or inst.draining:
            return CLOSED
        rnd = self.tokens[slot]
        tokens = inst.base() + rnd
        q_reqs, q_seq = self.queued[slot]
        if self.least_loaded:
            start, factor = float(inst.resident_tokens + rnd), 0.0
        else:
            start, factor = self.start(inst), inst.factor
        kv = BIG if inst.kv is None else max(inst.kv - inst.resident_tokens - q_seq, 0)
        req = BIG if inst.max_req is None else max(inst.max_req - inst.residents - q_reqs, 0)
        return (start, factor, tokens, max(inst.budget - tokens, 0), kv, req, self.steady(slot))

    def steady(self, slot: int, horizon: Lookahead | None = None) -> int:
        inst = self.insts[slot]
        q_reqs, q_seq = self.queued[slot]
        look = horizon or self.look
        return look.per_step(inst.residents + q_reqs, inst.resident_tokens + q_seq)

    def leaf(self, slot: int) -> tuple:
        return CLOSED if slot == self.reserved else self.open_leaf(slot)

    def build(self) -> None:
        for slot, inst in enumerate(self.insts):
            if inst.alive:
                tree = self.trees[inst.group]
                self.leaf_of[slot] = len(tree.slots)
                tree.slots.append(slot)
        for tree in self.trees:
            tree.build(self.leaf)

    def refresh(self, slot: int) -> None:
        index = self.leaf_of[slot]
        if index is not None:
            self.trees[self.insts[slot].group].set(index, self.leaf(slot))

    def best(self, n: int, seq: int, groups: list[DegreeCosts]):
        best = None
        for tree, costs in zip(self.trees, groups, strict=False):
            best = tree.search(n, seq, None if self.least_loaded else self.look, costs, best)
        return best

    def reserved_key(self, slot: int, n: int, seq: int, costs: DegreeCosts) -> float | None:
        leaf = self.open_leaf(slot)
        if leaf[3] >= n and leaf[4] >= seq and leaf[5] >= 1:
            if self.least_loaded:
                return leaf[0]
            return self.look.key(leaf, n, self.look.per_step(1, seq), costs)
        return None

    def home_key(self, slot: int, n: int, seq: int, costs: DegreeCosts) -> float | None:
        inst = self.insts[slot]
        if inst.draining or not self.fits(slot, n):
            return None
        rnd = self.tokens[slot]
        if self.least_loaded:
            return float(max(inst.resident_tokens - seq, 0) + rnd)
        leaf = (self.start(inst), inst.factor, inst.base() + rnd, 0, 0, 0, self.steady(slot))
        return self.look.key(leaf, n, 0, costs)

    def move_pays(self, home: int, to: int, n: int, seq: int, policy, groups) -> bool:
        horizon = Lookahead(policy.lookahead_steps, self.look.block, self.look.caching)

        def key(slot: int, own: int) -> float:
            inst = self.insts[slot]
            tokens = inst.base() + self.tokens[slot]
            leaf = (self.start(inst), inst.factor, tokens, 0, 0, 0, self.steady(slot, horizon))
            return horizon.key(leaf, n, own, groups[inst.group]) - self.now

        return key(to, horizon.per_step(1, seq)) < key(home, 0) * (1.0 - policy.migration_gain)

    def add_free(self, slot: int, n: int, new_resident: int | None) -> None:
        self.tokens[slot] += n
        if self.insts[slot].busy:
            if new_resident is not None:
                reqs, toks = self.queued[slot]
                self.queued[slot] = (reqs + 1, toks + new_resident)
        else:
            self.full_tokens[slot] += n
        self.refresh(slot)

    def resident_room(self, slot: int, seq: int) -> bool:
        inst = self.insts[slot]
        reqs, toks = self.queued[slot]
        return (
            inst.alive
            and not inst.draining
            and (inst.kv is None or inst.resident_tokens + toks + seq <= inst.kv)
            and (inst.max_req is None or inst.residents + reqs + 1 <= inst.max_req)
        )

    def any_resident_room(self, seq: int) -> bool:
        return any(t.any_resident_room(seq) for t in self.trees)

    def next_end(self, slot: int, costs: DegreeCosts) -> float:
        inst = self.insts[slot]
        tokens = inst.base() + self.tokens[slot]
        if tokens == 0:
            return self.start(inst)
        return self.start(inst) + inst.factor * costs.full(float(tokens))


@dataclass(frozen=True)
class Finished:
    """Same fields as `dilaserve.scheduler.FinishedRequest`."""

    id: int
    steps: int
    recompute_steps: int
    taus: list[float]
    instances: list[int]
    migrations: int
    first_dispatch: float | None
    deadline: float
    arrival: float


class ReferenceScheduler:
    """Same events and decisions as `dilaserve.scheduler.Scheduler`, in plain Python.

    Expects valid input: it does none of the Rust core's checks.
    """

    def __init__(self, profile, config) -> None:
        p = config.policy
        self.profile = profile
        self.taus = sorted(config.thresholds)
        self.block_length = config.block_length
        self.caching = config.caching
        self.max_batch = config.max_batch_tokens
        self.slo_window = config.slo_window_s
        self.max_queued = config.max_queued
        self.fixed_tau = p.fixed_tau if p.threshold == "fixed" else None
        self.load_control = p.load_control and self.fixed_tau is None
        self.by_priority = p.load_order == "priority"
        self.least_loaded = p.instance_choice == "least_loaded"
        self.look = Lookahead(p.lookahead_steps, config.block_length, config.caching)
        self.migration = p.migration
        self.policy = p
        self.every = p.predict_every if p.prediction == "online" else None
        self.predictor = MeanRatePredictor(config.predictor_rates or FAST_DLLM_GSM8K)
        self.requests: dict[int, Request] = {}
        self.order: list[tuple[tuple, int]] = []
        self.instances: list[Instance] = []
        self.instance_slot: dict[int, int] = {}
        self.groups: list[DegreeCosts] = []
        # Measured / predicted step time, pooled over each degree group's instances.
        self.group_factors: list[float] = []
        self.next_seq = 0
        self.queued = 0
        self.overloaded = False
        self.reservation: tuple[int, int] | None = None  # (request id, instance slot)

    # ---- events -----------------------------------------------------------------------
    def arrive(self, request_id, *, arrival, deadline, prompt_len, output_len, priority=0,
               block_length=None, thresholds=None) -> None:  # fmt: skip
        if self.overloaded and self.max_queued is not None and self.queued >= self.max_queued:
            raise RuntimeError(f"request {request_id} rejected: overloaded")
        b = block_length or self.block_length
        allowed = (1 << len(self.taus)) - 1
        if thresholds is not None:
            allowed = sum(1 << self.taus.index(t) for t in set(thresholds))
        r = Request(
            id=request_id, seq=self.next_seq, arrival=arrival, deadline=deadline,
            priority=priority, prompt_len=prompt_len, output_len=-(-output_len // b) * b,
            block_length=b, allowed=allowed,
            next_kind="recompute" if self.caching else "no_cache",
        )  # fmt: skip
        self.next_seq += 1
        self.queued += 1
        r.cap = highest_bit(allowed)
        r.steps = self.predictor.predict(r, self.taus)
        self.requests[request_id] = r
        key = (-priority if self.by_priority else 0, arrival, r.seq)
        bisect.insort(self.order, (key, request_id))

    def cancel(self, request_id: int) -> None:
        r = self.requests.pop(request_id)
        if r.home is not None:
            inst = self.instances[r.home]
            self._drop_resident(r.home, r)
            if r.in_flight:
                inst.inflight.remove(request_id)
                inst.cancelled.append(request_id)
                inst.next_tokens = max(inst.next_tokens - r.next_estimate(self.caching), 0)
        if r.first_dispatch is None:
            self.queued -= 1
        if self.reservation is not None and self.reservation[0] == request_id:
            self.reservation = None
        self.order = [e for e in self.order if e[1] != request_id]

    def add_instance(self, instance_id: int, *, tp: int, gpus=(), node: int = 0, kv_tokens=None,
                     max_requests=None, max_batch_tokens=None) -> None:  # fmt: skip
        group = next((g for g, c in enumerate(self.groups) if c.tp == tp), None)
        if group is None:
            self.groups.append(DegreeCosts(self.profile, tp, self.caching, self.max_batch))
            self.group_factors.append(1.0)
            group = len(self.groups) - 1
        self.instance_slot[instance_id] = len(self.instances)
        budget = self.max_batch if max_batch_tokens is None else max_batch_tokens
        self.instances.append(Instance(instance_id, tp, group, budget, kv_tokens, max_requests))

    def drain_instance(self, instance_id: int) -> None:
        slot = self.instance_slot[instance_id]
        self.instances[slot].draining = True
        if self.reservation is not None and self.reservation[1] == slot:
            self.reservation = None

    def undrain_instance(self, instance_id: int) -> None:
        self.instances[self.instance_slot[instance_id]].draining = False

    def drained_instances(self) -> list[int]:
        return [
            i.id
            for i in self.instances
            if i.alive and i.draining and not i.busy and i.residents == 0
        ]

    def remove_instance(self, instance_id: int) -> None:
        slot = self.instance_slot.pop(instance_id)
        inst = self.instances[slot]
        inst.alive = inst.busy = False
        inst.inflight, inst.cancelled = [], []
        inst.residents = inst.resident_tokens = inst.next_tokens = 0
        if self.reservation is not None and self.reservation[1] == slot:
            self.reservation = None
        for r in self.requests.values():
            if r.home == slot:
                self._displace(r, instance_id, "instance_removed")

    def abort_step(self, instance_id: int) -> list[int]:
        slot = self.instance_slot[instance_id]
        inst = self.instances[slot]
        aborted, inst.inflight, inst.cancelled = inst.inflight, [], []
        inst.busy = False
        inst.next_tokens = 0
        for rid in aborted:
            r = self.requests[rid]
            self._drop_resident(slot, r)
            self._displace(r, instance_id, "step_aborted")
        return aborted

    def _displace(self, r: Request, from_id: int, reason: str) -> None:
        r.home = None
        r.in_flight = False
        r.displaced_from = (from_id, reason)
        if self.caching and r.next_kind == "cache":
            r.next_kind = "recompute"
            if self.every is not None:
                r.steps = self.predictor.predict(r, self.taus)

    def step_done(self, instance_id: int, measured_s: float, results) -> list[Finished]:
        inst = self.instances[self.instance_slot[instance_id]]
        if inst.predicted_s > 0.0:
            ratio = min(max(measured_s / inst.predicted_s, 1.0 / FACTOR_CLAMP), FACTOR_CLAMP)
            inst.factor = (1.0 - FACTOR_WEIGHT) * inst.factor + FACTOR_WEIGHT * ratio
            pooled = self.group_factors[inst.group]
            self.group_factors[inst.group] = (1.0 - FACTOR_WEIGHT) * pooled + FACTOR_WEIGHT * ratio
        finished = []
        for res in sorted(results, key=lambda x: x[0]):
            if res[0] in inst.cancelled:
                continue
            r = self.requests[res[0]]
            r.taus.append(r.last_tau)
            if r.next_kind == "recompute":
                r.recompute_steps += 1
            if self._commit(r, res[1], res[3]):
                self._drop_resident(r.home, r)
                del self.requests[r.id]
                finished.append(self._finished(r))
        if finished:
            gone = {f.id for f in finished}
            self.order = [e for e in self.order if e[1] not in gone]
        inst.inflight, inst.cancelled = [], []
        inst.busy = False
        inst.next_tokens = 0
        return finished

    @staticmethod
    def _finished(r: Request) -> Finished:
        return Finished(
            r.id, r.steps_done, r.recompute_steps, r.taus, r.instances, r.migrations,
            r.first_dispatch, r.deadline, r.arrival,
        )  # fmt: skip

    def _commit(self, r: Request, committed: int, eos: bool) -> bool:
        was_full = r.needs_recompute()
        r.in_flight = False
        r.steps_done += 1
        r.unmasked += committed
        r.in_block += committed
        if r.in_block == r.block_length:
            r.current_block += 1
            r.in_block = 0
            if self.caching:
                r.next_kind = "recompute"
        elif self.caching:
            r.next_kind = "cache"
        if eos or r.unmasked >= r.output_len:
            return True
        if self.every is not None and r.steps_done % self.every == 0:
            r.steps = self.predictor.predict(r, self.taus)
        else:
            k = 1 if was_full else 0
            for s in r.steps:
                s[k] = max(s[k] - 1.0, 0.0)
        return False

    def _drop_resident(self, slot: int, r: Request) -> None:
        self.instances[slot].residents -= 1
        self.instances[slot].resident_tokens -= r.seq_tokens()

    def _add_resident(self, slot: int, r: Request) -> None:
        self.instances[slot].residents += 1
        self.instances[slot].resident_tokens += r.seq_tokens()

    # ---- one round --------------------------------------------------------------------
    def schedule(self, now: float) -> Decisions:
        ordered = [self.requests[rid] for _, rid in self.order]
        self.overloaded = False
        if self.load_control and ordered:
            self.overloaded = self._control_load(ordered)
        out = Decisions(overloaded=self.overloaded)
        for inst in self.instances:
            if not inst.busy:  # an idle instance's factor relaxes toward its group's
                pooled = self.group_factors[inst.group]
                inst.factor = pooled + IDLE_RELAX * (inst.factor - pooled)
        assigned = self._place(now, ordered, out)
        self._emit(now, assigned, out)
        return out

    def _load(self, r: Request, k: int) -> float:
        cache, recompute = r.steps[k]
        seq = float(r.seq_tokens())
        if self.caching:
            return cache * float(r.block_length) + recompute * seq
        return (cache + recompute) * seq

    def _control_load(self, ordered: list[Request]) -> bool:
        n = len(ordered)
        seq_sum = slo_sum = 0.0
        for r in ordered:
            seq_sum += float(r.seq_tokens())
            slo_sum += r.deadline - r.arrival
        window = self.slo_window if self.slo_window is not None else slo_sum / n
        mean_seq = seq_sum / n
        # Steps per block at each request's current cap.
        total = sum(r.steps[r.cap][0] + r.steps[r.cap][1] for r in ordered)
        blocks = sum(r.steps[r.cap][1] for r in ordered)
        spb = total / blocks if blocks > 0 else float(self.block_length)
        block = self.block_length
        thr = [g.throughput(mean_seq, block, spb, self.max_batch) for g in self.groups]
        capacity = 0.0
        for inst in self.instances:
            if inst.alive and not inst.draining:
                if inst.kv is None and inst.max_req is None and inst.budget == self.max_batch:
                    rate = thr[inst.group]
                else:
                    rate = self.groups[inst.group].throughput(
                        mean_seq, block, spb, inst.budget, inst.kv, inst.max_req
                    )
                capacity += rate * window
        suffix = [0.0] * (n + 1)
        for i in range(n - 1, -1, -1):
            suffix[i] = suffix[i + 1] + self._load(ordered[i], lowest_bit(ordered[i].allowed))
        committed = 0.0
        for i, r in enumerate(ordered):
            lowest = lowest_bit(r.allowed)
            chosen = lowest
            rest = suffix[i + 1]
            higher = r.allowed & ~(1 << lowest)
            while higher:
                k = highest_bit(higher)
                if committed + self._load(r, k) + rest <= capacity:
                    chosen = k
                    break
                higher &= ~(1 << k)
            committed += self._load(r, chosen)
            r.cap = chosen
        return suffix[0] > capacity

    def _place(self, now: float, ordered: list[Request], out: Decisions):
        insts, groups = self.instances, self.groups
        res = self.reservation
        # The lookahead only tells instances of different degrees apart.
        look = self.look if len(groups) > 1 else Lookahead(0, self.block_length, self.caching)
        p = Placement(
            insts, len(groups), now, self.least_loaded, look, None if res is None else res[1]
        )
        self._p = p

        def stays(r: Request) -> bool:
            if r.home is None:
                return False
            if self.caching and r.next_kind == "cache":
                return True
            return not self.migration and not insts[r.home].draining

        assigned: list[tuple[int, Request, bool]] = []
        free = []
        for r in ordered:
            if r.in_flight:
                continue
            if not stays(r):
                free.append(r)
                continue
            home, n = r.home, r.step_tokens()
            is_open = p.open[home]
            if p.fits(home, n):
                p.tokens[home] += n
                if r.next_kind != "cache" and is_open:
                    p.full_tokens[home] += n
                if is_open:
                    r.in_flight = True
                    assigned.append((home, r, False))
                    continue
            out.waiting.append((r.id, "home_full" if is_open else "home_busy"))

        p.build()
        for r in free:
            n, seq, home = r.step_tokens(), r.seq_tokens(), r.home
            reserved_slot = res[1] if res is not None and res[0] == r.id else None
            best = p.best(n, seq, groups)
            if reserved_slot is not None:
                key = p.reserved_key(reserved_slot, n, seq, groups[insts[reserved_slot].group])
                if key is not None and (
                    best is None or key < best[0] or (key == best[0] and reserved_slot < best[1])
                ):
                    best = (key, reserved_slot)
            target = None if best is None else best[1]
            if home is not None and target != home:
                home_key = p.home_key(home, n, seq, groups[insts[home].group])
                if home_key is not None and (
                    best is None
                    or home_key <= best[0]
                    or (
                        not self.least_loaded
                        and best[1] != reserved_slot
                        and not p.move_pays(home, best[1], n, seq, self.policy, groups)
                    )
                ):
                    target = home
            if target is None:
                reason = self._wait_reason(p, r)
                out.waiting.append((r.id, reason))
                if self.reservation is None and reason != "no_instance":
                    found = self._soonest(p, r, now)
                    if found is not None:
                        self.reservation = res = (r.id, found)
                        p.reserved = found
                        p.refresh(found)
                continue
            new_resident = home != target
            if not p.open[target]:
                p.add_free(target, n, seq if new_resident else None)
                out.waiting.append((r.id, "queued_busy"))
                continue
            to = insts[target].id
            moved = None
            if home is not None and home != target:
                if insts[home].draining:
                    reason = "draining"
                elif not p.open[home]:
                    reason = "home_busy"
                elif not p.fits(home, n):
                    reason = "home_full"
                else:
                    reason = "rebalance"
                moved = (insts[home].id, reason)
            elif home is None and r.displaced_from is not None and r.displaced_from[0] != to:
                moved = r.displaced_from
            if moved is not None:
                out.migrations.append((r.id, moved[0], to, moved[1]))
                r.migrations += 1
            if new_resident:
                if home is not None:
                    self._drop_resident(home, r)
                    p.refresh(home)
                self._add_resident(target, r)
            p.add_free(target, n, None)
            if reserved_slot is not None:
                self.reservation = res = None
                p.reserved = None
                p.refresh(reserved_slot)
            r.in_flight = True
            r.home = target
            r.displaced_from = None
            assigned.append((target, r, new_resident))
        return assigned

    def _wait_reason(self, p: Placement, r: Request) -> str:
        if p.targets == 0:
            return "no_instance"
        seq = r.seq_tokens()
        home_room = r.home is not None and not self.instances[r.home].draining
        reserved_room = p.reserved is not None and p.resident_room(p.reserved, seq)
        if not (home_room or reserved_room or p.any_resident_room(seq)):
            return "no_kv_room"
        return "all_busy" if p.accepting == 0 else "no_room"

    def _prices(self, inst: Instance) -> tuple[float, float]:
        costs = self.groups[inst.group]
        price_full = costs.full(float(inst.resident_tokens)) * inst.factor
        if self.caching:
            block_tokens = float(self.block_length) * float(inst.residents)
            price_cache = costs.cache(block_tokens) * inst.factor
        else:
            price_cache = price_full
        return price_cache, price_full

    def _soonest(self, p: Placement, r: Request, now: float) -> int | None:
        """The instance that would fit `r` soonest (rust/src/scheduler/reservation.rs)."""
        seq, n = r.seq_tokens(), r.step_tokens()
        need = {}
        for slot, inst in enumerate(self.instances):
            if (
                inst.alive
                and not inst.draining
                and (inst.kv is None or seq <= inst.kv)
                and n <= inst.budget
            ):
                toks = 0 if inst.kv is None else max(inst.resident_tokens + seq - inst.kv, 0)
                reqs = 0 if inst.max_req is None else max(inst.residents + 1 - inst.max_req, 0)
                need[slot] = (0, 0) if r.home == slot else (toks, reqs)
        leavers: dict[int, list[tuple[float, int]]] = {}
        for q in self.requests.values():
            if q.home is not None and need.get(q.home, (0, 0)) != (0, 0):
                cache, full = self._prices(self.instances[q.home])
                steps = q.steps[q.cap]
                finish = now + (steps[0] * cache + steps[1] * full)
                leavers.setdefault(q.home, []).append((finish, q.seq_tokens()))
        best = None
        for slot, (need_tokens, need_reqs) in need.items():
            at = p.next_end(slot, self.groups[self.instances[slot].group])
            freed = 0
            for left, (finish, tokens) in enumerate(sorted(leavers.get(slot, []))):
                if freed >= need_tokens and left >= need_reqs:
                    break
                freed += tokens
                at = max(at, finish)
            if best is None or at < best[0]:
                best = (at, slot)
        return None if best is None else best[1]

    def _emit(self, now: float, assigned: list[tuple[int, Request, bool]], out: Decisions) -> None:
        members: dict[int, list[tuple[Request, bool]]] = {}
        for slot, r, new_here in assigned:
            members.setdefault(slot, []).append((r, new_here))
        p = self._p
        for slot in sorted(members):
            inst = self.instances[slot]
            costs = self.groups[inst.group]
            tokens, full = p.tokens[slot], p.full_tokens[slot]
            inst.busy = True
            inst.started_at = now
            inst.predicted_s = costs.batch(full, tokens - full)
            inst.inflight = [r.id for r, _ in members[slot]]
            inst.next_tokens = sum(r.next_estimate(self.caching) for r, _ in members[slot])
            out.batches.append((inst.id, tokens, inst.predicted_finish()))
            price_cache, price_full = self._prices(inst)
            for r, new_here in members[slot]:
                tau = self.fixed_tau if self.fixed_tau is not None else self._choose(
                    r, price_cache, price_full, r.deadline - now
                )  # fmt: skip
                r.in_flight = True
                r.last_tau = tau
                if r.first_dispatch is None:
                    r.first_dispatch = now
                    self.queued -= 1
                if not r.instances or r.instances[-1] != inst.id:
                    r.instances.append(inst.id)
                out.entries.append(
                    (r.id, tau, r.next_kind, new_here, r.step_tokens(), r.current_block, r.in_block)
                )

    def _choose(self, r: Request, price_cache: float, price_full: float, slo_left: float) -> float:
        allowed = r.allowed & ((1 << (r.cap + 1)) - 1)
        lowest = lowest_bit(allowed)
        rest = allowed
        while rest:
            k = highest_bit(rest)
            cache, recompute = r.steps[k]
            if k == lowest or cache * price_cache + recompute * price_full <= slo_left:
                return self.taus[k]
            rest &= ~(1 << k)
        return self.taus[lowest]


def as_reference(decisions) -> Decisions:
    """A `dilaserve.scheduler.Decisions` in the reference's plain-tuple form. The reference
    is the synchronous scheduler (`overlap` off, the core's default): no step is ahead."""
    entries = [e for b in decisions.batches for e in b.entries]
    if any(e.ahead for e in entries):
        raise AssertionError("a step ahead: the reference models overlap off")
    return Decisions(
        batches=[(b.instance, b.tokens, b.predicted_finish) for b in decisions.batches],
        entries=[tuple(e)[: len(e) - 1] for e in entries],
        migrations=[tuple(m) for m in decisions.migrations],
        waiting=[tuple(w) for w in decisions.waiting],
        overloaded=decisions.overloaded,
    )


def assert_same(rust, reference: Decisions) -> None:
    """Raises AssertionError naming the first decision where the two implementations differ."""
    ours = as_reference(rust)
    if ours.overloaded != reference.overloaded:
        raise AssertionError(
            f"overloaded differs: rust {ours.overloaded} vs reference {reference.overloaded}"
        )
    for name in ("batches", "entries", "migrations", "waiting"):
        x, y = getattr(ours, name), getattr(reference, name)
        if x != y:
            pairs = enumerate(zip(x, y, strict=False))
            i = next((i for i, (p, q) in pairs if p != q), min(len(x), len(y)))
            raise AssertionError(
                f"{name} differ at {i}: rust {x[i : i + 1]} vs reference {y[i : i + 1]} "
                f"(lengths {len(x)} and {len(y)})"
            )
