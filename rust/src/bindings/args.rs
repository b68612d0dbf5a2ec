//! Argument types shared by the bindings.

use std::marker::PhantomData;

use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::PyTypeInfo;

/// An unsigned integer argument (an id, a count, a GPU number). A negative or too large value
/// raises the binding's bad-input exception `E` (a `ValueError` subclass) instead of pyo3's
/// `OverflowError`; a value that is no integer at all still raises `TypeError`.
pub struct Unsigned<T, E>(pub T, PhantomData<E>);

impl<T, E> Unsigned<T, E> {
    pub const fn new(value: T) -> Self {
        Unsigned(value, PhantomData)
    }
}

impl<'a, 'py, T, E> FromPyObject<'a, 'py> for Unsigned<T, E>
where
    T: FromPyObject<'a, 'py>,
    E: PyTypeInfo,
{
    type Error = PyErr;

    fn extract(obj: Borrowed<'a, 'py, PyAny>) -> PyResult<Self> {
        T::extract(obj).map(Unsigned::new).map_err(|e| {
            let e: PyErr = e.into();
            if !e.is_instance_of::<PyOverflowError>(obj.py()) {
                return e;
            }
            PyErr::new::<E, _>(format!(
                "expected an integer in [0, 2^{}), got {}",
                8 * std::mem::size_of::<T>(),
                obj.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })
    }
}
