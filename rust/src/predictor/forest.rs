//! A parsed LightGBM regression forest and its evaluation.
//!
//! Evaluation follows LightGBM's `Tree::NumericalDecision` and `GBDT::Predict` exactly, so
//! outputs equal `lightgbm.Booster.predict` bit for bit on the same inputs:
//!
//! - an input whose magnitude is at most `kZeroThreshold` (1e-35 as a float) is zero, as
//!   LightGBM's dense-row reader drops it;
//! - at a split whose missing type is `NaN`, a NaN goes the default direction; at a split
//!   whose missing type is `Zero`, NaN and zero go the default direction; at a split whose
//!   missing type is `None`, NaN is read as zero; everything else goes left iff
//!   `value <= threshold`;
//! - the raw score is the sum of every tree's leaf in tree order (starting from 0.0),
//!   divided by the number of trees for `average_output` models, then mapped through the
//!   objective's output transform.
//!
//! [`Forest::predict_varying`] evaluates one row at many values of one feature (the step
//! predictor's threshold) in a single walk of each tree: the walk only forks at splits on
//! that feature, so a request at six thresholds costs little more than at one.

use super::error::GbmError;

/// LightGBM's `kZeroThreshold`: a `float` 1e-35, compared as a `double`.
pub(crate) const ZERO_THRESHOLD: f64 = 1e-35_f32 as f64;

/// Most values [`Forest::predict_varying`] forks over in one pass (one bit each).
const MAX_FORK: usize = 64;

pub(crate) const MISSING_NONE: u8 = 0;
pub(crate) const MISSING_ZERO: u8 = 1;
pub(crate) const MISSING_NAN: u8 = 2;

/// How raw scores become predictions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutputTransform {
    /// `regression`, `regression_l1`, `huber`, `fair`, `quantile`, `mape`.
    Identity,
    /// Those objectives trained with `reg_sqrt`: `sign(x) * x²`.
    SignedSquare,
    /// Log-link objectives: `poisson`, `gamma`, `tweedie`.
    Exp,
}

impl OutputTransform {
    #[inline]
    pub fn apply(self, raw: f64) -> f64 {
        match self {
            OutputTransform::Identity => raw,
            OutputTransform::SignedSquare => raw.signum() * raw * raw,
            OutputTransform::Exp => raw.exp(),
        }
    }
}

/// One internal node. Children `>= 0` are node indices into [`Forest::nodes`]; children
/// `< 0` are `!leaf` with `leaf` an index into [`Forest::leaves`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Node {
    pub threshold: f64,
    pub feature: u32,
    /// Left and right child.
    pub children: [i32; 2],
    /// Where NaN goes (`missing == Zero or NaN`: the default side; `None`: where 0 goes).
    pub nan_left: bool,
    /// Missing type `Zero`: zero also goes the default side.
    pub zero_missing: bool,
    pub default_left: bool,
}

impl Node {
    pub fn new(
        threshold: f64,
        feature: u32,
        children: [i32; 2],
        missing: u8,
        default_left: bool,
    ) -> Self {
        Self {
            threshold,
            feature,
            children,
            nan_left: if missing == MISSING_NONE {
                0.0 <= threshold
            } else {
                default_left
            },
            zero_missing: missing == MISSING_ZERO,
            default_left,
        }
    }

    /// LightGBM's `NumericalDecision` on a value already normalised by [`normalize`].
    #[inline(always)]
    pub fn goes_left(&self, x: f64) -> bool {
        if self.zero_missing && (x == 0.0 || x.is_nan()) {
            return self.default_left;
        }
        // Without branches: a comparison with NaN is false, so NaN takes `nan_left`.
        (x <= self.threshold) | (x.is_nan() & self.nan_left)
    }

    #[inline(always)]
    pub fn child(&self, left: bool) -> i32 {
        self.children[usize::from(!left)]
    }

    #[inline(always)]
    pub fn left(&self) -> i32 {
        self.children[0]
    }

    #[inline(always)]
    pub fn right(&self) -> i32 {
        self.children[1]
    }
}

/// LightGBM reads inputs within ±`kZeroThreshold` as exact zeros.
#[inline(always)]
pub(crate) fn normalize(x: f64) -> f64 {
    if x.abs() <= ZERO_THRESHOLD {
        0.0
    } else {
        x
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct TreeRef {
    /// Root node index, or `!leaf` for a single-leaf tree.
    pub root: i32,
}

/// A LightGBM regression model: one tree per iteration, numerical splits only.
#[derive(Clone, Debug, PartialEq)]
pub struct Forest {
    pub(crate) feature_names: Vec<String>,
    pub(crate) transform: OutputTransform,
    pub(crate) average_output: bool,
    pub(crate) objective: String,
    pub(crate) nodes: Vec<Node>,
    pub(crate) leaves: Vec<f64>,
    pub(crate) trees: Vec<TreeRef>,
}

impl Forest {
    /// Parses LightGBM's text model format (`Booster.save_model` / `model_to_string`).
    pub fn from_text(text: &str) -> Result<Self, GbmError> {
        super::text_format::parse(text)
    }

    /// Loads a LightGBM text model file.
    pub fn load(path: impl AsRef<std::path::Path>) -> Result<Self, GbmError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| GbmError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_text(&text)
    }

    pub fn num_features(&self) -> usize {
        self.feature_names.len()
    }

    pub fn feature_names(&self) -> &[String] {
        &self.feature_names
    }

    pub fn num_trees(&self) -> usize {
        self.trees.len()
    }

    /// The objective line of the model (e.g. `regression`, `poisson`).
    pub fn objective(&self) -> &str {
        &self.objective
    }

    pub fn transform(&self) -> OutputTransform {
        self.transform
    }

    /// Prediction for one row of `num_features()` values.
    pub fn predict_row(&self, row: &[f64]) -> Result<f64, GbmError> {
        let mut out = [0.0];
        self.predict_rows(row, &mut out)?;
        Ok(out[0])
    }

    /// Predictions for row-major `rows`, one per row, into `out`.
    pub fn predict_rows(&self, rows: &[f64], out: &mut [f64]) -> Result<(), GbmError> {
        let width = self.num_features();
        self.check_rows(rows, out.len())?;
        let mut row = vec![0.0; width];
        for (src, slot) in rows.chunks_exact(width.max(1)).zip(out.iter_mut()) {
            for (dst, &x) in row.iter_mut().zip(src) {
                *dst = normalize(x);
            }
            let mut raw = 0.0;
            for tree in &self.trees {
                raw += self.leaves[self.leaf_of(tree.root, &row)];
            }
            *slot = self.finish(raw);
        }
        Ok(())
    }

    /// Evaluates each row of row-major `rows` with feature `vary` set to each of `values`
    /// in turn: `out[r * values.len() + k]` is row `r` at `values[k]` (whatever `rows`
    /// holds in that feature's column is ignored).
    pub fn predict_varying(
        &self,
        rows: &[f64],
        vary: usize,
        values: &[f64],
        out: &mut [f64],
    ) -> Result<(), GbmError> {
        let width = self.num_features();
        if vary >= width {
            return Err(GbmError::Features(format!(
                "feature index {vary} is out of range for a model of {width} features"
            )));
        }
        let k = values.len();
        if k == 0 {
            return self.check_rows(rows, 0).map(|_| ());
        }
        let n = self.check_rows(rows, out.len() / k)?;
        if out.len() != n * k {
            return Err(GbmError::RowWidth {
                expected: n * k,
                got: out.len(),
            });
        }
        let values: Vec<f64> = values.iter().map(|&x| normalize(x)).collect();
        let mut eval = Varying::new(self, vary);
        let mut row = vec![0.0; width];
        for (src, dst) in rows.chunks_exact(width).zip(out.chunks_exact_mut(k)) {
            for (slot, &x) in row.iter_mut().zip(src) {
                *slot = normalize(x);
            }
            eval.raw_scores(&row, &values, dst);
            for slot in dst.iter_mut() {
                *slot = self.finish(*slot);
            }
        }
        Ok(())
    }

    /// Checks that `rows` is a whole number of rows; returns how many, which must equal
    /// `expected_rows`.
    fn check_rows(&self, rows: &[f64], expected_rows: usize) -> Result<usize, GbmError> {
        let width = self.num_features();
        if width == 0 || rows.len() % width != 0 || rows.len() / width != expected_rows {
            return Err(GbmError::RowWidth {
                expected: expected_rows * width,
                got: rows.len(),
            });
        }
        Ok(expected_rows)
    }

    #[inline(always)]
    pub(crate) fn leaf_of(&self, root: i32, row: &[f64]) -> usize {
        let mut node = root;
        while node >= 0 {
            let n = &self.nodes[node as usize];
            node = n.child(n.goes_left(row[n.feature as usize]));
        }
        !node as usize
    }

    #[inline]
    pub(crate) fn finish(&self, raw: f64) -> f64 {
        let raw = if self.average_output && !self.trees.is_empty() {
            raw / self.trees.len() as f64
        } else {
            raw
        };
        self.transform.apply(raw)
    }
}

/// Raw scores of one row at many values of one feature: each tree is walked once, forking
/// only at splits on that feature. Keeps its fork stack between rows.
pub(crate) struct Varying<'a> {
    forest: &'a Forest,
    vary: usize,
    stack: Vec<(i32, u64)>,
}

impl<'a> Varying<'a> {
    pub fn new(forest: &'a Forest, vary: usize) -> Self {
        Self {
            forest,
            vary,
            stack: Vec::with_capacity(64),
        }
    }

    /// Writes the raw (untransformed) score of `row` at each of `values` (already
    /// normalised) into `out`; `row`'s own value of the varying feature is ignored.
    pub fn raw_scores(&mut self, row: &[f64], values: &[f64], out: &mut [f64]) {
        out.fill(0.0);
        for (start, chunk) in (0..values.len())
            .step_by(MAX_FORK)
            .map(|s| (s, &values[s..(s + MAX_FORK).min(values.len())]))
        {
            self.raw_chunk(row, chunk, &mut out[start..start + chunk.len()]);
        }
    }

    /// Adds each tree's leaf to `out[j]` in tree order, as LightGBM sums them.
    fn raw_chunk(&mut self, row: &[f64], values: &[f64], out: &mut [f64]) {
        let forest = self.forest;
        let all = if values.len() == 64 {
            u64::MAX
        } else {
            (1u64 << values.len()) - 1
        };
        let vary = self.vary as u32;
        for tree in &forest.trees {
            self.stack.push((tree.root, all));
            while let Some((mut node, mut mask)) = self.stack.pop() {
                while node >= 0 {
                    let n = &forest.nodes[node as usize];
                    if n.feature != vary {
                        node = n.child(n.goes_left(row[n.feature as usize]));
                        continue;
                    }
                    let mut left = 0u64;
                    let mut bits = mask;
                    while bits != 0 {
                        let j = bits.trailing_zeros();
                        bits &= bits - 1;
                        left |= u64::from(n.goes_left(values[j as usize])) << j;
                    }
                    let right = mask & !left;
                    if right == 0 {
                        node = n.left();
                    } else if left == 0 {
                        node = n.right();
                    } else {
                        self.stack.push((n.right(), right));
                        node = n.left();
                        mask = left;
                    }
                }
                let v = forest.leaves[!node as usize];
                if mask == all {
                    for slot in out.iter_mut() {
                        *slot += v;
                    }
                } else {
                    let mut bits = mask;
                    while bits != 0 {
                        let j = bits.trailing_zeros() as usize;
                        bits &= bits - 1;
                        out[j] += v;
                    }
                }
            }
        }
    }
}
