//! pyo3 bindings, one file per concern; each converts its Rust errors to Python exceptions.

use pyo3::prelude::*;

mod args;
mod decisions;
mod planner;
mod predictor;
mod profile;
mod scheduler;
mod sim;
mod worker;

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    profile::register(m)?;
    scheduler::register(m)?;
    decisions::register(m)?;
    planner::register(m)?;
    sim::register(m)?;
    worker::register(m)?;
    predictor::register(m)
}
