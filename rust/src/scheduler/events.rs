//! Event handlers: arrivals, step reports, cancellations and instance changes. Each checks
//! its whole input before changing anything, so a rejected event leaves no trace.

use super::config::Prediction;
use super::cost::DegreeCosts;
use super::error::SchedError;
use super::instance::InstanceSpec;
use super::request::{RequestSpec, RequestTable};
use super::Scheduler;
use crate::profile::StepKind;

/// A worker's report on one request of a finished step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepResult {
    pub request: u64,
    /// Tokens unmasked by this step (at least one: the threshold rule always commits one).
    pub committed: u32,
    /// Confidence statistics of the still-masked output tokens: min, q25, median, mean, q75.
    pub confidence: Option<[f64; 5]>,
    /// The request ended early (EOS committed with everything before it unmasked).
    pub finished: bool,
}

impl StepResult {
    pub fn new(request: u64, committed: u32) -> Self {
        Self {
            request,
            committed,
            confidence: None,
            finished: false,
        }
    }
}

impl Scheduler {
    /// Admits a new request; it is ready for the next round.
    pub fn arrive(&mut self, spec: RequestSpec) -> Result<(), SchedError> {
        let request = self.requests.build(&spec, &self.config)?;
        let slot = self.requests.insert(request, self.config.policy.load_order);
        self.scratch.pending.clear();
        self.scratch.pending.push(slot);
        self.refresh_predictions();
        Ok(())
    }

    /// Takes a request out of the scheduler. A request in flight stays in its instance's
    /// batch until that step is reported; its result is then ignored.
    pub fn cancel(&mut self, id: u64) -> Result<(), SchedError> {
        let slot = self.requests.slot_of(id)?;
        let r = &self.requests.slots[slot as usize];
        if let Some(home) = r.home {
            let tokens = r.seq_tokens();
            self.instances.slots[home as usize].drop_resident(tokens);
        }
        self.requests.remove(slot);
        Ok(())
    }

    /// Applies the report of `instance`'s finished step. Returns the requests that finished.
    pub fn step_done(
        &mut self,
        instance: u64,
        measured_s: f64,
        results: &[StepResult],
    ) -> Result<&[u64], SchedError> {
        let inst_slot = self.instances.slot_of(instance)?;
        self.check_report(inst_slot, measured_s, results)?;
        self.instances.slots[inst_slot as usize].observe_step(measured_s);
        self.scratch.finished.clear();
        self.scratch.pending.clear();
        for i in 0..self.scratch.reported.len() {
            let (slot, index) = self.scratch.reported[i];
            let result = &results[index];
            let confidence = result.confidence;
            let executed = self.commit(slot, result.committed, result.finished);
            if let Some(conf) = confidence {
                self.requests.confidence[slot as usize] = Some(conf);
            }
            match executed {
                Commit::Finished => {
                    let r = &self.requests.slots[slot as usize];
                    let (id, home, tokens) = (r.id, r.home, r.seq_tokens());
                    if let Some(home) = home {
                        self.instances.slots[home as usize].drop_resident(tokens);
                    }
                    self.requests.remove(slot);
                    self.scratch.finished.push(id);
                }
                Commit::Continues { was_full } => self.update_prediction(slot, was_full),
            }
        }
        let inst = &mut self.instances.slots[inst_slot as usize];
        release_cancelled(&mut self.requests, &inst.inflight);
        inst.inflight.clear();
        inst.busy = false;
        inst.inflight_tokens = 0;
        self.refresh_predictions();
        Ok(&self.scratch.finished)
    }

    /// Validates a step report, leaving `(slot, result index)` pairs in `scratch.reported`.
    fn check_report(
        &mut self,
        inst_slot: u32,
        measured_s: f64,
        results: &[StepResult],
    ) -> Result<(), SchedError> {
        let inst = &self.instances.slots[inst_slot as usize];
        let bad = |reason: String| SchedError::BadStepReport {
            instance: inst.id,
            reason,
        };
        if !inst.busy {
            return Err(SchedError::NoStepInFlight(inst.id));
        }
        if !(measured_s.is_finite() && measured_s >= 0.0) {
            return Err(bad(format!(
                "measured step time must be finite and non-negative, got {measured_s}"
            )));
        }
        let reported = &mut self.scratch.reported;
        reported.clear();
        for (index, res) in results.iter().enumerate() {
            let slot = match self.requests.slot_of(res.request) {
                Ok(slot) => slot,
                Err(e) => {
                    let cancelled = inst.inflight.iter().any(|&s| {
                        let r = &self.requests.slots[s as usize];
                        !r.alive && r.id == res.request
                    });
                    if cancelled {
                        continue;
                    }
                    return Err(e);
                }
            };
            let r = &self.requests.slots[slot as usize];
            if !(r.in_flight && r.home == Some(inst_slot)) {
                return Err(bad(format!("request {} is not in its batch", res.request)));
            }
            let masked = r.block_size - r.unmasked_in_block;
            if res.committed == 0 || res.committed > masked {
                return Err(bad(format!(
                    "request {} committed {} tokens; its block has {} masked (a step commits \
                     at least one)",
                    res.request, res.committed, masked
                )));
            }
            if let Some(conf) = res.confidence {
                if conf.iter().any(|c| !c.is_finite()) {
                    return Err(bad(format!(
                        "request {} reported non-finite confidence {conf:?}",
                        res.request
                    )));
                }
            }
            reported.push((slot, index));
        }
        reported.sort_unstable();
        if let Some(w) = reported.windows(2).find(|w| w[0].0 == w[1].0) {
            let id = self.requests.slots[w[0].0 as usize].id;
            return Err(bad(format!("request {id} is reported twice")));
        }
        let members = inst
            .inflight
            .iter()
            .filter(|&&s| self.requests.slots[s as usize].alive)
            .count();
        if reported.len() != members {
            let missing = inst
                .inflight
                .iter()
                .find(|&&s| {
                    self.requests.slots[s as usize].alive
                        && reported.binary_search_by_key(&s, |p| p.0).is_err()
                })
                .map_or(0, |&s| self.requests.slots[s as usize].id);
            return Err(bad(format!("no result for request {missing} of its batch")));
        }
        Ok(())
    }

    /// Advances one request by a committed step.
    fn commit(&mut self, slot: u32, committed: u32, eos: bool) -> Commit {
        let caching = self.config.caching;
        let r = &mut self.requests.slots[slot as usize];
        let was_full = r.needs_recompute();
        r.in_flight = false;
        r.steps_done += 1;
        r.unmasked += committed;
        r.unmasked_in_block += committed;
        if r.unmasked_in_block == r.block_size {
            r.current_block += 1;
            r.unmasked_in_block = 0;
            if caching {
                r.next_kind = StepKind::Recompute;
            }
        } else if caching {
            r.next_kind = StepKind::Cache;
        }
        if eos || r.unmasked >= r.output_len {
            Commit::Finished
        } else {
            Commit::Continues { was_full }
        }
    }

    /// After a step: queue a fresh prediction, or count the step off the last one.
    fn update_prediction(&mut self, slot: u32, was_full: bool) {
        let steps_done = self.requests.slots[slot as usize].steps_done;
        if let Prediction::Online { every } = self.config.policy.prediction {
            if steps_done % every == 0 {
                self.scratch.pending.push(slot);
                return;
            }
        }
        for s in self.requests.steps_of_mut(slot) {
            if was_full {
                s.recompute = (s.recompute - 1.0).max(0.0);
            } else {
                s.cache = (s.cache - 1.0).max(0.0);
            }
        }
    }

    /// Runs the predictor once over every slot in `scratch.pending`.
    fn refresh_predictions(&mut self) {
        let scratch = &mut self.scratch;
        if scratch.pending.is_empty() {
            return;
        }
        let taus = &self.config.thresholds;
        scratch.views.clear();
        scratch.views.extend(scratch.pending.iter().map(|&slot| {
            self.requests.slots[slot as usize].view(self.requests.confidence[slot as usize])
        }));
        scratch.predicted.clear();
        scratch
            .predicted
            .resize(scratch.views.len() * taus.len(), Default::default());
        self.predictor
            .predict_batch(&scratch.views, taus, &mut scratch.predicted);
        for (&slot, row) in scratch
            .pending
            .iter()
            .zip(scratch.predicted.chunks_exact(taus.len()))
        {
            self.requests.steps_of_mut(slot).copy_from_slice(row);
        }
        scratch.pending.clear();
    }

    /// Announces a new instance; it takes requests from the next round.
    pub fn add_instance(&mut self, spec: InstanceSpec) -> Result<(), SchedError> {
        self.instances.validate(&spec)?;
        let group = match self.groups.iter().position(|g| g.tp == spec.tp) {
            Some(group) => group,
            None => {
                let costs = DegreeCosts::new(
                    &self.profile,
                    spec.tp,
                    self.config.caching,
                    self.config.max_batch_tokens,
                )?;
                self.groups.push(costs);
                self.groups.len() - 1
            }
        };
        self.instances.insert(spec, group);
        Ok(())
    }

    /// Stops sending new requests to an instance. Requests it holds finish their current
    /// block there (with caching) and then move; the caller removes it once it holds none.
    pub fn drain_instance(&mut self, id: u64) -> Result<(), SchedError> {
        let slot = self.instances.slot_of(id)?;
        self.instances.slots[slot as usize].draining = true;
        Ok(())
    }

    /// Forgets an instance (stopped or failed). Its requests, including those of a step in
    /// flight, lose their cache and are placed again from the engine's copy of their state.
    pub fn remove_instance(&mut self, id: u64) -> Result<(), SchedError> {
        let inst_slot = self.instances.slot_of(id)?;
        let inst = &mut self.instances.slots[inst_slot as usize];
        release_cancelled(&mut self.requests, &inst.inflight);
        inst.inflight.clear();
        self.instances.remove(inst_slot);
        let caching = self.config.caching;
        let online = matches!(self.config.policy.prediction, Prediction::Online { .. });
        self.scratch.pending.clear();
        for (slot, r) in self.requests.slots.iter_mut().enumerate() {
            if r.alive && r.home == Some(inst_slot) {
                r.home = None;
                r.in_flight = false;
                r.displaced_from = Some(id);
                if caching && r.next_kind == StepKind::Cache {
                    r.next_kind = StepKind::Recompute;
                    if online {
                        self.scratch.pending.push(slot as u32);
                    }
                }
            }
        }
        self.refresh_predictions();
        Ok(())
    }
}

/// Frees the slots of batch members cancelled while their step ran.
fn release_cancelled(requests: &mut RequestTable, batch: &[u32]) {
    for &slot in batch {
        let r = &requests.slots[slot as usize];
        if !r.alive && r.in_flight {
            requests.release(slot);
        }
    }
}

enum Commit {
    Finished,
    Continues { was_full: bool },
}
