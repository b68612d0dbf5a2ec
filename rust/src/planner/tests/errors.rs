//! Bad input yields a typed error that names the problem.

use super::super::inputs::{Deployment, Instance, ThresholdOption};
use super::super::{plan, PlannerError, PlannerInputs};
use super::{class, inputs, profile};
use crate::profile::{LatencyProfile, ProfileError, StepKind};

fn ok_inputs() -> PlannerInputs {
    inputs(
        vec![class(100.0, 200.0, 1.0)],
        vec![4],
        vec![1, 2, 4],
        vec![1024],
        20.0,
    )
}

#[test]
fn no_gpus() {
    let mut i = ok_inputs();
    i.node_gpus.clear();
    assert!(matches!(plan(&i, &profile()), Err(PlannerError::NoGpus)));
    i.node_gpus = vec![4, 0];
    assert!(matches!(
        plan(&i, &profile()),
        Err(PlannerError::EmptyNode { node: 1 })
    ));
}

#[test]
fn empty_class_list() {
    let mut i = ok_inputs();
    i.classes.clear();
    let err = plan(&i, &profile()).unwrap_err();
    assert!(matches!(err, PlannerError::NoClasses));
    assert!(err.to_string().contains("at least one class"));
}

#[test]
fn bad_class_values() {
    let mut i = ok_inputs();
    i.classes.push(class(10.0, 0.0, 1.0));
    assert!(matches!(
        plan(&i, &profile()),
        Err(PlannerError::BadClass { index: 1, .. })
    ));
    i.classes[1] = class(10.0, 10.0, f64::NAN);
    assert!(matches!(
        plan(&i, &profile()),
        Err(PlannerError::BadClass { index: 1, .. })
    ));
}

#[test]
fn profile_missing_a_degree() {
    let small = LatencyProfile::from_tables([
        (1, StepKind::NoCache, vec![(64, 0.01), (4096, 0.1)]),
        (2, StepKind::NoCache, vec![(64, 0.008), (4096, 0.08)]),
    ])
    .unwrap();
    let err = plan(&ok_inputs(), &small).unwrap_err();
    assert!(matches!(
        err,
        PlannerError::Profile(ProfileError::MissingDegree { tp: 4, .. })
    ));
    assert!(err.to_string().contains("no TP degree 4"));
    let mut caching = ok_inputs();
    caching.config.caching = true;
    caching.config.degrees = vec![1, 2];
    assert!(matches!(
        plan(&caching, &small),
        Err(PlannerError::Profile(ProfileError::MissingKind {
            tp: 1,
            ..
        }))
    ));
}

#[test]
fn degrees_and_batches() {
    let mut i = ok_inputs();
    i.config.degrees = vec![1, 8];
    let err = plan(&i, &profile()).unwrap_err();
    assert!(
        matches!(err, PlannerError::BadDegree { degree: 8, .. }),
        "{err}"
    );
    i.config.degrees = vec![];
    assert!(matches!(plan(&i, &profile()), Err(PlannerError::NoDegrees)));
    i.config.degrees = vec![1, 1];
    assert!(matches!(
        plan(&i, &profile()),
        Err(PlannerError::BadDegree { degree: 1, .. })
    ));
    i.config.degrees = vec![1];
    i.config.batch_tokens = vec![];
    assert!(matches!(
        plan(&i, &profile()),
        Err(PlannerError::NoBatchSizes)
    ));
    i.config.batch_tokens = vec![0, 64];
    assert!(matches!(
        plan(&i, &profile()),
        Err(PlannerError::BadBatchSizes(_))
    ));
}

#[test]
fn thresholds_must_trade_quality_for_speed() {
    let mut i = ok_inputs();
    i.thresholds.clear();
    assert!(matches!(
        plan(&i, &profile()),
        Err(PlannerError::NoThresholds)
    ));
    i.thresholds = vec![
        ThresholdOption {
            threshold: 0.9,
            tokens_per_step: 5.0,
        },
        ThresholdOption {
            threshold: 0.7,
            tokens_per_step: 4.0,
        },
    ];
    let err = plan(&i, &profile()).unwrap_err();
    assert!(err.to_string().contains("not fewer than"), "{err}");
    i.thresholds = vec![ThresholdOption {
        threshold: 1.5,
        tokens_per_step: 1.0,
    }];
    assert!(matches!(
        plan(&i, &profile()),
        Err(PlannerError::BadThreshold { index: 0, .. })
    ));
    i.thresholds = vec![ThresholdOption {
        threshold: 0.9,
        tokens_per_step: 40.0,
    }];
    i.config.caching = true;
    let err = plan(&i, &profile()).unwrap_err();
    assert!(err.to_string().contains("block length"), "{err}");
}

#[test]
fn bad_settings() {
    type Edit = fn(&mut PlannerInputs);
    let cases: [(&str, Edit); 4] = [
        ("slo_seconds", |i| i.config.slo_seconds = 0.0),
        ("time_limit_seconds", |i| i.config.time_limit_seconds = -1.0),
        ("mip_gap", |i| i.config.mip_gap = 1.0),
        ("min_improvement", |i| i.config.min_improvement = f64::NAN),
    ];
    for (name, edit) in cases {
        let mut i = ok_inputs();
        edit(&mut i);
        match plan(&i, &profile()) {
            Err(PlannerError::BadSetting { name: n, .. }) => assert_eq!(n, name),
            other => panic!("{name}: unexpected {other:?}"),
        }
    }
}

#[test]
fn bad_deployments() {
    let inst = |node, gpus: &[u32]| Instance {
        node,
        degree: gpus.len() as u32,
        gpus: gpus.to_vec(),
    };
    let cases = [
        (vec![inst(0, &[0, 1]), inst(0, &[1, 2])], "used twice"),
        (vec![inst(1, &[0])], "node 1"),
        (vec![inst(0, &[3, 4])], "GPU 4"),
        (
            vec![Instance {
                node: 0,
                degree: 2,
                gpus: vec![0],
            }],
            "degree 2 but 1 GPUs",
        ),
    ];
    for (instances, needle) in cases {
        let mut i = ok_inputs();
        i.current = Some(Deployment {
            instances,
            batch_tokens: [(1, 1024), (2, 1024)].into_iter().collect(),
        });
        let err = plan(&i, &profile()).unwrap_err();
        assert!(
            matches!(&err, PlannerError::BadDeployment(m) if m.contains(needle)),
            "{needle}: {err}"
        );
    }
    let mut i = ok_inputs();
    i.current = Some(Deployment {
        instances: vec![inst(0, &[0])],
        batch_tokens: [(1, 999)].into_iter().collect(),
    });
    assert!(plan(&i, &profile())
        .unwrap_err()
        .to_string()
        .contains("not a candidate"));
}

#[cfg(not(feature = "microlp"))]
#[test]
fn missing_backend_is_named() {
    let mut i = ok_inputs();
    i.config.solver = super::super::SolverKind::Microlp;
    assert!(matches!(
        plan(&i, &profile()),
        Err(PlannerError::SolverUnavailable("microlp"))
    ));
}
