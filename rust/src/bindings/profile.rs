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
/// One `(tp, kind, [(tokens, seconds), ...])` table as Python passes it.
type TableArg = (Count<u32>, String, Vec<(Count<u64>, f64)>);

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

    /// Builds a profile from `(tp, kind, [(tokens, seconds), ...])` triples.
    #[staticmethod]
    fn from_tables(tables: Vec<TableArg>) -> PyResult<Self> {
        let parsed = tables
            .into_iter()
            .map(|(tp, kind, points)| {
                let points = points.into_iter().map(|(t, s)| (t.0, s)).collect();
                Ok((tp.0, kind.parse::<StepKind>()?, points))
            })
            .collect::<Result<Vec<_>, ProfileError>>()?;
        Ok(Self {
            inner: LatencyProfile::from_tables(parsed)?,
        })
    }

    fn to_json(&self) -> String {
        self.inner.to_json()
    }

    /// Seconds for one `kind` step over `tokens` batch tokens on a TP-`tp` instance.
    fn latency(&self, tp: Count<u32>, kind: &str, tokens: f64) -> PyResult<f64> {
        Ok(self.inner.latency(tp.0, kind.parse()?, tokens)?)
    }

    /// Measured `(tokens, seconds)` points of one table.
    fn points(&self, tp: Count<u32>, kind: &str) -> PyResult<Vec<(u64, f64)>> {
        Ok(self.inner.table(tp.0, kind.parse()?)?.points().collect())
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
