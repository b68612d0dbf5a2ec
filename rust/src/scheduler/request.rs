//! Request state and the table that holds it: a slab of flat vectors plus the arrival (or
//! priority) order that load control and dispatch walk, kept sorted on insert so a round
//! never sorts.

use std::cmp::Ordering;
use std::collections::HashMap;

use super::config::{LoadOrder, SchedulerConfig};
use super::error::SchedError;
use super::predictor::{RequestView, StepsLeft};
use crate::profile::StepKind;

/// A new request as the front end hands it to the scheduler.
#[derive(Clone, Debug, PartialEq)]
pub struct RequestSpec {
    pub id: u64,
    /// Seconds, on the same clock as `schedule(now)`.
    pub arrival: f64,
    /// Absolute time by which the request should finish.
    pub deadline: f64,
    /// Higher runs first under [`LoadOrder::Priority`].
    pub priority: i32,
    pub prompt_len: u32,
    /// Requested output positions; rounded up to whole blocks.
    pub output_len: u32,
    /// Block size `B`; `None` uses the scheduler's.
    pub block_size: Option<u32>,
    /// Thresholds this request accepts (a subset of the candidates); `None` allows all.
    pub thresholds: Option<Vec<f64>>,
}

impl RequestSpec {
    /// A request with default priority, block size and threshold set.
    pub fn new(id: u64, arrival: f64, deadline: f64, prompt_len: u32, output_len: u32) -> Self {
        Self {
            id,
            arrival,
            deadline,
            priority: 0,
            prompt_len,
            output_len,
            block_size: None,
            thresholds: None,
        }
    }
}

/// Live state of one request. Slot-indexed; `home` is an instance slot.
#[derive(Clone, Debug)]
pub(crate) struct Request {
    pub id: u64,
    pub seq: u64,
    pub arrival: f64,
    pub deadline: f64,
    pub priority: i32,
    pub prompt_len: u32,
    pub output_len: u32,
    pub block_size: u32,
    pub steps_done: u32,
    pub unmasked: u32,
    pub unmasked_in_block: u32,
    pub current_block: u32,
    pub next_kind: StepKind,
    /// Bitmask over candidate thresholds.
    pub allowed: u32,
    /// Instance slot holding this request's state (and its KV cache, if any).
    pub home: Option<u32>,
    /// Id of a removed instance this request was displaced from, until it is dispatched.
    pub displaced_from: Option<u64>,
    pub in_flight: bool,
    pub alive: bool,
    /// Threshold of the last dispatched step (NaN before the first).
    pub tau: f64,
}

impl Request {
    /// Tokens a full-sequence step of this request processes.
    pub fn seq_tokens(&self) -> u64 {
        u64::from(self.prompt_len) + u64::from(self.output_len)
    }

    /// Tokens the next step of this request adds to a batch.
    pub fn step_tokens(&self) -> u64 {
        match self.next_kind {
            StepKind::Cache => u64::from(self.block_size),
            StepKind::Recompute | StepKind::NoCache => self.seq_tokens(),
        }
    }

    /// Whether the next step is the full-sequence step of its block (or replaces a lost cache).
    pub fn needs_recompute(&self) -> bool {
        match self.next_kind {
            StepKind::Recompute => true,
            StepKind::Cache => false,
            StepKind::NoCache => self.unmasked_in_block == 0,
        }
    }

    pub fn view(&self, confidence: Option<[f64; 5]>) -> RequestView {
        RequestView {
            prompt_len: self.prompt_len,
            output_len: self.output_len,
            block_size: self.block_size,
            steps_done: self.steps_done,
            unmasked: self.unmasked,
            unmasked_in_block: self.unmasked_in_block,
            current_block: self.current_block,
            needs_recompute: self.needs_recompute(),
            confidence,
        }
    }
}

/// Every request the scheduler knows, in flat slot-indexed vectors.
#[derive(Clone, Debug, Default)]
pub(crate) struct RequestTable {
    pub slots: Vec<Request>,
    /// `slots.len() × thresholds` remaining-step predictions, slot-major.
    pub steps: Vec<StepsLeft>,
    /// Last reported confidence statistics per slot (predictor input only).
    pub confidence: Vec<Option<[f64; 5]>>,
    /// Highest candidate index load control left each slot.
    pub caps: Vec<u8>,
    /// Live slots in load order (plus dead ones until the next compaction).
    pub order: Vec<u32>,
    index: HashMap<u64, u32>,
    free: Vec<u32>,
    /// Slots released since the last compaction; `order` may still name them.
    retired: Vec<u32>,
    order_dirty: bool,
    thresholds: usize,
    next_seq: u64,
}

fn order_key(order: LoadOrder, r: &Request, other: &Request) -> Ordering {
    let by_priority = match order {
        LoadOrder::Priority => other.priority.cmp(&r.priority),
        LoadOrder::Arrival => Ordering::Equal,
    };
    by_priority
        .then(r.arrival.total_cmp(&other.arrival))
        .then(r.seq.cmp(&other.seq))
}

impl RequestTable {
    pub fn new(thresholds: usize) -> Self {
        Self {
            thresholds,
            ..Self::default()
        }
    }

    pub fn live(&self) -> usize {
        self.index.len()
    }

    pub fn slot_of(&self, id: u64) -> Result<u32, SchedError> {
        self.index
            .get(&id)
            .copied()
            .ok_or(SchedError::UnknownRequest(id))
    }

    /// Predictions of one slot, one per candidate threshold.
    pub fn steps_of(&self, slot: u32) -> &[StepsLeft] {
        let k = self.thresholds;
        &self.steps[slot as usize * k..(slot as usize + 1) * k]
    }

    pub fn steps_of_mut(&mut self, slot: u32) -> &mut [StepsLeft] {
        let k = self.thresholds;
        &mut self.steps[slot as usize * k..(slot as usize + 1) * k]
    }

    /// Validates `spec` against `config` and builds its initial state.
    pub fn build(
        &self,
        spec: &RequestSpec,
        config: &SchedulerConfig,
    ) -> Result<Request, SchedError> {
        let id = spec.id;
        let invalid = |reason: String| SchedError::InvalidRequest { id, reason };
        if self.index.contains_key(&id) {
            return Err(SchedError::DuplicateRequest(id));
        }
        if !spec.arrival.is_finite() || !spec.deadline.is_finite() {
            return Err(invalid(format!(
                "arrival and deadline must be finite, got {} and {}",
                spec.arrival, spec.deadline
            )));
        }
        if spec.deadline < spec.arrival {
            return Err(invalid(format!(
                "deadline {} is before arrival {}",
                spec.deadline, spec.arrival
            )));
        }
        if spec.output_len == 0 {
            return Err(invalid("output length must be at least 1".into()));
        }
        let block_size = spec.block_size.unwrap_or(config.block_size);
        if block_size == 0 {
            return Err(invalid("block size must be at least 1".into()));
        }
        let blocks = spec.output_len.div_ceil(block_size);
        let output_len = blocks
            .checked_mul(block_size)
            .ok_or_else(|| invalid(format!("output length {} overflows", spec.output_len)))?;
        let allowed = match &spec.thresholds {
            None => u32::MAX >> (32 - config.thresholds.len()),
            Some(taus) => allowed_mask(id, taus, &config.thresholds)?,
        };
        let next_kind = if config.caching {
            StepKind::Recompute
        } else {
            StepKind::NoCache
        };
        let request = Request {
            id,
            seq: self.next_seq,
            arrival: spec.arrival,
            deadline: spec.deadline,
            priority: spec.priority,
            prompt_len: spec.prompt_len,
            output_len,
            block_size,
            steps_done: 0,
            unmasked: 0,
            unmasked_in_block: 0,
            current_block: 0,
            next_kind,
            allowed,
            home: None,
            displaced_from: None,
            in_flight: false,
            alive: true,
            tau: f64::NAN,
        };
        let tokens = request.seq_tokens();
        if tokens > config.max_batch_tokens {
            return Err(SchedError::RequestTooLarge {
                id,
                tokens,
                max: config.max_batch_tokens,
            });
        }
        Ok(request)
    }

    /// Stores a request built by [`Self::build`] and places it in load order.
    pub fn insert(&mut self, request: Request, order: LoadOrder) -> u32 {
        let id = request.id;
        self.next_seq += 1;
        let k = self.thresholds;
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = request;
                self.confidence[slot as usize] = None;
                slot
            }
            None => {
                self.slots.push(request);
                self.steps
                    .resize(self.slots.len() * k, StepsLeft::default());
                self.confidence.push(None);
                self.caps.push(0);
                (self.slots.len() - 1) as u32
            }
        };
        self.caps[slot as usize] = (31 - self.slots[slot as usize].allowed.leading_zeros()) as u8;
        self.index.insert(id, slot);
        let new = &self.slots[slot as usize];
        let slots = &self.slots;
        let at = self
            .order
            .partition_point(|&s| order_key(order, &slots[s as usize], new) == Ordering::Less);
        self.order.insert(at, slot);
        slot
    }

    /// Forgets a request's id; its slot is released now unless it is in flight, in which
    /// case [`Self::release`] frees it once its step is reported.
    pub fn remove(&mut self, slot: u32) {
        let r = &mut self.slots[slot as usize];
        r.alive = false;
        self.index.remove(&r.id);
        self.order_dirty = true;
        if !r.in_flight {
            self.retired.push(slot);
        }
    }

    /// Releases the slot of a request removed while in flight.
    pub fn release(&mut self, slot: u32) {
        self.slots[slot as usize].in_flight = false;
        self.retired.push(slot);
    }

    /// Drops dead slots from the load order and makes retired slots reusable.
    pub fn compact(&mut self) {
        if self.order_dirty {
            let slots = &self.slots;
            self.order.retain(|&s| slots[s as usize].alive);
            self.order_dirty = false;
        }
        self.free.append(&mut self.retired);
    }
}

/// Bitmask of `taus` over `candidates`; every tau must be a candidate.
fn allowed_mask(id: u64, taus: &[f64], candidates: &[f64]) -> Result<u32, SchedError> {
    let mut mask = 0u32;
    for &tau in taus {
        let k = candidates.iter().position(|&c| c == tau).ok_or_else(|| {
            SchedError::UnknownThreshold {
                id,
                tau,
                candidates: candidates.to_vec(),
            }
        })?;
        mask |= 1 << k;
    }
    if mask == 0 {
        return Err(SchedError::EmptyThresholdSet { id });
    }
    Ok(mask)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SchedulerConfig {
        SchedulerConfig::default().validated().unwrap()
    }

    #[test]
    fn pads_output_and_maps_thresholds() {
        let t = RequestTable::new(5);
        let mut spec = RequestSpec::new(1, 0.0, 10.0, 7, 33);
        spec.thresholds = Some(vec![0.9, 0.6]);
        let r = t.build(&spec, &config()).unwrap();
        assert_eq!(r.output_len, 64);
        assert_eq!(r.allowed, 0b10010);
        assert_eq!(r.next_kind, StepKind::Recompute);
        assert_eq!(r.step_tokens(), 71);
    }

    #[test]
    fn rejects_bad_specs() {
        let t = RequestTable::new(5);
        let cfg = config();
        let base = RequestSpec::new(1, 0.0, 10.0, 7, 33);
        let cases = [
            RequestSpec {
                deadline: -1.0,
                ..base.clone()
            },
            RequestSpec {
                arrival: f64::NAN,
                ..base.clone()
            },
            RequestSpec {
                output_len: 0,
                ..base.clone()
            },
            RequestSpec {
                block_size: Some(0),
                ..base.clone()
            },
            RequestSpec {
                prompt_len: 9000,
                ..base.clone()
            },
        ];
        for spec in cases {
            assert!(t.build(&spec, &cfg).is_err(), "{spec:?}");
        }
        let empty = RequestSpec {
            thresholds: Some(vec![]),
            ..base.clone()
        };
        assert!(matches!(
            t.build(&empty, &cfg),
            Err(SchedError::EmptyThresholdSet { id: 1 })
        ));
        let odd = RequestSpec {
            thresholds: Some(vec![0.55]),
            ..base
        };
        assert!(matches!(
            t.build(&odd, &cfg),
            Err(SchedError::UnknownThreshold { .. })
        ));
    }

    #[test]
    fn keeps_load_order_and_reuses_slots_after_compaction() {
        let cfg = config();
        let mut t = RequestTable::new(5);
        for (id, arrival) in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 1.0)] {
            let r = t
                .build(&RequestSpec::new(id, arrival, 10.0, 1, 1), &cfg)
                .unwrap();
            t.insert(r, LoadOrder::Arrival);
        }
        let ids: Vec<u64> = t.order.iter().map(|&s| t.slots[s as usize].id).collect();
        assert_eq!(ids, vec![2, 4, 3, 1]);
        let slot = t.slot_of(3).unwrap();
        t.remove(slot);
        assert!(t.slot_of(3).is_err());
        // Not reusable until the order no longer names it.
        let r = t
            .build(&RequestSpec::new(5, 0.5, 10.0, 1, 1), &cfg)
            .unwrap();
        assert_ne!(t.insert(r, LoadOrder::Arrival), slot);
        t.compact();
        let r = t
            .build(&RequestSpec::new(6, 9.0, 10.0, 1, 1), &cfg)
            .unwrap();
        assert_eq!(t.insert(r, LoadOrder::Arrival), slot);
        let ids: Vec<u64> = t.order.iter().map(|&s| t.slots[s as usize].id).collect();
        assert_eq!(ids, vec![5, 2, 4, 1, 6]);
    }

    #[test]
    fn priority_order_puts_high_priority_first() {
        let cfg = config();
        let mut t = RequestTable::new(5);
        for (id, prio) in [(1, 0), (2, 5), (3, 0), (4, 5)] {
            let mut spec = RequestSpec::new(id, id as f64, 100.0, 1, 1);
            spec.priority = prio;
            let r = t.build(&spec, &cfg).unwrap();
            t.insert(r, LoadOrder::Priority);
        }
        let ids: Vec<u64> = t.order.iter().map(|&s| t.slots[s as usize].id).collect();
        assert_eq!(ids, vec![2, 4, 1, 3]);
    }
}
