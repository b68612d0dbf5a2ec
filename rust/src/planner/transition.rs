//! Stage 2 alone: move the running deployment to instance counts chosen by the caller (an
//! operator's layout, or the engine asked to scale), keeping as many running instances as
//! possible and ordering launches and stops exactly as after a Stage-1 plan.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::error::PlannerError;
use super::inputs::{validate_degrees, validate_nodes, validate_placement, Deployment};
use super::stage2::{plan_transition, TransitionPlan};
use super::{settings, PlannerConfig, SolverKind};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransitionInputs {
    pub node_gpus: Vec<u32>,
    /// Instances wanted per TP degree; running instances of other degrees stop.
    pub targets: BTreeMap<u32, u32>,
    #[serde(default)]
    pub current: Deployment,
    #[serde(default = "default_solver")]
    pub solver: SolverKind,
    #[serde(default = "default_time_limit")]
    pub time_limit_seconds: f64,
}

fn default_solver() -> SolverKind {
    SolverKind::Highs
}

fn default_time_limit() -> f64 {
    10.0
}

/// Plans the transition from `inputs.current` to `inputs.targets`.
pub fn plan_transition_to(inputs: &TransitionInputs) -> Result<TransitionPlan, PlannerError> {
    validate_nodes(&inputs.node_gpus)?;
    validate_placement(&inputs.current, &inputs.node_gpus)?;
    let wanted: Vec<u32> = inputs.targets.keys().copied().collect();
    let degrees = validate_degrees(&wanted, &inputs.node_gpus)?;
    let targets: Vec<u32> = degrees.iter().map(|d| inputs.targets[d]).collect();
    let witness = first_fit(&inputs.node_gpus, &degrees, &targets).ok_or_else(|| {
        PlannerError::TargetsDoNotFit {
            targets: inputs.targets.iter().map(|(&d, &n)| (d, n)).collect(),
            node_gpus: inputs.node_gpus.clone(),
        }
    })?;
    let mut config = PlannerConfig::new(1.0, degrees.clone(), vec![1]);
    config.solver = inputs.solver;
    config.time_limit_seconds = inputs.time_limit_seconds;
    let settings = settings(&config)?;
    plan_transition(
        &inputs.node_gpus,
        &degrees,
        &targets,
        &inputs.current,
        &witness,
        &settings,
    )
}

/// A placement of the targets, largest degree first, each on the first node with room:
/// the warm start of Stage 2 and the proof that the targets fit.
fn first_fit(node_gpus: &[u32], degrees: &[u32], targets: &[u32]) -> Option<Vec<Vec<u32>>> {
    let mut free = node_gpus.to_vec();
    let mut placed = vec![vec![0u32; degrees.len()]; node_gpus.len()];
    for d in (0..degrees.len()).rev() {
        for _ in 0..targets[d] {
            let node = free.iter().position(|&f| f >= degrees[d])?;
            free[node] -= degrees[d];
            placed[node][d] += 1;
        }
    }
    Some(placed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::inputs::Instance;
    use crate::planner::Action;

    fn inst(node: usize, gpus: &[u32]) -> Instance {
        Instance {
            node,
            degree: gpus.len() as u32,
            gpus: gpus.to_vec(),
        }
    }

    fn inputs(targets: &[(u32, u32)], current: Vec<Instance>) -> TransitionInputs {
        TransitionInputs {
            node_gpus: vec![4],
            targets: targets.iter().copied().collect(),
            current: Deployment {
                instances: current,
                batch_tokens: BTreeMap::new(),
            },
            solver: SolverKind::Microlp,
            time_limit_seconds: 10.0,
        }
    }

    #[test]
    fn scaling_up_keeps_every_running_instance() {
        let plan =
            plan_transition_to(&inputs(&[(1, 3)], vec![inst(0, &[0]), inst(0, &[1])])).unwrap();
        assert_eq!(plan.kept, vec![0, 1]);
        assert_eq!(plan.launched.len(), 1);
        assert!(matches!(plan.actions[..], [Action::Launch { .. }]));
    }

    #[test]
    fn scaling_down_stops_the_rest() {
        let current = vec![inst(0, &[0]), inst(0, &[1]), inst(0, &[2])];
        let plan = plan_transition_to(&inputs(&[(1, 1)], current)).unwrap();
        assert_eq!(plan.kept.len(), 1);
        assert_eq!(plan.stopped.len(), 2);
        assert!(plan.launched.is_empty());
    }

    #[test]
    fn targets_that_do_not_fit_are_an_error() {
        let err = plan_transition_to(&inputs(&[(1, 5)], vec![])).unwrap_err();
        assert!(matches!(err, PlannerError::TargetsDoNotFit { .. }), "{err}");
        let err = plan_transition_to(&inputs(&[(8, 1)], vec![])).unwrap_err();
        assert!(matches!(err, PlannerError::BadDegree { .. }), "{err}");
    }
}
