//! Latency profiles: measured seconds of one denoising step per TP degree, step kind,
//! batch-token count and, where measured, cached-context length (DESIGN §2). A cache step
//! feeds few tokens but attends to every cached one, so its cost grows with the context
//! even at a fixed batch size. Interpolation lives in `table`, in exactly one place.

mod table;

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

pub use self::table::{interpolate_context, ContextTables, LatencyTable};

/// Format version written by `dilaserve profile`; bumped on incompatible changes.
/// Version 2 added the optional per-table `context`; version-1 files still load.
pub const PROFILE_FORMAT_VERSION: u32 = 2;
const READABLE_VERSIONS: [u32; 2] = [1, 2];

/// What one denoising step computes, which decides its cost.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// First step of a block under an approximate KV cache: full sequence, K/V refreshed.
    Recompute,
    /// Later step of a block under a KV cache: only the block's positions go through the model.
    Cache,
    /// Step without any KV cache: full sequence, nothing stored.
    NoCache,
}

impl StepKind {
    pub const ALL: [StepKind; 3] = [StepKind::Recompute, StepKind::Cache, StepKind::NoCache];

    pub fn as_str(self) -> &'static str {
        match self {
            StepKind::Recompute => "recompute",
            StepKind::Cache => "cache",
            StepKind::NoCache => "no_cache",
        }
    }
}

impl fmt::Display for StepKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for StepKind {
    type Err = ProfileError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "recompute" => Ok(StepKind::Recompute),
            "cache" => Ok(StepKind::Cache),
            "no_cache" | "none" => Ok(StepKind::NoCache),
            other => Err(ProfileError::UnknownStepKind(other.to_string())),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("cannot read latency profile {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("latency profile is not valid JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("latency profile format version {found} is not supported (expected {expected})")]
    Version { found: u32, expected: u32 },
    #[error("unknown step kind {0:?} (expected recompute, cache or no_cache)")]
    UnknownStepKind(String),
    #[error("latency table for tp={tp} kind={kind} has no points")]
    EmptyTable { tp: u32, kind: StepKind },
    #[error(
        "latency table for tp={tp} kind={kind}: point {index} is invalid \
         (token counts must be positive and strictly increasing, seconds positive and finite)"
    )]
    BadPoint {
        tp: u32,
        kind: StepKind,
        index: usize,
    },
    #[error(
        "latency table for tp={tp} kind={kind} appears twice (or mixes tables with and \
         without a context length)"
    )]
    Duplicate { tp: u32, kind: StepKind },
    #[error("TP degree must be at least 1, got {0}")]
    BadDegree(u32),
    #[error("latency profile has no TP degree {tp} (it has {available:?})")]
    MissingDegree { tp: u32, available: Vec<u32> },
    #[error("latency profile has no {kind} table for TP degree {tp}")]
    MissingKind { tp: u32, kind: StepKind },
}

/// Wire format of one table in the profile JSON.
#[derive(Serialize, Deserialize)]
struct TableJson {
    tp: u32,
    kind: StepKind,
    /// Cached tokens per request the table was measured at; absent: context-free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    context: Option<u64>,
    points: Vec<(u64, f64)>,
}

/// One table as the constructors take it: degree, kind, optional context, points.
pub type TableSpec = (u32, StepKind, Option<u64>, Vec<(u64, f64)>);

/// Wire format of the profile JSON file written by `dilaserve profile`.
#[derive(Serialize, Deserialize)]
struct ProfileJson {
    version: u32,
    #[serde(default)]
    model: String,
    #[serde(default)]
    device: String,
    #[serde(default)]
    dtype: String,
    #[serde(default)]
    block_length: u32,
    tables: Vec<TableJson>,
}

/// Latency tables for every (TP degree, step kind) measured on one model and device.
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyProfile {
    pub model: String,
    pub device: String,
    pub dtype: String,
    pub block_length: u32,
    tables: BTreeMap<(u32, StepKind), ContextTables>,
}

impl LatencyProfile {
    /// Builds a profile from context-free `(tp, kind, points)` triples.
    pub fn from_tables(
        tables: impl IntoIterator<Item = (u32, StepKind, Vec<(u64, f64)>)>,
    ) -> Result<Self, ProfileError> {
        Self::from_context_tables(tables.into_iter().map(|(tp, k, p)| (tp, k, None, p)))
    }

    /// Builds a profile from `(tp, kind, context, points)`; a (tp, kind) has either one
    /// context-free table or tables at distinct context lengths.
    pub fn from_context_tables(
        tables: impl IntoIterator<Item = TableSpec>,
    ) -> Result<Self, ProfileError> {
        let mut map: BTreeMap<(u32, StepKind), ContextTables> = BTreeMap::new();
        for (tp, kind, context, points) in tables {
            if tp == 0 {
                return Err(ProfileError::BadDegree(tp));
            }
            if points.is_empty() {
                return Err(ProfileError::EmptyTable { tp, kind });
            }
            let table = LatencyTable::new(&points).map_err(|index| ProfileError::BadPoint {
                tp,
                kind,
                index,
            })?;
            let inserted = match map.get_mut(&(tp, kind)) {
                Some(existing) => existing.insert(context, table),
                None => {
                    let fresh = match context {
                        Some(c) => ContextTables::with_context(c, table),
                        None => ContextTables::context_free(table),
                    };
                    map.insert((tp, kind), fresh);
                    true
                }
            };
            if !inserted {
                return Err(ProfileError::Duplicate { tp, kind });
            }
        }
        Ok(Self {
            model: String::new(),
            device: String::new(),
            dtype: String::new(),
            block_length: 0,
            tables: map,
        })
    }

    pub fn from_json(text: &str) -> Result<Self, ProfileError> {
        let raw: ProfileJson = serde_json::from_str(text)?;
        if !READABLE_VERSIONS.contains(&raw.version) {
            return Err(ProfileError::Version {
                found: raw.version,
                expected: PROFILE_FORMAT_VERSION,
            });
        }
        let mut profile = Self::from_context_tables(
            raw.tables
                .into_iter()
                .map(|t| (t.tp, t.kind, t.context, t.points)),
        )?;
        profile.model = raw.model;
        profile.device = raw.device;
        profile.dtype = raw.dtype;
        profile.block_length = raw.block_length;
        Ok(profile)
    }

    pub fn load(path: impl AsRef<Path>) -> Result<Self, ProfileError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ProfileError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_json(&text)
    }

    pub fn to_json(&self) -> String {
        let raw = ProfileJson {
            version: PROFILE_FORMAT_VERSION,
            model: self.model.clone(),
            device: self.device.clone(),
            dtype: self.dtype.clone(),
            block_length: self.block_length,
            tables: self
                .tables
                .iter()
                .flat_map(|(&(tp, kind), t)| {
                    t.slices().map(move |(context, table)| TableJson {
                        tp,
                        kind,
                        context,
                        points: table.points().collect(),
                    })
                })
                .collect(),
        };
        serde_json::to_string_pretty(&raw).expect("profile serialisation cannot fail")
    }

    /// TP degrees with at least one table, ascending.
    pub fn degrees(&self) -> Vec<u32> {
        let mut d: Vec<u32> = self.tables.keys().map(|k| k.0).collect();
        d.dedup();
        d
    }

    /// The tables of one (TP degree, step kind), or a typed error naming what is missing.
    pub fn table(&self, tp: u32, kind: StepKind) -> Result<&ContextTables, ProfileError> {
        self.tables.get(&(tp, kind)).ok_or_else(|| {
            let available = self.degrees();
            if available.contains(&tp) {
                ProfileError::MissingKind { tp, kind }
            } else {
                ProfileError::MissingDegree { tp, available }
            }
        })
    }

    /// Seconds for one `kind` step over `batch_tokens` fed tokens on a TP-`tp` instance
    /// whose requests hold `context_tokens` cached tokens each (ignored by context-free
    /// tables; see [`interpolate_context`] between and beyond measured contexts).
    pub fn step_time(
        &self,
        tp: u32,
        kind: StepKind,
        batch_tokens: f64,
        context_tokens: f64,
    ) -> Result<f64, ProfileError> {
        Ok(self.table(tp, kind)?.latency(batch_tokens, context_tokens))
    }

    /// Seconds for one `kind` step over `tokens` batch tokens, at the shortest measured
    /// context: exact for full-sequence steps and context-free tables; use
    /// [`Self::step_time`] where the context is known.
    pub fn latency(&self, tp: u32, kind: StepKind, tokens: f64) -> Result<f64, ProfileError> {
        Ok(self.table(tp, kind)?.shortest().latency(tokens))
    }

    /// Checks that every degree in `degrees` has every kind in `kinds`.
    pub fn require(&self, degrees: &[u32], kinds: &[StepKind]) -> Result<(), ProfileError> {
        for &tp in degrees {
            for &kind in kinds {
                self.table(tp, kind)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile() -> LatencyProfile {
        LatencyProfile::from_tables([
            (
                1,
                StepKind::NoCache,
                vec![(64, 0.010), (256, 0.020), (1024, 0.060)],
            ),
            (1, StepKind::Cache, vec![(32, 0.004)]),
            (2, StepKind::NoCache, vec![(64, 0.008), (1024, 0.040)]),
        ])
        .unwrap()
    }

    #[test]
    fn interpolates_between_points() {
        let p = profile();
        let t = p.table(1, StepKind::NoCache).unwrap().shortest();
        assert!((t.latency(64.0) - 0.010).abs() < 1e-12);
        assert!((t.latency(160.0) - 0.015).abs() < 1e-12);
        assert!((t.latency(640.0) - 0.040).abs() < 1e-12);
        assert!((t.latency(1024.0) - 0.060).abs() < 1e-12);
    }

    #[test]
    fn clamps_below_and_extrapolates_above() {
        let p = profile();
        let t = p.table(1, StepKind::NoCache).unwrap().shortest();
        assert_eq!(t.latency(1.0), 0.010);
        // Last segment slope is 0.04 / 768 s per token.
        let expected = 0.060 + 0.04 / 768.0 * 1024.0;
        assert!((t.latency(2048.0) - expected).abs() < 1e-12);
    }

    #[test]
    fn single_point_scales_proportionally_above() {
        let p = profile();
        assert!((p.latency(1, StepKind::Cache, 64.0).unwrap() - 0.008).abs() < 1e-12);
        assert_eq!(p.latency(1, StepKind::Cache, 8.0).unwrap(), 0.004);
    }

    #[test]
    fn missing_degree_and_kind_are_typed_errors() {
        let p = profile();
        match p.latency(4, StepKind::NoCache, 10.0) {
            Err(ProfileError::MissingDegree { tp: 4, available }) => {
                assert_eq!(available, vec![1, 2])
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(matches!(
            p.latency(2, StepKind::Cache, 10.0),
            Err(ProfileError::MissingKind {
                tp: 2,
                kind: StepKind::Cache
            })
        ));
        assert!(p.require(&[1, 2], &[StepKind::NoCache]).is_ok());
        assert!(p.require(&[1, 2], &[StepKind::Cache]).is_err());
    }

    #[test]
    fn rejects_bad_tables() {
        let bad = [
            (1, StepKind::Cache, vec![]),
            (1, StepKind::Cache, vec![(0, 0.1)]),
            (1, StepKind::Cache, vec![(10, 0.1), (10, 0.2)]),
            (1, StepKind::Cache, vec![(10, -0.1)]),
            (1, StepKind::Cache, vec![(10, f64::NAN)]),
        ];
        for t in bad {
            assert!(LatencyProfile::from_tables([t]).is_err());
        }
        assert!(matches!(
            LatencyProfile::from_tables([(0, StepKind::Cache, vec![(1, 0.1)])]),
            Err(ProfileError::BadDegree(0))
        ));
        let dup = LatencyProfile::from_tables([
            (1, StepKind::Cache, vec![(1, 0.1)]),
            (1, StepKind::Cache, vec![(2, 0.1)]),
        ]);
        assert!(matches!(dup, Err(ProfileError::Duplicate { .. })));
    }

    #[test]
    fn json_round_trip_and_errors() {
        let mut p = profile();
        p.model = "tiny".into();
        p.device = "cpu".into();
        p.block_length = 32;
        let back = LatencyProfile::from_json(&p.to_json()).unwrap();
        assert_eq!(back, p);
        assert!(matches!(
            LatencyProfile::from_json("{\"version\": 9, \"tables\": []}"),
            Err(ProfileError::Version { found: 9, .. })
        ));
        assert!(matches!(
            LatencyProfile::from_json("not json"),
            Err(ProfileError::Json(_))
        ));
        let bad_kind = r#"{"version":1,"tables":[{"tp":1,"kind":"warp","points":[[1,0.1]]}]}"#;
        assert!(LatencyProfile::from_json(bad_kind).is_err());
        assert!(matches!(
            LatencyProfile::load("/nonexistent/profile.json"),
            Err(ProfileError::Io { .. })
        ));
    }

    fn with_contexts() -> LatencyProfile {
        LatencyProfile::from_context_tables([
            (
                1,
                StepKind::Cache,
                Some(1024),
                vec![(32, 0.010), (64, 0.014)],
            ),
            (
                1,
                StepKind::Cache,
                Some(256),
                vec![(32, 0.004), (64, 0.006)],
            ),
            (1, StepKind::Recompute, None, vec![(100, 0.02)]),
        ])
        .unwrap()
    }

    #[test]
    fn cache_step_cost_grows_with_context() {
        let p = with_contexts();
        let at = |tokens, context| p.step_time(1, StepKind::Cache, tokens, context).unwrap();
        assert_eq!(
            p.table(1, StepKind::Cache).unwrap().contexts(),
            vec![256, 1024]
        );
        assert!((at(32.0, 256.0) - 0.004).abs() < 1e-12);
        assert!((at(32.0, 640.0) - 0.007).abs() < 1e-12);
        assert!((at(64.0, 1024.0) - 0.014).abs() < 1e-12);
        // Below the shortest context: the shortest; beyond the longest: its slope.
        assert_eq!(at(32.0, 10.0), 0.004);
        assert!((at(32.0, 1792.0) - 0.016).abs() < 1e-12);
        // Context-free tables ignore the context.
        assert_eq!(
            p.step_time(1, StepKind::Recompute, 100.0, 5e4).unwrap(),
            0.02
        );
        assert_eq!(p.latency(1, StepKind::Cache, 32.0).unwrap(), 0.004);
    }

    #[test]
    fn context_tables_round_trip_and_reject_mixing() {
        let p = with_contexts();
        let text = p.to_json();
        assert!(text.contains("\"context\": 256"));
        assert_eq!(LatencyProfile::from_json(&text).unwrap(), p);
        for clash in [Some(256), None] {
            let mixed = LatencyProfile::from_context_tables([
                (1, StepKind::Cache, Some(256), vec![(32, 0.004)]),
                (1, StepKind::Cache, clash, vec![(32, 0.005)]),
            ]);
            assert!(matches!(mixed, Err(ProfileError::Duplicate { .. })));
        }
    }

    #[test]
    fn version_one_files_and_the_shipped_profile_load() {
        let v1 = r#"{"version":1,"tables":[{"tp":1,"kind":"cache","points":[[32,0.01]]}]}"#;
        let p = LatencyProfile::from_json(v1).unwrap();
        assert!(p.table(1, StepKind::Cache).unwrap().contexts().is_empty());
        // Read at run time where cargo runs the test: a test binary reused from a build
        // cache shared with another checkout carries that checkout's path at compile time.
        let root = std::env::var("CARGO_MANIFEST_DIR")
            .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned());
        let shipped = format!("{root}/python/dilaserve/profiles/llada8b_h100_simulated.json");
        let p = LatencyProfile::load(&shipped).unwrap();
        assert_eq!(p.degrees(), vec![1, 2, 4, 8]);
    }

    #[test]
    fn step_kind_parses() {
        for k in StepKind::ALL {
            assert_eq!(k.as_str().parse::<StepKind>().unwrap(), k);
        }
        assert!("x".parse::<StepKind>().is_err());
    }
}
