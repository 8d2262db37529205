//! The job's own key-value store for the rendezvous: any Python object with torch's `Store` methods
//! (`set`, `get`, `check`, `wait`, `add`, `delete_key`) as a [`KeyValueStore`]. The rendezvous runs
//! with the GIL released; each call takes it only for the store's own method.

use std::time::Duration;

use pyo3::exceptions::PyKeyboardInterrupt;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::{Error, Result};
use crate::rendezvous::{JobSecret, KeyValueStore, MAX_VALUE};

/// A Python store (torch's TCPStore, FileStore, HashStore, PrefixStore, or one with their methods).
pub(crate) struct PyStore {
    store: Py<PyAny>,
    name: String,
}

impl PyStore {
    pub(crate) fn new(store: &Bound<'_, PyAny>) -> PyResult<PyStore> {
        let kind = store.get_type().name()?.to_string();
        Ok(PyStore { store: store.clone().unbind(), name: format!("the job's store ({kind})") })
    }

    /// Call `method` with the GIL held; a Python exception becomes a store failure (or, for Ctrl-C,
    /// an interrupt), and `read` turns the result into ours.
    fn call<T>(
        &self,
        method: &str,
        args: impl for<'py> FnOnce(Python<'py>) -> PyResult<Bound<'py, pyo3::types::PyTuple>>,
        read: impl for<'py> FnOnce(&Bound<'py, PyAny>) -> PyResult<T>,
    ) -> Result<T> {
        Python::attach(|py| {
            let got = args(py).and_then(|a| self.store.bind(py).call_method1(method, a));
            got.and_then(|v| read(&v)).map_err(|e| self.failure(py, method, &e))
        })
    }

    fn failure(&self, py: Python<'_>, method: &str, e: &PyErr) -> Error {
        if e.is_instance_of::<PyKeyboardInterrupt>(py) {
            return Error::Interrupted { op: "rendezvous".into() };
        }
        Error::os(format!("rendezvous: {}.{method}", self.name), std::io::Error::other(e.to_string()))
    }

    fn check(&self, keys: &[&str]) -> Result<bool> {
        let keys: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        self.call("check", |py| (keys,).into_pyobject(py), |v| v.extract())
    }
}

impl KeyValueStore for PyStore {
    fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        self.call("set", |py| (key, PyBytes::new(py, value)).into_pyobject(py), |_| Ok(()))
    }

    fn get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        // torch's `get` waits for a missing key: ask first.
        if !self.check(&[key])? {
            return Ok(None);
        }
        let value = self.call(
            "get",
            |py| (key,).into_pyobject(py),
            |v| {
                let b = v.cast::<PyBytes>()?.as_bytes();
                Ok((b.len() <= MAX_VALUE).then(|| b.to_vec()))
            },
        )?;
        value
            .map(Some)
            .ok_or_else(|| Error::invalid(format!("rendezvous: {key:?} in {} is too long", self.name)))
    }

    fn wait(&self, keys: &[&str], timeout: Duration) -> Result<bool> {
        let list: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        match self.call("wait", |py| (list, timeout).into_pyobject(py), |_| Ok(())) {
            Ok(()) => Ok(true),
            Err(Error::Interrupted { op }) => Err(Error::Interrupted { op }),
            // torch's stores raise when the timeout passes: whether the keys came says which it was.
            Err(e) => match self.check(keys) {
                Ok(all) if !all => Ok(false),
                Ok(_) => Ok(true),
                Err(_) => Err(e),
            },
        }
    }

    fn add(&self, key: &str, delta: i64) -> Result<i64> {
        self.call("add", |py| (key, delta).into_pyobject(py), |v| v.extract())
    }

    fn delete(&self, key: &str) -> Result<()> {
        self.call("delete_key", |py| (key,).into_pyobject(py), |_| Ok(()))
    }

    fn name(&self) -> String {
        self.name.clone()
    }
}

/// Refuse a job secret the rendezvous would refuse (too short), with the core's message: the
/// settings check it when they read AXONML_JOB_SECRET.
#[pyfunction]
pub(crate) fn check_job_secret(secret: Vec<u8>) -> PyResult<()> {
    JobSecret::new(secret)?;
    Ok(())
}
