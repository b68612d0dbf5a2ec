//! Errors of the simulator: bad inputs, and the core's own errors passed through.

use crate::planner::PlannerError;
use crate::scheduler::SchedError;

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error("progress model: {0}")]
    Progress(String),
    #[error("workload: {0}")]
    Workload(String),
    #[error("cluster: {0}")]
    Cluster(String),
    #[error(transparent)]
    Scheduler(#[from] SchedError),
    #[error(transparent)]
    Planner(#[from] PlannerError),
}
