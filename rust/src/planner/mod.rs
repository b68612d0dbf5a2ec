//! Cluster reconfiguration (DESIGN §7): Stage 1 decides how many instances of each TP
//! degree to run, at which batch size and threshold mix; Stage 2 decides which running
//! instances to keep and how to launch the rest. `plan` runs both, evaluates the running
//! deployment under the same load, and adopts the new plan only if it is clearly better.

mod capacity;
pub mod classes;
pub mod error;
pub mod inputs;
pub mod replanner;
pub mod sequence;
pub mod slo;
pub mod solver;
mod stage1;
mod stage2;
mod transition;

use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use self::classes::{classes_from_arrivals, Arrival, BinSpec};
pub use self::error::PlannerError;
pub use self::inputs::{
    Deployment, Instance, PlannerConfig, PlannerInputs, RequestClass, SolverKind, ThresholdOption,
};
pub use self::replanner::{ReplanInputs, ReplanOptions, Replanner, RunningInstance, SloTarget};
pub use self::sequence::Action;
pub use self::slo::mean_isolated_latency;
pub use self::solver::{solver_available, SolveStatus};
pub use self::stage1::{CapacityPlan, ClassPlan, DegreePlan, PlanValue};
pub use self::stage2::TransitionPlan;
pub use self::transition::{plan_transition_to, TransitionInputs};

use self::capacity::node_types;
use self::solver::SolveSettings;
use self::stage1::{fixed_from, Stage1, Warm};
use crate::profile::LatencyProfile;

/// Relative gain of each objective of a new plan over the running deployment.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Gains {
    pub sustained_load: f64,
    pub quality: f64,
    pub latency_slack: f64,
}

/// Result of one planning call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// The new capacity plan (adopted or not).
    pub capacity: CapacityPlan,
    /// The running deployment's objective values under the same load, if one runs.
    pub current_value: Option<PlanValue>,
    pub gains: Option<Gains>,
    pub adopted: bool,
    pub reason: String,
    /// How to get there; `None` when the running deployment stays.
    pub transition: Option<TransitionPlan>,
    /// Instances per node and degree (order of `capacity.degrees`) after this plan.
    pub instances_per_node: Vec<Vec<u32>>,
    pub stage1_seconds: f64,
    pub stage2_seconds: f64,
}

pub(crate) fn settings(config: &PlannerConfig) -> Result<SolveSettings, PlannerError> {
    if !solver_available(config.solver) {
        return Err(PlannerError::SolverUnavailable(config.solver.as_str()));
    }
    Ok(SolveSettings {
        solver: config.solver,
        deadline: Instant::now() + std::time::Duration::from_secs_f64(config.time_limit_seconds),
        mip_gap: config.mip_gap,
    })
}

fn relative_gain(new: f64, old: f64) -> f64 {
    (new - old) / old.abs().max(1e-9)
}

/// The adoption rule: a new plan replaces the running one only if some objective (served
/// load, quality and, if `for_slack`, latency slack, in that order) improves by at least
/// `min_improvement`.
fn adoption(
    current: Option<PlanValue>,
    new: PlanValue,
    min_improvement: f64,
    for_slack: bool,
) -> (bool, Option<Gains>, String) {
    let Some(old) = current else {
        return (true, None, "no deployment is running".into());
    };
    let gains = Gains {
        sustained_load: relative_gain(new.sustained_load, old.sustained_load),
        quality: relative_gain(new.quality, old.quality),
        latency_slack: relative_gain(new.latency_slack, old.latency_slack),
    };
    let named = [
        ("served load", gains.sustained_load),
        ("quality", gains.quality),
        ("latency slack", gains.latency_slack),
    ];
    let counted = if for_slack { 3 } else { 2 };
    let pct = |g: f64| 100.0 * g;
    match named[..counted].iter().find(|(_, g)| *g >= min_improvement) {
        Some((name, g)) => (
            true,
            Some(gains),
            format!("{name} improves by {:.1} %", pct(*g)),
        ),
        None => (
            false,
            Some(gains),
            format!(
                "no objective improves by {:.1} % (served load {:+.1} %, quality {:+.1} %, \
                 latency slack {:+.1} %{}): keeping the running deployment",
                pct(min_improvement),
                pct(gains.sustained_load),
                pct(gains.quality),
                pct(gains.latency_slack),
                if for_slack || gains.latency_slack < min_improvement {
                    ""
                } else {
                    ", which alone adopts nothing"
                }
            ),
        ),
    }
}

fn per_node(node_gpus: &[u32], degrees: &[u32], instances: &[Instance]) -> Vec<Vec<u32>> {
    let mut counts = vec![vec![0u32; degrees.len()]; node_gpus.len()];
    for inst in instances {
        if let Some(d) = degrees.iter().position(|&x| x == inst.degree) {
            counts[inst.node][d] += 1;
        }
    }
    counts
}

/// Stage 1 alone: the capacity plan for `inputs` (the running deployment, if given, only
/// warm-starts the solve).
pub fn plan_capacity(
    inputs: &PlannerInputs,
    profile: &LatencyProfile,
) -> Result<CapacityPlan, PlannerError> {
    let problem = inputs::validate(inputs, profile)?;
    let types = node_types(&problem.node_gpus, &problem.degrees)?;
    let stage1 = Stage1::new(&problem, &types, settings(&inputs.config)?);
    let solved = stage1.solve(None, &Warm::default())?;
    stage1.extract(&solved)
}

/// Both stages and the adoption rule.
pub fn plan(inputs: &PlannerInputs, profile: &LatencyProfile) -> Result<Plan, PlannerError> {
    let started = Instant::now();
    let problem = inputs::validate(inputs, profile)?;
    let types = node_types(&problem.node_gpus, &problem.degrees)?;
    let settings = settings(&inputs.config)?;
    let stage1 = Stage1::new(&problem, &types, settings);
    let empty = Deployment::default();
    let current = inputs.current.as_ref().unwrap_or(&empty);
    let (current_value, warm) = if current.instances.is_empty() {
        (None, Warm::default())
    } else {
        let fixed = fixed_from(&problem, current);
        let solved = stage1.solve(Some(&fixed), &Warm::default())?;
        (Some(stage1.value(&solved)), stage1.warm_from(&solved))
    };
    let solved = stage1.solve(None, &warm)?;
    let capacity = stage1.extract(&solved)?;
    let stage1_seconds = started.elapsed().as_secs_f64();
    let (adopted, gains, reason) = adoption(
        current_value,
        capacity.value,
        inputs.config.min_improvement,
        inputs.config.adopt_for_latency_slack,
    );
    let transition = if adopted {
        let targets: Vec<u32> = capacity.degrees.iter().map(|d| d.instances).collect();
        Some(stage2::plan_transition(
            &problem.node_gpus,
            &problem.degrees,
            &targets,
            current,
            &capacity.instances_per_node,
            &settings,
        )?)
    } else {
        None
    };
    let after = transition
        .as_ref()
        .map_or(&current.instances, |t| &t.instances);
    Ok(Plan {
        instances_per_node: per_node(&problem.node_gpus, &problem.degrees, after),
        capacity,
        current_value,
        gains,
        adopted,
        reason,
        transition,
        stage1_seconds,
        stage2_seconds: started.elapsed().as_secs_f64() - stage1_seconds,
    })
}
#[cfg(test)]
mod tests;
