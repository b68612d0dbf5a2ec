"""Native tree evaluation equals LightGBM; what it cannot evaluate is refused."""

from __future__ import annotations

import lightgbm as lgb
import numpy as np
import pytest

from dilaserve.predictor import Forest, PredictorModelError
from dilaserve.predictor.features import FEATURE_NAMES
from dilaserve.predictor.train import features_of


def test_shipped_boosters_equal_lightgbm_on_heldout(heldout, shipped):
    x = features_of(heldout, FEATURE_NAMES)
    assert np.isnan(x).any(), "held-out rows include states without confidence features"
    for path in shipped:
        booster = lgb.Booster(model_file=str(path))
        expected = booster.predict(x)
        got = Forest.load(path).predict(x)
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=0)
        assert np.array_equal(got, expected)  # in fact bit for bit: same sums, same order


def _stump(decision_type: int, threshold: float) -> str:
    return (
        "tree\nversion=v4\nnum_class=1\nnum_tree_per_iteration=1\nlabel_index=0\n"
        "max_feature_idx=1\nobjective=regression\nfeature_names=x y\n"
        "feature_infos=[-1:1] [-1:1]\ntree_sizes=1\n\nTree=0\nnum_leaves=2\nnum_cat=0\n"
        f"split_feature=0\nsplit_gain=1\nthreshold={threshold}\ndecision_type={decision_type}\n"
        "left_child=-1\nright_child=-2\nleaf_value=-1 1\nleaf_weight=1 1\nleaf_count=1 1\n"
        "internal_value=0\ninternal_weight=0\ninternal_count=2\nis_linear=0\nshrinkage=1\n\n\n"
        "end of trees\n\nfeature_importances:\nx=1\n\nparameters:\nend of parameters\n\n"
        "pandas_categorical:null\n"
    )


@pytest.mark.parametrize("decision_type", [0, 2, 4, 6, 8, 10])
@pytest.mark.parametrize("threshold", [-0.5, 0.0, 0.5])
def test_missing_values_follow_lightgbm(decision_type, threshold):
    text = _stump(decision_type, threshold)
    x = np.array([[v, 0.0] for v in (np.nan, 0.0, 1e-36, -1e-36, 1e-30, -0.7, 0.3, 0.9)])
    expected = lgb.Booster(model_str=text).predict(x)
    np.testing.assert_array_equal(Forest.from_text(text).predict(x), expected)


def test_categorical_splits_are_refused():
    rng = np.random.default_rng(0)
    x = np.column_stack([rng.integers(0, 5, 300), rng.normal(size=300)])
    y = (x[:, 0] == 2) * 3.0 + x[:, 1]
    booster = lgb.train(
        {"objective": "regression", "verbosity": -1, "min_data_per_group": 5, "cat_smooth": 1},
        lgb.Dataset(x, y, categorical_feature=[0]),
        num_boost_round=3,
    )
    with pytest.raises(PredictorModelError, match="categorical"):
        Forest.from_text(booster.model_to_string())


@pytest.mark.parametrize("objective", ["binary", "multiclass", "lambdarank"])
def test_unknown_objectives_are_refused(objective):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 2))
    y = (x[:, 0] > 0).astype(int)
    params = {"objective": objective, "verbosity": -1}
    data = lgb.Dataset(x, y)
    if objective == "multiclass":
        params["num_class"] = 2
    if objective == "lambdarank":
        data = lgb.Dataset(x, y, group=[20] * 10)
    booster = lgb.train(params, data, num_boost_round=2)
    with pytest.raises(PredictorModelError, match="regression|single-output"):
        Forest.from_text(booster.model_to_string())


def test_log_link_objective_matches():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(300, 2))
    y = np.exp(0.5 * x[:, 0]) + 1
    booster = lgb.train({"objective": "poisson", "verbosity": -1}, lgb.Dataset(x, y), 10)
    np.testing.assert_allclose(
        Forest.from_text(booster.model_to_string()).predict(x), booster.predict(x), rtol=1e-12
    )


def test_truncated_model_is_refused():
    with pytest.raises(PredictorModelError, match="truncated"):
        Forest.from_text(_stump(0, 0.0).split("end of trees")[0])
