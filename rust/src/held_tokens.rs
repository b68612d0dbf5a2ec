//! A worker's token state of the requests resident on it, and the two host-side halves of
//! a step over them, each one pass over the batch: the index columns of the step's packed
//! model call, built from each row's current block, and the step's read-back applied to
//! every row (its commit, block and finish bookkeeping, its report row). Without these, a
//! step's host time grows by a dozen Python operations per row, which at batch 64 is longer
//! than a GPU step.
//!
//! A row's output follows the rules of [`Tokens`] (the engine core's copy of the same
//! state), so the worker and the core cannot disagree on when a block or a request ends.

use std::collections::HashMap;

use crate::profile::StepKind;
use crate::step_readback::read_back;
use crate::tokens::{Commit, TokenSpec, Tokens};

/// What a cache step feeds besides its block: nothing (dual cache), everything after it
/// (prefix cache), or — block diffusion's exact cache — the blocks finished since the
/// instance last wrote exact K/V (the block the previous step completed). Steps of the
/// other kinds feed the whole sequence, or under the exact cache everything up to the end
/// of the current block (later blocks are invisible to it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheWindow {
    Block,
    Suffix,
    Exact,
}

/// A resident request.
#[derive(Clone, Debug)]
struct Held {
    prompt: Vec<u32>,
    tokens: Tokens,
    /// This instance holds K/V of the current block's recompute step: a cache step may
    /// read it.
    cache_valid: bool,
    /// Under the exact cache: sequence positions whose final K/V this instance holds
    /// (everything before the block its last step ran).
    exact_len: usize,
}

impl Held {
    fn block_length(&self) -> u32 {
        self.tokens.block_length()
    }

    fn seq_length(&self) -> usize {
        self.prompt.len() + self.tokens.output().len()
    }

    /// Sequence index of the current block's first position.
    fn block_start(&self) -> usize {
        self.prompt.len() + (self.tokens.current_block() * self.block_length()) as usize
    }

    fn block_end(&self) -> usize {
        self.block_start() + self.block_length() as usize
    }

    /// Block offsets of the current block's masked positions: the step's candidates.
    fn candidates(&self, out: &mut Vec<u32>) {
        out.clear();
        let b = self.block_length() as usize;
        let start = self.block_start() - self.prompt.len();
        let output = self.tokens.output();
        let end = (start + b).min(output.len());
        let mask = self.tokens.mask();
        out.extend(
            (start..end)
                .filter(|&p| output[p] == mask)
                .map(|p| (p - start) as u32),
        );
    }

    fn token(&self, position: usize) -> i64 {
        let prompt = self.prompt.len();
        i64::from(if position < prompt {
            self.prompt[position]
        } else {
            self.tokens.output()[position - prompt]
        })
    }
}

/// A request's step counters and its current block's masked count (what the decoding
/// options of a row read: the fixed schedule's share, Dream's grid, a seeded row's stream).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Counters {
    pub steps_done: u32,
    pub block_steps: u32,
    pub timestep: u32,
    pub masked_in_block: u32,
}

/// A step's packed model call as flat columns (see `dilaserve.models.packed.PackedBatch`).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PackedStep {
    /// Fed tokens `[T]`, row after row.
    pub ids: Vec<i64>,
    /// Their sequence positions `[T]`.
    pub positions: Vec<i64>,
    /// Pool rows their K/V is written to `[T]` (empty without a pool).
    pub slots: Vec<i64>,
    /// `[rows, width]`: the fed-token index of each logit column; column `j` of row `i`
    /// is its `j`-th candidate, a row with fewer repeating its last one.
    pub index: Vec<i64>,
    /// `[rows, width]`: 1 where the column is one of the row's candidates.
    pub candidate: Vec<i64>,
    /// Fed tokens per row.
    pub lengths: Vec<u32>,
    /// Sequence length per row (what a pool read spans).
    pub seq_lengths: Vec<u32>,
    pub width: usize,
}

/// A step's report columns (`dilaserve.protocol.StepReport`), after its commit applied.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct AppliedStep {
    pub blocks: Vec<u32>,
    pub counts: Vec<u32>,
    /// Committed output positions, row after row.
    pub positions: Vec<u32>,
    pub tokens: Vec<u32>,
    /// `CONFIDENCE_STATS` per row.
    pub stats: Vec<f64>,
    pub done: Vec<bool>,
    pub timesteps: Vec<u32>,
}

/// The token state of every request resident on a worker, by id.
#[derive(Default)]
pub struct HeldTokens {
    rows: HashMap<u64, Held>,
    /// Block diffusion's exact cache: a finished block's K/V stays valid, and every step
    /// feeds and reads up to the end of the current block only.
    exact: bool,
}

impl HeldTokens {
    /// The state of a worker whose cache is block diffusion's exact one.
    pub fn exact() -> Self {
        Self {
            exact: true,
            ..Self::default()
        }
    }

    /// Takes a request in at any point of its decoding (new, or migrated with its output
    /// and counters); it holds no K/V here yet.
    pub fn add(
        &mut self,
        id: u64,
        prompt: Vec<u32>,
        spec: &TokenSpec,
        output: &[u32],
        counters: [u32; 3],
    ) -> Result<(), String> {
        if self.rows.contains_key(&id) {
            return Err(format!("request {id} is already on this runner"));
        }
        if prompt.is_empty() && spec.lead == 0 {
            return Err(format!("request {id}: prompt is empty"));
        }
        let tokens = Tokens::resume(spec, output, counters)?;
        let held = Held {
            prompt,
            tokens,
            cache_valid: false,
            exact_len: 0,
        };
        self.rows.insert(id, held);
        Ok(())
    }

    /// Under the exact cache: the first `len` positions of a resident request (whole
    /// blocks of its prompt) already hold final K/V on this instance — stored blocks of a
    /// prefix another request computed — so its steps, its first one too, feed from there.
    pub fn seed_exact(&mut self, id: u64, len: usize) -> Result<(), String> {
        if !self.exact {
            return Err("only the exact block cache keeps a prefix's K/V".into());
        }
        let held = self
            .rows
            .get_mut(&id)
            .ok_or(format!("request {id} is not held"))?;
        if len > held.prompt.len() || len % held.block_length() as usize != 0 {
            return Err(format!(
                "request {id}: a cached prefix of {len} positions is not whole blocks of its \
                 {}-token prompt",
                held.prompt.len()
            ));
        }
        held.exact_len = len;
        Ok(())
    }

    /// Drops a request; its output and `(steps_done, block_steps, timestep)`.
    pub fn remove(&mut self, id: u64) -> Option<(Vec<u32>, [u32; 3])> {
        let held = self.rows.remove(&id)?;
        let counters = held.tokens.counters();
        Some((held.tokens.output().to_vec(), counters))
    }

    pub fn contains(&self, id: u64) -> bool {
        self.rows.contains_key(&id)
    }

    pub fn output(&self, id: u64) -> Option<&[u32]> {
        Some(self.rows.get(&id)?.tokens.output())
    }

    pub fn counters(&self, id: u64) -> Option<Counters> {
        let held = self.rows.get(&id)?;
        let [steps_done, block_steps, timestep] = held.tokens.counters();
        Some(Counters {
            steps_done,
            block_steps,
            timestep,
            masked_in_block: held.tokens.masked_in_block(),
        })
    }

    pub fn done(&self, id: u64) -> Option<bool> {
        Some(self.rows.get(&id)?.tokens.done())
    }

    pub fn cache_valid(&self, id: u64) -> Option<bool> {
        Some(self.rows.get(&id)?.cache_valid)
    }

    /// The rows of a step: each held, not finished, named once.
    fn rows_of<'a>(&'a self, ids: &[u64]) -> Result<Vec<&'a Held>, String> {
        let mut seen = std::collections::HashSet::with_capacity(ids.len());
        ids.iter()
            .map(|id| {
                if !seen.insert(id) {
                    return Err(format!("request {id} appears twice in one step"));
                }
                let held = self
                    .rows
                    .get(id)
                    .ok_or(format!("request {id} is not held"))?;
                if held.tokens.done() {
                    return Err(format!("request {id} is already finished"));
                }
                Ok(held)
            })
            .collect()
    }

    /// The packed model call of a step of `ids` with step kinds `kinds`. `shift` is 1 for
    /// a model whose logits are shifted (Dream: a cache step also feeds the position
    /// before its block); `bases` are the pool rows of the rows' position 0, if the step
    /// writes a pool (a row whose leading positions are read shared has its extent start
    /// after them: its base lies before its extent, possibly below 0).
    pub fn pack(
        &self,
        ids: &[u64],
        kinds: &[StepKind],
        window: CacheWindow,
        shift: usize,
        bases: Option<&[i64]>,
    ) -> Result<PackedStep, String> {
        if kinds.len() != ids.len() || bases.is_some_and(|b| b.len() != ids.len()) {
            return Err("a step's requests, kinds and pool bases differ in number".into());
        }
        let rows = self.rows_of(ids)?;
        let columns: Vec<Vec<u32>> = rows
            .iter()
            .map(|h| {
                let mut c = Vec::new();
                h.candidates(&mut c);
                c
            })
            .collect();
        let width = columns.iter().map(Vec::len).max().unwrap_or(0);
        let mut out = PackedStep {
            width,
            ..PackedStep::default()
        };
        for (i, (h, kind)) in rows.iter().zip(kinds).enumerate() {
            let (start, seq) = (h.block_start(), h.seq_length());
            let window = if self.exact {
                CacheWindow::Exact
            } else {
                window
            };
            let (begin, end) = match (kind, window) {
                (StepKind::Cache, CacheWindow::Block) => (start - shift, h.block_end()),
                (StepKind::Cache, CacheWindow::Suffix) => (start - shift, seq),
                (StepKind::Cache | StepKind::Recompute, CacheWindow::Exact) => {
                    (h.exact_len, h.block_end())
                }
                // Its fed positions would start before a shared prefix's end, whose K/V
                // lives outside the row's extent.
                (StepKind::NoCache, CacheWindow::Exact) => {
                    return Err("the exact block cache runs no no-cache step".into())
                }
                _ => (0, seq),
            };
            let offset = out.ids.len() as i64;
            out.ids.extend((begin..end).map(|p| h.token(p)));
            out.positions.extend((begin as i64)..(end as i64));
            if let Some(bases) = bases {
                out.slots
                    .extend((begin as i64..end as i64).map(|p| bases[i] + p));
            }
            // Block position j of this row is fed token first + j.
            let first = offset + (start - shift - begin) as i64;
            let c = &columns[i];
            let last = *c
                .last()
                .ok_or("a resident request has no masked position")?;
            for j in 0..width {
                let column = c.get(j).copied().unwrap_or(last);
                out.index.push(first + i64::from(column));
                out.candidate.push(i64::from(j < c.len()));
            }
            out.lengths.push((end - begin) as u32);
            out.seq_lengths
                .push(if self.exact { end } else { seq } as u32);
        }
        Ok(out)
    }

    /// Applies a step's read-back `host` (`rows` × `3 * width + 1`: committed flags, ids,
    /// confidences, grid steps, the columns as [`HeldTokens::pack`] laid them out) to every
    /// row, or to none if any row's commit is malformed; the step's report columns.
    pub fn commit(
        &mut self,
        ids: &[u64],
        kinds: &[StepKind],
        host: &[f64],
    ) -> Result<AppliedStep, String> {
        let rows = self.rows_of(ids)?;
        if kinds.len() != ids.len() {
            return Err("a step's requests and kinds differ in number".into());
        }
        let mut counts = Vec::with_capacity(rows.len());
        let mut columns = Vec::new();
        let mut candidates = Vec::new();
        for h in &rows {
            h.candidates(&mut candidates);
            counts.push(candidates.len() as u32);
        }
        let width = counts.iter().copied().max().unwrap_or(0) as usize;
        for h in &rows {
            h.candidates(&mut candidates);
            let last = candidates.last().copied().unwrap_or(0);
            columns
                .extend((0..width).map(|j| i64::from(candidates.get(j).copied().unwrap_or(last))));
        }
        let back = read_back(host, rows.len(), width, &counts, &columns)?;
        let mut out = AppliedStep {
            stats: back.stats,
            timesteps: back.timesteps,
            ..AppliedStep::default()
        };
        let mut offset = 0;
        for (h, &n) in rows.iter().zip(&back.counts) {
            let block = h.tokens.current_block();
            let first = block * h.block_length();
            let end = offset + n as usize;
            out.positions
                .extend(back.positions[offset..end].iter().map(|p| first + p));
            out.blocks.push(block);
            offset = end;
        }
        out.tokens = back.tokens;
        out.counts = back.counts;
        // Check every row before any changes.
        let mut offset = 0;
        for (i, h) in rows.iter().enumerate() {
            let end = offset + out.counts[i] as usize;
            h.tokens
                .check(&commit_of(&out, i, offset, end))
                .map_err(|e| format!("request {}: {e}", ids[i]))?;
            offset = end;
        }
        let mut offset = 0;
        for (i, (id, kind)) in ids.iter().zip(kinds).enumerate() {
            let end = offset + out.counts[i] as usize;
            let held = self.rows.get_mut(id).expect("checked above");
            let block_start = held.block_start();
            held.tokens.apply(&commit_of(&out, i, offset, end));
            // Every step writes the fed tokens' K/V; only a recompute step refreshes the
            // rest of the sequence, which a cache step of the same block reads. The exact
            // cache's K/V of everything before the block stays final, past the block's end.
            let writes = *kind != StepKind::NoCache;
            let kept = held.cache_valid || *kind == StepKind::Recompute;
            held.cache_valid = writes && kept && (self.exact || held.tokens.counters()[1] != 0);
            if self.exact && writes {
                held.exact_len = block_start;
            }
            out.done.push(held.tokens.done());
            offset = end;
        }
        Ok(out)
    }
}

fn commit_of(out: &AppliedStep, row: usize, start: usize, end: usize) -> Commit<'_> {
    Commit {
        block: out.blocks[row],
        positions: &out.positions[start..end],
        tokens: &out.tokens[start..end],
        timesteps: out.timesteps[row],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MASK: u32 = 99;
    const EOS: u32 = 7;

    fn spec(output_len: u32, block_length: u32) -> TokenSpec {
        TokenSpec {
            output_len,
            block_length,
            mask: MASK,
            stops: vec![EOS],
            fixed_schedule: false,
            lead: 0,
        }
    }

    /// A read-back row of `width` columns committing `committed` with `ids`.
    fn row(width: usize, committed: &[bool], ids: &[u32]) -> Vec<f64> {
        let mut r: Vec<f64> = (0..width)
            .map(|j| f64::from(u8::from(committed.get(j).copied().unwrap_or(false))))
            .collect();
        r.extend((0..width).map(|j| f64::from(ids.get(j).copied().unwrap_or(MASK))));
        r.extend((0..width).map(|j| 0.5 + j as f64 / 100.0));
        r.push(1.0);
        r
    }

    #[test]
    fn a_dual_cache_step_feeds_the_block_and_indexes_its_masked_positions() {
        let mut t = HeldTokens::default();
        t.add(
            1,
            vec![1, 2, 3],
            &spec(8, 4),
            &[5, MASK, 6, MASK, MASK, MASK, MASK, MASK],
            [2, 1, 1],
        )
        .unwrap();
        t.add(2, vec![4, 5], &spec(4, 4), &[MASK; 4], [0, 0, 0])
            .unwrap();
        let ids = [1, 2];
        let p = t
            .pack(
                &ids,
                &[StepKind::Cache, StepKind::Recompute],
                CacheWindow::Block,
                0,
                Some(&[100, 200]),
            )
            .unwrap();
        // Row 1: block 0 starts at sequence index 3; fed [3, 7). Row 2: the whole sequence.
        assert_eq!(p.lengths, vec![4, 6]);
        assert_eq!(
            p.ids,
            vec![5, MASK as i64, 6, MASK as i64, 4, 5, 99, 99, 99, 99]
        );
        assert_eq!(p.positions, vec![3, 4, 5, 6, 0, 1, 2, 3, 4, 5]);
        assert_eq!(p.slots[..4], [103, 104, 105, 106]);
        assert_eq!(p.width, 4);
        // Row 1's candidates are block offsets 1 and 3 (fed tokens 1, 3), padded with 3.
        assert_eq!(p.index[..4], [1, 3, 3, 3]);
        assert_eq!(p.candidate[..4], [1, 1, 0, 0]);
        // Row 2's block starts at sequence index 2: fed tokens 4 + 2 + j.
        assert_eq!(p.index[4..], [6, 7, 8, 9]);
        assert_eq!(p.seq_lengths, vec![11, 6]);
    }

    #[test]
    fn the_exact_cache_feeds_the_finished_block_once_then_only_the_current_one() {
        let mut t = HeldTokens::exact();
        // Prompt [1, 2] plus a lead of two prompt tokens: blocks of 4 start at position 0.
        let lead = TokenSpec {
            lead: 2,
            ..spec(8, 4)
        };
        let output = [3, EOS, MASK, MASK, MASK, MASK, MASK, MASK];
        t.add(1, vec![1, 2], &lead, &output, [0, 0, 0]).unwrap();
        assert!(
            !t.done(1).unwrap(),
            "a stop token in the lead is the prompt's"
        );
        let kinds = [StepKind::Recompute];
        let p = t
            .pack(&[1], &kinds, CacheWindow::Block, 0, Some(&[0]))
            .unwrap();
        // A recompute feeds up to the end of the current block, never the blocks after it.
        assert_eq!(
            (p.positions.clone(), p.seq_lengths.clone()),
            ((0..6).collect(), vec![6])
        );
        assert_eq!(p.index, vec![4, 5]);
        // Commit both masked positions: the block ends; its K/V written so far is stale.
        let host = row(2, &[true, true], &[8, 9]);
        t.commit(&[1], &kinds, &host).unwrap();
        assert!(
            t.cache_valid(1).unwrap(),
            "the exact cache survives the block's end"
        );
        let cache = [StepKind::Cache];
        let p = t
            .pack(&[1], &cache, CacheWindow::Block, 0, Some(&[0]))
            .unwrap();
        // The next step feeds the finished block (its final K/V) and the new one.
        assert_eq!(p.positions, (2..10).collect::<Vec<i64>>());
        assert_eq!(p.seq_lengths, vec![10]);
        assert_eq!(p.index[..1], [4]);
        t.commit(&[1], &cache, &row(4, &[true], &[10])).unwrap();
        let p = t
            .pack(&[1], &cache, CacheWindow::Block, 0, Some(&[0]))
            .unwrap();
        assert_eq!(p.positions, (6..10).collect::<Vec<i64>>());
    }

    #[test]
    fn a_seeded_prefix_is_not_fed_again() {
        let mut t = HeldTokens::exact();
        t.add(1, (1..=8).collect(), &spec(4, 4), &[MASK; 4], [0, 0, 0])
            .unwrap();
        assert!(t.seed_exact(1, 6).is_err(), "not whole blocks");
        assert!(t.seed_exact(1, 12).is_err(), "longer than the prompt");
        t.seed_exact(1, 8).unwrap();
        let p = t
            .pack(
                &[1],
                &[StepKind::Recompute],
                CacheWindow::Block,
                0,
                Some(&[100]),
            )
            .unwrap();
        assert_eq!(p.positions, (8..12).collect::<Vec<i64>>());
        assert_eq!(p.slots, (108..112).collect::<Vec<i64>>());
        assert_eq!(
            (p.index.clone(), p.seq_lengths.clone()),
            (vec![0, 1, 2, 3], vec![12])
        );
        assert!(HeldTokens::default().seed_exact(1, 0).is_err());
    }

    #[test]
    fn a_shifted_cache_step_feeds_the_position_before_its_block() {
        let mut t = HeldTokens::default();
        t.add(
            1,
            vec![1, 2],
            &spec(8, 4),
            &[3, 4, 5, 6, MASK, MASK, 8, MASK],
            [4, 1, 1],
        )
        .unwrap();
        let p = t
            .pack(&[1], &[StepKind::Cache], CacheWindow::Suffix, 1, None)
            .unwrap();
        // Block 1 starts at sequence index 6; fed [5, 10) to the end.
        assert_eq!(p.positions, vec![5, 6, 7, 8, 9]);
        // Shifted logits: block position j is predicted at the fed token before it.
        assert_eq!(p.index, vec![0, 1, 3]);
        assert!(p.slots.is_empty());
    }

    #[test]
    fn a_commit_updates_blocks_counters_cache_and_the_report() {
        let mut t = HeldTokens::default();
        t.add(1, vec![1], &spec(8, 4), &[MASK; 8], [0, 0, 0])
            .unwrap();
        let host = row(4, &[true, false, true, false], &[10, 0, 11, 0]);
        let out = t.commit(&[1], &[StepKind::Recompute], &host).unwrap();
        assert_eq!((out.blocks, out.counts), (vec![0], vec![2]));
        assert_eq!((out.positions, out.tokens), (vec![0, 2], vec![10, 11]));
        assert_eq!(out.done, vec![false]);
        assert_eq!(t.cache_valid(1), Some(true));
        assert_eq!(t.counters(1).unwrap().masked_in_block, 2);
        // The rest of block 0: offsets 1 and 3, which close it.
        let host = row(2, &[true, true], &[12, EOS]);
        let out = t.commit(&[1], &[StepKind::Cache], &host).unwrap();
        assert_eq!(out.positions, vec![1, 3]);
        // Block 0 is whole and ends in the stop token: the request is done.
        assert_eq!(out.done, vec![true]);
        assert_eq!(t.cache_valid(1), Some(false));
    }

    #[test]
    fn a_stop_token_after_unmasked_positions_finishes_the_request() {
        let mut t = HeldTokens::default();
        t.add(1, vec![1], &spec(8, 4), &[MASK; 8], [0, 0, 0])
            .unwrap();
        let host = row(4, &[true, true, false, false], &[3, EOS, 0, 0]);
        let out = t.commit(&[1], &[StepKind::NoCache], &host).unwrap();
        assert_eq!(out.done, vec![true]);
        assert_eq!(t.done(1), Some(true));
        assert!(t
            .pack(&[1], &[StepKind::NoCache], CacheWindow::Block, 0, None)
            .is_err());
    }

    #[test]
    fn a_malformed_commit_changes_no_row() {
        let mut t = HeldTokens::default();
        t.add(1, vec![1], &spec(4, 4), &[MASK; 4], [0, 0, 0])
            .unwrap();
        t.add(2, vec![1], &spec(4, 4), &[MASK; 4], [0, 0, 0])
            .unwrap();
        let mut host = row(4, &[true], &[5]);
        host.extend(row(4, &[true], &[MASK])); // row 2 would write the mask token
        assert!(t.commit(&[1, 2], &[StepKind::NoCache; 2], &host).is_err());
        let twice = [row(4, &[true], &[5]), row(4, &[true], &[6])].concat();
        assert!(t.commit(&[1, 1], &[StepKind::NoCache; 2], &twice).is_err());
        assert_eq!(t.output(1).unwrap(), &[MASK; 4]);
        assert_eq!(t.counters(1).unwrap().steps_done, 0);
    }

    #[test]
    fn a_migrated_request_resumes_with_its_output_and_counters() {
        let mut t = HeldTokens::default();
        let output = [5, 6, 4, 8, 9, MASK, MASK, MASK];
        t.add(3, vec![1, 2], &spec(8, 4), &output, [5, 1, 2])
            .unwrap();
        let c = t.counters(3).unwrap();
        assert_eq!(
            (c.steps_done, c.block_steps, c.timestep, c.masked_in_block),
            (5, 1, 2, 3)
        );
        assert_eq!(t.done(3), Some(false));
        assert!(t.add(3, vec![1], &spec(8, 4), &output, [0, 0, 0]).is_err());
        assert_eq!(t.remove(3), Some((output.to_vec(), [5, 1, 2])));
        assert!(!t.contains(3));
    }
}
