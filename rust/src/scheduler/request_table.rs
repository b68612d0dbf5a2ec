//! The table of live requests, laid out for the round: flat columns in load (arrival or
//! priority) order, so load control and dispatch read memory front to back.

use std::cmp::Ordering;

use super::config::{LoadOrder, SchedulerConfig};
use super::error::SchedError;
use super::history::History;
use super::load_control::request_load;
use super::predictor::StepsLeft;
use super::request::Request;
use crate::id_map::IdMap;

/// Columns the table keeps per position; double-buffered so reordering does not allocate.
#[derive(Clone, Debug, Default)]
struct Columns {
    reqs: Vec<Request>,
    allowed: Vec<u32>,
    steps: Vec<StepsLeft>,
    loads: Vec<f64>,
    caps: Vec<u8>,
    seq_tokens: Vec<f64>,
    slo: Vec<f64>,
    /// Threshold of the last dispatched step (NaN before the first).
    last_tau: Vec<f64>,
    /// Live and not in flight: its next step may be dispatched. A round scans this column,
    /// not the requests.
    ready: Vec<bool>,
}

/// Every live request, stored by *position* in load order so that a round streams through
/// memory instead of chasing indices. Positions change only in [`Self::normalize`] (run at
/// the start of a round); events address requests by a stable handle.
///
/// A removed request stays as a dead entry until then, with zero load and zero sequence
/// tokens so that sums over all positions equal sums over live requests.
#[derive(Clone, Debug, Default)]
pub(crate) struct RequestTable {
    cols: Columns,
    spare: Columns,
    perm: Vec<u32>,
    /// Handle -> position (`NO_POS` for free handles).
    pos_of: Vec<u32>,
    /// Last reported confidence statistics, by handle (predictor input only).
    pub confidence: Vec<Option<[f64; 5]>>,
    /// Life record, by handle.
    pub history: Vec<History>,
    free_handles: Vec<u32>,
    index: IdMap<u64, u32>,
    dead: usize,
    unsorted: bool,
    order: LoadOrder,
    caching: bool,
    thresholds: usize,
    next_seq: u64,
}

const NO_POS: u32 = u32::MAX;

/// What load control sums over the live requests, each in load order.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct LoadSums {
    pub seq_tokens: f64,
    /// Of deadline − arrival.
    pub slo: f64,
    /// Predicted steps, and recompute steps (one per block left), at each request's cap.
    pub steps: f64,
    pub blocks: f64,
    /// Load at each request's lowest allowed threshold.
    pub lowest_load: f64,
}

impl LoadSums {
    /// Steps per block the predictions at the caps imply; `None` when no block is left.
    pub fn steps_per_block(&self) -> Option<f64> {
        (self.blocks > 0.0).then(|| self.steps / self.blocks)
    }
}

impl RequestTable {
    pub fn new(config: &SchedulerConfig) -> Self {
        Self {
            order: config.policy.load_order,
            caching: config.caching,
            thresholds: config.thresholds.len(),
            ..Self::default()
        }
    }

    pub fn live(&self) -> usize {
        self.index.len()
    }

    pub fn contains(&self, id: u64) -> bool {
        self.index.contains_key(&id)
    }

    /// Arrival counter the next request gets; breaks ties between equal arrival times.
    pub fn next_seq(&self) -> u64 {
        self.next_seq
    }

    /// Positions, live or dead, in load order.
    pub fn len(&self) -> usize {
        self.cols.reqs.len()
    }

    pub fn reqs(&self) -> &[Request] {
        &self.cols.reqs
    }

    pub fn req(&self, pos: u32) -> &Request {
        &self.cols.reqs[pos as usize]
    }

    pub fn req_mut(&mut self, pos: u32) -> &mut Request {
        &mut self.cols.reqs[pos as usize]
    }

    pub fn last_tau(&self, pos: u32) -> f64 {
        self.cols.last_tau[pos as usize]
    }

    pub fn set_last_tau(&mut self, pos: u32, tau: f64) {
        self.cols.last_tau[pos as usize] = tau;
    }

    /// Whether the live request at `pos` awaits its next step (is not in flight).
    pub fn ready(&self, pos: u32) -> bool {
        self.cols.ready[pos as usize]
    }

    /// Marks the live request at `pos` dispatched (`false`) or back from its step (`true`).
    pub fn set_ready(&mut self, pos: u32, ready: bool) {
        self.cols.ready[pos as usize] = ready;
    }

    /// Position of the live request `id`.
    pub fn pos_of(&self, id: u64) -> Result<u32, SchedError> {
        let handle = self.index.get(&id).ok_or(SchedError::UnknownRequest(id))?;
        Ok(self.pos_of[*handle as usize])
    }

    pub fn pos_of_handle(&self, handle: u32) -> u32 {
        self.pos_of[handle as usize]
    }

    pub fn allowed(&self) -> &[u32] {
        &self.cols.allowed
    }

    pub fn caps(&self) -> &[u8] {
        &self.cols.caps
    }

    /// What load control reads and writes: allowed masks, loads, and the caps it sets.
    pub fn load_lanes(&mut self) -> (&[u32], &[f64], &mut [u8]) {
        let c = &mut self.cols;
        (&c.allowed, &c.loads, &mut c.caps)
    }

    /// Loads at every candidate threshold, position-major (see `request_load`).
    #[cfg(test)]
    pub fn loads(&self) -> &[f64] {
        &self.cols.loads
    }

    /// Every sum of [`LoadSums`] in one pass over the columns. Dead positions hold zeros
    /// (sequence tokens, SLO, predictions, loads), so the sums are over live requests.
    pub fn load_sums(&self) -> LoadSums {
        let k = self.thresholds;
        let c = &self.cols;
        let mut sums = LoadSums::default();
        let rows = c.steps.chunks_exact(k).zip(c.loads.chunks_exact(k));
        for (p, (steps, loads)) in rows.enumerate() {
            sums.seq_tokens += c.seq_tokens[p];
            sums.slo += c.slo[p];
            let at_cap = steps[usize::from(c.caps[p])];
            sums.steps += at_cap.total();
            sums.blocks += at_cap.recompute;
            sums.lowest_load += loads[c.allowed[p].trailing_zeros() as usize];
        }
        sums
    }

    /// Predictions of one position, one per candidate threshold.
    pub fn steps_of(&self, pos: u32) -> &[StepsLeft] {
        let k = self.thresholds;
        &self.cols.steps[pos as usize * k..(pos as usize + 1) * k]
    }

    /// Replaces a position's predictions and the loads derived from them.
    pub fn set_steps(&mut self, pos: u32, steps: &[StepsLeft]) {
        let k = self.thresholds;
        let range = pos as usize * k..(pos as usize + 1) * k;
        self.cols.steps[range.clone()].copy_from_slice(steps);
        self.refresh_loads(pos, range);
    }

    /// Counts one executed step off a position's predictions.
    pub fn count_step_off(&mut self, pos: u32, was_full: bool) {
        let k = self.thresholds;
        let range = pos as usize * k..(pos as usize + 1) * k;
        for s in &mut self.cols.steps[range.clone()] {
            if was_full {
                s.recompute = (s.recompute - 1.0).max(0.0);
            } else {
                s.cache = (s.cache - 1.0).max(0.0);
            }
        }
        self.refresh_loads(pos, range);
    }

    fn refresh_loads(&mut self, pos: u32, range: std::ops::Range<usize>) {
        let r = &self.cols.reqs[pos as usize];
        let (full, block) = (r.full_step_tokens() as f64, f64::from(r.block_length));
        for (load, s) in self.cols.loads[range.clone()]
            .iter_mut()
            .zip(&self.cols.steps[range])
        {
            *load = request_load(*s, full, block, self.caching);
        }
    }

    /// Stores a request built by [`Request::from_spec`] at the end; returns its position. A request
    /// that belongs earlier in load order is moved there by the next [`Self::normalize`].
    pub fn insert(&mut self, mut request: Request, allowed: u32) -> u32 {
        self.next_seq += 1;
        let handle = match self.free_handles.pop() {
            Some(h) => h,
            None => {
                self.pos_of.push(NO_POS);
                self.confidence.push(None);
                self.history.push(History::default());
                (self.pos_of.len() - 1) as u32
            }
        };
        request.handle = handle;
        self.confidence[handle as usize] = None;
        self.history[handle as usize].reset();
        if let Some(last) = self.cols.reqs.last() {
            self.unsorted |= request.key_cmp(last, self.order) == Ordering::Less;
        }
        let pos = self.cols.reqs.len() as u32;
        self.pos_of[handle as usize] = pos;
        self.index.insert(request.id, handle);
        let c = &mut self.cols;
        c.seq_tokens.push(request.seq_tokens() as f64);
        c.slo.push(request.deadline - request.arrival);
        c.last_tau.push(f64::NAN);
        c.ready.push(true);
        c.reqs.push(request);
        c.allowed.push(allowed);
        c.caps.push((31 - allowed.leading_zeros()) as u8);
        let k = self.thresholds;
        c.steps.resize(c.steps.len() + k, StepsLeft::default());
        c.loads.resize(c.loads.len() + k, 0.0);
        pos
    }

    /// Forgets a request. Its position stays, dead and weightless (zero tokens, SLO,
    /// predictions and loads), until the next normalize.
    pub fn remove(&mut self, pos: u32) {
        let k = self.thresholds;
        let p = pos as usize;
        let c = &mut self.cols;
        let r = &mut c.reqs[p];
        r.alive = false;
        c.ready[p] = false;
        self.index.remove(&r.id);
        self.pos_of[r.handle as usize] = NO_POS;
        self.free_handles.push(r.handle);
        c.allowed[p] = 1;
        c.steps[p * k..(p + 1) * k].fill(StepsLeft::default());
        c.loads[p * k..(p + 1) * k].fill(0.0);
        c.seq_tokens[p] = 0.0;
        c.slo[p] = 0.0;
        self.dead += 1;
    }

    /// Restores load order after out-of-order arrivals and drops dead positions once they
    /// are an eighth of the table. Moves positions; handles stay valid.
    pub fn normalize(&mut self) {
        if !self.unsorted && self.dead * 8 <= self.cols.reqs.len() {
            return;
        }
        let (cols, spare, perm) = (&self.cols, &mut self.spare, &mut self.perm);
        perm.clear();
        perm.extend((0..cols.reqs.len() as u32).filter(|&p| cols.reqs[p as usize].alive));
        if self.unsorted {
            let order = self.order;
            perm.sort_unstable_by(|&a, &b| {
                cols.reqs[a as usize].key_cmp(&cols.reqs[b as usize], order)
            });
        }
        let k = self.thresholds;
        fn gather<T: Copy>(dst: &mut Vec<T>, src: &[T], perm: &[u32], width: usize) {
            dst.clear();
            for &p in perm {
                let p = p as usize;
                dst.extend_from_slice(&src[p * width..(p + 1) * width]);
            }
        }
        gather(&mut spare.reqs, &cols.reqs, perm, 1);
        gather(&mut spare.allowed, &cols.allowed, perm, 1);
        gather(&mut spare.caps, &cols.caps, perm, 1);
        gather(&mut spare.seq_tokens, &cols.seq_tokens, perm, 1);
        gather(&mut spare.slo, &cols.slo, perm, 1);
        gather(&mut spare.last_tau, &cols.last_tau, perm, 1);
        gather(&mut spare.ready, &cols.ready, perm, 1);
        gather(&mut spare.steps, &cols.steps, perm, k);
        gather(&mut spare.loads, &cols.loads, perm, k);
        std::mem::swap(&mut self.cols, &mut self.spare);
        for (pos, r) in self.cols.reqs.iter().enumerate() {
            self.pos_of[r.handle as usize] = pos as u32;
        }
        self.dead = 0;
        self.unsorted = false;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::request::RequestSpec;

    fn config() -> SchedulerConfig {
        SchedulerConfig::default().validated().unwrap()
    }

    fn ids(t: &RequestTable) -> Vec<u64> {
        t.reqs().iter().filter(|r| r.alive).map(|r| r.id).collect()
    }

    fn add(t: &mut RequestTable, cfg: &SchedulerConfig, spec: RequestSpec) -> u32 {
        let (r, allowed) = Request::from_spec(&spec, cfg, t.next_seq()).unwrap();
        t.insert(r, allowed)
    }

    #[test]
    fn normalize_restores_load_order_and_keeps_handles() {
        let cfg = config();
        let mut t = RequestTable::new(&cfg);
        for (id, arrival) in [(1, 3.0), (2, 1.0), (3, 2.0), (4, 1.0)] {
            add(&mut t, &cfg, RequestSpec::new(id, arrival, 10.0, 1, 1));
        }
        t.normalize();
        assert_eq!(ids(&t), vec![2, 4, 3, 1]);
        for id in 1..=4 {
            assert_eq!(t.req(t.pos_of(id).unwrap()).id, id);
        }
        t.remove(t.pos_of(3).unwrap());
        assert!(t.pos_of(3).is_err());
        assert_eq!(t.load_sums().seq_tokens, 3.0 * 33.0);
        add(&mut t, &cfg, RequestSpec::new(5, 0.5, 10.0, 1, 1));
        add(&mut t, &cfg, RequestSpec::new(6, 9.0, 10.0, 1, 1));
        t.normalize();
        assert_eq!(ids(&t), vec![5, 2, 4, 1, 6]);
        assert_eq!(t.len(), 5, "dead positions are dropped when reordering");
        for id in [1, 2, 4, 5, 6] {
            assert_eq!(t.req(t.pos_of(id).unwrap()).id, id);
        }
    }

    #[test]
    fn readiness_follows_its_request() {
        let cfg = config();
        let mut t = RequestTable::new(&cfg);
        for (id, arrival) in [(1, 3.0), (2, 1.0), (3, 2.0)] {
            add(&mut t, &cfg, RequestSpec::new(id, arrival, 10.0, 1, 1));
        }
        assert!(
            (0..3).all(|p| t.ready(p)),
            "a new request awaits its first step"
        );
        t.set_ready(t.pos_of(1).unwrap(), false);
        let gone = t.pos_of(2).unwrap();
        t.remove(gone);
        assert!(!t.ready(gone), "a dead position is never ready");
        t.normalize();
        assert!(!t.ready(t.pos_of(1).unwrap()));
        assert!(t.ready(t.pos_of(3).unwrap()));
    }

    #[test]
    fn in_order_arrivals_append_and_dead_positions_wait() {
        let cfg = config();
        let mut t = RequestTable::new(&cfg);
        for id in 0..16 {
            add(&mut t, &cfg, RequestSpec::new(id, id as f64, 100.0, 1, 1));
        }
        t.remove(t.pos_of(3).unwrap());
        t.normalize();
        assert_eq!(t.len(), 16, "one dead position in sixteen is kept");
        assert_eq!(t.loads()[3 * 5..4 * 5], [0.0; 5]);
        t.remove(t.pos_of(4).unwrap());
        t.remove(t.pos_of(5).unwrap());
        t.normalize();
        assert_eq!(t.len(), 13);
        assert_eq!(t.live(), 13);
    }

    #[test]
    fn loads_follow_predictions() {
        let cfg = config();
        let mut t = RequestTable::new(&cfg);
        let pos = add(&mut t, &cfg, RequestSpec::new(1, 0.0, 10.0, 8, 32));
        let steps = vec![
            StepsLeft {
                cache: 3.0,
                recompute: 1.0
            };
            5
        ];
        t.set_steps(pos, &steps);
        assert_eq!(t.loads()[0], 3.0 * 32.0 + 40.0);
        t.count_step_off(pos, true);
        assert_eq!(
            t.steps_of(pos)[0],
            StepsLeft {
                cache: 3.0,
                recompute: 0.0
            }
        );
        assert_eq!(t.loads()[0], 3.0 * 32.0);
    }

    #[test]
    fn load_sums_count_live_requests_only() {
        let cfg = config();
        let mut t = RequestTable::new(&cfg);
        let steps = |cache, recompute| vec![StepsLeft { cache, recompute }; 5];
        for (id, (cache, recompute)) in [(6.0, 2.0), (9.0, 9.0), (3.0, 1.0)].into_iter().enumerate()
        {
            let pos = add(
                &mut t,
                &cfg,
                RequestSpec::new(id as u64, 0.0, 10.0 + id as f64, 8, 32),
            );
            t.set_steps(pos, &steps(cache, recompute));
        }
        t.remove(t.pos_of(1).unwrap());
        let sums = t.load_sums();
        assert_eq!(sums.seq_tokens, 2.0 * 40.0);
        assert_eq!(sums.slo, 10.0 + 12.0);
        assert_eq!((sums.steps, sums.blocks), (8.0 + 4.0, 3.0));
        assert_eq!(sums.steps_per_block(), Some(4.0));
        // Caps start at the highest threshold; lowest loads are at the lowest one.
        assert_eq!(sums.lowest_load, t.loads()[0] + t.loads()[2 * 5]);
        t.remove(t.pos_of(0).unwrap());
        t.remove(t.pos_of(2).unwrap());
        assert_eq!(t.load_sums(), LoadSums::default());
        assert_eq!(t.load_sums().steps_per_block(), None);
    }

    #[test]
    fn priority_order_puts_high_priority_first() {
        let cfg = SchedulerConfig {
            policy: super::super::config::Policy {
                load_order: LoadOrder::Priority,
                ..super::super::config::Policy::dilaserve()
            },
            ..config()
        };
        let mut t = RequestTable::new(&cfg);
        for (id, prio) in [(1, 0), (2, 5), (3, 0), (4, 5)] {
            let mut spec = RequestSpec::new(id, id as f64, 100.0, 1, 1);
            spec.priority = prio;
            add(&mut t, &cfg, spec);
        }
        t.normalize();
        assert_eq!(ids(&t), vec![2, 4, 1, 3]);
    }
}
