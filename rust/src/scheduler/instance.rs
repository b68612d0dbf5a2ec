//! Instance state: identity and placement, capacity, the batch in flight, the requests it
//! holds, and *(ours)* a measured-over-predicted step-time factor that corrects the profile
//! online for threshold choice and finish-time predictions.

use std::collections::HashMap;

use super::error::SchedError;
use super::request::Request;
use super::shared_blocks::SharedBlocks;
use crate::id_map::IdMap;

/// A serving instance as the cluster manager announces it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InstanceSpec {
    pub id: u64,
    /// Tensor-parallel degree; equals the number of GPUs.
    pub tp: u32,
    pub gpus: Vec<u32>,
    pub node: u32,
    /// KV token capacity: the sequence tokens (prompt + padded output) of the requests
    /// resident here, a shared prompt block counted once, may not exceed it. `None`:
    /// unbounded.
    pub kv_tokens: Option<u64>,
    /// Most requests resident at once. `None`: unbounded.
    pub max_requests: Option<u32>,
    /// Most tokens one step of this instance may process. `None`: the scheduler's
    /// `max_batch_tokens`.
    pub max_batch_tokens: Option<u64>,
}

impl InstanceSpec {
    /// An instance without capacity limits beyond the scheduler's batch budget.
    pub fn new(id: u64, tp: u32, gpus: Vec<u32>, node: u32) -> Self {
        Self {
            id,
            tp,
            gpus,
            node,
            kv_tokens: None,
            max_requests: None,
            max_batch_tokens: None,
        }
    }
}

/// Weight of the newest measured/predicted ratio in the step-time factor.
const FACTOR_WEIGHT: f64 = 0.2;
/// A single step can move the factor by at most this ratio either way.
const FACTOR_CLAMP: f64 = 4.0;
/// Share of an idle instance's factor deviation from its group's kept per round.
pub(crate) const IDLE_RELAX: f64 = 0.9;

#[derive(Clone, Debug)]
pub(crate) struct Instance {
    pub id: u64,
    pub tp: u32,
    pub gpus: Vec<u32>,
    pub node: u32,
    pub kv_tokens: Option<u64>,
    pub max_requests: Option<u32>,
    /// Batch-token budget of one step.
    pub budget: u64,
    /// Index of this degree's step costs.
    pub group: usize,
    pub alive: bool,
    pub draining: bool,
    /// Request handles of the step in flight.
    pub inflight: Vec<u32>,
    /// Ids of requests cancelled while in that step; their results are ignored.
    pub cancelled: Vec<u64>,
    pub busy: bool,
    pub inflight_tokens: u64,
    /// *(ours)* Estimated tokens the requests of the step in flight feed its next step: a
    /// block each with caching (their likely cache steps), the whole sequence without.
    pub next_tokens: u64,
    pub started_at: f64,
    /// Profile prediction of the step in flight, before the factor.
    pub predicted_s: f64,
    /// Requests whose state (and cache) this instance holds, and their sequence tokens.
    pub residents: u32,
    pub resident_tokens: u64,
    /// *(ours)* KV tokens they hold: `resident_tokens`, a stored prompt block read by
    /// several of them counted once ([`SharedBlocks`]). What admission checks.
    pub kv_used: u64,
    pub shared: SharedBlocks,
    /// Exponential average of measured / predicted step time, relaxed toward its degree
    /// group's while idle (see [`Instance::relax_toward`]).
    pub factor: f64,
    pub steps_run: u64,
    pub last_step_s: f64,
    /// Requests that left since this instance's last batch (finished, cancelled, moved
    /// away, their step aborted): its next step command releases them.
    pub released: Vec<u64>,
    /// *(ours)* With overlap: the step queued behind the one in flight; it becomes the
    /// step in flight when that one's report is applied.
    pub ahead: Option<AheadStep>,
}

/// *(ours)* A step sent while the instance's previous one runs (see
/// `SchedulerConfig::overlap`): what the step in flight keeps, for when it starts.
#[derive(Clone, Debug, Default)]
pub(crate) struct AheadStep {
    pub handles: Vec<u32>,
    /// Ids of its requests cancelled (or finished in the step before) meanwhile.
    pub cancelled: Vec<u64>,
    pub tokens: u64,
    pub next_tokens: u64,
    /// Profile prediction of its duration, before the factor.
    pub predicted_s: f64,
}

impl Instance {
    /// *(ours)* Moves an idle instance's factor part of the way to its group's, once per
    /// round. A factor kept only by the instance's own steps went stale on one that stopped
    /// getting work after one slow step (a busy host, say): it looked slower than the rest
    /// for good, got no work to correct it, and the others took its share (at 4 emulated
    /// instances one ran 916 steps and another 10). A truly slow instance still shows its
    /// own factor right after each of its steps.
    pub fn relax_toward(&mut self, pooled: f64) {
        self.factor = pooled + IDLE_RELAX * (self.factor - pooled);
    }

    pub fn predicted_finish(&self) -> f64 {
        self.started_at + self.predicted_s * self.factor
    }

    /// When the last step sent here is predicted to end: the one in flight, or the one
    /// queued behind it.
    pub fn free_at(&self) -> f64 {
        let ahead = self.ahead.as_ref().map_or(0.0, |a| a.predicted_s);
        self.predicted_finish() + ahead * self.factor
    }

    /// *(ours)* With overlap: the step queued behind the one in flight starts (its
    /// predecessor's report is in, at `started_at`); without one the instance is idle.
    pub fn start_ahead(&mut self, started_at: f64) {
        match self.ahead.take() {
            Some(next) => {
                self.inflight = next.handles;
                self.cancelled = next.cancelled;
                self.busy = true;
                self.inflight_tokens = next.tokens;
                self.next_tokens = next.next_tokens;
                self.started_at = started_at;
                self.predicted_s = next.predicted_s;
            }
            None => self.clear_steps(),
        }
    }

    /// Forgets the steps sent here: the instance is idle.
    pub fn clear_steps(&mut self) {
        self.ahead = None;
        self.inflight.clear();
        self.cancelled.clear();
        self.busy = false;
        self.inflight_tokens = 0;
        self.next_tokens = 0;
    }

    /// Folds one measured step time into this instance's factor and into `pooled`, the
    /// factor of its degree group.
    pub fn observe_step(&mut self, measured_s: f64, pooled: &mut f64) {
        if self.predicted_s > 0.0 {
            let ratio = (measured_s / self.predicted_s).clamp(1.0 / FACTOR_CLAMP, FACTOR_CLAMP);
            self.factor = (1.0 - FACTOR_WEIGHT) * self.factor + FACTOR_WEIGHT * ratio;
            *pooled = (1.0 - FACTOR_WEIGHT) * *pooled + FACTOR_WEIGHT * ratio;
        }
        self.last_step_s = measured_s;
        self.steps_run += 1;
    }

    /// Tokens already expected in this instance's next step before this round assigns any:
    /// none when that step is decided now (idle, or open for a step ahead, whose continuing
    /// requests are assigned explicitly).
    pub fn base_tokens(&self, open: bool) -> u64 {
        match &self.ahead {
            Some(a) => a.next_tokens,
            None if self.busy && !open => self.next_tokens,
            None => 0,
        }
    }

    /// Whether a round may send this instance a step: it is idle, or (with `overlap`) runs
    /// one with nothing queued behind it and is not draining (its requests move at their
    /// next recompute step, which a step ahead would not let them).
    pub fn open(&self, overlap: bool) -> bool {
        self.alive && (!self.busy || (overlap && self.ahead.is_none() && !self.draining))
    }

    /// Whether `residents` more requests holding `tokens` in all fit beside those here.
    pub fn has_resident_room(&self, residents: u32, tokens: u64) -> bool {
        self.kv_tokens.is_none_or(|kv| self.kv_used + tokens <= kv)
            && self
                .max_requests
                .is_none_or(|m| u64::from(self.residents) + u64::from(residents) <= u64::from(m))
    }

    /// Whether a request of `seq_tokens` whose steps feed up to `step_tokens` fits here once
    /// every other request has left.
    pub fn could_hold(&self, seq_tokens: u64, step_tokens: u64) -> bool {
        self.kv_tokens.is_none_or(|kv| seq_tokens <= kv) && step_tokens <= self.budget
    }

    /// Whether the capacity differs from an unlimited instance with budget `default_budget`.
    pub fn limited(&self, default_budget: u64) -> bool {
        self.kv_tokens.is_some() || self.max_requests.is_some() || self.budget != default_budget
    }

    /// `r` lives here now; until its worker reports the stored blocks it reads, it is
    /// charged its whole sequence.
    pub fn add_resident(&mut self, r: &Request) {
        self.residents += 1;
        self.resident_tokens += r.seq_tokens();
        self.kv_used += r.seq_tokens();
    }

    /// `r` no longer lives here; the worker is told with the next batch.
    pub fn drop_resident(&mut self, r: &Request) {
        self.set_reads(r, Vec::new());
        self.released.push(r.id);
        self.residents -= 1;
        self.resident_tokens -= r.seq_tokens();
        self.kv_used -= r.seq_tokens();
    }

    /// Keys of the stored blocks resident `r` reads (as its worker reported).
    pub fn reads_of(&self, r: &Request) -> &[u64] {
        self.shared.keys_of(r.id)
    }

    /// *(ours)* Resident `r` reads the stored blocks `keys` (as its worker reported).
    pub fn set_reads(&mut self, r: &Request, keys: Vec<u64>) {
        let (read, held) = self.shared.set_reads(r.id, keys);
        let change = (held - read) * i64::from(r.block_length);
        self.kv_used = self
            .kv_used
            .checked_add_signed(change)
            .expect("KV use below zero");
    }
}

/// Instances by slot; slots of removed instances are never reused, so slot order is
/// announcement order and ties break the same way in every run.
#[derive(Clone, Debug, Default)]
pub(crate) struct InstanceTable {
    pub slots: Vec<Instance>,
    index: IdMap<u64, u32>,
    gpus_held: HashMap<(u32, u32), u64>,
}

impl InstanceTable {
    pub fn slot_of(&self, id: u64) -> Result<u32, SchedError> {
        self.index
            .get(&id)
            .copied()
            .ok_or(SchedError::UnknownInstance(id))
    }

    /// Checks a spec: unique id, one distinct free GPU per TP rank, non-zero capacities.
    pub fn validate(&self, spec: &InstanceSpec) -> Result<(), SchedError> {
        let invalid = |reason: String| SchedError::InvalidInstance {
            id: spec.id,
            reason,
        };
        if self.index.contains_key(&spec.id) {
            return Err(SchedError::DuplicateInstance(spec.id));
        }
        if spec.tp == 0 {
            return Err(invalid("TP degree must be at least 1".into()));
        }
        if spec.gpus.len() != spec.tp as usize {
            return Err(invalid(format!(
                "TP degree {} needs {} GPUs, got {:?}",
                spec.tp, spec.tp, spec.gpus
            )));
        }
        if spec.kv_tokens == Some(0) {
            return Err(invalid("kv_tokens must be at least 1".into()));
        }
        if spec.max_requests == Some(0) {
            return Err(invalid("max_requests must be at least 1".into()));
        }
        if spec.max_batch_tokens == Some(0) {
            return Err(invalid("max_batch_tokens must be at least 1".into()));
        }
        for (i, gpu) in spec.gpus.iter().enumerate() {
            if spec.gpus[..i].contains(gpu) {
                return Err(invalid(format!("GPU {gpu} is listed twice")));
            }
            if let Some(&holder) = self.gpus_held.get(&(spec.node, *gpu)) {
                return Err(SchedError::GpuInUse {
                    id: spec.id,
                    node: spec.node,
                    gpu: *gpu,
                    holder,
                });
            }
        }
        Ok(())
    }

    /// Adds a validated instance in degree group `group`; `default_budget` is the batch
    /// budget of an instance that names none.
    pub fn insert(&mut self, spec: InstanceSpec, group: usize, default_budget: u64) -> u32 {
        let slot = self.slots.len() as u32;
        for &gpu in &spec.gpus {
            self.gpus_held.insert((spec.node, gpu), spec.id);
        }
        self.index.insert(spec.id, slot);
        self.slots.push(Instance {
            id: spec.id,
            tp: spec.tp,
            gpus: spec.gpus,
            node: spec.node,
            kv_tokens: spec.kv_tokens,
            max_requests: spec.max_requests,
            budget: spec.max_batch_tokens.unwrap_or(default_budget),
            group,
            alive: true,
            draining: false,
            inflight: Vec::new(),
            cancelled: Vec::new(),
            busy: false,
            inflight_tokens: 0,
            next_tokens: 0,
            started_at: 0.0,
            predicted_s: 0.0,
            residents: 0,
            resident_tokens: 0,
            kv_used: 0,
            shared: SharedBlocks::default(),
            factor: 1.0,
            steps_run: 0,
            last_step_s: 0.0,
            released: Vec::new(),
            ahead: None,
        });
        slot
    }

    /// The most sequence tokens a live instance's KV cache holds; `None` while some live
    /// instance has no such limit, or none is live (nothing to judge a request by yet).
    pub fn largest_kv(&self) -> Option<u64> {
        let mut live = self.slots.iter().filter(|i| i.alive).peekable();
        live.peek()?;
        live.map(|i| i.kv_tokens)
            .try_fold(0, |max, kv| Some(max.max(kv?)))
    }

    /// Forgets an instance and frees its GPUs; the caller re-homes its requests.
    pub fn remove(&mut self, slot: u32) {
        let inst = &mut self.slots[slot as usize];
        inst.alive = false;
        inst.clear_steps();
        inst.residents = 0;
        inst.resident_tokens = 0;
        inst.kv_used = 0;
        inst.shared.clear();
        self.index.remove(&inst.id);
        for gpu in &inst.gpus {
            self.gpus_held.remove(&(inst.node, *gpu));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::{RequestSpec, SchedulerConfig};

    fn spec(id: u64, tp: u32, gpus: Vec<u32>) -> InstanceSpec {
        InstanceSpec::new(id, tp, gpus, 0)
    }

    #[test]
    fn validates_gpus() {
        let mut t = InstanceTable::default();
        t.validate(&spec(1, 2, vec![0, 1])).unwrap();
        t.insert(spec(1, 2, vec![0, 1]), 0, 100);
        assert!(matches!(
            t.validate(&spec(1, 1, vec![5])),
            Err(SchedError::DuplicateInstance(1))
        ));
        assert!(matches!(
            t.validate(&spec(2, 1, vec![1])),
            Err(SchedError::GpuInUse {
                holder: 1,
                gpu: 1,
                ..
            })
        ));
        assert!(t.validate(&spec(2, 2, vec![3])).is_err());
        assert!(t.validate(&spec(2, 2, vec![3, 3])).is_err());
        assert!(t.validate(&spec(2, 0, vec![])).is_err());
        for zero in [
            InstanceSpec {
                kv_tokens: Some(0),
                ..spec(2, 1, vec![4])
            },
            InstanceSpec {
                max_requests: Some(0),
                ..spec(2, 1, vec![4])
            },
            InstanceSpec {
                max_batch_tokens: Some(0),
                ..spec(2, 1, vec![4])
            },
        ] {
            assert!(matches!(
                t.validate(&zero),
                Err(SchedError::InvalidInstance { .. })
            ));
        }
        t.remove(0);
        t.validate(&spec(2, 1, vec![1])).unwrap();
        assert!(t.slot_of(1).is_err());
    }

    #[test]
    fn factor_tracks_measured_time() {
        let mut t = InstanceTable::default();
        t.insert(spec(1, 1, vec![0]), 0, 100);
        let inst = &mut t.slots[0];
        inst.predicted_s = 0.1;
        let mut pooled = 1.0;
        inst.observe_step(0.2, &mut pooled);
        assert!((inst.factor - 1.2).abs() < 1e-12 && pooled == inst.factor);
        inst.relax_toward(1.0);
        assert!((inst.factor - (1.0 + IDLE_RELAX * 0.2)).abs() < 1e-12);
        inst.factor = 1.2;
        inst.observe_step(100.0, &mut pooled);
        assert!((inst.factor - (0.8 * 1.2 + 0.2 * 4.0)).abs() < 1e-12);
        assert_eq!(inst.steps_run, 2);
    }

    #[test]
    fn resident_room_counts_tokens_and_requests() {
        let mut t = InstanceTable::default();
        let limited = InstanceSpec {
            kv_tokens: Some(1000),
            max_requests: Some(2),
            max_batch_tokens: Some(500),
            ..spec(1, 1, vec![0])
        };
        t.insert(limited, 0, 8192);
        t.insert(spec(2, 1, vec![1]), 0, 8192);
        let (a, b) = (&t.slots[0], &t.slots[1]);
        assert_eq!((a.budget, b.budget), (500, 8192));
        assert!(a.limited(8192) && !b.limited(8192) && b.limited(4096));
        assert!(a.has_resident_room(1, 1000) && !a.has_resident_room(1, 1001));
        assert!(a.could_hold(1000, 500) && !a.could_hold(1000, 501));
        assert!(!a.could_hold(1001, 10));
        let a = &mut t.slots[0];
        a.add_resident(&request(3, 568));
        a.add_resident(&request(7, 68));
        assert!(!a.has_resident_room(1, 1), "two requests already resident");
        a.drop_resident(&request(7, 68));
        assert_eq!(a.released, [7]);
        assert!(a.has_resident_room(1, 400) && !a.has_resident_room(1, 401));
    }

    /// A request of `prompt` tokens and one 32-token output block.
    fn request(id: u64, prompt: u32) -> Request {
        let config = SchedulerConfig::default().validated().unwrap();
        let spec = RequestSpec::new(id, 0.0, 10.0, prompt, 32);
        Request::from_spec(&spec, &config, 0).unwrap().0
    }
}
