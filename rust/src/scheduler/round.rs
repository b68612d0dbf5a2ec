//! One scheduling round: load control over every active request, then instance choice for
//! the ready ones (those that must stay first, then those free to move, in load order),
//! then the threshold of each dispatched step given its instance's resulting load.

use std::time::Instant;

use super::config::{InstanceChoice, LoadModel, Prediction, ThresholdPolicy};
use super::cost::{DegreeCosts, Limits};
use super::decisions::{
    Batch, BatchEntry, Decisions, Migration, MigrationReason, ThresholdReason, ThresholdWhy,
    WaitReason, Waiting,
};
use super::error::SchedError;
use super::history::FinishedRequest;
use super::instance::{AheadStep, Instance};
use super::load_control::LoadControl;
use super::placement::{Candidate, Lookahead, Placement};
use super::predictor::{RequestView, StepsLeft};
use super::request::Request;
use super::reservation::{self, Reservation};
use super::threshold::{capped, choose_threshold, remaining_seconds, StepPrices};
use super::Scheduler;
use crate::profile::StepKind;

/// The arrival rate is measured over this many SLO windows.
const FORECAST_WINDOWS: f64 = 4.0;

/// Buffers reused by every round and event, so steady-state operation does not allocate.
#[derive(Clone, Debug, Default)]
pub(crate) struct RoundScratch {
    load: LoadControl,
    placement: Placement,
    throughput: Vec<f64>,
    /// Ready requests free to move, by position, in load order.
    free: Vec<u32>,
    /// Dispatched steps in dispatch order.
    assigned: Vec<Assignment>,
    /// Step prices per instance slot (valid for instances that got a batch).
    prices: Vec<StepPrices>,
    /// Per instance: entries so far, then the write cursor while grouping into batches.
    cursor: Vec<usize>,
    /// Request handle of each entry, grouped like the entries.
    entry_handles: Vec<u32>,
    /// Instance slot of each emitted batch.
    batch_slots: Vec<u32>,
    /// Load expected from arrivals within the window, per candidate threshold.
    expected: Vec<f64>,
    pub reservation: reservation::Scratch,
    pub pending: Vec<u32>,
    pub views: Vec<RequestView>,
    pub predicted: Vec<StepsLeft>,
    /// Loads of an arriving request at each candidate threshold.
    pub arrival_loads: Vec<f64>,
    pub reported: Vec<(u32, usize)>,
    pub finished: Vec<FinishedRequest>,
    pub aborted: Vec<u64>,
}

/// One dispatched step, with what emission needs copied while the request is in cache.
#[derive(Clone, Copy, Debug)]
struct Assignment {
    inst: u32,
    pos: u32,
    handle: u32,
    new_here: bool,
    /// A step ahead of a request whose step in flight is on the same instance.
    ahead: bool,
    kind: StepKind,
    request: u64,
    slo_left: f64,
    tokens: u64,
    block: u32,
    unmasked_in_block: u32,
    next_estimate: u64,
}

impl Assignment {
    fn new(inst: u32, pos: u32, r: &Request, new_here: bool, now: f64, caching: bool) -> Self {
        Self {
            inst,
            pos,
            handle: r.handle,
            new_here,
            ahead: false,
            kind: r.next_kind,
            request: r.id,
            slo_left: r.deadline - now,
            tokens: r.step_tokens(),
            block: r.current_block,
            unmasked_in_block: r.unmasked_in_block,
            next_estimate: r.next_step_estimate(caching),
        }
    }

    /// *(ours)* The step after `r`'s step in flight on `inst`, of `tokens` expected tokens
    /// (the worker resolves its kind), at the threshold chosen now.
    fn ahead(inst: u32, pos: u32, r: &Request, now: f64, caching: bool, tokens: u64) -> Self {
        let kind = if caching {
            StepKind::Cache
        } else {
            StepKind::NoCache
        };
        Self {
            ahead: true,
            kind,
            tokens,
            ..Self::new(inst, pos, r, false, now, caching)
        }
    }
}

/// Where a ready request may run its next step.
enum Placing {
    /// Only on its current instance: its cache lives there, or migration is off.
    Stay(u32),
    /// Anywhere accepting.
    Free,
}

impl Scheduler {
    /// Runs one round at time `now` and returns its decisions; dispatched requests are in
    /// flight until their instance's [`Scheduler::step_done`].
    pub fn schedule(&mut self, now: f64) -> Result<&Decisions, SchedError> {
        let start = Instant::now();
        if !now.is_finite() {
            return Err(SchedError::BadTime(now));
        }
        self.requests.normalize();
        self.decisions.clear(now);
        self.overloaded = false;
        if matches!(self.config.policy.threshold, ThresholdPolicy::SloAware)
            && self.config.policy.load_control
        {
            self.overloaded = self.control_load(now);
        }
        self.decisions.overloaded = self.overloaded;
        for inst in self
            .instances
            .slots
            .iter_mut()
            .filter(|i| i.alive && !i.busy)
        {
            inst.relax_toward(self.group_factors[inst.group]);
        }
        self.place(now);
        self.emit_batches(now);
        self.decisions.elapsed_s = start.elapsed().as_secs_f64();
        Ok(&self.decisions)
    }

    /// DESIGN §5: caps every active request's thresholds so worst-case load fits capacity.
    /// Returns whether even the lowest thresholds exceed it (overload).
    fn control_load(&mut self, now: f64) -> bool {
        let live = self.requests.live();
        if live == 0 {
            return false;
        }
        let sums = self.requests.load_sums();
        let window = self.config.slo_window_s.unwrap_or(sums.slo / live as f64);
        let mean_seq = sums.seq_tokens / live as f64;
        let (block, max_tokens) = (self.config.block_length, self.config.max_batch_tokens);
        // Steps per block at the thresholds requests may use now (their current caps).
        let spb = sums.steps_per_block().unwrap_or(f64::from(block));
        let throughput = &mut self.scratch.throughput;
        throughput.clear();
        throughput.extend(
            self.groups
                .iter()
                .map(|g| g.throughput(mean_seq, block, spb, Limits::budget(max_tokens))),
        );
        let mut capacity = 0.0;
        for inst in &self.instances.slots {
            if inst.alive && !inst.draining {
                let rate = if inst.limited(max_tokens) {
                    let limits = Limits {
                        budget: inst.budget,
                        kv_tokens: inst.kv_tokens,
                        max_requests: inst.max_requests,
                    };
                    self.groups[inst.group].throughput(mean_seq, block, spb, limits)
                } else {
                    throughput[inst.group]
                };
                capacity += rate * window;
            }
        }
        self.capacity_rate = capacity / window;
        let k = self.config.thresholds.len();
        let n = self.requests.len();
        let (allowed, loads, caps) = self.requests.load_lanes();
        self.backlog_lowest = sums.lowest_load;
        let planned = capacity * self.config.target_utilisation;
        self.shedder
            .update(now, window, FORECAST_WINDOWS * window, planned);
        match self.config.policy.load_model {
            LoadModel::Window => self.scratch.load.run(
                n,
                capacity,
                |i| allowed[i],
                |i, t| loads[i * k + t],
                |i, t| caps[i] = t as u8,
            ),
            LoadModel::Forecast => {
                let expected = &mut self.scratch.expected;
                self.forecast
                    .expected(now, window, FORECAST_WINDOWS * window, expected);
                let lowest = self
                    .scratch
                    .load
                    .uniform(k, planned, expected, allowed, loads, caps);
                lowest > capacity
            }
        }
    }

    /// DESIGN §6: puts every ready request in an instance's next batch, or records why it
    /// waits (and reserves an instance for a request that no instance has room for).
    fn place(&mut self, now: f64) {
        let Scheduler {
            config,
            requests,
            instances,
            groups,
            scratch,
            decisions,
            reservation,
            queued,
            ..
        } = self;
        let caching = config.caching;
        let placement: &mut Placement = &mut scratch.placement;
        let choice = config.policy.instance_choice;
        // Within one degree instances differ only in load, which the next step orders (a
        // move away from home is then checked over the lookahead, `Placement::move_pays`);
        // across degrees it misjudges them (see `placement`), and only there is the
        // lookahead worth its weaker search bounds in the search itself (3× a round's time
        // at 1024 GPUs). A degree group, once added, stays for the scheduler's life.
        let lookahead = Lookahead {
            steps: if groups.len() > 1 {
                config.policy.lookahead_steps
            } else {
                0
            },
            block: u64::from(config.block_length),
            caching,
        };
        placement.begin(
            &instances.slots,
            groups.len(),
            now,
            choice,
            lookahead,
            reservation.map(|r| r.slot),
            config.overlap,
        );
        scratch.assigned.clear();
        scratch.free.clear();
        // Under the exact cache a block's first step may move, paying a prefill of its
        // prefix there: only where that price is weighed (earliest completion's
        // `move_pays`); a least-loaded choice would give up the cache at every block.
        let costed_moves = config.policy.migration && choice == InstanceChoice::EarliestCompletion;
        let placing = |r: &Request, instances: &[Instance]| match r.home {
            Some(h)
                if caching
                    && r.next_kind == StepKind::Cache
                    && !(costed_moves && r.opens_exact_block()) =>
            {
                Placing::Stay(h)
            }
            Some(h) if !config.policy.migration && !instances[h as usize].draining => {
                Placing::Stay(h)
            }
            _ => Placing::Free,
        };

        for pos in 0..requests.len() as u32 {
            if !requests.ready(pos) {
                let r = requests.req(pos);
                let home = r.home.filter(|&h| {
                    r.alive
                        && r.ahead_tau.is_none()
                        && instances.slots[h as usize].busy
                        && placement.open[h as usize]
                });
                // A step in flight that likely ends its block leaves the next step (likely
                // a recompute step, where the request may migrate) to the report, unless
                // the request stays home anyway: then it goes ahead, priced as recompute.
                let ends_block = r.likely_ends_block();
                let may_move = if r.exact {
                    costed_moves
                } else {
                    config.policy.migration
                };
                if let Some(home) = home.filter(|_| !ends_block || !may_move) {
                    let n = if ends_block {
                        r.full_step_tokens()
                    } else {
                        r.next_step_estimate(caching)
                    };
                    if placement.fits(home, &instances.slots[home as usize], n) {
                        // Under the exact cache the next block opens with a cache step.
                        placement.add_fixed(home, n, !caching || ends_block && !r.exact);
                        let a = Assignment::ahead(home, pos, r, now, caching, n);
                        scratch.assigned.push(a);
                    }
                }
                continue;
            }
            let r = *requests.req(pos);
            let Placing::Stay(home) = placing(&r, &instances.slots) else {
                scratch.free.push(pos);
                continue;
            };
            let inst = &instances.slots[home as usize];
            let n = r.step_tokens();
            let open = placement.open[home as usize];
            if placement.fits(home, inst, n) {
                // On a busy home the step waits for the next batch there; it counts anyway.
                placement.add_fixed(home, n, r.next_kind != StepKind::Cache);
                if open {
                    requests.set_ready(pos, false);
                    // Stays on its home: the same instance as its last dispatch.
                    scratch
                        .assigned
                        .push(Assignment::new(home, pos, &r, false, now, caching));
                    continue;
                }
            }
            let reason = if open {
                WaitReason::HomeFull
            } else {
                WaitReason::HomeBusy
            };
            decisions.waiting.push(Waiting {
                request: r.id,
                reason,
            });
        }

        placement.build(&instances.slots);
        for &pos in &scratch.free {
            let r = *requests.req(pos);
            // Elsewhere a step may feed more than at home: a prefill under the exact cache.
            let (n_home, n) = (r.step_tokens(), r.move_tokens());
            let seq = r.seq_tokens();
            let reserved_slot = reservation.filter(|v| v.handle == r.handle).map(|v| v.slot);
            let mut best = placement.best(n, seq, groups);
            if let Some(rs) = reserved_slot {
                let inst = &instances.slots[rs as usize];
                if let Some(key) = placement.key_at(rs, inst, (n, seq), &groups[inst.group], true) {
                    if Placement::better(key, rs, best) {
                        best = Some(Candidate { slot: rs, key });
                    }
                }
            }
            // Prefix sharing: where its prompt's leading blocks are stored, its first step
            // feeds only what follows them, so that instance competes at its shorter step.
            let cached = r
                .cached_prefix
                .filter(|_| r.home.is_none())
                .and_then(|(id, _)| Some((instances.slot_of(id).ok()?, r.cached_on(Some(id)))));
            if let Some((cs, hit)) = cached.filter(|&(_, hit)| hit > 0) {
                let inst = &instances.slots[cs as usize];
                let reserver = reserved_slot == Some(cs);
                let costs = &groups[inst.group];
                if let Some(key) = placement.key_at(cs, inst, (n - hit, seq), costs, reserver) {
                    if Placement::better(key, cs, best) {
                        best = Some(Candidate { slot: cs, key });
                    }
                }
            }
            let target = match r.home {
                Some(h) if best.is_some_and(|b| b.slot == h) => Some(h),
                Some(h) => {
                    let inst = &instances.slots[h as usize];
                    let home = (h, inst, &groups[inst.group]);
                    let stays = match (placement.home_key(h, inst, n_home, seq, home.2), best) {
                        (None, _) => false,
                        (Some(_), None) => true,
                        // Earliest completion moves only what wins its key and also pays
                        // over the lookahead's horizon; a reserver takes its reservation.
                        (Some(key), Some(b)) => {
                            key <= b.key
                                || choice == InstanceChoice::EarliestCompletion
                                    && reserved_slot != Some(b.slot)
                                    && {
                                        let to = &instances.slots[b.slot as usize];
                                        let to = (b.slot, to, &groups[to.group]);
                                        !placement.move_pays(
                                            home,
                                            to,
                                            (n_home, n),
                                            seq,
                                            &config.policy,
                                        )
                                    }
                        }
                    };
                    if stays {
                        Some(h)
                    } else {
                        best.map(|b| b.slot)
                    }
                }
                None => best.map(|b| b.slot),
            };
            let Some(target) = target else {
                let reason = wait_reason(placement, &instances.slots, &r);
                decisions.waiting.push(Waiting {
                    request: r.id,
                    reason,
                });
                if reservation.is_none() && reason != WaitReason::NoInstance {
                    let found = reservation::soonest(
                        &mut scratch.reservation,
                        requests,
                        &instances.slots,
                        groups,
                        placement,
                        config,
                        &r,
                        now,
                    );
                    if let Some(slot) = found {
                        *reservation = Some(Reservation {
                            handle: r.handle,
                            slot,
                        });
                        placement.reserve(slot, &instances.slots[slot as usize]);
                    }
                }
                continue;
            };
            let new_resident = r.home != Some(target);
            let n = match cached {
                _ if !new_resident => n_home,
                Some((cs, hit)) if cs == target => n - hit,
                _ => n,
            };
            if !placement.open[target as usize] {
                let inst = &instances.slots[target as usize];
                placement.add_free(target, inst, n, new_resident.then_some(seq));
                decisions.waiting.push(Waiting {
                    request: r.id,
                    reason: WaitReason::QueuedBusy,
                });
                continue;
            }
            let to = instances.slots[target as usize].id;
            let moved_from = match (r.home, r.displaced_from) {
                (Some(h), _) if h != target => {
                    let inst = &instances.slots[h as usize];
                    let reason = if inst.draining {
                        MigrationReason::Draining
                    } else if !placement.open[h as usize] {
                        MigrationReason::HomeBusy
                    } else if !placement.fits(h, inst, n_home) {
                        MigrationReason::HomeFull
                    } else {
                        MigrationReason::Rebalance
                    };
                    Some((inst.id, reason))
                }
                (None, Some((from, reason))) if from != to => Some((from, reason)),
                _ => None,
            };
            if let Some((from, reason)) = moved_from {
                decisions.migrations.push(Migration {
                    request: r.id,
                    from,
                    to,
                    reason,
                });
                requests.history[r.handle as usize].migrations += 1;
            }
            if new_resident {
                if let Some(h) = r.home {
                    instances.slots[h as usize].drop_resident(&r);
                    placement.left(h, &instances.slots[h as usize]);
                }
                instances.slots[target as usize].add_resident(&r);
            }
            placement.add_free(target, &instances.slots[target as usize], n, None);
            if let Some(rs) = reserved_slot {
                *reservation = None;
                placement.release(rs, &instances.slots[rs as usize]);
            }
            requests.set_ready(pos, false);
            let r = requests.req_mut(pos);
            if new_resident && r.opens_exact_block() {
                // Its cache stays behind: the new instance prefills the prefix first.
                r.next_kind = StepKind::Recompute;
                if config.policy.prediction == Prediction::Online {
                    scratch.pending.push(pos);
                }
            }
            r.home = Some(target);
            r.displaced_from = None;
            let (first, changed) = (r.last_instance.is_none(), r.last_instance != Some(to));
            r.last_instance = Some(to);
            let a = Assignment::new(target, pos, r, new_resident, now, caching);
            scratch.assigned.push(a);
            if changed {
                if first {
                    *queued = queued.saturating_sub(1);
                }
                requests.history[a.handle as usize].moved_to(to, now);
            }
        }
    }

    /// Picks each dispatched step's threshold, groups the steps into per-instance batches
    /// and marks instances and requests in flight.
    fn emit_batches(&mut self, now: f64) {
        let Scheduler {
            config,
            requests,
            instances,
            groups,
            scratch,
            decisions,
            ..
        } = self;
        let n_inst = instances.slots.len();
        scratch.cursor.clear();
        scratch.cursor.resize(n_inst, 0);
        for a in &scratch.assigned {
            scratch.cursor[a.inst as usize] += 1;
        }
        scratch.prices.resize(n_inst, StepPrices::default());
        scratch.batch_slots.clear();
        let mut start = 0;
        for (slot, inst) in instances.slots.iter_mut().enumerate() {
            let len = scratch.cursor[slot];
            scratch.cursor[slot] = start;
            if len == 0 {
                continue;
            }
            let costs = &groups[inst.group];
            let tokens = scratch.placement.tokens[slot];
            let full = scratch.placement.full_tokens[slot];
            let predicted_s = costs.batch(full, tokens - full, mean_context(inst));
            if inst.busy {
                inst.ahead = Some(AheadStep {
                    tokens,
                    predicted_s,
                    ..AheadStep::default()
                });
            } else {
                inst.busy = true;
                inst.inflight_tokens = tokens;
                inst.next_tokens = 0;
                inst.started_at = now;
                inst.predicted_s = predicted_s;
            }
            scratch.prices[slot] = step_prices(costs, inst, config.caching, config.block_length);
            let release_start = decisions.releases.len();
            decisions.releases.append(&mut inst.released);
            decisions.batches.push(Batch {
                instance: inst.id,
                start,
                len,
                tokens,
                predicted_s: predicted_s * inst.factor,
                predicted_finish: inst.free_at(),
                release_start,
                release_len: decisions.releases.len() - release_start,
            });
            scratch.batch_slots.push(slot as u32);
            start += len;
        }

        let placeholder = BatchEntry {
            request: 0,
            tau: f64::NAN,
            kind: StepKind::NoCache,
            new_here: false,
            ahead: false,
            tokens: 0,
            block: 0,
            unmasked_in_block: 0,
            why: ThresholdWhy {
                reason: ThresholdReason::Fixed,
                estimate_s: f64::NAN,
                slo_left_s: f64::NAN,
                cap_tau: f64::NAN,
            },
        };
        decisions.entries.clear();
        decisions
            .entries
            .resize(scratch.assigned.len(), placeholder);
        scratch.entry_handles.clear();
        scratch.entry_handles.resize(scratch.assigned.len(), 0);
        for a in &scratch.assigned {
            let p = a.pos as usize;
            let (mut tau, mut why) = match config.policy.fixed() {
                Some(tau) => (
                    tau,
                    ThresholdWhy {
                        reason: ThresholdReason::Fixed,
                        estimate_s: f64::NAN,
                        slo_left_s: a.slo_left,
                        cap_tau: f64::NAN,
                    },
                ),
                None => {
                    let allowed = requests.allowed()[p];
                    let cap = usize::from(requests.caps()[p]);
                    let steps = requests.steps_of(a.pos);
                    let prices = scratch.prices[a.inst as usize];
                    let k = choose_threshold(capped(allowed, cap), steps, prices, a.slo_left);
                    let estimate_s = remaining_seconds(steps[k], prices);
                    let reason = if estimate_s > a.slo_left {
                        ThresholdReason::Late
                    } else if capped(allowed, cap) != allowed
                        && choose_threshold(allowed, steps, prices, a.slo_left) > k
                    {
                        ThresholdReason::Capped
                    } else {
                        ThresholdReason::Fits
                    };
                    let limited = config.policy.load_control;
                    let why = ThresholdWhy {
                        reason,
                        estimate_s,
                        slo_left_s: a.slo_left,
                        cap_tau: if limited {
                            config.thresholds[cap]
                        } else {
                            f64::NAN
                        },
                    };
                    (config.thresholds[k], why)
                }
            };
            if let Some(pinned) = requests.req(a.pos).pinned {
                tau = pinned;
                why.reason = ThresholdReason::Pinned;
            }
            if a.ahead {
                requests.req_mut(a.pos).ahead_tau = Some(tau);
            } else {
                requests.set_last_tau(a.pos, tau);
            }
            let inst = &mut instances.slots[a.inst as usize];
            match &mut inst.ahead {
                Some(step) => step.next_tokens += a.next_estimate,
                None => inst.next_tokens += a.next_estimate,
            }
            let at = scratch.cursor[a.inst as usize];
            scratch.cursor[a.inst as usize] += 1;
            decisions.entries[at] = BatchEntry {
                request: a.request,
                tau,
                kind: a.kind,
                new_here: a.new_here,
                ahead: a.ahead,
                tokens: a.tokens,
                block: a.block,
                unmasked_in_block: a.unmasked_in_block,
                why,
            };
            scratch.entry_handles[at] = a.handle;
        }
        for (batch, &slot) in decisions.batches.iter().zip(&scratch.batch_slots) {
            let inst = &mut instances.slots[slot as usize];
            let handles = &scratch.entry_handles[batch.start..batch.start + batch.len];
            let step = match &mut inst.ahead {
                Some(step) => &mut step.handles,
                None => &mut inst.inflight,
            };
            step.clear();
            step.extend_from_slice(handles);
        }
    }
}

/// Why a free request found no instance: none accepts work; none has resident room for it;
/// all are busy with full next steps; or none has batch-token room (or the one with room
/// is reserved for another request).
fn wait_reason(placement: &mut Placement, instances: &[Instance], r: &Request) -> WaitReason {
    let seq = r.seq_tokens();
    if placement.targets == 0 {
        return WaitReason::NoInstance;
    }
    let home_room = r.home.is_some_and(|h| !instances[h as usize].draining);
    let reserved_room = placement
        .reserved()
        .is_some_and(|rs| placement.resident_room(rs, &instances[rs as usize], seq));
    if !(home_room || reserved_room || placement.any_resident_room(seq)) {
        WaitReason::NoKvRoom
    } else if placement.accepting == 0 {
        WaitReason::AllBusy
    } else {
        WaitReason::NoRoom
    }
}

/// Mean tokens per request resident on `inst`: the context its cache steps attend to.
fn mean_context(inst: &Instance) -> f64 {
    inst.resident_tokens as f64 / f64::from(inst.residents.max(1))
}

/// Expected seconds of each step shape on `inst` given the requests it now holds.
pub(crate) fn step_prices(
    costs: &DegreeCosts,
    inst: &Instance,
    caching: bool,
    block: u32,
) -> StepPrices {
    // A request's full step: the whole batch recomputes, or under the exact cache its
    // cache step carries one more block.
    let full = if costs.exact {
        let tokens = f64::from(block) * f64::from(inst.residents + 1);
        costs.cache(tokens, mean_context(inst)) * inst.factor
    } else {
        costs.full_tokens(inst.resident_tokens) * inst.factor
    };
    let cache = if caching {
        costs.cache(
            f64::from(block) * f64::from(inst.residents),
            mean_context(inst),
        ) * inst.factor
    } else {
        full
    };
    StepPrices { cache, full }
}
