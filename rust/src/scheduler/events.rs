//! Request events: arrivals, step reports and cancellations. Each checks its whole input
//! before changing anything, so a rejected event leaves no trace.

use std::collections::HashSet;

use super::config::{Admission, ThresholdPolicy};
use super::error::SchedError;
use super::history::FinishedRequest;
use super::load_control::request_load;
use super::predictor::check_predictions;
use super::request::{Request, RequestSpec, BEST_EFFORT};
use super::Scheduler;
use crate::profile::StepKind;

/// A worker's report on one request of a finished step.
///
/// Confidence statistics are the min, q25, median, mean and q75 of the confidences of the
/// current block's positions that were still masked when the step began. A step that
/// completes its block reports them too, but they then describe a finished block: the
/// scheduler drops them, and the request has no confidence features until its next report
/// (the next block's confidences are unknown before its first step). Statistics that are
/// not all finite are dropped the same way, for that request only.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepResult {
    pub request: u64,
    /// Tokens unmasked by this step (at least one: the threshold rule always commits one).
    pub committed: u32,
    /// Confidence statistics: min, q25, median, mean, q75 (see above).
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
    ///
    /// While the last round found the cluster overloaded, an arrival is rejected with
    /// [`SchedError::Admission`] once `max_queued` requests wait for their first step.
    /// Deadline admission refuses only requests with an explicit deadline; others it
    /// would refuse are served best-effort.
    pub fn arrive(&mut self, spec: RequestSpec) -> Result<(), SchedError> {
        if self.requests.contains(spec.id) {
            return Err(SchedError::DuplicateRequest(spec.id));
        }
        let (mut request, allowed) =
            Request::from_spec(&spec, &self.config, self.requests.next_seq())?;
        if let Some(max) = self.instances.largest_kv() {
            let tokens = request.seq_tokens();
            if tokens > max {
                // No instance could ever hold it: it would wait forever.
                return Err(SchedError::ExceedsKvCache {
                    id: spec.id,
                    tokens,
                    max,
                });
            }
        }
        if let Some(max_queued) = self.config.max_queued.filter(|_| self.overloaded) {
            if self.queued >= max_queued {
                return Err(SchedError::Admission {
                    id: spec.id,
                    queued: self.queued,
                    max_queued,
                });
            }
        }
        // Predicted before the request is stored, so a failing predictor leaves no trace.
        let taus = &self.config.thresholds;
        let view = [request.view(None)];
        let scratch = &mut self.scratch;
        scratch.predicted.clear();
        scratch.predicted.resize(taus.len(), Default::default());
        self.predictor
            .predict_batch(&view, taus, &mut scratch.predicted)
            .and_then(|()| check_predictions(&view, taus, &scratch.predicted))?;
        let full = request.full_step_tokens() as f64;
        let block = f64::from(request.block_length);
        let caching = self.config.caching;
        scratch.arrival_loads.clear();
        scratch.arrival_loads.extend(
            scratch
                .predicted
                .iter()
                .map(|s| request_load(*s, full, block, caching)),
        );
        let lowest = allowed.trailing_zeros() as usize;
        self.shedder
            .offer(spec.arrival, &self.scratch.arrival_loads);
        if let Some(refusal) = self.refusal(&spec, &request, lowest) {
            match self.config.policy.admission {
                Admission::Off => {}
                Admission::Reject if spec.explicit_deadline => return Err(refusal),
                Admission::Reject | Admission::BestEffort => request.seq |= BEST_EFFORT,
            }
        }
        self.backlog_lowest += self.scratch.arrival_loads[lowest];
        if request.seq & BEST_EFFORT == 0 {
            self.forecast
                .record(spec.arrival, &self.scratch.arrival_loads);
        }
        let pos = self.requests.insert(request, allowed);
        self.requests.set_steps(pos, &self.scratch.predicted);
        self.queued += 1;
        Ok(())
    }

    /// *(ours)* Why admission would refuse an arrival, if it would: it cannot meet its
    /// deadline (see [`Self::unmeetable`]), or it falls in the share of arrivals shed while
    /// the offered load exceeds what the cluster carries at the lowest thresholds.
    fn refusal(
        &mut self,
        spec: &RequestSpec,
        request: &Request,
        lowest: usize,
    ) -> Option<SchedError> {
        let active = matches!(self.config.policy.threshold, ThresholdPolicy::SloAware)
            && self.config.policy.load_control
            && self.config.policy.admission != Admission::Off;
        if !active || self.capacity_rate <= 0.0 {
            return None;
        }
        let slo_s = spec.deadline - spec.arrival;
        if let Some(estimate_s) = self.unmeetable(request, lowest, slo_s) {
            return Some(SchedError::Unmeetable {
                id: spec.id,
                estimate_s,
                slo_s,
            });
        }
        self.shedder.refuse_next().then(|| SchedError::Shed {
            id: spec.id,
            share: self.shedder.fraction(),
        })
    }

    /// Deadline admission: the seconds an arrival would take at its `lowest` threshold
    /// sharing the whole cluster with every live request at its own lowest (or alone on the
    /// fastest instance, if longer) — when that exceeds `slo_s`.
    fn unmeetable(&self, request: &Request, lowest: usize, slo_s: f64) -> Option<f64> {
        let steps = self.scratch.predicted[lowest];
        let seq = request.seq_tokens() as f64;
        let block = f64::from(request.block_length);
        let alone = self
            .groups
            .iter()
            .map(|g| steps.cache * g.cache(block, seq) + steps.recompute * g.full_step(block, seq))
            .fold(f64::INFINITY, f64::min);
        // Batched steps share the cluster among the live requests, so none delays this one
        // by more than this one's own work: Σ min(load_j, own) ≤ min(Σ load_j, n × own).
        let own = self.scratch.arrival_loads[lowest];
        let ahead = self.backlog_lowest.min(self.requests.live() as f64 * own);
        let shared = (ahead + own) / self.capacity_rate;
        let estimate = shared.max(if alone.is_finite() { alone } else { 0.0 });
        (estimate > slo_s).then_some(estimate)
    }

    /// *(ours)* Prefix sharing: instance `instance` is expected to hold the exact K/V of the
    /// first `tokens` prompt tokens of request `id` (whole blocks another request stored
    /// there), so its first step there feeds only what follows them; placement weighs that
    /// instance at the shorter step. Only before its first dispatch, under the exact cache.
    pub fn expect_prefix(&mut self, id: u64, instance: u64, tokens: u32) -> Result<(), SchedError> {
        let pos = self.requests.pos_of(id)?;
        self.instances.slot_of(instance)?;
        let r = self.requests.req_mut(pos);
        let invalid = |reason: String| SchedError::InvalidRequest { id, reason };
        if !r.exact {
            return Err(invalid("only the exact block cache shares prefixes".into()));
        }
        if tokens > r.prompt_len || tokens % r.block_length != 0 {
            return Err(invalid(format!(
                "a stored prefix of {tokens} tokens is not whole blocks of its {}-token prompt",
                r.prompt_len
            )));
        }
        if r.last_instance.is_none() {
            r.cached_prefix = Some((instance, tokens));
        }
        Ok(())
    }

    /// *(ours)* Prefix sharing: request `id`, in the step in flight on `instance`, reads
    /// the stored prompt blocks `keys` there (its worker reported them with that step, which
    /// took the request in), so the instance holds them once however many residents read
    /// them (`shared_blocks`). Ignored for a request not in that step (it was cancelled, or
    /// a new request reuses its id).
    pub fn read_prefix(
        &mut self,
        instance: u64,
        id: u64,
        keys: Vec<u64>,
    ) -> Result<(), SchedError> {
        let slot = self.instances.slot_of(instance)?;
        let Ok(pos) = self.requests.pos_of(id) else {
            return Ok(());
        };
        let r = *self.requests.req(pos);
        let bad = |reason: String| SchedError::BadStepReport {
            instance,
            reason: format!("request {id}: {reason}"),
        };
        let blocks = u64::try_from(keys.len()).unwrap_or(u64::MAX);
        if blocks.saturating_mul(u64::from(r.block_length)) > u64::from(r.prompt_len) {
            return Err(bad(format!(
                "{blocks} stored blocks of {} tokens exceed its {}-token prompt",
                r.block_length, r.prompt_len
            )));
        }
        if keys.iter().collect::<HashSet<_>>().len() != keys.len() {
            return Err(bad("a stored block is named twice".into()));
        }
        let inst = &mut self.instances.slots[slot as usize];
        if inst.inflight.contains(&r.handle) && !inst.cancelled.contains(&id) {
            inst.set_reads(&r, keys);
        }
        Ok(())
    }

    /// Takes a request out of the scheduler. If it is in flight, its instance's report may
    /// still name it; that result is ignored, even if a new request reuses the id meanwhile.
    pub fn cancel(&mut self, id: u64) -> Result<(), SchedError> {
        let pos = self.requests.pos_of(id)?;
        let r = *self.requests.req(pos);
        if let Some(home) = r.home {
            let estimate = r.next_step_estimate(self.config.caching);
            let inst = &mut self.instances.slots[home as usize];
            inst.drop_resident(&r);
            if !self.requests.ready(pos) {
                if inst.inflight.contains(&r.handle) {
                    inst.inflight.retain(|&h| h != r.handle);
                    inst.cancelled.push(id);
                    inst.next_tokens = inst.next_tokens.saturating_sub(estimate);
                }
                if let Some(ahead) = inst
                    .ahead
                    .as_mut()
                    .filter(|a| a.handles.contains(&r.handle))
                {
                    ahead.handles.retain(|&h| h != r.handle);
                    ahead.cancelled.push(id);
                    ahead.next_tokens = ahead.next_tokens.saturating_sub(estimate);
                }
            }
        }
        if r.last_instance.is_none() {
            self.queued = self.queued.saturating_sub(1);
        }
        if self.reservation.is_some_and(|v| v.handle == r.handle) {
            self.reservation = None;
        }
        self.requests.remove(pos);
        Ok(())
    }

    /// Applies the report of `instance`'s finished step. Returns the requests that
    /// finished, with their statistics.
    ///
    /// A report that passes its checks is applied even if the predictor then fails
    /// ([`SchedError::Predictor`]): the step did run. The requests due a fresh prediction
    /// keep their last one, and the error is returned.
    pub fn step_done(
        &mut self,
        instance: u64,
        measured_s: f64,
        results: &[StepResult],
    ) -> Result<&[FinishedRequest], SchedError> {
        let inst_slot = self.instances.slot_of(instance)?;
        self.check_report(inst_slot, measured_s, results)?;
        self.apply_step(inst_slot, measured_s, results)
    }

    /// [`Scheduler::step_done`] with a say of the caller's between the check and the
    /// change, so that what the caller keeps of the report (the engine's token state) and
    /// the scheduler take it together or not at all. `prepare` gets the scheduler and the
    /// indices of the results it will apply (not those of requests cancelled while the step
    /// ran, even if a new request has taken the id since); it may refuse the report,
    /// leaving the scheduler unchanged, or set those results' `finished` flags, which the
    /// check ignores.
    pub fn step_done_with(
        &mut self,
        instance: u64,
        measured_s: f64,
        results: &mut [StepResult],
        prepare: impl FnOnce(&Self, &[usize], &mut [StepResult]) -> Result<(), SchedError>,
    ) -> Result<&[FinishedRequest], SchedError> {
        let inst_slot = self.instances.slot_of(instance)?;
        self.check_report(inst_slot, measured_s, results)?;
        let rows: Vec<usize> = self.scratch.reported.iter().map(|&(_, i)| i).collect();
        prepare(self, &rows, results)?;
        self.apply_step(inst_slot, measured_s, results)
    }

    /// Applies a report that `check_report` passed (its rows are in `scratch.reported`).
    fn apply_step(
        &mut self,
        inst_slot: u32,
        measured_s: f64,
        results: &[StepResult],
    ) -> Result<&[FinishedRequest], SchedError> {
        let inst = &mut self.instances.slots[inst_slot as usize];
        inst.observe_step(measured_s, &mut self.group_factors[inst.group]);
        let ended_at = inst.started_at + measured_s;
        self.scratch.finished.clear();
        self.scratch.pending.clear();
        for i in 0..self.scratch.reported.len() {
            let (pos, index) = self.scratch.reported[i];
            let result = &results[index];
            let r = *self.requests.req(pos);
            let tau = self.requests.last_tau(pos);
            let history = &mut self.requests.history[r.handle as usize];
            history.taus.push(tau);
            if r.next_kind == StepKind::Recompute {
                history.recompute_steps += 1;
            }
            match self.commit(pos, result.committed, result.finished, tau) {
                Commit::Finished => {
                    let r = *self.requests.req(pos);
                    if self.reservation.is_some_and(|v| v.handle == r.handle) {
                        self.reservation = None;
                    }
                    if let Some(home) = r.home {
                        let inst = &mut self.instances.slots[home as usize];
                        inst.drop_resident(&r);
                        if let Some(ahead) = inst.ahead.as_mut().filter(|_| r.ahead_tau.is_some()) {
                            // The worker skips its step ahead: it knows the request ended.
                            ahead.handles.retain(|&h| h != r.handle);
                            ahead.cancelled.push(r.id);
                        }
                    }
                    let history = &mut self.requests.history[r.handle as usize];
                    self.scratch.finished.push(FinishedRequest {
                        id: r.id,
                        steps: r.steps_done,
                        recompute_steps: history.recompute_steps,
                        taus: std::mem::take(&mut history.taus),
                        instances: std::mem::take(&mut history.instances),
                        migrations: history.migrations,
                        first_dispatch: history.first_dispatch,
                        deadline: r.deadline,
                        arrival: r.arrival,
                    });
                    self.requests.remove(pos);
                }
                Commit::Continues {
                    was_full,
                    block_done,
                } => {
                    let confidence = result
                        .confidence
                        .filter(|c| !block_done && c.iter().all(|x| x.is_finite()));
                    self.requests.confidence[r.handle as usize] = confidence;
                    self.update_prediction(pos, was_full);
                    if let Some(tau) = r.ahead_tau {
                        // Its step ahead is the instance's next step in flight.
                        self.requests.set_ready(pos, false);
                        self.requests.set_last_tau(pos, tau);
                        self.requests.req_mut(pos).ahead_tau = None;
                    }
                }
            }
        }
        self.instances.slots[inst_slot as usize].start_ahead(ended_at);
        // The report is applied whatever the predictor does: the worker did run the step.
        self.refresh_predictions()?;
        Ok(&self.scratch.finished)
    }

    /// The τ of a live request's last dispatched step (its step in flight, if any).
    pub fn last_tau(&self, id: u64) -> Result<f64, SchedError> {
        Ok(self.requests.last_tau(self.requests.pos_of(id)?))
    }

    /// Validates a step report, leaving `(position, result index)` pairs in
    /// `scratch.reported`. `finished` flags are not checked.
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
            // A result naming a request cancelled during this step is about that request,
            // even if a new request has taken its id since.
            if inst.cancelled.contains(&res.request) {
                continue;
            }
            let pos = self.requests.pos_of(res.request)?;
            let r = self.requests.req(pos);
            if self.requests.ready(pos)
                || r.home != Some(inst_slot)
                || !inst.inflight.contains(&r.handle)
            {
                return Err(bad(format!("request {} is not in its batch", res.request)));
            }
            let masked = r.block_length - r.unmasked_in_block;
            if res.committed == 0 || res.committed > masked {
                return Err(bad(format!(
                    "request {} committed {} tokens; its block has {} masked (a step commits \
                     at least one)",
                    res.request, res.committed, masked
                )));
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

    /// Advances one request by a step run at `tau` that committed `committed` tokens.
    fn commit(&mut self, pos: u32, committed: u32, eos: bool, tau: f64) -> Commit {
        let (caching, exact) = (self.config.caching, self.config.exact_cache);
        self.requests.set_ready(pos, true);
        let r = self.requests.req_mut(pos);
        let was_full = r.needs_recompute();
        r.steps_done += 1;
        r.tau_sum += tau;
        r.block_steps += 1;
        r.unmasked += committed;
        r.unmasked_in_block += committed;
        let block_done = r.unmasked_in_block == r.block_length;
        if block_done {
            r.current_block += 1;
            r.unmasked_in_block = 0;
            r.block_steps = 0;
            if caching {
                // The exact cache's K/V outlives the block: the next one opens with a cache
                // step; the approximate cache recomputes.
                r.next_kind = if exact {
                    StepKind::Cache
                } else {
                    StepKind::Recompute
                };
            }
        } else if caching {
            r.next_kind = StepKind::Cache;
        }
        if eos || r.unmasked >= r.output_len {
            Commit::Finished
        } else {
            Commit::Continues {
                was_full,
                block_done,
            }
        }
    }

    /// After a step: queue a fresh prediction, or count the step off the last one.
    fn update_prediction(&mut self, pos: u32, was_full: bool) {
        if let Some(every) = self.config.policy.refresh_every() {
            if self.requests.req(pos).steps_done % every == 0 {
                self.scratch.pending.push(pos);
                return;
            }
        }
        self.requests.count_step_off(pos, was_full);
    }

    /// Runs the predictor once over every position in `scratch.pending`. If it fails or
    /// returns an invalid prediction, every pending request keeps its last predictions
    /// (valid numbers, not yet counted off by the latest step) and the error is returned.
    pub(crate) fn refresh_predictions(&mut self) -> Result<(), SchedError> {
        let scratch = &mut self.scratch;
        if scratch.pending.is_empty() {
            return Ok(());
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
        let predicted = self
            .predictor
            .predict_batch(&scratch.views, taus, &mut scratch.predicted)
            .and_then(|()| check_predictions(&scratch.views, taus, &scratch.predicted));
        if let Err(e) = predicted {
            scratch.pending.clear();
            return Err(e.into());
        }
        for (&pos, row) in scratch
            .pending
            .iter()
            .zip(scratch.predicted.chunks_exact(taus.len()))
        {
            requests.set_steps(pos, row);
        }
        scratch.pending.clear();
        Ok(())
    }
}

enum Commit {
    Finished,
    Continues { was_full: bool, block_done: bool },
}
