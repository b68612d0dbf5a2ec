//! What one scheduling round decides: per instance the next batch, every migration with its
//! reason, and why each ready request that was not dispatched is waiting. Stored flat and
//! reused between rounds.

use crate::profile::StepKind;

/// One request's next step in a batch.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BatchEntry {
    pub request: u64,
    pub tau: f64,
    pub kind: StepKind,
    /// The instance does not hold this request's token state yet (arrival or migration):
    /// the step command must carry it.
    pub new_here: bool,
    /// *(ours)* A step ahead ([`super::SchedulerConfig::overlap`]): it runs after the
    /// request's step in flight on the same instance, so its kind (`kind` is the likely
    /// one), `block` and `unmasked_in_block` (as of before that step) are the worker's to
    /// resolve; the worker skips it if the request finished in that step.
    pub ahead: bool,
    /// Tokens this step feeds the model: the whole sequence for a recompute or no-cache
    /// step, the block for a cache step.
    pub tokens: u64,
    /// Index of the output block this step works on.
    pub block: u32,
    /// Positions of that block already unmasked before this step.
    pub unmasked_in_block: u32,
    /// Why this `tau`, below.
    pub why: ThresholdWhy,
}

/// *(ours)* How a step's threshold was chosen: the request's predicted seconds left at it
/// on this instance, its time left, and the highest threshold load control allowed it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ThresholdWhy {
    pub reason: ThresholdReason,
    /// NaN under a fixed threshold.
    pub estimate_s: f64,
    pub slo_left_s: f64,
    /// NaN without load control.
    pub cap_tau: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ThresholdReason {
    /// The policy fixes the threshold.
    Fixed,
    /// The highest threshold the request allows whose estimate meets its deadline.
    Fits,
    /// Load control's cap: a higher threshold would have met the deadline alone.
    Capped,
    /// No allowed threshold meets the deadline: the lowest.
    Late,
    /// The request pinned its threshold ([`super::RequestSpec::pinned_tau`]).
    Pinned,
}

impl ThresholdReason {
    pub const ALL: [ThresholdReason; 5] = [
        ThresholdReason::Fixed,
        ThresholdReason::Fits,
        ThresholdReason::Capped,
        ThresholdReason::Late,
        ThresholdReason::Pinned,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ThresholdReason::Fixed => "fixed",
            ThresholdReason::Fits => "fits",
            ThresholdReason::Capped => "capped",
            ThresholdReason::Late => "late",
            ThresholdReason::Pinned => "pinned",
        }
    }
}

/// The next batch of one instance: `entries[start..start + len]` of [`Decisions`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Batch {
    pub instance: u64,
    pub start: usize,
    pub len: usize,
    pub tokens: u64,
    /// Predicted duration of the step (profile × the instance's measured correction).
    pub predicted_s: f64,
    /// Predicted end of the step: it starts now, or after the step in flight there.
    pub predicted_finish: f64,
    /// `releases[release_start..release_start + release_len]` of [`Decisions`]: requests
    /// the instance drops before this step (they left it since its last batch).
    pub release_start: usize,
    pub release_len: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MigrationReason {
    /// Another instance completes the step earlier (or is less loaded, for the baselines).
    Rebalance,
    /// The request's instance is running another step.
    HomeBusy,
    /// The request's instance has no batch-token room left.
    HomeFull,
    /// The request's instance is draining.
    Draining,
    /// The request's instance was removed; its state moves from the engine's copy.
    InstanceRemoved,
    /// The request's last step failed on its instance ([`super::Scheduler::abort_step`]);
    /// its state moves from the engine's copy.
    StepAborted,
}

impl MigrationReason {
    pub const ALL: [MigrationReason; 6] = [
        MigrationReason::Rebalance,
        MigrationReason::HomeBusy,
        MigrationReason::HomeFull,
        MigrationReason::Draining,
        MigrationReason::InstanceRemoved,
        MigrationReason::StepAborted,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            MigrationReason::Rebalance => "rebalance",
            MigrationReason::HomeBusy => "home_busy",
            MigrationReason::HomeFull => "home_full",
            MigrationReason::Draining => "draining",
            MigrationReason::InstanceRemoved => "instance_removed",
            MigrationReason::StepAborted => "step_aborted",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Migration {
    pub request: u64,
    pub from: u64,
    pub to: u64,
    pub reason: MigrationReason,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WaitReason {
    /// No instance accepts new work (none, or all draining).
    NoInstance,
    /// Every accepting instance is running a step and none has batch-token room for this
    /// request in its next one.
    AllBusy,
    /// No instance has batch-token room for this request.
    NoRoom,
    /// The request must stay on its instance (cache step, or no migration), which is busy.
    HomeBusy,
    /// The request must stay on its instance, which has no batch-token room left.
    HomeFull,
    /// No instance it may move to has resident capacity (KV tokens or request slots) for it.
    NoKvRoom,
    /// The instance that would complete its step earliest is running a step: the request
    /// waits for it rather than starting elsewhere now.
    QueuedBusy,
}

impl WaitReason {
    pub const ALL: [WaitReason; 7] = [
        WaitReason::NoInstance,
        WaitReason::AllBusy,
        WaitReason::NoRoom,
        WaitReason::HomeBusy,
        WaitReason::HomeFull,
        WaitReason::NoKvRoom,
        WaitReason::QueuedBusy,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            WaitReason::NoInstance => "no_instance",
            WaitReason::AllBusy => "all_busy",
            WaitReason::NoRoom => "no_room",
            WaitReason::HomeBusy => "home_busy",
            WaitReason::HomeFull => "home_full",
            WaitReason::NoKvRoom => "no_kv_room",
            WaitReason::QueuedBusy => "queued_busy",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiting {
    pub request: u64,
    pub reason: WaitReason,
}

/// Result of [`super::Scheduler::schedule`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decisions {
    pub now: f64,
    /// One per instance that runs a step, in instance announcement order.
    pub batches: Vec<Batch>,
    /// Entries of every batch, grouped by batch.
    pub entries: Vec<BatchEntry>,
    pub migrations: Vec<Migration>,
    /// Released request ids of every batch, grouped by batch.
    pub releases: Vec<u64>,
    pub waiting: Vec<Waiting>,
    /// Load control found that even every request at its lowest allowed threshold exceeds
    /// the cluster's capacity (always false when load control is off).
    pub overloaded: bool,
    /// Wall time the round took inside the scheduler.
    pub elapsed_s: f64,
}

impl Decisions {
    pub fn entries_of(&self, batch: &Batch) -> &[BatchEntry] {
        &self.entries[batch.start..batch.start + batch.len]
    }

    pub fn releases_of(&self, batch: &Batch) -> &[u64] {
        &self.releases[batch.release_start..batch.release_start + batch.release_len]
    }

    pub(crate) fn clear(&mut self, now: f64) {
        self.now = now;
        self.batches.clear();
        self.entries.clear();
        self.migrations.clear();
        self.releases.clear();
        self.waiting.clear();
        self.overloaded = false;
        self.elapsed_s = 0.0;
    }
}
