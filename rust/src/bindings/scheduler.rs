//! Python view of the Rust `Scheduler`: events in, decisions out, typed exceptions for bad
//! input, and the GIL released while a round runs.

use std::path::PathBuf;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::Unsigned;
use super::decisions::{batch_commands, BatchCommand, PyDecisions};
use super::predictor::predictor_from_object;
use super::profile::PyLatencyProfile;
use crate::predictor::GbmPredictor;
use crate::scheduler::{
    FinishedRequest, InstanceSpec, MeanRatePredictor, Policy, RequestSpec, SchedError, Scheduler,
    SchedulerConfig, StepPredictor, StepResult, PRESETS,
};
use crate::settings::Described;
use crate::step_report::{apply_report, PackedReport};
use crate::tokens::{TokenSpec, TokenTable, Tokens};

create_exception!(
    dilaserve._core,
    SchedulerError,
    PyValueError,
    "The scheduler rejected an event or configuration; its state is unchanged."
);
create_exception!(
    dilaserve._core,
    SchedulerConfigError,
    SchedulerError,
    "The scheduler configuration or policy is invalid."
);
create_exception!(
    dilaserve._core,
    InvalidRequestError,
    SchedulerError,
    "A request has bad fields (lengths, times, thresholds) or reuses a live id."
);
create_exception!(
    dilaserve._core,
    UnknownRequestError,
    SchedulerError,
    "No active request has this id."
);
create_exception!(
    dilaserve._core,
    AdmissionError,
    SchedulerError,
    "The cluster is overloaded and too many requests already wait for their first step."
);
create_exception!(
    dilaserve._core,
    InvalidInstanceError,
    SchedulerError,
    "An instance has bad fields, reuses a live id, or claims a GPU already in use."
);
create_exception!(
    dilaserve._core,
    UnknownInstanceError,
    SchedulerError,
    "No live instance has this id."
);
create_exception!(
    dilaserve._core,
    StepReportError,
    SchedulerError,
    "A step report does not match the batch in flight on that instance."
);

impl From<SchedError> for PyErr {
    fn from(e: SchedError) -> PyErr {
        let msg = e.to_string();
        match e {
            SchedError::Config(_) => SchedulerConfigError::new_err(msg),
            SchedError::InvalidRequest { .. }
            | SchedError::DuplicateRequest(_)
            | SchedError::EmptyThresholdSet { .. }
            | SchedError::UnknownThreshold { .. }
            | SchedError::RequestTooLarge { .. }
            | SchedError::ExceedsKvCache { .. } => InvalidRequestError::new_err(msg),
            SchedError::UnknownRequest(_) => UnknownRequestError::new_err(msg),
            SchedError::Admission { .. }
            | SchedError::Unmeetable { .. }
            | SchedError::Shed { .. } => AdmissionError::new_err(msg),
            SchedError::InvalidInstance { .. }
            | SchedError::DuplicateInstance(_)
            | SchedError::GpuInUse { .. } => InvalidInstanceError::new_err(msg),
            SchedError::UnknownInstance(_) => UnknownInstanceError::new_err(msg),
            SchedError::NoStepInFlight(_) | SchedError::BadStepReport { .. } => {
                StepReportError::new_err(msg)
            }
            SchedError::BadTime(_) => SchedulerError::new_err(msg),
            SchedError::Profile(p) => p.into(),
            SchedError::Predictor(p) => p.into(),
        }
    }
}

/// Unsigned arguments of the scheduler raise `SchedulerError` when out of range.
type Id = Unsigned<u64, SchedulerError>;
type Small = Unsigned<u32, SchedulerError>;

/// A finished request as Python gets it: `(id, steps, recompute_steps, taus, instances,
/// migrations, first_dispatch, deadline, arrival)`.
type FinishedTuple = (
    u64,
    u32,
    u32,
    Vec<f64>,
    Vec<u64>,
    u32,
    Option<f64>,
    f64,
    f64,
);

fn finished_tuple(f: &FinishedRequest) -> FinishedTuple {
    (
        f.id,
        f.steps,
        f.recompute_steps,
        f.taus.clone(),
        f.instances.clone(),
        f.migrations,
        f.first_dispatch,
        f.deadline,
        f.arrival,
    )
}

/// A non-negative count from Python, or an error naming the field.
fn count(field: &str, value: i64, error: impl Fn(String) -> SchedError) -> Result<u32, SchedError> {
    u32::try_from(value).map_err(|_| {
        error(format!(
            "{field} must be an integer in [0, 2^32), got {value}"
        ))
    })
}

/// The scheduler's settings from their JSON form (a missing key takes its default).
fn parse_config(config_json: &str) -> Result<SchedulerConfig, SchedError> {
    let mut json = serde_json::Deserializer::from_str(config_json);
    serde_path_to_error::deserialize(&mut json).map_err(|e| {
        let inner = e.inner().to_string();
        let message = inner.split(" at line ").next().unwrap_or(&inner);
        SchedError::Config(format!("{}: {message}", e.path()))
    })
}

/// The schema of the scheduler's settings and the named policies, as JSON: what the Python
/// config classes, CLI flags and TOML keys are built from.
#[pyfunction]
fn scheduler_settings_json() -> String {
    let presets: Vec<serde_json::Value> = PRESETS
        .iter()
        .map(|p| {
            serde_json::json!({
                "name": p.name,
                "doc": p.doc,
                "fixed_layout": p.fixed_layout,
                "policy": (p.policy)(),
            })
        })
        .collect();
    serde_json::json!({ "scheduler": SchedulerConfig::schema(), "presets": presets }).to_string()
}

/// Checks the scheduler's settings (JSON) as a scheduler would, without making one.
#[pyfunction]
fn check_scheduler_settings_json(config_json: &str) -> PyResult<()> {
    parse_config(config_json)?.validated()?;
    Ok(())
}

/// A policy by name (a preset or `fixed-T`), as JSON.
#[pyfunction]
fn policy_named_json(name: &str) -> PyResult<String> {
    let policy = Policy::named(name)?;
    Ok(serde_json::to_string(&policy).expect("a policy serialises"))
}

/// Step-level scheduler of DiLaServe (see `dilaserve.scheduler.Scheduler`).
#[pyclass(name = "Scheduler", module = "dilaserve._core")]
pub struct PyScheduler {
    pub(super) inner: Scheduler,
    /// Token state of the requests that arrived with a mask token (the engine's).
    tokens: TokenTable,
}

/// What `apply_report` returns: finished requests as `(finished tuple, generated ids,
/// completion tokens)`, `(id, complete ids)` of requests with newly complete blocks, and
/// `(τ, steps, tokens)` of the threshold-rule commits.
type ReportTuple = (
    Vec<(FinishedTuple, Vec<u32>, usize)>,
    Vec<(u64, Vec<u32>)>,
    Vec<(f64, u32, u64)>,
);

#[pymethods]
impl PyScheduler {
    /// `config_json`: the scheduler's settings (`SchedulerConfig`'s serde form).
    #[new]
    #[pyo3(signature = (profile, config_json, *, predictor_rates=None, predictor=None, predictor_model=None))]
    fn new(
        profile: &PyLatencyProfile,
        config_json: &str,
        predictor_rates: Option<Vec<(f64, f64)>>,
        predictor: Option<&Bound<'_, PyAny>>,
        predictor_model: Option<PathBuf>,
    ) -> PyResult<Self> {
        let config = parse_config(config_json)?;
        let predictor: Box<dyn StepPredictor> = match (predictor, predictor_model, predictor_rates)
        {
            (None, None, None) => Box::new(MeanRatePredictor::default()),
            (None, None, Some(points)) => Box::new(MeanRatePredictor::new(&points)?),
            (None, Some(path), None) => Box::new(GbmPredictor::load(path)?),
            (Some(object), None, None) => predictor_from_object(object),
            _ => {
                return Err(SchedError::Config(
                    "give at most one of predictor, predictor_model and predictor_rates".into(),
                )
                .into())
            }
        };
        Ok(Self {
            inner: Scheduler::with_predictor(profile.inner.clone(), config, predictor)?,
            tokens: TokenTable::default(),
        })
    }

    /// Replaces the step predictor with a mean-rate table of `(threshold, tokens per
    /// step)` points.
    fn set_predictor_rates(&mut self, points: Vec<(f64, f64)>) -> PyResult<()> {
        let predictor = MeanRatePredictor::new(&points)?;
        self.inner.set_predictor(Box::new(predictor));
        Ok(())
    }

    /// Candidate thresholds, ascending.
    #[getter]
    fn thresholds(&self) -> Vec<f64> {
        self.inner.config().thresholds.clone()
    }

    #[getter]
    fn active_requests(&self) -> usize {
        self.inner.active_requests()
    }

    /// Requests that arrived and were never dispatched.
    #[getter]
    fn queued_requests(&self) -> u32 {
        self.inner.queued_requests()
    }

    /// Whether the last round's load control found the cluster overloaded.
    #[getter]
    fn overloaded(&self) -> bool {
        self.inner.overloaded()
    }

    #[pyo3(signature = (
        id, *, arrival, deadline, prompt_len, output_len, priority=0, block_length=None,
        thresholds=None, explicit_deadline=true, pinned_tau=None, mask_token=None,
        stop_tokens=Vec::new(), fixed_schedule=false, lead_tokens=Vec::new(),
    ))]
    #[allow(clippy::too_many_arguments)]
    /// With `mask_token`, the scheduler also keeps the request's token state (see
    /// `apply_report`); `block_length` is then required. `lead_tokens`: the prompt's tail
    /// that opens a block diffusion request's first output block (`RequestSpec::lead`).
    fn arrive(
        &mut self,
        id: Id,
        arrival: f64,
        deadline: f64,
        prompt_len: i64,
        output_len: i64,
        priority: i32,
        block_length: Option<i64>,
        thresholds: Option<Vec<f64>>,
        explicit_deadline: bool,
        pinned_tau: Option<f64>,
        mask_token: Option<u32>,
        stop_tokens: Vec<u32>,
        fixed_schedule: bool,
        lead_tokens: Vec<u32>,
    ) -> PyResult<()> {
        let id = id.0;
        let invalid = |reason| SchedError::InvalidRequest { id, reason };
        let lead = lead_tokens.len() as u32;
        let tokens = mask_token
            .map(|mask| {
                let spec = TokenSpec {
                    output_len: count("output_len", output_len, invalid)?,
                    block_length: count("block_length", block_length.unwrap_or(0), invalid)?,
                    mask,
                    stops: stop_tokens,
                    fixed_schedule,
                    lead,
                };
                if lead_tokens.contains(&mask) || lead as usize > spec.output_len as usize {
                    return Err(invalid("the prompt's tail holds the mask token".into()));
                }
                let mut output = lead_tokens.clone();
                output.resize(spec.output_len as usize, mask);
                Tokens::resume(&spec, &output, [0, 0, 0]).map_err(invalid)
            })
            .transpose()?;
        let spec = RequestSpec {
            id,
            arrival,
            deadline,
            priority,
            prompt_len: count("prompt_len", prompt_len, invalid)?,
            output_len: count("output_len", output_len, invalid)?,
            block_length: block_length
                .map(|b| count("block_length", b, invalid))
                .transpose()?,
            thresholds,
            pinned_tau,
            explicit_deadline,
            lead,
        };
        self.inner.arrive(spec)?;
        if let Some(tokens) = tokens {
            self.tokens.insert(id, tokens);
        }
        Ok(())
    }

    /// Applies a packed step report of `instance` to the token state and the scheduler in
    /// one call, all or nothing (`StepReportError`); see `dilaserve.scheduler.Scheduler`.
    #[allow(clippy::too_many_arguments)]
    fn apply_report(
        &mut self,
        instance: Id,
        measured_s: f64,
        requests: Vec<u64>,
        blocks: Vec<u32>,
        counts: Vec<u32>,
        positions: Vec<u32>,
        tokens: Vec<u32>,
        confidence: Vec<f64>,
        timesteps: Vec<u32>,
    ) -> PyResult<ReportTuple> {
        let report = PackedReport {
            requests: &requests,
            blocks: &blocks,
            counts: &counts,
            positions: &positions,
            tokens: &tokens,
            confidence: &confidence,
            timesteps: &timesteps,
        };
        let out = apply_report(
            &mut self.inner,
            &mut self.tokens,
            instance.0,
            measured_s,
            &report,
        )?;
        Ok((
            out.finished
                .into_iter()
                .map(|f| (finished_tuple(&f.served), f.generated, f.completion_tokens))
                .collect(),
            out.updates,
            out.rates
                .into_iter()
                .map(|r| (r.tau, r.steps, r.tokens))
                .collect(),
        ))
    }

    /// A live request's token state: `(output ids, steps done, steps in the current block,
    /// Dream grid steps passed in it, completion tokens so far)`.
    fn token_state(&self, id: Id) -> PyResult<(Vec<u32>, u32, u32, u32, usize)> {
        let t = self
            .tokens
            .get(id.0)
            .ok_or(SchedError::UnknownRequest(id.0))?;
        Ok((
            t.output().to_vec(),
            t.steps_done,
            t.block_steps,
            t.timestep,
            t.completion_tokens(),
        ))
    }

    /// Applies a step report: `(request, committed, confidence or None, finished)` per
    /// request of the batch. Returns the requests that finished, as tuples (see
    /// `FinishedTuple`).
    fn step_done(
        &mut self,
        instance: Id,
        measured_s: f64,
        results: Vec<(Id, i64, Option<[f64; 5]>, bool)>,
    ) -> PyResult<Vec<FinishedTuple>> {
        let instance = instance.0;
        let parsed = results
            .into_iter()
            .map(|(request, committed, confidence, finished)| {
                let request = request.0;
                let committed =
                    count("committed", committed, |reason| SchedError::BadStepReport {
                        instance,
                        reason: format!("request {request}: {reason}"),
                    })?;
                Ok(StepResult {
                    request,
                    committed,
                    confidence,
                    finished,
                })
            })
            .collect::<Result<Vec<_>, SchedError>>()?;
        let finished = self.inner.step_done(instance, measured_s, &parsed)?;
        for f in finished {
            self.tokens.remove(f.id);
        }
        Ok(finished.iter().map(finished_tuple).collect())
    }

    /// Fails the step in flight on `instance`; returns the ids of its requests.
    fn abort_step(&mut self, instance: Id) -> PyResult<Vec<u64>> {
        Ok(self.inner.abort_step(instance.0)?.to_vec())
    }

    /// Instance `instance` is expected to hold request `id`'s first `tokens` prompt tokens
    /// (prefix sharing); see `Scheduler::expect_prefix`.
    fn expect_prefix(&mut self, id: Id, instance: Id, tokens: u32) -> PyResult<()> {
        Ok(self.inner.expect_prefix(id.0, instance.0, tokens)?)
    }

    /// Request `id`, in the step in flight on `instance`, reads the stored prompt blocks
    /// `keys` there (prefix sharing); see `Scheduler::read_prefix`.
    fn read_prefix(&mut self, instance: Id, id: Id, keys: Vec<u64>) -> PyResult<()> {
        Ok(self.inner.read_prefix(instance.0, id.0, keys)?)
    }

    fn cancel(&mut self, id: Id) -> PyResult<()> {
        self.inner.cancel(id.0)?;
        self.tokens.remove(id.0);
        Ok(())
    }

    #[pyo3(signature = (
        id, *, tp, gpus, node=Unsigned::new(0), kv_tokens=None, max_requests=None,
        max_batch_tokens=None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn add_instance(
        &mut self,
        id: Id,
        tp: Small,
        gpus: Vec<Small>,
        node: Small,
        kv_tokens: Option<Id>,
        max_requests: Option<Small>,
        max_batch_tokens: Option<Id>,
    ) -> PyResult<()> {
        Ok(self.inner.add_instance(InstanceSpec {
            id: id.0,
            tp: tp.0,
            gpus: gpus.into_iter().map(|g| g.0).collect(),
            node: node.0,
            kv_tokens: kv_tokens.map(|k| k.0),
            max_requests: max_requests.map(|m| m.0),
            max_batch_tokens: max_batch_tokens.map(|b| b.0),
        })?)
    }

    fn drain_instance(&mut self, id: Id) -> PyResult<()> {
        Ok(self.inner.drain_instance(id.0)?)
    }

    fn undrain_instance(&mut self, id: Id) -> PyResult<()> {
        Ok(self.inner.undrain_instance(id.0)?)
    }

    /// Draining instances that are idle and hold no request.
    fn drained_instances(&self) -> Vec<u64> {
        self.inner.drained_instances()
    }

    fn remove_instance(&mut self, id: Id) -> PyResult<()> {
        Ok(self.inner.remove_instance(id.0)?)
    }

    /// Runs one round at time `now` with the GIL released.
    fn schedule(&mut self, py: Python<'_>, now: f64) -> PyResult<PyDecisions> {
        let inner = &mut self.inner;
        py.detach(|| inner.schedule(now).map(|_| ()))?;
        PyDecisions::new(py, self.inner.last_decisions())
    }

    /// Runs one round as `schedule` does; returns only what the engine sends, one
    /// `BatchCommand` per batch.
    fn schedule_commands(&mut self, py: Python<'_>, now: f64) -> PyResult<Vec<BatchCommand>> {
        let inner = &mut self.inner;
        py.detach(|| inner.schedule(now).map(|_| ()))?;
        Ok(batch_commands(self.inner.last_decisions()))
    }

    /// Live instance ids in announcement order.
    fn instance_ids(&self) -> Vec<u64> {
        self.inner.instance_ids()
    }

    /// How a live request has been served so far, as a finished-request tuple.
    fn served_so_far(&self, id: Id) -> PyResult<FinishedTuple> {
        Ok(finished_tuple(&self.inner.served_so_far(id.0)?))
    }

    /// State of one request as a dict (see `dilaserve.scheduler.RequestInfo`).
    fn request<'py>(&self, py: Python<'py>, id: Id) -> PyResult<Bound<'py, PyDict>> {
        let r = self.inner.request(id.0)?;
        let d = PyDict::new(py);
        d.set_item("id", r.id)?;
        d.set_item("arrival", r.arrival)?;
        d.set_item("deadline", r.deadline)?;
        d.set_item("priority", r.priority)?;
        d.set_item("prompt_len", r.prompt_len)?;
        d.set_item("output_len", r.output_len)?;
        d.set_item("block_length", r.block_length)?;
        d.set_item("steps_done", r.steps_done)?;
        d.set_item("unmasked", r.unmasked)?;
        d.set_item("unmasked_in_block", r.unmasked_in_block)?;
        d.set_item("current_block", r.current_block)?;
        d.set_item("instance", r.instance)?;
        d.set_item("next_kind", r.next_kind.as_str())?;
        d.set_item("in_flight", r.in_flight)?;
        d.set_item("allowed", r.allowed)?;
        d.set_item("max_tau", r.max_tau)?;
        d.set_item("last_tau", r.last_tau)?;
        let predictions: Vec<(f64, f64)> = r
            .predictions
            .iter()
            .map(|s| (s.cache, s.recompute))
            .collect();
        d.set_item("predictions", predictions)?;
        d.set_item(
            "confidence",
            r.confidence.map(|[a, b, c, e, f]| (a, b, c, e, f)),
        )?;
        Ok(d)
    }

    /// State of one instance as a dict (see `dilaserve.scheduler.InstanceInfo`).
    fn instance<'py>(&self, py: Python<'py>, id: Id) -> PyResult<Bound<'py, PyDict>> {
        let i = self.inner.instance(id.0)?;
        let d = PyDict::new(py);
        d.set_item("id", i.id)?;
        d.set_item("tp", i.tp)?;
        d.set_item("gpus", i.gpus)?;
        d.set_item("node", i.node)?;
        d.set_item("draining", i.draining)?;
        d.set_item("batch", i.batch)?;
        d.set_item("ahead", i.ahead)?;
        d.set_item("batch_tokens", i.batch_tokens)?;
        d.set_item("predicted_finish", i.predicted_finish)?;
        d.set_item("residents", i.residents)?;
        d.set_item("resident_tokens", i.resident_tokens)?;
        d.set_item("kv_used_tokens", i.kv_used_tokens)?;
        d.set_item("factor", i.factor)?;
        d.set_item("steps_run", i.steps_run)?;
        d.set_item("kv_tokens", i.kv_tokens)?;
        d.set_item("max_requests", i.max_requests)?;
        d.set_item("max_batch_tokens", i.max_batch_tokens)?;
        d.set_item("reserved_for", i.reserved_for)?;
        Ok(d)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyScheduler>()?;
    m.add_function(wrap_pyfunction!(scheduler_settings_json, m)?)?;
    m.add_function(wrap_pyfunction!(policy_named_json, m)?)?;
    m.add_function(wrap_pyfunction!(check_scheduler_settings_json, m)?)?;
    m.add("SchedulerError", py.get_type::<SchedulerError>())?;
    m.add(
        "SchedulerConfigError",
        py.get_type::<SchedulerConfigError>(),
    )?;
    m.add("InvalidRequestError", py.get_type::<InvalidRequestError>())?;
    m.add("UnknownRequestError", py.get_type::<UnknownRequestError>())?;
    m.add("AdmissionError", py.get_type::<AdmissionError>())?;
    m.add(
        "InvalidInstanceError",
        py.get_type::<InvalidInstanceError>(),
    )?;
    m.add(
        "UnknownInstanceError",
        py.get_type::<UnknownInstanceError>(),
    )?;
    m.add("StepReportError", py.get_type::<StepReportError>())?;
    Ok(())
}
