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
//!
//! The boosters are specialised to the candidate thresholds on first use (and again if
//! the thresholds change; see `specialized`). When the thresholds share specialised trees
//! (few threshold splits, or one threshold), a batch is evaluated by branch-free walks of
//! several requests at a time; otherwise, and beyond 64 thresholds, by one walk per
//! request and tree that forks only at threshold splits.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::error::GbmError;
use super::features::{FeatureMap, KNOWN_FEATURES};
use super::forest::{normalize, Forest, Varying};
use super::specialized::{Specialized, LANES};
use crate::scheduler::{PredictError, RequestView, StepPredictor, StepsLeft};

/// File name of the recompute booster next to `predictor.txt` (see [`GbmPredictor::load`]).
pub const RECOMPUTE_SUFFIX: &str = "_recompute";

/// Batches of at least this many requests are split over threads.
const PARALLEL_MIN_REQUESTS: usize = 2048;
/// Most threads one batch uses.
const MAX_THREADS: usize = 4;
/// A row of any booster's features (boosters use distinct known features).
type Row = [f64; KNOWN_FEATURES.len()];

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

    fn specialize(&self, taus: &[f64]) -> Specialized {
        Specialized::new(&self.forest, self.map.threshold_column(), taus)
    }
}

/// Both boosters specialised to one set of thresholds.
#[derive(Debug)]
struct Specializations {
    total: Specialized,
    recompute: Option<Specialized>,
    /// Lock-step walks pay off (see `Specialized::worthwhile`); else the forking walk runs.
    worthwhile: bool,
}

/// Remaining-step predictions from LightGBM boosters, evaluated natively.
#[derive(Debug)]
pub struct GbmPredictor {
    total: Booster,
    recompute: Option<Booster>,
    /// The boosters specialised to the thresholds of the last call.
    specialized: Mutex<Option<Arc<Specializations>>>,
}

impl GbmPredictor {
    /// `total` predicts remaining steps; `recompute`, if given, remaining recompute steps.
    /// Each must use only known features (`features::KNOWN_FEATURES`), the threshold among
    /// them.
    pub fn new(total: Forest, recompute: Option<Forest>) -> Result<Self, GbmError> {
        Ok(Self {
            total: Booster::new(total)?,
            recompute: recompute.map(Booster::new).transpose()?,
            specialized: Mutex::new(None),
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

    /// The boosters specialised to `taus`, built on the first call with these thresholds.
    fn specializations(&self, taus: &[f64]) -> Option<Arc<Specializations>> {
        if taus.len() > 64 {
            return None;
        }
        let mut cached = self
            .specialized
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(s) = cached.as_ref().filter(|s| s.total.values() == taus) {
            return Some(s.clone()).filter(|s| s.worthwhile);
        }
        let total = self.total.specialize(taus);
        let recompute = self.recompute.as_ref().map(|b| b.specialize(taus));
        let worthwhile = total.worthwhile(self.total.forest.num_trees())
            && recompute.as_ref().is_none_or(|r| {
                r.worthwhile(self.recompute.as_ref().map_or(0, |b| b.forest.num_trees()))
            });
        let built = Arc::new(Specializations {
            total,
            recompute,
            worthwhile,
        });
        *cached = Some(built.clone());
        Some(built).filter(|s| s.worthwhile)
    }

    fn predict_serial(
        &self,
        requests: &[RequestView],
        taus: &[f64],
        spec: Option<&Specializations>,
        out: &mut [StepsLeft],
    ) {
        match spec {
            Some(spec) => self.predict_lanes(requests, taus.len(), spec, out),
            None => self.predict_forking(requests, taus, out),
        }
    }

    /// Groups of [`LANES`] requests through the specialised boosters.
    fn predict_lanes(
        &self,
        requests: &[RequestView],
        k: usize,
        spec: &Specializations,
        out: &mut [StepsLeft],
    ) {
        let mut rows: [Row; LANES] = [[0.0; KNOWN_FEATURES.len()]; LANES];
        let mut rec_rows: [Row; LANES] = [[0.0; KNOWN_FEATURES.len()]; LANES];
        let mut total = vec![0.0; LANES * k];
        let mut recompute = vec![0.0; LANES * k];
        for (group, group_out) in requests.chunks(LANES).zip(out.chunks_mut(LANES * k)) {
            let n = group.len();
            for (view, row) in group.iter().zip(&mut rows) {
                self.total.map.fill(view, row);
            }
            spec.total.raw_scores(&rows[..n], &mut total[..n * k]);
            if let (Some(booster), Some(s)) = (&self.recompute, &spec.recompute) {
                for (view, row) in group.iter().zip(&mut rec_rows) {
                    booster.map.fill(view, row);
                }
                s.raw_scores(&rec_rows[..n], &mut recompute[..n * k]);
            }
            for (l, (view, row)) in group.iter().zip(group_out.chunks_exact_mut(k)).enumerate() {
                let raw = |b: &Booster, v: &[f64], j: usize| b.forest.finish(v[l * k + j]);
                for (j, slot) in row.iter_mut().enumerate() {
                    let full = self.recompute.as_ref().map(|b| raw(b, &recompute, j));
                    *slot = consistent(view, raw(&self.total, &total, j), full);
                }
            }
        }
    }

    /// One forking walk per request and tree (any number of thresholds).
    fn predict_forking(&self, requests: &[RequestView], taus: &[f64], out: &mut [StepsLeft]) {
        let k = taus.len();
        let mut total = Pass::new(&self.total, k);
        let mut recompute = self.recompute.as_ref().map(|b| Pass::new(b, k));
        for (view, row) in requests.iter().zip(out.chunks_exact_mut(k)) {
            total.run(view, taus);
            if let Some(pass) = recompute.as_mut() {
                pass.run(view, taus);
            }
            for (j, slot) in row.iter_mut().enumerate() {
                let full = recompute.as_ref().map(|p| p.raw[j]);
                *slot = consistent(view, total.raw[j], full);
            }
        }
    }
}

/// Booster outputs made consistent with what is certain about a live request.
#[inline]
fn consistent(view: &RequestView, total: f64, recompute: Option<f64>) -> StepsLeft {
    let due = if view.needs_recompute { 1.0 } else { 0.0 };
    let blocks = f64::from(view.future_blocks()) + due;
    let steps = total.max(1.0);
    let full = recompute
        .map_or(blocks, |r| r.clamp(due, blocks))
        .min(steps);
    StepsLeft {
        cache: steps - full,
        recompute: full,
    }
}

/// One booster's forking walk state for a batch.
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
        let spec = self.specializations(&taus);
        let spec = spec.as_deref();
        let threads = if requests.len() >= PARALLEL_MIN_REQUESTS {
            std::thread::available_parallelism().map_or(1, |n| n.get().min(MAX_THREADS))
        } else {
            1
        };
        if threads <= 1 {
            self.predict_serial(requests, &taus, spec, out);
            return Ok(());
        }
        // Whole lane groups per thread.
        let per = requests.len().div_ceil(threads).div_ceil(LANES) * LANES;
        std::thread::scope(|scope| {
            for (part, part_out) in requests.chunks(per).zip(out.chunks_mut(per * k)) {
                let taus = &taus;
                scope.spawn(move || self.predict_serial(part, taus, spec, part_out));
            }
        });
        Ok(())
    }
}
