//! The engine's authoritative token state of every live request: output ids and the step
//! counters a worker needs to resume a request anywhere (after a migration, a restart or a
//! lost worker).
//!
//! A step report is applied here in one pass over packed columns. Per request the table
//! keeps the masked count of each output block, the number of leading complete blocks and
//! the first committed stop token, so finish and block-completion detection look at one
//! block, never at the whole output. A worker keeps the same state of the requests it
//! holds (`held_tokens`), and `RequestState.commit` in `dilaserve.protocol` states the
//! rules in Python (the emulated worker's copy): a position unmasks once; a request is done
//! when every position is unmasked or a stop token is committed with everything before it
//! unmasked; a step that leaves its block open counts towards the block's steps and Dream
//! grid, one that closes it resets both.

use std::collections::HashMap;

/// What the table needs to know of a request when it arrives.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenSpec {
    pub output_len: u32,
    pub block_length: u32,
    pub mask: u32,
    /// Tokens that end the request once committed with everything before them unmasked.
    pub stops: Vec<u32>,
    /// The request follows a fixed schedule (steps per block), not the threshold rule: its
    /// commits say nothing about the served model's tokens per step at a τ.
    pub fixed_schedule: bool,
    /// Leading output positions that hold the prompt's tail (block diffusion aligns blocks
    /// on absolute positions): never committed, never a stop.
    pub lead: u32,
}

/// One request's token state.
#[derive(Clone, Debug)]
pub struct Tokens {
    output: Vec<u32>,
    block_length: u32,
    mask: u32,
    stops: Vec<u32>,
    fixed_schedule: bool,
    masked_per_block: Vec<u32>,
    /// Leading blocks with every position unmasked.
    complete: u32,
    /// Output index of the first committed stop token.
    stop_at: Option<u32>,
    /// Complete blocks already handed out as text (see [`TokenTable::apply`]).
    reported_blocks: u32,
    /// Leading positions that hold the prompt's tail ([`TokenSpec::lead`]).
    lead: u32,
    pub steps_done: u32,
    pub block_steps: u32,
    pub timestep: u32,
}

/// One request's commit in a step report, checked against its state.
#[derive(Clone, Copy, Debug)]
pub struct Commit<'a> {
    pub block: u32,
    pub positions: &'a [u32],
    pub tokens: &'a [u32],
    pub timesteps: u32,
}

impl Tokens {
    /// A fresh request's state, every position masked; why `spec` is bad, if it is.
    pub fn new(spec: &TokenSpec) -> Result<Self, String> {
        if spec.block_length == 0
            || spec.output_len == 0
            || spec.output_len % spec.block_length != 0
        {
            return Err(format!(
                "output length {} is not a positive multiple of block length {}",
                spec.output_len, spec.block_length
            ));
        }
        if spec.stops.contains(&spec.mask) {
            return Err("the mask token cannot be a stop token".into());
        }
        let blocks = spec.output_len / spec.block_length;
        Ok(Self {
            output: vec![spec.mask; spec.output_len as usize],
            block_length: spec.block_length,
            mask: spec.mask,
            stops: spec.stops.clone(),
            fixed_schedule: spec.fixed_schedule,
            masked_per_block: vec![spec.block_length; blocks as usize],
            complete: 0,
            stop_at: None,
            reported_blocks: 0,
            lead: spec.lead,
            steps_done: 0,
            block_steps: 0,
            timestep: 0,
        })
    }

    /// A request's state part-way through decoding: its `output` so far and its
    /// `(steps_done, block_steps, timestep)` (a migrated request's, or one resumed after a
    /// restart); why they do not fit `spec`, if they do not.
    pub fn resume(spec: &TokenSpec, output: &[u32], counters: [u32; 3]) -> Result<Self, String> {
        let mut tokens = Self::new(spec)?;
        if output.len() != tokens.output.len() {
            return Err(format!(
                "output of {} positions, expected {}",
                output.len(),
                tokens.output.len()
            ));
        }
        let b = spec.block_length as usize;
        for (masked, block) in tokens.masked_per_block.iter_mut().zip(output.chunks(b)) {
            *masked = block.iter().filter(|&&t| t == spec.mask).count() as u32;
        }
        tokens.output = output.to_vec();
        tokens.complete = tokens
            .masked_per_block
            .iter()
            .take_while(|&&m| m == 0)
            .count() as u32;
        tokens.stop_at = output
            .iter()
            .skip(spec.lead as usize)
            .position(|t| spec.stops.contains(t))
            .map(|p| p as u32 + spec.lead);
        [tokens.steps_done, tokens.block_steps, tokens.timestep] = counters;
        Ok(tokens)
    }

    pub fn output(&self) -> &[u32] {
        &self.output
    }

    pub fn block_length(&self) -> u32 {
        self.block_length
    }

    pub fn mask(&self) -> u32 {
        self.mask
    }

    /// Index of the first output block with a masked position (the block count once every
    /// position is unmasked).
    pub fn current_block(&self) -> u32 {
        self.complete
    }

    /// Masked positions of the current block.
    pub fn masked_in_block(&self) -> u32 {
        self.masked_per_block
            .get(self.complete as usize)
            .copied()
            .unwrap_or(0)
    }

    /// `(steps_done, block_steps, timestep)`.
    pub fn counters(&self) -> [u32; 3] {
        [self.steps_done, self.block_steps, self.timestep]
    }

    pub fn fixed_schedule(&self) -> bool {
        self.fixed_schedule
    }

    fn blocks(&self) -> u32 {
        self.masked_per_block.len() as u32
    }

    /// Output index of the first masked position (None: all are unmasked). Scans one block.
    fn first_masked(&self) -> Option<u32> {
        if self.complete == self.blocks() {
            return None;
        }
        let start = self.complete * self.block_length;
        let block = &self.output[start as usize..(start + self.block_length) as usize];
        let offset = block.iter().position(|&t| t == self.mask)?;
        Some(start + offset as u32)
    }

    /// Every position unmasked, or a stop token committed with everything before it
    /// unmasked.
    pub fn done(&self) -> bool {
        match self.first_masked() {
            None => true,
            Some(first) => self.stop_at.is_some_and(|s| s < first),
        }
    }

    /// Output ids after the lead, cut before the first stop token.
    pub fn generated(&self) -> &[u32] {
        let end = self.stop_at.map_or(self.output.len(), |s| s as usize);
        &self.output[self.lead as usize..end]
    }

    /// Output ids of the complete blocks after the lead, cut before the first stop token:
    /// text that never changes.
    pub fn complete_ids(&self) -> &[u32] {
        let end = (self.complete * self.block_length) as usize;
        let end = self.stop_at.map_or(end, |s| end.min(s as usize));
        &self.output[self.lead as usize..end.max(self.lead as usize)]
    }

    /// Generated positions that hold a token (EOS padding after a stop is cut off).
    pub fn completion_tokens(&self) -> usize {
        self.generated().iter().filter(|&&t| t != self.mask).count()
    }

    /// Why `commit` cannot apply, if it cannot.
    pub fn check(&self, commit: &Commit<'_>) -> Result<(), String> {
        let b = self.block_length;
        if commit.block >= self.blocks() {
            return Err(format!(
                "block {} is past the output's {}",
                commit.block,
                self.blocks()
            ));
        }
        if commit.positions.is_empty() {
            return Err("a step commits at least one position".into());
        }
        if commit.positions.len() != commit.tokens.len() {
            return Err("positions and tokens differ in length".into());
        }
        let (start, end) = (commit.block * b, (commit.block + 1) * b);
        for (i, &p) in commit.positions.iter().enumerate() {
            if !(start..end).contains(&p) {
                return Err(format!("position {p} is outside block {}", commit.block));
            }
            if self.output[p as usize] != self.mask || commit.positions[..i].contains(&p) {
                return Err(format!("position {p} is already unmasked"));
            }
        }
        if commit.tokens.contains(&self.mask) {
            return Err("a commit cannot write the mask token".into());
        }
        Ok(())
    }

    /// Applies a checked commit (see [`Tokens::check`]).
    pub(crate) fn apply(&mut self, commit: &Commit<'_>) {
        for (&p, &t) in commit.positions.iter().zip(commit.tokens) {
            self.output[p as usize] = t;
            if self.stops.contains(&t) && self.stop_at.is_none_or(|s| p < s) {
                self.stop_at = Some(p);
            }
        }
        let masked = &mut self.masked_per_block[commit.block as usize];
        *masked -= commit.positions.len() as u32;
        let block_open = *masked > 0;
        while self.complete < self.blocks() && self.masked_per_block[self.complete as usize] == 0 {
            self.complete += 1;
        }
        self.steps_done += 1;
        self.block_steps = if block_open { self.block_steps + 1 } else { 0 };
        self.timestep = if block_open {
            self.timestep + commit.timesteps
        } else {
            0
        };
    }

    /// The complete ids once more blocks are complete than were last handed out.
    fn new_blocks(&mut self) -> Option<&[u32]> {
        if self.complete <= self.reported_blocks {
            return None;
        }
        self.reported_blocks = self.complete;
        Some(self.complete_ids())
    }
}

/// The token state of every live request, by id.
#[derive(Default)]
pub struct TokenTable {
    requests: HashMap<u64, Tokens>,
}

impl TokenTable {
    pub fn insert(&mut self, id: u64, tokens: Tokens) {
        self.requests.insert(id, tokens);
    }

    pub fn remove(&mut self, id: u64) -> Option<Tokens> {
        self.requests.remove(&id)
    }

    pub fn get(&self, id: u64) -> Option<&Tokens> {
        self.requests.get(&id)
    }

    /// Applies a commit that passed [`Tokens::check`]; returns whether the request is
    /// done and, when blocks were completed since the last time, its complete ids.
    pub fn apply(&mut self, id: u64, commit: &Commit<'_>) -> (bool, Option<Vec<u32>>) {
        let tokens = self
            .requests
            .get_mut(&id)
            .expect("a checked commit names a held request");
        tokens.apply(commit);
        let done = tokens.done();
        (done, tokens.new_blocks().map(<[u32]>::to_vec))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MASK: u32 = 99;
    const EOS: u32 = 7;

    fn table(output_len: u32, block_length: u32) -> TokenTable {
        let mut t = TokenTable::default();
        let spec = TokenSpec {
            output_len,
            block_length,
            mask: MASK,
            stops: vec![EOS],
            fixed_schedule: false,
            lead: 0,
        };
        t.insert(1, Tokens::new(&spec).unwrap());
        t
    }

    fn commit<'a>(block: u32, positions: &'a [u32], tokens: &'a [u32]) -> Commit<'a> {
        Commit {
            block,
            positions,
            tokens,
            timesteps: 1,
        }
    }

    #[test]
    fn blocks_complete_and_counters_follow_the_workers_rules() {
        let mut t = table(8, 4);
        let c = commit(0, &[1, 3], &[10, 11]);
        t.get(1).unwrap().check(&c).unwrap();
        assert_eq!(t.apply(1, &c), (false, None));
        let s = t.get(1).unwrap();
        assert_eq!((s.steps_done, s.block_steps, s.timestep), (1, 1, 1));
        let c = commit(0, &[0, 2], &[12, 13]);
        assert_eq!(t.apply(1, &c), (false, Some(vec![12, 10, 13, 11])));
        let s = t.get(1).unwrap();
        assert_eq!((s.steps_done, s.block_steps, s.timestep), (2, 0, 0));
        assert!(t.apply(1, &commit(1, &[4, 5, 6, 7], &[1, 2, 3, 4])).0);
        assert_eq!(t.get(1).unwrap().generated(), &[12, 10, 13, 11, 1, 2, 3, 4]);
    }

    #[test]
    fn a_stop_token_ends_the_request_once_everything_before_it_is_unmasked() {
        let mut t = table(8, 4);
        assert_eq!(t.apply(1, &commit(0, &[2], &[EOS])), (false, None));
        let s = t.get(1).unwrap();
        assert_eq!(s.generated(), &[MASK, MASK]);
        assert_eq!(s.completion_tokens(), 0);
        let (done, ids) = t.apply(1, &commit(0, &[0, 1], &[5, 6]));
        assert!(done);
        assert_eq!(ids, None, "the block is still open");
        let s = t.get(1).unwrap();
        assert_eq!((s.generated(), s.completion_tokens()), (&[5u32, 6][..], 2));
        assert_eq!(s.complete_ids(), &[] as &[u32]);
    }

    #[test]
    fn bad_commits_are_refused_before_anything_changes() {
        let t = table(8, 4);
        for (c, reason) in [
            (commit(2, &[8], &[1]), "past"),
            (commit(0, &[4], &[1]), "outside block 0"),
            (commit(0, &[], &[]), "at least one"),
            (commit(0, &[1, 1], &[2, 3]), "already unmasked"),
            (commit(0, &[1], &[MASK]), "mask token"),
            (commit(0, &[1, 2], &[3]), "differ"),
        ] {
            let err = t.get(1).unwrap().check(&c).unwrap_err();
            assert!(err.contains(reason), "{err}");
        }
        assert!(t.get(2).is_none());
        assert_eq!(t.get(1).unwrap().output(), &[MASK; 8]);
    }
}
