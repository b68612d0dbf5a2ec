//! Exact instance choice over the instances of one TP degree without scanning them all.
//!
//! A request's key on instance `s` is
//! `start_s + factor_s × (C(tokens_s + n) + L × C(steady_s + own))` (earliest completion: `C`
//! is the degree's full-step cost, non-decreasing in tokens; the second term prices the
//! request's `L` further steps at the instance's steady per-step tokens with its own added,
//! see `placement`) or `start_s` (least loaded, `factor_s = 0`). Factors, start times and
//! loads differ between instances, so neither the fewest tokens nor the earliest start
//! identifies the best one. A segment tree over the instances (leaves in slot order) keeps,
//! per subtree, the smallest start, factor, tokens and steady tokens and the largest
//! batch-token, KV-token and request room. A search descends left to right and skips a
//! subtree when no instance in it has room, or when the key of those minima — a lower bound
//! of every key in it — cannot beat the best key found so far. The answer is the exact
//! minimum of (key, slot).
//!
//! The bound is exact in floating point, not just in real numbers: `C` never decreases even
//! by rounding (see `cost`), factors and costs are positive, and rounded addition and
//! multiplication are monotone. So ties prune too: a subtree whose bound equals the best key
//! and whose slots all come after the best one's cannot win.

use super::cost::DegreeCosts;

/// One instance's entry, or a subtree's aggregate (minima of the first three fields, maxima
/// of the rooms).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Leaf {
    /// When its next step can start (earliest completion), or its load (least loaded).
    pub start: f64,
    /// Measured step-time correction; 0 under least-loaded choice.
    pub factor: f64,
    /// Batch tokens its next step already holds.
    pub tokens: u64,
    /// Tokens its residents bring to a step in the long run.
    pub steady: u64,
    /// Batch tokens its next step may still take.
    pub batch_room: i64,
    /// Sequence tokens that may still become resident.
    pub kv_room: i64,
    /// Requests that may still become resident.
    pub req_room: i64,
}

impl Leaf {
    /// An instance that takes no new request.
    pub const CLOSED: Leaf = Leaf {
        start: f64::INFINITY,
        factor: f64::INFINITY,
        tokens: u64::MAX,
        steady: u64::MAX,
        batch_room: -1,
        kv_room: -1,
        req_room: -1,
    };

    fn merge(a: &Leaf, b: &Leaf) -> Leaf {
        Leaf {
            start: a.start.min(b.start),
            factor: a.factor.min(b.factor),
            tokens: a.tokens.min(b.tokens),
            steady: a.steady.min(b.steady),
            batch_room: a.batch_room.max(b.batch_room),
            kv_room: a.kv_room.max(b.kv_room),
            req_room: a.req_room.max(b.req_room),
        }
    }

    /// Whether a request of `seq` sequence tokens with an `n`-token step may come here.
    fn admits(&self, n: i64, seq: i64) -> bool {
        self.batch_room >= n && self.kv_room >= seq && self.req_room >= 1
    }
}

/// What a search looks for.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Query {
    /// Batch tokens of the request's step.
    pub n: u64,
    /// Sequence tokens it would hold resident.
    pub seq: u64,
    /// Earliest completion (keys involve step costs) rather than least loaded.
    pub timed: bool,
    /// Further steps priced at an instance's steady load, and the tokens the request adds
    /// to each of them.
    pub lookahead: u32,
    pub own: u64,
}

impl Query {
    /// Key of a leaf, or a lower bound of the keys below an aggregate.
    fn key(&self, leaf: &Leaf, costs: &DegreeCosts) -> f64 {
        if self.timed {
            completion_key(leaf, self.n, self.lookahead, self.own, costs)
        } else {
            leaf.start
        }
    }
}

/// Earliest-completion key of a request with an `n`-token next step on `leaf`, its
/// `lookahead` later steps adding `own` tokens to the leaf's steady load.
pub(crate) fn completion_key(
    leaf: &Leaf,
    n: u64,
    lookahead: u32,
    own: u64,
    costs: &DegreeCosts,
) -> f64 {
    let next = costs.full_tokens(leaf.tokens.saturating_add(n));
    if lookahead == 0 {
        return leaf.start + leaf.factor * next;
    }
    let later = f64::from(lookahead) * costs.full_tokens(leaf.steady.saturating_add(own));
    leaf.start + leaf.factor * (next + later)
}

/// The best `(key, slot)` so far; smaller is better.
pub(crate) type Best = Option<(f64, u32)>;

/// Whether `(key, slot)` beats `best`.
pub(crate) fn beats(key: f64, slot: u32, best: Best) -> bool {
    best.is_none_or(|(k, s)| key < k || (key == k && slot < s))
}

#[derive(Clone, Debug, Default)]
pub(crate) struct ChoiceTree {
    /// Leaves in a power-of-two layer; node `i` has children `2i` and `2i + 1`.
    width: usize,
    nodes: Vec<Leaf>,
    /// Instance slot of each leaf, ascending.
    slots: Vec<u32>,
}

impl ChoiceTree {
    /// Empties the tree; leaves are then added with [`Self::push`] and filled by
    /// [`Self::build`].
    pub fn clear(&mut self) {
        self.slots.clear();
    }

    /// Adds instance `slot` (slots must come ascending); returns its leaf index.
    pub fn push(&mut self, slot: u32) -> u32 {
        self.slots.push(slot);
        (self.slots.len() - 1) as u32
    }

    /// Sets every leaf from `leaf(slot)` and computes the aggregates.
    pub fn build(&mut self, mut leaf: impl FnMut(u32) -> Leaf) {
        self.width = self.slots.len().next_power_of_two();
        self.nodes.clear();
        self.nodes.resize(2 * self.width, Leaf::CLOSED);
        for (i, &slot) in self.slots.iter().enumerate() {
            self.nodes[self.width + i] = leaf(slot);
        }
        for i in (1..self.width).rev() {
            self.nodes[i] = Leaf::merge(&self.nodes[2 * i], &self.nodes[2 * i + 1]);
        }
    }

    /// Replaces leaf `index` and updates the aggregates above it.
    pub fn set(&mut self, index: u32, leaf: Leaf) {
        let mut i = self.width + index as usize;
        self.nodes[i] = leaf;
        while i > 1 {
            i /= 2;
            self.nodes[i] = Leaf::merge(&self.nodes[2 * i], &self.nodes[2 * i + 1]);
        }
    }

    /// Improves `best` with the minimum (key, slot) over leaves that admit the query.
    pub fn search(&self, q: &Query, costs: &DegreeCosts, best: &mut Best) {
        if let Some(bound) = self.bound(1, q, costs) {
            self.visit(1, 0, self.width, bound, q, costs, best);
        }
    }

    /// The lower bound of node `node`'s keys, if some leaf below admits the query.
    fn bound(&self, node: usize, q: &Query, costs: &DegreeCosts) -> Option<f64> {
        let agg = self.nodes.get(node)?;
        agg.admits(q.n as i64, q.seq as i64)
            .then(|| q.key(agg, costs))
    }

    /// Visits admitting node `node` (leaves `first..first + span`, keys at least `bound`).
    #[allow(clippy::too_many_arguments)]
    fn visit(
        &self,
        node: usize,
        first: usize,
        span: usize,
        bound: f64,
        q: &Query,
        costs: &DegreeCosts,
        best: &mut Best,
    ) {
        // Leaves past the last instance are CLOSED, so an admitting node has `first` in range.
        let first_slot = self.slots[first];
        if let Some((k, s)) = *best {
            if bound > k || (bound == k && first_slot > s) {
                return;
            }
        }
        if span == 1 {
            // A leaf's bound is its key.
            if beats(bound, first_slot, *best) {
                *best = Some((bound, first_slot));
            }
            return;
        }
        // The child with the lower bound first: the best leaf is found early and prunes
        // the rest.
        let half = span / 2;
        let (left, right) = (2 * node, 2 * node + 1);
        let (lb, rb) = (self.bound(left, q, costs), self.bound(right, q, costs));
        if let (Some(l), Some(r)) = (lb, rb) {
            if r < l {
                self.visit(right, first + half, half, r, q, costs, best);
                self.visit(left, first, half, l, q, costs, best);
                return;
            }
        }
        if let Some(l) = lb {
            self.visit(left, first, half, l, q, costs, best);
        }
        if let Some(r) = rb {
            self.visit(right, first + half, half, r, q, costs, best);
        }
    }

    /// Whether some leaf has resident room for `seq` sequence tokens (batch room aside).
    pub fn any_resident_room(&self, seq: u64) -> bool {
        !self.slots.is_empty() && self.room_below(1, seq as i64)
    }

    fn room_below(&self, node: usize, seq: i64) -> bool {
        let agg = &self.nodes[node];
        if agg.kv_room < seq || agg.req_room < 1 {
            return false;
        }
        node >= self.width || self.room_below(2 * node, seq) || self.room_below(2 * node + 1, seq)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::scheduler::tests::profile;

    fn leaf() -> impl Strategy<Value = Leaf> {
        (
            prop::sample::select(vec![0.0, 0.0, 0.05, 0.3]),
            prop::sample::select(vec![0.5, 1.0, 1.0, 1.3]),
            0u64..6000,
            0u64..3000,
            -5i64..4000,
            -5i64..4000,
            -1i64..3,
            prop::bool::weighted(0.1),
        )
            .prop_map(|(start, factor, tokens, steady, batch, kv, req, closed)| {
                if closed {
                    Leaf::CLOSED
                } else {
                    Leaf {
                        start,
                        factor,
                        tokens,
                        steady,
                        batch_room: batch,
                        kv_room: kv,
                        req_room: req,
                    }
                }
            })
    }

    proptest! {
        /// The pruned search returns exactly the minimum (key, slot) of a scan, before and
        /// after leaf updates, for both kinds of key, with and without lookahead.
        #[test]
        fn search_matches_a_scan(
            leaves in prop::collection::vec(leaf(), 1..40),
            updates in prop::collection::vec((any::<prop::sample::Index>(), leaf()), 0..10),
            queries in prop::collection::vec((1u64..3000, 1u64..3000), 1..10),
            timed in any::<bool>(),
            lookahead in prop::sample::select(vec![0u32, 0, 4, 9]),
        ) {
            let costs = DegreeCosts::new(&profile(), 1, true, 8192).unwrap();
            let slots: Vec<u32> = (0..leaves.len() as u32).map(|i| 3 * i + 1).collect();
            let mut leaves: Vec<Leaf> = leaves
                .into_iter()
                .map(|l| if timed { l } else { Leaf { factor: 0.0, ..l } })
                .collect();
            let mut tree = ChoiceTree::default();
            for &s in &slots {
                tree.push(s);
            }
            tree.build(|s| leaves[(s / 3) as usize]);
            for round in 0..=updates.len() {
                if round > 0 {
                    let (at, mut l) = updates[round - 1];
                    if !timed {
                        l.factor = 0.0;
                    }
                    let i = at.index(leaves.len());
                    leaves[i] = l;
                    tree.set(i as u32, l);
                }
                for &(n, seq) in &queries {
                    let own = 32 + seq / (u64::from(lookahead) + 1);
                    let q = Query { n, seq, timed, lookahead, own };
                    let mut expected: Best = None;
                    for (i, l) in leaves.iter().enumerate() {
                        if l.admits(n as i64, seq as i64) {
                            let key = q.key(l, &costs);
                            if beats(key, slots[i], expected) {
                                expected = Some((key, slots[i]));
                            }
                        }
                    }
                    let mut got = None;
                    tree.search(&q, &costs, &mut got);
                    prop_assert_eq!(got, expected);
                    let any = leaves.iter().any(|l| l.kv_room >= seq as i64 && l.req_room >= 1);
                    prop_assert_eq!(tree.any_resident_room(seq), any);
                }
            }
        }
    }
}
