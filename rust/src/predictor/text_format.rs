//! Parser of LightGBM's text model format (what `Booster.save_model` writes).
//!
//! The header holds `key=value` lines (and a bare `average_output` line for random-forest
//! models); each tree is a `Tree=<i>` line followed by `key=value` lines; `end of trees`
//! closes the forest, and what follows (feature importances, training parameters) is not
//! needed for prediction. Only what prediction reads is checked and kept: a single-output
//! regression forest of numerical splits. Categorical splits, linear trees, several outputs
//! per iteration and objectives whose output transform is not known here are refused.

use std::collections::HashMap;

use super::error::GbmError;
use super::forest::{Forest, Node, OutputTransform, TreeRef, MISSING_NAN};

/// LightGBM's decision-type bits.
const CATEGORICAL_MASK: i8 = 1;
const DEFAULT_LEFT_MASK: i8 = 2;

/// `key=value` lines of one section, with the line number each came from.
struct Section<'a> {
    start: usize,
    fields: HashMap<&'a str, (usize, &'a str)>,
}

impl<'a> Section<'a> {
    fn new(start: usize) -> Self {
        Self {
            start,
            fields: HashMap::new(),
        }
    }

    fn get(&self, key: &str) -> Result<(usize, &'a str), GbmError> {
        self.fields
            .get(key)
            .copied()
            .ok_or_else(|| GbmError::Parse {
                line: self.start,
                reason: format!("missing `{key}=`"),
            })
    }

    fn opt(&self, key: &str) -> Option<(usize, &'a str)> {
        self.fields.get(key).copied()
    }

    fn int(&self, key: &str) -> Result<i64, GbmError> {
        let (line, value) = self.get(key)?;
        value.trim().parse().map_err(|_| GbmError::Parse {
            line,
            reason: format!("`{key}` is not an integer: {value:?}"),
        })
    }

    /// A whitespace-separated list of exactly `len` numbers.
    fn list<T: std::str::FromStr>(&self, key: &str, len: usize) -> Result<Vec<T>, GbmError> {
        let (line, value) = self.get(key)?;
        let items: Vec<T> = value
            .split_whitespace()
            .map(|s| s.parse::<T>())
            .collect::<Result<_, _>>()
            .map_err(|_| GbmError::Parse {
                line,
                reason: format!("`{key}` holds a value that is not a number"),
            })?;
        if items.len() != len {
            return Err(GbmError::Parse {
                line,
                reason: format!("`{key}` has {} values, expected {len}", items.len()),
            });
        }
        Ok(items)
    }
}

/// Splits `text` into the header and one section per tree, stopping at `end of trees`.
fn sections(text: &str) -> Result<(Section<'_>, Vec<Section<'_>>), GbmError> {
    let mut header = Section::new(1);
    let mut trees: Vec<Section<'_>> = Vec::new();
    let mut average_output = false;
    let mut ended = false;
    for (i, raw) in text.lines().enumerate() {
        let line_no = i + 1;
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        if line == "end of trees" {
            ended = true;
            break;
        }
        if line == "average_output" {
            average_output = true;
            continue;
        }
        if let Some(index) = line.strip_prefix("Tree=") {
            if index.trim().parse::<usize>() != Ok(trees.len()) {
                return Err(GbmError::Parse {
                    line: line_no,
                    reason: format!("expected `Tree={}`, found {line:?}", trees.len()),
                });
            }
            trees.push(Section::new(line_no));
            continue;
        }
        let section = trees.last_mut().unwrap_or(&mut header);
        match line.split_once('=') {
            Some((key, value)) => {
                section.fields.insert(key.trim(), (line_no, value));
            }
            // The format's first line names the model type (`tree`).
            None if trees.is_empty() && header.fields.is_empty() => {}
            None => {
                return Err(GbmError::Parse {
                    line: line_no,
                    reason: format!("expected `key=value`, found {line:?}"),
                })
            }
        }
    }
    if !ended {
        return Err(GbmError::Parse {
            line: text.lines().count(),
            reason: "no `end of trees` line: the model text is truncated".into(),
        });
    }
    if average_output {
        header.fields.insert("average_output", (0, "1"));
    }
    Ok((header, trees))
}

/// The output transform of an `objective=` line; unknown objectives are refused.
fn transform_of(line: usize, objective: &str) -> Result<OutputTransform, GbmError> {
    let mut words = objective.split_whitespace();
    let name = words.next().ok_or_else(|| GbmError::Parse {
        line,
        reason: "empty `objective=`".into(),
    })?;
    let sqrt = words.any(|w| w == "sqrt");
    match name {
        "regression" | "regression_l1" | "huber" | "fair" | "quantile" | "mape" => Ok(if sqrt {
            OutputTransform::SignedSquare
        } else {
            OutputTransform::Identity
        }),
        "poisson" | "gamma" | "tweedie" => Ok(OutputTransform::Exp),
        other => Err(GbmError::Unsupported(format!(
            "objective {other:?}: only regression objectives (regression, regression_l1, \
             huber, fair, quantile, mape, poisson, gamma, tweedie) are evaluated natively"
        ))),
    }
}

pub(crate) fn parse(text: &str) -> Result<Forest, GbmError> {
    let (header, tree_sections) = sections(text)?;
    let (version_line, version) = header.get("version")?;
    if !version.trim().starts_with('v') {
        return Err(GbmError::Parse {
            line: version_line,
            reason: format!("unknown model version {version:?}"),
        });
    }
    let (objective_line, objective) = header.opt("objective").ok_or_else(|| {
        GbmError::Unsupported(
            "the model has no `objective=` line (a custom objective): its output transform is \
             unknown"
                .into(),
        )
    })?;
    let transform = transform_of(objective_line, objective)?;
    let num_class = header.int("num_class")?;
    let per_iteration = header.int("num_tree_per_iteration")?;
    if num_class != 1 || per_iteration != 1 {
        return Err(GbmError::Unsupported(format!(
            "{num_class} classes and {per_iteration} trees per iteration: only single-output \
             regression is evaluated natively"
        )));
    }
    let max_feature = header.int("max_feature_idx")?;
    if !(0..=u32::MAX as i64 / 2).contains(&max_feature) {
        return Err(GbmError::Parse {
            line: header.get("max_feature_idx")?.0,
            reason: format!("max_feature_idx {max_feature} is out of range"),
        });
    }
    let num_features = max_feature as usize + 1;
    let feature_names: Vec<String> = header
        .get("feature_names")?
        .1
        .split_whitespace()
        .map(str::to_owned)
        .collect();
    if feature_names.len() != num_features {
        return Err(GbmError::Parse {
            line: header.get("feature_names")?.0,
            reason: format!(
                "{} feature names for max_feature_idx {max_feature}",
                feature_names.len()
            ),
        });
    }
    let mut forest = Forest {
        feature_names,
        transform,
        average_output: header.opt("average_output").is_some(),
        objective: objective.trim().to_owned(),
        nodes: Vec::new(),
        leaves: Vec::new(),
        trees: Vec::with_capacity(tree_sections.len()),
    };
    for section in &tree_sections {
        parse_tree(section, num_features, &mut forest)?;
    }
    Ok(forest)
}

fn parse_tree(s: &Section<'_>, num_features: usize, forest: &mut Forest) -> Result<(), GbmError> {
    let at = |reason: String| GbmError::Parse {
        line: s.start,
        reason,
    };
    let num_leaves = s.int("num_leaves")?;
    if !(1..=i32::MAX as i64 / 2).contains(&num_leaves) {
        return Err(at(format!("num_leaves {num_leaves} is out of range")));
    }
    let num_leaves = num_leaves as usize;
    if s.opt("num_cat").is_some() && s.int("num_cat")? != 0 {
        return Err(GbmError::Unsupported(format!(
            "tree at line {} has categorical splits; train with numerical features only",
            s.start
        )));
    }
    if s.opt("is_linear").is_some() && s.int("is_linear")? != 0 {
        return Err(GbmError::Unsupported(format!(
            "tree at line {} is a linear tree (linear_tree=true)",
            s.start
        )));
    }
    let leaves: Vec<f64> = s.list("leaf_value", num_leaves)?;
    if let Some(bad) = leaves.iter().find(|v| !v.is_finite()) {
        return Err(at(format!("leaf value {bad} is not finite")));
    }
    let node_base = forest.nodes.len();
    let leaf_base = forest.leaves.len();
    let global_leaf = |leaf: usize| !((leaf_base + leaf) as i32);
    if num_leaves == 1 {
        forest.leaves.extend(leaves);
        forest.trees.push(TreeRef {
            root: global_leaf(0),
        });
        return Ok(());
    }
    let n = num_leaves - 1;
    let split_feature: Vec<i64> = s.list("split_feature", n)?;
    let threshold: Vec<f64> = s.list("threshold", n)?;
    let decision_type: Vec<i8> = s.list("decision_type", n)?;
    let left: Vec<i64> = s.list("left_child", n)?;
    let right: Vec<i64> = s.list("right_child", n)?;
    let mut leaf_seen = vec![false; num_leaves];
    for i in 0..n {
        let dt = decision_type[i];
        if dt & CATEGORICAL_MASK != 0 {
            return Err(GbmError::Unsupported(format!(
                "tree at line {}: node {i} is a categorical split; train with numerical \
                 features only",
                s.start
            )));
        }
        let missing = ((dt >> 2) & 3) as u8;
        if missing > MISSING_NAN {
            return Err(at(format!(
                "node {i}: unknown missing-value type {missing}"
            )));
        }
        let feature = split_feature[i];
        if !(0..num_features as i64).contains(&feature) {
            return Err(at(format!(
                "node {i} splits on feature {feature}; the model has {num_features}"
            )));
        }
        if threshold[i].is_nan() {
            return Err(at(format!("node {i} has a NaN threshold")));
        }
        let mut child = |c: i64| -> Result<i32, GbmError> {
            if c >= 0 {
                // Children are created after their parent, which also rules out cycles.
                if c as usize <= i || c as usize >= n {
                    return Err(at(format!("node {i} has invalid child node {c}")));
                }
                Ok((node_base + c as usize) as i32)
            } else {
                let leaf = !c as usize;
                if leaf >= num_leaves || std::mem::replace(&mut leaf_seen[leaf], true) {
                    return Err(at(format!("node {i} has invalid or repeated leaf {leaf}")));
                }
                Ok(global_leaf(leaf))
            }
        };
        let (l, r) = (child(left[i])?, child(right[i])?);
        forest.nodes.push(Node::new(
            threshold[i],
            feature as u32,
            [l, r],
            missing,
            dt & DEFAULT_LEFT_MASK != 0,
        ));
    }
    if leaf_seen.iter().any(|seen| !seen) {
        return Err(at("a leaf is not reachable from the root".into()));
    }
    forest.leaves.extend(leaves);
    forest.trees.push(TreeRef {
        root: node_base as i32,
    });
    Ok(())
}
