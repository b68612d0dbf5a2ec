//! *(ours)* Prefix sharing in the KV budget. Under the exact block cache a request whose
//! prompt starts with blocks stored on its instance reads them in place: its own extent
//! holds only what follows them, and a stored block is held once however many requests read
//! it (the worker pins it per reader). So an instance's KV use is its residents' own
//! extents plus each read block once, and admission counts it that way.
//!
//! Blocks are named by the keys workers report (`protocol.prompt_block_keys`: a block's
//! key covers its tokens and every block before it). A request's reads are what its
//! worker reported; before that, at placement, only the leading blocks of its expected hit
//! (`Scheduler::expect_prefix`) that residents there already read — blocks pinned by a
//! resident cannot have been evicted, so the request is sure to read them.

use std::collections::HashMap;

/// The stored prompt blocks an instance's residents read, each held once.
#[derive(Clone, Debug, Default)]
pub(crate) struct SharedBlocks {
    /// Block key → residents reading it.
    readers: HashMap<u64, u32>,
    /// Request id → keys of the blocks it reads, in prompt order.
    reads: HashMap<u64, Vec<u64>>,
    /// Request id → keys of the stored blocks expected to lead its prompt here (it is not
    /// placed yet).
    hints: HashMap<u64, Vec<u64>>,
}

impl SharedBlocks {
    /// Keeps `keys` as request `id`'s expected hit here, until it is placed.
    pub fn hint(&mut self, id: u64, keys: Vec<u64>) {
        self.hints.insert(id, keys);
    }

    /// Forgets request `id`'s expected hit (it went elsewhere or left).
    pub fn drop_hint(&mut self, id: u64) {
        self.hints.remove(&id);
    }

    /// Blocks request `id` would read that residents here already read: its expected hit's
    /// leading run of them.
    pub fn held_run(&self, id: u64) -> usize {
        self.hints.get(&id).map_or(0, |keys| {
            keys.iter()
                .take_while(|k| self.readers.contains_key(k))
                .count()
        })
    }

    /// Request `id`, placed here, reads the held run of its expected hit; returns how many
    /// blocks that is.
    pub fn place(&mut self, id: u64) -> usize {
        let held = self.held_run(id);
        let mut keys = self.hints.remove(&id).unwrap_or_default();
        keys.truncate(held);
        self.set_reads(id, keys);
        held
    }

    /// Request `id` reads exactly the blocks `keys` (none: it left). Returns the change in
    /// blocks held for it, counted once: `(blocks it no longer holds in its own extent,
    /// blocks newly held − blocks no longer held by anyone)`, so the instance's KV use
    /// changes by `(held − read) × block` tokens.
    pub fn set_reads(&mut self, id: u64, keys: Vec<u64>) -> (i64, i64) {
        let old = self.reads.remove(&id).unwrap_or_default();
        let mut held = 0i64;
        for k in &keys {
            let n = self.readers.entry(*k).or_insert(0);
            held += i64::from(*n == 0);
            *n += 1;
        }
        for k in &old {
            if let Some(n) = self.readers.get_mut(k) {
                *n -= 1;
                if *n == 0 {
                    self.readers.remove(k);
                    held -= 1;
                }
            }
        }
        let read = keys.len() as i64 - old.len() as i64;
        if !keys.is_empty() {
            self.reads.insert(id, keys);
        }
        (read, held)
    }

    /// Forgets every read and hint (the instance is gone).
    pub fn clear(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_read_by_several_requests_is_held_once_until_its_last_reader_leaves() {
        let mut s = SharedBlocks::default();
        assert_eq!(s.set_reads(1, vec![10, 11, 12]), (3, 3));
        // A second reader of the first two: its extent is two blocks shorter, nothing new held.
        assert_eq!(s.set_reads(2, vec![10, 11]), (2, 0));
        assert_eq!(s.readers.len(), 3);
        // The first leaves: its extent's blocks go, and block 12, which only it read.
        assert_eq!(s.set_reads(1, vec![]), (-3, -1));
        assert_eq!(s.readers.len(), 2);
        assert_eq!(s.set_reads(2, vec![]), (-2, -2));
        assert_eq!(s.readers.len(), 0);
    }

    #[test]
    fn a_placed_request_counts_only_the_leading_hinted_blocks_already_held() {
        let mut s = SharedBlocks::default();
        s.set_reads(1, vec![10, 11]);
        s.hint(2, vec![10, 11, 12]);
        s.hint(3, vec![20, 11]);
        assert_eq!((s.held_run(2), s.held_run(3), s.held_run(4)), (2, 0, 0));
        assert_eq!(s.place(2), 2);
        assert_eq!(s.readers.len(), 2);
        // The hint is consumed: placing again reads nothing.
        assert_eq!(s.held_run(2), 0);
        // Its worker reports it read all three after all: one more block held.
        assert_eq!(s.set_reads(2, vec![10, 11, 12]), (1, 1));
        s.drop_hint(3);
        assert_eq!(s.place(3), 0);
    }
}
