//! Python view of the step predictors: LightGBM forests evaluated natively, the mean-rate
//! table, and predictors written in Python for experiments.
//!
//! Bulk data crosses as `bytes` of little-endian float64 (numpy's `tobytes` /
//! `frombuffer`, done by `dilaserve.predictor.native`), never as Python lists.

use std::path::PathBuf;
use std::sync::Arc;

use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::predictor::{Forest, GbmError, GbmPredictor, KNOWN_FEATURES};
use crate::scheduler::{MeanRatePredictor, PredictError, RequestView, StepPredictor, StepsLeft};

create_exception!(
    dilaserve._core,
    PredictorModelError,
    PyValueError,
    "A LightGBM model is malformed, uses what native inference does not evaluate \
     (categorical splits, linear trees, non-regression objectives), or has features the \
     step predictor does not know."
);
create_exception!(
    dilaserve._core,
    PredictorError,
    PyValueError,
    "A step predictor failed or returned a NaN, infinite or negative prediction."
);

impl From<GbmError> for PyErr {
    fn from(e: GbmError) -> PyErr {
        match e {
            GbmError::Io { .. } => PyOSError::new_err(e.to_string()),
            other => PredictorModelError::new_err(other.to_string()),
        }
    }
}

impl From<PredictError> for PyErr {
    fn from(e: PredictError) -> PyErr {
        PredictorError::new_err(e.to_string())
    }
}

/// Columns of a packed request-state row, in order (see `VIEW_COLUMNS` in Python).
pub const VIEW_COLUMNS: [&str; 13] = [
    "prompt_length",
    "output_length",
    "block_length",
    "steps_done",
    "block_steps",
    "unmasked",
    "unmasked_in_block",
    "needs_recompute",
    "confidence_min",
    "confidence_q25",
    "confidence_median",
    "confidence_mean",
    "confidence_q75",
];

fn floats(data: &[u8]) -> PyResult<Vec<f64>> {
    if data.len() % 8 != 0 {
        return Err(PyValueError::new_err(
            "packed float64 data must be a multiple of 8 bytes",
        ));
    }
    Ok(data
        .chunks_exact(8)
        .map(|b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8])))
        .collect())
}

fn pack<'py>(py: Python<'py>, values: impl ExactSizeIterator<Item = f64>) -> Bound<'py, PyBytes> {
    let mut out = Vec::with_capacity(values.len() * 8);
    for v in values {
        out.extend_from_slice(&v.to_le_bytes());
    }
    PyBytes::new(py, &out)
}

fn count(column: &str, row: usize, x: f64) -> PyResult<u32> {
    if x.fract() == 0.0 && (0.0..=f64::from(u32::MAX)).contains(&x) {
        Ok(x as u32)
    } else {
        Err(PyValueError::new_err(format!(
            "request state {row}: {column} must be a non-negative integer, got {x}"
        )))
    }
}

fn view_of(row: usize, v: &[f64]) -> PyResult<RequestView> {
    let c = |i: usize| count(VIEW_COLUMNS[i], row, v[i]);
    let (output_len, block_length) = (c(1)?, c(2)?);
    let (unmasked, unmasked_in_block) = (c(5)?, c(6)?);
    if output_len == 0
        || block_length == 0
        || output_len % block_length != 0
        || unmasked > output_len
        || unmasked_in_block >= block_length
        || unmasked < unmasked_in_block
    {
        return Err(PyValueError::new_err(format!(
            "request state {row} is inconsistent: output {output_len}, block {block_length}, \
             unmasked {unmasked} ({unmasked_in_block} in the current block)"
        )));
    }
    let conf = [v[8], v[9], v[10], v[11], v[12]];
    Ok(RequestView {
        id: row as u64,
        prompt_len: c(0)?,
        output_len,
        block_length,
        steps_done: c(3)?,
        // Packed rows carry no threshold history.
        mean_tau_done: None,
        block_steps: c(4)?,
        unmasked,
        unmasked_in_block,
        current_block: (unmasked - unmasked_in_block) / block_length,
        needs_recompute: v[7] != 0.0,
        confidence: conf.iter().all(|x| x.is_finite()).then_some(conf),
    })
}

fn unpack_view(v: &RequestView) -> [f64; 13] {
    let conf = v.confidence.unwrap_or([f64::NAN; 5]);
    [
        f64::from(v.prompt_len),
        f64::from(v.output_len),
        f64::from(v.block_length),
        f64::from(v.steps_done),
        f64::from(v.block_steps),
        f64::from(v.unmasked),
        f64::from(v.unmasked_in_block),
        if v.needs_recompute { 1.0 } else { 0.0 },
        conf[0],
        conf[1],
        conf[2],
        conf[3],
        conf[4],
    ]
}

/// Request states as a predictor sees them, held natively so that repeated predictions
/// (benchmarks) pay no conversion.
#[pyclass(name = "RequestViews", module = "dilaserve._core", frozen)]
pub struct PyRequestViews {
    pub inner: Vec<RequestView>,
}

#[pymethods]
impl PyRequestViews {
    /// From packed rows of `VIEW_COLUMNS` (float64, row-major); request ids are row numbers.
    #[new]
    fn new(data: &[u8]) -> PyResult<Self> {
        let values = floats(data)?;
        if values.len() % VIEW_COLUMNS.len() != 0 {
            return Err(PyValueError::new_err(format!(
                "packed request states must have {} columns",
                VIEW_COLUMNS.len()
            )));
        }
        let inner = values
            .chunks_exact(VIEW_COLUMNS.len())
            .enumerate()
            .map(|(i, row)| view_of(i, row))
            .collect::<PyResult<_>>()?;
        Ok(Self { inner })
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    /// Packed rows of `VIEW_COLUMNS` (what `__new__` takes).
    fn packed<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        pack(
            py,
            self.inner
                .iter()
                .flat_map(unpack_view)
                .collect::<Vec<_>>()
                .into_iter(),
        )
    }

    /// Request ids, in row order.
    fn ids(&self) -> Vec<u64> {
        self.inner.iter().map(|v| v.id).collect()
    }

    #[classattr]
    fn columns() -> Vec<&'static str> {
        VIEW_COLUMNS.to_vec()
    }
}

/// Runs `predictor` over `views` at `thresholds` without the GIL; returns packed
/// `(cache, recompute)`, request-major.
fn predict_packed<'py>(
    py: Python<'py>,
    predictor: &dyn StepPredictor,
    views: &PyRequestViews,
    thresholds: Vec<f64>,
) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
    let mut out = vec![StepsLeft::default(); views.inner.len() * thresholds.len()];
    py.detach(|| predictor.predict_batch(&views.inner, &thresholds, &mut out))?;
    crate::scheduler::check_predictions(&views.inner, &thresholds, &out)?;
    Ok((
        pack(py, out.iter().map(|s| s.cache)),
        pack(py, out.iter().map(|s| s.recompute)),
    ))
}

/// A LightGBM text model, evaluated natively (exactly as `lightgbm.Booster.predict`).
#[pyclass(name = "Forest", module = "dilaserve._core", frozen)]
pub struct PyForest {
    pub inner: Forest,
}

#[pymethods]
impl PyForest {
    #[staticmethod]
    fn load(path: PathBuf) -> PyResult<Self> {
        Ok(Self {
            inner: Forest::load(path)?,
        })
    }

    #[staticmethod]
    fn from_text(text: &str) -> PyResult<Self> {
        Ok(Self {
            inner: Forest::from_text(text)?,
        })
    }

    #[getter]
    fn feature_names(&self) -> Vec<String> {
        self.inner.feature_names().to_vec()
    }

    #[getter]
    fn num_trees(&self) -> usize {
        self.inner.num_trees()
    }

    #[getter]
    fn objective(&self) -> String {
        self.inner.objective().to_owned()
    }

    /// Predictions of packed float64 rows (row-major, `len(feature_names)` per row).
    fn predict<'py>(&self, py: Python<'py>, rows: &[u8]) -> PyResult<Bound<'py, PyBytes>> {
        let rows = floats(rows)?;
        let n = rows.len() / self.inner.num_features().max(1);
        let mut out = vec![0.0; n];
        py.detach(|| self.inner.predict_rows(&rows, &mut out))?;
        Ok(pack(py, out.into_iter()))
    }
}

/// The learned step predictor (see `dilaserve.predictor.GbmPredictor`).
#[pyclass(name = "GbmPredictor", module = "dilaserve._core", frozen)]
pub struct PyGbmPredictor {
    pub inner: Arc<GbmPredictor>,
}

#[pymethods]
impl PyGbmPredictor {
    /// Loads `predictor.txt` and, if present, `predictor_recompute.txt` beside it.
    #[staticmethod]
    fn load(path: PathBuf) -> PyResult<Self> {
        Ok(Self {
            inner: Arc::new(GbmPredictor::load(path)?),
        })
    }

    #[staticmethod]
    #[pyo3(signature = (total, recompute=None))]
    fn from_forests(total: &PyForest, recompute: Option<&PyForest>) -> PyResult<Self> {
        let predictor = GbmPredictor::new(total.inner.clone(), recompute.map(|f| f.inner.clone()))?;
        Ok(Self {
            inner: Arc::new(predictor),
        })
    }

    #[getter]
    fn has_recompute_model(&self) -> bool {
        self.inner.has_recompute_model()
    }

    #[getter]
    fn feature_names(&self) -> Vec<String> {
        self.inner.total_model().feature_names().to_vec()
    }

    fn predict<'py>(
        &self,
        py: Python<'py>,
        views: &PyRequestViews,
        thresholds: Vec<f64>,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        predict_packed(py, self.inner.as_ref(), views, thresholds)
    }
}

/// The mean-rate table predictor (the scheduler's default).
#[pyclass(name = "MeanRatePredictor", module = "dilaserve._core", frozen)]
pub struct PyMeanRatePredictor {
    pub inner: Arc<MeanRatePredictor>,
}

#[pymethods]
impl PyMeanRatePredictor {
    /// `(threshold, tokens per step)` points; `None` uses Fast-dLLM's GSM8K figures.
    #[new]
    #[pyo3(signature = (points=None))]
    fn new(points: Option<Vec<(f64, f64)>>) -> PyResult<Self> {
        let inner = match points {
            Some(p) => MeanRatePredictor::new(&p)?,
            None => MeanRatePredictor::default(),
        };
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    fn rate(&self, tau: f64) -> f64 {
        self.inner.rate(tau)
    }

    fn predict<'py>(
        &self,
        py: Python<'py>,
        views: &PyRequestViews,
        thresholds: Vec<f64>,
    ) -> PyResult<(Bound<'py, PyBytes>, Bound<'py, PyBytes>)> {
        predict_packed(py, self.inner.as_ref(), views, thresholds)
    }
}

/// A predictor written in Python, for experiments: `dilaserve.predictor.native` calls its
/// `predict(states, thresholds)` with request-state columns and packs the answer.
pub struct PyObjectPredictor {
    object: Py<PyAny>,
}

impl PyObjectPredictor {
    pub fn new(object: Py<PyAny>) -> Self {
        Self { object }
    }
}

impl StepPredictor for PyObjectPredictor {
    fn predict(
        &self,
        request: &RequestView,
        thresholds: &[f64],
        out: &mut [StepsLeft],
    ) -> Result<(), PredictError> {
        self.predict_batch(std::slice::from_ref(request), thresholds, out)
    }

    fn predict_batch(
        &self,
        requests: &[RequestView],
        thresholds: &[f64],
        out: &mut [StepsLeft],
    ) -> Result<(), PredictError> {
        Python::attach(|py| {
            let fail = |e: PyErr| PredictError::Failed(e.to_string());
            let views = Bound::new(
                py,
                PyRequestViews {
                    inner: requests.to_vec(),
                },
            )
            .map_err(fail)?;
            let call = py
                .import("dilaserve.predictor.native")
                .and_then(|m| m.getattr("call_python_predictor"))
                .map_err(fail)?;
            let (cache, recompute): (Vec<u8>, Vec<u8>) = call
                .call1((self.object.bind(py), views, thresholds.to_vec()))
                .and_then(|r| r.extract())
                .map_err(fail)?;
            let (cache, recompute) = (
                floats(&cache).map_err(fail)?,
                floats(&recompute).map_err(fail)?,
            );
            if cache.len() != out.len() || recompute.len() != out.len() {
                return Err(PredictError::Failed(format!(
                    "a Python predictor returned {} and {} values for {} requests × {} \
                     thresholds",
                    cache.len(),
                    recompute.len(),
                    requests.len(),
                    thresholds.len()
                )));
            }
            for ((slot, c), r) in out.iter_mut().zip(cache).zip(recompute) {
                *slot = StepsLeft {
                    cache: c,
                    recompute: r,
                };
            }
            Ok(())
        })
    }
}

/// What the scheduler's `predictor` argument may be: a native predictor object (shared, no
/// Python in the loop) or any Python object with a `predict` method.
pub fn predictor_from_object(object: &Bound<'_, PyAny>) -> Box<dyn StepPredictor> {
    if let Ok(gbm) = object.cast::<PyGbmPredictor>() {
        return Box::new(SharedPredictor(gbm.get().inner.clone()));
    }
    if let Ok(rates) = object.cast::<PyMeanRatePredictor>() {
        return Box::new(SharedPredictor(rates.get().inner.clone()));
    }
    Box::new(PyObjectPredictor::new(object.clone().unbind()))
}

/// A native predictor shared with the Python object that made it.
struct SharedPredictor<P>(Arc<P>);

impl<P: StepPredictor> StepPredictor for SharedPredictor<P> {
    fn predict(
        &self,
        request: &RequestView,
        thresholds: &[f64],
        out: &mut [StepsLeft],
    ) -> Result<(), PredictError> {
        self.0.predict(request, thresholds, out)
    }

    fn predict_batch(
        &self,
        requests: &[RequestView],
        thresholds: &[f64],
        out: &mut [StepsLeft],
    ) -> Result<(), PredictError> {
        self.0.predict_batch(requests, thresholds, out)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyForest>()?;
    m.add_class::<PyGbmPredictor>()?;
    m.add_class::<PyMeanRatePredictor>()?;
    m.add_class::<PyRequestViews>()?;
    m.add("PREDICTOR_FEATURES", KNOWN_FEATURES.to_vec())?;
    m.add(
        "PredictorModelError",
        m.py().get_type::<PredictorModelError>(),
    )?;
    m.add("PredictorError", m.py().get_type::<PredictorError>())?;
    Ok(())
}
