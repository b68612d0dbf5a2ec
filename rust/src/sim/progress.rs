//! Denoising progress of the simulated workers: how many tokens a step commits, drawn from
//! counts recorded while a real model decoded (per threshold and position in the block),
//! and the answer accuracy measured at each threshold.

use rand::rngs::SmallRng;
use rand::RngExt;
use serde::{Deserialize, Serialize};

use super::error::SimError;

/// Recorded per-step commit counts of one model.
///
/// `commits[t][b]` holds the tokens committed by steps run at `thresholds[t]` that began
/// with a fraction of their block in `[b, b + 1) / buckets` already unmasked (a bucket may
/// be empty where a threshold commits too fast to stop there). Counts are
/// real numbers so that a model's record can be rescaled to another model's mean rates.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ProgressModel {
    pub model: String,
    /// Block length the counts were recorded at; other block lengths scale them.
    pub block_length: u32,
    /// Ascending.
    pub thresholds: Vec<f64>,
    pub commits: Vec<Vec<Vec<f64>>>,
    /// Share of right answers at each threshold.
    pub accuracy: Vec<f64>,
}

impl ProgressModel {
    pub fn from_json(text: &str) -> Result<Self, SimError> {
        let model: Self = serde_json::from_str(text)
            .map_err(|e| SimError::Progress(format!("not a progress model: {e}")))?;
        model.validated()
    }

    /// A JSON list of progress models (one per workload class), each checked.
    pub fn list_from_json(text: &str) -> Result<Vec<Self>, SimError> {
        let models: Vec<Self> = serde_json::from_str(text)
            .map_err(|e| SimError::Progress(format!("not a list of progress models: {e}")))?;
        models.into_iter().map(Self::validated).collect()
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("a progress model serializes")
    }

    fn validated(self) -> Result<Self, SimError> {
        let bad = |why: String| Err(SimError::Progress(why));
        let n = self.thresholds.len();
        if n == 0 {
            return bad("no thresholds".into());
        }
        if self.block_length == 0 {
            return bad("block length must be at least 1".into());
        }
        if self.thresholds.windows(2).any(|w| w[0] >= w[1])
            || self.thresholds.iter().any(|t| !(*t > 0.0 && *t <= 1.0))
        {
            return bad(format!(
                "thresholds must be ascending within (0, 1], got {:?}",
                self.thresholds
            ));
        }
        if self.commits.len() != n || self.accuracy.len() != n {
            return bad(format!(
                "{n} thresholds but {} commit tables and {} accuracies",
                self.commits.len(),
                self.accuracy.len()
            ));
        }
        let buckets = self.commits[0].len();
        for (t, table) in self.commits.iter().enumerate() {
            if table.len() != buckets || buckets == 0 {
                return bad(format!(
                    "threshold {}: every threshold needs the same non-zero number of buckets",
                    self.thresholds[t]
                ));
            }
            if table.iter().all(|counts| counts.is_empty()) {
                return bad(format!(
                    "threshold {}: no recorded step",
                    self.thresholds[t]
                ));
            }
            if table
                .iter()
                .flatten()
                .any(|c| !(c.is_finite() && *c >= 1.0))
            {
                return bad(format!(
                    "threshold {}: a step commits at least one token",
                    self.thresholds[t]
                ));
            }
        }
        if self.accuracy.iter().any(|a| !(0.0..=1.0).contains(a)) {
            return bad(format!(
                "accuracies must be in [0, 1], got {:?}",
                self.accuracy
            ));
        }
        Ok(self)
    }

    /// Index of the recorded threshold nearest `tau`.
    fn nearest(&self, tau: f64) -> usize {
        let mut best = 0;
        for (i, t) in self.thresholds.iter().enumerate() {
            if (t - tau).abs() < (self.thresholds[best] - tau).abs() {
                best = i;
            }
        }
        best
    }

    /// Tokens one step at `tau` commits in a block of `block_length` positions of which
    /// `unmasked_in_block` are already unmasked: a recorded count (scaled to the block
    /// length, stochastically rounded), at least one and at most what the block has left.
    pub fn sample(
        &self,
        tau: f64,
        unmasked_in_block: u32,
        block_length: u32,
        rng: &mut SmallRng,
    ) -> u32 {
        let t = self.nearest(tau);
        let bucket = self.bucket(t, unmasked_in_block, block_length);
        let recorded = self.recorded_near(t, bucket);
        self.draw(t, recorded, unmasked_in_block, block_length, rng)
    }

    /// Bucket of a step at recorded threshold `t` that begins with `unmasked_in_block` of
    /// `block_length` positions unmasked.
    fn bucket(&self, t: usize, unmasked_in_block: u32, block_length: u32) -> usize {
        let buckets = self.commits[t].len();
        let fraction = f64::from(unmasked_in_block) / f64::from(block_length.max(1));
        ((fraction * buckets as f64) as usize).min(buckets - 1)
    }

    /// The bucket with records nearest `bucket` at recorded threshold `t` (a fast
    /// threshold may jump over a bucket: its nearest recorded neighbour stands in).
    fn recorded_near(&self, t: usize, bucket: usize) -> usize {
        let table = &self.commits[t];
        (0..table.len())
            .filter(|&b| !table[b].is_empty())
            .min_by_key(|&b| b.abs_diff(bucket))
            .expect("validated: every threshold has a recorded step")
    }

    /// One of the counts recorded at threshold `t` in bucket `recorded`, scaled to the
    /// block length and rounded stochastically, within the block's room.
    fn draw(
        &self,
        t: usize,
        recorded: usize,
        unmasked_in_block: u32,
        block_length: u32,
        rng: &mut SmallRng,
    ) -> u32 {
        let counts = &self.commits[t][recorded];
        let left = block_length.saturating_sub(unmasked_in_block).max(1);
        let recorded = counts[rng.random_range(0..counts.len())];
        let scaled = recorded * f64::from(block_length) / f64::from(self.block_length);
        let whole = scaled.floor();
        let count = whole as u32 + u32::from(rng.random::<f64>() < scaled - whole);
        count.clamp(1, left)
    }

    /// Accuracy at `tau`, linear between recorded thresholds.
    pub fn accuracy(&self, tau: f64) -> f64 {
        interpolate(&self.thresholds, &self.accuracy, tau)
    }

    /// Mean tokens per step at each recorded threshold, over all buckets' records.
    pub fn mean_rates(&self) -> Vec<(f64, f64)> {
        self.thresholds
            .iter()
            .zip(&self.commits)
            .map(|(&t, table)| {
                let (sum, n) = table
                    .iter()
                    .flatten()
                    .fold((0.0, 0usize), |(s, n), c| (s + c, n + 1));
                (t, sum / n as f64)
            })
            .collect()
    }
}

/// [`ProgressModel::sample`] and [`ProgressModel::accuracy`] with their lookups done once
/// for the thresholds a scheduler uses: the simulator draws for every request of every
/// step. Same values and the same random draws.
pub(crate) struct Draws<'a> {
    model: &'a ProgressModel,
    /// Per known threshold: its nearest recorded threshold and the accuracy at it.
    known: Vec<(f64, usize, f64)>,
    /// Per recorded threshold and bucket: the nearest bucket with records.
    recorded: Vec<Vec<usize>>,
}

impl<'a> Draws<'a> {
    pub fn new(model: &'a ProgressModel, taus: &[f64]) -> Self {
        Self {
            model,
            known: taus
                .iter()
                .map(|&tau| (tau, model.nearest(tau), model.accuracy(tau)))
                .collect(),
            recorded: (0..model.commits.len())
                .map(|t| {
                    (0..model.commits[t].len())
                        .map(|b| model.recorded_near(t, b))
                        .collect()
                })
                .collect(),
        }
    }

    fn known(&self, tau: f64) -> Option<&(f64, usize, f64)> {
        self.known.iter().find(|k| k.0 == tau)
    }

    pub fn sample(
        &self,
        tau: f64,
        unmasked_in_block: u32,
        block_length: u32,
        rng: &mut SmallRng,
    ) -> u32 {
        let m = self.model;
        let t = self.known(tau).map_or_else(|| m.nearest(tau), |k| k.1);
        let recorded = self.recorded[t][m.bucket(t, unmasked_in_block, block_length)];
        m.draw(t, recorded, unmasked_in_block, block_length, rng)
    }

    pub fn accuracy(&self, tau: f64) -> f64 {
        self.known(tau)
            .map_or_else(|| self.model.accuracy(tau), |k| k.2)
    }
}

/// `ys` at `x` over ascending `xs`, linear between points, flat outside them.
pub(crate) fn interpolate(xs: &[f64], ys: &[f64], x: f64) -> f64 {
    let i = xs.partition_point(|&v| v < x);
    if i == 0 {
        return ys[0];
    }
    if i == xs.len() {
        return ys[xs.len() - 1];
    }
    let w = (x - xs[i - 1]) / (xs[i] - xs[i - 1]);
    ys[i - 1] + w * (ys[i] - ys[i - 1])
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn model() -> ProgressModel {
        ProgressModel {
            model: "test".into(),
            block_length: 8,
            thresholds: vec![0.5, 0.9],
            commits: vec![vec![vec![6.0], vec![2.0]], vec![vec![2.0], vec![1.0]]],
            accuracy: vec![0.8, 1.0],
        }
    }

    #[test]
    fn samples_follow_threshold_position_and_block_room() {
        let m = model();
        let mut rng = SmallRng::seed_from_u64(0);
        assert_eq!(m.sample(0.5, 0, 8, &mut rng), 6);
        assert_eq!(m.sample(0.5, 4, 8, &mut rng), 2, "second half of the block");
        assert_eq!(m.sample(0.9, 0, 8, &mut rng), 2);
        assert_eq!(
            m.sample(0.55, 0, 8, &mut rng),
            6,
            "nearest recorded threshold"
        );
        assert_eq!(
            m.sample(0.5, 7, 8, &mut rng),
            1,
            "never past the block's end"
        );
        let mut skipped = model();
        skipped.commits[0][1].clear();
        assert_eq!(
            skipped.sample(0.5, 4, 8, &mut rng),
            4,
            "nearest recorded bucket, capped"
        );
        // A block twice as long commits twice as many per step.
        assert_eq!(m.sample(0.5, 0, 16, &mut rng), 12);
    }

    #[test]
    fn draws_match_the_model_draw_for_draw() {
        let mut m = model();
        m.commits[0][1].clear();
        let draws = Draws::new(&m, &[0.5, 0.9]);
        let (mut a, mut b) = (SmallRng::seed_from_u64(3), SmallRng::seed_from_u64(3));
        // Known thresholds, one that is not (0.55), buckets with and without records.
        for (i, tau) in [0.5, 0.9, 0.55, 0.5]
            .into_iter()
            .cycle()
            .take(200)
            .enumerate()
        {
            let (unmasked, block) = ((i % 8) as u32, if i % 3 == 0 { 16 } else { 8 });
            assert_eq!(
                draws.sample(tau, unmasked, block, &mut a),
                m.sample(tau, unmasked, block, &mut b)
            );
            assert_eq!(draws.accuracy(tau), m.accuracy(tau));
        }
    }

    #[test]
    fn fractional_counts_round_to_their_mean() {
        let mut m = model();
        m.commits[0][0] = vec![2.5];
        let mut rng = SmallRng::seed_from_u64(1);
        let n = 20_000;
        let sum: u32 = (0..n).map(|_| m.sample(0.5, 0, 8, &mut rng)).sum();
        let mean = f64::from(sum) / f64::from(n);
        assert!((mean - 2.5).abs() < 0.03, "mean {mean}");
    }

    #[test]
    fn accuracy_interpolates_and_rates_average() {
        let m = model();
        assert!((m.accuracy(0.7) - 0.9).abs() < 1e-12);
        assert_eq!(m.accuracy(0.1), 0.8);
        assert_eq!(m.mean_rates(), vec![(0.5, 4.0), (0.9, 1.5)]);
    }

    #[test]
    fn rejects_malformed_models() {
        let mut bad = vec![];
        let mut m = model();
        m.thresholds = vec![0.9, 0.5];
        bad.push(m);
        let mut m = model();
        m.commits[1][0].clear();
        m.commits[1][1].clear();
        bad.push(m);
        let mut m = model();
        m.commits[1][0] = vec![0.0];
        bad.push(m);
        let mut m = model();
        m.accuracy = vec![0.5];
        bad.push(m);
        for m in bad {
            assert!(ProgressModel::from_json(&m.to_json()).is_err());
        }
        assert_eq!(
            ProgressModel::from_json(&model().to_json()).unwrap(),
            model()
        );
    }
}
