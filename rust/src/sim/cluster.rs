//! The event loop: arrivals, step completions and reconfiguration in simulated time, each
//! handed to the scheduler exactly as the live engine hands it worker reports.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::time::Instant;

use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::outcome::{RequestOutcome, SimResult, SimStats};
use super::progress::{Draws, ProgressModel};
use super::reconfig::Reconfig;
use super::{SimError, SimOptions, SimRequest};
use crate::id_map::IdMap;
use crate::profile::StepKind;
use crate::scheduler::{
    DegreeCosts, FinishedRequest, InstanceSpec, RequestSpec, SchedError, Scheduler, StepResult,
    ThresholdReason,
};

/// A simulated time as a heap key (times are finite: checked on input).
#[derive(Clone, Copy, Debug, PartialEq)]
struct Time(f64);

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Time {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

/// One request's part in a step in flight.
#[derive(Clone, Copy, Debug)]
struct Part {
    request: u64,
    tau: f64,
    unmasked_in_block: u32,
}

/// A simulated instance.
#[derive(Clone, Debug)]
pub(super) struct SimInstance {
    pub spec: InstanceSpec,
    /// The step it runs and that step's simulated duration.
    step: Vec<Part>,
    step_s: f64,
}

/// Tokens committed per request, their accuracy-weighted sum, and why its steps ran at
/// their thresholds.
#[derive(Clone, Copy, Debug)]
struct Tally {
    tokens: f64,
    accuracy_tokens: f64,
    /// Steps whose τ load control capped, and steps no τ could bring in on time.
    capped: u32,
    late: u32,
    min_cap: f64,
}

pub(super) struct Simulation<'a> {
    pub sched: &'a mut Scheduler,
    requests: &'a [SimRequest],
    /// Request indices by arrival time, and how many have arrived.
    order: Vec<u32>,
    arrived: usize,
    /// One per progress class, and the models they draw from.
    progress: Vec<Draws<'a>>,
    models: &'a [ProgressModel],
    seed: u64,
    quantum: f64,
    step_overhead_s: f64,
    rng: SmallRng,
    costs: IdMap<u32, DegreeCosts>,
    pub instances: IdMap<u64, SimInstance>,
    due: BinaryHeap<Reverse<(Time, u64)>>,
    tally: Vec<Tally>,
    outcomes: Vec<RequestOutcome>,
    pub stats: SimStats,
    reconfig: Option<Reconfig>,
    results: Vec<StepResult>,
}

impl<'a> Simulation<'a> {
    pub fn new(
        sched: &'a mut Scheduler,
        instances: &[InstanceSpec],
        requests: &'a [SimRequest],
        progress: &'a [ProgressModel],
        options: &SimOptions,
    ) -> Result<Self, SimError> {
        if progress.is_empty() {
            return Err(SimError::Progress("no progress model".into()));
        }
        if sched.active_requests() > 0 || !sched.instance_ids().is_empty() {
            return Err(SimError::Cluster(
                "the scheduler must be fresh: no instances, no requests".into(),
            ));
        }
        if sched.config().overlap {
            return Err(SimError::Cluster(
                "the simulator models the synchronous round trip (its engine costs \
                 `step_overhead_s` a step): set overlap off"
                    .into(),
            ));
        }
        if !(options.round_quantum_s.is_finite() && options.round_quantum_s >= 0.0) {
            return Err(SimError::Cluster(format!(
                "round quantum must be finite and non-negative, got {}",
                options.round_quantum_s
            )));
        }
        if !(options.step_overhead_s.is_finite() && options.step_overhead_s >= 0.0) {
            return Err(SimError::Cluster(format!(
                "step overhead must be finite and non-negative, got {}",
                options.step_overhead_s
            )));
        }
        if u32::try_from(requests.len()).is_err() {
            return Err(SimError::Workload("more than 2^32 requests".into()));
        }
        for (i, r) in requests.iter().enumerate() {
            if !(r.arrival.is_finite() && r.arrival >= 0.0) {
                return Err(SimError::Workload(format!(
                    "request {i}: arrival must be finite and non-negative, got {}",
                    r.arrival
                )));
            }
            if !(r.slo_s.is_finite() && r.slo_s > 0.0) {
                return Err(SimError::Workload(format!(
                    "request {i}: SLO must be positive and finite, got {}",
                    r.slo_s
                )));
            }
            if r.class as usize >= progress.len() {
                return Err(SimError::Workload(format!(
                    "request {i}: progress class {} of {} models",
                    r.class,
                    progress.len()
                )));
            }
        }
        let mut order: Vec<u32> = (0..requests.len() as u32).collect();
        order.sort_by(|&a, &b| {
            requests[a as usize]
                .arrival
                .total_cmp(&requests[b as usize].arrival)
        });
        let outcomes = requests
            .iter()
            .map(|r| RequestOutcome {
                arrival: r.arrival,
                deadline: r.arrival + r.slo_s,
                mean_tau: f64::NAN,
                min_tau: f64::NAN,
                min_cap_tau: f64::NAN,
                queue_s: f64::NAN,
                accuracy: f64::NAN,
                ..Default::default()
            })
            .collect();
        let reconfig = options
            .replan
            .as_ref()
            .map(|o| Reconfig::new(o.clone()))
            .transpose()?;
        // The thresholds steps can run at: the candidates, or a fixed policy's.
        let mut taus = sched.config().thresholds.clone();
        if let Some(tau) = sched.config().policy.fixed() {
            taus.push(tau);
        }
        let mut sim = Self {
            progress: progress.iter().map(|m| Draws::new(m, &taus)).collect(),
            models: progress,
            seed: options.seed,
            sched,
            requests,
            order,
            arrived: 0,
            quantum: options.round_quantum_s,
            step_overhead_s: options.step_overhead_s,
            rng: SmallRng::seed_from_u64(options.seed),
            costs: IdMap::default(),
            instances: IdMap::default(),
            due: BinaryHeap::new(),
            tally: vec![
                Tally {
                    tokens: 0.0,
                    accuracy_tokens: 0.0,
                    capped: 0,
                    late: 0,
                    min_cap: f64::NAN,
                };
                requests.len()
            ],
            outcomes,
            stats: SimStats::default(),
            reconfig,
            results: Vec::new(),
        };
        for spec in instances {
            sim.add_instance(spec.clone())?;
        }
        Ok(sim)
    }

    pub fn add_instance(&mut self, spec: InstanceSpec) -> Result<(), SimError> {
        if !self.costs.contains_key(&spec.tp) {
            let c = self.sched.config();
            let costs =
                DegreeCosts::new(self.sched.profile(), spec.tp, c.caching, c.max_batch_tokens)
                    .map_err(SchedError::from)?;
            self.costs.insert(spec.tp, costs);
        }
        self.sched.add_instance(spec.clone())?;
        self.instances.insert(
            spec.id,
            SimInstance {
                spec,
                step: Vec::new(),
                step_s: 0.0,
            },
        );
        Ok(())
    }

    /// The progress models requests draw from, by class.
    pub fn progress_models(&self) -> &'a [ProgressModel] {
        self.models
    }

    /// This run's options, without replanning.
    pub fn options(&self) -> SimOptions {
        SimOptions {
            seed: self.seed,
            round_quantum_s: self.quantum,
            step_overhead_s: self.step_overhead_s,
            replan: None,
        }
    }

    /// Replaces the reconfiguration (a rehearsal's scripted transition).
    pub fn set_reconfig(&mut self, reconfig: Option<Reconfig>) {
        self.reconfig = reconfig;
    }

    pub fn busy(&self, id: u64) -> bool {
        self.instances.get(&id).is_some_and(|i| !i.step.is_empty())
    }

    pub fn run(mut self) -> Result<SimResult, SimError> {
        let started = Instant::now();
        while let Some(first) = self.next_event() {
            let horizon = first + self.quantum;
            let mut now = first;
            loop {
                let arrival = self.next_arrival().unwrap_or(f64::INFINITY);
                let done = self.due.peek().map_or(f64::INFINITY, |Reverse((t, _))| t.0);
                if arrival.min(done) > horizon {
                    break;
                }
                if done <= arrival {
                    let Some(Reverse((t, id))) = self.due.pop() else {
                        break;
                    };
                    now = now.max(t.0);
                    self.complete(id, t.0)?;
                } else {
                    now = now.max(arrival);
                    self.arrive()?;
                }
            }
            if let Some(mut reconfig) = self.reconfig.take() {
                let result = reconfig.advance(&mut self, now);
                self.reconfig = Some(reconfig);
                result?;
            }
            self.round(now)?;
        }
        self.stats.wall_seconds = started.elapsed().as_secs_f64();
        Ok(SimResult {
            requests: self.outcomes,
            stats: self.stats,
        })
    }

    /// The time of the next event, or `None` once nothing can happen any more.
    fn next_event(&self) -> Option<f64> {
        let arrival = self.next_arrival().unwrap_or(f64::INFINITY);
        let done = self.due.peek().map_or(f64::INFINITY, |Reverse((t, _))| t.0);
        let mut next = arrival.min(done);
        if let Some(r) = &self.reconfig {
            // Replanning only matters while requests may still come or run.
            if next.is_finite() || self.sched.active_requests() > 0 {
                next = next.min(r.next_event());
            }
        }
        next.is_finite().then_some(next)
    }

    fn next_arrival(&self) -> Option<f64> {
        self.order
            .get(self.arrived)
            .map(|&i| self.requests[i as usize].arrival)
    }

    fn arrive(&mut self) -> Result<(), SimError> {
        let index = self.order[self.arrived];
        self.arrived += 1;
        let r = self.requests[index as usize];
        if let Some(reconfig) = &mut self.reconfig {
            reconfig.record(&r);
        }
        let spec = RequestSpec::new(
            u64::from(index),
            r.arrival,
            r.arrival + r.slo_s,
            r.prompt_len,
            r.output_len,
        );
        let started = Instant::now();
        let admitted = self.sched.arrive(spec);
        self.stats.sched_seconds += started.elapsed().as_secs_f64();
        match admitted {
            Ok(()) => Ok(()),
            // Turned away as the live server would (429 / 400), not a failed simulation.
            Err(
                SchedError::Admission { .. }
                | SchedError::Unmeetable { .. }
                | SchedError::Shed { .. }
                | SchedError::RequestTooLarge { .. }
                | SchedError::ExceedsKvCache { .. },
            ) => {
                self.outcomes[index as usize].rejected = true;
                Ok(())
            }
            Err(e) => Err(e.into()),
        }
    }

    /// Reports the step of instance `id` that ends at `now`.
    fn complete(&mut self, id: u64, now: f64) -> Result<(), SimError> {
        let Some(inst) = self.instances.get_mut(&id) else {
            return Ok(());
        };
        let block_length = self.sched.config().block_length;
        self.results.clear();
        for part in inst.step.drain(..) {
            let draws = &self.progress[self.requests[part.request as usize].class as usize];
            let committed = draws.sample(
                part.tau,
                part.unmasked_in_block,
                block_length,
                &mut self.rng,
            );
            let t = &mut self.tally[part.request as usize];
            let c = f64::from(committed);
            t.tokens += c;
            t.accuracy_tokens += draws.accuracy(part.tau) * c;
            self.results.push(StepResult::new(part.request, committed));
        }
        let step_s = inst.step_s;
        let started = Instant::now();
        let finished = self.sched.step_done(id, step_s, &self.results)?;
        let spent = started.elapsed().as_secs_f64();
        self.stats.sched_seconds += spent;
        self.stats.step_path_seconds += spent;
        for f in finished {
            record(&mut self.outcomes, &self.tally, f, now);
        }
        Ok(())
    }

    /// One scheduling round at `now`; every batch it emits starts running.
    fn round(&mut self, now: f64) -> Result<(), SimError> {
        let started = Instant::now();
        let (block_length, exact) = {
            let c = self.sched.config();
            (c.block_length, c.caching && c.exact_cache)
        };
        let decisions = self.sched.schedule(now)?;
        let spent = started.elapsed().as_secs_f64();
        self.stats.sched_seconds += spent;
        self.stats.step_path_seconds += spent;
        self.stats.rounds += 1;
        for batch in &decisions.batches {
            let inst = self
                .instances
                .get_mut(&batch.instance)
                .ok_or_else(|| SimError::Cluster(format!("unknown instance {}", batch.instance)))?;
            let (mut full, mut cache, mut context, mut cached) = (0, 0, 0.0, 0.0_f64);
            inst.step.clear();
            let degree = self.stats.by_degree.entry(inst.spec.tp).or_default();
            for e in decisions.entries_of(batch) {
                if e.kind == StepKind::Cache {
                    cache += e.tokens;
                    let r = &self.requests[e.request as usize];
                    context += if exact {
                        // The exact cache attends up to the end of the block only.
                        f64::from(r.prompt_len) + f64::from((e.block + 1) * block_length)
                    } else {
                        seq_tokens(r, block_length)
                    };
                    cached += 1.0;
                } else {
                    full += e.tokens;
                }
                let t = &mut self.tally[e.request as usize];
                t.capped += u32::from(e.why.reason == ThresholdReason::Capped);
                t.late += u32::from(e.why.reason == ThresholdReason::Late);
                t.min_cap = t.min_cap.min(e.why.cap_tau);
                inst.step.push(Part {
                    request: e.request,
                    tau: e.tau,
                    unmasked_in_block: e.unmasked_in_block,
                });
            }
            degree.steps += 1;
            degree.requests += inst.step.len() as u64;
            degree.tokens += full + cache;
            inst.step_s = self.costs[&inst.spec.tp].batch(full, cache, context / cached.max(1.0))
                + self.step_overhead_s;
            self.stats.steps += 1;
            self.stats.step_seconds += inst.step_s;
            degree.busy_seconds += inst.step_s;
            self.due
                .push(Reverse((Time(now + inst.step_s), batch.instance)));
        }
        self.stats.end_time = self.stats.end_time.max(now);
        Ok(())
    }
}

/// Tokens of a request's whole sequence: its prompt and its output padded to whole blocks.
fn seq_tokens(r: &SimRequest, block_length: u32) -> f64 {
    f64::from(r.prompt_len) + f64::from(r.output_len.div_ceil(block_length) * block_length)
}

fn record(outcomes: &mut [RequestOutcome], tally: &[Tally], f: &FinishedRequest, now: f64) {
    let o = &mut outcomes[f.id as usize];
    let t = tally[f.id as usize];
    o.finish = Some(now);
    o.steps = f.steps;
    o.recompute_steps = f.recompute_steps;
    o.migrations = f.migrations;
    o.instances = f.instances.len() as u32;
    o.queue_s = f.first_dispatch.map_or(f64::NAN, |d| d - f.arrival);
    if !f.taus.is_empty() {
        o.mean_tau = f.taus.iter().sum::<f64>() / f.taus.len() as f64;
        o.min_tau = f.taus.iter().copied().fold(f64::INFINITY, f64::min);
    }
    if t.tokens > 0.0 {
        o.accuracy = t.accuracy_tokens / t.tokens;
    }
    o.capped_steps = t.capped;
    o.late_steps = t.late;
    o.min_cap_tau = t.min_cap;
}
