//! Scheduler configuration. The DiLaServe policy, the DESIGN §8 baselines and the ablations
//! are all values of [`Policy`], so every comparison runs the same scheduler code.

use super::error::SchedError;

/// Most candidate thresholds a scheduler can hold: allowed sets are bitmasks over them.
pub const MAX_THRESHOLDS: usize = 32;

/// How the threshold of each dispatched step is picked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum ThresholdPolicy {
    /// DESIGN §4: the highest allowed threshold whose predicted finish meets the SLO.
    SloAware,
    /// Every step runs at this threshold (the baselines).
    Fixed(f64),
}

/// Order in which load control and dispatch walk the requests.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LoadOrder {
    /// Earliest arrival first.
    #[default]
    Arrival,
    /// Highest priority first, then earliest arrival.
    Priority,
}

/// How a request that may move picks its instance.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InstanceChoice {
    /// DESIGN §6: the instance whose next step would finish first.
    EarliestCompletion,
    /// The instance with the fewest batch tokens (the baselines).
    LeastLoaded,
}

/// When remaining-step predictions are refreshed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prediction {
    /// Re-run the predictor after every `every`-th step of a request; in between, count
    /// the executed steps off the last prediction.
    Online { every: u32 },
    /// Predict once at arrival, then only count executed steps off (the ablation).
    OneShot,
}

/// What load control counts and how it lowers thresholds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadModel {
    /// DESIGN §5 as written: the active requests over one SLO window; walking in load
    /// order, the earliest keep the highest thresholds.
    Window,
    /// *(ours)* The active requests plus the arrivals expected within the window, against
    /// `target_utilisation` of capacity; one level for all, the spare raising the earliest.
    Forecast,
}

/// What happens to an arrival that cannot meet its deadline even at its lowest threshold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Admitted like any other.
    Off,
    /// Rejected ([`super::SchedError::Unmeetable`]).
    Reject,
    /// Admitted behind every other request (served with what capacity is left).
    BestEffort,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    pub threshold: ThresholdPolicy,
    pub load_control: bool,
    pub load_model: LoadModel,
    pub admission: Admission,
    pub load_order: LoadOrder,
    pub instance_choice: InstanceChoice,
    /// Whether a request may change instance between steps (with caching: only before a
    /// recompute step). Requests on a draining or removed instance move regardless.
    pub migration: bool,
    pub prediction: Prediction,
}

impl Policy {
    /// The full DiLaServe policy. Predictions are refreshed after every step: the largest
    /// interval whose error stays within 5 % of that (DESIGN §3) is 1 on dilaserve-tiny
    /// (`benches/predictor.py`, `predict_every_default`).
    pub fn dilaserve() -> Self {
        Self {
            threshold: ThresholdPolicy::SloAware,
            load_control: true,
            load_model: LoadModel::Forecast,
            admission: Admission::Reject,
            load_order: LoadOrder::Arrival,
            instance_choice: InstanceChoice::EarliestCompletion,
            migration: true,
            prediction: Prediction::Online { every: 1 },
        }
    }

    /// Fixed-τ INFaaS-like baseline: least-loaded dispatch, no migration.
    pub fn infaas_like(tau: f64) -> Self {
        Self {
            threshold: ThresholdPolicy::Fixed(tau),
            load_control: false,
            load_model: LoadModel::Window,
            admission: Admission::Off,
            load_order: LoadOrder::Arrival,
            instance_choice: InstanceChoice::LeastLoaded,
            migration: false,
            prediction: Prediction::Online { every: 1 },
        }
    }

    /// Fixed-τ Llumnix-like baseline: INFaaS-like plus step-level migration.
    pub fn llumnix_like(tau: f64) -> Self {
        Self {
            migration: true,
            ..Self::infaas_like(tau)
        }
    }

    /// Ablation: DiLaServe without adaptive load control.
    pub fn without_load_control(self) -> Self {
        Self {
            load_control: false,
            ..self
        }
    }

    /// DiLaServe with DESIGN §5's load control as written (the paper's policy).
    pub fn window_load_control(self) -> Self {
        Self {
            load_model: LoadModel::Window,
            ..self
        }
    }

    /// DiLaServe admitting every request.
    pub fn without_admission(self) -> Self {
        Self {
            admission: Admission::Off,
            ..self
        }
    }

    /// Ablation: DiLaServe without migration.
    pub fn without_migration(self) -> Self {
        Self {
            migration: false,
            ..self
        }
    }

    /// Ablation: DiLaServe with a one-shot step prediction.
    pub fn one_shot(self) -> Self {
        Self {
            prediction: Prediction::OneShot,
            ..self
        }
    }

    fn validate(&self) -> Result<(), SchedError> {
        if let ThresholdPolicy::Fixed(tau) = self.threshold {
            if !(tau > 0.0 && tau <= 1.0) {
                return Err(SchedError::Config(format!(
                    "fixed threshold must be in (0, 1], got {tau}"
                )));
            }
        }
        if let Prediction::Online { every: 0 } = self.prediction {
            return Err(SchedError::Config(
                "prediction update interval must be at least 1 step".into(),
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct SchedulerConfig {
    /// Candidate thresholds; stored ascending.
    pub thresholds: Vec<f64>,
    /// Default block size `B` of requests that do not name their own.
    pub block_length: u32,
    /// Approximate KV cache on: steps are recompute or cache steps; off: no-cache steps.
    pub caching: bool,
    /// Most tokens one instance step may process.
    pub max_batch_tokens: u64,
    /// SLO window the load controller plans for; `None` uses the mean SLO
    /// (deadline − arrival) of the active requests.
    pub slo_window_s: Option<f64>,
    /// Admission bound: while load control finds the cluster overloaded, an arrival is
    /// rejected once this many requests are queued (arrived, never dispatched). `None`
    /// admits everything.
    pub max_queued: Option<u32>,
    /// Share of capacity the forecast load control plans to fill: the rest absorbs bursts
    /// and prediction error.
    pub target_utilisation: f64,
    pub policy: Policy,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            thresholds: vec![0.5, 0.6, 0.7, 0.8, 0.9],
            block_length: 32,
            caching: true,
            max_batch_tokens: 8192,
            slo_window_s: None,
            max_queued: None,
            target_utilisation: 0.9,
            policy: Policy::dilaserve(),
        }
    }
}

impl SchedulerConfig {
    /// Checks every field and sorts the thresholds ascending.
    pub fn validated(mut self) -> Result<Self, SchedError> {
        if self.thresholds.is_empty() {
            return Err(SchedError::Config(
                "candidate threshold set is empty".into(),
            ));
        }
        if self.thresholds.len() > MAX_THRESHOLDS {
            return Err(SchedError::Config(format!(
                "at most {MAX_THRESHOLDS} candidate thresholds, got {}",
                self.thresholds.len()
            )));
        }
        if let Some(bad) = self.thresholds.iter().find(|t| !(**t > 0.0 && **t <= 1.0)) {
            return Err(SchedError::Config(format!(
                "thresholds must be in (0, 1], got {bad}"
            )));
        }
        self.thresholds.sort_by(f64::total_cmp);
        if self.thresholds.windows(2).any(|w| w[0] == w[1]) {
            return Err(SchedError::Config(format!(
                "candidate thresholds repeat: {:?}",
                self.thresholds
            )));
        }
        if self.block_length == 0 {
            return Err(SchedError::Config("block size must be at least 1".into()));
        }
        if self.max_batch_tokens == 0 {
            return Err(SchedError::Config(
                "max batch tokens must be at least 1".into(),
            ));
        }
        if let Some(w) = self.slo_window_s {
            if !(w.is_finite() && w > 0.0) {
                return Err(SchedError::Config(format!(
                    "SLO window must be positive and finite, got {w}"
                )));
            }
        }
        if !(self.target_utilisation > 0.0 && self.target_utilisation <= 1.0) {
            return Err(SchedError::Config(format!(
                "target utilisation must be in (0, 1], got {}",
                self.target_utilisation
            )));
        }
        self.policy.validate()?;
        Ok(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sorts_and_rejects_bad_thresholds() {
        let cfg = SchedulerConfig {
            thresholds: vec![0.9, 0.5, 0.7],
            ..Default::default()
        };
        assert_eq!(cfg.validated().unwrap().thresholds, vec![0.5, 0.7, 0.9]);
        for bad in [vec![], vec![0.0], vec![1.5], vec![0.5, 0.5], vec![f64::NAN]] {
            let cfg = SchedulerConfig {
                thresholds: bad,
                ..Default::default()
            };
            assert!(matches!(cfg.validated(), Err(SchedError::Config(_))));
        }
    }

    #[test]
    fn rejects_bad_policy_and_sizes() {
        let bad = [
            SchedulerConfig {
                policy: Policy::infaas_like(0.0),
                ..Default::default()
            },
            SchedulerConfig {
                policy: Policy {
                    prediction: Prediction::Online { every: 0 },
                    ..Policy::dilaserve()
                },
                ..Default::default()
            },
            SchedulerConfig {
                block_length: 0,
                ..Default::default()
            },
            SchedulerConfig {
                max_batch_tokens: 0,
                ..Default::default()
            },
            SchedulerConfig {
                slo_window_s: Some(-1.0),
                ..Default::default()
            },
        ];
        for cfg in bad {
            assert!(cfg.validated().is_err());
        }
    }

    #[test]
    fn presets_differ_only_where_design_says() {
        let inf = Policy::infaas_like(0.9);
        let llu = Policy::llumnix_like(0.9);
        assert!(!inf.migration && llu.migration);
        assert_eq!(
            Policy {
                migration: true,
                ..inf
            },
            llu
        );
        let d = Policy::dilaserve();
        assert!(!d.without_load_control().load_control);
        assert!(!d.without_migration().migration);
        assert_eq!(d.one_shot().prediction, Prediction::OneShot);
    }
}
