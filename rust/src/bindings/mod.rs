//! pyo3 bindings, one file per concern; each converts its Rust errors to Python exceptions.

use pyo3::prelude::*;

mod profile;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    profile::register(m)
}
