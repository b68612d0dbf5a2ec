//! The step predictor's features (DESIGN §3) from the scheduler's view of a request.
//!
//! Mirrors `dilaserve.predictor.features` (Python), which computes the training data's
//! features: the same names, the same float64 arithmetic, NaN where a state has no value
//! (confidence before a block's first report), so a booster sees at serving time exactly
//! the inputs it was trained on.

use super::error::GbmError;
use super::forest::normalize;
use crate::scheduler::RequestView;

/// DESIGN §3's 11 features, in the order the shipped boosters use.
pub const FEATURE_NAMES: [&str; 11] = [
    "threshold",
    "output_length",
    "full_progress",
    "full_unmask_progress",
    "block_progress",
    "block_unmask_progress",
    "confidence_min",
    "confidence_q25",
    "confidence_median",
    "confidence_mean",
    "confidence_q75",
];

/// Every feature a booster may use: DESIGN §3's, the prompt length (which the one-shot
/// ablation, knowing only lengths and τ, uses) and the blocks not yet finished, the current
/// one included (block diffusion: a block's steps, then the next block's).
pub const KNOWN_FEATURES: [&str; 13] = [
    "threshold",
    "output_length",
    "full_progress",
    "full_unmask_progress",
    "block_progress",
    "block_unmask_progress",
    "confidence_min",
    "confidence_q25",
    "confidence_median",
    "confidence_mean",
    "confidence_q75",
    "prompt_length",
    "remaining_blocks",
];

/// Index of `threshold` in [`KNOWN_FEATURES`].
pub const THRESHOLD: usize = 0;

/// All known features of a request, the threshold slot left at 0.
pub fn known_features(view: &RequestView) -> [f64; KNOWN_FEATURES.len()] {
    let output = f64::from(view.output_len);
    let block = f64::from(view.block_length);
    let conf = view.confidence.unwrap_or([f64::NAN; 5]);
    [
        0.0,
        output,
        f64::from(view.steps_done) / output,
        f64::from(view.unmasked) / output,
        f64::from(view.block_steps) / block,
        f64::from(view.unmasked_in_block) / block,
        conf[0],
        conf[1],
        conf[2],
        conf[3],
        conf[4],
        f64::from(view.prompt_len),
        // Positions of finished blocks: everything unmasked outside the current block.
        (output - f64::from(view.unmasked) + f64::from(view.unmasked_in_block)) / block,
    ]
}

/// Maps a booster's feature columns onto [`KNOWN_FEATURES`].
#[derive(Clone, Debug, PartialEq)]
pub struct FeatureMap {
    /// `columns[j]`: index in [`KNOWN_FEATURES`] of the booster's feature `j`.
    columns: Vec<usize>,
    /// The booster's column holding the threshold.
    threshold: usize,
}

impl FeatureMap {
    /// Checks that every name is a known feature, none twice, and the threshold is one.
    pub fn new(names: &[String]) -> Result<Self, GbmError> {
        let mut columns = Vec::with_capacity(names.len());
        for name in names {
            let index = KNOWN_FEATURES
                .iter()
                .position(|k| k == name)
                .ok_or_else(|| {
                    GbmError::Features(format!(
                        "unknown feature {name:?}; a step predictor uses {KNOWN_FEATURES:?}"
                    ))
                })?;
            if columns.contains(&index) {
                return Err(GbmError::Features(format!(
                    "feature {name:?} appears twice"
                )));
            }
            columns.push(index);
        }
        let threshold = columns
            .iter()
            .position(|&c| c == THRESHOLD)
            .ok_or_else(|| {
                GbmError::Features(
                    "the model does not use the threshold: it cannot rank thresholds".into(),
                )
            })?;
        Ok(Self { columns, threshold })
    }

    pub fn width(&self) -> usize {
        self.columns.len()
    }

    /// The booster's column holding the threshold.
    pub fn threshold_column(&self) -> usize {
        self.threshold
    }

    /// Writes the booster's row for `view` into `row` (its threshold column left at 0),
    /// normalised as LightGBM reads inputs.
    pub fn fill(&self, view: &RequestView, row: &mut [f64]) {
        let all = known_features(view);
        for (slot, &c) in row.iter_mut().zip(&self.columns) {
            *slot = normalize(all[c]);
        }
    }
}
