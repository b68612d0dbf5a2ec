//! Trace-driven discrete-event simulator (DESIGN §10): the live engine's [`Scheduler`] and
//! planner run unchanged in simulated time; workers are replaced by the latency profile
//! (what a step costs) and a [`ProgressModel`] recorded from real decoding (what it
//! commits). Cluster-scale experiments thus run on one machine with every policy decision
//! made by the same code that serves.

mod cluster;
mod error;
mod outcome;
mod progress;
mod reconfig;

pub use error::SimError;
pub use outcome::{DegreeStats, RequestOutcome, SimResult, SimStats};
pub use progress::ProgressModel;
pub use reconfig::SimReplanOptions;

use crate::scheduler::{InstanceSpec, Scheduler};

/// One request of the workload.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimRequest {
    /// Simulated seconds.
    pub arrival: f64,
    pub prompt_len: u32,
    pub output_len: u32,
    /// Latency objective: the deadline is `arrival + slo_s`.
    pub slo_s: f64,
    /// Which of the progress models given to [`simulate`] its steps draw from: requests of
    /// different kinds (tasks) decode at different speeds on the same model.
    pub class: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct SimOptions {
    pub seed: u64,
    /// Events within this many simulated seconds of the first share one scheduling round;
    /// 0 runs a round at every distinct event time, as the live engine does.
    pub round_quantum_s: f64,
    /// Seconds every step costs besides the profiled worker execution: the engine's
    /// dispatch, transport and result handling around it (the live engine measures it).
    pub step_overhead_s: f64,
    /// Periodic replanning through the planner (DESIGN §7); `None` keeps the layout.
    pub replan: Option<SimReplanOptions>,
}

impl Default for SimOptions {
    fn default() -> Self {
        Self {
            seed: 0,
            round_quantum_s: 0.0,
            step_overhead_s: 0.0,
            replan: None,
        }
    }
}

/// Runs `requests` (any order) through `scheduler`, a fresh scheduler with no instances
/// or requests, on a cluster starting with `instances`; a request's steps commit what
/// `progress[request.class]` draws.
pub fn simulate(
    scheduler: &mut Scheduler,
    instances: &[InstanceSpec],
    requests: &[SimRequest],
    progress: &[ProgressModel],
    options: &SimOptions,
) -> Result<SimResult, SimError> {
    cluster::Simulation::new(scheduler, instances, requests, progress, options)?.run()
}

#[cfg(test)]
mod tests;
