"""Pure-Python implementation of the scheduler's algorithms (DESIGN §4-§6), the baseline of
`benches/scheduler.py` and an independent check of the Rust core: fed the same events, it
must make bit-identical decisions.

It mirrors the Rust code's data structures (sorted arrival order, per-degree heaps of idle
instances) so the speed comparison is of implementations, not of algorithms, and evaluates
every float expression in the same order so results match exactly.
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field

FACTOR_WEIGHT = 0.2
FACTOR_CLAMP = 4.0
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
                return s[0] * x / t[0]
            return s[0]
        hi = min(bisect.bisect_left(t, x), n - 1)
        lo = hi - 1
        slope = (s[hi] - s[lo]) / (t[hi] - t[lo])
        if x > t[n - 1]:
            return s[n - 1] + max(slope, 0.0) * (x - t[n - 1])
        return s[lo] + slope * (x - t[lo])


class DegreeCosts:
    def __init__(self, profile, tp: int, caching: bool, max_batch: int) -> None:
        self.tp = tp
        self.full_t = Table(profile.points(tp, "recompute" if caching else "no_cache"))
        self.cache_t = Table(profile.points(tp, "cache")) if caching else None
        budget = float(max_batch)
        candidates = [t for t in self.full_t.tokens if t <= budget] + [budget]
        self.full_throughput = max([0.0] + [x / self.full_t.latency(x) for x in candidates])

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

    def throughput(self, mean_seq: float, block: int, max_batch: int) -> float:
        if self.cache_t is None:
            return self.full_throughput
        b = float(block)
        seq = max(mean_seq, 1.0)
        max_seqs = max(math.floor(float(max_batch) / seq), 1.0)
        tokens = b * max_seqs * (b - 1.0) + max_seqs * seq
        secs = self.cache_t.latency(b * max_seqs) * (b - 1.0) + self.full(max_seqs * seq)
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

    def predict(self, r: Request, thresholds: list[float]) -> list[list[float]]:
        masked = float(r.block_size - r.in_block)
        block = float(r.block_size)
        future = float(max(r.output_len // r.block_size - (r.current_block + 1), 0))
        lost = 1.0 if r.needs_recompute() else 0.0
        out = []
        for tau in thresholds:
            rate = self.rate(tau)
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
    block_size: int
    allowed: int
    next_kind: str
    steps_done: int = 0
    unmasked: int = 0
    in_block: int = 0
    current_block: int = 0
    home: int | None = None
    displaced_from: int | None = None
    in_flight: bool = False
    cap: int = 0
    steps: list[list[float]] = field(default_factory=list)

    def seq_tokens(self) -> int:
        return self.prompt_len + self.output_len

    def step_tokens(self) -> int:
        return self.block_size if self.next_kind == "cache" else self.seq_tokens()

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
    alive: bool = True
    draining: bool = False
    busy: bool = False
    inflight: list[int] = field(default_factory=list)
    started_at: float = 0.0
    predicted_s: float = 0.0
    residents: int = 0
    resident_tokens: int = 0
    factor: float = 1.0

    def predicted_finish(self) -> float:
        return self.started_at + self.predicted_s * self.factor


@dataclass
class Decisions:
    """Same content as the Rust decisions, as plain tuples."""

    batches: list[tuple[int, int, float]] = field(default_factory=list)
    entries: list[tuple[int, float, str, bool]] = field(default_factory=list)
    migrations: list[tuple[int, int, int, str]] = field(default_factory=list)
    waiting: list[tuple[int, str]] = field(default_factory=list)


def highest_bit(mask: int) -> int:
    return mask.bit_length() - 1


def lowest_bit(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


class ReferenceScheduler:
    """Same events and decisions as `dilaserve.scheduler.Scheduler`, in plain Python.

    Expects valid input: it does none of the Rust core's checks.
    """

    def __init__(self, profile, config) -> None:
        p = config.policy
        self.profile = profile
        self.taus = sorted(config.thresholds)
        self.block_size = config.block_size
        self.caching = config.caching
        self.max_batch = config.max_batch_tokens
        self.slo_window = config.slo_window_s
        self.fixed_tau = p.fixed_tau if p.threshold == "fixed" else None
        self.load_control = p.load_control and self.fixed_tau is None
        self.by_priority = p.load_order == "priority"
        self.least_loaded = p.instance_choice == "least_loaded"
        self.migration = p.migration
        self.every = p.predict_every if p.prediction == "online" else None
        self.predictor = MeanRatePredictor(config.predictor_rates or FAST_DLLM_GSM8K)
        self.requests: dict[int, Request] = {}
        self.order: list[tuple[tuple, int]] = []
        self.instances: list[Instance] = []
        self.instance_slot: dict[int, int] = {}
        self.groups: list[DegreeCosts] = []
        self.next_seq = 0

    # ---- events -----------------------------------------------------------------------
    def arrive(self, request_id, *, arrival, deadline, prompt_len, output_len, priority=0,
               block_size=None, thresholds=None) -> None:  # fmt: skip
        b = block_size or self.block_size
        allowed = (1 << len(self.taus)) - 1
        if thresholds is not None:
            allowed = sum(1 << self.taus.index(t) for t in set(thresholds))
        r = Request(
            id=request_id, seq=self.next_seq, arrival=arrival, deadline=deadline,
            priority=priority, prompt_len=prompt_len, output_len=-(-output_len // b) * b,
            block_size=b, allowed=allowed,
            next_kind="recompute" if self.caching else "no_cache",
        )  # fmt: skip
        self.next_seq += 1
        r.cap = highest_bit(allowed)
        r.steps = self.predictor.predict(r, self.taus)
        self.requests[request_id] = r
        key = (-priority if self.by_priority else 0, arrival, r.seq)
        bisect.insort(self.order, (key, request_id))

    def cancel(self, request_id: int) -> None:
        r = self.requests.pop(request_id)
        if r.home is not None:
            self._drop_resident(r.home, r)
        self.order = [e for e in self.order if e[1] != request_id]

    def add_instance(self, instance_id: int, *, tp: int, gpus=(), node: int = 0) -> None:
        group = next((g for g, c in enumerate(self.groups) if c.tp == tp), None)
        if group is None:
            self.groups.append(DegreeCosts(self.profile, tp, self.caching, self.max_batch))
            group = len(self.groups) - 1
        self.instance_slot[instance_id] = len(self.instances)
        self.instances.append(Instance(instance_id, tp, group))

    def drain_instance(self, instance_id: int) -> None:
        self.instances[self.instance_slot[instance_id]].draining = True

    def remove_instance(self, instance_id: int) -> None:
        slot = self.instance_slot.pop(instance_id)
        inst = self.instances[slot]
        inst.alive = inst.busy = False
        inst.inflight = []
        inst.residents = inst.resident_tokens = 0
        for r in self.requests.values():
            if r.home == slot:
                r.home = None
                r.in_flight = False
                r.displaced_from = instance_id
                if self.caching and r.next_kind == "cache":
                    r.next_kind = "recompute"
                    if self.every is not None:
                        r.steps = self.predictor.predict(r, self.taus)

    def step_done(self, instance_id: int, measured_s: float, results) -> list[int]:
        inst = self.instances[self.instance_slot[instance_id]]
        if inst.predicted_s > 0.0:
            ratio = min(max(measured_s / inst.predicted_s, 1.0 / FACTOR_CLAMP), FACTOR_CLAMP)
            inst.factor = (1.0 - FACTOR_WEIGHT) * inst.factor + FACTOR_WEIGHT * ratio
        finished = []
        for res in sorted(results, key=lambda x: x[0]):
            r = self.requests.get(res[0])
            if r is None:
                continue
            if self._commit(r, res[1], res[3]):
                self._drop_resident(r.home, r)
                del self.requests[r.id]
                finished.append(r.id)
        if finished:
            gone = set(finished)
            self.order = [e for e in self.order if e[1] not in gone]
        inst.inflight = []
        inst.busy = False
        return finished

    def _commit(self, r: Request, committed: int, eos: bool) -> bool:
        was_full = r.needs_recompute()
        r.in_flight = False
        r.steps_done += 1
        r.unmasked += committed
        r.in_block += committed
        if r.in_block == r.block_size:
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
        if self.load_control and ordered:
            self._control_load(ordered)
        out = Decisions()
        assigned = self._place(ordered, out)
        self._emit(now, assigned, out)
        return out

    def _load(self, r: Request, k: int) -> float:
        cache, recompute = r.steps[k]
        seq = float(r.seq_tokens())
        if self.caching:
            return cache * float(r.block_size) + recompute * seq
        return (cache + recompute) * seq

    def _control_load(self, ordered: list[Request]) -> None:
        n = len(ordered)
        seq_sum = slo_sum = 0.0
        for r in ordered:
            seq_sum += float(r.seq_tokens())
            slo_sum += r.deadline - r.arrival
        window = self.slo_window if self.slo_window is not None else slo_sum / n
        mean_seq = seq_sum / n
        thr = [g.throughput(mean_seq, self.block_size, self.max_batch) for g in self.groups]
        capacity = 0.0
        for inst in self.instances:
            if inst.alive and not inst.draining:
                capacity += thr[inst.group] * window
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

    def _key(self, tokens: list[int], slot: int, n: int) -> float:
        if self.least_loaded:
            return float(tokens[slot])
        return self.groups[self.instances[slot].group].full(float(tokens[slot] + n))

    def _place(self, ordered: list[Request], out: Decisions) -> list[tuple[int, Request, bool]]:
        insts = self.instances
        tokens = [0] * len(insts)
        full_tokens = [0] * len(insts)
        is_open = [i.alive and not i.busy for i in insts]
        targets = sum(1 for i in insts if i.alive and not i.draining)
        accepting = sum(1 for i, o in zip(insts, is_open, strict=True) if o and not i.draining)
        self._tokens, self._full_tokens = tokens, full_tokens

        def fits(slot: int, n: int) -> bool:
            return is_open[slot] and tokens[slot] + n <= self.max_batch

        def stays(r: Request) -> bool:
            if r.home is None:
                return False
            if self.caching and r.next_kind == "cache":
                return True
            return not self.migration and not insts[r.home].draining

        assigned: list[tuple[int, Request, bool]] = []
        for r in ordered:
            if r.in_flight or not stays(r):
                continue
            n = r.step_tokens()
            if fits(r.home, n):
                tokens[r.home] += n
                if r.next_kind != "cache":
                    full_tokens[r.home] += n
                assigned.append((r.home, r, False))
            else:
                out.waiting.append((r.id, "home_full" if is_open[r.home] else "home_busy"))

        heaps: list[list[tuple[int, int]]] = [[] for _ in self.groups]
        for slot, inst in enumerate(insts):
            if is_open[slot] and not inst.draining:
                heaps[inst.group].append((tokens[slot], slot))
        for h in heaps:
            heapq.heapify(h)

        for r in ordered:
            if r.in_flight or stays(r):
                continue
            n = r.step_tokens()
            best = None
            for heap in heaps:
                while heap and heap[0][0] != tokens[heap[0][1]]:
                    heapq.heappop(heap)
                if not heap or heap[0][0] + n > self.max_batch:
                    continue
                t, slot = heap[0]
                cand = (self._key(tokens, slot, n), t, slot)
                if best is None or cand < best:
                    best = cand
            if best is None:
                if targets == 0:
                    reason = "no_instance"
                else:
                    reason = "all_busy" if accepting == 0 else "no_room"
                out.waiting.append((r.id, reason))
                continue
            best_slot = best[2]
            home = r.home
            if home is None:
                if r.displaced_from is not None:
                    out.migrations.append(
                        (r.id, r.displaced_from, insts[best_slot].id, "instance_removed")
                    )
                target = best_slot
            elif home == best_slot or (
                not insts[home].draining and fits(home, n) and self._key(tokens, home, n) <= best[0]
            ):
                target = home
            else:
                if insts[home].draining:
                    reason = "draining"
                elif not is_open[home]:
                    reason = "home_busy"
                elif not fits(home, n):
                    reason = "home_full"
                else:
                    reason = "rebalance"
                out.migrations.append((r.id, insts[home].id, insts[best_slot].id, reason))
                target = best_slot
            group = insts[target].group
            tokens[target] += n
            full_tokens[target] += n
            heapq.heappush(heaps[group], (tokens[target], target))
            moved = home != target
            if moved:
                if home is not None:
                    self._drop_resident(home, r)
                self._add_resident(target, r)
                r.home = target
                r.displaced_from = None
            assigned.append((target, r, moved))
        return assigned

    def _emit(self, now: float, assigned: list[tuple[int, Request, bool]], out: Decisions) -> None:
        members: dict[int, list[tuple[Request, bool]]] = {}
        for slot, r, new_here in assigned:
            members.setdefault(slot, []).append((r, new_here))
        for slot in sorted(members):
            inst = self.instances[slot]
            costs = self.groups[inst.group]
            tokens, full = self._tokens[slot], self._full_tokens[slot]
            inst.busy = True
            inst.started_at = now
            inst.predicted_s = costs.batch(full, tokens - full)
            inst.inflight = [r.id for r, _ in members[slot]]
            out.batches.append((inst.id, tokens, inst.predicted_finish()))
            price_full = costs.full(float(inst.resident_tokens)) * inst.factor
            price_cache = (
                costs.cache(float(self.block_size) * float(inst.residents)) * inst.factor
                if self.caching
                else price_full
            )
            for r, new_here in members[slot]:
                tau = self.fixed_tau if self.fixed_tau is not None else self._choose(
                    r, price_cache, price_full, r.deadline - now
                )  # fmt: skip
                r.in_flight = True
                out.entries.append((r.id, tau, r.next_kind, new_here))

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
    """A `dilaserve.scheduler.Decisions` in the reference's plain-tuple form."""
    return Decisions(
        batches=[(b.instance, b.tokens, b.predicted_finish) for b in decisions.batches],
        entries=[
            (e.request, e.tau, e.kind, e.new_here) for b in decisions.batches for e in b.entries
        ],
        migrations=[tuple(m) for m in decisions.migrations],
        waiting=[tuple(w) for w in decisions.waiting],
    )


def assert_same(rust, reference: Decisions) -> None:
    """Raises AssertionError naming the first decision where the two implementations differ."""
    ours = as_reference(rust)
    for name in ("batches", "entries", "migrations", "waiting"):
        x, y = getattr(ours, name), getattr(reference, name)
        if x != y:
            pairs = enumerate(zip(x, y, strict=False))
            i = next((i for i, (p, q) in pairs if p != q), min(len(x), len(y)))
            raise AssertionError(
                f"{name} differ at {i}: rust {x[i : i + 1]} vs reference {y[i : i + 1]} "
                f"(lengths {len(x)} and {len(y)})"
            )
