//! Property tests over random event traces: every round's decisions must respect the
//! scheduler's invariants whatever the policy, budgets, instance capacities and event
//! order.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;

use super::tests::{instance, profile};
use super::*;
use crate::profile::StepKind;

#[derive(Clone, Debug)]
enum Op {
    Arrive {
        prompt: u32,
        output: u32,
        slack: f64,
        priority: i32,
        subset: u32,
    },
    /// Report the step of the n-th running batch (mod their count). Under the exact cache
    /// each request the step took in first reads up to `reads` stored prompt blocks, most
    /// of them one shared prefix.
    Finish {
        pick: usize,
        commit: u32,
        eos: bool,
        reads: u32,
    },
    Cancel(usize),
    /// Arrive with the id of the n-th cancelled request (mod their count).
    Reuse(usize),
    AddInstance(u32, Capacity),
    Drain(usize),
    Undrain(usize),
    Remove(usize),
    /// Abort the step of the n-th running batch.
    Abort(usize),
    Schedule,
}

/// Optional KV tokens, request slots and batch budget of a new instance.
#[derive(Clone, Copy, Debug)]
struct Capacity(Option<u64>, Option<u32>, Option<u64>);

fn capacity() -> impl Strategy<Value = Capacity> {
    (
        prop::option::weighted(0.4, prop::sample::select(vec![400u64, 900, 3000])),
        prop::option::weighted(0.3, 1u32..6),
        prop::option::weighted(0.3, prop::sample::select(vec![300u64, 800, 1500])),
    )
        .prop_map(|(kv, reqs, batch)| Capacity(kv, reqs, batch))
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0u32..600, 1u32..200, 0.0f64..5.0, 0i32..3, 0u32..32).prop_map(
            |(prompt, output, slack, priority, subset)| Op::Arrive {
                prompt, output, slack, priority, subset
            }
        ),
        6 => (any::<usize>(), 1u32..40, prop::bool::weighted(0.03), 0u32..5)
            .prop_map(|(pick, commit, eos, reads)| Op::Finish { pick, commit, eos, reads }),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => any::<usize>().prop_map(Op::Reuse),
        1 => (prop::sample::select(vec![1u32, 2, 4]), capacity())
            .prop_map(|(tp, cap)| Op::AddInstance(tp, cap)),
        1 => any::<usize>().prop_map(Op::Drain),
        1 => any::<usize>().prop_map(Op::Undrain),
        1 => any::<usize>().prop_map(Op::Remove),
        1 => any::<usize>().prop_map(Op::Abort),
        6 => Just(Op::Schedule),
    ]
}

fn policy() -> impl Strategy<Value = Policy> {
    prop::sample::select(vec![
        Policy::dilaserve(),
        Policy::dilaserve().without_load_control(),
        Policy::dilaserve().without_migration(),
        Policy::dilaserve().one_shot(),
        Policy {
            load_order: LoadOrder::Priority,
            prediction: Prediction::Online,
            predict_every: 3,
            ..Policy::dilaserve()
        },
        Policy::infaas_like(0.9),
        Policy::llumnix_like(0.9),
    ])
}

/// Pre-round view of one request, for checking the round against.
struct Before {
    info: RequestInfo,
    step_tokens: u64,
}

struct Harness {
    s: Scheduler,
    policy: Policy,
    caching: bool,
    exact: bool,
    ids: Vec<u64>,
    cancelled: Vec<u64>,
    next_id: u64,
    next_instance: u64,
    running: Vec<(u64, Vec<u64>)>,
    /// (instance, request) of each request a running step took in.
    took_in: HashSet<(u64, u64)>,
    now: f64,
}

impl Harness {
    fn new(policy: Policy, caching: bool, max_batch_tokens: u64) -> Self {
        Self::with_cache(policy, caching, false, max_batch_tokens)
    }

    fn with_cache(policy: Policy, caching: bool, exact: bool, max_batch_tokens: u64) -> Self {
        let config = SchedulerConfig {
            caching,
            exact_cache: exact,
            max_batch_tokens,
            policy,
            ..Default::default()
        };
        Self {
            s: Scheduler::new(profile(), config).unwrap(),
            policy,
            caching,
            exact: caching && exact,
            ids: Vec::new(),
            cancelled: Vec::new(),
            next_id: 0,
            next_instance: 0,
            running: Vec::new(),
            took_in: HashSet::new(),
            now: 0.0,
        }
    }

    fn snapshot(&self) -> HashMap<u64, Before> {
        self.ids
            .iter()
            .filter_map(|&id| self.s.request(id).ok())
            .map(|info| {
                let step_tokens = if info.next_kind == StepKind::Cache {
                    u64::from(info.block_length)
                } else {
                    u64::from(info.prompt_len) + u64::from(info.output_len)
                };
                (info.id, Before { info, step_tokens })
            })
            .collect()
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Arrive {
                prompt,
                output,
                slack,
                priority,
                subset,
            } => {
                let id = self.next_id;
                self.next_id += 1;
                self.arrive(id, prompt, output, slack, priority, subset);
            }
            Op::Reuse(pick) => {
                if !self.cancelled.is_empty() {
                    let id = self.cancelled.remove(pick % self.cancelled.len());
                    self.arrive(id, 30, 40, 2.0, 0, 0);
                }
            }
            Op::Finish {
                pick,
                commit,
                eos,
                reads,
            } => {
                if self.running.is_empty() {
                    return Ok(());
                }
                let (inst, members) = self.running.remove(pick % self.running.len());
                self.read_prefixes(inst, &members, reads)?;
                let results: Vec<StepResult> = members
                    .iter()
                    .filter_map(|&id| self.s.request(id).ok())
                    .map(|info| StepResult {
                        request: info.id,
                        committed: commit.min(info.block_length - info.unmasked_in_block),
                        confidence: Some([0.1, 0.2, 0.4, 0.5, 0.7]),
                        finished: eos,
                    })
                    .collect();
                let finished = self
                    .s
                    .step_done(inst, 0.02, &results)
                    .map_err(|e| TestCaseError::fail(format!("valid report rejected: {e}")))?;
                for f in finished {
                    prop_assert_eq!(f.taus.len(), f.steps as usize);
                    prop_assert!(f.recompute_steps <= f.steps);
                    prop_assert_eq!(
                        f.instances.len(),
                        f.migrations as usize + 1,
                        "every change of instance is a reported migration"
                    );
                    prop_assert!(f.instances.windows(2).all(|w| w[0] != w[1]));
                }
                let finished: HashSet<u64> = finished.iter().map(|f| f.id).collect();
                self.ids.retain(|id| !finished.contains(id));
            }
            Op::Cancel(pick) => {
                if !self.ids.is_empty() {
                    let id = self.ids.remove(pick % self.ids.len());
                    self.s
                        .cancel(id)
                        .map_err(|e| TestCaseError::fail(e.to_string()))?;
                    self.cancelled.push(id);
                }
            }
            Op::AddInstance(tp, Capacity(kv, reqs, batch)) => {
                let id = self.next_instance;
                self.next_instance += 1;
                let spec = InstanceSpec {
                    kv_tokens: kv,
                    max_requests: reqs,
                    max_batch_tokens: batch,
                    ..instance(id, tp)
                };
                self.s
                    .add_instance(spec)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::Drain(pick) | Op::Undrain(pick) | Op::Remove(pick) => {
                let live = self.s.instance_ids();
                if live.len() <= 1 {
                    return Ok(());
                }
                let id = live[pick % live.len()];
                let done = match op {
                    Op::Drain(_) => self.s.drain_instance(id),
                    Op::Undrain(_) => self.s.undrain_instance(id),
                    _ => {
                        self.running.retain(|(inst, _)| *inst != id);
                        self.s.remove_instance(id)
                    }
                };
                done.map_err(|e| TestCaseError::fail(e.to_string()))?;
            }
            Op::Abort(pick) => {
                if self.running.is_empty() {
                    return Ok(());
                }
                let (inst, members) = self.running.remove(pick % self.running.len());
                for id in &members {
                    self.took_in.remove(&(inst, *id));
                }
                let aborted = self
                    .s
                    .abort_step(inst)
                    .map_err(|e| TestCaseError::fail(e.to_string()))?
                    .to_vec();
                for id in aborted {
                    prop_assert!(members.contains(&id));
                    let info = self.s.request(id).unwrap();
                    prop_assert!(!info.in_flight && info.instance.is_none());
                }
                let inst = self.s.instance(inst).unwrap();
                prop_assert!(inst.batch.is_empty() && inst.predicted_finish.is_none());
            }
            Op::Schedule => self.round()?,
        }
        Ok(())
    }

    /// Under the exact cache, each of `members` that `inst`'s step took in reads up to
    /// `reads` stored blocks, as its worker would report: every third request its own
    /// prefix, the others one they share.
    fn read_prefixes(
        &mut self,
        inst: u64,
        members: &[u64],
        reads: u32,
    ) -> Result<(), TestCaseError> {
        for &id in members {
            if !self.took_in.remove(&(inst, id)) || !self.exact {
                continue;
            }
            let Ok(info) = self.s.request(id) else {
                continue;
            };
            let base = if id % 3 == 0 { 1000 * (id + 1) } else { 0 };
            let blocks = u64::from(reads.min(info.prompt_len / info.block_length));
            self.s
                .read_prefix(inst, id, (base..base + blocks).collect())
                .map_err(|e| TestCaseError::fail(format!("valid reads rejected: {e}")))?;
        }
        Ok(())
    }

    /// Cancels every request and reports every running step: each instance must then
    /// charge nothing, whatever its residents read.
    fn retire_all(&mut self) -> Result<(), TestCaseError> {
        for id in std::mem::take(&mut self.ids) {
            self.s
                .cancel(id)
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        for (inst, _) in std::mem::take(&mut self.running) {
            self.s
                .step_done(inst, 0.02, &[])
                .map_err(|e| TestCaseError::fail(e.to_string()))?;
        }
        for id in self.s.instance_ids() {
            let i = self.s.instance(id).unwrap();
            prop_assert_eq!(i.residents, 0);
            prop_assert_eq!(i.kv_used_tokens, 0, "instance {} still charges", id);
        }
        Ok(())
    }

    fn arrive(
        &mut self,
        id: u64,
        prompt: u32,
        output: u32,
        slack: f64,
        priority: i32,
        subset: u32,
    ) {
        let taus = &self.s.config().thresholds;
        let chosen: Vec<f64> = taus
            .iter()
            .enumerate()
            .filter(|(k, _)| subset & (1 << k) != 0)
            .map(|(_, &t)| t)
            .collect();
        let mut spec = RequestSpec::new(id, self.now, self.now + slack, prompt, output);
        spec.priority = priority;
        spec.thresholds = (!chosen.is_empty()).then_some(chosen);
        if self.s.arrive(spec).is_ok() {
            self.ids.push(id);
        }
    }

    fn round(&mut self) -> Result<(), TestCaseError> {
        let before = self.snapshot();
        let instances: HashMap<u64, InstanceInfo> = self
            .s
            .instance_ids()
            .into_iter()
            .filter_map(|id| self.s.instance(id).ok())
            .map(|i| (i.id, i))
            .collect();
        let idle: HashSet<u64> = instances
            .values()
            .filter(|i| i.predicted_finish.is_none())
            .map(|i| i.id)
            .collect();
        self.now += 0.01;
        let d = self
            .s
            .schedule(self.now)
            .map_err(|e| TestCaseError::fail(e.to_string()))?
            .clone();
        let ready: HashSet<u64> = before
            .values()
            .filter(|b| !b.info.in_flight)
            .map(|b| b.info.id)
            .collect();

        let mut seen = HashSet::new();
        for batch in &d.batches {
            prop_assert!(
                idle.contains(&batch.instance),
                "batch on a busy or dead instance"
            );
            let inst = &instances[&batch.instance];
            prop_assert!(
                batch.tokens <= inst.max_batch_tokens,
                "batch over the instance's token budget"
            );
            let mut tokens = 0;
            for e in d.entries_of(batch) {
                prop_assert!(
                    seen.insert(e.request),
                    "request {} in two batches",
                    e.request
                );
                let b = before
                    .get(&e.request)
                    .ok_or_else(|| TestCaseError::fail("unknown"))?;
                prop_assert!(!b.info.in_flight, "dispatched while in flight");
                if self.exact && e.new_here {
                    // The exact cache moves a request between blocks: it prefills there.
                    prop_assert_eq!(e.kind, StepKind::Recompute);
                } else {
                    prop_assert_eq!(e.kind, b.info.next_kind);
                }
                if self.exact {
                    // A prefill feeds at most the sequence (less behind a stored prefix);
                    // a cache step its block, and the finished one too at a block opening.
                    let block = u64::from(b.info.block_length);
                    let most = match e.kind {
                        StepKind::Cache => 2 * block,
                        _ => u64::from(b.info.prompt_len) + u64::from(b.info.output_len),
                    };
                    prop_assert!(
                        (1..=most).contains(&e.tokens),
                        "{:?} step of {} tokens",
                        e.kind,
                        e.tokens
                    );
                } else {
                    prop_assert_eq!(e.tokens, b.step_tokens);
                }
                tokens += e.tokens;
                if self.caching && e.kind == StepKind::Cache {
                    prop_assert!(!e.new_here, "cache step on a new instance");
                    prop_assert_eq!(b.info.instance, Some(batch.instance));
                }
                prop_assert_eq!(e.new_here, b.info.instance != Some(batch.instance));
                if let Some(reserver) = inst.reserved_for {
                    // Until its reserver is dispatched (which ends the reservation), a
                    // reserved instance takes no other new request.
                    let entries = d.entries_of(batch);
                    let here = entries.iter().position(|x| x.request == reserver);
                    let this = entries.iter().position(|x| x.request == e.request);
                    let before_it = here.zip(this).is_some_and(|(h, t)| h <= t);
                    let elsewhere =
                        here.is_none() && d.entries.iter().any(|x| x.request == reserver);
                    prop_assert!(
                        !e.new_here || elsewhere || before_it,
                        "instance reserved for {} took new request {}",
                        reserver,
                        e.request
                    );
                }
                match self.policy.fixed() {
                    Some(tau) => prop_assert_eq!(e.tau, tau),
                    None => {
                        prop_assert!(b.info.allowed.contains(&e.tau));
                        let cap = self.s.request(e.request).unwrap().max_tau;
                        prop_assert!(e.tau <= cap);
                    }
                }
            }
            prop_assert_eq!(tokens, batch.tokens);
            for e in d.entries_of(batch).iter().filter(|e| e.new_here) {
                self.took_in.insert((batch.instance, e.request));
            }
            self.running.push((
                batch.instance,
                d.entries_of(batch).iter().map(|e| e.request).collect(),
            ));
        }
        for m in &d.migrations {
            let b = &before[&m.request];
            prop_assert!(seen.contains(&m.request), "migration without dispatch");
            if self.exact {
                prop_assert!(
                    b.info.next_kind == StepKind::Recompute || b.info.unmasked_in_block == 0,
                    "migration inside a block"
                );
            } else if self.caching {
                prop_assert_eq!(
                    b.info.next_kind,
                    StepKind::Recompute,
                    "migration before a cache step"
                );
            }
            if !self.policy.migration {
                prop_assert!(
                    matches!(
                        m.reason,
                        MigrationReason::Draining
                            | MigrationReason::InstanceRemoved
                            | MigrationReason::StepAborted
                    ),
                    "migration {:?} with migration off",
                    m.reason
                );
            }
        }
        let mut waiting = HashSet::new();
        for w in &d.waiting {
            prop_assert!(waiting.insert(w.request), "request waits twice");
            prop_assert!(
                !seen.contains(&w.request),
                "request both dispatched and waiting"
            );
        }
        let accounted: HashSet<u64> = seen.union(&waiting).copied().collect();
        prop_assert_eq!(
            accounted,
            ready,
            "every ready request is dispatched or waits"
        );
        for id in self.s.instance_ids() {
            let i = self.s.instance(id).unwrap();
            prop_assert!(
                i.kv_tokens.is_none_or(|kv| i.kv_used_tokens <= kv),
                "instance {} holds {} tokens over its KV capacity {:?}",
                id,
                i.kv_used_tokens,
                i.kv_tokens
            );
            prop_assert!(i.max_requests.is_none_or(|m| i.residents <= m));
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn rounds_respect_invariants(
        policy in policy(),
        cache in 0u8..3,
        max_tokens in prop::sample::select(vec![700u64, 2000, 8192]),
        tps in prop::collection::vec((prop::sample::select(vec![1u32, 2, 4]), capacity()), 1..5),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        // No cache, the approximate one, or block diffusion's exact one.
        let mut h = Harness::with_cache(policy, cache > 0, cache == 2, max_tokens);
        for (tp, cap) in tps {
            h.apply(&Op::AddInstance(tp, cap))?;
        }
        for op in &ops {
            h.apply(op)?;
        }
        h.round()?;
        h.retire_all()?;
    }
}

/// A request reserved an instance while it had to leave its draining home, then stayed
/// when the home was undrained and finished there: its reservation used to outlive it.
#[test]
fn a_finished_request_holds_no_reservation() {
    let mut h = Harness::new(Policy::dilaserve().without_migration(), false, 2000);
    let arrive = |prompt, output| Op::Arrive {
        prompt,
        output,
        slack: 0.0,
        priority: 0,
        subset: 0,
    };
    // Running batches are picked by index modulo their count: 1 is the TP-2 instance's.
    let finish = |commit| Op::Finish {
        pick: 1,
        commit,
        eos: false,
        reads: 0,
    };
    let none = Capacity(None, None, None);
    let ops = [
        Op::AddInstance(4, none),
        Op::AddInstance(2, none),
        arrive(481, 161),
        arrive(163, 97),
        arrive(514, 33),
        arrive(395, 33),
        Op::Schedule,
        finish(2),
        Op::Schedule,
        finish(30),
        Op::Schedule,
        finish(21),
        Op::Drain(1),
        Op::Schedule,
        Op::Undrain(1),
        Op::Schedule,
        finish(26),
        Op::Abort(0),
    ];
    for op in &ops {
        h.apply(op).unwrap();
    }
    for id in h.s.instance_ids() {
        assert_eq!(h.s.instance(id).unwrap().reserved_for, None);
    }
}
