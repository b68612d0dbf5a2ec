//! Stage 1 in each load regime, the adoption rule and the time-limit fallback.

use std::time::Instant;

use super::super::capacity::node_types;
use super::super::inputs::{validate, Deployment, Instance};
use super::super::solver::{SolveSettings, SolveStatus};
use super::super::stage1::{Stage1, Warm};
use super::super::{plan, plan_capacity, PlannerError, PlannerInputs};
use super::{class, default_solver, inputs, profile};

fn cluster(rate: f64) -> PlannerInputs {
    inputs(
        vec![class(200.0, 256.0, rate), class(800.0, 128.0, rate / 2.0)],
        vec![4, 4],
        vec![1, 2, 4],
        vec![1024, 4096, 16384],
        20.0,
    )
}

#[test]
fn light_load_runs_every_class_at_the_top_threshold_on_the_fastest_instances() {
    let plan = plan_capacity(&cluster(0.05), &profile()).unwrap();
    assert!(!plan.overloaded);
    assert!((plan.value.quality - 0.9).abs() < 1e-6);
    for c in &plan.classes {
        assert!((c.threshold_mix[2] - 1.0).abs() < 1e-6, "{c:?}");
        // Slack decides: every step on TP-4 at the smallest batch, the lowest step latency.
        assert!((c.degree_share[2] - 1.0).abs() < 1e-6, "{c:?}");
    }
    assert_eq!(plan.degrees[2].batch_tokens, Some(1024));
    // The same inputs give the same plan.
    assert_eq!(plan, plan_capacity(&cluster(0.05), &profile()).unwrap());
}

#[test]
fn loaded_cluster_lowers_thresholds_within_the_slo() {
    let plan = plan_capacity(&cluster(6.0), &profile()).unwrap();
    assert!(!plan.overloaded, "{plan:#?}");
    assert!(
        plan.value.quality < 0.9 - 1e-3,
        "thresholds must drop: {}",
        plan.value.quality
    );
    assert!(
        plan.value.quality > 0.7 + 1e-3,
        "but not to the floor: {}",
        plan.value.quality
    );
    for c in &plan.classes {
        assert!(c.latency_seconds <= 20.0 + 1e-6);
        let shares: f64 = c.threshold_mix.iter().sum();
        assert!((shares - 1.0).abs() < 1e-6);
    }
    for d in &plan.degrees {
        assert!(d.utilisation <= 1.0 + 1e-6);
    }
    for (node, counts) in plan.instances_per_node.iter().enumerate() {
        let gpus: u32 = counts.iter().zip([1, 2, 4]).map(|(c, d)| c * d).sum();
        assert!(gpus <= 4, "node {node} over-subscribed: {counts:?}");
    }
}

#[test]
fn overload_serves_the_most_load_at_the_lowest_threshold() {
    let plan = plan_capacity(&cluster(50.0), &profile()).unwrap();
    assert!(plan.overloaded);
    assert!(plan.value.sustained_load > 0.0 && plan.value.sustained_load < 1.0);
    for c in &plan.classes {
        assert!((c.threshold_mix[0] - 1.0).abs() < 1e-9);
        assert!(c.latency_seconds <= 20.0 + 1e-6);
    }
    // Half the load is sustainable: doubling the rate halves the served share.
    let half = plan_capacity(&cluster(100.0), &profile()).unwrap();
    let ratio = half.value.sustained_load / plan.value.sustained_load;
    assert!((ratio - 0.5).abs() < 1e-4, "{ratio}");
}

#[test]
fn a_class_no_instance_can_serve_in_time_pins_only_itself_to_the_lowest_threshold() {
    let mut i = cluster(0.05);
    i.classes.push(class(100.0, 12_000.0, 0.001));
    let plan = plan_capacity(&i, &profile()).unwrap();
    assert!(!plan.overloaded, "{plan:#?}");
    assert!((plan.value.sustained_load - 1.0).abs() < 1e-9);
    assert!(!plan.classes[2].slo_reachable);
    assert!((plan.classes[2].threshold_mix[0] - 1.0).abs() < 1e-9);
    for c in &plan.classes[..2] {
        assert!(c.slo_reachable);
        assert!((c.mean_threshold - 0.9).abs() < 1e-6, "{c:?}");
        assert!(c.latency_seconds <= 20.0 + 1e-6);
    }
}

#[test]
fn a_batch_smaller_than_a_class_step_is_not_a_choice_for_that_class() {
    // Code completion: 4k-token prompts. At light load the smallest batch on TP-4 has the
    // lowest step latency, but a 4.3k-token step does not fit a 1024-token batch.
    let i = inputs(
        vec![class(4000.0, 256.0, 0.05)],
        vec![4, 4],
        vec![1, 2, 4],
        vec![1024, 4096, 16384],
        60.0,
    );
    let plan = plan_capacity(&i, &profile()).unwrap();
    let c = &plan.classes[0];
    for (d, share) in plan.degrees.iter().zip(&c.degree_share) {
        if *share > 1e-9 {
            assert!(d.batch_tokens.unwrap() >= 4256, "{d:?} carries {share}");
        }
    }
    assert!(c.latency_seconds > 0.0);
    // Longer than every candidate batch: a typed error, not a plan that cannot run.
    let mut too_long = i.clone();
    too_long.config.batch_tokens = vec![1024, 4096];
    assert!(matches!(
        plan_capacity(&too_long, &profile()),
        Err(PlannerError::BadClass { index: 0, .. })
    ));
}

#[test]
fn outputs_are_padded_to_whole_blocks() {
    // 40 output tokens decode as two 32-token blocks: 64 positions at 3.25 per step.
    let i = inputs(
        vec![class(100.0, 40.0, 0.05)],
        vec![4],
        vec![1, 2, 4],
        vec![1024],
        20.0,
    );
    let plan = plan_capacity(&i, &profile()).unwrap();
    let c = &plan.classes[0];
    assert!((c.mean_threshold - 0.9).abs() < 1e-6);
    assert!((c.steps_per_request - 64.0 / 3.25).abs() < 1e-6, "{c:?}");
}

#[test]
fn a_solve_out_of_time_returns_its_warm_start_and_says_so() {
    let i = cluster(3.0);
    let profile = profile();
    let problem = validate(&i, &profile).unwrap();
    let types = node_types(&problem.node_gpus, &problem.degrees).unwrap();
    let settings = |deadline| SolveSettings {
        solver: default_solver(),
        deadline,
        mip_gap: 0.0,
    };
    let far = Instant::now() + std::time::Duration::from_secs(60);
    let stage1 = Stage1::new(&problem, &types, settings(far));
    let solved = stage1.solve(None, &Warm::default()).unwrap();
    let optimal = stage1.extract(&solved).unwrap();
    // Finished within the gap (HiGHS also stops at its 1e-6 absolute gap).
    assert_ne!(optimal.status, SolveStatus::TimeLimit);
    let late = Stage1::new(&problem, &types, settings(Instant::now()));
    let warm = stage1.warm_from(&solved);
    let timed_out = late.extract(&late.solve(None, &warm).unwrap()).unwrap();
    assert_eq!(timed_out.status, SolveStatus::TimeLimit);
    assert!((timed_out.value.quality - optimal.value.quality).abs() < 1e-9);
    // Without any incumbent there is nothing to return: a typed error.
    assert!(late.solve(None, &Warm::default()).is_err());
}

fn deployment_of(plan: &super::super::Plan) -> Deployment {
    let t = plan
        .transition
        .as_ref()
        .expect("adopted plans carry a transition");
    Deployment {
        instances: t.instances.clone(),
        batch_tokens: plan
            .capacity
            .degrees
            .iter()
            .filter_map(|d| d.batch_tokens.map(|b| (d.degree, b)))
            .collect(),
    }
}

/// Every GPU of the two 4-GPU nodes a TP-1 instance at `batch` tokens.
fn all_tp1(batch: u64) -> Deployment {
    Deployment {
        instances: (0..8)
            .map(|g| Instance {
                node: g / 4,
                degree: 1,
                gpus: vec![(g % 4) as u32],
            })
            .collect(),
        batch_tokens: [(1, batch)].into_iter().collect(),
    }
}

#[test]
fn a_plan_is_adopted_only_when_an_objective_improves_enough() {
    let profile = profile();
    let mut i = cluster(3.0);
    let first = plan(&i, &profile).unwrap();
    assert!(first.adopted);
    assert!(first.reason.contains("no deployment"));
    // Re-planning the same load from the adopted deployment changes nothing.
    i.current = Some(deployment_of(&first));
    let again = plan(&i, &profile).unwrap();
    assert!(!again.adopted, "{}", again.reason);
    assert!(again.transition.is_none());
    assert_eq!(again.instances_per_node, first.instances_per_node);
    // A poor deployment (every GPU a TP-1 at the largest batch) is replaced.
    i.current = Some(all_tp1(16384));
    let replaced = plan(&i, &profile).unwrap();
    assert!(replaced.adopted, "{}", replaced.reason);
    let gains = replaced.gains.unwrap();
    assert!(gains.quality >= 0.1 || gains.latency_slack >= 0.1 || gains.sustained_load >= 0.1);
}

#[test]
fn latency_slack_alone_adopts_a_plan_only_when_asked_to() {
    // Light load on all TP-1 at its smallest batch: every class already runs at the top
    // threshold, and the best plan (TP-4) gains only latency slack.
    let profile = profile();
    let mut i = cluster(0.05);
    i.config.slo_seconds = 8.0;
    i.current = Some(all_tp1(1024));
    let kept = plan(&i, &profile).unwrap();
    let gains = kept.gains.unwrap();
    assert!(gains.latency_slack >= 0.1, "{gains:?}");
    assert!(gains.quality.abs() < 1e-9 && gains.sustained_load.abs() < 1e-9);
    assert!(
        !kept.adopted && kept.transition.is_none(),
        "{}",
        kept.reason
    );
    assert!(
        kept.reason.contains("which alone adopts nothing"),
        "{}",
        kept.reason
    );
    i.config.adopt_for_latency_slack = true;
    let moved = plan(&i, &profile).unwrap();
    assert!(
        moved.adopted && moved.reason.contains("latency slack"),
        "{}",
        moved.reason
    );
}
