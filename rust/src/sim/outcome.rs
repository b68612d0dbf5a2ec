//! What a simulation returns: one record per request, in the shape the live benchmark
//! reports, and counters of the run itself.

use std::collections::BTreeMap;

/// How one request fared.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct RequestOutcome {
    pub arrival: f64,
    pub deadline: f64,
    /// Simulated time it finished; `None` when rejected at admission or never finished.
    pub finish: Option<f64>,
    /// Turned away at arrival: over the admission bound, or a request no instance can run
    /// (longer than a step's batch budget).
    pub rejected: bool,
    pub steps: u32,
    pub recompute_steps: u32,
    /// Mean and minimum threshold over its steps (NaN before its first step).
    pub mean_tau: f64,
    pub min_tau: f64,
    pub migrations: u32,
    /// Instances it ran on, consecutive repeats collapsed.
    pub instances: u32,
    /// Seconds from arrival to its first dispatch.
    pub queue_s: f64,
    /// Probability its answer is right: the progress model's accuracy at its threshold
    /// weighted by the tokens each step committed.
    pub accuracy: f64,
    /// Why its steps ran at their thresholds: steps whose τ load control capped, steps no
    /// allowed τ could finish in time, and the lowest cap load control gave it (NaN: none).
    pub capped_steps: u32,
    pub late_steps: u32,
    pub min_cap_tau: f64,
}

impl RequestOutcome {
    pub fn latency(&self) -> Option<f64> {
        self.finish.map(|f| f - self.arrival)
    }

    pub fn slo_met(&self) -> bool {
        self.finish.is_some_and(|f| f <= self.deadline)
    }
}

/// What the instances of one TP degree ran: the batches the scheduler actually formed there.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DegreeStats {
    pub steps: u64,
    /// Simulated seconds of those steps, summed over instances.
    pub busy_seconds: f64,
    /// Requests and batch tokens of those steps, summed.
    pub requests: u64,
    pub tokens: u64,
}

/// Counters of one run.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimStats {
    /// Scheduling rounds run.
    pub rounds: u64,
    /// Instance steps simulated.
    pub steps: u64,
    /// Simulated seconds those steps took, summed over instances.
    pub step_seconds: f64,
    /// Wall seconds spent inside the scheduler (arrivals, step reports, rounds).
    pub sched_seconds: f64,
    /// Of which in reports of finished steps and the rounds they trigger.
    pub step_path_seconds: f64,
    /// Simulated time of the last event.
    pub end_time: f64,
    /// Planner runs, adopted plans, instance launches and stops.
    pub replans: u32,
    pub plans_adopted: u32,
    /// Plans the planner would adopt that their rehearsal turned down.
    pub plans_rehearsed_out: u32,
    pub launches: u32,
    pub stops: u32,
    /// Wall seconds the planner took, summed, and the rehearsals of its plans.
    pub plan_seconds: f64,
    pub rehearsal_seconds: f64,
    /// Wall seconds of the whole run.
    pub wall_seconds: f64,
    /// Per TP degree.
    pub by_degree: BTreeMap<u32, DegreeStats>,
}

impl SimStats {
    /// Scheduler wall time between a step's end and its instance's next dispatch, as a
    /// share of the mean simulated step: the delay scheduling adds to every step.
    pub fn sched_share_of_step_time(&self) -> f64 {
        if self.steps == 0 {
            return 0.0;
        }
        (self.step_path_seconds / self.rounds.max(1) as f64)
            / (self.step_seconds / self.steps as f64)
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimResult {
    /// In the order the requests were given.
    pub requests: Vec<RequestOutcome>,
    pub stats: SimStats,
}
