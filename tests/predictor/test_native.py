"""The Rust predictors from Python: features identical to the training features, outputs
consistent with what is certain, and the scheduler's use of a learned or Python predictor."""

from __future__ import annotations

import lightgbm as lgb
import numpy as np
import pytest

from dilaserve.predictor import (
    Forest,
    GbmPredictor,
    MeanRatePredictor,
    PredictorError,
    PredictorModelError,
)
from dilaserve.predictor.features import (
    BLOCK_FEATURES,
    FEATURE_NAMES,
    feature_matrix,
    repeat_over_thresholds,
)
from dilaserve.scheduler import (
    LatencyProfile,
    Policy,
    Scheduler,
    SchedulerConfig,
    SchedulerConfigError,
    StepResult,
)

TAUS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


def states(table) -> dict[str, np.ndarray]:
    cols = {
        c: table.column(c).to_numpy()
        for c in (
            "prompt_length",
            "output_length",
            "block_length",
            "steps_done",
            "block_steps",
            "unmasked",
            "unmasked_in_block",
            "confidence_min",
            "confidence_q25",
            "confidence_median",
            "confidence_mean",
            "confidence_q75",
        )
    }
    cols["needs_recompute"] = table.column("next_full").to_numpy(zero_copy_only=False)
    return cols


@pytest.mark.parametrize("taus", [TAUS, (0.9,), (0.5, 1.0)])
def test_rust_features_equal_python_features(heldout, shipped, taus):
    """Through the scheduler's path (features computed in Rust; forking walks for the six
    thresholds, lock-step walks of specialised trees for one or two) the total equals
    LightGBM on the Python features, floored at one step."""
    total_path = shipped[0]
    st = states(heldout)
    booster = lgb.Booster(model_file=str(total_path))
    expected = booster.predict(repeat_over_thresholds(st, taus, FEATURE_NAMES))
    got = GbmPredictor.from_forests(Forest.load(total_path)).predict(st, taus)
    np.testing.assert_array_equal(got.total.ravel(), np.maximum(expected, 1.0))


def test_the_remaining_blocks_feature_is_computed_alike_in_rust(heldout, tmp_path):
    """A booster on the block features (trained here on the shipped traces) predicts in
    Rust what LightGBM predicts on the Python features."""
    st = states(heldout)
    names = [*FEATURE_NAMES, *BLOCK_FEATURES]
    x = feature_matrix(st, heldout.column("tau").to_numpy(), names)
    remaining = x[:, names.index("remaining_blocks")]
    assert remaining.min() >= 1 and len(np.unique(remaining)) > 1
    label = heldout.column("remaining_steps").to_numpy()
    params = {"num_leaves": 8, "verbose": -1, "seed": 0}
    booster = lgb.train(params, lgb.Dataset(x, label, feature_name=names), num_boost_round=5)
    assert booster.feature_importance()[names.index("remaining_blocks")] > 0
    path = tmp_path / "predictor.txt"
    booster.save_model(str(path))
    expected = booster.predict(repeat_over_thresholds(st, TAUS, names))
    got = GbmPredictor.from_forests(Forest.load(path)).predict(st, TAUS)
    np.testing.assert_array_equal(got.total.ravel(), np.maximum(expected, 1.0))


def test_shipped_predictor_is_consistent(heldout, shipped):
    p = GbmPredictor.load(shipped[0])
    # Counting blocks beat the recompute booster on dilaserve-tiny: none is shipped.
    assert not p.has_recompute_model and p.feature_names == list(FEATURE_NAMES)
    st = states(heldout)
    out = p.predict(st, TAUS)
    assert (out.total >= 1.0).all() and (out.cache >= 0).all()
    due = st["needs_recompute"].astype(float)[:, None]
    blocks = (st["output_length"] - st["unmasked"] + st["unmasked_in_block"]) // st["block_length"]
    assert (out.recompute >= np.minimum(due, out.total)).all()
    assert (out.recompute <= (blocks - 1)[:, None] + due + 1e-12).all()


def test_learned_predictor_beats_the_fixed_table(heldout, shipped):
    st = states(heldout)
    tau = heldout.column("tau").to_numpy()
    truth = heldout.column("remaining_steps").to_numpy()
    labeled = heldout.column("labeled").to_numpy(zero_copy_only=False)
    pick = (np.arange(len(tau)), np.searchsorted(TAUS, tau))

    def mae(predictor) -> float:
        total = predictor.predict(st, TAUS).total[pick]
        return float(np.abs(total - truth)[labeled].mean())

    assert mae(GbmPredictor.load(shipped[0])) < 0.5 * mae(MeanRatePredictor())


def test_unknown_features_are_refused():
    text = (
        "tree\nversion=v4\nnum_class=1\nnum_tree_per_iteration=1\nmax_feature_idx=0\n"
        "objective=regression\nfeature_names=tokens\n\nTree=0\nnum_leaves=1\nleaf_value=1\n\n"
        "end of trees\n"
    )
    with pytest.raises(PredictorModelError, match="unknown feature"):
        GbmPredictor.from_forests(Forest.from_text(text))


def _profile() -> LatencyProfile:
    t = [(32, 0.01), (4096, 0.2)]
    return LatencyProfile.from_tables([(1, "recompute", t), (1, "cache", t)])


def _run(config: SchedulerConfig, rounds: int = 3) -> Scheduler:
    s = Scheduler(_profile(), config)
    s.add_instance(1, tp=1, gpus=[0], node=0)
    s.arrive(7, arrival=0.0, deadline=10.0, prompt_len=12, output_len=32)
    for t in range(rounds):
        d = s.schedule(float(t))
        if not len(d.entry_requests):
            break
        s.step_done(1, 0.01, [StepResult(7, 4, (0.3, 0.5, 0.6, 0.6, 0.8))])
    return s


def test_scheduler_loads_a_model_file(shipped):
    s = _run(SchedulerConfig(predictor_model=str(shipped[0])), rounds=1)
    predictions = s.request(7).predictions
    assert all(c + r >= 1.0 for c, r in predictions)


class Recording:
    """A Python predictor: records what the scheduler shows it."""

    def __init__(self, value: float = 2.0) -> None:
        self.value = value
        self.calls: list[dict[str, np.ndarray]] = []

    def predict(self, states, thresholds):
        self.calls.append(states)
        shape = (len(states["request_id"]), len(thresholds))
        return np.full(shape, self.value), np.ones(shape)


def test_scheduler_takes_a_python_predictor():
    p = Recording()
    policy = Policy(predict_every=1)
    s = _run(SchedulerConfig(predictor=p, policy=policy))
    assert [int(c["request_id"][0]) for c in p.calls] == [7] * len(p.calls)
    assert [int(c["steps_done"][0]) for c in p.calls][:3] == [0, 1, 2]
    assert [int(c["block_steps"][0]) for c in p.calls][:3] == [0, 1, 2]
    assert np.isnan(p.calls[0]["confidence_min"]).all()
    assert p.calls[1]["confidence_min"][0] == pytest.approx(0.3)
    assert s.request(7).predictions[0] == (2.0, 1.0)


@pytest.mark.parametrize("bad", [float("nan"), -1.0, float("inf")])
def test_invalid_predictions_raise_and_leave_no_request(bad):
    s = Scheduler(_profile(), SchedulerConfig(predictor=Recording(bad)))
    with pytest.raises(PredictorError, match="finite and non-negative"):
        s.arrive(7, arrival=0.0, deadline=10.0, prompt_len=12, output_len=32)
    assert s.active_requests == 0


def test_a_failing_python_predictor_raises():
    class Broken:
        def predict(self, states, thresholds):
            raise RuntimeError("boom")

    s = Scheduler(_profile(), SchedulerConfig(predictor=Broken()))
    with pytest.raises(PredictorError, match="boom"):
        s.arrive(7, arrival=0.0, deadline=10.0, prompt_len=12, output_len=32)


def test_native_objects_run_without_python(shipped):
    for predictor in (GbmPredictor.load(shipped[0]), MeanRatePredictor([(0.5, 20.0), (1.0, 2.0)])):
        s = _run(SchedulerConfig(predictor=predictor))
        assert s.active_requests in (0, 1)


def test_one_predictor_source_only(shipped):
    with pytest.raises(SchedulerConfigError, match="at most one"):
        Scheduler(
            _profile(),
            SchedulerConfig(predictor_model=str(shipped[0]), predictor_rates=((0.9, 8.0),)),
        )
