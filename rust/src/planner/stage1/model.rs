//! The Stage-1 MILP (DESIGN §7) with its bilinear terms linearised exactly.
//!
//! DESIGN's variables are per-request steps `s_kd` on degree `d`, a binary `z_db` picking
//! each degree's batch size and integer instance counts `x_nd`; latency and stability
//! multiply `z` with `s` and with `x`. Here every (degree, batch) pair is an *option* `j`
//! and the products are disaggregated over the options (a disjunctive, convex-hull style
//! reformulation, not big-M on a sum):
//!
//! * `v[k][j][kind]` = rate_k × steps of that kind a class-k request spends on option `j`
//!   (steps per second), so `z_j·s_kd` becomes `v[k][j]`, forced to 0 unless `z_j = 1`
//!   by a bound that is already implied by demand, latency or capacity (no loose M);
//! * `x_j` = instances of the option's degree working at its batch size, `x_j ≤ U_d z_j`
//!   with `U_d` the most instances of that degree the cluster can hold;
//! * `Σ_b z_db ≤ 1` in an ordered (cumulative) binary encoding, and a degree without
//!   instances picks nothing, so it adds no symmetric branches.
//!
//! For any 0/1 `z` the model is DESIGN's model with that batch choice, so the optimum is
//! unchanged. Thresholds enter as `f[k][c]`, the share of class-k output tokens committed at
//! threshold c (`f = T_c s_kc / O_k`, bounded in [0, 1]), which keeps coefficients near 1.
//! Instance counts per degree come from `capacity`'s symmetry-free node-type variables.
//!
//! The served share `α` of the offered load is a variable only in the overload phases,
//! where thresholds are fixed at the lowest: there the demand `α·rate·steps` and the
//! latency bound `α·rate·SLO` stay linear because the flows `v` already carry the rate.

use good_lp::{constraint, variable, Expression, VariableDefinition};

use super::super::capacity::{NodeType, Packing};
use super::super::inputs::Problem;
use super::super::solver::{Model, Var};

/// Which demand the phase must serve.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Demand {
    /// Every class at the lowest threshold; a share `α ≥ min_load` of the offered load.
    Lowest { min_load: f64, max_load: f64 },
    /// All of the offered load, thresholds free.
    Full,
}

/// What the phase maximises.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Goal {
    Load,
    Quality,
    Slack,
    /// `Σ_j weight_j·x_j`: instances where the load is, to settle ties left after quality
    /// and slack.
    Spare(Vec<f64>),
}

/// A fixed batch choice and instance counts (a deployment being evaluated).
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Fixed {
    pub chosen: Vec<bool>,
    pub instances: Vec<f64>,
}

/// One phase of the lexicographic solve.
#[derive(Clone, Debug)]
pub(crate) struct PhaseSpec<'a> {
    pub demand: Demand,
    pub goal: Goal,
    pub min_quality: Option<f64>,
    pub min_slack: Option<f64>,
    /// Classes that no option can serve within the SLO: planned for throughput only.
    pub exempt: &'a [bool],
    /// A deployment's batch choice and instance counts; its capacity variables are then
    /// continuous (the deployment runs, so its packing needs no proof).
    pub fixed: Option<&'a Fixed>,
    /// A solved point whose batch choice, thresholds and flows this phase keeps, leaving
    /// only the instance counts free.
    pub pin: Option<&'a [f64]>,
}

/// Handles of every model variable, created in the same order in every phase so one
/// phase's solution is a warm start for the next.
#[derive(Clone, Debug)]
pub(crate) struct Vars {
    pub alpha: Var,
    pub f: Vec<Vec<Var>>,
    /// `None` where the class's step of that kind does not fit the option's batch: no
    /// variable at all, rather than one fixed at 0 that some backends stumble over.
    pub v: Vec<Vec<Vec<Option<Var>>>>,
    pub z: Vec<Var>,
    /// Per degree, the cumulative batch binary of its largest batch: 1 iff the degree runs.
    pub last_w: Vec<Var>,
    pub x: Vec<Var>,
    /// Per node type: pooled instance counts per fitting degree, or nodes per layout.
    pub cap: Vec<Vec<Var>>,
}

/// A linear function `constant + Σ coef·var`, kept as terms so the same definition both
/// builds constraints and evaluates solutions.
pub(crate) struct Linear {
    pub constant: f64,
    pub terms: Vec<(Var, f64)>,
}

impl Linear {
    pub fn expr(&self) -> Expression {
        self.terms
            .iter()
            .fold(Expression::from(self.constant), |e, &(v, c)| e + c * v.var)
    }

    pub fn eval(&self, values: &[f64]) -> f64 {
        self.terms
            .iter()
            .fold(self.constant, |s, &(v, c)| s + c * v.value(values))
    }
}

/// Rate-weighted mean threshold (DESIGN's quality objective divided by the total rate).
pub(crate) fn quality(problem: &Problem, vars: &Vars) -> Linear {
    let total = problem.total_rate();
    let mut terms = Vec::new();
    for (k, class) in problem.classes.iter().enumerate() {
        for (c, t) in problem.thresholds.iter().enumerate() {
            terms.push((vars.f[k][c], class.rate * t.threshold / total));
        }
    }
    Linear {
        constant: 0.0,
        terms,
    }
}

/// Latency slack of the served requests, `Σ_k α·rate_k·(SLO_k − t_k)`, in request-seconds
/// per second.
pub(crate) fn slack(problem: &Problem, vars: &Vars) -> Linear {
    let mut terms = vec![(vars.alpha, problem.rate_weighted_slo())];
    for (class, per_option) in problem.classes.iter().zip(&vars.v) {
        for (j, per_kind) in per_option.iter().enumerate() {
            for (kind, v) in per_kind.iter().enumerate() {
                let Some(v) = *v else { continue };
                terms.push((v, -class.latency[j][kind]));
            }
        }
    }
    Linear {
        constant: 0.0,
        terms,
    }
}

/// Busy instance-seconds per second of option `j` (its utilisation times instances).
pub(crate) fn busy(problem: &Problem, vars: &Vars, j: usize) -> Linear {
    let mut terms = Vec::new();
    for (k, class) in problem.classes.iter().enumerate() {
        for (kind, v) in vars.v[k][j].iter().enumerate() {
            let Some(v) = *v else { continue };
            terms.push((v, class.busy[j][kind]));
        }
    }
    Linear {
        constant: 0.0,
        terms,
    }
}

/// Tokens per second one instance of option `j` processes (of the first step kind).
pub(crate) fn throughput(problem: &Problem, j: usize) -> f64 {
    1.0 / problem.options[j].full_secs_per_token
}

/// Instances of degree index `d` the capacity variables provide.
pub(crate) fn instances_of(types: &[NodeType], vars: &Vars, d: usize) -> Linear {
    let mut terms = Vec::new();
    for (t, ty) in types.iter().enumerate() {
        let Some(k) = ty.degrees.iter().position(|&x| x == d) else {
            continue;
        };
        match &ty.packing {
            Packing::Pooled => terms.push((vars.cap[t][k], 1.0)),
            Packing::Layouts(layouts) => {
                for (l, layout) in layouts.iter().enumerate() {
                    if layout[k] > 0 {
                        terms.push((vars.cap[t][l], layout[k] as f64));
                    }
                }
            }
        }
    }
    Linear {
        constant: 0.0,
        terms,
    }
}

/// Most instances of each degree the whole cluster can hold.
pub(crate) fn max_instances(problem: &Problem, types: &[NodeType]) -> Vec<f64> {
    problem
        .degrees
        .iter()
        .map(|&d| {
            types
                .iter()
                .filter(|t| t.gpus >= d)
                .map(|t| t.max_instances(d) as f64)
                .sum()
        })
        .collect()
}

/// Largest steps per request of each kind a class may need in this phase.
fn max_steps(problem: &Problem, k: usize, kind: usize, demand: Demand) -> f64 {
    let steps = &problem.classes[k].steps[kind];
    match demand {
        Demand::Lowest { .. } => steps[0],
        Demand::Full => steps.iter().copied().fold(0.0, f64::max),
    }
}

/// Tight upper bound of the flow `v[k][j][kind]`: demand, latency and the most instances
/// of the option's degree each cap it; the smallest is the `M` of its link to `z_j`.
fn flow_bound(
    problem: &Problem,
    spec: &PhaseSpec<'_>,
    max_inst: &[f64],
    k: usize,
    j: usize,
    kind: usize,
) -> f64 {
    let class = &problem.classes[k];
    let by_demand = class.rate * max_steps(problem, k, kind, spec.demand);
    let by_capacity = max_inst[problem.options[j].degree_index] / class.busy[j][kind];
    let by_latency = if spec.exempt[k] {
        f64::INFINITY
    } else {
        class.rate * class.slo / class.latency[j][kind]
    };
    by_demand.min(by_capacity).min(by_latency)
}

/// Per option, whether the phase fixes its batch choice (`Some`) or leaves it to the
/// solver: a fixed deployment fixes every degree; a pinned point fixes the batch of each
/// degree that carries load there and frees the others, whose instances the spare phase
/// may then move. `z_start` is where the `z` variables will sit in the pinned point.
fn batch_choice(
    problem: &Problem,
    spec: &PhaseSpec<'_>,
    v: &[Vec<Vec<Option<Var>>>],
    z_start: usize,
) -> Vec<Option<bool>> {
    if let Some(fixed) = spec.fixed {
        return fixed.chosen.iter().map(|&c| Some(c)).collect();
    }
    let Some(values) = spec.pin else {
        return vec![None; problem.options.len()];
    };
    let flow = |j: usize| -> f64 {
        v.iter()
            .flat_map(|per| per[j].iter().flatten())
            .map(|f| f.value(values))
            .sum()
    };
    let mut choice = vec![None; problem.options.len()];
    for d in 0..problem.degrees.len() {
        let chosen = problem.options_of(d).find(|&j| values[z_start + j] > 0.5);
        if let Some(used) = chosen.filter(|&j| flow(j) > 1e-9) {
            for j in problem.options_of(d) {
                choice[j] = Some(j == used);
            }
        }
    }
    choice
}

fn add_variables(
    model: &mut Model,
    problem: &Problem,
    types: &[NodeType],
    spec: &PhaseSpec<'_>,
    max_inst: &[f64],
) -> Vars {
    // A pinned phase fixes every variable up to `x` at the pinned point's value.
    let pinned = |model: &mut Model, def: VariableDefinition| match spec.pin {
        Some(values) => {
            let value = values[model.len()];
            model.add(variable().clamp(value, value))
        }
        None => model.add(def),
    };
    let alpha = match spec.demand {
        Demand::Lowest { min_load, max_load } => {
            pinned(model, variable().clamp(min_load, max_load))
        }
        Demand::Full => pinned(model, variable().clamp(1.0, 1.0)),
    };
    // A class no option serves within the SLO runs at the lowest threshold, the fastest it
    // can; the others keep their free mix.
    let f = (0..problem.classes.len())
        .map(|k| {
            let lowest = matches!(spec.demand, Demand::Lowest { .. }) || spec.exempt[k];
            (0..problem.thresholds.len())
                .map(|c| {
                    if lowest {
                        let fixed = if c == 0 { 1.0 } else { 0.0 };
                        pinned(model, variable().clamp(fixed, fixed))
                    } else {
                        pinned(model, variable().clamp(0.0, 1.0))
                    }
                })
                .collect()
        })
        .collect();
    let v: Vec<Vec<Vec<Option<Var>>>> = (0..problem.classes.len())
        .map(|k| {
            (0..problem.options.len())
                .map(|j| {
                    (0..problem.kinds.len())
                        .map(|kind| {
                            problem.classes[k].fits[j][kind].then(|| {
                                let bound = flow_bound(problem, spec, max_inst, k, j, kind);
                                pinned(model, variable().clamp(0.0, bound))
                            })
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    // Batch choice in the ordered (cumulative) encoding: per degree, binaries `w_j = 1` iff
    // the degree runs at a batch of at most `b_j` (options ascend by batch), and
    // `z_j = w_j − w_{j−1}`. Same feasible set and LP bound as one binary per option, but a
    // branch on `w_j` splits the batch range in two, so the LP cannot keep interpolating
    // between neighbouring batch sizes on both sides of a branch.
    let choice = batch_choice(problem, spec, &v, model.len());
    let z: Vec<Var> = choice
        .iter()
        .map(|c| {
            let (lo, hi) = match c {
                Some(true) => (1.0, 1.0),
                Some(false) => (0.0, 0.0),
                None => (0.0, 1.0),
            };
            model.add(variable().clamp(lo, hi))
        })
        .collect();
    let mut w: Vec<Var> = Vec::with_capacity(problem.options.len());
    for j in 0..problem.options.len() {
        let def = if choice[j].is_none() {
            variable().binary()
        } else {
            variable().clamp(0.0, 1.0)
        };
        let wj = model.add(def);
        let same_degree =
            j > 0 && problem.options[j - 1].degree_index == problem.options[j].degree_index;
        let step: Expression = if same_degree {
            wj.var - w[j - 1].var
        } else {
            wj.var.into()
        };
        model.constrain(constraint!(z[j].var == step));
        w.push(wj);
    }
    let x = problem
        .options
        .iter()
        .enumerate()
        .map(|(j, option)| {
            let hi = match spec.fixed {
                Some(fixed) => fixed.instances[j],
                None => max_inst[option.degree_index],
            };
            model.add(variable().clamp(0.0, hi))
        })
        .collect();
    let count = |hi: u32| {
        let def = variable().clamp(0, hi);
        if spec.fixed.is_some() {
            def
        } else {
            def.integer()
        }
    };
    let cap = types
        .iter()
        .map(|ty| match &ty.packing {
            Packing::Pooled => ty
                .degrees
                .iter()
                .map(|&d| {
                    let hi = ty.max_instances(problem.degrees[d]);
                    model.add(count(hi))
                })
                .collect(),
            Packing::Layouts(layouts) => layouts
                .iter()
                .map(|_| model.add(count(ty.nodes.len() as u32)))
                .collect(),
        })
        .collect();
    let last_w = (0..problem.degrees.len())
        .filter_map(|d| problem.options_of(d).last().map(|j| w[j]))
        .collect();
    Vars {
        alpha,
        f,
        v,
        z,
        last_w,
        x,
        cap,
    }
}

fn add_demand_and_latency(model: &mut Model, problem: &Problem, vars: &Vars, spec: &PhaseSpec<'_>) {
    for (k, class) in problem.classes.iter().enumerate() {
        if matches!(spec.demand, Demand::Full) {
            let shares: Expression = vars.f[k].iter().map(|f| f.var).sum();
            model.constrain(constraint!(shares == 1.0));
        }
        for kind in 0..problem.kinds.len() {
            let served: Expression = vars.v[k]
                .iter()
                .filter_map(|per_kind| per_kind[kind].map(|v| v.var))
                .sum();
            let needed: Expression = match spec.demand {
                Demand::Lowest { .. } => class.rate * class.steps[kind][0] * vars.alpha.var,
                Demand::Full => vars.f[k]
                    .iter()
                    .enumerate()
                    .map(|(c, f)| class.rate * class.steps[kind][c] * f.var)
                    .sum(),
            };
            model.constrain(constraint!(served == needed));
        }
        if !spec.exempt[k] {
            let latency: Expression = vars.v[k]
                .iter()
                .enumerate()
                .flat_map(|(j, per_kind)| {
                    per_kind
                        .iter()
                        .enumerate()
                        .filter_map(move |(kind, v)| v.map(|v| class.latency[j][kind] * v.var))
                })
                .sum();
            model.constrain(constraint!(
                latency <= class.rate * class.slo * vars.alpha.var
            ));
        }
    }
}

fn add_capacity(
    model: &mut Model,
    problem: &Problem,
    types: &[NodeType],
    vars: &Vars,
    spec: &PhaseSpec<'_>,
    max_inst: &[f64],
) {
    for (j, option) in problem.options.iter().enumerate() {
        let busy = busy(problem, vars, j).expr();
        model.constrain(constraint!(busy <= vars.x[j].var));
        model.constrain(constraint!(
            vars.x[j].var <= max_inst[option.degree_index] * vars.z[j].var
        ));
        for (k, per_option) in vars.v.iter().enumerate() {
            for (kind, v) in per_option[j].iter().enumerate() {
                if let Some(v) = v {
                    let m = flow_bound(problem, spec, max_inst, k, j, kind);
                    model.constrain(constraint!(v.var <= m * vars.z[j].var));
                }
            }
        }
    }
    for d in 0..problem.degrees.len() {
        let working: Expression = problem.options_of(d).map(|j| vars.x[j].var).sum();
        let available = instances_of(types, vars, d).expr();
        model.constrain(constraint!(working <= available.clone()));
        // A degree without instances picks no batch size, so it adds no symmetric branches.
        model.constrain(constraint!(vars.last_w[d].var <= available));
    }
    for (t, ty) in types.iter().enumerate() {
        match &ty.packing {
            Packing::Pooled => {
                let gpus: Expression = ty
                    .degrees
                    .iter()
                    .enumerate()
                    .map(|(k, &d)| problem.degrees[d] as f64 * vars.cap[t][k].var)
                    .sum();
                model.constrain(constraint!(
                    gpus <= (ty.gpus as usize * ty.nodes.len()) as f64
                ));
            }
            Packing::Layouts(_) => {
                let nodes: Expression = vars.cap[t].iter().map(|w| w.var).sum();
                model.constrain(constraint!(nodes <= ty.nodes.len() as f64));
            }
        }
    }
}

/// A phase's model, its variables and its objective.
pub(crate) struct Built {
    pub model: Model,
    pub vars: Vars,
    pub objective: Expression,
}

/// Builds the model of one phase.
pub(crate) fn build(problem: &Problem, types: &[NodeType], spec: &PhaseSpec<'_>) -> Built {
    let mut model = Model::presolved();
    let max_inst = max_instances(problem, types);
    let vars = add_variables(&mut model, problem, types, spec, &max_inst);
    add_demand_and_latency(&mut model, problem, &vars, spec);
    add_capacity(&mut model, problem, types, &vars, spec, &max_inst);
    if let Some(q) = spec.min_quality {
        let e = quality(problem, &vars).expr();
        model.constrain(constraint!(e >= q));
    }
    if let Some(s) = spec.min_slack {
        let e = slack(problem, &vars).expr();
        model.constrain(constraint!(e >= s));
    }
    let objective = match &spec.goal {
        Goal::Load => Expression::from(vars.alpha.var),
        Goal::Quality => quality(problem, &vars).expr(),
        Goal::Slack => slack(problem, &vars).expr(),
        Goal::Spare(weights) => (0..problem.options.len())
            .map(|j| weights[j] * vars.x[j].var)
            .sum(),
    };
    Built {
        model,
        vars,
        objective,
    }
}
