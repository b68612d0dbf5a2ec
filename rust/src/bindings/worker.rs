//! Python view of the worker's step read-back (`step_readback`): numpy arrays in through
//! the buffer protocol, report columns out as lists.

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::step_readback::read_back;

/// `(counts, positions, tokens, stats, timesteps)` of a step's read-back `host`
/// (`[rows, 3 * width + 1]` float64: committed flags, ids, confidences, grid steps), row
/// `i` having `candidates[i]` candidate columns whose block positions are `columns[i]`
/// (`[rows, width]` int64).
#[pyfunction(name = "read_back")]
fn py_read_back(
    py: Python<'_>,
    host: &Bound<'_, PyAny>,
    candidates: Vec<u32>,
    columns: &Bound<'_, PyAny>,
) -> PyResult<(Vec<u32>, Vec<u32>, Vec<u32>, Vec<f64>, Vec<u32>)> {
    let host = PyBuffer::<f64>::get(host)?;
    let columns = PyBuffer::<i64>::get(columns)?;
    let (&[rows, stride], &[_, width]) = (host.shape(), columns.shape()) else {
        return Err(PyValueError::new_err(
            "read-back arrays must be two-dimensional",
        ));
    };
    if stride != 3 * width + 1 {
        return Err(PyValueError::new_err(format!(
            "a read-back row of {width} columns has {} values, got {stride}",
            3 * width + 1
        )));
    }
    let out = read_back(
        &host.to_vec(py)?,
        rows,
        width,
        &candidates,
        &columns.to_vec(py)?,
    )
    .map_err(PyValueError::new_err)?;
    Ok((
        out.counts,
        out.positions,
        out.tokens,
        out.stats,
        out.timesteps,
    ))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(py_read_back, m)?)
}
