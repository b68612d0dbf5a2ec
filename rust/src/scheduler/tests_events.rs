//! Scenario tests of the events an asyncio engine relies on: aborted steps, drained
//! instances, reused ids, confidence reports, admission, and what decisions and finished
//! requests carry.

use super::tests::{batch_of, instance, profile, results, scheduler};
use super::*;
use crate::profile::StepKind;

fn ids(entries: &[BatchEntry]) -> Vec<u64> {
    entries.iter().map(|e| e.request).collect()
}

#[test]
fn an_aborted_step_frees_its_requests_without_progress() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    for id in 1..=3 {
        s.arrive(RequestSpec::new(id, 0.0, 10.0, 10, 64)).unwrap();
    }
    let d = s.schedule(0.0).unwrap().clone();
    s.step_done(1, 0.05, &results(&d.entries, 1)).unwrap();
    let d = s.schedule(0.1).unwrap().clone();
    assert!(d.entries.iter().all(|e| e.kind == StepKind::Cache));
    s.cancel(3).unwrap();
    assert!(matches!(
        s.abort_step(9),
        Err(SchedError::UnknownInstance(9))
    ));
    assert_eq!(s.abort_step(1).unwrap(), &[1, 2]);
    assert!(matches!(
        s.abort_step(1),
        Err(SchedError::NoStepInFlight(1))
    ));
    let inst = s.instance(1).unwrap();
    assert!(inst.batch.is_empty() && inst.predicted_finish.is_none());
    assert_eq!(
        (inst.residents, inst.resident_tokens, inst.steps_run),
        (0, 0, 1)
    );
    for id in [1, 2] {
        let info = s.request(id).unwrap();
        assert_eq!(
            (info.in_flight, info.instance, info.next_kind),
            (false, None, StepKind::Recompute)
        );
        assert_eq!(
            (info.steps_done, info.unmasked),
            (1, 1),
            "no progress counted"
        );
    }
    // A report for the aborted step is no longer expected.
    assert!(matches!(
        s.step_done(1, 0.05, &results(&d.entries, 1)),
        Err(SchedError::NoStepInFlight(1))
    ));
    // Back on the same instance the state is resent, but that is no migration.
    let d = s.schedule(0.2).unwrap().clone();
    assert!(d.migrations.is_empty());
    assert!(d
        .entries
        .iter()
        .all(|e| e.new_here && e.kind == StepKind::Recompute));
    // Elsewhere it is a migration out of the failed instance.
    s.abort_step(1).unwrap();
    s.add_instance(instance(2, 1)).unwrap();
    s.drain_instance(1).unwrap();
    let d = s.schedule(0.3).unwrap();
    assert_eq!(d.migrations.len(), 2);
    assert!(d
        .migrations
        .iter()
        .all(|m| (m.from, m.to, m.reason) == (1, 2, MigrationReason::StepAborted)));
}

#[test]
fn drained_instances_are_idle_and_empty() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    s.add_instance(instance(2, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 10, 64)).unwrap();
    let d = s.schedule(0.0).unwrap().clone();
    let home = d.batches[0].instance;
    s.drain_instance(home).unwrap();
    s.drain_instance(3 - home).unwrap();
    assert_eq!(
        s.drained_instances(),
        vec![3 - home],
        "busy and holding a request"
    );
    s.step_done(home, 0.05, &results(&d.entries, 32)).unwrap();
    assert_eq!(
        s.drained_instances(),
        vec![3 - home],
        "still holds request 1"
    );
    s.undrain_instance(3 - home).unwrap();
    assert!(s.drained_instances().is_empty());
    // At its block boundary request 1 leaves for the undrained instance.
    let d = s.schedule(0.1).unwrap();
    assert_eq!(ids(&batch_of(d, 3 - home)), vec![1]);
    assert_eq!(s.drained_instances(), vec![home]);
    assert!(matches!(
        s.undrain_instance(7),
        Err(SchedError::UnknownInstance(7))
    ));
}

#[test]
fn a_reused_id_is_not_confused_with_its_cancelled_namesake() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(7, 0.0, 10.0, 10, 64)).unwrap();
    s.arrive(RequestSpec::new(8, 0.0, 10.0, 10, 64)).unwrap();
    let on_a = s.schedule(0.0).unwrap().clone();
    assert_eq!(ids(&on_a.entries), vec![7, 8]);
    s.cancel(7).unwrap();
    s.add_instance(instance(2, 1)).unwrap();
    s.arrive(RequestSpec::new(7, 0.1, 10.0, 10, 64)).unwrap();
    let on_b = s.schedule(0.1).unwrap().clone();
    assert_eq!(ids(&batch_of(&on_b, 2)), vec![7]);
    // Instance 1 still names the old 7; that result is ignored.
    s.step_done(1, 0.05, &results(&on_a.entries, 5)).unwrap();
    let new7 = s.request(7).unwrap();
    assert_eq!(
        (new7.in_flight, new7.steps_done, new7.instance),
        (true, 0, Some(2))
    );
    assert_eq!(s.request(8).unwrap().steps_done, 1);
    s.step_done(2, 0.05, &[StepResult::new(7, 3)]).unwrap();
    assert_eq!(s.request(7).unwrap().unmasked, 3);
}

#[test]
fn confidence_describes_the_current_block_only() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 10, 64)).unwrap();
    s.arrive(RequestSpec::new(2, 0.0, 10.0, 10, 64)).unwrap();
    s.schedule(0.0).unwrap();
    let conf = [0.1, 0.2, 0.4, 0.45, 0.7];
    let nan = [0.1, f64::NAN, 0.4, 0.45, f64::INFINITY];
    let report = [
        StepResult {
            confidence: Some(conf),
            ..StepResult::new(1, 4)
        },
        StepResult {
            confidence: Some(nan),
            ..StepResult::new(2, 4)
        },
    ];
    // A non-finite report drops that request's statistics, not the whole report.
    s.step_done(1, 0.05, &report).unwrap();
    assert_eq!(s.request(1).unwrap().confidence, Some(conf));
    assert_eq!(s.request(2).unwrap().confidence, None);
    s.schedule(0.1).unwrap();
    // Completing the block: the statistics describe a finished block and are dropped.
    let report = [
        StepResult {
            confidence: Some(conf),
            ..StepResult::new(1, 28)
        },
        StepResult {
            confidence: Some(conf),
            ..StepResult::new(2, 4)
        },
    ];
    s.step_done(1, 0.05, &report).unwrap();
    assert_eq!(s.request(1).unwrap().confidence, None);
    assert_eq!(s.request(2).unwrap().confidence, Some(conf));
}

#[test]
fn arrivals_past_max_queued_are_rejected_while_overloaded() {
    let config = SchedulerConfig {
        max_batch_tokens: 1000,
        slo_window_s: Some(0.01),
        max_queued: Some(2),
        policy: Policy::dilaserve().without_admission(),
        ..Default::default()
    };
    let mut s = Scheduler::new(profile(), config).unwrap();
    s.add_instance(instance(1, 1)).unwrap();
    for id in 0..3 {
        s.arrive(RequestSpec::new(id, 0.0, 10.0, 900, 64)).unwrap();
    }
    assert_eq!(s.queued_requests(), 3);
    assert!(!s.overloaded(), "no round has run yet");
    s.arrive(RequestSpec::new(3, 0.0, 10.0, 900, 64)).unwrap();
    let d = s.schedule(0.0).unwrap();
    assert!(d.overloaded && s.overloaded());
    assert_eq!(s.queued_requests(), 3, "one dispatched");
    let err = s
        .arrive(RequestSpec::new(4, 0.0, 10.0, 10, 32))
        .unwrap_err();
    assert!(
        matches!(
            err,
            SchedError::Admission {
                id: 4,
                queued: 3,
                max_queued: 2
            }
        ),
        "{err}"
    );
    assert_eq!(s.active_requests(), 4, "a rejected arrival leaves no trace");
    // Cancelling queued requests makes room.
    s.cancel(2).unwrap();
    s.cancel(3).unwrap();
    s.arrive(RequestSpec::new(4, 0.0, 10.0, 10, 32)).unwrap();
    // Without a bound nothing is rejected.
    let mut open = Scheduler::new(
        profile(),
        SchedulerConfig {
            max_queued: None,
            ..s.config().clone()
        },
    )
    .unwrap();
    open.add_instance(instance(1, 1)).unwrap();
    for id in 0..6 {
        open.arrive(RequestSpec::new(id, 0.0, 10.0, 900, 64))
            .unwrap();
        open.schedule(0.0).unwrap();
    }
    assert!(open.overloaded());
}

#[test]
fn a_late_request_still_runs_to_completion() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 0.05, 10, 64)).unwrap();
    let mut now = 0.0;
    let mut done = Vec::new();
    while done.is_empty() {
        let d = s.schedule(now).unwrap().clone();
        assert!(now < 5.0, "the request is never dropped");
        done = s
            .step_done(1, 0.1, &results(&d.entries, 4))
            .unwrap()
            .to_vec();
        now += 0.1;
    }
    let f = &done[0];
    assert_eq!((f.id, f.steps, f.deadline), (1, 16, 0.05));
    assert!(
        now > f.deadline,
        "finished after its deadline: the caller counts a miss"
    );
}

#[test]
fn entries_carry_step_tokens_and_block_position() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 100, 64)).unwrap();
    let d = s.schedule(0.0).unwrap().clone();
    let e = d.entries[0];
    assert_eq!((e.tokens, e.block, e.unmasked_in_block), (164, 0, 0));
    s.step_done(1, 0.05, &[StepResult::new(1, 5)]).unwrap();
    let e = s.schedule(0.1).unwrap().entries[0];
    assert_eq!(
        (e.kind, e.tokens, e.block, e.unmasked_in_block),
        (StepKind::Cache, 32, 0, 5)
    );
    s.step_done(1, 0.05, &[StepResult::new(1, 27)]).unwrap();
    let e = s.schedule(0.2).unwrap().entries[0];
    assert_eq!(
        (e.kind, e.tokens, e.block, e.unmasked_in_block),
        (StepKind::Recompute, 164, 1, 0)
    );
}

#[test]
fn finished_requests_carry_their_history() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.5, 10.0, 1900, 64)).unwrap();
    s.arrive(RequestSpec::new(2, 0.5, 10.0, 1900, 64)).unwrap();
    let d = s.schedule(1.0).unwrap().clone();
    s.step_done(1, 0.05, &results(&d.entries, 32)).unwrap();
    // A second instance: one request moves at its block boundary.
    s.add_instance(instance(2, 1)).unwrap();
    let d = s.schedule(1.1).unwrap().clone();
    assert_eq!(d.migrations.len(), 1);
    let moved = d.migrations[0].request;
    let mut finished = Vec::new();
    for b in &d.batches {
        let res = [StepResult::new(d.entries_of(b)[0].request, 2)];
        finished.extend(s.step_done(b.instance, 0.05, &res).unwrap().iter().cloned());
    }
    let mut now = 1.2;
    while s.active_requests() > 0 {
        let d = s.schedule(now).unwrap().clone();
        for b in &d.batches {
            let res = results(d.entries_of(b), 15);
            finished.extend(s.step_done(b.instance, 0.05, &res).unwrap().iter().cloned());
        }
        now += 0.1;
    }
    finished.sort_by_key(|f| f.id);
    for f in &finished {
        // 32 in one step, then 2 + 15 + 15.
        assert_eq!((f.steps, f.recompute_steps), (4, 2), "{f:?}");
        assert_eq!(f.taus.len(), 4);
        assert_eq!(
            (f.arrival, f.deadline, f.first_dispatch),
            (0.5, 10.0, Some(1.0))
        );
        if f.id == moved {
            assert_eq!((f.instances.clone(), f.migrations), (vec![1, 2], 1));
        } else {
            assert_eq!((f.instances.clone(), f.migrations), (vec![1], 0));
        }
    }
    assert_eq!(finished.len(), 2);
}
