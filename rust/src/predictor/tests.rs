//! Parser and evaluation tests. Equality with `lightgbm.Booster.predict` on real models is
//! tested from Python (tests/predictor/), where LightGBM is available.

use super::*;

const TWO_TREES: &str = include_str!("testdata/two_trees.txt");

/// A one-split tree on feature 0 at `threshold` with the given decision type; leaves are
/// -1 (left) and +1 (right).
fn stump(decision_type: u8, threshold: f64) -> String {
    format!(
        "tree\nversion=v4\nnum_class=1\nnum_tree_per_iteration=1\nlabel_index=0\n\
         max_feature_idx=1\nobjective=regression\nfeature_names=x y\n\n\
         Tree=0\nnum_leaves=2\nnum_cat=0\nsplit_feature=0\nthreshold={threshold}\n\
         decision_type={decision_type}\nleft_child=-1\nright_child=-2\nleaf_value=-1 1\n\
         is_linear=0\nshrinkage=1\n\nend of trees\n"
    )
}

#[test]
fn matches_lightgbm_on_a_saved_model() {
    let forest = Forest::from_text(TWO_TREES).unwrap();
    assert_eq!(forest.num_trees(), 2);
    assert_eq!(forest.feature_names(), ["a", "b", "c"]);
    let nan = f64::NAN;
    let rows = [
        0.1, nan, 0.0, //
        0.1, 0.5, 1e-40, //
        -2.0, 1.0, 1.0, //
        nan, nan, nan, //
        3.0, -3.0, 0.3,
    ];
    // lightgbm 4.7 Booster.predict on the same rows, as exact bit patterns.
    let expected = [
        f64::from_bits(0x3FE4_B5AF_00B4_BB00),
        -f64::from_bits(0x3FB0_7BDE_93A3_F642),
        f64::from_bits(0x3FD5_582A_6130_94F1),
        f64::from_bits(0x3FE4_B5AF_00B4_BB00),
        f64::from_bits(0x3FD5_582A_6130_94F1),
    ];
    let mut out = [0.0; 5];
    forest.predict_rows(&rows, &mut out).unwrap();
    assert_eq!(out, expected);
}

#[test]
fn missing_values_follow_lightgbm() {
    let nan = f64::NAN;
    // (decision type, threshold, input, expected leaf), each checked against LightGBM 4.7.
    let cases = [
        // Missing type None: NaN reads as 0.
        (0, 0.5, nan, -1.0),
        (0, -0.5, nan, 1.0),
        (2, -0.5, nan, 1.0),
        // Missing type Zero: NaN and 0 (and anything within 1e-35) take the default side.
        (4, -0.5, 0.0, 1.0),
        (6, 0.5, 0.0, -1.0),
        (6, -0.5, 0.0, -1.0),
        (6, -0.5, nan, -1.0),
        (4, 0.5, nan, 1.0),
        (4, 0.5, 1e-36, 1.0),
        (4, 0.5, 0.2, -1.0),
        // Missing type NaN: only NaN takes the default side; 0 compares.
        (8, -0.5, nan, 1.0),
        (10, 0.5, nan, -1.0),
        (10, 0.5, 0.0, -1.0),
        (8, -0.5, 0.0, 1.0),
        // Values within 1e-35 of zero are zero.
        (0, 0.0, -1e-36, -1.0),
        (0, 0.0, 1e-36, -1.0),
        (0, 0.0, 1e-30, 1.0),
    ];
    for (dt, thr, x, want) in cases {
        let forest = Forest::from_text(&stump(dt, thr)).unwrap();
        let got = forest.predict_row(&[x, 0.0]).unwrap();
        assert_eq!(got, want, "decision_type={dt} threshold={thr} x={x}");
    }
}

#[test]
fn varying_one_feature_equals_row_by_row() {
    let forest = Forest::from_text(TWO_TREES).unwrap();
    let values = [-1.0, 0.0, 0.02, 0.5, 1.2, f64::NAN, 3.0];
    let rows = [0.1, 0.3, 0.0, 2.0, f64::NAN, 0.05, -1.0, 1.5, 1.0];
    for vary in 0..3 {
        let mut out = vec![0.0; 3 * values.len()];
        forest
            .predict_varying(&rows, vary, &values, &mut out)
            .unwrap();
        for (r, row) in rows.chunks(3).enumerate() {
            for (k, &v) in values.iter().enumerate() {
                let mut one = row.to_vec();
                one[vary] = v;
                assert_eq!(out[r * values.len() + k], forest.predict_row(&one).unwrap());
            }
        }
    }
}

#[test]
fn varying_handles_more_values_than_one_mask() {
    let forest = Forest::from_text(TWO_TREES).unwrap();
    let values: Vec<f64> = (0..150).map(|i| -2.0 + 0.03 * f64::from(i)).collect();
    let row = [0.1, 0.0, 0.3];
    let mut out = vec![0.0; values.len()];
    forest.predict_varying(&row, 1, &values, &mut out).unwrap();
    for (k, &v) in values.iter().enumerate() {
        assert_eq!(out[k], forest.predict_row(&[0.1, v, 0.3]).unwrap());
    }
}

#[test]
fn output_transforms() {
    let with = |objective: &str| {
        stump(0, 0.0).replace("objective=regression", &format!("objective={objective}"))
    };
    let cases = [
        ("regression", -1.0),
        ("huber delta:1", -1.0),
        ("regression sqrt", -1.0),
        ("poisson max_delta_step:0.7", (-1.0f64).exp()),
        ("tweedie", (-1.0f64).exp()),
    ];
    for (objective, want) in cases {
        let forest = Forest::from_text(&with(objective)).unwrap();
        assert_eq!(
            forest.predict_row(&[-1.0, 0.0]).unwrap(),
            want,
            "{objective}"
        );
    }
    let sq =
        Forest::from_text(&with("regression sqrt").replace("leaf_value=-1 1", "leaf_value=-3 2"))
            .unwrap();
    assert_eq!(sq.predict_row(&[-1.0, 0.0]).unwrap(), -9.0);
    assert_eq!(sq.transform(), OutputTransform::SignedSquare);
}

#[test]
fn average_output_divides_by_tree_count() {
    let text = TWO_TREES.replace("tree_sizes=", "average_output\ntree_sizes=");
    let avg = Forest::from_text(&text).unwrap();
    let sum = Forest::from_text(TWO_TREES).unwrap();
    let row = [0.1, 0.5, 1.0];
    assert_eq!(
        avg.predict_row(&row).unwrap(),
        sum.predict_row(&row).unwrap() / 2.0
    );
}

#[test]
fn single_leaf_trees() {
    let text = "tree\nversion=v4\nnum_class=1\nnum_tree_per_iteration=1\nmax_feature_idx=0\n\
                objective=regression\nfeature_names=x\n\nTree=0\nnum_leaves=1\nnum_cat=0\n\
                split_feature=\nthreshold=\ndecision_type=\nleft_child=\nright_child=\n\
                leaf_value=2.5\nis_linear=0\nshrinkage=1\n\nend of trees\n";
    let forest = Forest::from_text(text).unwrap();
    assert_eq!(forest.predict_row(&[f64::NAN]).unwrap(), 2.5);
}

#[test]
fn rejects_what_it_cannot_evaluate() {
    let unsupported = [
        stump(1, 0.0),
        stump(0, 0.0).replace("num_cat=0", "num_cat=1"),
        stump(0, 0.0).replace("is_linear=0", "is_linear=1"),
        stump(0, 0.0).replace("objective=regression", "objective=binary sigmoid:1"),
        stump(0, 0.0).replace("objective=regression", "objective=multiclass num_class:3"),
        stump(0, 0.0).replace("objective=regression", "objective=lambdarank"),
        stump(0, 0.0).replace("objective=regression\n", ""),
        stump(0, 0.0).replace("num_class=1", "num_class=3"),
    ];
    for text in unsupported {
        let err = Forest::from_text(&text).unwrap_err();
        assert!(matches!(err, GbmError::Unsupported(_)), "{err}");
    }
    let malformed = [
        stump(0, 0.0).replace("end of trees\n", ""),
        stump(0, 0.0).replace("split_feature=0", "split_feature=2"),
        stump(0, 0.0).replace("left_child=-1", "left_child=0"),
        stump(0, 0.0).replace("right_child=-2", "right_child=-1"),
        stump(0, 0.0).replace("leaf_value=-1 1", "leaf_value=-1"),
        stump(0, 0.0).replace("leaf_value=-1 1", "leaf_value=-1 nan"),
        stump(0, 0.0).replace("threshold=0", "threshold=zero"),
        stump(0, 0.0).replace("decision_type=0", "decision_type=12"),
        stump(0, 0.0).replace("Tree=0", "Tree=1"),
        stump(0, 0.0).replace("feature_names=x y", "feature_names=x"),
        stump(0, 0.0).replace("num_leaves=2", "num_leaves=0"),
    ];
    for text in malformed {
        let err = Forest::from_text(&text).unwrap_err();
        assert!(matches!(err, GbmError::Parse { .. }), "{err}: {text}");
    }
    let forest = Forest::from_text(&stump(0, 0.0)).unwrap();
    assert!(matches!(
        forest.predict_row(&[1.0]),
        Err(GbmError::RowWidth { .. })
    ));
    assert!(forest
        .predict_varying(&[1.0, 0.0], 2, &[0.5], &mut [0.0])
        .is_err());
}
