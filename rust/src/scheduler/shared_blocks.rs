//! *(ours)* Prefix sharing in the KV budget. Under the exact block cache a request whose
//! prompt starts with blocks stored on its instance reads them in place: its own extent
//! holds only what follows them, and a stored block is held once however many requests read
//! it (the worker pins it per reader). So an instance's KV use is its residents' own
//! extents plus each read block once, and admission counts it that way.
//!
//! A request's reads are what its worker reported once it took the request in
//! (`StepReport.prefix_reads`, blocks named by `protocol.prompt_block_keys`). Until then it
//! is charged its whole sequence: whatever it pins (blocks it reads, shared or newly pinned)
//! plus its own extent never exceeds that, so the charge never falls short of what the
//! worker holds, whichever blocks the worker's store still had.

use std::collections::HashMap;

use crate::id_map::IdMap;

/// The stored prompt blocks an instance's residents read, each held once.
#[derive(Clone, Debug, Default)]
pub(crate) struct SharedBlocks {
    /// Block key → residents reading it. Keys derive from client prompts, so this map keeps
    /// std's flooding-resistant hash.
    readers: HashMap<u64, u32>,
    /// Request id → keys of the blocks it reads, in prompt order.
    reads: IdMap<u64, Vec<u64>>,
}

impl SharedBlocks {
    /// Request `id` reads exactly the blocks `keys` (distinct; none: it left). Returns how
    /// many more blocks it reads than before, and how many more blocks are read here at all
    /// (each counted once): its own extent shrinks by the first, the instance's shared
    /// blocks grow by the second.
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

    /// Keys of the stored blocks request `id` reads (none if it reads none).
    pub fn keys_of(&self, id: u64) -> &[u64] {
        self.reads.get(&id).map_or(&[], Vec::as_slice)
    }

    /// Forgets every read (the instance is gone).
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
        assert_eq!(
            (s.keys_of(1), s.keys_of(2), s.keys_of(3)),
            (&[10, 11, 12][..], &[10, 11][..], &[][..])
        );
        // The first leaves: its reads go, and block 12, which only it read.
        assert_eq!(s.set_reads(1, vec![]), (-3, -1));
        assert_eq!(s.readers.len(), 2);
        // A corrected report replaces the reads.
        assert_eq!(s.set_reads(2, vec![10]), (-1, -1));
        assert_eq!(s.set_reads(2, vec![]), (-1, -1));
        assert!(s.readers.is_empty() && s.reads.is_empty());
    }
}
