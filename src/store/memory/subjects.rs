//! What each subject holds in the memory store (records and bytes), so that one subject cannot
//! take the room every other subject needs: a subject past its share of the capacity is refused
//! new records, and the others are served.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::sync::Mutex;

use crate::util::lock::lock;

const SHARDS: usize = 16;

/// Records and bytes of one subject.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Usage {
    pub(super) records: u64,
    pub(super) bytes: usize,
}

/// Every subject's usage, in independently locked shards. Always locked after a record shard,
/// never before, and never two at once.
#[derive(Default)]
pub(super) struct Subjects {
    hasher: RandomState,
    shards: [Mutex<HashMap<String, Usage>>; SHARDS],
}

impl Subjects {
    fn shard(&self, subject: &str) -> &Mutex<HashMap<String, Usage>> {
        &self.shards[self.hasher.hash_one(subject) as usize % SHARDS]
    }

    /// What `subject` holds now.
    pub(super) fn usage(&self, subject: &str) -> Usage {
        lock(self.shard(subject))
            .get(subject)
            .copied()
            .unwrap_or_default()
    }

    /// `records` more records and `bytes` more bytes for `subject`.
    pub(super) fn add(&self, subject: &str, records: u64, bytes: usize) {
        let mut shard = lock(self.shard(subject));
        match shard.get_mut(subject) {
            Some(usage) => {
                usage.records += records;
                usage.bytes += bytes;
            }
            None => {
                shard.insert(subject.to_owned(), Usage { records, bytes });
            }
        }
    }

    /// `records` fewer records and `bytes` fewer bytes for `subject`; a subject left with nothing
    /// is forgotten.
    pub(super) fn sub(&self, subject: &str, records: u64, bytes: usize) {
        let mut shard = lock(self.shard(subject));
        if let Some(usage) = shard.get_mut(subject) {
            usage.records = usage.records.saturating_sub(records);
            usage.bytes = usage.bytes.saturating_sub(bytes);
            if usage.records == 0 {
                shard.remove(subject);
            }
        }
    }
}
