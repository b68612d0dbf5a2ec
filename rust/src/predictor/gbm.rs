//! [`GbmPredictor`]: the scheduler's [`StepPredictor`] backed by LightGBM boosters.
//!
//! Two boosters trained by `dilaserve predictor train`: one predicts the remaining steps
//! of a request (`predictor.txt`), the other how many of them are recompute steps
//! (`predictor_recompute.txt`); cache steps are the difference. Without the second booster
//! the recompute steps are counted from the block structure (one per block still to open,
//! plus one if the cache was lost), which is exact for requests that decode every block.
//!
//! Outputs are made consistent with what is certain about a live request: at least one
//! step is left; recompute steps lie between the one already due (a block's first step or
//! a lost cache) and one per remaining block, and never exceed the total.

use std::path::{Path, PathBuf};

use super::error::GbmError;
use super::features::FeatureMap;
use super::forest::{normalize, Forest, Varying};
use crate::scheduler::{PredictError, RequestView, StepPredictor, StepsLeft};

/// File name of the recompute booster next to `predictor.txt` (see [`GbmPredictor::load`]).
pub const RECOMPUTE_SUFFIX: &str = "_recompute";

/// Batches of at least this many requests are split over threads.
const PARALLEL_MIN_REQUESTS: usize = 2048;
/// Most threads one batch uses.
const MAX_THREADS: usize = 4;

#[derive(Clone, Debug)]
struct Booster {
    forest: Forest,
    map: FeatureMap,
}

impl Booster {
    fn new(forest: Forest) -> Result<Self, GbmError> {
        let map = FeatureMap::new(forest.feature_names())?;
        Ok(Self { forest, map })
    }
}

/// Remaining-step predictions from LightGBM boosters, evaluated natively.
#[derive(Clone, Debug)]
pub struct GbmPredictor {
    total: Booster,
    recompute: Option<Booster>,
}

impl GbmPredictor {
    /// `total` predicts remaining steps; `recompute`, if given, remaining recompute steps.
    /// Each must use only known features (`features::KNOWN_FEATURES`), the threshold among
    /// them.
    pub fn new(total: Forest, recompute: Option<Forest>) -> Result<Self, GbmError> {
        Ok(Self {
            total: Booster::new(total)?,
            recompute: recompute.map(Booster::new).transpose()?,
        })
    }

    /// Loads `path` (a `predictor.txt`) and, when it exists, its recompute booster
    /// `predictor_recompute.txt` beside it (the stem plus [`RECOMPUTE_SUFFIX`]).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, GbmError> {
        let path = path.as_ref();
        let companion = Self::recompute_path(path);
        let recompute = companion
            .is_file()
            .then(|| Forest::load(&companion))
            .transpose()?;
        Self::new(Forest::load(path)?, recompute)
    }

    /// Where [`Self::load`] looks for the recompute booster of `path`.
    pub fn recompute_path(path: &Path) -> PathBuf {
        let stem = path.file_stem().unwrap_or_default().to_string_lossy();
        let name = match path.extension() {
            Some(ext) => format!("{stem}{RECOMPUTE_SUFFIX}.{}", ext.to_string_lossy()),
            None => format!("{stem}{RECOMPUTE_SUFFIX}"),
        };
        path.with_file_name(name)
    }

    pub fn has_recompute_model(&self) -> bool {
        self.recompute.is_some()
    }

    pub fn total_model(&self) -> &Forest {
        &self.total.forest
    }

    pub fn recompute_model(&self) -> Option<&Forest> {
        self.recompute.as_ref().map(|b| &b.forest)
    }
}

/// One booster's walk state for a batch.
struct Pass<'a> {
    booster: &'a Booster,
    eval: Varying<'a>,
    row: Vec<f64>,
    raw: Vec<f64>,
}

impl<'a> Pass<'a> {
    fn new(booster: &'a Booster, k: usize) -> Self {
        Self {
            booster,
            eval: Varying::new(&booster.forest, booster.map.threshold_column()),
            row: vec![0.0; booster.map.width()],
            raw: vec![0.0; k],
        }
    }

    /// Predictions of `view` at every threshold, left in `self.raw`.
    fn run(&mut self, view: &RequestView, thresholds: &[f64]) {
        self.booster.map.fill(view, &mut self.row);
        self.eval.raw_scores(&self.row, thresholds, &mut self.raw);
        for x in &mut self.raw {
            *x = self.booster.forest.finish(*x);
        }
    }
}

impl StepPredictor for GbmPredictor {
    fn predict(
        &self,
        request: &RequestView,
        thresholds: &[f64],
        out: &mut [StepsLeft],
    ) -> Result<(), PredictError> {
        self.predict_batch(std::slice::from_ref(request), thresholds, out)
    }

    /// Large batches (a burst of arrivals, a refresh of many requests) are split over up
    /// to [`MAX_THREADS`] threads; each request's result does not depend on the split.
    fn predict_batch(
        &self,
        requests: &[RequestView],
        thresholds: &[f64],
        out: &mut [StepsLeft],
    ) -> Result<(), PredictError> {
        let k = thresholds.len();
        if k == 0 {
            return Ok(());
        }
        let taus: Vec<f64> = thresholds.iter().map(|&t| normalize(t)).collect();
        let threads = if requests.len() >= PARALLEL_MIN_REQUESTS {
            std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_THREADS))
        } else {
            1
        };
        if threads <= 1 {
            self.predict_serial(requests, &taus, out);
            return Ok(());
        }
        let per = requests.len().div_ceil(threads);
        std::thread::scope(|scope| {
            for (part, part_out) in requests.chunks(per).zip(out.chunks_mut(per * k)) {
                let taus = &taus;
                scope.spawn(move || self.predict_serial(part, taus, part_out));
            }
        });
        Ok(())
    }
}

impl GbmPredictor {
    fn predict_serial(&self, requests: &[RequestView], taus: &[f64], out: &mut [StepsLeft]) {
        let k = taus.len();
        let mut total = Pass::new(&self.total, k);
        let mut recompute = self.recompute.as_ref().map(|b| Pass::new(b, k));
        for (view, row) in requests.iter().zip(out.chunks_exact_mut(k)) {
            total.run(view, taus);
            if let Some(pass) = recompute.as_mut() {
                pass.run(view, taus);
            }
            let due = if view.needs_recompute { 1.0 } else { 0.0 };
            let blocks = f64::from(view.future_blocks()) + due;
            for (j, slot) in row.iter_mut().enumerate() {
                let steps = total.raw[j].max(1.0);
                let full = recompute
                    .as_ref()
                    .map_or(blocks, |p| p.raw[j].clamp(due, blocks))
                    .min(steps);
                *slot = StepsLeft {
                    cache: steps - full,
                    recompute: full,
                };
            }
        }
    }
}
