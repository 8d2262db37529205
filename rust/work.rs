//! Asynchronous collectives: a per-group worker thread runs queued jobs in issue order, and a [`Work`]
//! handle reports each job's result.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};

use crate::error::Result;

type Job = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct State {
    result: Mutex<Option<Result<()>>>,
    finished: Condvar,
}

/// The handle of one queued job.
#[derive(Clone, Default)]
pub struct Work {
    state: Arc<State>,
}

impl Work {
    /// Block until the job has run; returns its result (every call returns the same).
    pub fn wait(&self) -> Result<()> {
        let mut r = self.state.result.lock().unwrap_or_else(|e| e.into_inner());
        while r.is_none() {
            r = self.state.finished.wait(r).unwrap_or_else(|e| e.into_inner());
        }
        r.clone().expect("checked above")
    }

    /// True once the job has run.
    pub fn is_completed(&self) -> bool {
        self.state.result.lock().unwrap_or_else(|e| e.into_inner()).is_some()
    }

    fn finish(&self, result: Result<()>) {
        *self.state.result.lock().unwrap_or_else(|e| e.into_inner()) = Some(result);
        self.state.finished.notify_all();
    }
}

/// A lazily started worker thread and the last job given to it.
#[derive(Default)]
pub(crate) struct WorkQueue {
    inner: Mutex<Option<(Sender<Job>, Work)>>,
}

impl WorkQueue {
    pub(crate) fn submit(&self, job: impl FnOnce() -> Result<()> + Send + 'static) -> Work {
        let work = Work::default();
        let handle = work.clone();
        let task: Job = Box::new(move || handle.finish(job()));
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let tx = match inner.take() {
            Some((tx, _)) => tx,
            None => {
                let (tx, rx) = channel::<Job>();
                // The thread ends when the group (and with it the sender) is dropped.
                std::thread::Builder::new()
                    .name("axonml-work".into())
                    .spawn(move || rx.into_iter().for_each(|job| job()))
                    .expect("spawning the group's work thread");
                tx
            }
        };
        tx.send(task).expect("the work thread lives as long as its sender");
        *inner = Some((tx, work.clone()));
        work
    }

    /// Wait for the last submitted job (and so for every earlier one).
    pub(crate) fn flush(&self) {
        let last = self.inner.lock().unwrap_or_else(|e| e.into_inner()).as_ref().map(|(_, w)| w.clone());
        if let Some(w) = last {
            let _ = w.wait();
        }
    }
}
