//! Typed errors of the scheduler's event API: every rejected input names what was wrong,
//! and the scheduler's state is left untouched when an event is rejected.

use super::predictor::PredictError;
use crate::profile::ProfileError;

#[derive(Debug, thiserror::Error)]
pub enum SchedError {
    #[error("invalid scheduler configuration: {0}")]
    Config(String),
    #[error("invalid request {id}: {reason}")]
    InvalidRequest { id: u64, reason: String },
    #[error("request {0} already exists")]
    DuplicateRequest(u64),
    #[error("unknown request id {0}")]
    UnknownRequest(u64),
    #[error("request {id}: the allowed threshold set is empty")]
    EmptyThresholdSet { id: u64 },
    #[error("request {id}: threshold {tau} is not one of the candidate thresholds {candidates:?}")]
    UnknownThreshold {
        id: u64,
        tau: f64,
        candidates: Vec<f64>,
    },
    #[error(
        "request {id}: a full-sequence step needs {tokens} batch tokens, more than the \
         batch budget of {max}"
    )]
    RequestTooLarge { id: u64, tokens: u64, max: u64 },
    #[error(
        "request {id}: its sequence of {tokens} tokens is longer than any instance's KV \
         cache holds (at most {max})"
    )]
    ExceedsKvCache { id: u64, tokens: u64, max: u64 },
    #[error(
        "request {id} rejected: the cluster is overloaded and {queued} requests already wait \
         for their first step (max_queued {max_queued})"
    )]
    Admission {
        id: u64,
        queued: u32,
        max_queued: u32,
    },
    #[error(
        "request {id} rejected: even at its lowest threshold it would take about \
         {estimate_s:.3} s under the current load, more than its {slo_s:.3} s SLO"
    )]
    Unmeetable {
        id: u64,
        estimate_s: f64,
        slo_s: f64,
    },
    #[error(
        "request {id} rejected: the offered load exceeds what the cluster serves even at \
         the lowest thresholds, so {pct:.0} % of arrivals are turned away",
        pct = share * 100.0
    )]
    Shed { id: u64, share: f64 },
    #[error("invalid instance {id}: {reason}")]
    InvalidInstance { id: u64, reason: String },
    #[error("instance {0} already exists")]
    DuplicateInstance(u64),
    #[error("unknown instance id {0}")]
    UnknownInstance(u64),
    #[error("instance {id}: GPU {gpu} on node {node} is already held by instance {holder}")]
    GpuInUse {
        id: u64,
        node: u32,
        gpu: u32,
        holder: u64,
    },
    #[error("instance {0} has no step in flight")]
    NoStepInFlight(u64),
    #[error("step report for instance {instance}: {reason}")]
    BadStepReport { instance: u64, reason: String },
    #[error("time must be finite, got {0}")]
    BadTime(f64),
    #[error(transparent)]
    Profile(#[from] ProfileError),
    /// The step predictor failed or returned an invalid prediction.
    #[error(transparent)]
    Predictor(#[from] PredictError),
}
