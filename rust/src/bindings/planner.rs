//! Python view of the cluster planner. Inputs and plans cross the boundary as JSON (the
//! serde form of the Rust types), which `dilaserve.planner` wraps in typed dataclasses;
//! solving releases the GIL.

use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use super::args::Unsigned;
use super::profile::PyLatencyProfile;
use crate::planner::{
    self, Arrival, BinSpec, Plan, PlannerError, PlannerInputs, ReplanOptions, Replanner,
    RunningInstance, SolverKind, ThresholdOption, TransitionInputs,
};

create_exception!(
    dilaserve._core,
    PlannerInputError,
    PyValueError,
    "The planner's inputs are invalid: no GPUs, no request classes, a bad setting, ..."
);
create_exception!(
    dilaserve._core,
    PlannerSolveError,
    PyRuntimeError,
    "The MILP solver failed or is not compiled in."
);

pub(super) fn to_py(e: PlannerError) -> PyErr {
    match e {
        PlannerError::Profile(p) => p.into(),
        PlannerError::Solver { .. } | PlannerError::SolverUnavailable(_) => {
            PlannerSolveError::new_err(e.to_string())
        }
        other => PlannerInputError::new_err(other.to_string()),
    }
}

/// Unsigned arguments of the planner raise `PlannerInputError` when out of range.
type Count<T> = Unsigned<T, PlannerInputError>;
type RawArrival = (f64, Count<u64>, Count<u64>);

fn arrivals(raw: Vec<RawArrival>) -> Vec<Arrival> {
    raw.into_iter()
        .map(|(time, prompt_tokens, output_tokens)| Arrival {
            time,
            prompt_tokens: prompt_tokens.0,
            output_tokens: output_tokens.0,
        })
        .collect()
}

fn parse_inputs(inputs_json: &str) -> PyResult<PlannerInputs> {
    serde_json::from_str(inputs_json)
        .map_err(|e| PlannerInputError::new_err(format!("planner inputs are malformed: {e}")))
}

fn to_json<T: serde::Serialize>(value: &T) -> PyResult<String> {
    serde_json::to_string(value).map_err(|e| PlannerSolveError::new_err(e.to_string()))
}

/// Runs both stages and the adoption rule; JSON in, JSON out.
#[pyfunction]
fn plan_json(
    py: Python<'_>,
    inputs_json: &str,
    profile: &Bound<'_, PyLatencyProfile>,
) -> PyResult<String> {
    let inputs = parse_inputs(inputs_json)?;
    let profile = &profile.get().inner;
    let plan = py
        .detach(|| planner::plan(&inputs, profile))
        .map_err(to_py)?;
    to_json(&plan)
}

/// Stage 1 only; JSON in, JSON out.
#[pyfunction]
fn plan_capacity_json(
    py: Python<'_>,
    inputs_json: &str,
    profile: &Bound<'_, PyLatencyProfile>,
) -> PyResult<String> {
    let inputs = parse_inputs(inputs_json)?;
    let profile = &profile.get().inner;
    let plan = py
        .detach(|| planner::plan_capacity(&inputs, profile))
        .map_err(to_py)?;
    to_json(&plan)
}

/// Stage 2 alone, to caller-chosen instance counts; JSON in, JSON out.
#[pyfunction]
fn plan_transition_json(py: Python<'_>, inputs_json: &str) -> PyResult<String> {
    let inputs: TransitionInputs = serde_json::from_str(inputs_json)
        .map_err(|e| PlannerInputError::new_err(format!("transition inputs are malformed: {e}")))?;
    let plan = py
        .detach(|| planner::plan_transition_to(&inputs))
        .map_err(to_py)?;
    to_json(&plan)
}

/// Bins `(time, prompt tokens, output tokens)` arrivals of `[start, end)` into
/// `(prompt tokens, output tokens, rate)` classes.
#[pyfunction]
fn classes_from_arrivals(
    arrivals_raw: Vec<RawArrival>,
    start: f64,
    end: f64,
    prompt_bins: Count<usize>,
    output_bins: Count<usize>,
    rate_margin: f64,
) -> PyResult<Vec<(f64, f64, f64)>> {
    let spec = BinSpec {
        prompt_bins: prompt_bins.0,
        output_bins: output_bins.0,
        rate_margin,
    };
    let classes = planner::classes_from_arrivals(&arrivals(arrivals_raw), start, end, &spec)
        .map_err(to_py)?;
    Ok(classes
        .into_iter()
        .map(|c| (c.prompt_tokens, c.output_tokens, c.rate))
        .collect())
}

/// Mean seconds a request takes alone on TP-1 at `tokens_per_step` tokens per step.
#[pyfunction]
#[pyo3(signature = (profile, arrivals_raw, tokens_per_step, caching, block_length, exact_cache=false))]
fn mean_isolated_latency(
    profile: &Bound<'_, PyLatencyProfile>,
    arrivals_raw: Vec<RawArrival>,
    tokens_per_step: f64,
    caching: bool,
    block_length: Count<u32>,
    exact_cache: bool,
) -> PyResult<f64> {
    let top = ThresholdOption {
        threshold: 1.0,
        tokens_per_step,
    };
    planner::mean_isolated_latency(
        &profile.get().inner,
        &arrivals(arrivals_raw),
        top,
        caching,
        exact_cache,
        block_length.0,
    )
    .map_err(to_py)
}

/// The replanner shared with the simulator (`planner::Replanner`): the engine records
/// arrivals, asks for the planner's inputs when a plan is due, solves them off its loop
/// (`plan_json`) and hands the plan back.
#[pyclass(name = "Replanner", module = "dilaserve._core")]
pub struct PyReplanner {
    inner: Replanner,
}

#[pymethods]
impl PyReplanner {
    #[new]
    fn new(options_json: &str) -> PyResult<Self> {
        let options: ReplanOptions = serde_json::from_str(options_json)
            .map_err(|e| PlannerInputError::new_err(format!("replan options: {e}")))?;
        Ok(Self {
            inner: Replanner::new(options).map_err(to_py)?,
        })
    }

    /// Replaces the options, keeping what was recorded.
    fn set_options_json(&mut self, options_json: &str) -> PyResult<()> {
        let options: ReplanOptions = serde_json::from_str(options_json)
            .map_err(|e| PlannerInputError::new_err(format!("replan options: {e}")))?;
        self.inner.set_options(options).map_err(to_py)
    }

    fn record(&mut self, time: f64, prompt_tokens: Count<u64>, output_tokens: Count<u64>) {
        self.inner.record(Arrival {
            time,
            prompt_tokens: prompt_tokens.0,
            output_tokens: output_tokens.0,
        });
    }

    /// Batch tokens the last adopted plan chose for a TP degree, if one did.
    fn planned_batch(&self, degree: u32) -> Option<u64> {
        self.inner.planned_batch(degree)
    }

    /// When the next periodic plan is due.
    #[getter]
    fn next_plan(&self) -> f64 {
        self.inner.next_plan()
    }

    /// `ReplanInputs` as JSON, or None without arrivals in the window. `running`:
    /// `(id, node index, degree, gpus)` of each instance serving.
    #[pyo3(signature = (now, running, node_gpus, default_batch, profile, *, min_improvement=None))]
    fn inputs_json(
        &mut self,
        now: f64,
        running: Vec<(u64, usize, u32, Vec<u32>)>,
        node_gpus: Vec<u32>,
        default_batch: Count<u64>,
        profile: &Bound<'_, PyLatencyProfile>,
        min_improvement: Option<f64>,
    ) -> PyResult<Option<String>> {
        let running: Vec<RunningInstance> = running
            .into_iter()
            .map(|(id, node, degree, gpus)| RunningInstance {
                id,
                node,
                degree,
                gpus,
            })
            .collect();
        let asked = self
            .inner
            .inputs(
                now,
                min_improvement,
                &running,
                &node_gpus,
                default_batch.0,
                &profile.get().inner,
            )
            .map_err(to_py)?;
        asked.map(|a| to_json(&a)).transpose()
    }

    /// Takes note of a plan (`plan_json`'s output) computed from its inputs.
    fn adopt_json(&mut self, plan_json: &str) -> PyResult<()> {
        let plan: Plan = serde_json::from_str(plan_json)
            .map_err(|e| PlannerInputError::new_err(format!("plan is malformed: {e}")))?;
        self.inner.adopt(&plan);
        Ok(())
    }

    /// Whether a planned stop hands its requests over instead of draining.
    #[staticmethod]
    fn handover(others_serving: bool, launch_follows: bool) -> bool {
        Replanner::handover(others_serving, launch_follows)
    }
}

/// Names of the MILP backends compiled in.
#[pyfunction]
fn planner_solvers() -> Vec<&'static str> {
    [SolverKind::Highs, SolverKind::Microlp]
        .into_iter()
        .filter(|&s| planner::solver_available(s))
        .map(SolverKind::as_str)
        .collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_json, m)?)?;
    m.add_function(wrap_pyfunction!(plan_capacity_json, m)?)?;
    m.add_function(wrap_pyfunction!(plan_transition_json, m)?)?;
    m.add_function(wrap_pyfunction!(classes_from_arrivals, m)?)?;
    m.add_function(wrap_pyfunction!(mean_isolated_latency, m)?)?;
    m.add_function(wrap_pyfunction!(planner_solvers, m)?)?;
    m.add_class::<PyReplanner>()?;
    m.add("PlannerInputError", m.py().get_type::<PlannerInputError>())?;
    m.add("PlannerSolveError", m.py().get_type::<PlannerSolveError>())?;
    Ok(())
}
