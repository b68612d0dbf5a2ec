//! Scenario tests of scheduling decisions through the event API, and the helpers the
//! other scheduler tests share.

use super::*;
use crate::profile::{LatencyProfile, StepKind};

/// Full steps cost 20 ms + 20 µs/token on TP1 (less on TP2/TP4); cache steps 5 ms + 10 µs/token.
pub(super) fn profile() -> LatencyProfile {
    let mut tables = Vec::new();
    for (tp, speed) in [(1u32, 1.0), (2, 0.75), (4, 0.45)] {
        let full: Vec<(u64, f64)> = [64u64, 512, 4096, 16384]
            .iter()
            .map(|&n| (n, (0.02 + 2e-5 * n as f64) * speed))
            .collect();
        let cache: Vec<(u64, f64)> = [32u64, 256, 2048, 16384]
            .iter()
            .map(|&n| (n, (0.005 + 1e-5 * n as f64) * speed))
            .collect();
        tables.push((tp, StepKind::Recompute, full.clone()));
        tables.push((tp, StepKind::NoCache, full));
        tables.push((tp, StepKind::Cache, cache));
    }
    LatencyProfile::from_tables(tables).unwrap()
}

pub(super) fn instance(id: u64, tp: u32) -> InstanceSpec {
    InstanceSpec::new(id, tp, (0..tp).collect(), id as u32)
}

pub(super) fn scheduler(policy: Policy) -> Scheduler {
    let config = SchedulerConfig {
        policy,
        ..Default::default()
    };
    Scheduler::new(profile(), config).unwrap()
}

/// [`scheduler`] under block diffusion's exact cache.
pub(super) fn exact_scheduler(policy: Policy) -> Scheduler {
    let config = SchedulerConfig {
        exact_cache: true,
        policy,
        ..Default::default()
    };
    Scheduler::new(profile(), config).unwrap()
}

pub(super) fn batch_of(d: &Decisions, instance: u64) -> Vec<BatchEntry> {
    d.batches
        .iter()
        .find(|b| b.instance == instance)
        .map(|b| d.entries_of(b).to_vec())
        .unwrap_or_default()
}

pub(super) fn results(entries: &[BatchEntry], committed: u32) -> Vec<StepResult> {
    entries
        .iter()
        .map(|e| StepResult::new(e.request, committed))
        .collect()
}

#[test]
fn dispatches_and_picks_threshold_by_slo() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(7, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 1000.0, 100, 64)).unwrap();
    s.arrive(RequestSpec::new(2, 0.0, 0.01, 100, 64)).unwrap();
    let d = s.schedule(0.0).unwrap().clone();
    let batch = batch_of(&d, 7);
    assert_eq!(batch.len(), 2);
    assert!(batch
        .iter()
        .all(|e| e.kind == StepKind::Recompute && e.new_here));
    assert_eq!(
        batch[0].tau, 0.9,
        "a loose deadline keeps the highest threshold"
    );
    assert_eq!(
        batch[1].tau, 0.5,
        "an unreachable deadline falls to the lowest"
    );
    assert_eq!(d.batches[0].tokens, 2 * (100 + 64));
    assert!(d.migrations.is_empty() && d.waiting.is_empty());
    let info = s.request(1).unwrap();
    assert!(info.in_flight);
    assert_eq!(info.instance, Some(7));
    assert_eq!(info.last_tau, Some(0.9));
    let inst = s.instance(7).unwrap();
    assert_eq!(inst.batch, vec![1, 2]);
    assert!(inst.predicted_finish.unwrap() > 0.0);
}

#[test]
fn cache_steps_stay_home_and_recompute_steps_may_move() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    for id in 0..4 {
        s.arrive(RequestSpec::new(id, 0.0, 100.0, 1900, 64))
            .unwrap();
    }
    let d = s.schedule(0.0).unwrap().clone();
    assert_eq!(batch_of(&d, 1).len(), 4);
    // A second, empty instance appears; everyone is mid-block, so nobody moves.
    s.add_instance(instance(2, 1)).unwrap();
    s.step_done(1, 0.1, &results(&batch_of(&d, 1), 8)).unwrap();
    let d = s.schedule(0.1).unwrap().clone();
    assert!(d.migrations.is_empty());
    assert!(batch_of(&d, 2).is_empty());
    assert!(batch_of(&d, 1)
        .iter()
        .all(|e| e.kind == StepKind::Cache && !e.new_here));
    // Finish the block: the next step is a recompute step and load spreads to instance 2.
    s.step_done(1, 0.1, &results(&batch_of(&d, 1), 24)).unwrap();
    let d = s.schedule(0.2).unwrap().clone();
    assert!(!d.migrations.is_empty());
    for m in &d.migrations {
        assert_eq!((m.from, m.to, m.reason), (1, 2, MigrationReason::Rebalance));
    }
    let moved = batch_of(&d, 2);
    assert_eq!(moved.len(), d.migrations.len());
    assert!(moved
        .iter()
        .all(|e| e.kind == StepKind::Recompute && e.new_here));
    assert_eq!(batch_of(&d, 1).len() + moved.len(), 4);
}

#[test]
fn waiting_requests_carry_reasons() {
    let mut s = Scheduler::new(
        profile(),
        SchedulerConfig {
            max_batch_tokens: 1000,
            ..Default::default()
        },
    )
    .unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 920, 64)).unwrap();
    let d = s.schedule(0.0).unwrap();
    assert_eq!(
        d.waiting,
        vec![Waiting {
            request: 1,
            reason: WaitReason::NoInstance
        }]
    );
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(2, 0.0, 10.0, 920, 64)).unwrap();
    let d = s.schedule(0.0).unwrap().clone();
    assert_eq!(batch_of(&d, 1).len(), 1);
    assert_eq!(
        d.waiting,
        vec![Waiting {
            request: 2,
            reason: WaitReason::NoRoom
        }]
    );
    assert_eq!(
        s.instance(1).unwrap().reserved_for,
        Some(2),
        "the request that found no room holds the instance"
    );
    s.arrive(RequestSpec::new(3, 0.0, 10.0, 10, 32)).unwrap();
    let d = s.schedule(0.0).unwrap();
    assert_eq!(d.waiting.len(), 2);
    assert!(d.waiting.iter().all(|w| w.reason == WaitReason::AllBusy));
    s.step_done(1, 0.05, &[StepResult::new(1, 1)]).unwrap();
    let d = s.schedule(0.1).unwrap().clone();
    // Request 1 keeps its cache step; 2 does not fit beside it, and 3 may not take the
    // instance reserved for 2.
    let ids: Vec<u64> = batch_of(&d, 1).iter().map(|e| e.request).collect();
    assert_eq!(ids, vec![1]);
    let waits: Vec<(u64, WaitReason)> = d.waiting.iter().map(|w| (w.request, w.reason)).collect();
    assert_eq!(
        waits,
        vec![(2, WaitReason::NoRoom), (3, WaitReason::NoRoom)]
    );
    s.drain_instance(1).unwrap();
    assert_eq!(s.instance(1).unwrap().reserved_for, None);
    s.step_done(1, 0.05, &[StepResult::new(1, 1)]).unwrap();
    s.arrive(RequestSpec::new(4, 0.0, 10.0, 10, 32)).unwrap();
    let d = s.schedule(0.2).unwrap();
    let waits: Vec<(u64, WaitReason)> = d.waiting.iter().map(|w| (w.request, w.reason)).collect();
    assert_eq!(
        waits,
        vec![
            (2, WaitReason::NoInstance),
            (3, WaitReason::NoInstance),
            (4, WaitReason::NoInstance)
        ]
    );
}

#[test]
fn home_busy_and_home_full_for_requests_that_must_stay() {
    let mut s = Scheduler::new(
        profile(),
        SchedulerConfig {
            max_batch_tokens: 180,
            policy: Policy::infaas_like(0.9),
            ..Default::default()
        },
    )
    .unwrap();
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 100, 64)).unwrap();
    s.schedule(0.0).unwrap();
    s.step_done(1, 0.05, &[StepResult::new(1, 1)]).unwrap();
    s.arrive(RequestSpec::new(2, 0.0, 10.0, 80, 64)).unwrap();
    // 1's cache step (32) and 2's recompute step (144) share the 180-token budget.
    let d = s.schedule(0.1).unwrap().clone();
    assert_eq!(batch_of(&d, 1).len(), 2);
    s.step_done(1, 0.05, &[StepResult::new(1, 31), StepResult::new(2, 1)])
        .unwrap();
    s.add_instance(instance(2, 1)).unwrap();
    // 1 needs a 164-token recompute step, 2 a cache step: 196 tokens. Without migration
    // 2 cannot use the idle instance 2.
    let d = s.schedule(0.2).unwrap().clone();
    assert_eq!(batch_of(&d, 1)[0].request, 1);
    assert!(batch_of(&d, 2).is_empty());
    assert_eq!(
        d.waiting,
        vec![Waiting {
            request: 2,
            reason: WaitReason::HomeFull
        }]
    );
    s.arrive(RequestSpec::new(3, 0.2, 10.0, 10, 32)).unwrap();
    let d = s.schedule(0.3).unwrap().clone();
    assert_eq!(
        d.waiting,
        vec![Waiting {
            request: 2,
            reason: WaitReason::HomeBusy
        }]
    );
    assert_eq!(
        batch_of(&d, 2)[0].request,
        3,
        "the idle instance takes the arrival"
    );
}

#[test]
fn baselines_keep_their_threshold_and_infaas_never_migrates() {
    for (policy, migrates) in [
        (Policy::infaas_like(0.7), false),
        (Policy::llumnix_like(0.7), true),
    ] {
        let mut s = scheduler(policy);
        s.add_instance(instance(1, 1)).unwrap();
        for id in 0..4 {
            s.arrive(RequestSpec::new(id, 0.0, 0.001, 1000, 64))
                .unwrap();
        }
        let d = s.schedule(0.0).unwrap().clone();
        assert!(d.entries.iter().all(|e| e.tau == 0.7));
        s.add_instance(instance(2, 1)).unwrap();
        s.step_done(1, 0.1, &results(&d.entries, 32)).unwrap();
        s.arrive(RequestSpec::new(9, 0.0, 0.001, 1000, 64)).unwrap();
        let d = s.schedule(0.1).unwrap().clone();
        assert!(d.entries.iter().all(|e| e.tau == 0.7));
        assert_eq!(!d.migrations.is_empty(), migrates, "{policy:?}");
    }
}

#[test]
fn window_load_control_lowers_later_requests_first() {
    let config = SchedulerConfig {
        slo_window_s: Some(4.5),
        policy: Policy::dilaserve().window_load_control(),
        ..Default::default()
    };
    let mut s = Scheduler::new(profile(), config).unwrap();
    s.add_instance(instance(1, 1)).unwrap();
    for id in 0..40 {
        s.arrive(RequestSpec::new(id, f64::from(id as u32), 1e6, 200, 256))
            .unwrap();
    }
    s.schedule(0.0).unwrap();
    let caps: Vec<f64> = (0..40).map(|id| s.request(id).unwrap().max_tau).collect();
    assert_eq!(caps[0], 0.9);
    assert_eq!(caps[39], 0.5);
    assert!(caps.windows(2).all(|w| w[0] >= w[1]), "{caps:?}");
    let dispatched = s.last_decisions().entries.clone();
    for e in dispatched {
        assert!(e.tau <= s.request(e.request).unwrap().max_tau);
    }
    // Without load control every request keeps its full set.
    let mut s = scheduler(Policy::dilaserve().without_load_control());
    s.add_instance(instance(1, 1)).unwrap();
    for id in 0..40 {
        s.arrive(RequestSpec::new(id, 0.0, 1e6, 200, 256)).unwrap();
    }
    s.schedule(0.0).unwrap();
    assert!((0..40).all(|id| s.request(id).unwrap().max_tau == 0.9));
}

#[test]
fn forecast_load_control_lowers_everyone_alike_and_counts_arrivals_to_come() {
    const N: usize = 8;
    let caps_after = |arrivals: &[f64]| {
        let config = SchedulerConfig {
            slo_window_s: Some(4.0),
            ..Default::default()
        };
        let mut s = Scheduler::new(profile(), config).unwrap();
        s.add_instance(instance(1, 1)).unwrap();
        for (id, &t) in arrivals.iter().enumerate() {
            s.arrive(RequestSpec::new(id as u64, t, 1e6, 200, 256))
                .unwrap();
        }
        let now = arrivals.last().copied().unwrap_or(0.0);
        s.schedule(now).unwrap();
        (0..arrivals.len() as u64)
            .map(|id| s.request(id).unwrap().max_tau)
            .collect::<Vec<f64>>()
    };
    // N requests at once: no rate is known beyond them, the level is shared.
    let burst = caps_after(&[0.0; N]);
    assert!(burst.windows(2).all(|w| w[0] >= w[1]), "{burst:?}");
    assert!(
        burst[0] - burst[N - 1] <= 0.1 + 1e-9,
        "one level apart at most: {burst:?}"
    );
    assert!(burst[N - 1] > 0.5, "{burst:?}");
    // N live requests again, after arrivals at N per second for a minute: the expected
    // arrivals take capacity, so every cap is lower.
    let steady: Vec<f64> = (0..60 * N).map(|i| i as f64 / N as f64).collect();
    let caps = caps_after(&steady);
    let last = &caps[caps.len() - N..];
    assert!(
        last.iter().zip(&burst).all(|(a, b)| a <= b),
        "{last:?} vs {burst:?}"
    );
    assert!(
        last.iter().zip(&burst).any(|(a, b)| a < b),
        "{last:?} vs {burst:?}"
    );
}

#[test]
fn every_dispatched_tau_is_explained() {
    let config = SchedulerConfig {
        slo_window_s: Some(4.0),
        ..Default::default()
    };
    let mut s = Scheduler::new(profile(), config).unwrap();
    s.add_instance(instance(1, 1)).unwrap();
    // Far deadlines, a burst that load control must cap, and one request already late.
    s.arrive(RequestSpec::new(99, 0.0, 1e-3, 10, 32)).unwrap();
    for id in 0..40 {
        s.arrive(RequestSpec::new(id, 0.0, 1e6, 200, 256)).unwrap();
    }
    let d = s.schedule(0.0).unwrap().clone();
    let why = |id| d.entries.iter().find(|e| e.request == id).unwrap().why;
    let late = why(99);
    assert_eq!(late.reason, ThresholdReason::Late);
    assert!(late.estimate_s > late.slo_left_s);
    for e in d.entries.iter().filter(|e| e.request != 99) {
        assert!(e.tau <= e.why.cap_tau + 1e-12, "{e:?}");
        assert!(e.why.estimate_s <= e.why.slo_left_s);
        let expected = if e.why.cap_tau < 0.9 {
            ThresholdReason::Capped
        } else {
            ThresholdReason::Fits
        };
        assert_eq!(e.why.reason, expected, "{e:?}");
    }
    assert!(d
        .entries
        .iter()
        .any(|e| e.why.reason == ThresholdReason::Capped));
    let mut fixed = scheduler(Policy::infaas_like(0.7));
    fixed.add_instance(instance(1, 1)).unwrap();
    fixed
        .arrive(RequestSpec::new(1, 0.0, 10.0, 10, 32))
        .unwrap();
    let e = fixed.schedule(0.0).unwrap().entries[0];
    assert_eq!(
        (e.why.reason, e.why.slo_left_s),
        (ThresholdReason::Fixed, 10.0)
    );
    assert!(e.why.estimate_s.is_nan() && e.why.cap_tau.is_nan());
}

#[test]
fn priority_order_serves_high_priority_first() {
    let config = SchedulerConfig {
        max_batch_tokens: 300,
        policy: Policy {
            load_order: LoadOrder::Priority,
            ..Policy::dilaserve()
        },
        ..Default::default()
    };
    let mut s = Scheduler::new(profile(), config).unwrap();
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 200, 32)).unwrap();
    let mut urgent = RequestSpec::new(2, 1.0, 10.0, 200, 32);
    urgent.priority = 3;
    s.arrive(urgent).unwrap();
    let d = s.schedule(1.0).unwrap();
    assert_eq!(d.entries[0].request, 2);
    assert_eq!(d.waiting[0].request, 1);
}

#[test]
fn one_shot_prediction_only_counts_steps_off() {
    let mut s = scheduler(Policy::dilaserve().one_shot());
    let mut online = scheduler(Policy::dilaserve());
    for sched in [&mut s, &mut online] {
        sched.add_instance(instance(1, 1)).unwrap();
        sched
            .arrive(RequestSpec::new(1, 0.0, 10.0, 10, 64))
            .unwrap();
        sched.schedule(0.0).unwrap();
        sched.step_done(1, 0.05, &[StepResult::new(1, 30)]).unwrap();
    }
    let first = s.request(1).unwrap().predictions[4];
    // Fresh at tau 0.9 (rate 3.25): 2 blocks x 10 steps; one recompute step counted off.
    assert_eq!(
        first,
        StepsLeft {
            cache: 18.0,
            recompute: 1.0
        }
    );
    // The online predictor sees only 2 masked tokens left in the block, and a request
    // that committed 30 tokens where the rates expected 3.2: at (30 + 32) / (3.2 + 32) =
    // 1.76 × the rate the next block takes 6 steps, not 10.
    assert_eq!(
        online.request(1).unwrap().predictions[4],
        StepsLeft {
            cache: 6.0,
            recompute: 1.0
        }
    );
}

#[test]
fn measured_step_time_corrects_the_profile() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 100, 64)).unwrap();
    let d = s.schedule(0.0).unwrap().clone();
    let predicted = d.batches[0].predicted_finish;
    s.step_done(1, predicted * 3.0, &[StepResult::new(1, 1)])
        .unwrap();
    let factor = s.instance(1).unwrap().factor;
    assert!((factor - 1.4).abs() < 1e-9, "{factor}");
    let d = s.schedule(1.0).unwrap();
    assert!(d.batches[0].predicted_finish > 1.0);
}

/// Runs a fixed event script and returns every round's decisions. Steps finish out of
/// order: an instance reports its step only every other round.
fn script(policy: Policy) -> Vec<Decisions> {
    let mut s = scheduler(policy);
    for (id, tp) in [(1, 1), (2, 2), (3, 4)] {
        s.add_instance(instance(id, tp)).unwrap();
    }
    let mut out = Vec::new();
    let mut running: Vec<(u64, Vec<StepResult>)> = Vec::new();
    let mut now = 0.0;
    for round in 0..40u64 {
        for j in 0..3 {
            let id = round * 3 + j;
            let prompt = 50 + 937 * j as u32;
            s.arrive(RequestSpec::new(id, now, now + 2.0 + j as f64, prompt, 96))
                .unwrap();
        }
        let d = s.schedule(now).unwrap().clone();
        for b in &d.batches {
            let res = d
                .entries_of(b)
                .iter()
                .map(|e| {
                    let info = s.request(e.request).unwrap();
                    let masked = info.block_length - info.unmasked_in_block;
                    StepResult::new(e.request, (1 + (e.request % 7) as u32).min(masked))
                })
                .collect();
            running.push((b.instance, res));
        }
        running.retain(|(inst, res)| {
            if (inst + round) % 2 == 0 {
                s.step_done(*inst, 0.03, res).unwrap();
                false
            } else {
                true
            }
        });
        if round == 10 {
            s.drain_instance(2).unwrap();
        }
        if round == 20 {
            s.remove_instance(2).unwrap();
            running.retain(|(inst, _)| *inst != 2);
        }
        out.push(d);
        now += 0.05;
    }
    out
}

#[test]
fn same_inputs_give_same_decisions() {
    // Admission off: the script's deadlines are tight enough to turn arrivals away.
    for policy in [
        Policy::dilaserve().without_admission(),
        Policy::llumnix_like(0.9),
    ] {
        let a = script(policy);
        let b = script(policy);
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            // Debug text: a decision's NaN fields (a fixed τ has no estimate) compare equal.
            assert_eq!(
                format!("{:?}", (&x.batches, &x.entries, &x.migrations, &x.waiting)),
                format!("{:?}", (&y.batches, &y.entries, &y.migrations, &y.waiting))
            );
        }
        assert!(a.iter().any(|d| !d.migrations.is_empty()));
    }
}

/// Under the exact cache and `policy`: `count` requests of `prompt` tokens (four 32-token
/// blocks out) on instance 1 finish their first block; then instance 2 joins. Returns the
/// decisions of the round where each opens its second block.
fn exact_block_opening_round(policy: Policy, prompt: u32, count: u64) -> Decisions {
    let mut s = exact_scheduler(policy);
    s.add_instance(instance(1, 1)).unwrap();
    for id in 0..count {
        s.arrive(RequestSpec::new(id, 0.0, 100.0, prompt, 128))
            .unwrap();
    }
    let d = s.schedule(0.0).unwrap().clone();
    assert_eq!(batch_of(&d, 1).len() as u64, count);
    s.step_done(1, 0.1, &results(&d.entries, 32)).unwrap();
    s.add_instance(instance(2, 1)).unwrap();
    s.schedule(0.1).unwrap().clone()
}

#[test]
fn under_the_exact_cache_a_block_moves_only_where_its_prefill_pays() {
    // Short prompts: the prefix prefill on the idle instance (96 tokens) beats waiting in
    // a home batch of 16 two-block cache steps (1024 tokens).
    let d = exact_block_opening_round(Policy::dilaserve(), 32, 16);
    assert!(
        !d.migrations.is_empty(),
        "no request took the idle instance"
    );
    let moved = batch_of(&d, 2);
    assert!(moved
        .iter()
        .all(|e| e.kind == StepKind::Recompute && e.new_here));
    assert!(moved.iter().all(|e| e.tokens == 32 + 64), "{moved:?}");
    let home = batch_of(&d, 1);
    assert!(
        home.iter()
            .all(|e| e.kind == StepKind::Cache && e.tokens == 64),
        "{home:?}"
    );
    // Long prompts: a 2,000-token prefill costs more than the two-block step at home.
    let d = exact_block_opening_round(Policy::dilaserve(), 2000, 4);
    assert!(d.migrations.is_empty(), "{:?}", d.migrations);
    assert!(batch_of(&d, 2).is_empty());
    // A least-loaded choice does not price the prefill: it keeps its requests' caches.
    let d = exact_block_opening_round(Policy::llumnix_like(0.9), 32, 16);
    assert!(d.migrations.is_empty(), "{:?}", d.migrations);
}

#[test]
fn a_stored_prefix_draws_a_request_to_the_instance_holding_it_at_its_shorter_step() {
    let mut s = exact_scheduler(Policy::dilaserve());
    s.add_instance(instance(2, 1)).unwrap();
    for id in 0..8 {
        s.arrive(RequestSpec::new(id, 0.0, 100.0, 32, 128)).unwrap();
    }
    let first = batch_of(&s.schedule(0.0).unwrap().clone(), 2);
    assert_eq!(first.len(), 8, "instance 2 is busy");
    s.add_instance(instance(1, 1)).unwrap();
    // Two requests with the same 4,000-token prompt; instance 2 holds its first 3,968.
    for id in [100, 101] {
        s.arrive(RequestSpec::new(id, 0.001, 100.0, 4000, 128))
            .unwrap();
    }
    let invalid = s.expect_prefix(100, 2, 3970);
    assert!(
        matches!(invalid, Err(SchedError::InvalidRequest { .. })),
        "not whole blocks"
    );
    s.expect_prefix(100, 2, 3968).unwrap();
    let d = s.schedule(0.001).unwrap().clone();
    // The one without a stored prefix prefills on the idle instance.
    let idle = batch_of(&d, 1);
    assert!(
        idle.iter().any(|e| e.request == 101 && e.tokens == 4032),
        "{idle:?}"
    );
    // The other waits for the busy one, where its first step feeds 64 tokens, not 4,032.
    assert!(!idle.iter().any(|e| e.request == 100), "{idle:?}");
    s.step_done(2, 0.05, &results(&first, 32)).unwrap();
    let d = s.schedule(0.05).unwrap().clone();
    let busy = batch_of(&d, 2);
    assert!(
        busy.iter().any(|e| e.request == 100 && e.tokens == 64),
        "{busy:?}"
    );
}
