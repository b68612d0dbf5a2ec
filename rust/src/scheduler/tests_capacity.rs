//! Scenario tests of per-instance capacity, completion-time instance choice with busy
//! instances, and reservations against starvation.

use super::tests::{batch_of, exact_scheduler, instance, profile, results, scheduler};
use super::*;
use crate::profile::StepKind;

fn limited(id: u64, kv: Option<u64>, reqs: Option<u32>, batch: Option<u64>) -> InstanceSpec {
    InstanceSpec {
        kv_tokens: kv,
        max_requests: reqs,
        max_batch_tokens: batch,
        ..instance(id, 1)
    }
}

fn ids(entries: &[BatchEntry]) -> Vec<u64> {
    entries.iter().map(|e| e.request).collect()
}

#[test]
fn placement_respects_resident_and_batch_capacity() {
    let mut s = scheduler(Policy::dilaserve());
    // Instance 1: room for one 300-token sequence by KV; 2: one request; 3: 200-token steps.
    s.add_instance(limited(1, Some(500), None, None)).unwrap();
    s.add_instance(limited(2, None, Some(1), None)).unwrap();
    s.add_instance(limited(3, None, None, Some(200))).unwrap();
    for id in 0..4 {
        s.arrive(RequestSpec::new(id, 0.0, 100.0, 268, 32)).unwrap();
    }
    let d = s.schedule(0.0).unwrap().clone();
    assert_eq!(batch_of(&d, 1).len(), 1);
    assert_eq!(batch_of(&d, 2).len(), 1);
    assert!(
        batch_of(&d, 3).is_empty(),
        "a 300-token step exceeds its budget"
    );
    assert_eq!(d.waiting.len(), 2);
    for id in 1..=3 {
        let info = s.instance(id).unwrap();
        assert!(info.kv_tokens.is_none_or(|kv| info.resident_tokens <= kv));
        assert!(info.max_requests.is_none_or(|m| info.residents <= m));
        assert!(info.batch_tokens <= info.max_batch_tokens);
    }
    let info = s.instance(3).unwrap();
    assert_eq!(
        (info.kv_tokens, info.max_requests, info.max_batch_tokens),
        (None, None, 200)
    );
    assert_eq!(s.instance(1).unwrap().max_batch_tokens, 8192);
}

#[test]
fn a_request_no_instance_can_hold_waits_with_a_reason() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(limited(1, Some(200), None, None)).unwrap();
    s.add_instance(limited(2, None, None, Some(250))).unwrap();
    // Fits the scheduler's budget, so it arrives; but 1 cannot hold it and 2 cannot step it.
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 268, 32)).unwrap();
    let d = s.schedule(0.0).unwrap();
    assert!(d.batches.is_empty());
    assert_eq!(d.waiting[0].reason, WaitReason::NoRoom);
    s.drain_instance(2).unwrap();
    let d = s.schedule(0.1).unwrap();
    assert_eq!(d.waiting[0].reason, WaitReason::NoKvRoom);
    assert_eq!(
        s.instance(1).unwrap().reserved_for,
        None,
        "it could never fit"
    );
}

#[test]
fn a_request_longer_than_every_kv_cache_is_refused_not_left_waiting() {
    let mut s = scheduler(Policy::dilaserve());
    // No instance yet: nothing to judge by, so it waits for one.
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 268, 32)).unwrap();
    s.add_instance(limited(1, Some(200), None, None)).unwrap();
    s.add_instance(limited(2, Some(250), None, None)).unwrap();
    let r = s.arrive(RequestSpec::new(2, 0.0, 10.0, 268, 32));
    assert!(
        matches!(
            r,
            Err(SchedError::ExceedsKvCache {
                id: 2,
                tokens: 300,
                max: 250
            })
        ),
        "{r:?}"
    );
    s.arrive(RequestSpec::new(3, 0.0, 10.0, 218, 32)).unwrap();
    // An instance without a KV limit could hold anything.
    s.add_instance(limited(3, None, None, None)).unwrap();
    s.arrive(RequestSpec::new(4, 0.0, 10.0, 268, 32)).unwrap();
}

#[test]
fn no_kv_room_when_every_instance_is_full_of_residents() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(limited(1, Some(700), None, None)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 368, 32)).unwrap();
    s.arrive(RequestSpec::new(2, 0.0, 10.0, 368, 32)).unwrap();
    let d = s.schedule(0.0).unwrap().clone();
    assert_eq!(ids(&batch_of(&d, 1)), vec![1]);
    assert_eq!(
        d.waiting,
        vec![Waiting {
            request: 2,
            reason: WaitReason::NoKvRoom
        }]
    );
    assert_eq!(s.instance(1).unwrap().reserved_for, Some(2));
    // Request 1 finishes: its KV frees and 2 goes there.
    s.step_done(1, 0.05, &results(&d.entries, 32)).unwrap();
    let d = s.schedule(0.1).unwrap();
    assert_eq!(ids(&batch_of(d, 1)), vec![2]);
    assert_eq!(s.instance(1).unwrap().reserved_for, None);
}

#[test]
fn a_busy_instance_that_completes_first_is_waited_for() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(4, 4)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 100.0, 10, 32)).unwrap();
    s.schedule(0.0).unwrap();
    s.add_instance(instance(1, 1)).unwrap();
    for id in 2..8 {
        s.arrive(RequestSpec::new(id, 0.0, 100.0, 1968, 32))
            .unwrap();
    }
    let d = s.schedule(0.0).unwrap().clone();
    // TP4 steps cost 45 %: finishing the tiny step first still beats starting on TP1 now.
    assert_eq!(
        d.waiting[0],
        Waiting {
            request: 2,
            reason: WaitReason::QueuedBusy
        }
    );
    // Queued tokens load the busy instance, so later requests start on TP1 instead.
    let on_tp1 = ids(&batch_of(&d, 1));
    assert!(!on_tp1.is_empty() && !on_tp1.contains(&2), "{on_tp1:?}");
    let queued = d
        .waiting
        .iter()
        .filter(|w| w.reason == WaitReason::QueuedBusy)
        .count();
    assert_eq!(queued + on_tp1.len(), 6);
    assert_eq!(
        s.request(2).unwrap().instance,
        None,
        "queued requests stay put"
    );
    // Once the TP4 step is reported, the queued request runs there.
    s.step_done(4, 0.01, &[StepResult::new(1, 32)]).unwrap();
    let d = s.schedule(0.02).unwrap();
    assert!(ids(&batch_of(d, 4)).contains(&2));
}

#[test]
fn least_loaded_counts_resident_load() {
    let mut s = scheduler(Policy::llumnix_like(0.9));
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 1.0, 100.0, 1000, 64)).unwrap();
    let d = s.schedule(1.0).unwrap().clone();
    s.step_done(1, 0.05, &results(&d.entries, 32)).unwrap();
    s.add_instance(instance(2, 1)).unwrap();
    // Arrives earlier, so it is placed first: instance 1 holds request 1's 1064 tokens.
    s.arrive(RequestSpec::new(2, 0.0, 100.0, 10, 32)).unwrap();
    let d = s.schedule(1.1).unwrap();
    assert_eq!(ids(&batch_of(d, 2)), vec![2]);
    assert_eq!(
        ids(&batch_of(d, 1)),
        vec![1],
        "its own tokens do not push it away"
    );
    assert!(d.migrations.is_empty());
}

/// Runs a stream of small requests (one new each round) beside one large request on a
/// single instance whose capacity is set by `spec`; returns rounds until the large one is
/// dispatched.
fn rounds_until_large_runs(spec: InstanceSpec, max_batch_tokens: u64) -> Option<u32> {
    let config = SchedulerConfig {
        max_batch_tokens,
        ..Default::default()
    };
    let mut s = Scheduler::new(profile(), config).unwrap();
    s.add_instance(spec).unwrap();
    let mut now = 0.0;
    let mut next = 10;
    for round in 0..400u32 {
        for _ in 0..2 {
            s.arrive(RequestSpec::new(next, now, now + 50.0, 68, 64))
                .unwrap();
            next += 1;
        }
        if round == 3 {
            s.arrive(RequestSpec::new(1, now, now + 50.0, 868, 32))
                .unwrap();
        }
        let d = s.schedule(now).unwrap().clone();
        if d.entries.iter().any(|e| e.request == 1) {
            return Some(round - 3);
        }
        for b in &d.batches {
            let res: Vec<StepResult> = d
                .entries_of(b)
                .iter()
                .map(|e| {
                    let info = s.request(e.request).unwrap();
                    StepResult::new(e.request, 4.min(info.block_length - info.unmasked_in_block))
                })
                .collect();
            s.step_done(b.instance, 0.05, &res).unwrap();
        }
        now += 0.05;
    }
    None
}

#[test]
fn small_requests_never_starve_a_large_one() {
    // KV room for 1000 tokens: the large request needs it nearly all.
    let kv = rounds_until_large_runs(limited(1, Some(1000), None, None), 8192);
    assert!(kv.is_some_and(|r| r <= 40), "KV-bound: {kv:?}");
    // A 1000-token batch budget: its recompute step needs all but 100 tokens.
    let batch = rounds_until_large_runs(instance(1, 1), 1000);
    assert!(batch.is_some_and(|r| r <= 40), "batch-bound: {batch:?}");
}

#[test]
fn reservation_picks_the_instance_that_frees_first() {
    let mut s = scheduler(Policy::dilaserve().without_load_control());
    s.add_instance(limited(1, Some(1000), None, None)).unwrap();
    s.add_instance(limited(2, Some(1000), None, None)).unwrap();
    // A long request on one instance and a short one on the other.
    s.arrive(RequestSpec::new(1, 0.0, 100.0, 468, 512)).unwrap();
    s.arrive(RequestSpec::new(2, 0.0, 100.0, 468, 32)).unwrap();
    let d = s.schedule(0.0).unwrap().clone();
    let on = |id| {
        d.batches
            .iter()
            .find(|b| d.entries_of(b).iter().any(|e| e.request == id))
            .map(|b| b.instance)
    };
    let short_on = on(2).unwrap();
    assert_ne!(on(1), Some(short_on));
    // 600 tokens fit neither (20 and 500 tokens of KV room); the short request leaves first.
    s.arrive(RequestSpec::new(3, 0.0, 100.0, 568, 32)).unwrap();
    let d = s.schedule(0.0).unwrap();
    assert_eq!(
        d.waiting,
        vec![Waiting {
            request: 3,
            reason: WaitReason::NoKvRoom
        }]
    );
    assert_eq!(s.instance(short_on).unwrap().reserved_for, Some(3));
    // The reserved instance takes no other new request meanwhile, though it has room.
    s.arrive(RequestSpec::new(4, 0.0, 100.0, 10, 22)).unwrap();
    s.step_done(short_on, 0.01, &[StepResult::new(2, 1)])
        .unwrap();
    let d = s.schedule(0.01).unwrap();
    assert_eq!(ids(&batch_of(d, short_on)), vec![2]);
    assert_eq!(batch_of(d, short_on)[0].kind, StepKind::Cache);
    let waits: Vec<(u64, WaitReason)> = d.waiting.iter().map(|w| (w.request, w.reason)).collect();
    assert_eq!(
        waits,
        vec![(3, WaitReason::NoKvRoom), (4, WaitReason::NoRoom)]
    );
    // Request 2 finishes: 3 takes the instance and the reservation ends.
    s.step_done(short_on, 0.01, &[StepResult::new(2, 31)])
        .unwrap();
    let d = s.schedule(0.02).unwrap();
    assert_eq!(ids(&batch_of(d, short_on)), vec![3, 4]);
    assert_eq!(s.instance(short_on).unwrap().reserved_for, None);
}

#[test]
fn requests_reading_one_stored_prefix_are_admitted_counting_it_once() {
    let mut s = exact_scheduler(Policy::dilaserve());
    s.add_instance(limited(1, Some(1500), None, None)).unwrap();
    // 448-token sequences whose prompts open with the same 12 blocks (384 tokens). The
    // first stores them with its first step; the next two arrive after it and read them.
    let arrive = |s: &mut Scheduler, id: u64, at: f64| {
        s.arrive(RequestSpec::new(id, at, 100.0, 416, 32)).unwrap();
    };
    arrive(&mut s, 1, 0.0);
    let d = s.schedule(0.0).unwrap().clone();
    s.step_done(1, 0.05, &results(&batch_of(&d, 1), 4)).unwrap();
    arrive(&mut s, 2, 0.05);
    arrive(&mut s, 3, 0.05);
    let d = s.schedule(0.05).unwrap().clone();
    assert_eq!(ids(&batch_of(&d, 1)), [1, 2, 3]);
    // Whole sequences until their worker reports what they read.
    assert_eq!(s.instance(1).unwrap().kv_used_tokens, 3 * 448);
    for id in [2, 3] {
        s.read_prefix(1, id, (1..=12).collect()).unwrap();
    }
    // Request 1's extent, the 12 stored blocks once, the other two's 64 own tokens.
    assert_eq!(s.instance(1).unwrap().kv_used_tokens, 448 + 384 + 2 * 64);
    s.step_done(1, 0.1, &results(&batch_of(&d, 1), 4)).unwrap();
    // Reads are taken only with the step that took a request in: request 1 is resident,
    // but no step of it is in flight.
    s.read_prefix(1, 1, (1..=12).collect()).unwrap();
    assert_eq!(s.instance(1).unwrap().kv_used_tokens, 448 + 384 + 2 * 64);
    // A fourth fits now: 960 + 448 ≤ 1,500, where whole sequences (1,792) would not.
    arrive(&mut s, 4, 0.1);
    let d = s.schedule(0.1).unwrap().clone();
    assert!(ids(&batch_of(&d, 1)).contains(&4), "{:?}", d.waiting);
    // Reports that cannot be right are refused; one for a request that left is ignored.
    let twice = s.read_prefix(1, 4, vec![5, 5]);
    assert!(matches!(twice, Err(SchedError::BadStepReport { .. })));
    let too_many = s.read_prefix(1, 4, (1..=14).collect());
    assert!(matches!(too_many, Err(SchedError::BadStepReport { .. })));
    s.read_prefix(1, 99, vec![1]).unwrap();
    assert_eq!(s.instance(1).unwrap().kv_used_tokens, 960 + 448);
}

/// Instance 1 (`kv` tokens) takes `residents` (prompt, output; ids from 1) in one round;
/// requests 1 and 2 report reading the 12 blocks of one stored 384-token system prompt,
/// which leaves instance 1 charging `kv_used`. Instance 2 (1,000 tokens) joins and takes
/// the next request (384 + `other_output` tokens, too large for instance 1's room); then a
/// 700-token request arrives that fits neither and waits for KV room. Returns the scheduler
/// and the waiting request's id.
fn reservation_behind_a_shared_prompt(
    kv: u64,
    residents: &[(u32, u32)],
    kv_used: u64,
    other_output: u32,
) -> (Scheduler, u64) {
    let mut s = exact_scheduler(Policy::dilaserve().without_load_control());
    s.add_instance(limited(1, Some(kv), None, None)).unwrap();
    let ids_here: Vec<u64> = (1..=residents.len() as u64).collect();
    for (&id, &(prompt, output)) in ids_here.iter().zip(residents) {
        s.arrive(RequestSpec::new(id, 0.0, 100.0, prompt, output))
            .unwrap();
    }
    let d = s.schedule(0.0).unwrap().clone();
    assert_eq!(ids(&batch_of(&d, 1)), ids_here);
    for id in [1, 2] {
        s.read_prefix(1, id, (1..=12).collect()).unwrap();
    }
    s.step_done(1, 0.05, &results(&batch_of(&d, 1), 1)).unwrap();
    assert_eq!(s.instance(1).unwrap().kv_used_tokens, kv_used);
    let other = residents.len() as u64 + 1;
    s.arrive(RequestSpec::new(other, 0.05, 100.0, 384, other_output))
        .unwrap();
    s.add_instance(limited(2, Some(1000), None, None)).unwrap();
    let d = s.schedule(0.05).unwrap().clone();
    assert_eq!(ids(&batch_of(&d, 2)), [other]);
    let waiter = other + 1;
    s.arrive(RequestSpec::new(waiter, 0.05, 100.0, 636, 64))
        .unwrap();
    let d = s.schedule(0.05).unwrap();
    assert_eq!(
        d.waiting,
        vec![Waiting {
            request: waiter,
            reason: WaitReason::NoKvRoom
        }]
    );
    (s, waiter)
}

#[test]
fn a_reservation_counts_a_leaving_reader_free_only_of_what_no_one_else_reads() {
    // Two readers, a short answer and a long one (both fit as whole sequences, until their
    // reports); a 512-token request on instance 2. The 700-token request fits neither (428
    // and 488 tokens of room). Request 1 leaves first but frees only its own 32 tokens,
    // since request 2 still reads the prompt: instance 1 fits only once request 2 leaves
    // too, after request 3 has left instance 2.
    let (s, waiter) =
        reservation_behind_a_shared_prompt(1100, &[(384, 32), (384, 256)], 32 + 256 + 384, 128);
    assert_eq!(s.instance(2).unwrap().reserved_for, Some(waiter));
    assert_eq!(s.instance(1).unwrap().reserved_for, None);
}

#[test]
fn a_reservation_expects_a_shared_prompt_freed_when_its_last_reader_leaves() {
    // Two readers, a short and a longer answer, and a long request that reads nothing; a
    // 576-token request on instance 2 (422 tokens of room on instance 1). The 700-token
    // request fits neither (422 and 424 tokens of room). On instance 1 the prompt frees
    // with request 2, its last reader, long before request 3 or 4 finishes.
    let (s, waiter) = reservation_behind_a_shared_prompt(
        1450,
        &[(384, 32), (384, 64), (100, 448)],
        32 + 64 + 384 + 548,
        192,
    );
    assert_eq!(s.instance(1).unwrap().reserved_for, Some(waiter));
    assert_eq!(s.instance(2).unwrap().reserved_for, None);
}
