//! Python view of a worker's token state (`held_tokens`): a step's packed model call out
//! as one int64 buffer, its read-back in through the buffer protocol, report columns out
//! as lists.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyByteArray;

use crate::held_tokens::{CacheWindow, HeldTokens};
use crate::profile::StepKind;
use crate::tokens::TokenSpec;

/// The token state of the requests resident on a worker: their prompts, outputs and step
/// counters, with the rules of the engine core's own copy.
#[pyclass(name = "HeldTokens", module = "dilaserve._core")]
pub struct PyHeldTokens {
    inner: HeldTokens,
}

fn not_held(id: u64) -> PyErr {
    PyKeyError::new_err(id)
}

/// Step kinds from their codes (`STEP_KINDS` order).
fn kinds_of(codes: &[u8]) -> PyResult<Vec<StepKind>> {
    codes
        .iter()
        .map(|&c| {
            StepKind::ALL
                .get(c as usize)
                .copied()
                .ok_or_else(|| PyValueError::new_err(format!("no step kind has code {c}")))
        })
        .collect()
}

/// A packed step: the int64 buffer, fed tokens per row, sequence length per row, width.
type Packed<'py> = (Bound<'py, PyByteArray>, Vec<u32>, Vec<u32>, usize);

type Report = (
    Vec<u32>,
    Vec<u32>,
    Vec<u32>,
    Vec<u32>,
    Vec<f64>,
    Vec<bool>,
    Vec<u32>,
);

#[pymethods]
impl PyHeldTokens {
    /// `exact`: block diffusion's exact KV cache (`held_tokens::CacheWindow::Exact`).
    #[new]
    #[pyo3(signature = (exact=false))]
    fn new(exact: bool) -> Self {
        let inner = if exact {
            HeldTokens::exact()
        } else {
            HeldTokens::default()
        };
        Self { inner }
    }

    /// Takes a request in with its output so far and `(steps_done, block_steps,
    /// timestep)`, its first `lead` output positions the prompt's tail; `ValueError` if
    /// they do not fit together.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (id, prompt, output, block_length, mask, stops, fixed_schedule, counters, lead=0))]
    fn add(
        &mut self,
        id: u64,
        prompt: Vec<u32>,
        output: Vec<u32>,
        block_length: u32,
        mask: u32,
        stops: Vec<u32>,
        fixed_schedule: bool,
        counters: (u32, u32, u32),
        lead: u32,
    ) -> PyResult<()> {
        let spec = TokenSpec {
            output_len: output.len() as u32,
            block_length,
            mask,
            stops,
            fixed_schedule,
            lead,
        };
        let (steps, block_steps, timestep) = counters;
        self.inner
            .add(id, prompt, &spec, &output, [steps, block_steps, timestep])
            .map_err(PyValueError::new_err)
    }

    /// Under the exact cache: the request's first `length` positions (whole prompt blocks)
    /// already hold final K/V here; `ValueError` otherwise.
    fn seed_exact(&mut self, id: u64, length: usize) -> PyResult<()> {
        self.inner
            .seed_exact(id, length)
            .map_err(PyValueError::new_err)
    }

    /// Drops a request: its output and `(steps_done, block_steps, timestep)`.
    fn remove(&mut self, id: u64) -> PyResult<(Vec<u32>, (u32, u32, u32))> {
        let (output, [a, b, c]) = self.inner.remove(id).ok_or_else(|| not_held(id))?;
        Ok((output, (a, b, c)))
    }

    fn __contains__(&self, id: u64) -> bool {
        self.inner.contains(id)
    }

    fn output(&self, id: u64) -> PyResult<Vec<u32>> {
        Ok(self.inner.output(id).ok_or_else(|| not_held(id))?.to_vec())
    }

    /// `(steps_done, block_steps, timestep, masked_in_block)`.
    fn counters(&self, id: u64) -> PyResult<(u32, u32, u32, u32)> {
        let c = self.inner.counters(id).ok_or_else(|| not_held(id))?;
        Ok((c.steps_done, c.block_steps, c.timestep, c.masked_in_block))
    }

    fn done(&self, id: u64) -> PyResult<bool> {
        self.inner.done(id).ok_or_else(|| not_held(id))
    }

    /// This instance holds K/V of the request's current block: a cache step may read it.
    fn cache_valid(&self, id: u64) -> PyResult<bool> {
        self.inner.cache_valid(id).ok_or_else(|| not_held(id))
    }

    /// The packed model call of a step: `(buffer, lengths, seq_lengths, width)`, the
    /// buffer holding int64 fed ids `[T]`, positions `[T]`, pool slots `[T]` (with
    /// `bases`), the logit index `[rows, width]` and the candidate flags `[rows, width]`.
    #[pyo3(signature = (ids, kinds, suffix, shift, bases=None))]
    fn pack<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u64>,
        kinds: Vec<u8>,
        suffix: bool,
        shift: usize,
        bases: Option<Vec<i64>>,
    ) -> PyResult<Packed<'py>> {
        let window = if suffix {
            CacheWindow::Suffix
        } else {
            CacheWindow::Block
        };
        let p = self
            .inner
            .pack(&ids, &kinds_of(&kinds)?, window, shift, bases.as_deref())
            .map_err(PyValueError::new_err)?;
        let parts = [&p.ids, &p.positions, &p.slots, &p.index, &p.candidate];
        let values = parts.iter().map(|v| v.len()).sum::<usize>();
        let buffer = PyByteArray::new_with(py, values * 8, |bytes| {
            let values = parts.iter().flat_map(|v| v.iter());
            for (chunk, v) in bytes.chunks_exact_mut(8).zip(values) {
                chunk.copy_from_slice(&v.to_ne_bytes());
            }
            Ok(())
        })?;
        Ok((buffer, p.lengths, p.seq_lengths, p.width))
    }

    /// Applies a step's read-back `host` (`[rows, 3 * width + 1]` float64: committed
    /// flags, ids, confidences, grid steps) to every row, or to none (`ValueError`); the
    /// report's `(blocks, counts, positions, tokens, confidence, done, timesteps)`.
    fn commit(
        &mut self,
        py: Python<'_>,
        ids: Vec<u64>,
        kinds: Vec<u8>,
        host: &Bound<'_, PyAny>,
    ) -> PyResult<Report> {
        let host = PyBuffer::<f64>::get(host)?;
        let out = self
            .inner
            .commit(&ids, &kinds_of(&kinds)?, &host.to_vec(py)?)
            .map_err(PyValueError::new_err)?;
        Ok((
            out.blocks,
            out.counts,
            out.positions,
            out.tokens,
            out.stats,
            out.done,
            out.timesteps,
        ))
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyHeldTokens>()
}
