//! Typed errors of the planner: every bad input names what is wrong and where, so the
//! caller (engine, CLI, tests) can report it without guessing.

use crate::profile::ProfileError;

#[derive(Debug, thiserror::Error)]
pub enum PlannerError {
    #[error("no request classes: the planner needs at least one class with a positive rate")]
    NoClasses,
    #[error("request class {index}: {reason}")]
    BadClass { index: usize, reason: &'static str },
    #[error("no candidate thresholds: give at least one (threshold, tokens per step) pair")]
    NoThresholds,
    #[error("candidate threshold {index}: {reason}")]
    BadThreshold { index: usize, reason: String },
    #[error("the cluster has no GPUs: give at least one node")]
    NoGpus,
    #[error("node {node} has 0 GPUs")]
    EmptyNode { node: usize },
    #[error("no TP degrees to plan for")]
    NoDegrees,
    #[error("TP degree {degree} is invalid: {reason}")]
    BadDegree { degree: u32, reason: String },
    #[error("no candidate batch sizes")]
    NoBatchSizes,
    #[error("batch sizes must be positive and distinct, got {0:?}")]
    BadBatchSizes(Vec<u64>),
    #[error("setting {name} is invalid: {reason} (got {value})")]
    BadSetting {
        name: &'static str,
        value: f64,
        reason: &'static str,
    },
    #[error(transparent)]
    Profile(#[from] ProfileError),
    #[error("current deployment: {0}")]
    BadDeployment(String),
    #[error("target instance counts {targets:?} do not fit on nodes of {node_gpus:?} GPUs")]
    TargetsDoNotFit {
        targets: Vec<(u32, u32)>,
        node_gpus: Vec<u32>,
    },
    #[error("arrival {index}: {reason}")]
    BadArrival { index: usize, reason: &'static str },
    #[error("no arrivals in the window [{start}, {end}) s")]
    EmptyWindow { start: f64, end: f64 },
    #[error("node of {gpus} GPUs has more than {limit} distinct instance layouts for degrees {degrees:?}")]
    TooManyLayouts {
        gpus: u32,
        degrees: Vec<u32>,
        limit: usize,
    },
    #[error("the {0} solver is not compiled in (enable the cargo feature of the same name)")]
    SolverUnavailable(&'static str),
    #[error("the {solver} solver failed: {message}")]
    Solver {
        solver: &'static str,
        message: String,
    },
}
