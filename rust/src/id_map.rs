//! Hash maps keyed by request and instance ids. The scheduler looks up an id for every
//! request of every step report; std's default SipHash, built to resist hash flooding by
//! untrusted keys, costs more than the rest of such a lookup, and these ids are assigned by
//! the engine, not chosen by clients.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// A map from integer ids, hashed by [`IdHasher`].
pub(crate) type IdMap<K, V> = HashMap<K, V, BuildHasherDefault<IdHasher>>;

/// Multiplicative (Fibonacci) hashing of integer keys: one multiply per key. Consecutive
/// ids get distinct low bits (the multiplier is odd) and well-mixed high bits.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct IdHasher(u64);

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

impl Hasher for IdHasher {
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    fn write_u32(&mut self, x: u32) {
        self.write_u64(u64::from(x));
    }

    fn write_u64(&mut self, x: u64) {
        self.0 = (self.0.rotate_left(5) ^ x).wrapping_mul(GOLDEN);
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

#[cfg(test)]
mod tests {
    use std::hash::BuildHasher;

    use super::*;

    #[test]
    fn consecutive_ids_spread_over_buckets_and_maps_work() {
        let build = BuildHasherDefault::<IdHasher>::default();
        let mut low: Vec<u64> = (0..1024u64).map(|id| build.hash_one(id) & 1023).collect();
        low.sort_unstable();
        low.dedup();
        assert_eq!(low.len(), 1024, "1024 consecutive ids fill 1024 buckets");
        let mut m: IdMap<u64, u64> = IdMap::default();
        for id in 0..10_000 {
            m.insert(id * 7, id);
        }
        m.remove(&70);
        assert_eq!(m.len(), 9_999);
        assert_eq!(m.get(&(9_999 * 7)), Some(&9_999));
        assert_eq!(m.get(&70), None);
    }
}
