//! Instance choice (DESIGN §6, Alg. 3): per-round batch-token accounting and, per TP
//! degree, [`ChoiceTree`]s over the instances that take new requests: one over the idle
//! instances and one over the busy ones. Keys of the two kinds differ in start time (now,
//! or the end of the step in flight), so a tree mixing them bounds its subtrees by the
//! start of an idle instance and the tokens of a busy one and prunes little.
//!
//! *(ours)* Busy instances are candidates too: a request's key on an instance is when its
//! step there would complete — `max(now, predicted end of the step in flight)` plus the
//! predicted step time with the request added (profile × the instance's factor). A busy
//! instance's next step is counted from [`Instance::base_tokens`] plus what this round
//! queued for it. If the best instance is busy the request waits for it; its tokens still
//! count there for the rest of the round. The least-loaded baseline keys an instance by its
//! resident tokens plus the tokens assigned to it this round.
//!
//! *(ours)* Once instances of more than one degree have joined, the key also prices the
//! request's next [`Lookahead::steps`] steps at the instance's steady load: the tokens its residents bring to a step in the long run (with
//! caching, each one's block plus its whole sequence spread over a block of `steps + 1`
//! steps, one of them a recompute step; without, each one's sequence), plus the request's
//! own. The next step alone misjudges instances of different degrees: a TP-4 instance's
//! next batch of cache steps is quick, so arrivals piled onto it while idle TP-1 instances
//! waited, and every step of theirs there ran crowded by the others' recompute steps (on
//! 2 × TP-4 + 8 × TP-1, the TP-4s were busy all the time and the TP-1s a quarter of it).
//!
//! A request that would become resident (arrival or migration) goes only where it fits the
//! instance's resident capacity; every step fits its instance's batch budget. A reserved
//! instance (see `reservation`) is closed to every free request but its reserver.

use super::choice_tree::{beats, completion_key, Best, ChoiceTree, Leaf, Query};
use super::config::{InstanceChoice, Policy};
use super::cost::DegreeCosts;
use super::instance::Instance;

/// Not in any tree (the instance is gone).
const NO_LEAF: u32 = u32::MAX;

/// Index of the tree holding `inst`; an instance's busy state is fixed during a round.
fn tree_of(inst: &Instance) -> usize {
    2 * inst.group + usize::from(inst.busy)
}

/// How far earliest-completion choice looks beyond a request's next step.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub(crate) struct Lookahead {
    /// Further steps priced at an instance's steady load; 0: the next step alone.
    pub steps: u32,
    pub block: u64,
    pub caching: bool,
}

impl Lookahead {
    /// Tokens `residents` requests holding `seq` sequence tokens bring to a step in the
    /// long run.
    pub fn per_step(&self, residents: u64, seq: u64) -> u64 {
        if self.caching {
            residents * self.block + seq / (u64::from(self.steps) + 1)
        } else {
            seq
        }
    }
}

/// An instance as a request's move is priced: its slot, state and degree's costs.
pub(crate) type PricedInstance<'a> = (u32, &'a Instance, &'a DegreeCosts);

/// The instance a free request would go to, with its comparison key.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Candidate {
    pub slot: u32,
    pub key: f64,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Placement {
    /// Per degree group `g`: idle instances in tree `2g`, busy ones in `2g + 1`.
    trees: Vec<ChoiceTree>,
    /// Per instance slot: its leaf in its tree.
    leaf_of: Vec<u32>,
    /// Batch tokens assigned this round per instance slot: dispatched on an idle instance,
    /// or waiting for a busy one's next step.
    pub tokens: Vec<u64>,
    /// The full-sequence part of `tokens` on idle instances.
    pub full_tokens: Vec<u64>,
    /// Per busy instance: requests queued for it this round that are not resident there,
    /// and their sequence tokens; they count against its resident room.
    queued: Vec<(u32, u64)>,
    /// May be sent a step this round ([`Instance::open`]): idle, or open for a step ahead.
    pub open: Vec<bool>,
    /// Open instances that take new requests (not draining).
    pub accepting: usize,
    /// Alive instances that are not draining, busy or not.
    pub targets: usize,
    /// Slot closed to every free request but its reserver.
    reserved: Option<u32>,
    /// Room only shrinks during a round, except when a request leaves an instance or a
    /// reservation ends: a search that found nothing for `(n, seq)` finds nothing for
    /// larger requests until then, so those fail without searching.
    no_fit: Option<(u64, u64)>,
    /// Likewise, sequence tokens from which no instance has resident room.
    no_resident_room: u64,
    now: f64,
    choice: Option<InstanceChoice>,
    lookahead: Lookahead,
}

impl Placement {
    #[allow(clippy::too_many_arguments)]
    pub fn begin(
        &mut self,
        instances: &[Instance],
        groups: usize,
        now: f64,
        choice: InstanceChoice,
        lookahead: Lookahead,
        reserved: Option<u32>,
        overlap: bool,
    ) {
        let n = instances.len();
        self.now = now;
        self.choice = Some(choice);
        self.lookahead = lookahead;
        self.reserved = reserved;
        self.freed();
        self.tokens.clear();
        self.tokens.resize(n, 0);
        self.full_tokens.clear();
        self.full_tokens.resize(n, 0);
        self.queued.clear();
        self.queued.resize(n, (0, 0));
        self.open.clear();
        (self.targets, self.accepting) = (0, 0);
        for inst in instances {
            let open = inst.open(overlap);
            let target = inst.alive && !inst.draining;
            self.open.push(open);
            self.targets += usize::from(target);
            self.accepting += usize::from(open && target);
        }
        self.trees.resize_with(2 * groups, ChoiceTree::default);
        for tree in &mut self.trees {
            tree.clear();
        }
        self.leaf_of.clear();
        self.leaf_of.resize(n, NO_LEAF);
    }

    /// Batch tokens instance `slot`'s next step holds so far.
    fn step_tokens(&self, slot: u32, inst: &Instance) -> u64 {
        inst.base_tokens(self.open[slot as usize]) + self.tokens[slot as usize]
    }

    /// Tokens instance `slot`'s residents, those queued for it included, bring to a step
    /// in the long run (recompute steps spread over `horizon`).
    fn steady(&self, slot: u32, inst: &Instance, horizon: Lookahead) -> u64 {
        let (reqs, seq) = self.queued[slot as usize];
        horizon.per_step(
            u64::from(inst.residents) + u64::from(reqs),
            inst.resident_tokens + seq,
        )
    }

    /// Whether instance `slot`'s next step has room for `n` more batch tokens.
    pub fn fits(&self, slot: u32, inst: &Instance, n: u64) -> bool {
        self.step_tokens(slot, inst) + n <= inst.budget
    }

    /// Assigns the `n`-token step of a request resident on `slot` that must stay there;
    /// trees are not built yet.
    pub fn add_fixed(&mut self, slot: u32, n: u64, full: bool) {
        self.tokens[slot as usize] += n;
        if full && self.open[slot as usize] {
            self.full_tokens[slot as usize] += n;
        }
    }

    /// Fills the trees once fixed assignments are in.
    pub fn build(&mut self, instances: &[Instance]) {
        for (slot, inst) in instances.iter().enumerate() {
            if inst.alive {
                self.leaf_of[slot] = self.trees[tree_of(inst)].push(slot as u32);
            }
        }
        let mut trees = std::mem::take(&mut self.trees);
        for tree in &mut trees {
            tree.build(|slot| self.leaf(slot, &instances[slot as usize]));
        }
        self.trees = trees;
    }

    /// When instance `slot` could start its next step.
    fn start(&self, inst: &Instance) -> f64 {
        if inst.busy {
            self.now.max(inst.free_at())
        } else {
            self.now
        }
    }

    /// The tree entry of instance `slot` as a destination for new requests.
    fn leaf(&self, slot: u32, inst: &Instance) -> Leaf {
        if self.reserved == Some(slot) {
            return Leaf::CLOSED;
        }
        self.open_leaf(slot, inst)
    }

    /// [`Self::leaf`] ignoring a reservation.
    fn open_leaf(&self, slot: u32, inst: &Instance) -> Leaf {
        if !inst.alive || inst.draining {
            return Leaf::CLOSED;
        }
        let round = self.tokens[slot as usize];
        let tokens = inst.base_tokens(self.open[slot as usize]) + round;
        let (queued_reqs, queued_seq) = self.queued[slot as usize];
        let (start, factor) = match self.choice {
            Some(InstanceChoice::LeastLoaded) => ((inst.resident_tokens + round) as f64, 0.0),
            _ => (self.start(inst), inst.factor),
        };
        let room = |cap: Option<u64>, used: u64| {
            cap.map_or(i64::MAX, |c| {
                c.saturating_sub(used).min(i64::MAX as u64) as i64
            })
        };
        let steady = self.steady(slot, inst, self.lookahead);
        Leaf {
            start,
            factor,
            tokens,
            steady,
            batch_room: room(Some(inst.budget), tokens),
            kv_room: room(inst.kv_tokens, inst.kv_used + queued_seq),
            req_room: room(
                inst.max_requests.map(u64::from),
                u64::from(inst.residents) + u64::from(queued_reqs),
            ),
        }
    }

    /// Forgets failed searches: some instance may have more room now.
    fn freed(&mut self) {
        self.no_fit = None;
        self.no_resident_room = u64::MAX;
    }

    /// Recomputes the entry of instance `slot`, which a request left.
    pub fn left(&mut self, slot: u32, inst: &Instance) {
        self.freed();
        self.refresh(slot, inst);
    }

    /// Recomputes instance `slot`'s entry after its tokens or residents changed.
    pub fn refresh(&mut self, slot: u32, inst: &Instance) {
        let index = self.leaf_of[slot as usize];
        if index != NO_LEAF {
            let leaf = self.leaf(slot, inst);
            self.trees[tree_of(inst)].set(index, leaf);
        }
    }

    fn query(&self, n: u64, seq: u64) -> Query {
        Query {
            n,
            seq,
            timed: self.choice != Some(InstanceChoice::LeastLoaded),
            lookahead: self.lookahead.steps,
            own: self.lookahead.per_step(1, seq),
        }
    }

    /// Best instance for a new resident of `seq` tokens with an `n`-token step, if any fits.
    pub fn best(&mut self, n: u64, seq: u64, groups: &[DegreeCosts]) -> Option<Candidate> {
        if self.no_fit.is_some_and(|(fn_, fs)| n >= fn_ && seq >= fs) {
            return None;
        }
        let q = self.query(n, seq);
        let mut best: Best = None;
        // Idle instances first: their keys are usually the smaller, so the busy trees'
        // searches start from a tight best and prune early.
        for busy in [0, 1] {
            for (g, costs) in groups.iter().enumerate() {
                self.trees[2 * g + busy].search(&q, costs, &mut best);
            }
        }
        if best.is_none() && self.no_fit.is_none_or(|(fn_, fs)| n <= fn_ && seq <= fs) {
            self.no_fit = Some((n, seq));
        }
        best.map(|(key, slot)| Candidate { slot, key })
    }

    /// Key of instance `slot` for a new resident whose step there feeds `n` tokens (for a
    /// reserved `slot`, only its `reserver`), if the request fits there.
    pub fn key_at(
        &self,
        slot: u32,
        inst: &Instance,
        (n, seq): (u64, u64),
        costs: &DegreeCosts,
        reserver: bool,
    ) -> Option<f64> {
        let leaf = if reserver {
            self.open_leaf(slot, inst)
        } else {
            self.leaf(slot, inst)
        };
        let fits = leaf.batch_room >= n as i64 && leaf.kv_room >= seq as i64 && leaf.req_room >= 1;
        fits.then(|| self.key_of(&leaf, n, seq, costs))
    }

    fn key_of(&self, leaf: &Leaf, n: u64, seq: u64, costs: &DegreeCosts) -> f64 {
        match self.choice {
            Some(InstanceChoice::LeastLoaded) => leaf.start,
            _ => {
                let own = self.lookahead.per_step(1, seq);
                completion_key(leaf, n, self.lookahead.steps, own, costs)
            }
        }
    }

    /// Key of a request of `seq` tokens staying on its home `slot`, if it may: the home
    /// takes no new residents, so only batch room counts, and the request's own tokens are
    /// already in its load (least loaded) or its steady load (earliest completion).
    pub fn home_key(
        &self,
        slot: u32,
        inst: &Instance,
        n: u64,
        seq: u64,
        costs: &DegreeCosts,
    ) -> Option<f64> {
        if inst.draining || !self.fits(slot, inst, n) {
            return None;
        }
        let round = self.tokens[slot as usize];
        Some(match self.choice {
            Some(InstanceChoice::LeastLoaded) => {
                (inst.resident_tokens.saturating_sub(seq) + round) as f64
            }
            _ => {
                let leaf = self.priced_leaf(slot, inst, self.lookahead);
                completion_key(&leaf, n, self.lookahead.steps, 0, costs)
            }
        })
    }

    /// *(ours)* Whether a request of `seq` tokens gains by leaving its `home` (next step
    /// `n_home` tokens there) for `to` (`n_to` tokens there: under the exact cache a
    /// recompute of its prefix): whether `to` finishes its next step and the policy's
    /// `lookahead_steps` further ones, priced at both instances' steady loads (its own
    /// share added on `to`), at least `migration_gain` of the time from now sooner than
    /// `home` does.
    pub fn move_pays(
        &self,
        home: PricedInstance<'_>,
        to: PricedInstance<'_>,
        (n_home, n_to): (u64, u64),
        seq: u64,
        policy: &Policy,
    ) -> bool {
        let steps = policy.lookahead_steps;
        let horizon = Lookahead {
            steps,
            ..self.lookahead
        };
        let key = |(slot, inst, costs): PricedInstance<'_>, n: u64, own: u64| {
            completion_key(&self.priced_leaf(slot, inst, horizon), n, steps, own, costs) - self.now
        };
        key(to, n_to, horizon.per_step(1, seq))
            < key(home, n_home, 0) * (1.0 - policy.migration_gain)
    }

    /// The pricing fields of `slot`'s leaf with its steady load over `horizon`.
    fn priced_leaf(&self, slot: u32, inst: &Instance, horizon: Lookahead) -> Leaf {
        Leaf {
            start: self.start(inst),
            factor: inst.factor,
            tokens: self.step_tokens(slot, inst),
            steady: self.steady(slot, inst, horizon),
            ..Leaf::CLOSED
        }
    }

    /// Whether `best` improves on by putting the request on `slot` with `key`.
    pub fn better(key: f64, slot: u32, best: Option<Candidate>) -> bool {
        beats(key, slot, best.map(|c| (c.key, c.slot)))
    }

    /// Assigns a free request's `n`-token full-sequence step to `slot`. `new_resident`: it
    /// is not resident there; for a busy `slot` (queued) that holds resident room.
    pub fn add_free(&mut self, slot: u32, inst: &Instance, n: u64, new_resident: Option<u64>) {
        let s = slot as usize;
        self.tokens[s] += n;
        if !self.open[s] {
            if let Some(seq) = new_resident {
                self.queued[s].0 += 1;
                self.queued[s].1 += seq;
            }
        } else {
            self.full_tokens[s] += n;
        }
        self.refresh(slot, inst);
    }

    /// Closes `slot` to every free request but its reserver.
    pub fn reserve(&mut self, slot: u32, inst: &Instance) {
        self.reserved = Some(slot);
        self.refresh(slot, inst);
    }

    /// The slot closed by a reservation, if any.
    pub fn reserved(&self) -> Option<u32> {
        self.reserved
    }

    /// Opens the reserved `slot` again (its reserver was dispatched).
    pub fn release(&mut self, slot: u32, inst: &Instance) {
        self.reserved = None;
        self.left(slot, inst);
    }

    /// Whether some instance open to new requests has resident room for `seq` tokens.
    pub fn any_resident_room(&mut self, seq: u64) -> bool {
        if seq >= self.no_resident_room {
            return false;
        }
        let any = self.trees.iter().any(|t| t.any_resident_room(seq));
        if !any {
            self.no_resident_room = seq;
        }
        any
    }

    /// Resident room left on `slot` for `seq` tokens, counting requests queued for it.
    pub fn resident_room(&self, slot: u32, inst: &Instance, seq: u64) -> bool {
        let (reqs, toks) = self.queued[slot as usize];
        inst.alive && !inst.draining && inst.has_resident_room(reqs + 1, toks + seq)
    }

    /// When instance `slot`'s next step would end with what this round gave it (the
    /// earliest its batch room frees).
    pub fn next_end(&self, slot: u32, inst: &Instance, costs: &DegreeCosts) -> f64 {
        let tokens = self.step_tokens(slot, inst);
        if tokens == 0 {
            return self.start(inst);
        }
        self.start(inst) + inst.factor * costs.full_tokens(tokens)
    }
}
