//! Python view of the simulator: the workload and the results cross as columns (one
//! sequence per field, numpy arrays on the way out), the progress model and replanning
//! options as JSON. The run keeps the GIL: the scheduler may call a predictor written in
//! Python.

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use rand::rngs::SmallRng;
use rand::SeedableRng;

use super::planner::to_py as planner_error;
use super::scheduler::PyScheduler;
use crate::scheduler::InstanceSpec;
use crate::sim::{
    self, ProgressModel, RequestOutcome, SimError, SimOptions, SimReplanOptions, SimRequest,
};

create_exception!(
    dilaserve._core,
    SimInputError,
    PyValueError,
    "The simulator's inputs are invalid: a malformed progress model or workload, a used scheduler, ..."
);

fn to_py(e: SimError) -> PyErr {
    match e {
        SimError::Scheduler(s) => s.into(),
        SimError::Planner(p) => planner_error(p),
        other => SimInputError::new_err(other.to_string()),
    }
}

/// Draws step commit counts from a progress model, as the simulator's workers do: what an
/// emulated worker commits per request of a step.
#[pyclass(name = "ProgressSampler", module = "dilaserve._core")]
pub struct PyProgressSampler {
    model: ProgressModel,
    rng: SmallRng,
}

#[pymethods]
impl PyProgressSampler {
    #[new]
    fn new(progress_json: &str, seed: u64) -> PyResult<Self> {
        Ok(Self {
            model: ProgressModel::from_json(progress_json).map_err(to_py)?,
            rng: SmallRng::seed_from_u64(seed),
        })
    }

    /// Tokens each step commits: one per `(tau, unmasked in block, block length)`.
    fn sample(&mut self, steps: Vec<(f64, u32, u32)>) -> Vec<u32> {
        steps
            .into_iter()
            .map(|(tau, unmasked, block)| self.model.sample(tau, unmasked, block, &mut self.rng))
            .collect()
    }
}

/// Checks a progress-model JSON document; returns it normalized.
#[pyfunction]
fn check_progress_json(text: &str) -> PyResult<String> {
    Ok(ProgressModel::from_json(text).map_err(to_py)?.to_json())
}

/// Runs a workload through `scheduler` (fresh) on `instances` (`(id, tp, gpus, node)`);
/// `progress_json` is a list of progress models and `progress_class` each request's index
/// into it (default: all the first). Returns `(columns, stats)`: per-request arrays in the
/// workload's order, and run counters.
#[pyfunction]
#[pyo3(signature = (
    scheduler, instances, arrival, prompt_len, output_len, slo_s, progress_json, *,
    progress_class=None, seed=0, round_quantum_s=0.0, step_overhead_s=0.0, replan_json=None,
))]
#[allow(clippy::too_many_arguments)]
fn simulate<'py>(
    py: Python<'py>,
    scheduler: &mut PyScheduler,
    instances: Vec<(u64, u32, Vec<u32>, u32)>,
    arrival: Vec<f64>,
    prompt_len: Vec<u32>,
    output_len: Vec<u32>,
    slo_s: Vec<f64>,
    progress_json: &str,
    progress_class: Option<Vec<u32>>,
    seed: u64,
    round_quantum_s: f64,
    step_overhead_s: f64,
    replan_json: Option<&str>,
) -> PyResult<(Bound<'py, PyDict>, Bound<'py, PyDict>)> {
    let n = arrival.len();
    let class = progress_class.unwrap_or_else(|| vec![0; n]);
    if [prompt_len.len(), output_len.len(), slo_s.len(), class.len()] != [n; 4] {
        return Err(SimInputError::new_err(
            "arrival, prompt_len, output_len, slo_s and progress_class must have the same length",
        ));
    }
    let requests: Vec<SimRequest> = (0..n)
        .map(|i| SimRequest {
            arrival: arrival[i],
            prompt_len: prompt_len[i],
            output_len: output_len[i],
            slo_s: slo_s[i],
            class: class[i],
        })
        .collect();
    let progress = ProgressModel::list_from_json(progress_json).map_err(to_py)?;
    let replan: Option<SimReplanOptions> = replan_json
        .map(serde_json::from_str)
        .transpose()
        .map_err(|e| SimInputError::new_err(format!("replan options: {e}")))?;
    let specs: Vec<InstanceSpec> = instances
        .into_iter()
        .map(|(id, tp, gpus, node)| InstanceSpec::new(id, tp, gpus, node))
        .collect();
    let options = SimOptions {
        seed,
        round_quantum_s,
        step_overhead_s,
        replan,
    };
    let result = sim::simulate(&mut scheduler.inner, &specs, &requests, &progress, &options)
        .map_err(to_py)?;

    // Columns cross as numpy arrays over little-endian bytes: a million requests' columns as
    // Python lists would cost a float object per value.
    let o = &result.requests;
    let frombuffer = py.import("numpy")?.getattr("frombuffer")?;
    let array = |dtype: &str, bytes: Vec<u8>| frombuffer.call1((PyBytes::new(py, &bytes), dtype));
    let f64s = |value: fn(&RequestOutcome) -> f64| {
        array(
            "<f8",
            o.iter().flat_map(|r| value(r).to_le_bytes()).collect(),
        )
    };
    let u32s = |value: fn(&RequestOutcome) -> u32| {
        array(
            "<u4",
            o.iter().flat_map(|r| value(r).to_le_bytes()).collect(),
        )
    };
    let columns = PyDict::new(py);
    columns.set_item("arrival", f64s(|r| r.arrival)?)?;
    columns.set_item("deadline", f64s(|r| r.deadline)?)?;
    columns.set_item("finish", f64s(|r| r.finish.unwrap_or(f64::NAN))?)?;
    columns.set_item(
        "rejected",
        array("?", o.iter().map(|r| u8::from(r.rejected)).collect())?,
    )?;
    columns.set_item("steps", u32s(|r| r.steps)?)?;
    columns.set_item("recompute_steps", u32s(|r| r.recompute_steps)?)?;
    columns.set_item("mean_tau", f64s(|r| r.mean_tau)?)?;
    columns.set_item("min_tau", f64s(|r| r.min_tau)?)?;
    columns.set_item("migrations", u32s(|r| r.migrations)?)?;
    columns.set_item("instances", u32s(|r| r.instances)?)?;
    columns.set_item("queue_s", f64s(|r| r.queue_s)?)?;
    columns.set_item("accuracy", f64s(|r| r.accuracy)?)?;
    columns.set_item("capped_steps", u32s(|r| r.capped_steps)?)?;
    columns.set_item("late_steps", u32s(|r| r.late_steps)?)?;
    columns.set_item("min_cap_tau", f64s(|r| r.min_cap_tau)?)?;

    let s = &result.stats;
    let stats = PyDict::new(py);
    stats.set_item("rounds", s.rounds)?;
    stats.set_item("steps", s.steps)?;
    stats.set_item("step_seconds", s.step_seconds)?;
    stats.set_item("sched_seconds", s.sched_seconds)?;
    stats.set_item("step_path_seconds", s.step_path_seconds)?;
    stats.set_item("sched_share_of_step_time", s.sched_share_of_step_time())?;
    stats.set_item("end_time", s.end_time)?;
    stats.set_item("replans", s.replans)?;
    stats.set_item("plans_adopted", s.plans_adopted)?;
    stats.set_item("plans_rehearsed_out", s.plans_rehearsed_out)?;
    stats.set_item("launches", s.launches)?;
    stats.set_item("stops", s.stops)?;
    stats.set_item("plan_seconds", s.plan_seconds)?;
    stats.set_item("rehearsal_seconds", s.rehearsal_seconds)?;
    stats.set_item("wall_seconds", s.wall_seconds)?;
    let by_degree = PyDict::new(py);
    for (tp, d) in &s.by_degree {
        let one = PyDict::new(py);
        one.set_item("steps", d.steps)?;
        one.set_item("busy_seconds", d.busy_seconds)?;
        one.set_item("requests", d.requests)?;
        one.set_item("tokens", d.tokens)?;
        by_degree.set_item(tp, one)?;
    }
    stats.set_item("by_degree", by_degree)?;
    Ok((columns, stats))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(simulate, m)?)?;
    m.add_function(wrap_pyfunction!(check_progress_json, m)?)?;
    m.add_class::<PyProgressSampler>()?;
    m.add("SimInputError", m.py().get_type::<SimInputError>())?;
    Ok(())
}
