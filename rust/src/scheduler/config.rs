//! Scheduler configuration. The DiLaServe policy, the DESIGN §8 baselines and the ablations
//! are all values of [`Policy`], so every comparison runs the same scheduler code.

use super::error::SchedError;
use crate::settings::{choice_enum, settings};

/// Most candidate thresholds a scheduler can hold: allowed sets are bitmasks over them.
pub const MAX_THRESHOLDS: usize = 32;

choice_enum! {
    /// How the threshold of each dispatched step is picked.
    pub enum ThresholdPolicy {
        /// DESIGN §4: the highest allowed threshold whose predicted finish meets the SLO.
        SloAware = "slo_aware",
        /// Every step runs at the policy's `fixed_tau` (the baselines).
        Fixed = "fixed",
    }
}

choice_enum! {
    /// Order in which load control and dispatch walk the requests.
    pub enum LoadOrder {
        /// Earliest arrival first.
        Arrival = "arrival",
        /// Highest priority first, then earliest arrival.
        Priority = "priority",
    }
}

choice_enum! {
    /// How a request that may move picks its instance.
    pub enum InstanceChoice {
        /// DESIGN §6: the instance whose next step would finish first.
        EarliestCompletion = "earliest_completion",
        /// The instance with the fewest batch tokens (the baselines).
        LeastLoaded = "least_loaded",
    }
}

choice_enum! {
    /// When remaining-step predictions are refreshed.
    pub enum Prediction {
        /// Re-run the predictor after every `predict_every`-th step of a request; in
        /// between, count the executed steps off the last prediction.
        Online = "online",
        /// Predict once at arrival, then only count executed steps off (the ablation).
        OneShot = "one_shot",
    }
}

choice_enum! {
    /// What load control counts and how it lowers thresholds.
    pub enum LoadModel {
        /// DESIGN §5 as written: the active requests over one SLO window; walking in load
        /// order, the earliest keep the highest thresholds.
        Window = "window",
        /// *(ours)* The active requests plus the arrivals expected within the window,
        /// against `target_utilisation` of capacity; one level for all, the spare raising
        /// the earliest.
        Forecast = "forecast",
    }
}

choice_enum! {
    /// What happens to an arrival that cannot meet its deadline even at its lowest
    /// threshold.
    pub enum Admission {
        /// Admitted like any other.
        Off = "off",
        /// Rejected ([`super::SchedError::Unmeetable`]).
        Reject = "reject",
        /// Admitted behind every other request (served with what capacity is left).
        BestEffort = "best_effort",
    }
}

// The request table's empty state; the enum is declared by `choice_enum!`, whose derives
// carry no `Default`.
#[allow(clippy::derivable_impls)]
impl Default for LoadOrder {
    fn default() -> Self {
        Self::Arrival
    }
}

settings! {
    /// How the scheduler decides. DiLaServe, the DESIGN §8 baselines and the ablations are
    /// all values of this struct (named in [`PRESETS`]), so every comparison runs the same
    /// scheduler code.
    #[derive(Copy)]
    pub struct Policy {
        /// How each step's threshold is chosen: slo_aware (DESIGN §4) or fixed.
        pub threshold: ThresholdPolicy = ThresholdPolicy::SloAware,
        /// Threshold of every step under the fixed threshold policy.
        pub fixed_tau: f64 = 0.9,
        /// Adaptive load control (DESIGN §5): caps thresholds so the load fits the cluster.
        pub load_control: bool = true,
        /// forecast: active requests plus the arrivals expected within the SLO window, one
        /// level for all (ours); window: DESIGN §5 as written.
        pub load_model: LoadModel = LoadModel::Forecast,
        /// An arrival that cannot meet its deadline even at its lowest threshold: reject
        /// (HTTP 429), best_effort (served behind the rest) or off (admitted like any other).
        pub admission: Admission = Admission::Reject,
        /// Order load control and dispatch walk requests in: arrival, or priority first.
        pub load_order: LoadOrder = LoadOrder::Arrival,
        /// Instance of a request that may move: earliest_completion (DESIGN §6) or
        /// least_loaded (the baselines).
        pub instance_choice: InstanceChoice = InstanceChoice::EarliestCompletion,
        /// *(ours)* Once instances of more than one TP degree have joined, earliest-completion
        /// choice also prices this many further steps of the request at each instance's
        /// steady load (its residents' block steps plus their recompute steps spread over a
        /// block of this + 1 steps), so that a request does not go where its next step is
        /// quick and every later one crowded (a TP-4 instance beside idle TP-1s); 0 prices
        /// the next step alone (DESIGN §6 as written). It is also the horizon a request's
        /// move must pay over (`migration_gain`).
        pub lookahead_steps: u32 = 9,
        /// Let requests change instance between steps (with caching: before recompute
        /// steps); requests on a draining or removed instance move regardless.
        pub migration: bool = true,
        /// *(ours)* Under earliest-completion choice a request leaves its home only if the
        /// move finishes its next step and `lookahead_steps` further ones (at both
        /// instances' steady loads) more than this share sooner than staying. Priced by the
        /// next step alone, requests leaving a block flocked to whichever instance's next
        /// batch was small and crowded every later step there: at the 16-GPU knee
        /// migrating met fewer deadlines than staying put. In [0, 1).
        pub migration_gain: f64 = 0.1,
        /// Step predictions refreshed as requests run (online) or made once (one_shot).
        pub prediction: Prediction = Prediction::Online,
        /// With online prediction, re-run the predictor every this many steps of a request:
        /// the largest interval whose error stays within 5 % of every step (DESIGN §3); 1 on
        /// dilaserve-tiny (benches/predictor.py, predict_every_default).
        pub predict_every: u32 = 1,
    }
}

/// A named policy: the paper's system, its baselines and its ablations.
pub struct Preset {
    pub name: &'static str,
    pub doc: &'static str,
    pub policy: fn() -> Policy,
    /// The simulator runs it on one TP-1 instance per GPU and never replans (DESIGN §8).
    pub fixed_layout: bool,
}

/// Every policy name the server, the benchmarks and the simulator accept.
pub const PRESETS: &[Preset] = &[
    Preset {
        name: "dilaserve",
        doc:
            "SLO-aware thresholds, forecast load control, earliest-completion placement, migration",
        policy: Policy::dilaserve,
        fixed_layout: false,
    },
    Preset {
        name: "infaas",
        doc: "fixed τ 0.9, least-loaded dispatch, no migration, no load control",
        policy: || Policy::infaas_like(0.9),
        fixed_layout: true,
    },
    Preset {
        name: "llumnix",
        doc: "infaas plus step-level migration for load balance",
        policy: || Policy::llumnix_like(0.9),
        fixed_layout: true,
    },
    Preset {
        name: "no-load-control",
        doc: "ablation: dilaserve without load control",
        policy: || Policy::dilaserve().without_load_control(),
        fixed_layout: false,
    },
    Preset {
        name: "no-migration",
        doc: "ablation: dilaserve without migration",
        policy: || Policy::dilaserve().without_migration(),
        fixed_layout: false,
    },
    Preset {
        name: "one-shot",
        doc: "ablation: dilaserve predicting steps once, at arrival",
        policy: || Policy::dilaserve().one_shot(),
        fixed_layout: false,
    },
    Preset {
        name: "no-admission",
        doc: "dilaserve admitting every request",
        policy: || Policy::dilaserve().without_admission(),
        fixed_layout: false,
    },
    Preset {
        name: "paper",
        doc: "DESIGN §5's load control and §6's instance choice as written, admitting everything, \
              on the fixed layout",
        policy: || {
            Policy::dilaserve()
                .window_load_control()
                .without_admission()
                .next_step_choice()
        },
        fixed_layout: true,
    },
    Preset {
        name: "no-reconfig",
        doc: "dilaserve on the baselines' layout, never replanned",
        policy: Policy::dilaserve,
        fixed_layout: true,
    },
];

impl Policy {
    /// A preset by name, or `fixed-T`: threshold T with DiLaServe's instance choice.
    pub fn named(name: &str) -> Result<Self, SchedError> {
        if let Some(preset) = PRESETS.iter().find(|p| p.name == name) {
            return Ok((preset.policy)());
        }
        if let Some(tau) = name.strip_prefix("fixed-").and_then(|t| t.parse().ok()) {
            let policy = Self {
                threshold: ThresholdPolicy::Fixed,
                fixed_tau: tau,
                ..Self::dilaserve()
            };
            policy.validate()?;
            return Ok(policy);
        }
        let names: Vec<&str> = PRESETS.iter().map(|p| p.name).collect();
        Err(SchedError::Config(format!(
            "unknown policy {name:?}; known: {} and fixed-T",
            names.join(", ")
        )))
    }

    /// The full DiLaServe policy. Predictions are refreshed after every step: the largest
    /// interval whose error stays within 5 % of that (DESIGN §3) is 1 on dilaserve-tiny
    /// (`benches/predictor.py`, `predict_every_default`).
    pub fn dilaserve() -> Self {
        Self::default()
    }

    /// Fixed-τ INFaaS-like baseline: least-loaded dispatch, no migration.
    pub fn infaas_like(tau: f64) -> Self {
        Self {
            threshold: ThresholdPolicy::Fixed,
            fixed_tau: tau,
            load_control: false,
            load_model: LoadModel::Window,
            admission: Admission::Off,
            load_order: LoadOrder::Arrival,
            instance_choice: InstanceChoice::LeastLoaded,
            lookahead_steps: 0,
            migration: false,
            migration_gain: 0.0,
            prediction: Prediction::Online,
            predict_every: 1,
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

    /// Earliest-completion choice by the next step alone (DESIGN §6 as written): any
    /// instance that finishes it sooner draws a request away from its home.
    pub fn next_step_choice(self) -> Self {
        Self {
            lookahead_steps: 0,
            migration_gain: 0.0,
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

    /// The threshold every step runs at under a fixed policy.
    pub fn fixed(&self) -> Option<f64> {
        (self.threshold == ThresholdPolicy::Fixed).then_some(self.fixed_tau)
    }

    /// Steps between prediction refreshes under online prediction.
    pub fn refresh_every(&self) -> Option<u32> {
        (self.prediction == Prediction::Online).then_some(self.predict_every)
    }

    fn validate(&self) -> Result<(), SchedError> {
        if self.threshold == ThresholdPolicy::Fixed
            && !(self.fixed_tau > 0.0 && self.fixed_tau <= 1.0)
        {
            return Err(SchedError::Config(format!(
                "fixed threshold must be in (0, 1], got {}",
                self.fixed_tau
            )));
        }
        if self.predict_every == 0 {
            return Err(SchedError::Config(
                "prediction update interval must be at least 1 step".into(),
            ));
        }
        if !(0.0..1.0).contains(&self.migration_gain) {
            return Err(SchedError::Config(format!(
                "migration gain must be in [0, 1), got {}",
                self.migration_gain
            )));
        }
        Ok(())
    }
}

settings! {
    /// The scheduler's settings; the engine's, the simulator's and the CLI's derive from
    /// these (see [`crate::settings`]).
    pub struct SchedulerConfig {
        /// Candidate thresholds the scheduler chooses from (stored ascending).
        pub thresholds: Vec<f64> = vec![0.5, 0.6, 0.7, 0.8, 0.9],
        /// Default block size of requests that do not name their own.
        pub block_length: u32 = 32,
        /// Approximate KV cache on (recompute and cache steps) or off (no-cache steps).
        pub caching: bool = true,
        /// *(ours)* With caching: the cache is block diffusion's exact one, whose K/V stays
        /// valid past a block's end, so only a request's first step on an instance
        /// recomputes.
        pub exact_cache: bool = false,
        /// Most tokens one instance step may process (the planner's batch size).
        pub max_batch_tokens: u64 = 8192,
        /// *(ours)* Decide an instance's next step while its current one runs (one step
        /// ahead): its requests continue at home with τ chosen from the predictions as of
        /// their previous step, and the worker resolves each such step's kind. Off: every
        /// step waits for the report of the one before (the synchronous round trip).
        pub overlap: bool = false,
        /// SLO window load control plans for; none uses the mean SLO of active requests.
        pub slo_window_s: Option<f64> = None,
        /// While load control finds the cluster overloaded, refuse an arrival once this many
        /// requests wait for their first step; none admits everything.
        pub max_queued: Option<u32> = None,
        /// Share of capacity the forecast load control plans to fill; the rest absorbs
        /// bursts and prediction error.
        pub target_utilisation: f64 = 0.9,
        /// How the scheduler decides.
        @nested
        pub policy: Policy = Policy::dilaserve(),
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
                    predict_every: 0,
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
        for preset in PRESETS {
            assert_eq!(Policy::named(preset.name).unwrap(), (preset.policy)());
        }
        let fixed = Policy::named("fixed-0.7").unwrap();
        assert_eq!(fixed.fixed(), Some(0.7));
        assert!(Policy::named("fixed-1.7").is_err() && Policy::named("nope").is_err());
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

    #[test]
    fn settings_round_trip_and_refuse_unknown_keys() {
        let cfg: SchedulerConfig =
            serde_json::from_str(r#"{"max_batch_tokens": 512, "policy": {"migration": false}}"#)
                .unwrap();
        assert_eq!(cfg.max_batch_tokens, 512);
        assert_eq!(cfg.policy, Policy::dilaserve().without_migration());
        assert_eq!(cfg.thresholds, SchedulerConfig::default().thresholds);
        let back: SchedulerConfig =
            serde_json::from_value(serde_json::to_value(&cfg).unwrap()).unwrap();
        assert_eq!(back, cfg);
        assert!(serde_json::from_str::<SchedulerConfig>(r#"{"max_batch": 1}"#).is_err());
        assert!(
            serde_json::from_str::<SchedulerConfig>(r#"{"policy": {"admission": "maybe"}}"#)
                .is_err()
        );
        let schema = <SchedulerConfig as crate::settings::Described>::schema();
        let field = |name: &str| {
            schema
                .as_array()
                .unwrap()
                .iter()
                .find(|f| f["name"] == name)
                .cloned()
                .unwrap()
        };
        assert_eq!(field("max_batch_tokens")["default"], 8192);
        assert_eq!(field("max_queued")["kind"]["nullable"], true);
        assert!(field("block_length")["doc"]
            .as_str()
            .unwrap()
            .contains("block size"));
        let policy = field("policy");
        let admission = policy["fields"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["name"] == "admission")
            .unwrap();
        assert_eq!(admission["kind"]["choices"][2], "best_effort");
    }
}
