//! Python view of `LatencyProfile`.

use std::path::PathBuf;

use pyo3::create_exception;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use super::args::Unsigned;
use crate::profile::{LatencyProfile, ProfileError, StepKind};

create_exception!(
    dilaserve._core,
    LatencyProfileError,
    PyValueError,
    "A latency profile is malformed or lacks a requested TP degree or step kind."
);

impl From<ProfileError> for PyErr {
    fn from(e: ProfileError) -> PyErr {
        match e {
            ProfileError::Io { .. } => pyo3::exceptions::PyOSError::new_err(e.to_string()),
            other => LatencyProfileError::new_err(other.to_string()),
        }
    }
}

/// Unsigned arguments of a profile raise `LatencyProfileError` when out of range.
type Count<T> = Unsigned<T, LatencyProfileError>;
/// One `(tp, kind, [(tokens, seconds), ...])` table as Python passes it, optionally with
/// the context length it was measured at as a fourth item.
type TableArg = (
    Count<u32>,
    String,
    Vec<(Count<u64>, f64)>,
    Option<Count<u64>>,
);

/// Measured per-step latency by TP degree, step kind and batch tokens.
#[pyclass(name = "LatencyProfile", module = "dilaserve._core", frozen)]
pub struct PyLatencyProfile {
    pub inner: LatencyProfile,
}

#[pymethods]
impl PyLatencyProfile {
    /// Parses the JSON text written by `dilaserve profile`.
    #[staticmethod]
    fn from_json(text: &str) -> PyResult<Self> {
        Ok(Self {
            inner: LatencyProfile::from_json(text)?,
        })
    }

    /// Loads a profile JSON file.
    #[staticmethod]
    fn load(path: PathBuf) -> PyResult<Self> {
        Ok(Self {
            inner: LatencyProfile::load(path)?,
        })
    }

    /// Builds a profile from `(tp, kind, [(tokens, seconds), ...])` triples, or
    /// `(tp, kind, points, context)` for tables measured at a cached-context length.
    #[staticmethod]
    fn from_tables(tables: Vec<Bound<'_, PyAny>>) -> PyResult<Self> {
        let parsed = tables
            .into_iter()
            .map(|item| {
                let (tp, kind, points, context): TableArg = match item.len()? {
                    3 => {
                        let (tp, kind, points) = item.extract()?;
                        (tp, kind, points, None)
                    }
                    _ => item.extract()?,
                };
                let points = points.into_iter().map(|(t, s)| (t.0, s)).collect();
                Ok((
                    tp.0,
                    kind.parse::<StepKind>()?,
                    context.map(|c| c.0),
                    points,
                ))
            })
            .collect::<PyResult<Vec<_>>>()?;
        Ok(Self {
            inner: LatencyProfile::from_context_tables(parsed)?,
        })
    }

    fn to_json(&self) -> String {
        self.inner.to_json()
    }

    /// Seconds for one `kind` step over `tokens` batch tokens on a TP-`tp` instance, at
    /// the shortest measured context.
    fn latency(&self, tp: Count<u32>, kind: &str, tokens: f64) -> PyResult<f64> {
        Ok(self.inner.latency(tp.0, kind.parse()?, tokens)?)
    }

    /// Seconds for one `kind` step over `batch_tokens` fed tokens whose requests hold
    /// `context_tokens` cached tokens each.
    fn step_time(
        &self,
        tp: Count<u32>,
        kind: &str,
        batch_tokens: f64,
        context_tokens: f64,
    ) -> PyResult<f64> {
        Ok(self
            .inner
            .step_time(tp.0, kind.parse()?, batch_tokens, context_tokens)?)
    }

    /// Context lengths one table was measured at (empty: context-free).
    fn contexts(&self, tp: Count<u32>, kind: &str) -> PyResult<Vec<u64>> {
        Ok(self.inner.table(tp.0, kind.parse()?)?.contexts())
    }

    /// Measured `(tokens, seconds)` points of one table, at `context` where the table was
    /// measured at several (default: the shortest).
    #[pyo3(signature = (tp, kind, context=None))]
    fn points(
        &self,
        tp: Count<u32>,
        kind: &str,
        context: Option<Count<u64>>,
    ) -> PyResult<Vec<(u64, f64)>> {
        let tables = self.inner.table(tp.0, kind.parse()?)?;
        let Some(context) = context else {
            return Ok(tables.shortest().points().collect());
        };
        tables
            .slices()
            .find(|(c, _)| *c == Some(context.0))
            .map(|(_, t)| t.points().collect())
            .ok_or_else(|| {
                LatencyProfileError::new_err(format!(
                    "no {kind} table at context {} for TP degree {}",
                    context.0, tp.0
                ))
            })
    }

    fn degrees(&self) -> Vec<u32> {
        self.inner.degrees()
    }

    #[getter]
    fn model(&self) -> &str {
        &self.inner.model
    }

    #[getter]
    fn device(&self) -> &str {
        &self.inner.device
    }

    #[getter]
    fn dtype(&self) -> &str {
        &self.inner.dtype
    }

    #[getter]
    fn block_length(&self) -> u32 {
        self.inner.block_length
    }

    fn __repr__(&self) -> String {
        format!(
            "LatencyProfile(model={:?}, device={:?}, degrees={:?})",
            self.inner.model,
            self.inner.device,
            self.inner.degrees()
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyLatencyProfile>()?;
    m.add(
        "LatencyProfileError",
        m.py().get_type::<LatencyProfileError>(),
    )?;
    Ok(())
}
