//! Instance choice (DESIGN §6, Alg. 3): per-round batch-token accounting and, per TP
//! degree, a min-heap of idle instances keyed by batch tokens.
//!
//! Step cost never decreases with batch tokens (see `cost`), so within one degree the idle
//! instance with the fewest batch tokens is both the earliest to complete and the most
//! likely to fit; a request compares only the heads of the degree heaps, O(degrees × log
//! instances) instead of a scan over every instance. Ties break on (tokens, slot).

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use super::config::InstanceChoice;
use super::cost::DegreeCosts;
use super::instance::Instance;

/// The instance a free request would go to, with its primary comparison key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Candidate {
    pub slot: u32,
    pub key: f64,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Placement {
    /// Per degree group: (batch tokens, instance slot) of accepting instances; entries whose
    /// tokens no longer match `tokens` are stale and dropped when they surface.
    heaps: Vec<BinaryHeap<Reverse<(u64, u32)>>>,
    /// Batch tokens assigned this round, per instance slot.
    pub tokens: Vec<u64>,
    /// The full-sequence part of `tokens`.
    pub full_tokens: Vec<u64>,
    /// Alive and not running a step: may run one this round.
    pub open: Vec<bool>,
    /// Open instances that take new requests (not draining).
    pub accepting: usize,
    /// Alive instances that are not draining, busy or not.
    pub targets: usize,
    max_tokens: u64,
}

impl Placement {
    pub fn begin(&mut self, instances: &[Instance], groups: usize, max_tokens: u64) {
        let n = instances.len();
        self.max_tokens = max_tokens;
        self.tokens.clear();
        self.tokens.resize(n, 0);
        self.full_tokens.clear();
        self.full_tokens.resize(n, 0);
        self.open.clear();
        self.open
            .extend(instances.iter().map(|inst| inst.alive && !inst.busy));
        self.targets = instances
            .iter()
            .filter(|inst| inst.alive && !inst.draining)
            .count();
        self.accepting = instances
            .iter()
            .zip(&self.open)
            .filter(|(inst, &open)| open && !inst.draining)
            .count();
        self.heaps.resize_with(groups, BinaryHeap::new);
        for heap in &mut self.heaps {
            heap.clear();
        }
    }

    /// Whether instance `slot` can run a step this round with `n` more batch tokens.
    pub fn fits(&self, slot: u32, n: u64) -> bool {
        self.open[slot as usize] && self.tokens[slot as usize] + n <= self.max_tokens
    }

    /// Assigns `n` tokens to `slot` before the heaps exist (requests that must stay).
    pub fn add_fixed(&mut self, slot: u32, n: u64, full: bool) {
        self.tokens[slot as usize] += n;
        if full {
            self.full_tokens[slot as usize] += n;
        }
    }

    /// Fills the heaps with accepting instances once fixed assignments are in.
    pub fn build_heaps(&mut self, instances: &[Instance]) {
        for (slot, inst) in instances.iter().enumerate() {
            if self.open[slot] && !inst.draining {
                self.heaps[inst.group].push(Reverse((self.tokens[slot], slot as u32)));
            }
        }
    }

    /// Primary key of putting `n` tokens on `slot`: predicted step seconds, or batch tokens.
    pub fn key(&self, slot: u32, n: u64, costs: &DegreeCosts, choice: InstanceChoice) -> f64 {
        let tokens = self.tokens[slot as usize];
        match choice {
            InstanceChoice::EarliestCompletion => costs.full((tokens + n) as f64),
            InstanceChoice::LeastLoaded => tokens as f64,
        }
    }

    /// Best accepting instance for a full-sequence step of `n` tokens, if any fits.
    pub fn best(
        &mut self,
        n: u64,
        groups: &[DegreeCosts],
        choice: InstanceChoice,
    ) -> Option<Candidate> {
        let mut best: Option<(f64, u64, u32)> = None;
        for (group, costs) in groups.iter().enumerate() {
            let heap = &mut self.heaps[group];
            while let Some(&Reverse((tokens, slot))) = heap.peek() {
                if tokens == self.tokens[slot as usize] {
                    break;
                }
                heap.pop();
            }
            let Some(&Reverse((tokens, slot))) = self.heaps[group].peek() else {
                continue;
            };
            if tokens + n > self.max_tokens {
                continue;
            }
            let key = self.key(slot, n, costs, choice);
            let better = match best {
                None => true,
                Some((k, t, s)) => key < k || (key == k && (tokens, slot) < (t, s)),
            };
            if better {
                best = Some((key, tokens, slot));
            }
        }
        best.map(|(key, _, slot)| Candidate { slot, key })
    }

    /// Assigns `n` full-sequence tokens to accepting instance `slot` and re-keys its heap.
    pub fn add_free(&mut self, slot: u32, group: usize, n: u64) {
        let old = self.tokens[slot as usize];
        self.tokens[slot as usize] = old + n;
        self.full_tokens[slot as usize] += n;
        let heap = &mut self.heaps[group];
        if let Some(mut top) = heap.peek_mut() {
            if top.0 == (old, slot) {
                *top = Reverse((old + n, slot));
                return;
            }
        }
        heap.push(Reverse((old + n, slot)));
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::scheduler::instance::{InstanceSpec, InstanceTable};
    use crate::scheduler::tests::profile;

    proptest! {
        /// The heap choice equals a scan for the minimum (key, tokens, slot) over every
        /// accepting instance that fits, after any sequence of assignments.
        #[test]
        fn heap_choice_matches_a_scan(
            tps in prop::collection::vec(prop::sample::select(vec![1u32, 2, 4]), 1..12),
            busy in prop::collection::vec(any::<bool>(), 12),
            draining in prop::collection::vec(prop::bool::weighted(0.2), 12),
            fixed in prop::collection::vec(0u64..3000, 12),
            requests in prop::collection::vec(1u64..1500, 1..60),
            least_loaded in any::<bool>(),
        ) {
            let choice = if least_loaded {
                InstanceChoice::LeastLoaded
            } else {
                InstanceChoice::EarliestCompletion
            };
            let profile = profile();
            let mut groups: Vec<DegreeCosts> = Vec::new();
            let mut table = InstanceTable::default();
            for (i, &tp) in tps.iter().enumerate() {
                let group = match groups.iter().position(|g| g.tp == tp) {
                    Some(g) => g,
                    None => {
                        groups.push(DegreeCosts::new(&profile, tp, true, 4096).unwrap());
                        groups.len() - 1
                    }
                };
                let slot = table.insert(
                    InstanceSpec { id: i as u64, tp, gpus: (0..tp).collect(), node: i as u32 },
                    group,
                );
                table.slots[slot as usize].busy = busy[i];
                table.slots[slot as usize].draining = draining[i];
            }
            let mut p = Placement::default();
            p.begin(&table.slots, groups.len(), 4096);
            for (i, &n) in fixed.iter().enumerate().take(tps.len()) {
                if p.fits(i as u32, n) {
                    p.add_fixed(i as u32, n, false);
                }
            }
            p.build_heaps(&table.slots);
            for (j, &n) in requests.iter().enumerate() {
                let mut expected: Option<(f64, u64, u32)> = None;
                for (slot, inst) in table.slots.iter().enumerate() {
                    let slot = slot as u32;
                    if inst.draining || !p.fits(slot, n) {
                        continue;
                    }
                    let key = p.key(slot, n, &groups[inst.group], choice);
                    let cand = (key, p.tokens[slot as usize], slot);
                    if expected.is_none_or(|e| {
                        cand.0 < e.0 || (cand.0 == e.0 && (cand.1, cand.2) < (e.1, e.2))
                    }) {
                        expected = Some(cand);
                    }
                }
                let got = p.best(n, &groups, choice);
                prop_assert_eq!(got.map(|c| c.slot), expected.map(|e| e.2));
                // Alternate between taking the best and loading some other open instance,
                // as a request that stays home does.
                if let Some(c) = got {
                    let target = if j % 3 == 2 {
                        (0..tps.len() as u32)
                            .find(|&s| !table.slots[s as usize].draining && p.fits(s, n))
                            .unwrap_or(c.slot)
                    } else {
                        c.slot
                    };
                    p.add_free(target, table.slots[target as usize].group, n);
                }
            }
        }
    }
}
