//! Python view of the Rust `Scheduler`: events in, decisions out, typed exceptions for bad
//! input, and the GIL released while a round runs.

use std::path::PathBuf;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::Unsigned;
use super::decisions::PyDecisions;
use super::predictor::predictor_from_object;
use super::profile::PyLatencyProfile;
use crate::predictor::GbmPredictor;
use crate::scheduler::{
    Admission, FinishedRequest, InstanceChoice, InstanceSpec, LoadModel, LoadOrder,
    MeanRatePredictor, Policy, Prediction, RequestSpec, SchedError, Scheduler, SchedulerConfig,
    StepPredictor, StepResult, ThresholdPolicy,
};

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

fn unknown(what: &str, got: &str, allowed: &str) -> SchedError {
    SchedError::Config(format!("unknown {what} {got:?} (expected {allowed})"))
}

fn parse_threshold(name: &str, fixed_tau: f64) -> Result<ThresholdPolicy, SchedError> {
    match name {
        "slo_aware" => Ok(ThresholdPolicy::SloAware),
        "fixed" => Ok(ThresholdPolicy::Fixed(fixed_tau)),
        other => Err(unknown("threshold policy", other, "slo_aware or fixed")),
    }
}

fn parse_load_order(name: &str) -> Result<LoadOrder, SchedError> {
    match name {
        "arrival" => Ok(LoadOrder::Arrival),
        "priority" => Ok(LoadOrder::Priority),
        other => Err(unknown("load order", other, "arrival or priority")),
    }
}

fn parse_instance_choice(name: &str) -> Result<InstanceChoice, SchedError> {
    match name {
        "earliest_completion" => Ok(InstanceChoice::EarliestCompletion),
        "least_loaded" => Ok(InstanceChoice::LeastLoaded),
        other => Err(unknown(
            "instance choice",
            other,
            "earliest_completion or least_loaded",
        )),
    }
}

fn parse_load_model(name: &str) -> Result<LoadModel, SchedError> {
    match name {
        "window" => Ok(LoadModel::Window),
        "forecast" => Ok(LoadModel::Forecast),
        other => Err(unknown("load model", other, "window or forecast")),
    }
}

fn parse_admission(name: &str) -> Result<Admission, SchedError> {
    match name {
        "off" => Ok(Admission::Off),
        "reject" => Ok(Admission::Reject),
        "best_effort" => Ok(Admission::BestEffort),
        other => Err(unknown("admission", other, "off, reject or best_effort")),
    }
}

fn parse_prediction(name: &str, every: i64) -> Result<Prediction, SchedError> {
    match name {
        "online" => Ok(Prediction::Online {
            every: count("predict_every", every, SchedError::Config)?,
        }),
        "one_shot" => Ok(Prediction::OneShot),
        other => Err(unknown("prediction mode", other, "online or one_shot")),
    }
}

/// Step-level scheduler of DiLaServe (see `dilaserve.scheduler.Scheduler`).
#[pyclass(name = "Scheduler", module = "dilaserve._core")]
pub struct PyScheduler {
    pub(super) inner: Scheduler,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (
        profile, *, thresholds, block_length, caching, max_batch_tokens, slo_window_s,
        threshold_policy, fixed_tau, load_control, load_order, instance_choice, migration,
        prediction, predict_every, predictor_rates, max_queued=None, predictor=None,
        predictor_model=None, load_model="forecast", admission="reject",
        target_utilisation=0.9,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        profile: &PyLatencyProfile,
        thresholds: Vec<f64>,
        block_length: i64,
        caching: bool,
        max_batch_tokens: i64,
        slo_window_s: Option<f64>,
        threshold_policy: &str,
        fixed_tau: f64,
        load_control: bool,
        load_order: &str,
        instance_choice: &str,
        migration: bool,
        prediction: &str,
        predict_every: i64,
        predictor_rates: Option<Vec<(f64, f64)>>,
        max_queued: Option<i64>,
        predictor: Option<&Bound<'_, PyAny>>,
        predictor_model: Option<PathBuf>,
        load_model: &str,
        admission: &str,
        target_utilisation: f64,
    ) -> PyResult<Self> {
        let policy = Policy {
            threshold: parse_threshold(threshold_policy, fixed_tau)?,
            load_control,
            load_model: parse_load_model(load_model)?,
            admission: parse_admission(admission)?,
            load_order: parse_load_order(load_order)?,
            instance_choice: parse_instance_choice(instance_choice)?,
            migration,
            prediction: parse_prediction(prediction, predict_every)?,
        };
        let config = SchedulerConfig {
            thresholds,
            block_length: count("block_length", block_length, SchedError::Config)?,
            caching,
            max_batch_tokens: u64::try_from(max_batch_tokens).map_err(|_| {
                SchedError::Config(format!(
                    "max_batch_tokens must be non-negative, got {max_batch_tokens}"
                ))
            })?,
            slo_window_s,
            max_queued: max_queued
                .map(|m| count("max_queued", m, SchedError::Config))
                .transpose()?,
            target_utilisation,
            policy,
        };
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
        thresholds=None, explicit_deadline=true,
    ))]
    #[allow(clippy::too_many_arguments)]
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
    ) -> PyResult<()> {
        let id = id.0;
        let invalid = |reason| SchedError::InvalidRequest { id, reason };
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
            explicit_deadline,
        };
        Ok(self.inner.arrive(spec)?)
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
        Ok(finished.iter().map(finished_tuple).collect())
    }

    /// Fails the step in flight on `instance`; returns the ids of its requests.
    fn abort_step(&mut self, instance: Id) -> PyResult<Vec<u64>> {
        Ok(self.inner.abort_step(instance.0)?.to_vec())
    }

    fn cancel(&mut self, id: Id) -> PyResult<()> {
        Ok(self.inner.cancel(id.0)?)
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

    /// Live instance ids in announcement order.
    fn instance_ids(&self) -> Vec<u64> {
        self.inner.instance_ids()
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
        d.set_item("batch_tokens", i.batch_tokens)?;
        d.set_item("predicted_finish", i.predicted_finish)?;
        d.set_item("residents", i.residents)?;
        d.set_item("resident_tokens", i.resident_tokens)?;
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
