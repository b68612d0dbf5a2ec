//! DiLaServe's Rust core: latency profiles, and (growing) the scheduling loop, load
//! accounting and ILP reconfiguration. Everything here is a plain Rust library; the pyo3
//! bindings are compiled only with the `python` feature, which maturin turns on.

pub mod held_tokens;
mod id_map;
pub mod planner;
pub mod predictor;
pub mod profile;
pub mod scheduler;
pub mod settings;
pub mod sim;
pub mod step_readback;
pub mod step_report;
pub mod tokens;

#[cfg(feature = "python")]
mod bindings;

#[cfg(feature = "python")]
use pyo3::prelude::*;

/// The `dilaserve._core` extension module.
#[cfg(feature = "python")]
#[pymodule]
#[pyo3(name = "_core")]
fn core_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    bindings::register(m)
}
