//! Event handlers: arrivals, step reports, cancellations and instance changes. Each checks
//! its whole input before changing anything, so a rejected event leaves no trace.

use super::config::Prediction;
use super::cost::DegreeCosts;
use super::error::SchedError;
use super::instance::InstanceSpec;
use super::request::{Request, RequestSpec};
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
        if self.requests.contains(spec.id) {
            return Err(SchedError::DuplicateRequest(spec.id));
        }
        let (request, allowed) = Request::from_spec(&spec, &self.config, self.requests.next_seq())?;
        let pos = self.requests.insert(request, allowed);
        self.scratch.pending.clear();
        self.scratch.pending.push(pos);
        self.refresh_predictions();
        Ok(())
    }

    /// Takes a request out of the scheduler. If it is in flight, its instance's report may
    /// still name it; that result is ignored.
    pub fn cancel(&mut self, id: u64) -> Result<(), SchedError> {
        let pos = self.requests.pos_of(id)?;
        let r = *self.requests.req(pos);
        if let Some(home) = r.home {
            let inst = &mut self.instances.slots[home as usize];
            inst.drop_resident(r.seq_tokens());
            if r.in_flight {
                inst.inflight.retain(|&h| h != r.handle);
                inst.cancelled.push(id);
            }
        }
        self.requests.remove(pos);
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
        let inst = &mut self.instances.slots[inst_slot as usize];
        inst.observe_step(measured_s);
        inst.inflight.clear();
        inst.cancelled.clear();
        inst.busy = false;
        inst.inflight_tokens = 0;
        self.scratch.finished.clear();
        self.scratch.pending.clear();
        for i in 0..self.scratch.reported.len() {
            let (pos, index) = self.scratch.reported[i];
            let result = &results[index];
            if let Some(conf) = result.confidence {
                let handle = self.requests.req(pos).handle;
                self.requests.confidence[handle as usize] = Some(conf);
            }
            match self.commit(pos, result.committed, result.finished) {
                Commit::Finished => {
                    let r = *self.requests.req(pos);
                    if let Some(home) = r.home {
                        self.instances.slots[home as usize].drop_resident(r.seq_tokens());
                    }
                    self.requests.remove(pos);
                    self.scratch.finished.push(r.id);
                }
                Commit::Continues { was_full } => self.update_prediction(pos, was_full),
            }
        }
        self.refresh_predictions();
        Ok(&self.scratch.finished)
    }

    /// Validates a step report, leaving `(position, result index)` pairs in
    /// `scratch.reported`.
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
            let pos = match self.requests.pos_of(res.request) {
                Ok(pos) => pos,
                Err(_) if inst.cancelled.contains(&res.request) => continue,
                Err(e) => return Err(e),
            };
            let r = self.requests.req(pos);
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
            reported.push((pos, index));
        }
        reported.sort_unstable();
        if let Some(w) = reported.windows(2).find(|w| w[0].0 == w[1].0) {
            let id = self.requests.req(w[0].0).id;
            return Err(bad(format!("request {id} is reported twice")));
        }
        if reported.len() != inst.inflight.len() {
            let missing = inst
                .inflight
                .iter()
                .map(|&h| self.requests.pos_of_handle(h))
                .find(|&pos| reported.binary_search_by_key(&pos, |p| p.0).is_err())
                .map_or(0, |pos| self.requests.req(pos).id);
            return Err(bad(format!("no result for request {missing} of its batch")));
        }
        Ok(())
    }

    /// Advances one request by a committed step.
    fn commit(&mut self, pos: u32, committed: u32, eos: bool) -> Commit {
        let caching = self.config.caching;
        let r = self.requests.req_mut(pos);
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
    fn update_prediction(&mut self, pos: u32, was_full: bool) {
        if let Prediction::Online { every } = self.config.policy.prediction {
            if self.requests.req(pos).steps_done % every == 0 {
                self.scratch.pending.push(pos);
                return;
            }
        }
        self.requests.count_step_off(pos, was_full);
    }

    /// Runs the predictor once over every position in `scratch.pending`.
    fn refresh_predictions(&mut self) {
        let scratch = &mut self.scratch;
        if scratch.pending.is_empty() {
            return;
        }
        let taus = &self.config.thresholds;
        let requests = &mut self.requests;
        scratch.views.clear();
        scratch.views.extend(scratch.pending.iter().map(|&pos| {
            let r = requests.req(pos);
            r.view(requests.confidence[r.handle as usize])
        }));
        scratch.predicted.clear();
        scratch
            .predicted
            .resize(scratch.views.len() * taus.len(), Default::default());
        self.predictor
            .predict_batch(&scratch.views, taus, &mut scratch.predicted);
        for (&pos, row) in scratch
            .pending
            .iter()
            .zip(scratch.predicted.chunks_exact(taus.len()))
        {
            requests.set_steps(pos, row);
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
        inst.inflight.clear();
        inst.cancelled.clear();
        self.instances.remove(inst_slot);
        let caching = self.config.caching;
        let online = matches!(self.config.policy.prediction, Prediction::Online { .. });
        self.scratch.pending.clear();
        for pos in 0..self.requests.len() as u32 {
            let r = self.requests.req_mut(pos);
            if r.alive && r.home == Some(inst_slot) {
                r.home = None;
                r.in_flight = false;
                r.displaced_from = Some(id);
                if caching && r.next_kind == StepKind::Cache {
                    r.next_kind = StepKind::Recompute;
                    if online {
                        self.scratch.pending.push(pos);
                    }
                }
            }
        }
        self.refresh_predictions();
        Ok(())
    }
}

enum Commit {
    Finished,
    Continues { was_full: bool },
}
