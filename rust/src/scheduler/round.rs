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
use super::load_control::{request_load, LoadControl};
use super::placement::Placement;
use super::predictor::{RequestView, StepsLeft};
use super::request::{Request, RequestTable};
use super::threshold::{capped, choose_threshold, StepPrices};
use super::Scheduler;
use crate::profile::StepKind;

/// Buffers reused by every round and event, so steady-state operation does not allocate.
#[derive(Clone, Debug, Default)]
pub(crate) struct RoundScratch {
    load: LoadControl,
    placement: Placement,
    throughput: Vec<f64>,
    /// (instance slot, request slot, new to that instance) in dispatch order.
    assigned: Vec<(u32, u32, bool)>,
    /// Per instance: entries so far (then write cursor) while grouping into batches.
    cursor: Vec<usize>,
    entry_slots: Vec<u32>,
    /// Instance slot of each emitted batch.
    batch_slots: Vec<u32>,
    pub pending: Vec<u32>,
    pub views: Vec<RequestView>,
    pub predicted: Vec<StepsLeft>,
    pub reported: Vec<(u32, usize)>,
    pub finished: Vec<u64>,
}

/// Where a ready request may run its next step.
enum Placing {
    /// Only on its current instance: its cache lives there, or migration is off.
    Stay(u32),
    /// Anywhere accepting; `Some` names its current instance.
    Free(Option<u32>),
}

impl Scheduler {
    /// Runs one round at time `now` and returns its decisions; dispatched requests are in
    /// flight until their instance's [`Scheduler::step_done`].
    pub fn schedule(&mut self, now: f64) -> Result<&Decisions, SchedError> {
        let start = Instant::now();
        if !now.is_finite() {
            return Err(SchedError::BadTime(now));
        }
        self.requests.compact();
        self.decisions.clear(now);
        if matches!(self.config.policy.threshold, ThresholdPolicy::SloAware)
            && self.config.policy.load_control
        {
            self.control_load();
        }
        self.place();
        self.emit_batches(now);
        self.decisions.elapsed_s = start.elapsed().as_secs_f64();
        Ok(&self.decisions)
    }

    /// DESIGN §5: caps every active request's thresholds so worst-case load fits capacity.
    fn control_load(&mut self) {
        let RequestTable {
            slots,
            steps,
            caps,
            order,
            ..
        } = &mut self.requests;
        let n = order.len();
        if n == 0 {
            return;
        }
        let (mut seq_sum, mut slo_sum) = (0.0, 0.0);
        for &slot in order.iter() {
            let r = &slots[slot as usize];
            seq_sum += r.seq_tokens() as f64;
            slo_sum += r.deadline - r.arrival;
        }
        let window = self.config.slo_window_s.unwrap_or(slo_sum / n as f64);
        let mean_seq = seq_sum / n as f64;
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
        let caching = self.config.caching;
        let k = self.config.thresholds.len();
        let load = |i: usize, t: usize| {
            let slot = order[i] as usize;
            let r = &slots[slot];
            request_load(
                steps[slot * k + t],
                r.seq_tokens() as f64,
                f64::from(r.block_size),
                caching,
            )
        };
        self.scratch.load.run(
            n,
            capacity,
            |i| slots[order[i] as usize].allowed,
            load,
            |i, t| caps[order[i] as usize] = t as u8,
        );
    }

    /// DESIGN §6: puts every ready request in an instance's next batch or records why it waits.
    fn place(&mut self) {
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
        let placing = |r: &Request, instances: &[Instance]| match r.home {
            Some(h) if config.caching && r.next_kind == StepKind::Cache => Placing::Stay(h),
            Some(h) if !config.policy.migration && !instances[h as usize].draining => {
                Placing::Stay(h)
            }
            other => Placing::Free(other),
        };

        for &slot in &requests.order {
            let r = &requests.slots[slot as usize];
            if r.in_flight {
                continue;
            }
            let Placing::Stay(home) = placing(r, &instances.slots) else {
                continue;
            };
            let n = r.step_tokens();
            if placement.fits(home, n) {
                placement.add_fixed(home, n, r.next_kind != StepKind::Cache);
                scratch.assigned.push((home, slot, false));
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
        for &slot in &requests.order {
            let r = &requests.slots[slot as usize];
            if r.in_flight {
                continue;
            }
            let Placing::Free(home) = placing(r, &instances.slots) else {
                continue;
            };
            let n = r.step_tokens();
            let Some(best) = placement.best(n, groups, choice) else {
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
            let target = match home {
                Some(h) if h == best.slot => h,
                Some(h) => {
                    let inst = &instances.slots[h as usize];
                    let stays = !inst.draining
                        && placement.fits(h, n)
                        && placement.key(h, n, &groups[inst.group], choice) <= best.key;
                    if stays {
                        h
                    } else {
                        let reason = if inst.draining {
                            MigrationReason::Draining
                        } else if !placement.open[h as usize] {
                            MigrationReason::HomeBusy
                        } else if !placement.fits(h, n) {
                            MigrationReason::HomeFull
                        } else {
                            MigrationReason::Rebalance
                        };
                        decisions.migrations.push(Migration {
                            request: r.id,
                            from: inst.id,
                            to: instances.slots[best.slot as usize].id,
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
                            to: instances.slots[best.slot as usize].id,
                            reason: MigrationReason::InstanceRemoved,
                        });
                    }
                    best.slot
                }
            };
            let group = instances.slots[target as usize].group;
            placement.add_free(target, group, n);
            let moved = home != Some(target);
            if moved {
                let tokens = r.seq_tokens();
                if let Some(h) = home {
                    instances.slots[h as usize].drop_resident(tokens);
                }
                instances.slots[target as usize].add_resident(tokens);
                let r = &mut requests.slots[slot as usize];
                r.home = Some(target);
                r.displaced_from = None;
            }
            scratch.assigned.push((target, slot, moved));
        }
    }

    /// Groups dispatched requests into per-instance batches, picks each step's threshold and
    /// marks instances and requests in flight.
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
        scratch.cursor.clear();
        scratch.cursor.resize(instances.slots.len(), 0);
        for &(inst, _, _) in &scratch.assigned {
            scratch.cursor[inst as usize] += 1;
        }
        scratch.batch_slots.clear();
        let mut start = 0;
        for (slot, inst) in instances.slots.iter_mut().enumerate() {
            let len = scratch.cursor[slot];
            scratch.cursor[slot] = start;
            if len == 0 {
                continue;
            }
            let tokens = scratch.placement.tokens[slot];
            let full = scratch.placement.full_tokens[slot];
            inst.busy = true;
            inst.inflight_tokens = tokens;
            inst.started_at = now;
            inst.predicted_s = groups[inst.group].batch(full, tokens - full);
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
        scratch.entry_slots.clear();
        scratch.entry_slots.resize(scratch.assigned.len(), 0);
        for &(inst_slot, slot, new_here) in &scratch.assigned {
            let pos = scratch.cursor[inst_slot as usize];
            scratch.cursor[inst_slot as usize] += 1;
            let r = &requests.slots[slot as usize];
            decisions.entries[pos] = BatchEntry {
                request: r.id,
                tau: f64::NAN,
                kind: r.next_kind,
                new_here,
            };
            scratch.entry_slots[pos] = slot;
        }
        for (batch, &inst_slot) in decisions.batches.iter().zip(&scratch.batch_slots) {
            let inst = &mut instances.slots[inst_slot as usize];
            let members = &scratch.entry_slots[batch.start..batch.start + batch.len];
            inst.inflight.clear();
            inst.inflight.extend_from_slice(members);
            let prices = step_prices(&groups[inst.group], inst, config.caching, config.block_size);
            let entries = &mut decisions.entries[batch.start..batch.start + batch.len];
            for (entry, &slot) in entries.iter_mut().zip(members) {
                let r = &mut requests.slots[slot as usize];
                entry.tau = match config.policy.threshold {
                    ThresholdPolicy::Fixed(tau) => tau,
                    ThresholdPolicy::SloAware => {
                        let cap = usize::from(requests.caps[slot as usize]);
                        let steps = &requests.steps[slot as usize * config.thresholds.len()..]
                            [..config.thresholds.len()];
                        let k = choose_threshold(
                            capped(r.allowed, cap),
                            steps,
                            prices,
                            r.deadline - now,
                        );
                        config.thresholds[k]
                    }
                };
                r.in_flight = true;
                r.tau = entry.tau;
            }
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
