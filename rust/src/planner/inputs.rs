//! What the planner is asked (DESIGN §7 inputs) and its validation into a `Problem`, the
//! derived per-class and per-(degree, batch) numbers every stage reads. Validation is the
//! only place that looks at raw input, so the models never meet a NaN or an empty list.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::error::PlannerError;
use crate::profile::{LatencyProfile, StepKind};

/// Requests of similar prompt and output length, arriving at `rate` per second (safety
/// margin already applied).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RequestClass {
    pub prompt_tokens: f64,
    pub output_tokens: f64,
    pub rate: f64,
    /// The class's own latency objective in seconds; none: the config's `slo_seconds`.
    /// SLOs that scale with each request's isolated latency give long classes longer ones.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo_seconds: Option<f64>,
}

/// A candidate confidence threshold and the mean tokens committed per step at it (`T_c`).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct ThresholdOption {
    pub threshold: f64,
    pub tokens_per_step: f64,
}

/// A running instance: a TP group of `degree` GPUs on one node.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Instance {
    pub node: usize,
    pub degree: u32,
    pub gpus: Vec<u32>,
}

/// What the cluster runs now: its instances and the batch size (tokens per forward) each
/// TP degree runs at.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Deployment {
    pub instances: Vec<Instance>,
    #[serde(default)]
    pub batch_tokens: BTreeMap<u32, u64>,
}

/// The MILP backend; both may be compiled in, HiGHS is the default.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SolverKind {
    #[default]
    Highs,
    Microlp,
}

impl SolverKind {
    pub fn as_str(self) -> &'static str {
        match self {
            SolverKind::Highs => "highs",
            SolverKind::Microlp => "microlp",
        }
    }
}

fn default_time_limit() -> f64 {
    10.0
}

fn default_mip_gap() -> f64 {
    1e-4
}

fn default_min_improvement() -> f64 {
    0.10
}

fn default_block_length() -> u32 {
    32
}

/// Planner settings: the SLO and the choices the capacity plan ranges over.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannerConfig {
    /// End-to-end latency target of every request, in seconds.
    pub slo_seconds: f64,
    /// TP degrees an instance may have.
    pub degrees: Vec<u32>,
    /// Candidate batch sizes in tokens per forward; each degree runs at one of them.
    pub batch_tokens: Vec<u64>,
    /// Whether workers run the approximate KV cache (recompute + cache steps).
    #[serde(default)]
    pub caching: bool,
    /// With `caching`: the cache is block diffusion's exact one — one recompute step per
    /// request (its prefill), cache steps for the rest.
    #[serde(default)]
    pub exact_cache: bool,
    #[serde(default = "default_block_length")]
    pub block_length: u32,
    /// Wall-clock budget of one planning call; a solve cut short returns its incumbent.
    #[serde(default = "default_time_limit")]
    pub time_limit_seconds: f64,
    /// Relative MIP gap at which a solve may stop.
    #[serde(default = "default_mip_gap")]
    pub mip_gap: f64,
    /// A new plan replaces the current one only if an objective improves by this share.
    #[serde(default = "default_min_improvement")]
    pub min_improvement: f64,
    /// *(ours)* Whether latency slack alone may adopt a plan, as DESIGN §7's rule has it.
    /// Off: only served load and quality do. Where those tie, every class already meets
    /// its SLO at its top threshold, and a faster layout buys latency with a transition
    /// and with throughput per GPU (TP-1 has the most on the shipped profile).
    #[serde(default)]
    pub adopt_for_latency_slack: bool,
    #[serde(default)]
    pub solver: SolverKind,
}

impl PlannerConfig {
    /// Settings with the documented defaults for everything but the SLO and the choices.
    pub fn new(slo_seconds: f64, degrees: Vec<u32>, batch_tokens: Vec<u64>) -> Self {
        Self {
            slo_seconds,
            degrees,
            batch_tokens,
            caching: false,
            exact_cache: false,
            block_length: default_block_length(),
            time_limit_seconds: default_time_limit(),
            mip_gap: default_mip_gap(),
            min_improvement: default_min_improvement(),
            adopt_for_latency_slack: false,
            solver: SolverKind::default(),
        }
    }
}

/// Everything one planning call needs besides the latency profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PlannerInputs {
    pub classes: Vec<RequestClass>,
    pub thresholds: Vec<ThresholdOption>,
    /// GPUs of each node.
    pub node_gpus: Vec<u32>,
    pub config: PlannerConfig,
    /// The running deployment, if any: warm start, adoption baseline and Stage 2 input.
    #[serde(default)]
    pub current: Option<Deployment>,
}

/// A class with the numbers the models use: per step kind, tokens per step and steps per
/// request at each threshold (ascending threshold order); per option and step kind, the
/// seconds of a step (its batch's latency at the class's context) and the instance-seconds
/// one step occupies (its tokens' share of the batch), and whether the step fits the batch.
#[derive(Clone, Debug)]
pub(crate) struct ClassData {
    pub rate: f64,
    /// Its latency objective, seconds.
    pub slo: f64,
    /// Prompt plus block-padded output: the context every step attends to.
    pub sequence: f64,
    pub tokens: Vec<f64>,
    pub steps: Vec<Vec<f64>>,
    pub latency: Vec<Vec<f64>>,
    pub busy: Vec<Vec<f64>>,
    pub fits: Vec<Vec<bool>>,
}

/// One (TP degree, batch size) choice.
#[derive(Clone, Debug)]
pub(crate) struct BatchOption {
    pub degree_index: usize,
    pub batch: u64,
    /// Seconds per token of a full batch of the first step kind (reported throughput).
    pub full_secs_per_token: f64,
}

/// Validated planner inputs.
#[derive(Clone, Debug)]
pub(crate) struct Problem {
    pub classes: Vec<ClassData>,
    /// Ascending by threshold; tokens per step strictly decreasing.
    pub thresholds: Vec<ThresholdOption>,
    /// Ascending.
    pub degrees: Vec<u32>,
    pub options: Vec<BatchOption>,
    pub kinds: Vec<StepKind>,
    pub node_gpus: Vec<u32>,
}

impl Problem {
    /// Options (indices into `options`) of degree index `d`.
    pub fn options_of(&self, d: usize) -> impl Iterator<Item = usize> + '_ {
        (0..self.options.len()).filter(move |&j| self.options[j].degree_index == d)
    }

    pub fn total_rate(&self) -> f64 {
        self.classes.iter().map(|c| c.rate).sum()
    }

    /// `Σ_k rate_k · SLO_k`: the latency slack of a plan whose requests took no time.
    pub fn rate_weighted_slo(&self) -> f64 {
        self.classes.iter().map(|c| c.rate * c.slo).sum()
    }
}

fn positive(x: f64) -> bool {
    x.is_finite() && x > 0.0
}

fn check_setting(
    name: &'static str,
    value: f64,
    ok: bool,
    reason: &'static str,
) -> Result<(), PlannerError> {
    if ok {
        Ok(())
    } else {
        Err(PlannerError::BadSetting {
            name,
            value,
            reason,
        })
    }
}

fn validate_config(c: &PlannerConfig) -> Result<(), PlannerError> {
    check_setting(
        "slo_seconds",
        c.slo_seconds,
        positive(c.slo_seconds),
        "must be positive",
    )?;
    check_setting(
        "time_limit_seconds",
        c.time_limit_seconds,
        positive(c.time_limit_seconds),
        "must be positive",
    )?;
    check_setting(
        "mip_gap",
        c.mip_gap,
        c.mip_gap.is_finite() && (0.0..1.0).contains(&c.mip_gap),
        "must be in [0, 1)",
    )?;
    check_setting(
        "min_improvement",
        c.min_improvement,
        c.min_improvement.is_finite() && c.min_improvement >= 0.0,
        "must be non-negative",
    )?;
    check_setting(
        "block_length",
        c.block_length as f64,
        c.block_length > 0,
        "must be positive",
    )
}

fn validate_thresholds(
    raw: &[ThresholdOption],
    caching: bool,
    block_length: u32,
) -> Result<Vec<ThresholdOption>, PlannerError> {
    if raw.is_empty() {
        return Err(PlannerError::NoThresholds);
    }
    for (index, t) in raw.iter().enumerate() {
        if !(t.threshold.is_finite() && t.threshold > 0.0 && t.threshold <= 1.0) {
            return Err(PlannerError::BadThreshold {
                index,
                reason: format!("threshold {} is not in (0, 1]", t.threshold),
            });
        }
        if !positive(t.tokens_per_step) {
            return Err(PlannerError::BadThreshold {
                index,
                reason: format!("tokens per step {} is not positive", t.tokens_per_step),
            });
        }
        if caching && t.tokens_per_step > block_length as f64 {
            return Err(PlannerError::BadThreshold {
                index,
                reason: format!(
                    "tokens per step {} exceeds the block length {block_length}",
                    t.tokens_per_step
                ),
            });
        }
    }
    let mut sorted = raw.to_vec();
    sorted.sort_by(|a, b| a.threshold.total_cmp(&b.threshold));
    for pair in sorted.windows(2) {
        if pair[0].threshold == pair[1].threshold {
            return Err(PlannerError::BadThreshold {
                index: raw
                    .iter()
                    .position(|t| t.threshold == pair[1].threshold)
                    .unwrap_or(0),
                reason: format!("threshold {} appears twice", pair[1].threshold),
            });
        }
        if pair[1].tokens_per_step >= pair[0].tokens_per_step {
            return Err(PlannerError::BadThreshold {
                index: raw
                    .iter()
                    .position(|t| t.threshold == pair[1].threshold)
                    .unwrap_or(0),
                reason: format!(
                    "threshold {} commits {} tokens per step, not fewer than the {} of the \
                     lower threshold {}",
                    pair[1].threshold,
                    pair[1].tokens_per_step,
                    pair[0].tokens_per_step,
                    pair[0].threshold
                ),
            });
        }
    }
    Ok(sorted)
}

pub(crate) fn validate_degrees(
    degrees: &[u32],
    node_gpus: &[u32],
) -> Result<Vec<u32>, PlannerError> {
    if degrees.is_empty() {
        return Err(PlannerError::NoDegrees);
    }
    let largest = node_gpus.iter().copied().max().unwrap_or(0);
    let mut seen = BTreeSet::new();
    for &degree in degrees {
        if degree == 0 {
            return Err(PlannerError::BadDegree {
                degree,
                reason: "must be at least 1".into(),
            });
        }
        if degree > largest {
            return Err(PlannerError::BadDegree {
                degree,
                reason: format!("no node has that many GPUs (largest has {largest})"),
            });
        }
        if !seen.insert(degree) {
            return Err(PlannerError::BadDegree {
                degree,
                reason: "listed twice".into(),
            });
        }
    }
    Ok(seen.into_iter().collect())
}

pub(crate) fn validate_nodes(node_gpus: &[u32]) -> Result<(), PlannerError> {
    if node_gpus.is_empty() {
        return Err(PlannerError::NoGpus);
    }
    match node_gpus.iter().position(|&g| g == 0) {
        Some(node) => Err(PlannerError::EmptyNode { node }),
        None => Ok(()),
    }
}

fn validate_batches(batches: &[u64]) -> Result<Vec<u64>, PlannerError> {
    if batches.is_empty() {
        return Err(PlannerError::NoBatchSizes);
    }
    let set: BTreeSet<u64> = batches.iter().copied().collect();
    if set.len() != batches.len() || set.contains(&0) {
        return Err(PlannerError::BadBatchSizes(batches.to_vec()));
    }
    Ok(set.into_iter().collect())
}

fn class_data(
    index: usize,
    class: &RequestClass,
    thresholds: &[ThresholdOption],
    config: &PlannerConfig,
) -> Result<ClassData, PlannerError> {
    let (caching, block_length) = (config.caching, f64::from(config.block_length));
    let bad = |reason| PlannerError::BadClass { index, reason };
    if !(class.prompt_tokens.is_finite() && class.prompt_tokens >= 0.0) {
        return Err(bad("prompt tokens must be finite and non-negative"));
    }
    if !positive(class.output_tokens) {
        return Err(bad("output tokens must be positive"));
    }
    if !positive(class.rate) {
        return Err(bad("rate must be positive"));
    }
    if class.slo_seconds.is_some_and(|s| !positive(s)) {
        return Err(bad("its SLO must be positive and finite"));
    }
    // Workers decode whole blocks: the output a request occupies is padded to them.
    let output = (class.output_tokens / block_length).ceil() * block_length;
    let sequence = class.prompt_tokens + output;
    let per_threshold = |f: &dyn Fn(f64) -> f64| -> Vec<f64> {
        thresholds.iter().map(|t| f(t.tokens_per_step)).collect()
    };
    let (tokens, steps) = if caching && config.exact_cache {
        // One prefill of the prompt and first block; every other step is a cache step.
        (
            vec![class.prompt_tokens + block_length, block_length],
            vec![
                per_threshold(&|_| 1.0),
                per_threshold(&|t| (output / t - 1.0).max(0.0)),
            ],
        )
    } else if caching {
        // One recompute step per block over the whole sequence; the rest of each block's
        // steps are cache steps over the block's positions.
        let blocks = output / block_length;
        (
            vec![sequence, block_length],
            vec![
                per_threshold(&|_| blocks),
                per_threshold(&|t| output / t - blocks),
            ],
        )
    } else {
        (vec![sequence], vec![per_threshold(&|t| output / t)])
    };
    Ok(ClassData {
        rate: class.rate,
        slo: class.slo_seconds.unwrap_or(config.slo_seconds),
        sequence,
        tokens,
        steps,
        latency: Vec::new(),
        busy: Vec::new(),
        fits: Vec::new(),
    })
}

/// Fills a class's per-option step costs. A step whose tokens exceed the batch size cannot
/// run at that batch size (the scheduler never puts more than the budget in one batch).
fn class_costs(
    class: &mut ClassData,
    options: &[BatchOption],
    profile: &LatencyProfile,
    degrees: &[u32],
    kinds: &[StepKind],
) -> Result<(), PlannerError> {
    for option in options {
        let batch = option.batch as f64;
        let latency = kinds
            .iter()
            .map(|&k| profile.step_time(degrees[option.degree_index], k, batch, class.sequence))
            .collect::<Result<Vec<f64>, _>>()?;
        class.busy.push(
            latency
                .iter()
                .zip(&class.tokens)
                .map(|(l, tokens)| tokens * l / batch)
                .collect(),
        );
        class
            .fits
            .push(class.tokens.iter().map(|&t| t <= batch).collect());
        class.latency.push(latency);
    }
    Ok(())
}

fn batch_options(
    profile: &LatencyProfile,
    degrees: &[u32],
    batches: &[u64],
    kinds: &[StepKind],
) -> Result<Vec<BatchOption>, PlannerError> {
    profile.require(degrees, kinds)?;
    let mut options = Vec::with_capacity(degrees.len() * batches.len());
    for (degree_index, &degree) in degrees.iter().enumerate() {
        for &batch in batches {
            let full = profile.latency(degree, kinds[0], batch as f64)?;
            options.push(BatchOption {
                degree_index,
                batch,
                full_secs_per_token: full / batch as f64,
            });
        }
    }
    Ok(options)
}

fn validate_deployment(
    current: &Deployment,
    node_gpus: &[u32],
    degrees: &[u32],
    batches: &[u64],
) -> Result<(), PlannerError> {
    validate_placement(current, node_gpus)?;
    for inst in current
        .instances
        .iter()
        .filter(|i| degrees.contains(&i.degree))
    {
        match current.batch_tokens.get(&inst.degree) {
            None => {
                return Err(PlannerError::BadDeployment(format!(
                    "no batch size given for TP degree {}",
                    inst.degree
                )))
            }
            Some(b) if !batches.contains(b) => {
                return Err(PlannerError::BadDeployment(format!(
                    "batch size {b} of TP degree {} is not a candidate batch size",
                    inst.degree
                )))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// Every instance on an existing node, with as many GPUs as its degree, none used twice.
pub(crate) fn validate_placement(
    current: &Deployment,
    node_gpus: &[u32],
) -> Result<(), PlannerError> {
    let bad = |m: String| Err(PlannerError::BadDeployment(m));
    let mut used = BTreeSet::new();
    for (i, inst) in current.instances.iter().enumerate() {
        let Some(&gpus) = node_gpus.get(inst.node) else {
            return bad(format!(
                "instance {i} is on node {} of {}",
                inst.node,
                node_gpus.len()
            ));
        };
        if inst.degree == 0 || inst.gpus.len() != inst.degree as usize {
            return bad(format!(
                "instance {i} has degree {} but {} GPUs",
                inst.degree,
                inst.gpus.len()
            ));
        }
        for &g in &inst.gpus {
            if g >= gpus {
                return bad(format!(
                    "instance {i} uses GPU {g} of node {} with {gpus} GPUs",
                    inst.node
                ));
            }
            if !used.insert((inst.node, g)) {
                return bad(format!("GPU {g} of node {} is used twice", inst.node));
            }
        }
    }
    Ok(())
}

/// Checks every input and derives the numbers the models use.
pub(crate) fn validate(
    inputs: &PlannerInputs,
    profile: &LatencyProfile,
) -> Result<Problem, PlannerError> {
    let config = &inputs.config;
    validate_config(config)?;
    validate_nodes(&inputs.node_gpus)?;
    if inputs.classes.is_empty() {
        return Err(PlannerError::NoClasses);
    }
    let thresholds = validate_thresholds(&inputs.thresholds, config.caching, config.block_length)?;
    let degrees = validate_degrees(&config.degrees, &inputs.node_gpus)?;
    let batches = validate_batches(&config.batch_tokens)?;
    let kinds = if config.caching {
        vec![StepKind::Recompute, StepKind::Cache]
    } else {
        vec![StepKind::NoCache]
    };
    let options = batch_options(profile, &degrees, &batches, &kinds)?;
    let largest = batches.last().copied().unwrap_or(0) as f64;
    let classes = inputs
        .classes
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut class = class_data(i, c, &thresholds, config)?;
            if class.sequence > largest {
                return Err(PlannerError::BadClass {
                    index: i,
                    reason: "its prompt plus block-padded output exceeds every candidate \
                             batch size, so no instance could run one of its steps",
                });
            }
            class_costs(&mut class, &options, profile, &degrees, &kinds)?;
            Ok(class)
        })
        .collect::<Result<Vec<_>, _>>()?;
    if let Some(current) = &inputs.current {
        validate_deployment(current, &inputs.node_gpus, &degrees, &batches)?;
    }
    Ok(Problem {
        classes,
        thresholds,
        degrees,
        options,
        kinds,
        node_gpus: inputs.node_gpus.clone(),
    })
}
