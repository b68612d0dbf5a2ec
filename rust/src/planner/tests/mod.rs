//! Planner tests that span modules: brute-force optimality of Stage 1, backend agreement,
//! Stage-2 properties and input errors. Fixtures here build small, hand-checkable problems.

mod brute_force;
mod errors;
#[cfg(all(feature = "highs", feature = "microlp"))]
mod solvers_agree;
mod stage1_behaviour;
mod stage2_properties;

use super::inputs::{PlannerConfig, PlannerInputs, RequestClass, SolverKind, ThresholdOption};
use crate::profile::{LatencyProfile, StepKind};

/// Per-step latency falls ~25 % at TP2, ~55 % at TP4 and ~67 % at TP8 (DESIGN §2).
pub(super) const TP_FACTOR: [(u32, f64); 4] = [(1, 1.0), (2, 0.75), (4, 0.45), (8, 0.33)];

/// A linear-cost profile: a fixed per-step overhead plus a per-token cost, per degree.
pub(super) fn profile() -> LatencyProfile {
    let points = |per_token: f64, factor: f64| -> Vec<(u64, f64)> {
        [64u64, 256, 1024, 4096, 16384]
            .iter()
            .map(|&n| (n, factor * (0.008 + per_token * n as f64)))
            .collect()
    };
    let mut tables = Vec::new();
    for (tp, factor) in TP_FACTOR {
        tables.push((tp, StepKind::NoCache, points(2.7e-5, factor)));
        tables.push((tp, StepKind::Recompute, points(2.8e-5, factor)));
        tables.push((tp, StepKind::Cache, points(3.2e-5, factor)));
    }
    LatencyProfile::from_tables(tables).expect("fixture profile is valid")
}

/// Fast-dLLM's tokens per step on GSM8K at thresholds 0.5 … 0.9 (DESIGN §9).
pub(super) fn thresholds(n: usize) -> Vec<ThresholdOption> {
    [
        (0.5, 7.01),
        (0.6, 6.17),
        (0.7, 5.12),
        (0.8, 4.24),
        (0.9, 3.25),
    ]
    .iter()
    .rev()
    .take(n)
    .map(|&(threshold, tokens_per_step)| ThresholdOption {
        threshold,
        tokens_per_step,
    })
    .collect()
}

pub(super) fn class(prompt: f64, output: f64, rate: f64) -> RequestClass {
    RequestClass {
        prompt_tokens: prompt,
        output_tokens: output,
        rate,
        slo_seconds: None,
    }
}

/// Small inputs solved to proven optimality (zero MIP gap).
pub(super) fn inputs(
    classes: Vec<RequestClass>,
    node_gpus: Vec<u32>,
    degrees: Vec<u32>,
    batches: Vec<u64>,
    slo: f64,
) -> PlannerInputs {
    let mut config = PlannerConfig::new(slo, degrees, batches);
    config.mip_gap = 0.0;
    config.time_limit_seconds = 60.0;
    PlannerInputs {
        classes,
        thresholds: thresholds(3),
        node_gpus,
        config,
        current: None,
    }
}

/// A deterministic pseudo-random stream for generated instances (no extra dependency).
pub(super) struct Lcg(pub u64);

impl Lcg {
    pub fn next(&mut self) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }

    pub fn range(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.next()
    }
}

/// The default backend of this build.
pub(super) fn default_solver() -> SolverKind {
    if cfg!(feature = "highs") {
        SolverKind::Highs
    } else {
        SolverKind::Microlp
    }
}
