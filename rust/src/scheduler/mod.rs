//! The step-level scheduler (DESIGN §2, §4–§6, §8) as a plain Rust library.
//!
//! Events ([`Scheduler::arrive`], [`Scheduler::step_done`], [`Scheduler::cancel`], instance
//! add / drain / remove) update request and instance state; [`Scheduler::schedule`] runs one
//! round — load control, instance choice, threshold choice — and returns the next batch of
//! every idle instance, every migration and why each undispatched ready request waits.
//! The same inputs always give the same decisions.
//!
//! *(ours)* A round only fills idle instances: an instance gets its next batch once its
//! step is reported, so a request's next step always sees where its state now lives. A
//! request free to move stays on its instance unless another one is strictly better; if
//! the best instance is busy it waits for it (`QueuedBusy`) rather than start elsewhere.
//!
//! Instances may bound their resident requests (KV tokens, request count) and their batch
//! tokens; placement never exceeds either. A request that no instance has room for reserves
//! the instance that will fit it soonest, so a stream of small requests cannot starve it
//! (see `reservation`). While load control finds the cluster overloaded, arrivals past
//! `max_queued` waiting requests are rejected ([`SchedError::Admission`]); a request past
//! its deadline still runs to the end unless cancelled.

mod choice_tree;
mod config;
mod cost;
mod decisions;
mod error;
mod events;
mod forecast;
mod history;
mod instance;
mod instance_events;
mod load_control;
mod placement;
mod predictor;
mod request;
mod request_table;
mod reservation;
mod round;
mod shared_blocks;
mod shedding;
mod threshold;

#[cfg(test)]
mod proptests;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_capacity;
#[cfg(test)]
mod tests_events;
#[cfg(test)]
mod tests_lifecycle;
#[cfg(test)]
mod tests_overlap;

pub use config::{
    Admission, InstanceChoice, LoadModel, LoadOrder, Policy, Prediction, Preset, SchedulerConfig,
    ThresholdPolicy, MAX_THRESHOLDS, PRESETS,
};
pub use cost::{DegreeCosts, Limits};
pub use decisions::{
    Batch, BatchEntry, Decisions, Migration, MigrationReason, ThresholdReason, ThresholdWhy,
    WaitReason, Waiting,
};
pub use error::SchedError;
pub use events::StepResult;
pub use history::FinishedRequest;
pub use instance::InstanceSpec;
pub use load_control::{request_load, LoadControl};
pub use predictor::{
    check_predictions, MeanRatePredictor, PredictError, RequestView, StepPredictor, StepsLeft,
};
pub use request::RequestSpec;
pub use threshold::{choose_threshold, StepPrices};

use crate::profile::{LatencyProfile, StepKind};
use instance::InstanceTable;
use request_table::RequestTable;
use reservation::Reservation;
use round::RoundScratch;

/// A request's state as seen from outside.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestInfo {
    pub id: u64,
    pub arrival: f64,
    pub deadline: f64,
    pub priority: i32,
    pub prompt_len: u32,
    /// Output positions, padded to whole blocks.
    pub output_len: u32,
    pub block_length: u32,
    pub steps_done: u32,
    pub unmasked: u32,
    pub unmasked_in_block: u32,
    pub current_block: u32,
    pub instance: Option<u64>,
    pub next_kind: StepKind,
    pub in_flight: bool,
    /// Thresholds the request accepts, ascending.
    pub allowed: Vec<f64>,
    /// Highest threshold load control currently leaves it.
    pub max_tau: f64,
    /// Threshold of the last dispatched step.
    pub last_tau: Option<f64>,
    /// Remaining-step predictions, one per candidate threshold.
    pub predictions: Vec<StepsLeft>,
    /// Confidence features of the current block from the last report (see [`StepResult`]).
    pub confidence: Option<[f64; 5]>,
}

/// An instance's state as seen from outside.
#[derive(Clone, Debug, PartialEq)]
pub struct InstanceInfo {
    pub id: u64,
    pub tp: u32,
    pub gpus: Vec<u32>,
    pub node: u32,
    pub draining: bool,
    /// Requests of the step in flight (empty when idle).
    pub batch: Vec<u64>,
    /// *(ours)* Requests of the step queued behind it (overlap; empty when none is).
    pub ahead: Vec<u64>,
    pub batch_tokens: u64,
    pub predicted_finish: Option<f64>,
    /// Requests whose state this instance holds.
    pub residents: u32,
    pub resident_tokens: u64,
    /// *(ours)* KV tokens they hold, a stored prompt block read by several counted once.
    pub kv_used_tokens: u64,
    /// Measured / predicted step-time correction.
    pub factor: f64,
    pub steps_run: u64,
    pub kv_tokens: Option<u64>,
    pub max_requests: Option<u32>,
    /// Batch-token budget of one step (its own, or the scheduler's).
    pub max_batch_tokens: u64,
    /// Request this instance is reserved for: it takes no other new request.
    pub reserved_for: Option<u64>,
}

pub struct Scheduler {
    config: SchedulerConfig,
    profile: LatencyProfile,
    predictor: Box<dyn StepPredictor>,
    requests: RequestTable,
    instances: InstanceTable,
    /// Step costs per TP degree in use; instances refer to them by index.
    groups: Vec<DegreeCosts>,
    /// Measured / predicted step time per degree group (see `Instance::observe_step`).
    group_factors: Vec<f64>,
    scratch: RoundScratch,
    decisions: Decisions,
    /// The instance held for a request no instance had room for.
    reservation: Option<Reservation>,
    /// Load control's verdict in the last round.
    overloaded: bool,
    /// Live requests never dispatched yet.
    queued: u32,
    /// Recent admitted arrivals, for the forecast load control.
    forecast: forecast::ArrivalForecast,
    /// Recent offered arrivals, for deadline admission under sustained overload.
    shedder: shedding::LoadShedder,
    /// Load tokens per second the serving instances process (last round).
    capacity_rate: f64,
    /// Load of every live request at its lowest allowed threshold (last round, plus the
    /// arrivals admitted since): the work ahead of an arrival, for deadline admission.
    backlog_lowest: f64,
}

impl Scheduler {
    /// A scheduler with the default mean-rate predictor.
    pub fn new(profile: LatencyProfile, config: SchedulerConfig) -> Result<Self, SchedError> {
        Self::with_predictor(profile, config, Box::new(MeanRatePredictor::default()))
    }

    pub fn with_predictor(
        profile: LatencyProfile,
        config: SchedulerConfig,
        predictor: Box<dyn StepPredictor>,
    ) -> Result<Self, SchedError> {
        let config = config.validated()?;
        Ok(Self {
            requests: RequestTable::new(&config),
            config,
            profile,
            predictor,
            instances: InstanceTable::default(),
            groups: Vec::new(),
            group_factors: Vec::new(),
            scratch: RoundScratch::default(),
            decisions: Decisions::default(),
            reservation: None,
            overloaded: false,
            queued: 0,
            forecast: Default::default(),
            shedder: Default::default(),
            capacity_rate: 0.0,
            backlog_lowest: 0.0,
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Replaces the step predictor (a mean-rate table learned while serving, say): each
    /// live request is predicted by it from its next refresh on.
    pub fn set_predictor(&mut self, predictor: Box<dyn StepPredictor>) {
        self.predictor = predictor;
    }

    pub fn profile(&self) -> &LatencyProfile {
        &self.profile
    }

    /// Requests that arrived and have neither finished nor been cancelled.
    pub fn active_requests(&self) -> usize {
        self.requests.live()
    }

    /// Live requests that have not been dispatched yet.
    pub fn queued_requests(&self) -> u32 {
        self.queued
    }

    /// Whether the last round's load control found even the lowest thresholds of every
    /// request beyond capacity.
    pub fn overloaded(&self) -> bool {
        self.overloaded
    }

    /// Ids of live instances in announcement order.
    pub fn instance_ids(&self) -> Vec<u64> {
        self.instances
            .slots
            .iter()
            .filter(|i| i.alive)
            .map(|i| i.id)
            .collect()
    }

    /// Decisions of the last round.
    pub fn last_decisions(&self) -> &Decisions {
        &self.decisions
    }

    /// How a live request has been served so far, in the form [`Scheduler::step_done`]
    /// reports a finished one (the one record of its statistics).
    pub fn served_so_far(&self, id: u64) -> Result<FinishedRequest, SchedError> {
        let pos = self.requests.pos_of(id)?;
        let r = self.requests.req(pos);
        let history = &self.requests.history[r.handle as usize];
        Ok(FinishedRequest {
            id,
            steps: r.steps_done,
            recompute_steps: history.recompute_steps,
            taus: history.taus.clone(),
            instances: history.instances.clone(),
            migrations: history.migrations,
            first_dispatch: history.first_dispatch,
            deadline: r.deadline,
            arrival: r.arrival,
        })
    }

    pub fn request(&self, id: u64) -> Result<RequestInfo, SchedError> {
        let pos = self.requests.pos_of(id)?;
        let r = self.requests.req(pos);
        let taus = &self.config.thresholds;
        let allowed = self.requests.allowed()[pos as usize];
        Ok(RequestInfo {
            id,
            arrival: r.arrival,
            deadline: r.deadline,
            priority: r.priority,
            prompt_len: r.prompt_len,
            output_len: r.output_len,
            block_length: r.block_length,
            steps_done: r.steps_done,
            unmasked: r.unmasked,
            unmasked_in_block: r.unmasked_in_block,
            current_block: r.current_block,
            instance: r.home.map(|h| self.instances.slots[h as usize].id),
            next_kind: r.next_kind,
            in_flight: !self.requests.ready(pos),
            allowed: (0..taus.len())
                .filter(|k| allowed & (1 << k) != 0)
                .map(|k| taus[k])
                .collect(),
            max_tau: taus[usize::from(self.requests.caps()[pos as usize])],
            last_tau: Some(self.requests.last_tau(pos)).filter(|t| !t.is_nan()),
            predictions: self.requests.steps_of(pos).to_vec(),
            confidence: self.requests.confidence[r.handle as usize],
        })
    }

    pub fn instance(&self, id: u64) -> Result<InstanceInfo, SchedError> {
        let slot = self.instances.slot_of(id)?;
        let inst = &self.instances.slots[slot as usize];
        Ok(InstanceInfo {
            id,
            tp: inst.tp,
            gpus: inst.gpus.clone(),
            node: inst.node,
            draining: inst.draining,
            batch: inst
                .inflight
                .iter()
                .map(|&h| self.requests.req(self.requests.pos_of_handle(h)).id)
                .collect(),
            ahead: inst
                .ahead
                .iter()
                .flat_map(|a| &a.handles)
                .map(|&h| self.requests.req(self.requests.pos_of_handle(h)).id)
                .collect(),
            batch_tokens: if inst.busy { inst.inflight_tokens } else { 0 },
            predicted_finish: inst.busy.then(|| inst.predicted_finish()),
            residents: inst.residents,
            resident_tokens: inst.resident_tokens,
            kv_used_tokens: inst.kv_used,
            factor: inst.factor,
            steps_run: inst.steps_run,
            kv_tokens: inst.kv_tokens,
            max_requests: inst.max_requests,
            max_batch_tokens: inst.budget,
            reserved_for: self
                .reservation
                .filter(|v| v.slot == slot)
                .map(|v| self.requests.req(self.requests.pos_of_handle(v.handle)).id),
        })
    }
}
