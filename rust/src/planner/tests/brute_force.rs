//! Stage 1 against a brute-force enumeration of DESIGN §7's model as written there: every
//! achievable vector of instance counts (from per-node allocations `x_nd`) and every batch
//! choice `z_db` is enumerated; with those fixed the bilinear model is an LP in DESIGN's
//! own variables (`s_kc`, `s_kd`, `t_k`), solved lexicographically. No linearisation,
//! node-type pooling or layout enumeration of the planner is reused.

use std::collections::BTreeSet;

use good_lp::{constraint, variable, Expression};

use super::super::inputs::{PlannerInputs, RequestClass};
use super::super::plan_capacity;
use super::super::solver::{Model, Outcome, SolveSettings, Var};
use super::super::stage1::keep;
use super::{class, default_solver, inputs, profile, Lcg};
use crate::profile::{LatencyProfile, StepKind};

fn settings() -> SolveSettings {
    SolveSettings {
        solver: default_solver(),
        deadline: std::time::Instant::now() + std::time::Duration::from_secs(60),
        mip_gap: 0.0,
    }
}

/// Every instance-count vector one node of `gpus` GPUs can hold.
fn node_allocations(gpus: u32, degrees: &[u32]) -> Vec<Vec<u32>> {
    let mut out = vec![vec![]];
    for &d in degrees {
        out = out
            .into_iter()
            .flat_map(|prefix: Vec<u32>| {
                let used: u32 = prefix.iter().zip(degrees).map(|(c, d)| c * d).sum();
                (0..=(gpus - used) / d).map(move |c| {
                    let mut p = prefix.clone();
                    p.push(c);
                    p
                })
            })
            .collect();
    }
    out
}

/// Every cluster-wide count vector `Σ_n x_nd`.
fn cluster_counts(node_gpus: &[u32], degrees: &[u32]) -> BTreeSet<Vec<u32>> {
    let mut sums: BTreeSet<Vec<u32>> = [vec![0; degrees.len()]].into_iter().collect();
    for &g in node_gpus {
        let allocs = node_allocations(g, degrees);
        sums = sums
            .iter()
            .flat_map(|s| {
                allocs
                    .iter()
                    .map(move |a| s.iter().zip(a).map(|(x, y)| x + y).collect())
            })
            .collect();
    }
    sums
}

/// Batch choices for the degrees with instances (None for the others).
fn batch_choices(counts: &[u32], batches: &[u64]) -> Vec<Vec<Option<u64>>> {
    let mut out = vec![vec![]];
    for &c in counts {
        out = out
            .into_iter()
            .flat_map(|prefix: Vec<Option<u64>>| {
                let options: Vec<Option<u64>> = if c == 0 {
                    vec![None]
                } else {
                    batches.iter().map(|&b| Some(b)).collect()
                };
                options.into_iter().map(move |o| {
                    let mut p = prefix.clone();
                    p.push(o);
                    p
                })
            })
            .collect();
    }
    out
}

/// What to optimise in one LP of the enumeration.
enum Objective {
    /// Share of the load served at the lowest threshold.
    Load,
    Quality,
    Slack {
        min_quality: f64,
    },
    OverloadSlack {
        load: f64,
    },
}

/// `Σ coef·var + constant`, evaluated on a solution.
#[derive(Clone, Default)]
struct Affine {
    constant: f64,
    terms: Vec<(Var, f64)>,
}

impl Affine {
    fn add(&mut self, v: Var, c: f64) {
        self.terms.push((v, c));
    }

    fn expr(&self) -> Expression {
        self.terms
            .iter()
            .fold(Expression::from(self.constant), |e, &(v, c)| e + c * v.var)
    }

    fn eval(&self, values: &[f64]) -> f64 {
        self.terms
            .iter()
            .fold(self.constant, |s, &(v, c)| s + c * v.value(values))
    }
}

/// DESIGN's model with the batch choice and instance counts fixed: an LP. The load phase
/// (lowest threshold, served share `α`) writes steps as `α × steps per request` so that
/// `α` stays linear.
fn lp(
    inputs: &PlannerInputs,
    profile: &LatencyProfile,
    counts: &[u32],
    batch: &[Option<u64>],
    objective: &Objective,
) -> Option<f64> {
    let cfg = &inputs.config;
    let kinds: Vec<StepKind> = if cfg.caching {
        vec![StepKind::Recompute, StepKind::Cache]
    } else {
        vec![StepKind::NoCache]
    };
    let block = cfg.block_length as f64;
    let slo_of = |c: &RequestClass| c.slo_seconds.unwrap_or(cfg.slo_seconds);
    let mut thresholds = inputs.thresholds.clone();
    thresholds.sort_by(|a, b| a.threshold.total_cmp(&b.threshold));
    let total_rate: f64 = inputs.classes.iter().map(|c| c.rate).sum();
    let lowest_only = matches!(objective, Objective::Load | Objective::OverloadSlack { .. });
    let mut m = Model::new();
    let alpha = match objective {
        Objective::Load => m.add(variable().clamp(0.0, 1.0)),
        Objective::OverloadSlack { load } => m.add(variable().clamp(keep(*load).max(0.0), *load)),
        _ => m.add(variable().clamp(1.0, 1.0)),
    };
    let mut quality = Affine::default();
    let mut slack = Affine::default();
    let rate_weighted_slo: f64 = inputs.classes.iter().map(|c| c.rate * slo_of(c)).sum();
    slack.add(alpha, rate_weighted_slo);
    // busy[d]: instance-seconds per second of degree d.
    let mut busy: Vec<Affine> = vec![Affine::default(); counts.len()];
    for class in &inputs.classes {
        // Workers decode whole blocks.
        let (o, rate) = ((class.output_tokens / block).ceil() * block, class.rate);
        let sequence = class.prompt_tokens + o;
        let s: Vec<Var> = thresholds
            .iter()
            .map(|_| m.add(variable().min(0.0)))
            .collect();
        let sd: Vec<Vec<Var>> = counts
            .iter()
            .map(|_| kinds.iter().map(|_| m.add(variable().min(0.0))).collect())
            .collect();
        let committed: Expression = s
            .iter()
            .zip(&thresholds)
            .map(|(v, t)| t.tokens_per_step * v.var)
            .sum();
        m.constrain(constraint!(committed == o));
        // Steps of each kind a request needs (times α in the load phase).
        let steps: Expression = s.iter().map(|v| v.var).sum();
        let recompute = o / block;
        let needed: Vec<Expression> = if lowest_only {
            for v in &s[1..] {
                m.constrain(constraint!(v.var == 0.0));
            }
            let total = o / thresholds[0].tokens_per_step;
            if cfg.caching {
                vec![recompute * alpha.var, (total - recompute) * alpha.var]
            } else {
                vec![total * alpha.var]
            }
        } else if cfg.caching {
            vec![Expression::from(recompute), steps - recompute]
        } else {
            vec![steps]
        };
        for (kind, need) in needed.into_iter().enumerate() {
            let placed: Expression = sd.iter().map(|per| per[kind].var).sum();
            m.constrain(constraint!(placed == need));
        }
        let mut latency = Affine::default();
        for (d, &degree) in cfg.degrees.iter().enumerate() {
            let Some(b) = batch[d] else {
                for v in &sd[d] {
                    m.constrain(constraint!(v.var == 0.0));
                }
                continue;
            };
            for (kind, &k) in kinds.iter().enumerate() {
                let lat = profile
                    .step_time(degree, k, b as f64, sequence)
                    .expect("degree profiled");
                let tokens = if k == StepKind::Cache {
                    block
                } else {
                    sequence
                };
                // A step larger than the batch cannot run there.
                if tokens > b as f64 {
                    m.constrain(constraint!(sd[d][kind].var == 0.0));
                    continue;
                }
                latency.add(sd[d][kind], lat);
                busy[d].add(sd[d][kind], rate * tokens * lat / b as f64);
            }
        }
        let bound = slo_of(class) * alpha.var;
        let t = latency.expr();
        m.constrain(constraint!(t <= bound));
        for &(v, c) in &latency.terms {
            slack.add(v, -rate * c);
        }
        for (v, t) in s.iter().zip(&thresholds) {
            quality.add(*v, rate * t.threshold * t.tokens_per_step / o / total_rate);
        }
    }
    for (d, b) in busy.iter().enumerate() {
        let e = b.expr();
        m.constrain(constraint!(e <= counts[d] as f64));
    }
    if let Objective::Slack { min_quality } = objective {
        let q = quality.expr();
        m.constrain(constraint!(q >= *min_quality));
    }
    let goal = match objective {
        Objective::Load => {
            let mut a = Affine::default();
            a.add(alpha, 1.0);
            a
        }
        Objective::Quality => quality,
        Objective::Slack { .. } | Objective::OverloadSlack { .. } => slack,
    };
    match m
        .maximise(goal.expr(), &settings(), None)
        .expect("LP solves")
    {
        Outcome::Solved { values, .. } => Some(goal.eval(&values)),
        Outcome::Infeasible => None,
        Outcome::NoSolutionInTime => panic!("an LP of the enumeration timed out"),
    }
}

/// The brute-force optimum: (overloaded, served load, quality, slack).
fn brute_force(inputs: &PlannerInputs, profile: &LatencyProfile) -> (bool, f64, f64, f64) {
    let cfg = &inputs.config;
    let mut candidates = Vec::new();
    for counts in cluster_counts(&inputs.node_gpus, &cfg.degrees) {
        for batch in batch_choices(&counts, &cfg.batch_tokens) {
            candidates.push((counts.clone(), batch));
        }
    }
    let best = |objective: &Objective| {
        candidates
            .iter()
            .filter_map(|(c, b)| lp(inputs, profile, c, b, objective))
            .fold(f64::NEG_INFINITY, f64::max)
    };
    let load = best(&Objective::Load);
    if load < 1.0 - 1e-7 {
        let slack = best(&Objective::OverloadSlack { load });
        return (true, load, thresholds_lowest(inputs), slack);
    }
    let quality = best(&Objective::Quality);
    let slack = best(&Objective::Slack {
        min_quality: keep(quality),
    });
    (false, load, quality, slack)
}

fn thresholds_lowest(inputs: &PlannerInputs) -> f64 {
    inputs
        .thresholds
        .iter()
        .map(|t| t.threshold)
        .fold(f64::INFINITY, f64::min)
}

fn assert_matches_brute_force(inputs: &PlannerInputs) -> (bool, f64) {
    let profile = profile();
    let (overloaded, load, quality, slack) = brute_force(inputs, &profile);
    let plan = plan_capacity(inputs, &profile).expect("planner solves");
    let v = plan.value;
    let close = |a: f64, b: f64, tol: f64| (a - b).abs() <= tol * b.abs().max(1.0);
    assert_eq!(
        plan.overloaded, overloaded,
        "overload verdict differs: {plan:?}"
    );
    assert!(
        close(v.sustained_load, load, 1e-6),
        "load {} vs brute force {load}",
        v.sustained_load
    );
    assert!(
        close(v.quality, quality, 1e-6),
        "quality {} vs brute force {quality}",
        v.quality
    );
    assert!(
        close(v.latency_slack, slack, 1e-5),
        "slack {} vs brute force {slack}",
        v.latency_slack
    );
    (overloaded, quality)
}

/// Random small clusters across light, loaded and overloaded regimes, with node sizes on
/// both packing paths (pooled 4-GPU nodes, layout-enumerated 6-GPU nodes), one SLO for
/// every class or one per class.
#[test]
fn stage1_optimum_equals_enumeration() {
    let mut rng = Lcg(7);
    let mut class_slo = Lcg(11);
    let mut regimes = BTreeSet::new();
    for case in 0..10 {
        let nodes = if case % 3 == 2 {
            vec![6, 6]
        } else {
            vec![4, 4]
        };
        let degrees = vec![1, 2, 4];
        let load = rng.range(0.2, 3.0);
        let classes = (0..3)
            .map(|_| {
                class(
                    rng.range(50.0, 800.0),
                    rng.range(64.0, 512.0),
                    load * rng.range(0.5, 2.0),
                )
            })
            .collect();
        let mut inp = inputs(
            classes,
            nodes,
            degrees,
            vec![1024, 4096],
            rng.range(8.0, 30.0),
        );
        inp.config.caching = case % 2 == 1;
        if case % 4 == 0 {
            // Per-class SLOs, as scaled default SLOs give (long classes get longer ones).
            for c in &mut inp.classes {
                c.slo_seconds = Some(inp.config.slo_seconds * class_slo.range(0.5, 2.0));
            }
        }
        let (overloaded, quality) = assert_matches_brute_force(&inp);
        let regime = if overloaded {
            "overloaded"
        } else if quality < 0.9 - 1e-6 {
            "loaded"
        } else {
            "light"
        };
        regimes.insert(regime);
    }
    assert_eq!(
        regimes.len(),
        3,
        "cases must cover every regime, got {regimes:?}"
    );
}
