//! Remaining-step predictions (DESIGN §3). The scheduler only sees the [`StepPredictor`]
//! trait, so the learned predictor (`crate::predictor::GbmPredictor`), a calibrated
//! mean-rate table or a predictor written in Python can replace the default without
//! touching the policies. Every prediction is checked ([`check_predictions`]): a NaN,
//! infinite or negative one is a [`PredictError`], never a silently wrong threshold.

use super::config::MAX_THRESHOLDS;
use super::error::SchedError;

/// What a predictor sees of one request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RequestView {
    pub id: u64,
    pub prompt_len: u32,
    /// Output positions, a whole number of blocks.
    pub output_len: u32,
    pub block_length: u32,
    pub steps_done: u32,
    /// Mean threshold of the steps run so far (None before the first, or not known).
    pub mean_tau_done: Option<f64>,
    /// Steps run in the current block (0: the next step opens it).
    pub block_steps: u32,
    pub unmasked: u32,
    pub unmasked_in_block: u32,
    pub current_block: u32,
    /// The next step runs over the full sequence (a block's first step, or the cache was lost).
    pub needs_recompute: bool,
    /// Confidence of the still-masked output tokens at the last step:
    /// min, q25, median, mean, q75.
    pub confidence: Option<[f64; 5]>,
}

impl RequestView {
    /// Blocks after the current one.
    pub fn future_blocks(&self) -> u32 {
        (self.output_len / self.block_length).saturating_sub(self.current_block + 1)
    }
}

/// Predicted remaining steps of a request at one threshold, by kind.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepsLeft {
    /// Steps over the block only (cache steps when caching is on).
    pub cache: f64,
    /// Steps over the full sequence (one per remaining block, plus a lost cache).
    pub recompute: f64,
}

impl StepsLeft {
    pub fn total(&self) -> f64 {
        self.cache + self.recompute
    }
}

/// Why a predictor produced no usable prediction.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum PredictError {
    #[error(
        "the step predictor returned {value} {kind} steps for request {request} at threshold \
         {threshold}: predictions must be finite and non-negative"
    )]
    Invalid {
        request: u64,
        threshold: f64,
        kind: &'static str,
        value: f64,
    },
    /// The predictor itself failed (a Python predictor raised, returned the wrong shape).
    #[error("the step predictor failed: {0}")]
    Failed(String),
}

/// Predicts remaining steps of requests at every candidate threshold.
pub trait StepPredictor: Send + Sync {
    /// Fills `out[k]` with the prediction at `thresholds[k]`.
    fn predict(
        &self,
        request: &RequestView,
        thresholds: &[f64],
        out: &mut [StepsLeft],
    ) -> Result<(), PredictError>;

    /// Batched form: `out` holds `thresholds.len()` entries per request, request-major.
    /// Learned predictors override this to evaluate requests × thresholds in one call.
    fn predict_batch(
        &self,
        requests: &[RequestView],
        thresholds: &[f64],
        out: &mut [StepsLeft],
    ) -> Result<(), PredictError> {
        predict_each(self, requests, thresholds, out)
    }
}

/// [`StepPredictor::predict_batch`] one request at a time.
fn predict_each<P: StepPredictor + ?Sized>(
    predictor: &P,
    requests: &[RequestView],
    thresholds: &[f64],
    out: &mut [StepsLeft],
) -> Result<(), PredictError> {
    if thresholds.is_empty() {
        return Ok(());
    }
    for (request, row) in requests.iter().zip(out.chunks_exact_mut(thresholds.len())) {
        predictor.predict(request, thresholds, row)?;
    }
    Ok(())
}

/// The first prediction of `out` (laid out as [`StepPredictor::predict_batch`] fills it)
/// that is NaN, infinite or negative, as an error.
pub fn check_predictions(
    requests: &[RequestView],
    thresholds: &[f64],
    out: &[StepsLeft],
) -> Result<(), PredictError> {
    if thresholds.is_empty() {
        return Ok(());
    }
    let valid = |value: f64| value.is_finite() && value >= 0.0;
    if out.iter().all(|s| valid(s.cache) && valid(s.recompute)) {
        return Ok(());
    }
    for (request, row) in requests.iter().zip(out.chunks_exact(thresholds.len())) {
        for (s, &threshold) in row.iter().zip(thresholds) {
            for (kind, value) in [("cache", s.cache), ("recompute", s.recompute)] {
                if !(value.is_finite() && value >= 0.0) {
                    return Err(PredictError::Invalid {
                        request: request.id,
                        threshold,
                        kind,
                        value,
                    });
                }
            }
        }
    }
    Ok(())
}

/// Default predictor: each threshold commits a fixed mean number of tokens per step,
/// so a block with `m` masked tokens needs `ceil(m / rate)` more steps. *(ours)* Once a
/// request has run steps, the rates are scaled by its own speed so far
/// ([`MeanRatePredictor::speed`]): kinds of request (tasks) decode at different speeds on
/// one model, and a refreshed prediction should know which kind it is looking at.
#[derive(Clone, Debug, PartialEq)]
pub struct MeanRatePredictor {
    taus: Vec<f64>,
    rates: Vec<f64>,
}

impl MeanRatePredictor {
    /// Fast-dLLM's measured mean tokens per step on GSM8K (DESIGN §9).
    pub const FAST_DLLM_GSM8K: [(f64, f64); 6] = [
        (0.5, 7.01),
        (0.6, 6.17),
        (0.7, 5.12),
        (0.8, 4.24),
        (0.9, 3.25),
        (1.0, 1.0),
    ];

    /// `points` are `(threshold, mean tokens per step)`; rates between points are linear
    /// in the threshold and clamp outside them.
    pub fn new(points: &[(f64, f64)]) -> Result<Self, SchedError> {
        if points.is_empty() {
            return Err(SchedError::Config(
                "mean-rate predictor needs at least one (threshold, tokens per step) point".into(),
            ));
        }
        let mut sorted = points.to_vec();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (i, &(tau, rate)) in sorted.iter().enumerate() {
            let increasing = i == 0 || tau > sorted[i - 1].0;
            if !(tau > 0.0 && tau <= 1.0 && increasing && rate.is_finite() && rate >= 1.0) {
                return Err(SchedError::Config(format!(
                    "mean-rate point ({tau}, {rate}) is invalid: thresholds must be distinct \
                     in (0, 1] and rates finite and at least 1 token per step"
                )));
            }
        }
        Ok(Self {
            taus: sorted.iter().map(|p| p.0).collect(),
            rates: sorted.iter().map(|p| p.1).collect(),
        })
    }

    /// Mean tokens committed per step at threshold `tau`.
    pub fn rate(&self, tau: f64) -> f64 {
        let n = self.taus.len();
        if tau <= self.taus[0] {
            return self.rates[0];
        }
        if tau >= self.taus[n - 1] {
            return self.rates[n - 1];
        }
        let hi = self.taus.partition_point(|&t| t < tau);
        let lo = hi - 1;
        let w = (tau - self.taus[lo]) / (self.taus[hi] - self.taus[lo]);
        self.rates[lo] + w * (self.rates[hi] - self.rates[lo])
    }
}

impl Default for MeanRatePredictor {
    fn default() -> Self {
        Self::new(&Self::FAST_DLLM_GSM8K).expect("built-in rates are valid")
    }
}

impl MeanRatePredictor {
    /// Tokens of evidence the mean rates count for against a request's own record (a
    /// block at the default block length): its speed estimate moves halfway to what it
    /// has shown once its steps were expected to unmask 32 tokens.
    pub const SPEED_PRIOR_TOKENS: f64 = 32.0;

    /// Steps a whole block of `block` positions takes at `rate` tokens per step.
    fn block_steps(block: u32, rate: f64) -> f64 {
        (f64::from(block) / rate).ceil()
    }

    /// *(ours)* How fast `r` has decoded against the rates: the tokens it unmasked over
    /// those its steps would have at the rate of their mean threshold (a block's last
    /// step commits only what is left, so a step counts for `block / steps per block`),
    /// both with [`Self::SPEED_PRIOR_TOKENS`] added; 1 before its first step. Judged at
    /// the mean threshold, a request whose steps ran at very different thresholds reads
    /// slightly off its pace (half at 0.5 and half at 0.9: about 1.05).
    pub fn speed(&self, r: &RequestView) -> f64 {
        let Some(tau) = r.mean_tau_done.filter(|_| r.steps_done > 0) else {
            return 1.0;
        };
        let block = f64::from(r.block_length);
        let per_step = block / Self::block_steps(r.block_length, self.rate(tau));
        let expected = f64::from(r.steps_done) * per_step;
        (f64::from(r.unmasked) + Self::SPEED_PRIOR_TOKENS) / (expected + Self::SPEED_PRIOR_TOKENS)
    }

    /// Steps left for request `r` committing `rate` tokens per step, `per_block` a block.
    fn steps_left(r: &RequestView, rate: f64, per_block: f64) -> StepsLeft {
        let masked = f64::from(r.block_length - r.unmasked_in_block);
        let future = f64::from(r.future_blocks());
        let lost = if r.needs_recompute { 1.0 } else { 0.0 };
        let current = (masked / rate).ceil();
        StepsLeft {
            cache: (current - lost) + future * (per_block - 1.0),
            recompute: future + lost,
        }
    }
}

impl StepPredictor for MeanRatePredictor {
    fn predict(
        &self,
        r: &RequestView,
        thresholds: &[f64],
        out: &mut [StepsLeft],
    ) -> Result<(), PredictError> {
        let speed = self.speed(r);
        for (slot, &tau) in out.iter_mut().zip(thresholds) {
            let rate = (self.rate(tau) * speed).max(1.0);
            *slot = Self::steps_left(r, rate, Self::block_steps(r.block_length, rate));
        }
        Ok(())
    }

    /// The rates depend only on the thresholds, and a block's steps only on them and the
    /// block length: computed once per batch (and block length), not per request, for
    /// requests at the mean speed (before their first step).
    fn predict_batch(
        &self,
        requests: &[RequestView],
        thresholds: &[f64],
        out: &mut [StepsLeft],
    ) -> Result<(), PredictError> {
        let k = thresholds.len();
        let mut rates = [0.0; MAX_THRESHOLDS];
        if k == 0 || k > rates.len() {
            return predict_each(self, requests, thresholds, out);
        }
        let rates = &mut rates[..k];
        for (rate, &tau) in rates.iter_mut().zip(thresholds) {
            *rate = self.rate(tau);
        }
        let mut per_block = [0.0; MAX_THRESHOLDS];
        let per_block = &mut per_block[..k];
        let mut block = None;
        for (request, row) in requests.iter().zip(out.chunks_exact_mut(k)) {
            let speed = self.speed(request);
            if speed != 1.0 {
                // Its own rates, so its own steps per block.
                for (slot, &rate) in row.iter_mut().zip(rates.iter()) {
                    let rate = (rate * speed).max(1.0);
                    let steps = Self::block_steps(request.block_length, rate);
                    *slot = Self::steps_left(request, rate, steps);
                }
                continue;
            }
            if block != Some(request.block_length) {
                block = Some(request.block_length);
                for (steps, &rate) in per_block.iter_mut().zip(rates.iter()) {
                    *steps = Self::block_steps(request.block_length, rate);
                }
            }
            for ((slot, &rate), &steps) in row.iter_mut().zip(rates.iter()).zip(per_block.iter()) {
                *slot = Self::steps_left(request, rate, steps);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(in_block: u32, block: u32, needs_recompute: bool) -> RequestView {
        RequestView {
            id: 7,
            prompt_len: 10,
            output_len: 128,
            block_length: 32,
            steps_done: 0,
            mean_tau_done: None,
            block_steps: 0,
            unmasked: block * 32 + in_block,
            unmasked_in_block: in_block,
            current_block: block,
            needs_recompute,
            confidence: None,
        }
    }

    #[test]
    fn a_request_slower_than_the_rates_is_predicted_more_steps() {
        let p = MeanRatePredictor::default();
        // Two blocks done in 20 steps at τ 0.9 (10 steps a block at 3.25 tokens a step):
        // the mean speed, so the rates stand.
        let on_pace = RequestView {
            steps_done: 20,
            mean_tau_done: Some(0.9),
            ..view(0, 2, true)
        };
        assert!((p.speed(&on_pace) - 1.0).abs() < 1e-12);
        // The same two blocks in 40 steps: half the speed, shrunk towards the rates by a
        // block's worth of tokens, (64 + 32) / (128 + 32).
        let slow = RequestView {
            steps_done: 40,
            ..on_pace
        };
        assert!((p.speed(&slow) - 0.6).abs() < 1e-12);
        let fresh = view(0, 2, true);
        assert_eq!(p.speed(&fresh), 1.0);
        let taus = [0.5, 0.9];
        let (mut a, mut b) = ([StepsLeft::default(); 2], [StepsLeft::default(); 2]);
        p.predict(&fresh, &taus, &mut a).unwrap();
        p.predict(&slow, &taus, &mut b).unwrap();
        for (fresh, slow) in a.iter().zip(&b) {
            assert!(slow.cache > fresh.cache, "{slow:?} vs {fresh:?}");
            assert_eq!(slow.recompute, fresh.recompute);
        }
        // Never slower than a token a step.
        let crawling = RequestView {
            steps_done: 1000,
            ..on_pace
        };
        p.predict(&crawling, &[1.0], &mut a[..1]).unwrap();
        // This block's 32 steps (its first recomputes) and the last block's 32.
        assert_eq!((a[0].cache, a[0].recompute), (62.0, 2.0));
    }

    #[test]
    fn rate_interpolates_and_clamps() {
        let p = MeanRatePredictor::default();
        assert_eq!(p.rate(0.1), 7.01);
        assert_eq!(p.rate(0.9), 3.25);
        assert!((p.rate(0.85) - (4.24 + 3.25) / 2.0).abs() < 1e-12);
        assert_eq!(p.rate(1.0), 1.0);
    }

    #[test]
    fn counts_block_structure() {
        let p = MeanRatePredictor::new(&[(0.5, 8.0), (1.0, 1.0)]).unwrap();
        let mut out = [StepsLeft::default(); 2];
        // Fresh request: 4 blocks of 32, 4 steps per block at rate 8.
        p.predict(&view(0, 0, true), &[0.5, 1.0], &mut out).unwrap();
        assert_eq!(
            out[0],
            StepsLeft {
                cache: 12.0,
                recompute: 4.0
            }
        );
        assert_eq!(
            out[1],
            StepsLeft {
                cache: 124.0,
                recompute: 4.0
            }
        );
        // Mid-block with the cache intact: 20 masked -> 3 cache steps now.
        p.predict(&view(12, 1, false), &[0.5], &mut out[..1])
            .unwrap();
        assert_eq!(
            out[0],
            StepsLeft {
                cache: 3.0 + 6.0,
                recompute: 2.0
            }
        );
        // Same state after a lost cache: one of those steps becomes a recompute step.
        p.predict(&view(12, 1, true), &[0.5], &mut out[..1])
            .unwrap();
        assert_eq!(
            out[0],
            StepsLeft {
                cache: 2.0 + 6.0,
                recompute: 3.0
            }
        );
    }

    #[test]
    fn higher_threshold_never_predicts_fewer_steps() {
        let p = MeanRatePredictor::default();
        let taus = [0.5, 0.6, 0.7, 0.8, 0.9, 1.0];
        let mut out = [StepsLeft::default(); 6];
        p.predict(&view(5, 2, false), &taus, &mut out).unwrap();
        assert!(out.windows(2).all(|w| w[0].total() <= w[1].total()));
    }

    #[test]
    fn batches_predict_what_requests_one_by_one_do() {
        let p = MeanRatePredictor::default();
        // Block lengths change within the batch: 32, 32, 16, 32, ...
        let views: Vec<RequestView> = (0..4)
            .flat_map(|block| [(0, true), (7, false), (15, false)].map(|(i, r)| view(i, block, r)))
            .enumerate()
            .map(|(n, v)| {
                if n % 3 == 2 {
                    RequestView {
                        block_length: 16,
                        ..v
                    }
                } else {
                    v
                }
            })
            // Every other one has run steps at its own speed.
            .map(|v| RequestView {
                steps_done: v.unmasked / 4 * (v.current_block % 2),
                mean_tau_done: Some(0.7),
                ..v
            })
            .collect();
        // Within the stack-sized batch path and past it.
        for k in [1, 6, MAX_THRESHOLDS + 3] {
            let taus: Vec<f64> = (0..k).map(|i| 0.4 + 0.6 * i as f64 / k as f64).collect();
            let mut batched = vec![StepsLeft::default(); views.len() * k];
            p.predict_batch(&views, &taus, &mut batched).unwrap();
            for (v, row) in views.iter().zip(batched.chunks_exact(k)) {
                let mut one = vec![StepsLeft::default(); k];
                p.predict(v, &taus, &mut one).unwrap();
                assert_eq!(row, &one[..]);
            }
        }
        p.predict_batch(&views, &[], &mut []).unwrap();
    }

    #[test]
    fn rejects_bad_points() {
        for bad in [
            vec![],
            vec![(0.5, 0.5)],
            vec![(0.5, 2.0), (0.5, 3.0)],
            vec![(1.5, 2.0)],
        ] {
            assert!(MeanRatePredictor::new(&bad).is_err());
        }
    }

    #[test]
    fn check_rejects_nan_infinite_and_negative() {
        let views = [view(0, 0, true), view(3, 1, false)];
        let taus = [0.5, 0.9];
        let good = StepsLeft {
            cache: 1.0,
            recompute: 0.0,
        };
        let mut out = [good; 4];
        assert_eq!(check_predictions(&views, &taus, &out), Ok(()));
        for bad in [f64::NAN, f64::INFINITY, -0.5] {
            out[3].recompute = bad;
            let err = check_predictions(&views, &taus, &out).unwrap_err();
            assert!(matches!(
                err,
                PredictError::Invalid {
                    request: 7,
                    threshold: 0.9,
                    kind: "recompute",
                    ..
                }
            ));
        }
    }
}
