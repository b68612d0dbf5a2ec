//! One door to the MILP backends: builds a good_lp model, applies the time limit, MIP gap
//! and warm start, and reports whether the answer is proven optimal or an incumbent.
//! Stages only see `Model` and `Outcome`, so swapping HiGHS for microlp is one setting.

use std::time::Instant;

use good_lp::{
    Constraint, Expression, ProblemVariables, ResolutionError, Solution, SolutionStatus,
    SolverModel, Variable, VariableDefinition, WithInitialSolution, WithMipGap, WithTimeLimit,
};
use serde::{Deserialize, Serialize};

use super::error::PlannerError;
use super::inputs::SolverKind;

/// How a solve ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SolveStatus {
    /// Proven optimal.
    Optimal,
    /// Stopped within the configured MIP gap of the bound.
    GapLimit,
    /// Stopped by the time limit: the best incumbent, optimality not proven.
    TimeLimit,
}

impl SolveStatus {
    /// The weaker of two statuses, for a result built from several solves.
    pub fn worst(self, other: SolveStatus) -> SolveStatus {
        use SolveStatus::*;
        match (self, other) {
            (TimeLimit, _) | (_, TimeLimit) => TimeLimit,
            (GapLimit, _) | (_, GapLimit) => GapLimit,
            _ => Optimal,
        }
    }
}

/// Where and how long to solve.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SolveSettings {
    pub solver: SolverKind,
    pub deadline: Instant,
    pub mip_gap: f64,
}

/// Result of one solve.
#[derive(Debug)]
pub(crate) enum Outcome {
    /// Values of every variable, in creation order.
    Solved {
        values: Vec<f64>,
        status: SolveStatus,
    },
    Infeasible,
    /// The time limit passed before any feasible point was found.
    NoSolutionInTime,
}

/// A model variable with its position in creation order (where its value sits in
/// `Outcome::Solved::values` and in warm starts).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Var {
    pub var: Variable,
    pub pos: usize,
}

impl Var {
    pub fn value(self, values: &[f64]) -> f64 {
        values[self.pos]
    }
}

/// A MILP under construction: variables in creation order plus constraints.
pub(crate) struct Model {
    vars: ProblemVariables,
    all: Vec<Variable>,
    constraints: Vec<Constraint>,
    presolve: bool,
}

impl Model {
    pub fn new() -> Self {
        Self {
            vars: ProblemVariables::new(),
            all: Vec::new(),
            constraints: Vec::new(),
            presolve: false,
        }
    }

    /// A model HiGHS presolves before its branch and bound (without restarts) and then
    /// branches by pseudocosts alone, without strong branching to make them reliable first.
    /// Worth it on Stage 1's phases: presolve removes about a sixth of a free phase's rows
    /// and columns and solves a fixed deployment's phases outright, the restarts it would
    /// trigger cost more than they save, and the search closes in a node or two, where
    /// strong branching's extra LP solves do not pay (benches/planner.py: the worst 16-GPU
    /// re-plan fell from about 160 to 80 ms of CPU time).
    pub fn presolved() -> Self {
        Self {
            presolve: true,
            ..Self::new()
        }
    }

    pub fn add(&mut self, def: VariableDefinition) -> Var {
        let var = self.vars.add(def);
        self.all.push(var);
        Var {
            var,
            pos: self.all.len() - 1,
        }
    }

    /// Variables added so far (the position the next one gets).
    pub fn len(&self) -> usize {
        self.all.len()
    }

    pub fn constrain(&mut self, c: Constraint) {
        self.constraints.push(c);
    }

    /// Maximises `objective`; `warm` (values in creation order) seeds the incumbent.
    pub fn maximise(
        self,
        objective: Expression,
        settings: &SolveSettings,
        warm: Option<&[f64]>,
    ) -> Result<Outcome, PlannerError> {
        let seconds = settings
            .deadline
            .saturating_duration_since(Instant::now())
            .as_secs_f64();
        if seconds <= 0.0 {
            return Ok(Outcome::NoSolutionInTime);
        }
        let Model {
            vars,
            all,
            constraints,
            ..
        } = self;
        let unsolved = vars.maximise(objective);
        let warm_pairs: Option<Vec<(Variable, f64)>> =
            warm.map(|w| all.iter().copied().zip(w.iter().copied()).collect());
        match settings.solver {
            #[cfg(feature = "highs")]
            SolverKind::Highs => run(
                highs_tuned(
                    unsolved.using(good_lp::solvers::highs::highs),
                    self.presolve,
                ),
                constraints,
                &all,
                seconds,
                settings.mip_gap,
                warm_pairs,
                "highs",
            ),
            #[cfg(feature = "microlp")]
            SolverKind::Microlp => run(
                unsolved.using(good_lp::solvers::microlp::microlp),
                constraints,
                &all,
                seconds,
                settings.mip_gap,
                warm_pairs,
                "microlp",
            ),
            #[allow(unreachable_patterns)]
            other => Err(PlannerError::SolverUnavailable(other.as_str())),
        }
    }
}

/// HiGHS primal heuristics switched off: every chained phase after the first starts from a
/// feasible warm start, so they mostly re-find it (benches/planner.py: about a fifth of the
/// worst 16-GPU load's time).
#[cfg(feature = "highs")]
const HIGHS_HEURISTICS_OFF: [&str; 6] = [
    "mip_heuristic_run_feasibility_jump",
    "mip_heuristic_run_rens",
    "mip_heuristic_run_rins",
    "mip_heuristic_run_root_reduced_cost",
    "mip_heuristic_run_zi_round",
    "mip_heuristic_run_shifting",
];

/// HiGHS settings for these models. They are small and already tight: HiGHS's parallel
/// search costs more than it saves here, and the planner runs beside the engine loop, so
/// one thread. Presolve runs only where the model asks for it ([`Model::presolved`]) and
/// never restarts the search (benches/planner.py measured presolve with restarts at about
/// twice the time of none). The root closes the gap with few cuts, so a
/// minimal cut pool (HiGHS's soft limit on stored cuts, not a cap on the cuts in the LP)
/// saves the time spent keeping hundreds of cuts (about a third of that load's time).
#[cfg(feature = "highs")]
fn highs_tuned(
    model: good_lp::solvers::highs::HighsProblem,
    presolve: bool,
) -> good_lp::solvers::highs::HighsProblem {
    use good_lp::solvers::highs::HighsPresolveType;
    let model = model
        .set_threads(1)
        .set_option("mip_allow_restart", false)
        .set_option("mip_heuristic_effort", 0.0)
        .set_option("mip_pool_soft_limit", 1);
    let model = if presolve {
        model
            .set_presolve(HighsPresolveType::On)
            .set_option("mip_pscost_minreliable", 0)
    } else {
        model.set_presolve(HighsPresolveType::Off)
    };
    HIGHS_HEURISTICS_OFF
        .iter()
        .fold(model, |m, &name| m.set_option(name, false))
}

/// Whether the backend named by `kind` is compiled in.
pub fn solver_available(kind: SolverKind) -> bool {
    match kind {
        SolverKind::Highs => cfg!(feature = "highs"),
        SolverKind::Microlp => cfg!(feature = "microlp"),
    }
}

fn run<M>(
    model: M,
    constraints: Vec<Constraint>,
    all: &[Variable],
    seconds: f64,
    mip_gap: f64,
    warm: Option<Vec<(Variable, f64)>>,
    name: &'static str,
) -> Result<Outcome, PlannerError>
where
    M: SolverModel<Error = ResolutionError> + WithTimeLimit + WithMipGap + WithInitialSolution,
{
    let fail = |message: String| PlannerError::Solver {
        solver: name,
        message,
    };
    let mut model = model
        .with_time_limit(seconds)
        .with_mip_gap(mip_gap as f32)
        .map_err(|e| fail(e.to_string()))?;
    if let Some(w) = warm {
        model = model.with_initial_solution(w);
    }
    match model.with_all(constraints).solve() {
        Ok(solution) => {
            let status = match solution.status() {
                SolutionStatus::Optimal => SolveStatus::Optimal,
                SolutionStatus::GapLimit => SolveStatus::GapLimit,
                SolutionStatus::TimeLimit => SolveStatus::TimeLimit,
            };
            let values = all.iter().map(|&v| solution.value(v)).collect();
            Ok(Outcome::Solved { values, status })
        }
        Err(ResolutionError::Infeasible) => Ok(Outcome::Infeasible),
        Err(ResolutionError::Other(msg))
            if msg == "NoSolutionFound" || msg.starts_with("Time limit reached") =>
        {
            Ok(Outcome::NoSolutionInTime)
        }
        Err(e) => Err(fail(e.to_string())),
    }
}
