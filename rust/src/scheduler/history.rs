//! What the scheduler remembers of each request's life, so the caller gets its statistics
//! at the end without keeping its own bookkeeping.

/// A request that finished, with what happened to it. Returned by
/// [`super::Scheduler::step_done`].
#[derive(Clone, Debug, PartialEq)]
pub struct FinishedRequest {
    pub id: u64,
    /// Steps it ran (aborted steps excluded).
    pub steps: u32,
    /// Of those, steps of kind recompute (0 without caching).
    pub recompute_steps: u32,
    /// Threshold of every step, in order.
    pub taus: Vec<f64>,
    /// Instances it was dispatched to, in order, consecutive repeats collapsed.
    pub instances: Vec<u64>,
    /// Times it moved to another instance between steps (every reported migration).
    pub migrations: u32,
    /// `now` of the round that first dispatched it.
    pub first_dispatch: Option<f64>,
    pub deadline: f64,
    pub arrival: f64,
}

/// Per-request record, kept by request handle.
#[derive(Clone, Debug, Default)]
pub(crate) struct History {
    pub taus: Vec<f64>,
    pub instances: Vec<u64>,
    pub recompute_steps: u32,
    pub migrations: u32,
    pub first_dispatch: Option<f64>,
}

impl History {
    /// Forgets a previous request's record, keeping the buffers.
    pub fn reset(&mut self) {
        self.taus.clear();
        self.instances.clear();
        self.recompute_steps = 0;
        self.migrations = 0;
        self.first_dispatch = None;
    }

    /// Records a dispatch to `instance`, a different one than the last, in the round at
    /// `now`.
    pub fn moved_to(&mut self, instance: u64, now: f64) {
        self.instances.push(instance);
        self.first_dispatch.get_or_insert(now);
    }
}
