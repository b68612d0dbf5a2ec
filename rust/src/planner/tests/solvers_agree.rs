//! HiGHS and microlp reach the same lexicographic optimum wherever both finish.

use super::super::{plan_capacity, SolveStatus, SolverKind};
use super::{class, inputs, profile, Lcg};

#[test]
fn highs_and_microlp_agree() {
    let profile = profile();
    let mut rng = Lcg(11);
    let mut compared = 0;
    for case in 0..6 {
        let load = rng.range(0.3, 4.0);
        let classes = (0..3)
            .map(|_| {
                class(
                    rng.range(50.0, 800.0),
                    rng.range(64.0, 512.0),
                    load * rng.range(0.5, 2.0),
                )
            })
            .collect();
        let nodes = if case % 2 == 0 { vec![4, 4] } else { vec![8] };
        let mut i = inputs(
            classes,
            nodes,
            vec![1, 2, 4],
            vec![1024, 4096, 16384],
            rng.range(8.0, 30.0),
        );
        i.config.caching = case % 3 == 1;
        i.config.time_limit_seconds = 20.0;
        let highs = plan_capacity(&i, &profile).expect("HiGHS solves");
        i.config.solver = SolverKind::Microlp;
        let microlp = plan_capacity(&i, &profile).expect("microlp solves");
        // Both finished (within a zero relative gap; HiGHS's absolute gap is 1e-6).
        if highs.status == SolveStatus::TimeLimit || microlp.status == SolveStatus::TimeLimit {
            continue;
        }
        compared += 1;
        let (a, b) = (highs.value, microlp.value);
        let close = |x: f64, y: f64| (x - y).abs() <= 1e-5 * x.abs().max(1.0);
        assert_eq!(highs.overloaded, microlp.overloaded, "case {case}");
        assert!(
            close(a.sustained_load, b.sustained_load),
            "case {case}: {a:?} vs {b:?}"
        );
        assert!(close(a.quality, b.quality), "case {case}: {a:?} vs {b:?}");
        assert!(
            close(a.latency_slack, b.latency_slack),
            "case {case}: {a:?} vs {b:?}"
        );
    }
    assert!(
        compared >= 4,
        "only {compared} cases finished on both backends"
    );
}
