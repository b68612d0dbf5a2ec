//! Step costs of one TP degree, read from the latency profile (DESIGN §2, §5).
//!
//! Measured tables can dip where a larger batch happened to run faster; the scheduler uses
//! their running maximum so that cost never decreases with batch tokens *(ours)*, and it
//! interpolates them so that this holds exactly in floating point too: instance choice
//! prunes its search with lower bounds that rely on it (see `choice_tree`). Cache steps also
//! depend on the cached context they attend to; where the profile measured several context
//! lengths the cost interpolates between them.

use crate::profile::{interpolate_context, LatencyProfile, LatencyTable, ProfileError, StepKind};

/// A latency table made non-decreasing, interpolated like [`crate::profile::LatencyTable`]
/// but with each segment's value clamped between its end points, so that rounding never
/// makes a larger batch cheaper.
#[derive(Clone, Debug)]
struct MonotoneTable {
    tokens: Vec<f64>,
    seconds: Vec<f64>,
}

impl MonotoneTable {
    fn new(table: &LatencyTable) -> Self {
        let mut worst = 0.0f64;
        let (tokens, seconds) = table
            .points()
            .map(|(tokens, secs)| {
                worst = worst.max(secs);
                (tokens as f64, worst)
            })
            .unzip();
        Self { tokens, seconds }
    }

    fn latency(&self, x: f64) -> f64 {
        let (t, s) = (&self.tokens, &self.seconds);
        let n = t.len();
        if n == 1 || x <= t[0] {
            if n == 1 && x > t[0] {
                // One point: cost proportional to tokens beyond it.
                return (s[0] * x / t[0]).max(s[0]);
            }
            return s[0];
        }
        let hi = t.partition_point(|&v| v < x).min(n - 1);
        let lo = hi - 1;
        let slope = (s[hi] - s[lo]) / (t[hi] - t[lo]);
        if x > t[n - 1] {
            return s[n - 1] + slope * (x - t[n - 1]);
        }
        (s[lo] + slope * (x - t[lo])).max(s[lo]).min(s[hi])
    }

    fn points(&self) -> impl Iterator<Item = f64> + '_ {
        self.tokens.iter().copied()
    }
}

/// Non-decreasing cache-step tables at each measured context length (one, context-free,
/// for profiles without that dimension).
#[derive(Clone, Debug)]
struct ContextCosts {
    contexts: Vec<f64>,
    tables: Vec<MonotoneTable>,
}

impl ContextCosts {
    fn new(profile: &LatencyProfile, tp: u32, kind: StepKind) -> Result<Self, ProfileError> {
        let measured = profile.table(tp, kind)?;
        Ok(Self {
            contexts: measured.contexts().iter().map(|&c| c as f64).collect(),
            tables: measured
                .slices()
                .map(|(_, t)| MonotoneTable::new(t))
                .collect(),
        })
    }

    fn latency(&self, tokens: f64, context: f64) -> f64 {
        interpolate_context(&self.contexts, context, |i| self.tables[i].latency(tokens))
    }
}

/// Most tokens [`DegreeCosts::full_tokens`] reads from its table (512 KiB of it).
const FULL_TABLE_TOKENS: u64 = 1 << 16;

/// Non-decreasing step-latency tables of one TP degree.
#[derive(Clone, Debug)]
pub struct DegreeCosts {
    pub tp: u32,
    /// Full-sequence steps: recompute steps with caching, no-cache steps without.
    full: MonotoneTable,
    /// `full` at every whole number of tokens up to the default budget: instance choice
    /// prices a step at each node it visits, and a lookup is several times cheaper than
    /// interpolating (same values).
    full_by_tokens: Vec<f64>,
    /// Block-only steps by cached context; present only with caching.
    cache: Option<ContextCosts>,
    /// Full-sequence tokens per second at the best batch size within `default_budget`
    /// (no caching only; with caching throughput depends on sequence lengths).
    full_throughput: f64,
    default_budget: u64,
    /// *(ours)* Block diffusion's exact cache: a block's "full" step is no recompute but a
    /// cache step feeding the finished block with the new one ([`Self::full_step`]).
    pub(crate) exact: bool,
}

/// What bounds one instance's throughput: its batch budget and its resident capacity.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Limits {
    pub budget: u64,
    pub kv_tokens: Option<u64>,
    pub max_requests: Option<u32>,
}

impl Limits {
    /// An instance limited only by the batch budget.
    pub fn budget(budget: u64) -> Self {
        Self {
            budget,
            kv_tokens: None,
            max_requests: None,
        }
    }
}

/// Best full-sequence tokens per second of `full` in steps of at most `budget` tokens.
fn best_full_rate(full: &MonotoneTable, budget: f64) -> f64 {
    full.points()
        .filter(|&tokens| tokens <= budget)
        .chain([budget])
        .map(|tokens| tokens / full.latency(tokens))
        .fold(0.0, f64::max)
}

impl DegreeCosts {
    pub fn new(
        profile: &LatencyProfile,
        tp: u32,
        caching: bool,
        max_batch_tokens: u64,
    ) -> Result<Self, ProfileError> {
        let full_kind = if caching {
            StepKind::Recompute
        } else {
            StepKind::NoCache
        };
        // A full-sequence step's batch tokens are its context, so its table has none.
        let full = MonotoneTable::new(profile.table(tp, full_kind)?.shortest());
        let cache = if caching {
            Some(ContextCosts::new(profile, tp, StepKind::Cache)?)
        } else {
            None
        };
        let full_throughput = best_full_rate(&full, max_batch_tokens as f64);
        let full_by_tokens = (0..=max_batch_tokens.min(FULL_TABLE_TOKENS))
            .map(|tokens| full.latency(tokens as f64))
            .collect();
        Ok(Self {
            tp,
            full,
            full_by_tokens,
            cache,
            full_throughput,
            default_budget: max_batch_tokens,
            exact: false,
        })
    }

    /// These costs under block diffusion's exact cache (`exact`), else unchanged.
    pub fn exact(mut self, exact: bool) -> Self {
        self.exact = exact && self.cache.is_some();
        self
    }

    /// Seconds of a request's full step alone ([`super::request::Request::full_step_tokens`] of a
    /// `seq`-token request).
    pub fn full_step(&self, block: f64, seq: f64) -> f64 {
        if self.exact {
            self.cache(2.0 * block, seq)
        } else {
            self.full(seq)
        }
    }

    /// Seconds of a full-sequence step over `tokens` batch tokens.
    pub fn full(&self, tokens: f64) -> f64 {
        self.full.latency(tokens)
    }

    /// [`Self::full`] at a whole number of tokens.
    pub fn full_tokens(&self, tokens: u64) -> f64 {
        match usize::try_from(tokens)
            .ok()
            .and_then(|t| self.full_by_tokens.get(t))
        {
            Some(&secs) => secs,
            None => self.full(tokens as f64),
        }
    }

    /// Seconds of a cache step over `tokens` batch tokens whose requests hold `context`
    /// tokens each (full-step cost without caching).
    pub fn cache(&self, tokens: f64, context: f64) -> f64 {
        match &self.cache {
            Some(t) => t.latency(tokens, context),
            None => self.full.latency(tokens),
        }
    }

    /// Seconds of a batch holding `full_tokens` full-sequence and `cache_tokens` cache-step
    /// tokens, the latter over requests of `context` tokens: the two shapes run as separate
    /// forwards.
    pub fn batch(&self, full_tokens: u64, cache_tokens: u64, context: f64) -> f64 {
        let mut secs = 0.0;
        if full_tokens > 0 {
            secs += self.full_tokens(full_tokens);
        }
        if cache_tokens > 0 {
            secs += self.cache(cache_tokens as f64, context);
        }
        secs
    }

    /// Load tokens (DESIGN §5 units) one instance with `limits` processes per second.
    ///
    /// Without caching: the best `b / LP(b)` for `b` within the batch budget. With caching,
    /// the per-block mix of DESIGN §5 at the predicted `steps_per_block` (DESIGN writes
    /// `B − 1` cache steps, which holds only at one token per step): `max_seqs` requests of
    /// `mean_seq_tokens` each run `steps_per_block − 1` cache steps (attending to their
    /// whole sequence) and one recompute step per block, where *(ours)* `max_seqs` is how
    /// many mean-length sequences fit the batch budget.
    ///
    /// *(ours)* Under the exact cache a block's full step feeds two blocks, with the same
    /// context as its cache steps ([`Self::full_step_tokens`]).
    ///
    /// *(ours)* Resident capacity bounds both: the requests in a batch are resident, so a
    /// step holds at most `kv_tokens` tokens and `max_requests` sequences.
    pub fn throughput(
        &self,
        mean_seq_tokens: f64,
        block: u32,
        steps_per_block: f64,
        limits: Limits,
    ) -> f64 {
        let seq = mean_seq_tokens.max(1.0);
        let mut room = limits.budget as f64;
        if let Some(kv) = limits.kv_tokens {
            room = room.min(kv as f64);
        }
        let Some(cache) = &self.cache else {
            if let Some(m) = limits.max_requests {
                room = room.min(f64::from(m) * seq);
            }
            if room == self.default_budget as f64 {
                return self.full_throughput;
            }
            return best_full_rate(&self.full, room);
        };
        let b = f64::from(block);
        let mut max_seqs = (room / seq).floor().max(1.0);
        if let Some(m) = limits.max_requests {
            max_seqs = max_seqs.min(f64::from(m));
        }
        let cache_steps = (steps_per_block.min(b) - 1.0).max(0.0);
        let full = max_seqs * if self.exact { 2.0 * b } else { seq };
        let full_secs = if self.exact {
            cache.latency(full, seq)
        } else {
            self.full(full)
        };
        let tokens = b * max_seqs * cache_steps + full;
        let secs = cache.latency(b * max_seqs, seq) * cache_steps + full_secs;
        tokens / secs
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
                vec![(100, 0.010), (200, 0.009), (400, 0.030)],
            ),
            (1, StepKind::Recompute, vec![(100, 0.010), (1000, 0.050)]),
            (1, StepKind::Cache, vec![(32, 0.002), (320, 0.004)]),
        ])
        .unwrap()
    }

    #[test]
    fn dips_are_flattened() {
        let c = DegreeCosts::new(&profile(), 1, false, 400).unwrap();
        assert_eq!(c.full(200.0), 0.010);
        assert_eq!(c.full(150.0), 0.010);
        assert!((c.full(300.0) - 0.020).abs() < 1e-12);
        let xs: Vec<f64> = (1..60).map(|i| f64::from(i) * 10.0).collect();
        assert!(xs.windows(2).all(|w| c.full(w[0]) <= c.full(w[1])));
    }

    #[test]
    fn cost_never_decreases_even_by_rounding() {
        // Awkward slopes whose interpolation rounds past a segment's end point.
        let odd = LatencyProfile::from_tables([(
            1,
            StepKind::NoCache,
            vec![
                (3, 0.1),
                (7, 0.1 + 1e-17),
                (13, 0.3),
                (29, 0.7000000000000001),
            ],
        )])
        .unwrap();
        let c = DegreeCosts::new(&odd, 1, false, 100).unwrap();
        let mut last = 0.0;
        for i in 0..4000 {
            let x = f64::from(i) * 0.0123;
            let y = c.full(x);
            assert!(y >= last, "cost at {x} dips below the cost before it");
            last = y;
        }
        let one = LatencyProfile::from_tables([(1, StepKind::NoCache, vec![(3, 0.1)])]).unwrap();
        let c = DegreeCosts::new(&one, 1, false, 100).unwrap();
        assert!(c.full(3.0000000001) >= c.full(3.0));
    }

    #[test]
    fn whole_token_costs_equal_interpolated_ones() {
        for budget in [1, 150, 1000] {
            let c = DegreeCosts::new(&profile(), 1, true, budget).unwrap();
            for tokens in (0..3 * budget).chain([u64::MAX / 2]) {
                assert_eq!(c.full_tokens(tokens), c.full(tokens as f64), "{tokens}");
            }
        }
    }

    #[test]
    fn throughput_without_caching_is_best_point_within_budget() {
        let c = DegreeCosts::new(&profile(), 1, false, 400).unwrap();
        // 100/0.01 = 10k, 200/0.01 = 20k, 400/0.03 = 13.3k tokens/s.
        assert!((c.throughput(0.0, 32, 32.0, Limits::budget(400)) - 20_000.0).abs() < 1e-6);
        let small = DegreeCosts::new(&profile(), 1, false, 150).unwrap();
        assert!((small.throughput(0.0, 32, 32.0, Limits::budget(150)) - 15_000.0).abs() < 1e-6);
    }

    #[test]
    fn throughput_with_caching_mixes_block_steps() {
        let c = DegreeCosts::new(&profile(), 1, true, 1000).unwrap();
        // mean sequence 500 -> 2 sequences; 31 cache steps of 64 tokens + 1 recompute of 1000.
        let cache = c.cache(64.0, 500.0);
        let expected = (32.0 * 2.0 * 31.0 + 1000.0) / (cache * 31.0 + c.full(1000.0));
        assert_eq!(
            c.throughput(500.0, 32, 32.0, Limits::budget(1000)),
            expected
        );
        assert_eq!(c.batch(1000, 64, 500.0), c.full(1000.0) + cache);
        assert_eq!(c.batch(0, 0, 500.0), 0.0);
    }

    #[test]
    fn cached_capacity_counts_predicted_steps_per_block() {
        let c = DegreeCosts::new(&profile(), 1, true, 1000).unwrap();
        // At 4 steps per block (8 tokens per step) a block is 3 cache steps + 1 recompute,
        // not the 31 + 1 of one token per step.
        let cache = c.cache(64.0, 500.0);
        let expected = (32.0 * 2.0 * 3.0 + 1000.0) / (cache * 3.0 + c.full(1000.0));
        let got = c.throughput(500.0, 32, 4.0, Limits::budget(1000));
        assert_eq!(got, expected);
        assert!(got != c.throughput(500.0, 32, 32.0, Limits::budget(1000)));
    }

    #[test]
    fn the_exact_cache_prices_a_blocks_full_step_as_a_cache_step_of_two_blocks() {
        let c = DegreeCosts::new(&profile(), 1, true, 1000).unwrap();
        let e = c.clone().exact(true);
        assert_eq!(e.full_step(32.0, 500.0), c.cache(64.0, 500.0));
        assert_eq!(c.full_step(32.0, 500.0), c.full(500.0));
        // Mean sequence 500 -> 2 sequences: 3 cache steps of 64 tokens and one of 128 per
        // block, all over the same context; no recompute of 1000.
        let cache = c.cache(64.0, 500.0);
        let expected = (64.0 * 3.0 + 128.0) / (cache * 3.0 + c.cache(128.0, 500.0));
        let got = e.throughput(500.0, 32, 4.0, Limits::budget(1000));
        assert!((got - expected).abs() < 1e-9, "{got} vs {expected}");
        let uncached = DegreeCosts::new(&profile(), 1, false, 1000).unwrap();
        assert!(!uncached.exact(true).exact, "only a cache is exact");
    }

    #[test]
    fn cache_cost_follows_the_cached_context() {
        let p = LatencyProfile::from_context_tables([
            (
                1,
                StepKind::Recompute,
                None,
                vec![(100, 0.010), (1000, 0.050)],
            ),
            (
                1,
                StepKind::Cache,
                Some(256),
                vec![(32, 0.002), (320, 0.004)],
            ),
            (
                1,
                StepKind::Cache,
                Some(2048),
                vec![(32, 0.006), (320, 0.012)],
            ),
        ])
        .unwrap();
        let c = DegreeCosts::new(&p, 1, true, 1000).unwrap();
        assert_eq!(c.cache(32.0, 256.0), 0.002);
        assert!((c.cache(32.0, 1152.0) - 0.004).abs() < 1e-12);
        assert_eq!(c.cache(320.0, 2048.0), 0.012);
        assert!(c.batch(0, 32, 2048.0) > c.batch(0, 32, 256.0));
    }

    #[test]
    fn resident_capacity_bounds_throughput() {
        let c = DegreeCosts::new(&profile(), 1, false, 400).unwrap();
        // KV room for 150 tokens caps the batch like a 150-token budget would.
        let kv = Limits {
            kv_tokens: Some(150),
            ..Limits::budget(400)
        };
        assert!((c.throughput(0.0, 32, 32.0, kv) - 15_000.0).abs() < 1e-6);
        // One resident request of 100 tokens: batches of 100.
        let one = Limits {
            max_requests: Some(1),
            ..Limits::budget(400)
        };
        assert!((c.throughput(100.0, 32, 32.0, one) - 10_000.0).abs() < 1e-6);
        let cached = DegreeCosts::new(&profile(), 1, true, 1000).unwrap();
        let two = Limits {
            max_requests: Some(1),
            ..Limits::budget(1000)
        };
        let cache = cached.cache(32.0, 500.0);
        let expected = (32.0 * 31.0 + 500.0) / (cache * 31.0 + cached.full(500.0));
        assert_eq!(cached.throughput(500.0, 32, 32.0, two), expected);
    }

    #[test]
    fn missing_tables_are_profile_errors() {
        assert!(matches!(
            DegreeCosts::new(&profile(), 2, true, 100),
            Err(ProfileError::MissingDegree { tp: 2, .. })
        ));
        let only_nocache =
            LatencyProfile::from_tables([(1, StepKind::NoCache, vec![(1, 0.1)])]).unwrap();
        assert!(DegreeCosts::new(&only_nocache, 1, true, 100).is_err());
    }
}
