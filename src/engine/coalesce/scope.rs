//! A record's scope as this process knows it: a cheap, process-local name for the
//! (key, subject, endpoint) of a record, for the maps of claims held here and of duplicates waiting
//! here. It never leaves the process: the stores name records by the scope's SHA-256 digest.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
use std::sync::OnceLock;

use crate::store::RecordKey;

/// 128 bits of two SipHash-1-3 hashes of a record's scope (each after its own domain byte), under a
/// key drawn at random once per process. Two scopes share a name with probability about 2^-128 per pair, and no client can aim
/// for it (the keys are secret and new in every process), so the maps keyed by it tell scopes apart
/// as the digest does, at a tenth of its cost.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) struct Scope {
    /// Names the slot in a map (see [`ByScope`]).
    slot: u64,
    /// Names the shard of a sharded map.
    shard: u64,
}

impl Scope {
    /// The name of `key`'s scope in this process.
    pub(crate) fn of(key: &RecordKey) -> Self {
        static KEYS: OnceLock<RandomState> = OnceLock::new();
        let keys = KEYS.get_or_init(RandomState::new);
        Scope {
            slot: hash_of(keys, 1, key),
            shard: hash_of(keys, 2, key),
        }
    }

    /// A made-up scope, for tests of the maps.
    #[cfg(test)]
    pub(crate) fn numbered(n: u64) -> Self {
        Scope { slot: n, shard: n }
    }

    /// Which of `shards` holds this scope.
    pub(crate) fn shard(&self, shards: usize) -> usize {
        (self.shard % shards as u64) as usize
    }
}

/// SipHash of `key` under `keys`, after `domain`: each half of a [`Scope`] is the hash of another
/// input under the one secret key, rather than of one input under two related keys.
fn hash_of(keys: &RandomState, domain: u8, key: &RecordKey) -> u64 {
    let mut hasher = keys.build_hasher();
    hasher.write_u8(domain);
    // Each part prefixed with its length: ("ab", "c") and ("a", "bc") are other scopes.
    for part in [&key.key, &key.subject, &key.endpoint] {
        hasher.write_usize(part.len());
        hasher.write(part.as_bytes());
    }
    hasher.finish()
}

impl Hash for Scope {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.slot);
    }
}

/// A map's hasher for [`Scope`] keys, which are hashes already: it takes them as they are.
pub(crate) type ByScope = BuildHasherDefault<SlotHasher>;

/// Passes a [`Scope`]'s slot through (see [`ByScope`]).
#[derive(Default)]
pub(crate) struct SlotHasher(u64);

impl Hasher for SlotHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used for a `Scope`; anything else is folded in all the same.
        for byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*byte);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(key: &str, subject: &str, endpoint: &str) -> RecordKey {
        RecordKey {
            key: key.into(),
            subject: subject.into(),
            endpoint: endpoint.into(),
        }
    }

    #[test]
    fn scopes_are_named_by_every_part_and_its_bounds() {
        let one = Scope::of(&key("k", "alice", "POST /pay"));
        assert_eq!(one, Scope::of(&key("k", "alice", "POST /pay")));
        for other in [
            key("k2", "alice", "POST /pay"),
            key("k", "bob", "POST /pay"),
            key("k", "alice", "POST /refund"),
            key("ka", "lice", "POST /pay"),
            key("", "kalice", "POST /pay"),
        ] {
            assert_ne!(one, Scope::of(&other), "{other:?}");
        }
    }
}
