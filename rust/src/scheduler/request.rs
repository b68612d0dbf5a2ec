//! One request: what the front end announces, and the state the scheduler keeps for it.

use std::cmp::Ordering;

use super::config::{LoadOrder, SchedulerConfig};
use super::decisions::MigrationReason;
use super::error::SchedError;
use super::predictor::RequestView;
use crate::profile::StepKind;

/// A new request as the front end hands it to the scheduler.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestSpec {
    pub id: u64,
    /// Seconds, on the same clock as `schedule(now)`.
    pub arrival: f64,
    /// Absolute time by which the request should finish.
    pub deadline: f64,
    /// Higher runs first under [`LoadOrder::Priority`].
    pub priority: i32,
    pub prompt_len: u32,
    /// Requested output positions; rounded up to whole blocks.
    pub output_len: u32,
    /// Block size `B`; `None` uses the scheduler's.
    pub block_length: Option<u32>,
    /// Thresholds this request accepts (a subset of the candidates); `None` allows all.
    pub thresholds: Option<Vec<f64>>,
    /// Every step runs at exactly this threshold, a candidate or not (excludes
    /// `thresholds`). The scheduler plans it with the nearest candidate's predictions.
    pub pinned_tau: Option<f64>,
    /// The caller asked for this deadline. A request whose deadline is only the server's
    /// default is never refused for a predicted miss: admission serves it best-effort.
    pub explicit_deadline: bool,
    /// Leading output positions that arrive unmasked: a block diffusion model's first
    /// block may begin inside the prompt (blocks of absolute positions), and those are
    /// the prompt's tail. Counted in `output_len`.
    pub lead: u32,
}

impl RequestSpec {
    /// A request with default priority, block size and threshold set.
    pub fn new(id: u64, arrival: f64, deadline: f64, prompt_len: u32, output_len: u32) -> Self {
        Self {
            id,
            arrival,
            deadline,
            priority: 0,
            prompt_len,
            output_len,
            block_length: None,
            thresholds: None,
            pinned_tau: None,
            explicit_deadline: true,
            lead: 0,
        }
    }
}

/// Bit of [`Request::seq`] marking a best-effort request: it sorts after every other.
pub(crate) const BEST_EFFORT: u64 = 1 << 63;

/// Live state of one request; `home` is an instance slot.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Request {
    pub id: u64,
    /// Stable index of this request while it lives (its position moves).
    pub handle: u32,
    pub seq: u64,
    pub arrival: f64,
    pub deadline: f64,
    pub priority: i32,
    pub prompt_len: u32,
    pub output_len: u32,
    pub block_length: u32,
    pub steps_done: u32,
    /// Sum of the thresholds of the steps run so far.
    pub tau_sum: f64,
    /// Steps run in the current block (0: the next step opens it).
    pub block_steps: u32,
    pub unmasked: u32,
    pub unmasked_in_block: u32,
    pub current_block: u32,
    pub next_kind: StepKind,
    /// Instance slot holding this request's state (and its KV cache, if any).
    pub home: Option<u32>,
    /// Instance this request was displaced from (removed, or its step there aborted) and
    /// why, until it is dispatched.
    pub displaced_from: Option<(u64, MigrationReason)>,
    /// Instance id of the last dispatch (`None` before the first), kept here so that a
    /// dispatch to the same instance does not touch the request's history.
    pub last_instance: Option<u64>,
    /// Threshold every step of this request runs at ([`RequestSpec::pinned_tau`]).
    pub pinned: Option<f64>,
    /// *(ours)* With overlap: the threshold of this request's second step, queued behind
    /// the one in flight (none when no step is ahead).
    pub ahead_tau: Option<f64>,
    pub alive: bool,
    /// *(ours)* Served with block diffusion's exact cache
    /// ([`super::SchedulerConfig::exact_cache`]): a recompute step rebuilds the prefix
    /// only up to the end of the current block.
    pub exact: bool,
    /// *(ours)* Prefix sharing: `(instance id, tokens)` — the leading prompt tokens whose
    /// exact K/V that instance is expected to hold already, so that the request's first
    /// step there feeds only what follows them
    /// ([`super::Scheduler::expect_prefix`]).
    pub cached_prefix: Option<(u64, u32)>,
}

impl Request {
    /// Tokens a full-sequence step of this request processes.
    pub fn seq_tokens(&self) -> u64 {
        u64::from(self.prompt_len) + u64::from(self.output_len)
    }

    /// Tokens a full step of a later block feeds (its load): the whole sequence, or under
    /// the exact cache the block just finished and the new one.
    pub fn full_step_tokens(&self) -> u64 {
        if self.exact {
            2 * u64::from(self.block_length)
        } else {
            self.seq_tokens()
        }
    }

    /// Tokens the next step of this request adds to a batch.
    pub fn step_tokens(&self) -> u64 {
        match self.next_kind {
            StepKind::Cache if self.opens_exact_block() => self.full_step_tokens(),
            StepKind::Cache => u64::from(self.block_length),
            StepKind::Recompute => self.move_tokens() - self.cached_on(self.last_instance),
            StepKind::NoCache => self.seq_tokens(),
        }
    }

    /// *(ours)* Prompt tokens the first step would not feed on instance `instance` (its
    /// stored prefix, [`Request::cached_prefix`]); 0 elsewhere or after the first step.
    pub fn cached_on(&self, instance: Option<u64>) -> u64 {
        match (self.cached_prefix, instance) {
            (Some((id, tokens)), Some(at)) if id == at && self.steps_done == 0 => u64::from(tokens),
            _ => 0,
        }
    }

    /// *(ours)* Under the exact cache, whether the next step opens a block after the
    /// first: a cache step at home (it feeds the finished block and the new one), or, on
    /// another instance, a recompute of the prefix up to the new block's end
    /// ([`Request::move_tokens`]) — where a costed migration may pay.
    pub fn opens_exact_block(&self) -> bool {
        self.exact && self.next_kind == StepKind::Cache && self.block_steps == 0
    }

    /// Tokens the next step feeds on an instance that does not hold this request's cache:
    /// under the exact cache the prefix up to the current block's end, else the sequence.
    pub fn move_tokens(&self) -> u64 {
        if self.exact {
            self.prefix_tokens()
        } else {
            self.seq_tokens()
        }
    }

    /// Positions up to the end of the current block: what a step of block diffusion's
    /// exact cache attends to (later blocks are invisible to it).
    pub fn prefix_tokens(&self) -> u64 {
        let end = (self.current_block + 1).min(self.output_len / self.block_length);
        u64::from(self.prompt_len) + u64::from(end * self.block_length)
    }

    /// *(ours)* Tokens this request is expected to feed the step after the one in flight:
    /// with caching most steps are cache steps over the block.
    pub fn next_step_estimate(&self, caching: bool) -> u64 {
        if caching {
            u64::from(self.block_length)
        } else {
            self.seq_tokens()
        }
    }

    /// *(ours)* Whether the step in flight likely completes the current block: its masked
    /// rest is no more than the tokens a step of this block has committed on average (of
    /// the request's steps so far before the block's second step; one before its first).
    /// Such a request's next step likely recomputes, where it may migrate, so overlap
    /// leaves it to be decided after the report unless the policy never migrates.
    pub fn likely_ends_block(&self) -> bool {
        let masked = self.block_length - self.unmasked_in_block;
        let per_step = match (self.block_steps, self.steps_done) {
            (0, 0) => 1,
            (0, steps) => self.unmasked.div_ceil(steps),
            (steps, _) => self.unmasked_in_block.div_ceil(steps),
        };
        masked <= per_step
    }

    /// Whether the next step is the full step of its block (or replaces a lost cache):
    /// under the exact cache, the two-block step opening a block after the first.
    pub fn needs_recompute(&self) -> bool {
        match self.next_kind {
            StepKind::Recompute => true,
            StepKind::Cache => self.opens_exact_block(),
            StepKind::NoCache => self.unmasked_in_block == 0,
        }
    }

    pub fn view(&self, confidence: Option<[f64; 5]>) -> RequestView {
        RequestView {
            id: self.id,
            prompt_len: self.prompt_len,
            output_len: self.output_len,
            block_length: self.block_length,
            steps_done: self.steps_done,
            mean_tau_done: (self.steps_done > 0).then(|| self.tau_sum / f64::from(self.steps_done)),
            block_steps: self.block_steps,
            unmasked: self.unmasked,
            unmasked_in_block: self.unmasked_in_block,
            current_block: self.current_block,
            needs_recompute: self.needs_recompute(),
            confidence,
        }
    }

    /// Validates `spec` against `config`; returns the initial state and threshold mask.
    /// `seq` breaks ties between equal arrival times.
    pub fn from_spec(
        spec: &RequestSpec,
        config: &SchedulerConfig,
        seq: u64,
    ) -> Result<(Request, u32), SchedError> {
        let id = spec.id;
        let invalid = |reason: String| SchedError::InvalidRequest { id, reason };
        if !spec.arrival.is_finite() || !spec.deadline.is_finite() {
            return Err(invalid(format!(
                "arrival and deadline must be finite, got {} and {}",
                spec.arrival, spec.deadline
            )));
        }
        if spec.deadline < spec.arrival {
            return Err(invalid(format!(
                "deadline {} is before arrival {}",
                spec.deadline, spec.arrival
            )));
        }
        if spec.output_len == 0 {
            return Err(invalid("output length must be at least 1".into()));
        }
        let block_length = spec.block_length.unwrap_or(config.block_length);
        if block_length == 0 {
            return Err(invalid("block size must be at least 1".into()));
        }
        if spec.lead >= block_length.min(spec.output_len) {
            return Err(invalid(format!(
                "a lead of {} positions does not fit in a first block of {block_length}",
                spec.lead
            )));
        }
        let blocks = spec.output_len.div_ceil(block_length);
        let output_len = blocks
            .checked_mul(block_length)
            .ok_or_else(|| invalid(format!("output length {} overflows", spec.output_len)))?;
        let allowed = match (&spec.thresholds, spec.pinned_tau) {
            (None, None) => u32::MAX >> (32 - config.thresholds.len()),
            (Some(taus), None) => allowed_mask(id, taus, &config.thresholds)?,
            (None, Some(tau)) if tau > 0.0 && tau <= 1.0 => 1 << nearest(tau, &config.thresholds),
            (None, Some(tau)) => {
                return Err(invalid(format!(
                    "a pinned threshold must be in (0, 1], got {tau}"
                )))
            }
            (Some(_), Some(_)) => {
                return Err(invalid(
                    "a pinned threshold excludes a set of allowed thresholds".into(),
                ))
            }
        };
        let next_kind = if config.caching {
            StepKind::Recompute
        } else {
            StepKind::NoCache
        };
        let request = Request {
            id,
            handle: 0,
            seq,
            arrival: spec.arrival,
            deadline: spec.deadline,
            priority: spec.priority,
            prompt_len: spec.prompt_len,
            output_len,
            block_length,
            steps_done: 0,
            tau_sum: 0.0,
            block_steps: 0,
            unmasked: spec.lead,
            unmasked_in_block: spec.lead,
            current_block: 0,
            next_kind,
            home: None,
            displaced_from: None,
            last_instance: None,
            pinned: spec.pinned_tau,
            ahead_tau: None,
            alive: true,
            exact: config.caching && config.exact_cache,
            cached_prefix: None,
        };
        let tokens = request.seq_tokens();
        if tokens > config.max_batch_tokens {
            return Err(SchedError::RequestTooLarge {
                id,
                tokens,
                max: config.max_batch_tokens,
            });
        }
        Ok((request, allowed))
    }

    pub fn key_cmp(&self, other: &Request, order: LoadOrder) -> Ordering {
        let by_priority = match order {
            LoadOrder::Priority => other.priority.cmp(&self.priority),
            LoadOrder::Arrival => Ordering::Equal,
        };
        by_priority
            .then(self.arrival.total_cmp(&other.arrival))
            .then(self.seq.cmp(&other.seq))
    }
}

/// Index of the candidate nearest `tau` (the lower of two equally near).
fn nearest(tau: f64, candidates: &[f64]) -> usize {
    (0..candidates.len())
        .min_by(|&a, &b| {
            (candidates[a] - tau)
                .abs()
                .total_cmp(&(candidates[b] - tau).abs())
        })
        .unwrap_or(0)
}

/// Bitmask of `taus` over `candidates`; every tau must be a candidate.
fn allowed_mask(id: u64, taus: &[f64], candidates: &[f64]) -> Result<u32, SchedError> {
    let mut mask = 0u32;
    for &tau in taus {
        let k = candidates.iter().position(|&c| c == tau).ok_or_else(|| {
            SchedError::UnknownThreshold {
                id,
                tau,
                candidates: candidates.to_vec(),
            }
        })?;
        mask |= 1 << k;
    }
    if mask == 0 {
        return Err(SchedError::EmptyThresholdSet { id });
    }
    Ok(mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SchedulerConfig {
        SchedulerConfig::default().validated().unwrap()
    }

    fn exact_config() -> SchedulerConfig {
        SchedulerConfig {
            exact_cache: true,
            ..config()
        }
    }

    #[test]
    fn pads_output_and_maps_thresholds() {
        let mut spec = RequestSpec::new(1, 0.0, 10.0, 7, 33);
        spec.thresholds = Some(vec![0.9, 0.6]);
        let (r, allowed) = Request::from_spec(&spec, &config(), 0).unwrap();
        assert_eq!(r.output_len, 64);
        assert_eq!(allowed, 0b10010);
        assert_eq!(r.next_kind, StepKind::Recompute);
        assert_eq!(r.step_tokens(), 71);
        spec.thresholds = None;
        spec.pinned_tau = Some(0.73);
        let (r, allowed) = Request::from_spec(&spec, &config(), 0).unwrap();
        assert_eq!((r.pinned, allowed), (Some(0.73), 0b00100), "planned as 0.7");
    }

    #[test]
    fn under_the_exact_cache_a_blocks_full_step_loads_two_blocks_not_the_sequence() {
        let spec = RequestSpec::new(1, 0.0, 10.0, 7, 64);
        let (r, _) = Request::from_spec(&spec, &config(), 0).unwrap();
        assert_eq!(r.full_step_tokens(), 71);
        let exact = exact_config();
        let (r, _) = Request::from_spec(&spec, &exact, 0).unwrap();
        assert_eq!(r.full_step_tokens(), 64, "two blocks of 32");
    }

    #[test]
    fn under_the_exact_cache_a_prefill_feeds_its_prefix_and_a_block_opening_is_full() {
        let exact = exact_config();
        let spec = RequestSpec::new(1, 0.0, 10.0, 1000, 64);
        let (mut r, _) = Request::from_spec(&spec, &exact, 0).unwrap();
        // The first step feeds the prompt and the first block.
        assert_eq!(r.step_tokens(), 1032);
        r.next_kind = StepKind::Cache;
        r.current_block = 1;
        assert!(r.opens_exact_block() && r.needs_recompute());
        assert_eq!((r.step_tokens(), r.move_tokens()), (64, 1064));
        r.block_steps = 1;
        assert!(!r.needs_recompute() && r.step_tokens() == 32);
    }

    #[test]
    fn a_stored_prefix_shortens_the_first_step_only_on_the_instance_holding_it() {
        let exact = exact_config();
        let spec = RequestSpec::new(1, 0.0, 10.0, 1000, 64);
        let (mut r, _) = Request::from_spec(&spec, &exact, 0).unwrap();
        r.cached_prefix = Some((7, 960));
        assert_eq!(r.cached_on(Some(7)), 960);
        assert_eq!((r.cached_on(Some(3)), r.cached_on(None)), (0, 0));
        r.last_instance = Some(7);
        assert_eq!(r.step_tokens(), 1032 - 960);
        r.last_instance = Some(3);
        assert_eq!(r.step_tokens(), 1032);
        r.last_instance = Some(7);
        r.steps_done = 1; // a later recompute there rebuilds it all
        assert_eq!(r.step_tokens(), 1032);
    }

    #[test]
    fn rejects_bad_specs() {
        let cfg = config();
        let base = RequestSpec::new(1, 0.0, 10.0, 7, 33);
        let cases = [
            RequestSpec {
                deadline: -1.0,
                ..base.clone()
            },
            RequestSpec {
                arrival: f64::NAN,
                ..base.clone()
            },
            RequestSpec {
                output_len: 0,
                ..base.clone()
            },
            RequestSpec {
                block_length: Some(0),
                ..base.clone()
            },
            RequestSpec {
                prompt_len: 9000,
                ..base.clone()
            },
        ];
        for spec in cases {
            assert!(Request::from_spec(&spec, &cfg, 0).is_err(), "{spec:?}");
        }
        let empty = RequestSpec {
            thresholds: Some(vec![]),
            ..base.clone()
        };
        assert!(matches!(
            Request::from_spec(&empty, &cfg, 0),
            Err(SchedError::EmptyThresholdSet { id: 1 })
        ));
        for bad in [0.0, 1.5, f64::NAN] {
            let pinned = RequestSpec {
                pinned_tau: Some(bad),
                ..base.clone()
            };
            assert!(Request::from_spec(&pinned, &cfg, 0).is_err(), "{bad}");
        }
        let both = RequestSpec {
            pinned_tau: Some(0.9),
            thresholds: Some(vec![0.9]),
            ..base.clone()
        };
        assert!(Request::from_spec(&both, &cfg, 0).is_err());
        let odd = RequestSpec {
            thresholds: Some(vec![0.55]),
            ..base
        };
        assert!(matches!(
            Request::from_spec(&odd, &cfg, 0),
            Err(SchedError::UnknownThreshold { .. })
        ));
    }
}
