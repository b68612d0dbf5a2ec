//! One scheduling round: load control over every active request, then instance choice for
//! the ready ones (those that must stay first, then those free to move), then the threshold
//! of each dispatched step given its instance's resulting load.

use std::time::Instant;

use super::config::ThresholdPolicy;
use super::cost::DegreeCosts;
use super::decisions::{
    Batch, BatchEntry, Decisions, Migration, MigrationReason, WaitReason, Waiting,
};
use super::error::SchedError;
use super::instance::Instance;
use super::load_control::LoadControl;
use super::placement::Placement;
use super::predictor::{RequestView, StepsLeft};
use super::request::Request;
use super::threshold::{capped, choose_threshold, StepPrices};
use super::Scheduler;
use crate::profile::StepKind;

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
    pub pending: Vec<u32>,
    pub views: Vec<RequestView>,
    pub predicted: Vec<StepsLeft>,
    pub reported: Vec<(u32, usize)>,
    pub finished: Vec<u64>,
}

/// One dispatched step, with what emission needs copied while the request is in cache.
#[derive(Clone, Copy, Debug)]
struct Assignment {
    inst: u32,
    pos: u32,
    handle: u32,
    new_here: bool,
    kind: StepKind,
    request: u64,
    slo_left: f64,
}

impl Assignment {
    fn new(inst: u32, pos: u32, r: &Request, new_here: bool, now: f64) -> Self {
        Self {
            inst,
            pos,
            handle: r.handle,
            new_here,
            kind: r.next_kind,
            request: r.id,
            slo_left: r.deadline - now,
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
        if matches!(self.config.policy.threshold, ThresholdPolicy::SloAware)
            && self.config.policy.load_control
        {
            self.control_load();
        }
        self.place(now);
        self.emit_batches(now);
        self.decisions.elapsed_s = start.elapsed().as_secs_f64();
        Ok(&self.decisions)
    }

    /// DESIGN §5: caps every active request's thresholds so worst-case load fits capacity.
    fn control_load(&mut self) {
        let live = self.requests.live();
        if live == 0 {
            return;
        }
        // Dead positions hold zeros, so these sums are over live requests, in load order.
        let (mut seq_sum, mut slo_sum) = (0.0, 0.0);
        for (seq, slo) in self.requests.seq_tokens().iter().zip(self.requests.slo()) {
            seq_sum += seq;
            slo_sum += slo;
        }
        let window = self.config.slo_window_s.unwrap_or(slo_sum / live as f64);
        let mean_seq = seq_sum / live as f64;
        let (block, max_tokens) = (self.config.block_size, self.config.max_batch_tokens);
        let throughput = &mut self.scratch.throughput;
        throughput.clear();
        throughput.extend(
            self.groups
                .iter()
                .map(|g| g.throughput(mean_seq, block, max_tokens)),
        );
        let mut capacity = 0.0;
        for inst in &self.instances.slots {
            if inst.alive && !inst.draining {
                capacity += throughput[inst.group] * window;
            }
        }
        let k = self.config.thresholds.len();
        let n = self.requests.len();
        let (allowed, loads, caps) = self.requests.load_lanes();
        self.scratch.load.run(
            n,
            capacity,
            |i| allowed[i],
            |i, t| loads[i * k + t],
            |i, t| caps[i] = t as u8,
        );
    }

    /// DESIGN §6: puts every ready request in an instance's next batch or records why it waits.
    fn place(&mut self, now: f64) {
        let Scheduler {
            config,
            requests,
            instances,
            groups,
            scratch,
            decisions,
            ..
        } = self;
        let placement: &mut Placement = &mut scratch.placement;
        placement.begin(&instances.slots, groups.len(), config.max_batch_tokens);
        scratch.assigned.clear();
        scratch.free.clear();
        let placing = |r: &Request, instances: &[Instance]| match r.home {
            Some(h) if config.caching && r.next_kind == StepKind::Cache => Placing::Stay(h),
            Some(h) if !config.policy.migration && !instances[h as usize].draining => {
                Placing::Stay(h)
            }
            _ => Placing::Free,
        };

        for (pos, r) in requests.reqs_mut().iter_mut().enumerate() {
            if !r.alive || r.in_flight {
                continue;
            }
            let Placing::Stay(home) = placing(r, &instances.slots) else {
                scratch.free.push(pos as u32);
                continue;
            };
            let n = r.step_tokens();
            if placement.fits(home, n) {
                placement.add_fixed(home, n, r.next_kind != StepKind::Cache);
                r.in_flight = true;
                scratch
                    .assigned
                    .push(Assignment::new(home, pos as u32, r, false, now));
            } else {
                let reason = if placement.open[home as usize] {
                    WaitReason::HomeFull
                } else {
                    WaitReason::HomeBusy
                };
                decisions.waiting.push(Waiting {
                    request: r.id,
                    reason,
                });
            }
        }

        placement.build_heaps(&instances.slots);
        let choice = config.policy.instance_choice;
        // Instances only fill up during a round: once no instance fits `n` tokens, none fits
        // more, so later requests that large wait without searching.
        let mut no_fit = if placement.accepting == 0 {
            0
        } else {
            u64::MAX
        };
        for &pos in &scratch.free {
            let r = *requests.req(pos);
            let n = r.step_tokens();
            let best = if n >= no_fit {
                None
            } else {
                placement.best(n, groups, choice)
            };
            let Some(best) = best else {
                no_fit = no_fit.min(n);
                let reason = if placement.targets == 0 {
                    WaitReason::NoInstance
                } else if placement.accepting == 0 {
                    WaitReason::AllBusy
                } else {
                    WaitReason::NoRoom
                };
                decisions.waiting.push(Waiting {
                    request: r.id,
                    reason,
                });
                continue;
            };
            let to = instances.slots[best.slot as usize].id;
            let target = match r.home {
                Some(h) if h == best.slot => h,
                Some(h) => {
                    let inst = &instances.slots[h as usize];
                    let home_fits = placement.fits(h, n);
                    if !inst.draining
                        && home_fits
                        && placement.key(h, n, &groups[inst.group], choice) <= best.key
                    {
                        h
                    } else {
                        let reason = if inst.draining {
                            MigrationReason::Draining
                        } else if !placement.open[h as usize] {
                            MigrationReason::HomeBusy
                        } else if !home_fits {
                            MigrationReason::HomeFull
                        } else {
                            MigrationReason::Rebalance
                        };
                        decisions.migrations.push(Migration {
                            request: r.id,
                            from: inst.id,
                            to,
                            reason,
                        });
                        best.slot
                    }
                }
                None => {
                    if let Some(from) = r.displaced_from {
                        decisions.migrations.push(Migration {
                            request: r.id,
                            from,
                            to,
                            reason: MigrationReason::InstanceRemoved,
                        });
                    }
                    best.slot
                }
            };
            placement.add_free(target, instances.slots[target as usize].group, n);
            let moved = r.home != Some(target);
            if moved {
                if let Some(h) = r.home {
                    instances.slots[h as usize].drop_resident(r.seq_tokens());
                }
                instances.slots[target as usize].add_resident(r.seq_tokens());
            }
            let r = requests.req_mut(pos);
            r.in_flight = true;
            r.home = Some(target);
            r.displaced_from = None;
            scratch
                .assigned
                .push(Assignment::new(target, pos, r, moved, now));
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
            inst.busy = true;
            inst.inflight_tokens = tokens;
            inst.started_at = now;
            inst.predicted_s = costs.batch(full, tokens - full);
            scratch.prices[slot] = step_prices(costs, inst, config.caching, config.block_size);
            decisions.batches.push(Batch {
                instance: inst.id,
                start,
                len,
                tokens,
                predicted_finish: inst.predicted_finish(),
            });
            scratch.batch_slots.push(slot as u32);
            start += len;
        }

        let placeholder = BatchEntry {
            request: 0,
            tau: f64::NAN,
            kind: StepKind::NoCache,
            new_here: false,
        };
        decisions.entries.clear();
        decisions
            .entries
            .resize(scratch.assigned.len(), placeholder);
        scratch.entry_handles.clear();
        scratch.entry_handles.resize(scratch.assigned.len(), 0);
        for a in &scratch.assigned {
            let p = a.pos as usize;
            let tau = match config.policy.threshold {
                ThresholdPolicy::Fixed(tau) => tau,
                ThresholdPolicy::SloAware => {
                    let mask = capped(requests.allowed()[p], usize::from(requests.caps()[p]));
                    let steps = requests.steps_of(a.pos);
                    let prices = scratch.prices[a.inst as usize];
                    config.thresholds[choose_threshold(mask, steps, prices, a.slo_left)]
                }
            };
            requests.set_last_tau(a.pos, tau);
            let at = scratch.cursor[a.inst as usize];
            scratch.cursor[a.inst as usize] += 1;
            decisions.entries[at] = BatchEntry {
                request: a.request,
                tau,
                kind: a.kind,
                new_here: a.new_here,
            };
            scratch.entry_handles[at] = a.handle;
        }
        for (batch, &slot) in decisions.batches.iter().zip(&scratch.batch_slots) {
            let inst = &mut instances.slots[slot as usize];
            inst.inflight.clear();
            inst.inflight
                .extend_from_slice(&scratch.entry_handles[batch.start..batch.start + batch.len]);
        }
    }
}

/// Expected seconds of each step shape on `inst` given the requests it now holds.
fn step_prices(costs: &DegreeCosts, inst: &Instance, caching: bool, block: u32) -> StepPrices {
    let full = costs.full(inst.resident_tokens as f64) * inst.factor;
    let cache = if caching {
        costs.cache(f64::from(block) * f64::from(inst.residents)) * inst.factor
    } else {
        full
    };
    StepPrices { cache, full }
}
