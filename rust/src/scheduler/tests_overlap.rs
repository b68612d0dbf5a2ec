//! Scenario tests of overlap (`SchedulerConfig::overlap`): a step sent ahead of the one in
//! flight, its promotion when that one reports, and what a finish, a cancel, an abort or
//! a removed instance do to it.

use super::tests::{batch_of, instance, profile, results};
use super::*;
use crate::profile::StepKind;

fn overlapping() -> Scheduler {
    let config = SchedulerConfig {
        overlap: true,
        ..Default::default()
    };
    let mut s = Scheduler::new(profile(), config).unwrap();
    s.add_instance(instance(1, 1)).unwrap();
    s
}

/// Two requests of one 32-token block each, both dispatched (their first step in flight).
fn two_in_flight() -> Scheduler {
    let mut s = overlapping();
    for id in [1, 2] {
        s.arrive(RequestSpec::new(id, 0.0, 100.0, 16, 64)).unwrap();
    }
    let d = s.schedule(0.0).unwrap();
    assert_eq!(d.entries.len(), 2);
    assert!(d.entries.iter().all(|e| !e.ahead));
    s
}

#[test]
fn a_busy_instance_gets_one_step_ahead_of_its_continuing_requests() {
    let mut s = two_in_flight();
    let d = s.schedule(0.01).unwrap().clone();
    let ahead = batch_of(&d, 1);
    assert_eq!(ahead.iter().map(|e| e.request).collect::<Vec<_>>(), [1, 2]);
    assert!(ahead
        .iter()
        .all(|e| e.ahead && e.kind == StepKind::Cache && !e.new_here));
    let info = s.instance(1).unwrap();
    assert_eq!((info.batch.len(), info.ahead.len()), (2, 2));
    assert!(d.batches[0].predicted_finish > info.predicted_finish.unwrap());
    // Nothing more is sent while a step is queued behind the one in flight.
    assert!(s.schedule(0.02).unwrap().entries.is_empty());
}

#[test]
fn the_step_ahead_runs_next_with_its_own_threshold() {
    let mut s = two_in_flight();
    let first_tau = s.last_tau(1).unwrap();
    let d = s.schedule(0.01).unwrap().clone();
    let ahead_tau = batch_of(&d, 1)[0].tau;
    // The first step's report counts the first step's τ, then the step ahead is in flight.
    s.step_done(1, 0.05, &results(&batch_of(&d, 1), 2)).unwrap();
    let info = s.instance(1).unwrap();
    assert_eq!((info.batch.len(), info.ahead.len()), (2, 0));
    assert_eq!(s.last_tau(1).unwrap(), ahead_tau);
    assert_eq!(s.served_so_far(1).unwrap().taus, [first_tau]);
    s.step_done(1, 0.01, &results(&batch_of(&d, 1), 2)).unwrap();
    let served = s.served_so_far(1).unwrap();
    assert_eq!(served.taus, [first_tau, ahead_tau]);
    assert_eq!(s.request(1).unwrap().steps_done, 2);
    assert!(s.instance(1).unwrap().batch.is_empty());
}

#[test]
fn a_request_that_finishes_leaves_the_step_ahead() {
    let mut s = two_in_flight();
    s.schedule(0.01).unwrap();
    let first = [
        StepResult::new(1, 1),
        StepResult {
            finished: true,
            ..StepResult::new(2, 1)
        },
    ];
    let done: Vec<u64> = s
        .step_done(1, 0.05, &first)
        .unwrap()
        .iter()
        .map(|f| f.id)
        .collect();
    assert_eq!(done, [2]);
    assert_eq!(s.instance(1).unwrap().batch, [1]);
    // The worker skipped request 2's step ahead; a row for it anyway is ignored.
    let rows = [StepResult::new(1, 1), StepResult::new(2, 1)];
    s.step_done(1, 0.01, &rows).unwrap();
    assert_eq!(s.request(1).unwrap().steps_done, 2);
}

#[test]
fn a_cancel_reaches_both_steps() {
    let mut s = two_in_flight();
    s.schedule(0.01).unwrap();
    s.cancel(2).unwrap();
    let info = s.instance(1).unwrap();
    assert_eq!((info.batch, info.ahead), (vec![1], vec![1]));
    let rows = [StepResult::new(1, 1), StepResult::new(2, 1)];
    s.step_done(1, 0.05, &rows).unwrap();
    s.step_done(1, 0.01, &rows).unwrap();
    assert_eq!(s.request(1).unwrap().steps_done, 2);
}

#[test]
fn an_aborted_step_takes_the_step_ahead_with_it() {
    let mut s = two_in_flight();
    s.schedule(0.01).unwrap();
    let mut aborted = s.abort_step(1).unwrap().to_vec();
    aborted.sort_unstable();
    assert_eq!(aborted, [1, 2]);
    let info = s.instance(1).unwrap();
    assert!(info.batch.is_empty() && info.ahead.is_empty());
    let d = s.schedule(0.02).unwrap().clone();
    let again = batch_of(&d, 1);
    assert!(again
        .iter()
        .all(|e| !e.ahead && e.new_here && e.kind == StepKind::Recompute));
    assert_eq!(s.request(1).unwrap().steps_done, 0);
}

#[test]
fn a_removed_instance_frees_both_steps_requests() {
    let mut s = two_in_flight();
    s.add_instance(instance(2, 1)).unwrap();
    s.schedule(0.01).unwrap();
    s.remove_instance(1).unwrap();
    let d = s.schedule(0.02).unwrap().clone();
    assert_eq!(batch_of(&d, 2).len(), 2);
    assert!(batch_of(&d, 2).iter().all(|e| !e.ahead && e.new_here));
}

#[test]
fn a_request_likely_to_end_its_block_waits_for_the_report() {
    let mut s = overlapping();
    s.arrive(RequestSpec::new(1, 0.0, 100.0, 16, 32)).unwrap();
    s.arrive(RequestSpec::new(2, 0.0, 100.0, 16, 32)).unwrap();
    let d = s.schedule(0.0).unwrap().clone();
    // Request 1 commits 30 of its 32 positions: its next step likely ends the block.
    s.step_done(1, 0.05, &[StepResult::new(1, 30), StepResult::new(2, 1)])
        .unwrap();
    assert_eq!(d.entries.len(), 2);
    s.schedule(0.1).unwrap();
    let d = s.schedule(0.11).unwrap().clone();
    assert_eq!(
        batch_of(&d, 1)
            .iter()
            .map(|e| e.request)
            .collect::<Vec<_>>(),
        [2]
    );
}

#[test]
fn without_migration_a_request_likely_to_end_its_block_takes_its_recompute_step_ahead() {
    let config = SchedulerConfig {
        overlap: true,
        policy: Policy::infaas_like(0.9),
        ..Default::default()
    };
    let mut s = Scheduler::new(profile(), config).unwrap();
    s.add_instance(instance(1, 1)).unwrap();
    s.arrive(RequestSpec::new(1, 0.0, 100.0, 16, 64)).unwrap();
    s.schedule(0.0).unwrap();
    s.step_done(1, 0.05, &[StepResult::new(1, 30)]).unwrap();
    assert_eq!(s.schedule(0.1).unwrap().entries.len(), 1);
    // The step in flight likely ends the block; the request cannot move, so its next step
    // goes ahead, priced as the whole sequence's recompute step.
    let d = s.schedule(0.11).unwrap().clone();
    let ahead = batch_of(&d, 1);
    assert_eq!(ahead.len(), 1);
    assert!(ahead[0].ahead);
    assert_eq!(ahead[0].tokens, 16 + 64);
    // The block ends as expected: the step ahead ran as the next block's recompute step.
    s.step_done(1, 0.05, &[StepResult::new(1, 2)]).unwrap();
    s.step_done(1, 0.05, &[StepResult::new(1, 3)]).unwrap();
    let served = s.served_so_far(1).unwrap();
    assert_eq!((served.steps, served.recompute_steps), (3, 2));
}

#[test]
fn a_request_that_fills_a_block_a_step_gets_no_step_ahead_at_a_block_start() {
    let mut s = overlapping();
    s.arrive(RequestSpec::new(1, 0.0, 100.0, 16, 96)).unwrap();
    s.schedule(0.0).unwrap();
    // Its first step fills the whole block: every step of it likely opens a block next,
    // where it may migrate.
    s.step_done(1, 0.05, &[StepResult::new(1, 32)]).unwrap();
    assert_eq!(s.schedule(0.1).unwrap().entries.len(), 1);
    assert!(s.schedule(0.11).unwrap().entries.is_empty());
}

#[test]
fn a_draining_instance_gets_no_step_ahead() {
    let mut s = two_in_flight();
    s.drain_instance(1).unwrap();
    assert!(s.schedule(0.01).unwrap().entries.is_empty());
}

#[test]
fn overlap_off_sends_nothing_to_a_busy_instance() {
    let mut s = scheduler_without_overlap();
    for id in [1, 2] {
        s.arrive(RequestSpec::new(id, 0.0, 100.0, 16, 64)).unwrap();
    }
    assert_eq!(s.schedule(0.0).unwrap().entries.len(), 2);
    assert!(s.schedule(0.01).unwrap().entries.is_empty());
}

fn scheduler_without_overlap() -> Scheduler {
    let mut s = Scheduler::new(profile(), SchedulerConfig::default()).unwrap();
    s.add_instance(instance(1, 1)).unwrap();
    s
}
