//! Periodic replanning (DESIGN §7), one implementation for the live engine and the
//! simulator: when a plan is due, what the planner is asked (the window's arrivals as
//! request classes, the running deployment described with each degree's batch size of the
//! last adopted plan, the batch sizes and degrees it may choose), what an adopted plan
//! changes here, and when a stop hands its requests over instead of draining. Solving and
//! executing the plan's actions are the caller's: the engine launches and stops workers, the
//! simulator advances simulated time.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use super::classes::{classes_from_arrivals, Arrival, BinSpec};
use super::error::PlannerError;
use super::inputs::{Deployment, Instance, PlannerConfig, PlannerInputs, ThresholdOption};
use super::slo::mean_isolated_latency;
use super::Plan;
use crate::profile::LatencyProfile;

/// The planner's SLO: a fixed number of seconds for every class, or, as default SLOs are,
/// a multiple of each class's isolated latency (alone on TP-1 at the given tokens per
/// step), so a class of long requests is planned against its own, longer deadline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SloTarget {
    Fixed { seconds: f64 },
    Scaled { scale: f64, tokens_per_step: f64 },
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplanOptions {
    /// Seconds between planner runs (the paper: 300).
    pub interval_s: f64,
    /// Arrivals of this many past seconds make the planner's request classes.
    pub window_s: f64,
    /// Degrees and candidate batch sizes the planner may choose, and its solver settings;
    /// its `slo_seconds` is replaced by `slo` at each plan.
    pub planner: PlannerConfig,
    pub slo: SloTarget,
    pub thresholds: Vec<ThresholdOption>,
    #[serde(default)]
    pub bins: BinSpec,
}

/// A running instance as the planner sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RunningInstance {
    pub id: u64,
    /// Index of its node in the `node_gpus` given with it.
    pub node: usize,
    pub degree: u32,
    pub gpus: Vec<u32>,
}

/// What to ask the planner, and which instance each of its deployment entries is.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReplanInputs {
    pub inputs: PlannerInputs,
    pub instance_ids: Vec<u64>,
}

pub struct Replanner {
    options: ReplanOptions,
    next_plan: f64,
    recent: VecDeque<Arrival>,
    /// Batch tokens per TP degree of the last adopted plan, which describe the running
    /// deployment to the next plan (the plan's latencies assume them). They cap nothing:
    /// capping instances at them cost 11 points of attainment on the simulated day trace.
    batch_tokens: BTreeMap<u32, u64>,
}

/// Why `options` cannot drive a replanner, if they cannot.
fn check_options(options: &ReplanOptions) -> Result<(), PlannerError> {
    for (name, value) in [
        ("replan interval_s", options.interval_s),
        ("replan window_s", options.window_s),
    ] {
        if !(value.is_finite() && value > 0.0) {
            return Err(PlannerError::BadSetting {
                name,
                value,
                reason: "must be positive and finite",
            });
        }
    }
    Ok(())
}

impl Replanner {
    pub fn new(options: ReplanOptions) -> Result<Self, PlannerError> {
        check_options(&options)?;
        Ok(Self {
            next_plan: options.interval_s,
            options,
            recent: VecDeque::new(),
            batch_tokens: BTreeMap::new(),
        })
    }

    pub fn options(&self) -> &ReplanOptions {
        &self.options
    }

    /// New options (rates learned while serving, say); the arrivals, the batch sizes of
    /// the last adopted plan and the next plan's time stay.
    pub fn set_options(&mut self, options: ReplanOptions) -> Result<(), PlannerError> {
        check_options(&options)?;
        self.options = options;
        Ok(())
    }

    /// Remembers an arrival; those older than the window are forgotten.
    pub fn record(&mut self, arrival: Arrival) {
        let horizon = arrival.time - self.options.window_s;
        while self.recent.front().is_some_and(|a| a.time < horizon) {
            self.recent.pop_front();
        }
        self.recent.push_back(arrival);
    }

    /// When the next periodic plan is due.
    pub fn next_plan(&self) -> f64 {
        self.next_plan
    }

    /// Batch tokens the last adopted plan chose for `degree`, if one did.
    pub fn planned_batch(&self, degree: u32) -> Option<u64> {
        self.batch_tokens.get(&degree).copied()
    }

    /// The planner's inputs at `now` for the arrivals of the last window, or `None` when
    /// there were none; the next periodic plan falls due an interval later.
    /// `min_improvement` replaces the adoption margin (0 after a node change: the running
    /// layout may no longer fit); `default_batch` describes a degree no plan has sized yet.
    pub fn inputs(
        &mut self,
        now: f64,
        min_improvement: Option<f64>,
        running: &[RunningInstance],
        node_gpus: &[u32],
        default_batch: u64,
        profile: &LatencyProfile,
    ) -> Result<Option<ReplanInputs>, PlannerError> {
        self.next_plan = now + self.options.interval_s;
        let start = now - self.options.window_s;
        let arrivals: Vec<Arrival> = self
            .recent
            .iter()
            .filter(|a| a.time >= start && a.time <= now)
            .cloned()
            .collect();
        if arrivals.is_empty() || node_gpus.is_empty() {
            return Ok(None);
        }
        let mut running: Vec<&RunningInstance> = running.iter().collect();
        running.sort_by_key(|r| r.id);
        let batch = |degree: u32| *self.batch_tokens.get(&degree).unwrap_or(&default_batch);
        let current = Deployment {
            instances: running
                .iter()
                .map(|r| Instance {
                    node: r.node,
                    degree: r.degree,
                    gpus: r.gpus.clone(),
                })
                .collect(),
            batch_tokens: running
                .iter()
                .map(|r| (r.degree, batch(r.degree)))
                .collect(),
        };
        let mut config = self.options.planner.clone();
        if let Some(share) = min_improvement {
            config.min_improvement = share;
        }
        let widest = node_gpus.iter().copied().max().unwrap_or(1);
        config.degrees.retain(|&d| d <= widest);
        if config.degrees.is_empty() {
            config.degrees.push(1);
        }
        let sizes: BTreeSet<u64> = config
            .batch_tokens
            .iter()
            .copied()
            .chain([default_batch])
            .chain(current.batch_tokens.values().copied())
            .collect();
        config.batch_tokens = sizes.into_iter().collect();
        let mut classes = classes_from_arrivals(&arrivals, start, now, &self.options.bins)?;
        config.slo_seconds = match self.options.slo {
            SloTarget::Fixed { seconds } => seconds,
            SloTarget::Scaled {
                scale,
                tokens_per_step,
            } => {
                let top = ThresholdOption {
                    threshold: 1.0,
                    tokens_per_step,
                };
                // Each class's own multiple, as each request's deadline is; the config's
                // SLO, which no class then falls back on, is their rate-weighted mean.
                let (mut weighted, mut rate) = (0.0, 0.0);
                for class in &mut classes {
                    let typical = Arrival {
                        time: now,
                        prompt_tokens: class.prompt_tokens.round() as u64,
                        output_tokens: class.output_tokens.round().max(1.0) as u64,
                    };
                    let alone = mean_isolated_latency(
                        profile,
                        &[typical],
                        top,
                        config.caching,
                        config.exact_cache,
                        config.block_length,
                    )?;
                    class.slo_seconds = Some(scale * alone);
                    weighted += class.rate * scale * alone;
                    rate += class.rate;
                }
                weighted / rate
            }
        };
        let inputs = PlannerInputs {
            classes,
            thresholds: self.options.thresholds.clone(),
            node_gpus: node_gpus.to_vec(),
            config,
            current: Some(current),
        };
        Ok(Some(ReplanInputs {
            inputs,
            instance_ids: running.iter().map(|r| r.id).collect(),
        }))
    }

    /// Takes note of a plan's verdict: an adopted plan's batch sizes describe the running
    /// deployment from now on.
    pub fn adopt(&mut self, plan: &Plan) {
        if plan.adopted {
            self.batch_tokens.extend(
                plan.capacity
                    .degrees
                    .iter()
                    .filter_map(|d| Some((d.degree, d.batch_tokens?))),
            );
        }
    }

    /// Whether a planned stop hands its requests over (they wait, holding only the
    /// engine's copy of their state, and resume on the next launch with a recompute step)
    /// instead of draining: only the last instance serving, when a launch follows, whose
    /// devices the launch may need.
    pub fn handover(others_serving: bool, launch_follows: bool) -> bool {
        !others_serving && launch_follows
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::planner::{PlannerConfig, SolverKind};
    use crate::profile::{LatencyProfile, StepKind};

    fn profile() -> LatencyProfile {
        let points: Vec<(u64, f64)> = [64, 512, 4096, 16384]
            .iter()
            .map(|&n| (n, 0.02 + 2e-5 * n as f64))
            .collect();
        let tables = [StepKind::Recompute, StepKind::Cache]
            .into_iter()
            .flat_map(|kind| [1, 2].map(|tp| (tp, kind, points.clone())));
        LatencyProfile::from_tables(tables).unwrap()
    }

    fn replanner() -> Replanner {
        Replanner::new(ReplanOptions {
            interval_s: 10.0,
            window_s: 10.0,
            planner: PlannerConfig {
                caching: true,
                solver: SolverKind::Microlp,
                ..PlannerConfig::new(1.0, vec![1, 2, 4], vec![1024, 4096])
            },
            slo: SloTarget::Scaled {
                scale: 5.0,
                tokens_per_step: 3.0,
            },
            thresholds: vec![ThresholdOption {
                threshold: 0.9,
                tokens_per_step: 3.0,
            }],
            bins: BinSpec::default(),
        })
        .unwrap()
    }

    fn arrival(time: f64) -> Arrival {
        Arrival {
            time,
            prompt_tokens: 100,
            output_tokens: 64,
        }
    }

    #[test]
    fn a_plan_falls_due_an_interval_after_the_last_even_without_arrivals() {
        let mut r = replanner();
        let p = profile();
        assert_eq!(r.next_plan(), 10.0);
        assert!(r.inputs(10.0, None, &[], &[2], 8192, &p).unwrap().is_none());
        assert_eq!(r.next_plan(), 20.0);
    }

    #[test]
    fn inputs_describe_the_window_the_nodes_and_the_running_deployment() {
        let mut r = replanner();
        let p = profile();
        for t in [1.0, 12.0, 13.0, 14.0] {
            r.record(arrival(t));
        }
        let running = [RunningInstance {
            id: 7,
            node: 0,
            degree: 1,
            gpus: vec![0],
        }];
        let asked = r
            .inputs(15.0, Some(0.0), &running, &[2], 8192, &p)
            .unwrap()
            .unwrap();
        let inputs = &asked.inputs;
        assert_eq!(asked.instance_ids, vec![7]);
        assert_eq!(
            inputs.config.degrees,
            vec![1, 2],
            "no degree wider than a node"
        );
        assert_eq!(inputs.config.batch_tokens, vec![1024, 4096, 8192]);
        assert_eq!(inputs.config.min_improvement, 0.0);
        assert!(
            inputs.config.slo_seconds > 0.0,
            "scaled from the window's isolated latency"
        );
        let current = inputs.current.as_ref().unwrap();
        assert_eq!(current.batch_tokens.get(&1), Some(&8192));
        let rate: f64 = inputs.classes.iter().map(|c| c.rate).sum();
        assert!(
            rate > 0.0 && rate < 1.0,
            "the arrival at t=1 left the window: {rate}"
        );
    }

    #[test]
    fn scaled_slos_give_each_class_its_own_multiple_of_its_isolated_latency() {
        let mut r = replanner();
        let p = profile();
        for (i, prompt) in [100, 100, 3000, 3000].into_iter().enumerate() {
            r.record(Arrival {
                prompt_tokens: prompt,
                ..arrival(1.0 + i as f64)
            });
        }
        let asked = r.inputs(5.0, None, &[], &[2], 8192, &p).unwrap().unwrap();
        let slo = |prompt: u64| {
            let typical = Arrival {
                prompt_tokens: prompt,
                ..arrival(0.0)
            };
            let top = ThresholdOption {
                threshold: 1.0,
                tokens_per_step: 3.0,
            };
            5.0 * mean_isolated_latency(&p, &[typical], top, true, false, 32).unwrap()
        };
        let mut got: Vec<(f64, f64)> = asked
            .inputs
            .classes
            .iter()
            .map(|c| (c.prompt_tokens, c.slo_seconds.unwrap()))
            .collect();
        got.sort_by(|a, b| a.0.total_cmp(&b.0));
        assert_eq!(got, vec![(100.0, slo(100)), (3000.0, slo(3000))]);
        assert!(slo(3000) > asked.inputs.config.slo_seconds);
        assert!(slo(100) < asked.inputs.config.slo_seconds);
    }

    #[test]
    fn new_options_keep_what_was_recorded_and_bad_ones_change_nothing() {
        let mut r = replanner();
        r.record(arrival(1.0));
        let mut options = r.options().clone();
        options.interval_s = -1.0;
        assert!(r.set_options(options).is_err());
        options = r.options().clone();
        options.thresholds[0].tokens_per_step = 6.0;
        r.set_options(options).unwrap();
        assert_eq!(r.options().thresholds[0].tokens_per_step, 6.0);
        assert!(r
            .inputs(2.0, None, &[], &[1], 8192, &profile())
            .unwrap()
            .is_some());
    }

    #[test]
    fn a_stop_hands_over_only_as_the_last_instance_before_a_launch() {
        assert!(Replanner::handover(false, true));
        assert!(!Replanner::handover(true, true) && !Replanner::handover(false, false));
    }
}
