//! Stage 2, the transition plan: reach the target instance counts while keeping as many
//! running instances as possible (DESIGN §7).
//!
//! DESIGN states it over GPU slots (`u`, `a`, `m` binaries). GPUs within a node are
//! interchangeable (one NVLink/PCIe domain; a TP group never spans nodes), and a kept
//! instance keeps exactly its old GPUs, so the slot model reduces exactly to counts per
//! node and degree: `keep[n][d] ≤ running[n][d]` old instances stay, `new[n][d]` are
//! launched, `Σ_n keep + new = R_d` and `Σ_d d·(keep + new) ≤ G_n`. The objective counts
//! kept instances first and kept GPUs second (integer weights, so lexicographic exactly).

use good_lp::{constraint, variable, Expression};
use serde::{Deserialize, Serialize};

use super::error::PlannerError;
use super::inputs::{Deployment, Instance};
use super::sequence::{sequence, Action};
use super::solver::{Model, Outcome, SolveSettings, SolveStatus, Var};

/// Stage-2 result: what stays, what starts, and in which order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TransitionPlan {
    pub status: SolveStatus,
    /// Indices into the current deployment's instances.
    pub kept: Vec<usize>,
    pub stopped: Vec<usize>,
    pub launched: Vec<Instance>,
    /// Launches and stops in execution order; a stop comes right before the launch that
    /// needs its GPUs, or at the end when no launch does.
    pub actions: Vec<Action>,
    /// The deployment after the transition: kept instances, then launched ones.
    pub instances: Vec<Instance>,
}

/// Running instances of each (node, degree index), by index into the deployment.
fn running_by_node(
    node_gpus: &[u32],
    degrees: &[u32],
    current: &Deployment,
) -> Vec<Vec<Vec<usize>>> {
    let mut running = vec![vec![Vec::new(); degrees.len()]; node_gpus.len()];
    for (i, inst) in current.instances.iter().enumerate() {
        if let Some(d) = degrees.iter().position(|&x| x == inst.degree) {
            running[inst.node][d].push(i);
        }
    }
    for per_node in &mut running {
        for list in per_node.iter_mut() {
            list.sort_by_key(|&i| current.instances[i].gpus.iter().min().copied());
        }
    }
    running
}

/// Plans the transition from `current` to `targets[d]` instances of `degrees[d]`.
/// `witness[n][d]` is a placement of the targets (Stage 1's), used as a warm start.
pub(crate) fn plan_transition(
    node_gpus: &[u32],
    degrees: &[u32],
    targets: &[u32],
    current: &Deployment,
    witness: &[Vec<u32>],
    settings: &SolveSettings,
) -> Result<TransitionPlan, PlannerError> {
    let running = running_by_node(node_gpus, degrees, current);
    let total_gpus: u32 = node_gpus.iter().sum();
    let mut model = Model::new();
    let mut keep: Vec<Vec<Var>> = Vec::new();
    let mut new: Vec<Vec<Var>> = Vec::new();
    for (n, &gpus) in node_gpus.iter().enumerate() {
        keep.push(
            (0..degrees.len())
                .map(|d| model.add(variable().integer().clamp(0, running[n][d].len() as u32)))
                .collect(),
        );
        new.push(
            degrees
                .iter()
                .map(|&deg| model.add(variable().integer().clamp(0, gpus / deg)))
                .collect(),
        );
    }
    for (d, &target) in targets.iter().enumerate() {
        let placed: Expression = (0..node_gpus.len())
            .map(|n| keep[n][d].var + new[n][d].var)
            .sum();
        model.constrain(constraint!(placed == target));
    }
    for (n, &gpus) in node_gpus.iter().enumerate() {
        let used: Expression = degrees
            .iter()
            .enumerate()
            .map(|(d, &deg)| deg as f64 * (keep[n][d].var + new[n][d].var))
            .sum();
        model.constrain(constraint!(used <= gpus));
    }
    let weight = (total_gpus + 1) as f64;
    let objective: Expression = keep
        .iter()
        .flat_map(|per_node| {
            per_node
                .iter()
                .zip(degrees)
                .map(move |(k, &deg)| (weight + deg as f64) * k.var)
        })
        .sum();
    let mut warm = vec![0.0; 2 * node_gpus.len() * degrees.len()];
    for n in 0..node_gpus.len() {
        for d in 0..degrees.len() {
            warm[new[n][d].pos] = witness[n][d] as f64;
        }
    }
    let fail = |message: &str| PlannerError::Solver {
        solver: settings.solver.as_str(),
        message: message.into(),
    };
    let (values, status) = match model.maximise(objective, settings, Some(&warm))? {
        Outcome::Solved { values, status } => (values, status),
        // The witness is feasible, so without time the witness stands (nothing kept).
        Outcome::NoSolutionInTime => (warm, SolveStatus::TimeLimit),
        Outcome::Infeasible => return Err(fail("the target counts do not fit on the nodes")),
    };
    let count = |v: Var| v.value(&values).round().max(0.0) as usize;
    let mut kept_flags = vec![false; current.instances.len()];
    let mut to_launch = vec![Vec::new(); node_gpus.len()];
    for n in 0..node_gpus.len() {
        for d in 0..degrees.len() {
            for &i in running[n][d].iter().take(count(keep[n][d])) {
                kept_flags[i] = true;
            }
            to_launch[n].extend(std::iter::repeat_n(degrees[d], count(new[n][d])));
        }
    }
    let (launched, actions) = sequence(node_gpus, current, &kept_flags, &to_launch);
    let kept: Vec<usize> = (0..current.instances.len())
        .filter(|&i| kept_flags[i])
        .collect();
    let stopped = (0..current.instances.len())
        .filter(|&i| !kept_flags[i])
        .collect();
    let instances = kept
        .iter()
        .map(|&i| current.instances[i].clone())
        .chain(launched.iter().cloned())
        .collect();
    Ok(TransitionPlan {
        status,
        kept,
        stopped,
        launched,
        actions,
        instances,
    })
}
