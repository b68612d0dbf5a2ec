//! Stage 1, the capacity plan: how many instances of each TP degree, at which batch size,
//! and which threshold mix each request class runs at (DESIGN §7).
//!
//! The objective is lexicographic, solved as a chain of MILPs, each warm-started from the
//! previous one's optimum (always feasible for the next); the first is warm-started from
//! the running deployment when there is one:
//!
//! 1. *Quality*: serve all of the load, maximise the rate-weighted mean threshold; a class
//!    too long for the SLO on any instance runs at the lowest threshold, planned for
//!    throughput only, and the others keep their choice. If no configuration carries the
//!    load (the MILP is infeasible) the cluster is *overloaded*; then instead
//!    *Load*: every class at the lowest threshold, maximise the served share `α ≤ 1`. The
//!    plan returned sustains the most load at the lowest threshold and says it is
//!    overloaded; there is no arbitrary fallback.
//! 2. *Slack*: keeping 1 at its optimum, maximise latency slack, so equal-quality plans
//!    (light load, where every class sits at the top threshold) are told apart by latency.
//! 3. *Spare*: keeping thresholds, batch choice and routing of 2, place instances where the
//!    load is: each option's instances weigh its share of the busy time, plus a small weight
//!    for throughput so GPUs no load needs still go somewhere definite. At light load every
//!    GPU joins the fastest degree rather than an arbitrary mix. Only instance counts are
//!    free here, so this MILP is tiny.

pub(crate) mod model;

use serde::{Deserialize, Serialize};

use self::model::{
    build, busy, instances_of, quality, slack, throughput, Demand, Fixed, Goal, PhaseSpec, Vars,
};
use super::capacity::{place_on_nodes, NodeType, Packing};
use super::error::PlannerError;
use super::inputs::{Deployment, Problem};
use super::solver::{Outcome, SolveSettings, SolveStatus};

/// Weight of throughput, relative to load share, in the spare-capacity phase.
const IDLE_THROUGHPUT_WEIGHT: f64 = 1e-3;

/// One TP degree in the capacity plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DegreePlan {
    pub degree: u32,
    pub instances: u32,
    /// Tokens per forward; `None` when the degree carries no load.
    pub batch_tokens: Option<u64>,
    /// Share of the degree's instance time the planned load keeps busy.
    pub utilisation: f64,
    /// Tokens per second the degree's instances process at the chosen batch size.
    pub capacity_tokens_per_second: f64,
}

/// One request class in the capacity plan.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ClassPlan {
    /// Share of output tokens committed at each threshold (ascending threshold order).
    pub threshold_mix: Vec<f64>,
    pub mean_threshold: f64,
    pub steps_per_request: f64,
    pub latency_seconds: f64,
    /// Whether any instance could serve the class within the SLO.
    pub slo_reachable: bool,
    /// Share of the class's steps on each degree (same order as `CapacityPlan::degrees`).
    pub degree_share: Vec<f64>,
}

/// Objective values of a plan, compared by the adoption rule.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlanValue {
    /// Share of the offered load the plan serves within the SLO (1 unless overloaded).
    pub sustained_load: f64,
    /// Rate-weighted mean threshold.
    pub quality: f64,
    /// `Σ_k rate_k·(SLO − latency_k)` over served requests, request-seconds per second.
    pub latency_slack: f64,
}

/// Stage-1 result.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CapacityPlan {
    pub status: SolveStatus,
    pub overloaded: bool,
    pub value: PlanValue,
    /// Factor by which the load may grow before a degree saturates at this plan's mix.
    pub headroom: f64,
    pub thresholds: Vec<f64>,
    pub degrees: Vec<DegreePlan>,
    /// Target instances per node and degree (same degree order as `degrees`): one feasible
    /// placement; Stage 2 re-chooses it to keep running instances.
    pub instances_per_node: Vec<Vec<u32>>,
    pub classes: Vec<ClassPlan>,
}

/// Values of one solved phase.
struct Point {
    values: Vec<f64>,
    status: SolveStatus,
}

/// Chains the phases over one problem.
pub(crate) struct Stage1<'a> {
    pub problem: &'a Problem,
    pub types: &'a [NodeType],
    pub settings: SolveSettings,
    /// Classes no option can serve within the SLO.
    pub exempt: Vec<bool>,
}

/// The plan a phase chain ends in, with its variables for extraction.
pub(crate) struct Solved {
    /// Optimum of the load phase (all lowest thresholds) if it ran: a warm start for
    /// another load phase.
    load_values: Option<Vec<f64>>,
    values: Vec<f64>,
    vars: Vars,
    status: SolveStatus,
    overloaded: bool,
}

/// Relative tolerance when a later phase keeps an earlier optimum: far below any gain
/// worth having, above the solvers' feasibility tolerance relative to the objectives.
pub(crate) const KEEP_TOLERANCE: f64 = 1e-8;

/// The bound a later phase keeps an earlier optimum `value` at.
pub(crate) fn keep(value: f64) -> f64 {
    value - KEEP_TOLERANCE * value.abs().max(1.0)
}

impl<'a> Stage1<'a> {
    pub fn new(problem: &'a Problem, types: &'a [NodeType], settings: SolveSettings) -> Self {
        let exempt = unreachable_classes(problem);
        Self {
            problem,
            types,
            settings,
            exempt,
        }
    }

    fn spec<'s>(&'s self, demand: Demand, goal: Goal, fixed: Option<&'s Fixed>) -> PhaseSpec<'s> {
        PhaseSpec {
            demand,
            goal,
            min_quality: None,
            min_slack: None,
            exempt: &self.exempt,
            fixed,
            pin: None,
        }
    }

    /// Solves one phase (`None`: infeasible); without time for a better answer the warm
    /// start stands.
    fn phase(
        &self,
        spec: &PhaseSpec<'_>,
        warm: Option<&Point>,
    ) -> Result<Option<(Point, Vars)>, PlannerError> {
        let built = build(self.problem, self.types, spec);
        let vars = built.vars.clone();
        let outcome = built.model.maximise(
            built.objective,
            &self.settings,
            warm.map(|p| p.values.as_slice()),
        )?;
        match (outcome, warm) {
            (Outcome::Solved { values, status }, _) => Ok(Some((Point { values, status }, vars))),
            (Outcome::Infeasible, _) => Ok(None),
            (Outcome::NoSolutionInTime, Some(w)) => Ok(Some((
                Point {
                    values: w.values.clone(),
                    status: SolveStatus::TimeLimit,
                },
                vars,
            ))),
            (Outcome::NoSolutionInTime, None) => {
                Err(self.fail("no feasible plan found within the time limit"))
            }
        }
    }

    fn fail(&self, message: &str) -> PlannerError {
        PlannerError::Solver {
            solver: self.settings.solver.as_str(),
            message: message.into(),
        }
    }

    /// A phase that admits its warm start (or serving nothing) cannot be infeasible; if the
    /// solver says so it lost an earlier optimum to tolerances.
    fn feasible_phase(
        &self,
        spec: &PhaseSpec<'_>,
        warm: Option<&Point>,
    ) -> Result<(Point, Vars), PlannerError> {
        self.phase(spec, warm)?
            .ok_or_else(|| self.fail("a phase found no point although an earlier phase had"))
    }

    /// Runs the lexicographic chain, optionally with a fixed batch choice and instance
    /// counts (to evaluate a deployment), warm-started where `warm` offers a point.
    pub fn solve(&self, fixed: Option<&Fixed>, warm: &Warm) -> Result<Solved, PlannerError> {
        let p = self.problem;
        // Quality first: it is infeasible exactly when the cluster is overloaded. Classes
        // that cannot meet the SLO anywhere (`exempt`) sit at the lowest threshold in it.
        let spec = self.spec(Demand::Full, Goal::Quality, fixed);
        let full_load = self.phase(&spec, warm.quality.as_ref())?;
        let (demand, min_quality, best, vars, load_values) = match full_load {
            Some((point, vars)) => {
                let q = quality(p, &vars).eval(&point.values);
                (Demand::Full, Some(keep(q)), point, vars, None)
            }
            None => {
                let lowest = Demand::Lowest {
                    min_load: 0.0,
                    max_load: 1.0,
                };
                let spec = self.spec(lowest, Goal::Load, fixed);
                let (point, vars) = self.feasible_phase(&spec, warm.load.as_ref())?;
                let alpha = vars.alpha.value(&point.values);
                let demand = Demand::Lowest {
                    min_load: keep(alpha).max(0.0),
                    max_load: alpha,
                };
                let load_values = Some(point.values.clone());
                (demand, None, point, vars, load_values)
            }
        };
        let overloaded = min_quality.is_none();
        let mut spec = self.spec(demand, Goal::Slack, fixed);
        spec.min_quality = min_quality;
        let (slack_point, _) = self.feasible_phase(&spec, Some(&best))?;
        let mut status = best.status.worst(slack_point.status);
        // A fixed deployment has no ties left to settle.
        let point = if fixed.is_some() {
            slack_point
        } else {
            let weights = spare_weights(p, &vars, &slack_point.values);
            let mut spare = self.spec(demand, Goal::Spare(weights), None);
            spare.pin = Some(&slack_point.values);
            // Every variable but the instance counts is fixed here; a backend that loses
            // the pinned point to its tolerances leaves the slack point's placement.
            match self.phase(&spare, Some(&slack_point))? {
                Some((point, _)) => {
                    status = status.worst(point.status);
                    point
                }
                None => slack_point,
            }
        };
        Ok(Solved {
            load_values,
            values: point.values,
            vars,
            status,
            overloaded,
        })
    }

    /// The warm starts a solved deployment offers to the free solve.
    pub fn warm_from(&self, solved: &Solved) -> Warm {
        let point = |values: &Vec<f64>| Point {
            values: values.clone(),
            status: solved.status,
        };
        Warm {
            load: solved.load_values.as_ref().map(point),
            quality: (!solved.overloaded).then(|| point(&solved.values)),
        }
    }

    /// Objective values of a solved chain.
    pub fn value(&self, solved: &Solved) -> PlanValue {
        PlanValue {
            sustained_load: solved.vars.alpha.value(&solved.values),
            quality: quality(self.problem, &solved.vars).eval(&solved.values),
            latency_slack: slack(self.problem, &solved.vars).eval(&solved.values),
        }
    }

    /// Reads the plan out of a solved chain.
    pub fn extract(&self, solved: &Solved) -> Result<CapacityPlan, PlannerError> {
        let p = self.problem;
        let values = &solved.values;
        let vars = &solved.vars;
        let count = |x: f64| x.round().max(0.0) as u32;
        let instances: Vec<u32> = (0..p.degrees.len())
            .map(|d| count(instances_of(self.types, vars, d).eval(values)))
            .collect();
        let mut headroom = f64::INFINITY;
        let degrees = p
            .degrees
            .iter()
            .enumerate()
            .map(|(d, &degree)| {
                let chosen = p.options_of(d).find(|&j| vars.z[j].value(values) > 0.5);
                let used = chosen.map(|j| busy(p, vars, j).eval(values)).unwrap_or(0.0);
                if used > 1e-9 {
                    headroom = headroom.min(instances[d] as f64 / used);
                }
                DegreePlan {
                    degree,
                    instances: instances[d],
                    batch_tokens: chosen.map(|j| p.options[j].batch),
                    utilisation: if instances[d] > 0 {
                        used / instances[d] as f64
                    } else {
                        0.0
                    },
                    capacity_tokens_per_second: chosen
                        .map(|j| instances[d] as f64 * throughput(p, j))
                        .unwrap_or(0.0),
                }
            })
            .collect();
        let alpha = vars.alpha.value(values);
        let classes = p
            .classes
            .iter()
            .enumerate()
            .map(|(k, class)| {
                let mix: Vec<f64> = vars.f[k]
                    .iter()
                    .map(|f| f.value(values).clamp(0.0, 1.0))
                    .collect();
                let steps: f64 = (0..p.kinds.len())
                    .map(|kind| {
                        mix.iter()
                            .zip(&class.steps[kind])
                            .map(|(f, s)| f * s)
                            .sum::<f64>()
                    })
                    .sum();
                let served = class.rate * alpha;
                let mut per_degree = vec![0.0; p.degrees.len()];
                let mut latency = 0.0;
                for (j, per_kind) in vars.v[k].iter().enumerate() {
                    for (kind, v) in per_kind.iter().enumerate() {
                        let Some(v) = v else { continue };
                        per_degree[p.options[j].degree_index] += v.value(values);
                        latency += class.latency[j][kind] * v.value(values);
                    }
                }
                let total: f64 = per_degree.iter().sum();
                ClassPlan {
                    mean_threshold: mix
                        .iter()
                        .zip(&p.thresholds)
                        .map(|(f, t)| f * t.threshold)
                        .sum(),
                    threshold_mix: mix,
                    steps_per_request: steps,
                    latency_seconds: if served > 0.0 { latency / served } else { 0.0 },
                    slo_reachable: !self.exempt[k],
                    degree_share: per_degree
                        .iter()
                        .map(|s| if total > 0.0 { s / total } else { 0.0 })
                        .collect(),
                }
            })
            .collect();
        Ok(CapacityPlan {
            status: solved.status,
            overloaded: solved.overloaded,
            value: self.value(solved),
            headroom: if headroom.is_finite() { headroom } else { 0.0 },
            thresholds: p.thresholds.iter().map(|t| t.threshold).collect(),
            degrees,
            instances_per_node: self.place(vars, values)?,
            classes,
        })
    }

    fn place(&self, vars: &Vars, values: &[f64]) -> Result<Vec<Vec<u32>>, PlannerError> {
        let counts: Vec<Vec<u32>> = vars
            .cap
            .iter()
            .map(|c| {
                c.iter()
                    .map(|v| v.value(values).round().max(0.0) as u32)
                    .collect()
            })
            .collect();
        let pooled: Vec<Vec<u32>> = self
            .types
            .iter()
            .zip(&counts)
            .map(|(t, c)| {
                if t.packing == Packing::Pooled {
                    c.clone()
                } else {
                    Vec::new()
                }
            })
            .collect();
        let layouts: Vec<Vec<u32>> = self
            .types
            .iter()
            .zip(&counts)
            .map(|(t, c)| {
                if t.packing == Packing::Pooled {
                    Vec::new()
                } else {
                    c.clone()
                }
            })
            .collect();
        place_on_nodes(
            self.types,
            self.problem.node_gpus.len(),
            self.problem.degrees.len(),
            &self.problem.degrees,
            &pooled,
            &layouts,
        )
    }
}

/// Per option: its share of the busy time at `values`, plus a small throughput term.
fn spare_weights(problem: &Problem, vars: &Vars, values: &[f64]) -> Vec<f64> {
    let busy: Vec<f64> = (0..problem.options.len())
        .map(|j| busy(problem, vars, j).eval(values).max(0.0))
        .collect();
    let total: f64 = busy.iter().sum::<f64>().max(1e-12);
    let fastest = (0..problem.options.len())
        .map(|j| throughput(problem, j))
        .fold(0.0, f64::max);
    busy.iter()
        .enumerate()
        .map(|(j, b)| b / total + IDLE_THROUGHPUT_WEIGHT * throughput(problem, j) / fastest)
        .collect()
}

/// Warm starts for the load and quality phases.
#[derive(Default)]
pub(crate) struct Warm {
    load: Option<Point>,
    quality: Option<Point>,
}

/// Classes whose requests exceed the SLO even at the lowest threshold on the fastest
/// instances: recompute and cache steps may sit on different degrees, but one degree runs
/// one batch size.
fn unreachable_classes(problem: &Problem) -> Vec<bool> {
    let kinds = problem.kinds.len();
    let n = problem.options.len();
    problem
        .classes
        .iter()
        .map(|class| {
            let mut best = f64::INFINITY;
            let combos = n.pow(kinds as u32);
            for combo in 0..combos {
                let picks: Vec<usize> = (0..kinds).map(|i| combo / n.pow(i as u32) % n).collect();
                let compatible = picks.iter().all(|&a| {
                    picks.iter().all(|&b| {
                        a == b || problem.options[a].degree_index != problem.options[b].degree_index
                    })
                });
                let fit = picks
                    .iter()
                    .enumerate()
                    .all(|(kind, &j)| class.fits[j][kind]);
                if compatible && fit {
                    let t: f64 = picks
                        .iter()
                        .enumerate()
                        .map(|(kind, &j)| class.steps[kind][0] * class.latency[j][kind])
                        .sum();
                    best = best.min(t);
                }
            }
            best > class.slo
        })
        .collect()
}

/// The batch choice and instance counts of a running deployment, as model constants.
pub(crate) fn fixed_from(problem: &Problem, current: &Deployment) -> Fixed {
    let mut chosen = vec![false; problem.options.len()];
    let mut instances = vec![0.0; problem.options.len()];
    for (d, &degree) in problem.degrees.iter().enumerate() {
        let count = current
            .instances
            .iter()
            .filter(|i| i.degree == degree)
            .count();
        let Some(&batch) = current.batch_tokens.get(&degree) else {
            continue;
        };
        if count == 0 {
            continue;
        }
        if let Some(j) = problem
            .options_of(d)
            .find(|&j| problem.options[j].batch == batch)
        {
            chosen[j] = true;
            instances[j] = count as f64;
        }
    }
    Fixed { chosen, instances }
}
