//! Python view of a round's decisions: columns as little-endian `bytes` (read with
//! `numpy.frombuffer`), so handing 10k entries to Python costs a copy, not 10k objects.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::profile::StepKind;
use crate::scheduler::{Decisions, MigrationReason, WaitReason};

/// Code of a step kind in `Decisions.entry_kinds`: its index in `StepKind::ALL`.
fn kind_code(kind: StepKind) -> u8 {
    StepKind::ALL.iter().position(|&k| k == kind).unwrap_or(0) as u8
}

/// Code of a wait reason in `Decisions.waiting_reasons`: its index in `WaitReason::ALL`.
fn wait_code(reason: WaitReason) -> u8 {
    WaitReason::ALL
        .iter()
        .position(|&r| r == reason)
        .unwrap_or(0) as u8
}

/// Packs 8-byte little-endian values into a `bytes` object without an intermediate buffer.
fn packed<'py>(
    py: Python<'py>,
    values: impl ExactSizeIterator<Item = [u8; 8]>,
) -> PyResult<Bound<'py, PyBytes>> {
    PyBytes::new_with(py, values.len() * 8, |buf| {
        for (chunk, v) in buf.chunks_exact_mut(8).zip(values) {
            chunk.copy_from_slice(&v);
        }
        Ok(())
    })
}

/// Decisions of one scheduling round (see `dilaserve.scheduler.Decisions`).
#[pyclass(name = "Decisions", module = "dilaserve._core", frozen)]
pub struct PyDecisions {
    pub inner: Decisions,
}

#[pymethods]
impl PyDecisions {
    #[getter]
    fn now(&self) -> f64 {
        self.inner.now
    }

    /// Seconds the round took inside the Rust core.
    #[getter]
    fn elapsed_s(&self) -> f64 {
        self.inner.elapsed_s
    }

    #[getter]
    fn num_batches(&self) -> usize {
        self.inner.batches.len()
    }

    #[getter]
    fn num_entries(&self) -> usize {
        self.inner.entries.len()
    }

    /// `(instance, start, len, tokens, predicted_finish)` per batch.
    fn batches(&self) -> Vec<(u64, usize, usize, u64, f64)> {
        self.inner
            .batches
            .iter()
            .map(|b| (b.instance, b.start, b.len, b.tokens, b.predicted_finish))
            .collect()
    }

    /// Request ids of all entries, grouped by batch (uint64).
    fn entry_requests<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        packed(
            py,
            self.inner.entries.iter().map(|e| e.request.to_le_bytes()),
        )
    }

    /// Threshold of every entry (float64).
    fn entry_taus<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        packed(py, self.inner.entries.iter().map(|e| e.tau.to_le_bytes()))
    }

    /// Step kind code of every entry (uint8, index into `STEP_KINDS`).
    fn entry_kinds<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let codes: Vec<u8> = self
            .inner
            .entries
            .iter()
            .map(|e| kind_code(e.kind))
            .collect();
        PyBytes::new(py, &codes)
    }

    /// 1 where the entry's instance does not hold the request's state yet (uint8).
    fn entry_new_here<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let flags: Vec<u8> = self
            .inner
            .entries
            .iter()
            .map(|e| u8::from(e.new_here))
            .collect();
        PyBytes::new(py, &flags)
    }

    /// `(request, from_instance, to_instance, reason)` per migration.
    fn migrations(&self) -> Vec<(u64, u64, u64, &'static str)> {
        self.inner
            .migrations
            .iter()
            .map(|m| (m.request, m.from, m.to, m.reason.as_str()))
            .collect()
    }

    /// Ids of waiting requests (uint64).
    fn waiting_requests<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        packed(
            py,
            self.inner.waiting.iter().map(|w| w.request.to_le_bytes()),
        )
    }

    /// Wait reason code per waiting request (uint8, index into `WAIT_REASONS`).
    fn waiting_reasons<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let codes: Vec<u8> = self
            .inner
            .waiting
            .iter()
            .map(|w| wait_code(w.reason))
            .collect();
        PyBytes::new(py, &codes)
    }

    fn __repr__(&self) -> String {
        format!(
            "Decisions(now={}, batches={}, entries={}, migrations={}, waiting={})",
            self.inner.now,
            self.inner.batches.len(),
            self.inner.entries.len(),
            self.inner.migrations.len(),
            self.inner.waiting.len()
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDecisions>()?;
    let kinds: Vec<&str> = StepKind::ALL.iter().map(|k| k.as_str()).collect();
    m.add("STEP_KINDS", PyTuple::new(m.py(), kinds)?)?;
    let waits: Vec<&str> = WaitReason::ALL.iter().map(|r| r.as_str()).collect();
    m.add("WAIT_REASONS", PyTuple::new(m.py(), waits)?)?;
    let migrations: Vec<&str> = MigrationReason::ALL.iter().map(|r| r.as_str()).collect();
    m.add("MIGRATION_REASONS", PyTuple::new(m.py(), migrations)?)?;
    Ok(())
}
