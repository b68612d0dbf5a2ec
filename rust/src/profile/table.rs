//! One measured latency curve over batch tokens, and the curves of one (TP degree, step
//! kind) at several cached-context lengths. Interpolation lives here and only here.

/// Measured `(batch tokens, seconds)` points of one (TP degree, step kind, context), sorted
/// by tokens.
#[derive(Clone, Debug, PartialEq)]
pub struct LatencyTable {
    tokens: Vec<f64>,
    seconds: Vec<f64>,
}

impl LatencyTable {
    /// The table of valid points, or the index of the first invalid one (token counts must
    /// be positive and strictly increasing, seconds positive and finite).
    pub(crate) fn new(points: &[(u64, f64)]) -> Result<Self, usize> {
        let mut prev = 0u64;
        for (index, &(tokens, secs)) in points.iter().enumerate() {
            if tokens == 0 || tokens <= prev || !secs.is_finite() || secs <= 0.0 {
                return Err(index);
            }
            prev = tokens;
        }
        Ok(Self {
            tokens: points.iter().map(|p| p.0 as f64).collect(),
            seconds: points.iter().map(|p| p.1).collect(),
        })
    }

    /// Seconds for a step over `tokens` batch tokens.
    ///
    /// Linear between measured points. Below the smallest point the step costs what the
    /// smallest measured one did (fixed per-step overhead dominates small batches); above
    /// the largest it grows along the last segment's slope, never decreasing.
    pub fn latency(&self, tokens: f64) -> f64 {
        let n = self.tokens.len();
        if n == 1 || tokens <= self.tokens[0] {
            if n == 1 && tokens > self.tokens[0] {
                // One point: assume cost proportional to tokens beyond it.
                return self.seconds[0] * tokens / self.tokens[0];
            }
            return self.seconds[0];
        }
        let hi = self.tokens.partition_point(|&t| t < tokens).min(n - 1);
        let lo = hi - 1;
        let slope = (self.seconds[hi] - self.seconds[lo]) / (self.tokens[hi] - self.tokens[lo]);
        if tokens > self.tokens[n - 1] {
            return self.seconds[n - 1] + slope.max(0.0) * (tokens - self.tokens[n - 1]);
        }
        self.seconds[lo] + slope * (tokens - self.tokens[lo])
    }

    /// Measured points as `(tokens, seconds)`.
    pub fn points(&self) -> impl Iterator<Item = (u64, f64)> + '_ {
        self.tokens
            .iter()
            .zip(&self.seconds)
            .map(|(&t, &s)| (t as u64, s))
    }

    /// Largest measured batch-token count.
    pub fn max_tokens(&self) -> u64 {
        self.tokens[self.tokens.len() - 1] as u64
    }
}

/// Value at `context` of a quantity measured at the ascending `contexts` (`at(i)` is its
/// value at `contexts[i]`): linear between measurements, the shortest one's value below
/// them, and growing along the last segment's slope (never decreasing) beyond them.
pub fn interpolate_context(contexts: &[f64], context: f64, at: impl Fn(usize) -> f64) -> f64 {
    let n = contexts.len();
    if n <= 1 || context <= contexts[0] {
        return at(0);
    }
    let hi = contexts.partition_point(|&c| c < context).min(n - 1);
    let lo = hi - 1;
    let (a, b) = (at(lo), at(hi));
    let slope = (b - a) / (contexts[hi] - contexts[lo]);
    if context > contexts[n - 1] {
        return b + slope.max(0.0) * (context - contexts[n - 1]);
    }
    a + slope * (context - contexts[lo])
}

/// The tables of one (TP degree, step kind): one without a context (its cost does not
/// depend on the cached context, or was measured before profiles had that dimension), or
/// one per measured context length, ascending.
#[derive(Clone, Debug, PartialEq)]
pub struct ContextTables {
    /// Empty for a context-free table.
    contexts: Vec<f64>,
    tables: Vec<LatencyTable>,
}

impl ContextTables {
    pub(crate) fn context_free(table: LatencyTable) -> Self {
        Self {
            contexts: Vec::new(),
            tables: vec![table],
        }
    }

    /// Adds the table measured at `context`; `false` if that would repeat a context or mix
    /// a context-free table with measured contexts.
    pub(crate) fn insert(&mut self, context: Option<u64>, table: LatencyTable) -> bool {
        let Some(context) = context else {
            return false;
        };
        if self.contexts.is_empty() && !self.tables.is_empty() {
            return false;
        }
        let context = context as f64;
        let at = self.contexts.partition_point(|&c| c < context);
        if self.contexts.get(at) == Some(&context) {
            return false;
        }
        self.contexts.insert(at, context);
        self.tables.insert(at, table);
        true
    }

    pub(crate) fn with_context(context: u64, table: LatencyTable) -> Self {
        Self {
            contexts: vec![context as f64],
            tables: vec![table],
        }
    }

    /// Measured context lengths, ascending; empty for a context-free table.
    pub fn contexts(&self) -> Vec<u64> {
        self.contexts.iter().map(|&c| c as u64).collect()
    }

    /// `(context, table)` pairs; the context is `None` for a context-free table.
    pub fn slices(&self) -> impl Iterator<Item = (Option<u64>, &LatencyTable)> + '_ {
        self.tables
            .iter()
            .enumerate()
            .map(|(i, t)| (self.contexts.get(i).map(|&c| c as u64), t))
    }

    /// The table at the shortest measured context (the only one when context-free).
    pub fn shortest(&self) -> &LatencyTable {
        &self.tables[0]
    }

    /// Seconds of a step over `tokens` batch tokens whose requests hold `context` tokens
    /// each (cached positions the fed ones attend to).
    pub fn latency(&self, tokens: f64, context: f64) -> f64 {
        interpolate_context(&self.contexts, context, |i| self.tables[i].latency(tokens))
    }
}
