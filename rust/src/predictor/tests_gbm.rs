//! The learned predictor through the scheduler's trait: features, consistency of its
//! outputs, loading, and what the scheduler does with a predictor that fails.

use std::sync::{Arc, Mutex};

use super::*;
use crate::profile::{LatencyProfile, StepKind};
use crate::scheduler::{
    InstanceSpec, Policy, PredictError, Prediction, RequestSpec, RequestView, SchedError,
    Scheduler, SchedulerConfig, StepPredictor, StepResult, StepsLeft,
};

/// A forest of one tree per `(feature, threshold, left, right)`.
fn forest(features: &[&str], trees: &[(usize, f64, f64, f64)]) -> Forest {
    let mut text = format!(
        "tree\nversion=v4\nnum_class=1\nnum_tree_per_iteration=1\nmax_feature_idx={}\n\
         objective=regression\nfeature_names={}\n\n",
        features.len() - 1,
        features.join(" ")
    );
    for (i, (f, thr, l, r)) in trees.iter().enumerate() {
        text += &format!(
            "Tree={i}\nnum_leaves=2\nnum_cat=0\nsplit_feature={f}\nthreshold={thr}\n\
             decision_type=10\nleft_child=-1\nright_child=-2\nleaf_value={l} {r}\n\n"
        );
    }
    Forest::from_text(&(text + "end of trees\n")).unwrap()
}

fn view(steps_done: u32, block_steps: u32, unmasked_in_block: u32, block: u32) -> RequestView {
    RequestView {
        id: 3,
        prompt_len: 20,
        output_len: 128,
        block_length: 32,
        steps_done,
        mean_tau_done: None,
        block_steps,
        unmasked: block * 32 + unmasked_in_block,
        unmasked_in_block,
        current_block: block,
        needs_recompute: block_steps == 0,
        confidence: None,
    }
}

#[test]
fn features_follow_design() {
    let mut v = view(6, 2, 8, 1);
    v.confidence = Some([0.1, 0.2, 0.3, 0.4, 0.5]);
    let f = known_features(&v);
    assert_eq!(KNOWN_FEATURES[..11], FEATURE_NAMES);
    assert_eq!(
        f,
        [
            0.0,
            128.0,
            6.0 / 128.0,
            40.0 / 128.0,
            2.0 / 32.0,
            8.0 / 32.0,
            0.1,
            0.2,
            0.3,
            0.4,
            0.5,
            20.0,
            3.0
        ]
    );
    assert!(known_features(&view(0, 0, 0, 0))[6..11]
        .iter()
        .all(|x| x.is_nan()));
}

#[test]
fn feature_map_checks_names() {
    let names = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    let map = FeatureMap::new(&names(&["output_length", "threshold"])).unwrap();
    assert_eq!(map.threshold_column(), 1);
    let mut row = [0.0; 2];
    map.fill(&view(0, 0, 0, 0), &mut row);
    assert_eq!(row, [128.0, 0.0]);
    for bad in [
        names(&["threshold", "tokens"]),
        names(&["output_length"]),
        names(&["threshold", "threshold"]),
    ] {
        assert!(matches!(FeatureMap::new(&bad), Err(GbmError::Features(_))));
    }
}

#[test]
fn predictions_vary_by_threshold_and_stay_consistent() {
    // Total: 2 steps at τ <= 0.75, else 6; plus 0.5 more once past 50 % of the block.
    let total = forest(
        &["threshold", "block_unmask_progress"],
        &[(0, 0.75, 2.0, 6.0), (1, 0.5, 0.0, 0.5)],
    );
    let recompute = forest(&["threshold", "output_length"], &[(0, 0.75, 0.2, 9.0)]);
    let p = GbmPredictor::new(total.clone(), Some(recompute)).unwrap();
    let taus = [0.5, 0.7, 0.8, 0.9];
    let mut out = [StepsLeft::default(); 4];
    // Fresh request: one recompute step is due, four blocks to open at most.
    p.predict(&view(0, 0, 0, 0), &taus, &mut out).unwrap();
    let totals: Vec<f64> = out.iter().map(StepsLeft::total).collect();
    assert_eq!(totals, [2.0, 2.0, 6.0, 6.0]);
    // 0.2 is raised to the recompute step already due; 9 is capped at one per block.
    assert_eq!((out[0].recompute, out[3].recompute), (1.0, 4.0));
    // Mid-block, second of four blocks: no recompute due, two blocks left to open.
    p.predict(&view(5, 3, 20, 1), &taus, &mut out).unwrap();
    assert_eq!(
        out[0],
        StepsLeft {
            cache: 2.5 - 0.2,
            recompute: 0.2
        }
    );
    assert_eq!(
        out[3],
        StepsLeft {
            cache: 4.5,
            recompute: 2.0
        }
    );
    // Without a recompute booster: one per block still to open.
    let structural = GbmPredictor::new(total, None).unwrap();
    structural
        .predict(&view(5, 3, 20, 1), &taus, &mut out)
        .unwrap();
    assert_eq!(
        out[0],
        StepsLeft {
            cache: 0.5,
            recompute: 2.0
        }
    );
}

#[test]
fn at_least_one_step_is_left() {
    let p = GbmPredictor::new(forest(&["threshold"], &[(0, 0.5, -3.0, 0.2)]), None).unwrap();
    let mut out = [StepsLeft::default(); 2];
    p.predict(&view(0, 0, 0, 3), &[0.5, 0.9], &mut out).unwrap();
    assert_eq!(
        out,
        [StepsLeft {
            cache: 0.0,
            recompute: 1.0
        }; 2]
    );
}

#[test]
fn batch_equals_one_by_one_across_threads() {
    let total = forest(
        &["threshold", "full_progress", "confidence_min"],
        &[
            (0, 0.65, 3.0, 7.0),
            (1, 0.1, 1.0, -0.5),
            (2, 0.4, 2.0, 0.25),
        ],
    );
    let p = GbmPredictor::new(total, None).unwrap();
    // Enough requests for the batch to be split over threads.
    let mut views: Vec<RequestView> = (0..3000).map(|i| view(i, i % 3, i % 30, i % 4)).collect();
    for (i, v) in views.iter_mut().enumerate() {
        v.confidence = (i % 2 == 0).then_some([i as f64 / 40.0; 5]);
    }
    let taus = [0.5, 0.6, 0.7, 0.8, 0.9, 1.0];
    let mut batch = vec![StepsLeft::default(); views.len() * taus.len()];
    p.predict_batch(&views, &taus, &mut batch).unwrap();
    for (v, row) in views.iter().zip(batch.chunks(taus.len())) {
        let mut one = [StepsLeft::default(); 6];
        p.predict(v, &taus, &mut one).unwrap();
        assert_eq!(row, one);
    }
}

#[test]
fn loads_the_recompute_booster_beside_the_model() {
    let dir = tempfile::tempdir().unwrap();
    let total = dir.path().join("predictor.txt");
    let text = |leaf: f64| {
        format!(
            "tree\nversion=v4\nnum_class=1\nnum_tree_per_iteration=1\nmax_feature_idx=0\n\
             objective=regression\nfeature_names=threshold\n\nTree=0\nnum_leaves=1\n\
             leaf_value={leaf}\n\nend of trees\n"
        )
    };
    std::fs::write(&total, text(5.0)).unwrap();
    assert!(!GbmPredictor::load(&total).unwrap().has_recompute_model());
    let companion = GbmPredictor::recompute_path(&total);
    assert_eq!(companion, dir.path().join("predictor_recompute.txt"));
    std::fs::write(&companion, text(1.0)).unwrap();
    assert!(GbmPredictor::load(&total).unwrap().has_recompute_model());
    assert!(matches!(
        GbmPredictor::load(dir.path().join("missing.txt")),
        Err(GbmError::Io { .. })
    ));
}

fn profile() -> LatencyProfile {
    let table = |n: f64| vec![(32u64, n), (4096u64, 10.0 * n)];
    LatencyProfile::from_tables(vec![
        (1, StepKind::Recompute, table(0.02)),
        (1, StepKind::Cache, table(0.005)),
        (1, StepKind::NoCache, table(0.02)),
    ])
    .unwrap()
}

/// Records every view it is asked about; predicts `value` cache steps.
struct Recording {
    seen: Arc<Mutex<Vec<RequestView>>>,
    value: f64,
}

impl StepPredictor for Recording {
    fn predict(
        &self,
        request: &RequestView,
        _thresholds: &[f64],
        out: &mut [StepsLeft],
    ) -> Result<(), PredictError> {
        self.seen.lock().unwrap().push(*request);
        out.fill(StepsLeft {
            cache: self.value,
            recompute: 1.0,
        });
        Ok(())
    }
}

fn scheduler_with(value: f64) -> (Scheduler, Arc<Mutex<Vec<RequestView>>>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let predictor = Recording {
        seen: seen.clone(),
        value,
    };
    let config = SchedulerConfig {
        policy: Policy {
            prediction: Prediction::Online,
            predict_every: 1,
            ..Policy::dilaserve()
        },
        ..Default::default()
    };
    let s = Scheduler::with_predictor(profile(), config, Box::new(predictor)).unwrap();
    (s, seen)
}

#[test]
fn scheduler_shows_id_and_block_steps_to_the_predictor() {
    let (mut s, seen) = scheduler_with(3.0);
    s.add_instance(InstanceSpec::new(1, 1, vec![0], 0)).unwrap();
    s.arrive(RequestSpec::new(42, 0.0, 100.0, 10, 64)).unwrap();
    // Commit 16, then 16 (block done), then 4 of the next block.
    for (t, committed) in [16u32, 16, 4].into_iter().enumerate() {
        let d = s.schedule(t as f64).unwrap().clone();
        assert_eq!(d.entries.len(), 1);
        s.step_done(1, 0.01, &[StepResult::new(42, committed)])
            .unwrap();
    }
    let seen = seen.lock().unwrap();
    let got: Vec<(u64, u32, u32, u32)> = seen
        .iter()
        .map(|v| (v.id, v.steps_done, v.block_steps, v.unmasked_in_block))
        .collect();
    assert_eq!(
        got,
        [(42, 0, 0, 0), (42, 1, 1, 16), (42, 2, 0, 0), (42, 3, 1, 4)]
    );
}

#[test]
fn invalid_predictions_are_errors() {
    for bad in [f64::NAN, -1.0, f64::INFINITY] {
        let (mut s, _) = scheduler_with(bad);
        let err = s
            .arrive(RequestSpec::new(5, 0.0, 100.0, 10, 64))
            .unwrap_err();
        assert!(
            matches!(
                err,
                SchedError::Predictor(PredictError::Invalid { request: 5, .. })
            ),
            "{err}"
        );
        // Rejected at arrival: the scheduler holds no trace of the request.
        assert_eq!(s.active_requests(), 0);
        assert!(s.request(5).is_err());
    }
}
