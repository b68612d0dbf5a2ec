//! Scenario tests of request and instance lifecycles: step reports, finishing, cancelling,
//! draining and removing instances, and rejected events.

use super::tests::{batch_of, instance, profile, results, scheduler};
use super::*;
use crate::profile::{LatencyProfile, ProfileError, StepKind};

#[test]
fn step_reports_are_checked_before_anything_changes() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    s.add_instance(instance(2, 1)).unwrap();
    assert!(matches!(
        s.step_done(1, 0.1, &[]),
        Err(SchedError::NoStepInFlight(1))
    ));
    for id in 0..2 {
        s.arrive(RequestSpec::new(id, 0.0, 10.0, 4000, 32)).unwrap();
    }
    let d = s.schedule(0.0).unwrap().clone();
    let (a, b) = (d.batches[0].instance, d.batches[1].instance);
    let on_a = batch_of(&d, a)[0].request;
    let on_b = batch_of(&d, b)[0].request;
    let bad = [
        vec![],
        vec![StepResult::new(on_a, 1), StepResult::new(on_a, 1)],
        vec![StepResult::new(on_b, 1)],
        vec![StepResult::new(on_a, 0)],
        vec![StepResult::new(on_a, 33)],
    ];
    for report in bad {
        assert!(matches!(
            s.step_done(a, 0.1, &report),
            Err(SchedError::BadStepReport { .. })
        ));
    }
    assert!(matches!(
        s.step_done(a, f64::NAN, &[StepResult::new(on_a, 1)]),
        Err(SchedError::BadStepReport { .. })
    ));
    assert!(matches!(
        s.step_done(a, 0.1, &[StepResult::new(99, 1)]),
        Err(SchedError::UnknownRequest(99))
    ));
    assert!(matches!(
        s.step_done(42, 0.1, &[]),
        Err(SchedError::UnknownInstance(42))
    ));
    assert_eq!(s.request(on_a).unwrap().steps_done, 0);
    s.step_done(a, 0.1, &[StepResult::new(on_a, 3)]).unwrap();
    let info = s.request(on_a).unwrap();
    assert_eq!(
        (info.steps_done, info.unmasked, info.next_kind),
        (1, 3, StepKind::Cache)
    );
}

#[test]
fn requests_finish_and_release_their_instance() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 10, 40)).unwrap();
    assert_eq!(s.request(1).unwrap().output_len, 64);
    let mut now = 0.0;
    let mut finished = Vec::new();
    for _ in 0..10 {
        let d = s.schedule(now).unwrap().clone();
        now += 0.1;
        if d.entries.is_empty() {
            break;
        }
        finished = s
            .step_done(1, 0.05, &results(&d.entries, 16))
            .unwrap()
            .iter()
            .map(|f| f.id)
            .collect();
    }
    assert_eq!(finished, vec![1]);
    assert_eq!(s.active_requests(), 0);
    assert!(matches!(s.request(1), Err(SchedError::UnknownRequest(1))));
    let inst = s.instance(1).unwrap();
    assert_eq!(
        (inst.residents, inst.resident_tokens, inst.steps_run),
        (0, 0, 4)
    );
}

#[test]
fn early_end_of_sequence_finishes_a_request() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 10, 256)).unwrap();
    s.schedule(0.0).unwrap();
    let eos = StepResult {
        finished: true,
        ..StepResult::new(1, 5)
    };
    let done = s.step_done(1, 0.05, &[eos]).unwrap();
    assert_eq!(done.iter().map(|f| f.id).collect::<Vec<_>>(), vec![1]);
    assert_eq!(s.active_requests(), 0);
}

#[test]
fn cancelled_requests_leave_cleanly_even_in_flight() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    for id in 0..3 {
        s.arrive(RequestSpec::new(id, 0.0, 10.0, 10, 64)).unwrap();
    }
    s.cancel(2).unwrap();
    let d = s.schedule(0.0).unwrap().clone();
    assert_eq!(d.entries.len(), 2);
    s.cancel(1).unwrap();
    assert!(matches!(s.cancel(1), Err(SchedError::UnknownRequest(1))));
    assert_eq!(s.instance(1).unwrap().batch, vec![0]);
    // The worker still reports the cancelled request; its result is ignored.
    s.step_done(1, 0.05, &results(&d.entries, 1)).unwrap();
    // Reusing the freed ids and slots works.
    s.arrive(RequestSpec::new(1, 0.2, 10.0, 10, 64)).unwrap();
    s.arrive(RequestSpec::new(2, 0.2, 10.0, 10, 64)).unwrap();
    let d = s.schedule(0.3).unwrap();
    let mut ids: Vec<u64> = d.entries.iter().map(|e| e.request).collect();
    ids.sort_unstable();
    assert_eq!(ids, vec![0, 1, 2]);
    assert_eq!(s.instance(1).unwrap().residents, 3);
}

#[test]
fn removed_instance_displaces_its_requests() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 10, 64)).unwrap();
    s.arrive(RequestSpec::new(2, 0.0, 10.0, 10, 64)).unwrap();
    let d = s.schedule(0.0).unwrap().clone();
    s.step_done(1, 0.05, &results(&d.entries, 1)).unwrap();
    s.schedule(0.1).unwrap();
    s.add_instance(instance(2, 2)).unwrap();
    s.remove_instance(1).unwrap();
    assert!(matches!(s.instance(1), Err(SchedError::UnknownInstance(1))));
    let info = s.request(1).unwrap();
    assert_eq!(
        (info.instance, info.next_kind, info.in_flight),
        (None, StepKind::Recompute, false)
    );
    assert_eq!(
        info.predictions[0].recompute, 2.0,
        "the lost cache costs a recompute step"
    );
    let d = s.schedule(0.2).unwrap();
    assert_eq!(d.migrations.len(), 2);
    assert!(d
        .migrations
        .iter()
        .all(|m| m.from == 1 && m.to == 2 && m.reason == MigrationReason::InstanceRemoved));
    assert!(d
        .entries
        .iter()
        .all(|e| e.new_here && e.kind == StepKind::Recompute));
    // The freed GPU can be announced again.
    s.add_instance(instance(3, 1)).unwrap();
}

#[test]
fn draining_moves_requests_at_block_boundaries_only() {
    let mut s = scheduler(Policy::dilaserve());
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 10.0, 10, 64)).unwrap();
    s.arrive(RequestSpec::new(2, 0.0, 10.0, 10, 64)).unwrap();
    s.schedule(0.0).unwrap();
    s.step_done(1, 0.05, &[StepResult::new(1, 32), StepResult::new(2, 1)])
        .unwrap();
    s.add_instance(instance(2, 1)).unwrap();
    s.drain_instance(1).unwrap();
    let d = s.schedule(0.1).unwrap();
    assert_eq!(
        d.migrations,
        vec![Migration {
            request: 1,
            from: 1,
            to: 2,
            reason: MigrationReason::Draining
        }]
    );
    assert_eq!(batch_of(d, 1)[0].request, 2);
    assert_eq!(batch_of(d, 1)[0].kind, StepKind::Cache);
}

#[test]
fn bad_events_are_typed_errors() {
    let mut s = scheduler(Policy::dilaserve());
    let only_tp1 = LatencyProfile::from_tables([
        (1, StepKind::Recompute, vec![(1, 0.1)]),
        (1, StepKind::Cache, vec![(1, 0.1)]),
    ])
    .unwrap();
    let mut narrow = Scheduler::new(only_tp1, SchedulerConfig::default()).unwrap();
    assert!(matches!(
        narrow.add_instance(instance(1, 2)),
        Err(SchedError::Profile(ProfileError::MissingDegree {
            tp: 2,
            ..
        }))
    ));
    s.arrive(RequestSpec::new(1, 0.0, 1.0, 1, 1)).unwrap();
    assert!(matches!(
        s.arrive(RequestSpec::new(1, 0.0, 1.0, 1, 1)),
        Err(SchedError::DuplicateRequest(1))
    ));
    assert!(matches!(
        s.schedule(f64::INFINITY),
        Err(SchedError::BadTime(_))
    ));
    assert!(matches!(
        s.drain_instance(3),
        Err(SchedError::UnknownInstance(3))
    ));
    assert!(matches!(
        s.remove_instance(3),
        Err(SchedError::UnknownInstance(3))
    ));
    assert!(matches!(s.request(5), Err(SchedError::UnknownRequest(5))));
    assert!(Scheduler::new(
        profile(),
        SchedulerConfig {
            thresholds: vec![],
            ..Default::default()
        }
    )
    .is_err());
}
