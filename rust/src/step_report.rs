//! A worker's step report, packed as columns, applied in one call to the engine's token
//! state and to the scheduler: the step path of the engine handles no per-request object.
//! Per request, Python sees only events: a finished request, newly complete blocks.

use std::collections::BTreeMap;

use crate::scheduler::{FinishedRequest, SchedError, Scheduler, StepResult};
use crate::tokens::{Commit, TokenTable};

/// Confidence statistics per request in [`PackedReport::confidence`].
pub const CONFIDENCE_STATS: usize = 5;

/// A step report as columns: request `i` committed `counts[i]` positions of output block
/// `blocks[i]`, listed in `positions` / `tokens` after those of the requests before it.
#[derive(Clone, Copy, Debug)]
pub struct PackedReport<'a> {
    pub requests: &'a [u64],
    pub blocks: &'a [u32],
    pub counts: &'a [u32],
    pub positions: &'a [u32],
    pub tokens: &'a [u32],
    /// `CONFIDENCE_STATS` per request: min, q25, median, mean, q75 (see `StepResult`).
    pub confidence: &'a [f64],
    /// Steps of Dream's grid each request passed (1 outside Dream's schedule).
    pub timesteps: &'a [u32],
}

/// Commits at one τ in a report, for learning the served model's tokens per step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RateSample {
    pub tau: f64,
    pub steps: u32,
    pub tokens: u64,
}

/// A request that finished in the step: its statistics, its output cut before the stop
/// token, and how many of those positions hold a token.
#[derive(Clone, Debug)]
pub struct Finished {
    pub served: FinishedRequest,
    pub generated: Vec<u32>,
    pub completion_tokens: usize,
}

/// What a report changed that the front end must hear of.
#[derive(Clone, Debug, Default)]
pub struct ReportOutcome {
    pub finished: Vec<Finished>,
    /// Requests with newly complete blocks: all their complete ids (cut before a stop).
    pub updates: Vec<(u64, Vec<u32>)>,
    /// Threshold-rule commits per τ, ascending.
    pub rates: Vec<RateSample>,
}

impl PackedReport<'_> {
    fn check_shape(&self, instance: u64) -> Result<(), SchedError> {
        let n = self.requests.len();
        let bad = |reason: String| SchedError::BadStepReport { instance, reason };
        if self.blocks.len() != n
            || self.counts.len() != n
            || self.timesteps.len() != n
            || self.confidence.len() != n * CONFIDENCE_STATS
        {
            return Err(bad(format!(
                "columns differ in length: {n} requests, {} blocks, {} counts, {} timesteps, \
                 {} confidence values",
                self.blocks.len(),
                self.counts.len(),
                self.timesteps.len(),
                self.confidence.len()
            )));
        }
        let total: u64 = self.counts.iter().map(|&c| u64::from(c)).sum();
        if total != self.positions.len() as u64 || total != self.tokens.len() as u64 {
            return Err(bad(format!(
                "counts add up to {total}, but {} positions and {} tokens are given",
                self.positions.len(),
                self.tokens.len()
            )));
        }
        Ok(())
    }

    /// Request `i`'s commit, `offset` being where its positions start.
    fn commit(&self, i: usize, offset: usize) -> Commit<'_> {
        let n = self.counts[i] as usize;
        Commit {
            block: self.blocks[i],
            positions: &self.positions[offset..offset + n],
            tokens: &self.tokens[offset..offset + n],
            timesteps: self.timesteps[i],
        }
    }

    /// Where each request's positions start.
    fn offsets(&self) -> Vec<usize> {
        self.counts
            .iter()
            .scan(0, |next, &c| {
                let offset = *next;
                *next += c as usize;
                Some(offset)
            })
            .collect()
    }
}

/// Applies `report` of `instance`'s step (measured at `measured_s`) to `tokens` and to
/// `scheduler`, all or nothing. The scheduler says which rows apply: not those of requests
/// cancelled while the step ran.
pub fn apply_report(
    scheduler: &mut Scheduler,
    tokens: &mut TokenTable,
    instance: u64,
    measured_s: f64,
    report: &PackedReport<'_>,
) -> Result<ReportOutcome, SchedError> {
    report.check_shape(instance)?;
    let offsets = report.offsets();
    let mut results: Vec<StepResult> = (0..report.requests.len())
        .map(|i| {
            let stats = &report.confidence[i * CONFIDENCE_STATS..(i + 1) * CONFIDENCE_STATS];
            let mut result = StepResult::new(report.requests[i], report.counts[i]);
            result.confidence = Some(stats.try_into().expect("five statistics"));
            result
        })
        .collect();
    let mut outcome = ReportOutcome::default();
    let finished =
        scheduler.step_done_with(instance, measured_s, &mut results, |s, rows, results| {
            // Every row is checked, and its τ read, before any is applied.
            let mut taus = Vec::with_capacity(rows.len());
            for &i in rows {
                let id = report.requests[i];
                let bad = |reason: String| SchedError::BadStepReport { instance, reason };
                let state = tokens
                    .get(id)
                    .ok_or_else(|| bad(format!("request {id}: no token state is held for it")))?;
                state
                    .check(&report.commit(i, offsets[i]))
                    .map_err(|reason| bad(format!("request {id}: {reason}")))?;
                taus.push(
                    (!state.fixed_schedule())
                        .then(|| s.last_tau(id))
                        .transpose()?,
                );
            }
            let mut rates: BTreeMap<u64, RateSample> = BTreeMap::new();
            for (&i, tau) in rows.iter().zip(taus) {
                let id = report.requests[i];
                if let Some(tau) = tau {
                    let sample = rates.entry(tau.to_bits()).or_insert(RateSample {
                        tau,
                        steps: 0,
                        tokens: 0,
                    });
                    sample.steps += 1;
                    sample.tokens += u64::from(report.counts[i]);
                }
                let (done, complete) = tokens.apply(id, &report.commit(i, offsets[i]));
                results[i].finished = done;
                if let (false, Some(ids)) = (done, complete) {
                    outcome.updates.push((id, ids));
                }
            }
            outcome.rates = rates.into_values().collect();
            Ok(())
        })?;
    for served in finished {
        let state = tokens
            .remove(served.id)
            .expect("a finished request had token state");
        outcome.finished.push(Finished {
            served: served.clone(),
            generated: state.generated().to_vec(),
            completion_tokens: state.completion_tokens(),
        });
    }
    Ok(outcome)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::{LatencyProfile, StepKind};
    use crate::scheduler::{InstanceSpec, RequestSpec, SchedulerConfig};
    use crate::tokens::{TokenSpec, Tokens};

    fn profile() -> LatencyProfile {
        let points = vec![(32u64, 0.01), (4096, 0.05)];
        let tables: Vec<_> = StepKind::ALL
            .iter()
            .map(|&k| (1, k, points.clone()))
            .collect();
        LatencyProfile::from_tables(tables).unwrap()
    }

    const MASK: u32 = 99;
    const EOS: u32 = 7;

    fn setup(requests: &[u64]) -> (Scheduler, TokenTable) {
        let mut s = Scheduler::new(profile(), SchedulerConfig::default()).unwrap();
        s.add_instance(InstanceSpec::new(0, 1, vec![0], 0)).unwrap();
        let mut t = TokenTable::default();
        for &id in requests {
            arrive(&mut s, &mut t, id);
        }
        s.schedule(0.0).unwrap();
        (s, t)
    }

    fn arrive(s: &mut Scheduler, t: &mut TokenTable, id: u64) {
        let mut spec = RequestSpec::new(id, 0.0, 100.0, 8, 8);
        spec.block_length = Some(4);
        s.arrive(spec).unwrap();
        let tokens = TokenSpec {
            output_len: 8,
            block_length: 4,
            mask: MASK,
            stops: vec![EOS],
            fixed_schedule: false,
            lead: 0,
        };
        t.insert(id, Tokens::new(&tokens).unwrap());
    }

    fn report<'a>(
        requests: &'a [u64],
        counts: &'a [u32],
        positions: &'a [u32],
        tokens: &'a [u32],
        confidence: &'a [f64],
    ) -> PackedReport<'a> {
        PackedReport {
            requests,
            blocks: &[0, 0][..requests.len()],
            counts,
            positions,
            tokens,
            confidence,
            timesteps: &[1, 1][..requests.len()],
        }
    }

    #[test]
    fn one_call_applies_tokens_and_the_schedulers_step() {
        let (mut s, mut t) = setup(&[1, 2]);
        let conf = [0.5; 10];
        // Request 1 fills block 0; request 2 commits EOS first, so it finishes.
        let r = report(
            &[1, 2],
            &[4, 1],
            &[0, 1, 2, 3, 0],
            &[1, 2, 3, 4, EOS],
            &conf,
        );
        let out = apply_report(&mut s, &mut t, 0, 0.01, &r).unwrap();
        assert_eq!(out.updates, vec![(1, vec![1, 2, 3, 4])]);
        assert_eq!(out.finished.len(), 1);
        assert_eq!(out.finished[0].served.id, 2);
        assert_eq!(out.finished[0].generated, Vec::<u32>::new());
        assert_eq!(out.rates.len(), 1);
        assert_eq!((out.rates[0].steps, out.rates[0].tokens), (2, 5));
        assert!(t.get(1).is_some() && t.get(2).is_none());
        assert_eq!(s.request(1).unwrap().unmasked, 4);
    }

    #[test]
    fn a_row_of_a_request_cancelled_mid_step_never_reaches_a_new_request_with_its_id() {
        let (mut s, mut t) = setup(&[1, 2]);
        s.cancel(2).unwrap();
        t.remove(2);
        arrive(&mut s, &mut t, 2);
        let conf = [0.5; 10];
        let r = report(&[1, 2], &[1, 1], &[0, 0], &[5, 6], &conf);
        apply_report(&mut s, &mut t, 0, 0.01, &r).unwrap();
        assert_eq!(t.get(1).unwrap().steps_done, 1);
        assert_eq!(
            t.get(2).unwrap().output(),
            &[MASK; 8],
            "the new request 2 is untouched"
        );
    }

    #[test]
    fn a_bad_report_changes_nothing() {
        let (mut s, mut t) = setup(&[1, 2]);
        let conf = [0.5; 10];
        // Request 2's position is outside its block: request 1's commit must not apply.
        let r = report(&[1, 2], &[1, 1], &[0, 6], &[1, 2], &conf);
        assert!(apply_report(&mut s, &mut t, 0, 0.01, &r).is_err());
        assert_eq!(t.get(1).unwrap().steps_done, 0);
        // A report missing a request of the batch is refused by the scheduler's check.
        let r = report(&[1], &[1], &[0], &[1], &conf[..5]);
        assert!(apply_report(&mut s, &mut t, 0, 0.01, &r).is_err());
        assert_eq!(t.get(1).unwrap().steps_done, 0);
        let r = report(&[1, 2], &[1, 1], &[0], &[1], &conf);
        assert!(apply_report(&mut s, &mut t, 0, 0.01, &r).is_err());
    }
}
