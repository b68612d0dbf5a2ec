//! Python view of a round's decisions: batches (with their release ranges), entries,
//! released ids and waiting requests each as one `bytes` of packed little-endian records
//! (read with `numpy.frombuffer` and a structured dtype), so handing 10k dispatched steps
//! to Python costs a copy, not 10k objects.

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyTuple};

use crate::profile::StepKind;
use crate::scheduler::{Decisions, MigrationReason, ThresholdReason, WaitReason};

/// Code of a step kind in `entry_kinds`: its index in `StepKind::ALL`.
fn kind_code(kind: StepKind) -> u8 {
    StepKind::ALL.iter().position(|&k| k == kind).unwrap_or(0) as u8
}

/// Code of a threshold reason in `entry_reasons`: its index in `ThresholdReason::ALL`.
fn reason_code(reason: ThresholdReason) -> u8 {
    ThresholdReason::ALL
        .iter()
        .position(|&r| r == reason)
        .unwrap_or(0) as u8
}

/// Code of a wait reason in `waiting_reasons`: its index in `WaitReason::ALL`.
fn wait_code(reason: WaitReason) -> u8 {
    WaitReason::ALL
        .iter()
        .position(|&r| r == reason)
        .unwrap_or(0) as u8
}

/// Writes one fixed-width little-endian record per item into a `bytes` object, without a
/// staging buffer. Record layouts are mirrored by numpy dtypes in `dilaserve.scheduler`.
fn records<'py, T>(
    py: Python<'py>,
    items: &[T],
    width: usize,
    write: impl Fn(&T, &mut [u8]),
) -> PyResult<Py<PyBytes>> {
    let bytes = PyBytes::new_with(py, items.len() * width, |buf| {
        for (chunk, item) in buf.chunks_exact_mut(width).zip(items) {
            write(item, chunk);
        }
        Ok(())
    })?;
    Ok(bytes.unbind())
}

/// Batch record: instance u64, start u64, len u64, tokens u64, predicted_finish f64,
/// release_start u64, release_len u64, predicted_s f64.
const BATCH_WIDTH: usize = 64;
/// Entry record: request u64, tau f64, kind u8, new_here u8, tokens u64, block u32,
/// unmasked_in_block u32, then why: reason u8, estimate_s f64, slo_left_s f64, cap_tau f64;
/// then ahead u8.
const ENTRY_WIDTH: usize = 60;
/// Waiting record: request u64, reason u8.
const WAITING_WIDTH: usize = 9;

/// Decisions of one scheduling round (see `dilaserve.scheduler.Decisions`).
#[pyclass(name = "Decisions", module = "dilaserve._core", frozen)]
pub struct PyDecisions {
    #[pyo3(get)]
    now: f64,
    /// Seconds the round took inside the Rust core.
    #[pyo3(get)]
    elapsed_s: f64,
    /// Load control found the cluster overloaded in this round.
    #[pyo3(get)]
    overloaded: bool,
    #[pyo3(get)]
    batches: Py<PyBytes>,
    #[pyo3(get)]
    entries: Py<PyBytes>,
    #[pyo3(get)]
    releases: Py<PyBytes>,
    #[pyo3(get)]
    waiting: Py<PyBytes>,
    migrations: Vec<(u64, u64, u64, &'static str)>,
}

impl PyDecisions {
    pub fn new(py: Python<'_>, d: &Decisions) -> PyResult<Self> {
        Ok(Self {
            now: d.now,
            elapsed_s: d.elapsed_s,
            overloaded: d.overloaded,
            batches: records(py, &d.batches, BATCH_WIDTH, |b, out| {
                out[0..8].copy_from_slice(&b.instance.to_le_bytes());
                out[8..16].copy_from_slice(&(b.start as u64).to_le_bytes());
                out[16..24].copy_from_slice(&(b.len as u64).to_le_bytes());
                out[24..32].copy_from_slice(&b.tokens.to_le_bytes());
                out[32..40].copy_from_slice(&b.predicted_finish.to_le_bytes());
                out[40..48].copy_from_slice(&(b.release_start as u64).to_le_bytes());
                out[48..56].copy_from_slice(&(b.release_len as u64).to_le_bytes());
                out[56..64].copy_from_slice(&b.predicted_s.to_le_bytes());
            })?,
            releases: records(py, &d.releases, 8, |r, out| {
                out.copy_from_slice(&r.to_le_bytes());
            })?,
            entries: records(py, &d.entries, ENTRY_WIDTH, |e, out| {
                out[0..8].copy_from_slice(&e.request.to_le_bytes());
                out[8..16].copy_from_slice(&e.tau.to_le_bytes());
                out[16] = kind_code(e.kind);
                out[17] = u8::from(e.new_here);
                out[18..26].copy_from_slice(&e.tokens.to_le_bytes());
                out[26..30].copy_from_slice(&e.block.to_le_bytes());
                out[30..34].copy_from_slice(&e.unmasked_in_block.to_le_bytes());
                out[34] = reason_code(e.why.reason);
                out[35..43].copy_from_slice(&e.why.estimate_s.to_le_bytes());
                out[43..51].copy_from_slice(&e.why.slo_left_s.to_le_bytes());
                out[51..59].copy_from_slice(&e.why.cap_tau.to_le_bytes());
                out[59] = u8::from(e.ahead);
            })?,
            waiting: records(py, &d.waiting, WAITING_WIDTH, |w, out| {
                out[0..8].copy_from_slice(&w.request.to_le_bytes());
                out[8] = wait_code(w.reason);
            })?,
            migrations: d
                .migrations
                .iter()
                .map(|m| (m.request, m.from, m.to, m.reason.as_str()))
                .collect(),
        })
    }
}

/// One batch as the engine sends it: `(instance, requests, taus, kind codes, released ids,
/// ids new there, predicted seconds)`. A step ahead's kind code is `len(STEP_KINDS)`
/// (the worker resolves it).
pub type BatchCommand = (u64, Vec<u64>, Vec<f64>, Vec<u32>, Vec<u64>, Vec<u64>, f64);

/// Every batch of a round as [`BatchCommand`]s: plain lists, built without a record per
/// entry on the Python side.
pub fn batch_commands(d: &Decisions) -> Vec<BatchCommand> {
    let ahead_code = StepKind::ALL.len() as u32;
    d.batches
        .iter()
        .map(|b| {
            let entries = d.entries_of(b);
            (
                b.instance,
                entries.iter().map(|e| e.request).collect(),
                entries.iter().map(|e| e.tau).collect(),
                entries
                    .iter()
                    .map(|e| {
                        if e.ahead {
                            ahead_code
                        } else {
                            u32::from(kind_code(e.kind))
                        }
                    })
                    .collect(),
                d.releases_of(b).to_vec(),
                entries
                    .iter()
                    .filter(|e| e.new_here)
                    .map(|e| e.request)
                    .collect(),
                b.predicted_s,
            )
        })
        .collect()
}

#[pymethods]
impl PyDecisions {
    /// `(request, from_instance, to_instance, reason)` per migration.
    fn migrations(&self) -> Vec<(u64, u64, u64, &'static str)> {
        self.migrations.clone()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Decisions(now={}, batches={}, entries={}, migrations={}, waiting={})",
            self.now,
            self.batches.as_bytes(py).len() / BATCH_WIDTH,
            self.entries.as_bytes(py).len() / ENTRY_WIDTH,
            self.migrations.len(),
            self.waiting.as_bytes(py).len() / WAITING_WIDTH
        )
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyDecisions>()?;
    let kinds: Vec<&str> = StepKind::ALL.iter().map(|k| k.as_str()).collect();
    m.add("STEP_KINDS", PyTuple::new(py, kinds)?)?;
    let waits: Vec<&str> = WaitReason::ALL.iter().map(|r| r.as_str()).collect();
    m.add("WAIT_REASONS", PyTuple::new(py, waits)?)?;
    let migrations: Vec<&str> = MigrationReason::ALL.iter().map(|r| r.as_str()).collect();
    m.add("MIGRATION_REASONS", PyTuple::new(py, migrations)?)?;
    let reasons: Vec<&str> = ThresholdReason::ALL.iter().map(|r| r.as_str()).collect();
    m.add("THRESHOLD_REASONS", PyTuple::new(py, reasons)?)?;
    Ok(())
}
