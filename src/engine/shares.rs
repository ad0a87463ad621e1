//! Each subject's share of what all subjects share at this instance: requests in flight, duplicates
//! waiting, and records in the store. One subject past its share is refused (`429`), and the others
//! are served.
//!
//! - **In flight**: a subject's guarded requests from admission to their end, attached to their
//!   clients or not, are counted; past its share a new one is refused before its body is read.
//! - **Waiting**: a subject's duplicates waiting for an answer; past its share (or past the
//!   instance's bound) a duplicate gets `409` at once instead of waiting.
//! - **Records**: how many live records a subject has in the store is asked now and then
//!   ([`IdempotencyStore::count_records`](crate::store::IdempotencyStore::count_records)): after a
//!   count `c` under the share `m`, again after `(m - c) / 4` claims of the subject here (at least
//!   64); once a count reaches the share, the subject is over it for a second, then counted again.
//!   While over, a claim first looks its record up: an existing record (a replay, a `409`, a
//!   retake) is claimed as usual, a new key is refused. With `n` instances a subject can pass its
//!   share by at most about `n / 4` of it between two counts.
//!
//! Subjects are named by a keyed hash drawn once per process (as scopes are), so no client can
//! aim two subjects at one entry. The map forgets idle subjects once it holds many.

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::util::lock::lock;

const SHARDS: usize = 16;

/// Entries a shard keeps before it forgets its idle subjects.
const IDLE_KEPT: usize = 4096;

/// The fewest claims between two counts of a subject's records.
const LEAST_BETWEEN_COUNTS: u64 = 64;

/// How long a subject found at its share of records stays refused new keys before it is counted
/// again.
const OVER_FOR: Duration = Duration::from_secs(1);

/// A subject, as this process names it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct SubjectId(u64);

#[derive(Default)]
struct Share {
    in_flight: usize,
    waiting: usize,
    /// Claims since the last count of the subject's records.
    since_count: u64,
    /// Claims due before the next count.
    until_count: u64,
    /// Refused new keys until then: its records reached its share at the last count.
    over_until: Option<Instant>,
}

impl Share {
    fn idle(&self) -> bool {
        self.in_flight == 0 && self.waiting == 0 && self.over_until.is_none()
    }
}

/// What a claim of a subject does about its share of records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Records {
    /// Claim as usual.
    Within,
    /// Count the subject's records first ([`Shares::counted`]).
    Count,
    /// Over its share: claim only a record that exists.
    Over,
}

/// Every subject's share at this instance.
pub(crate) struct Shares {
    keys: RandomState,
    shards: [Mutex<HashMap<SubjectId, Share, BuildHasherDefault<IdHasher>>>; SHARDS],
    /// Duplicates waiting at this instance, all subjects together.
    waiting: AtomicUsize,
}

impl Default for Shares {
    fn default() -> Self {
        Shares {
            keys: RandomState::new(),
            shards: Default::default(),
            waiting: AtomicUsize::new(0),
        }
    }
}

impl std::fmt::Debug for Shares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shares").finish_non_exhaustive()
    }
}

impl Shares {
    /// This process's name for `subject`.
    pub(crate) fn id(&self, subject: &str) -> SubjectId {
        let mut hasher = self.keys.build_hasher();
        hasher.write(subject.as_bytes());
        SubjectId(hasher.finish())
    }

    fn shard(
        &self,
        id: SubjectId,
    ) -> MutexGuard<'_, HashMap<SubjectId, Share, BuildHasherDefault<IdHasher>>> {
        lock(&self.shards[(id.0 >> 60) as usize % SHARDS])
    }

    /// Counts a request of `id` in flight until the guard is dropped, if fewer than `max` are.
    pub(crate) fn enter(self: &Arc<Self>, id: SubjectId, max: usize) -> Option<InFlight> {
        let mut shard = self.shard(id);
        if shard.len() > IDLE_KEPT {
            shard.retain(|_, share| !share.idle());
        }
        let share = shard.entry(id).or_default();
        if share.in_flight >= max {
            return None;
        }
        share.in_flight += 1;
        Some(InFlight {
            shares: self.clone(),
            id,
        })
    }

    /// A place among the duplicates waiting, if `id` has fewer than `per_subject` waiting and the
    /// instance fewer than `total`.
    pub(crate) fn wait(
        self: &Arc<Self>,
        id: SubjectId,
        per_subject: usize,
        total: usize,
    ) -> Option<Waiting> {
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= total {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        let mut shard = self.shard(id);
        let share = shard.entry(id).or_default();
        if share.waiting >= per_subject {
            drop(shard);
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        share.waiting += 1;
        Some(Waiting {
            shares: self.clone(),
            id,
        })
    }

    /// What a claim of `id` does about its share of records (see the module docs).
    pub(crate) fn records(&self, id: SubjectId) -> Records {
        let now = Instant::now();
        let mut shard = self.shard(id);
        let share = shard.entry(id).or_default();
        if let Some(until) = share.over_until {
            if now < until {
                return Records::Over;
            }
            share.over_until = None;
            return Records::Count;
        }
        share.since_count += 1;
        if share.since_count >= share.until_count.max(LEAST_BETWEEN_COUNTS) {
            return Records::Count;
        }
        Records::Within
    }

    /// The subject's records were counted: `count` of its share `max`. Whether it is over.
    pub(crate) fn counted(&self, id: SubjectId, count: u64, max: u64) -> bool {
        let mut shard = self.shard(id);
        let share = shard.entry(id).or_default();
        share.since_count = 0;
        if count >= max {
            share.over_until = Some(Instant::now() + OVER_FOR);
            return true;
        }
        share.until_count = (max - count) / 4;
        false
    }

    fn leave(&self, id: SubjectId, waiting: bool) {
        let mut shard = self.shard(id);
        if let Some(share) = shard.get_mut(&id) {
            if waiting {
                share.waiting = share.waiting.saturating_sub(1);
            } else {
                share.in_flight = share.in_flight.saturating_sub(1);
            }
        }
    }
}

/// A request of a subject in flight, counted until dropped.
pub(crate) struct InFlight {
    shares: Arc<Shares>,
    id: SubjectId,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight").finish_non_exhaustive()
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.shares.leave(self.id, false);
    }
}

/// A duplicate of a subject waiting, counted until dropped.
pub(crate) struct Waiting {
    shares: Arc<Shares>,
    id: SubjectId,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.shares.waiting.fetch_sub(1, Ordering::AcqRel);
        self.shares.leave(self.id, true);
    }
}

/// A map's hasher for [`SubjectId`]s, which are keyed hashes already.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
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

    #[test]
    fn in_flight_and_waiting_are_bounded_per_subject_and_given_back() {
        let shares = Arc::new(Shares::default());
        let (a, b) = (shares.id("a"), shares.id("b"));
        let first = shares.enter(a, 2).expect("first");
        let second = shares.enter(a, 2).expect("second");
        assert!(shares.enter(a, 2).is_none(), "a third of a is refused");
        let other = shares.enter(b, 2).expect("b has its own share");
        drop(first);
        let again = shares
            .enter(a, 2)
            .expect("a place given back is taken again");
        drop((second, other, again));

        let w1 = shares.wait(a, 1, 2).expect("a waits");
        assert!(shares.wait(a, 1, 2).is_none(), "a's share of waiters");
        let w2 = shares.wait(b, 1, 2).expect("b waits");
        assert!(
            shares.wait(shares.id("c"), 1, 2).is_none(),
            "the instance's bound"
        );
        drop((w1, w2));
        assert!(shares.wait(shares.id("c"), 1, 2).is_some());
    }

    #[test]
    fn records_are_counted_now_and_then_and_a_subject_at_its_share_is_over_for_a_while() {
        let shares = Shares::default();
        let a = shares.id("a");
        let mut claims = 0;
        while shares.records(a) == Records::Within {
            claims += 1;
        }
        assert_eq!(claims, LEAST_BETWEEN_COUNTS - 1, "the first count");
        assert!(!shares.counted(a, 0, 1000));
        let mut claims = 0;
        while shares.records(a) == Records::Within {
            claims += 1;
        }
        assert_eq!(
            claims, 249,
            "the next count after a quarter of what is left"
        );
        assert!(shares.counted(a, 1000, 1000));
        assert_eq!(shares.records(a), Records::Over);
        assert_eq!(shares.records(shares.id("b")), Records::Within);
    }
}
