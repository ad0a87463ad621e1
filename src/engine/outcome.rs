//! What the layer did with each guarded request: logged (a DEBUG event in the request's span) and
//! reported to an optional
//! hook, and counted by [`OutcomeCounters`] for export to any metrics system; with the `metrics`
//! feature, also counted by endpoint through the `metrics` facade.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// One thing the layer did with a guarded request. A request that runs the handler reports two: how
/// it was claimed, then whether its answer was recorded or released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// A fresh key was claimed; the handler runs.
    Claimed,
    /// A stale `in_progress` record was taken over; the handler runs.
    Retaken,
    /// The handler's answer was recorded for replay.
    Recorded,
    /// The record was released (retryable answer, panic, unrecordable response, handler error).
    Released,
    /// The answer could not be recorded because the lease was lost to a retaker.
    LeaseLost,
    /// The answer could not be recorded yet because the store failed; recording is retried in the
    /// background.
    RecordDeferred,
    /// A finished record was replayed.
    Replayed,
    /// A duplicate of a request in progress was answered `409`.
    InProgress,
    /// The key was reused for another request: `422`.
    KeyReuse,
    /// The store failed and the request was refused: `503`.
    StoreUnavailable,
    /// The store failed and the request ran unguarded (`fail_open`).
    FailedOpen,
    /// The request was refused before any claim: bad or missing key, no subject, body too large or
    /// unreadable.
    Rejected,
    /// The request was refused before any claim because the layer runs too many requests on tasks
    /// of their own (or this subject runs its share of them): `503 idempotency_overloaded`.
    Overloaded,
    /// The store refused the claim for lack of room: `503 idempotency_store_full`.
    StoreFull,
    /// The subject holds its share of the store, and the claim of a new key was refused:
    /// `429 idempotency_quota_exceeded`.
    QuotaExceeded,
    /// The handler or its body was still running at the maximum hold and was cancelled.
    TimedOut,
    /// The key's record expired within the tombstones' time: answered "expired" (`410`), nothing
    /// ran.
    Expired,
}

impl Outcome {
    /// Every outcome, in a fixed order.
    pub const ALL: [Outcome; 17] = [
        Outcome::Claimed,
        Outcome::Retaken,
        Outcome::Recorded,
        Outcome::Released,
        Outcome::LeaseLost,
        Outcome::RecordDeferred,
        Outcome::Replayed,
        Outcome::InProgress,
        Outcome::KeyReuse,
        Outcome::StoreUnavailable,
        Outcome::FailedOpen,
        Outcome::Rejected,
        Outcome::Overloaded,
        Outcome::TimedOut,
        Outcome::StoreFull,
        Outcome::QuotaExceeded,
        Outcome::Expired,
    ];

    /// A stable snake_case name, as logged in the `outcome` field of the outcome's DEBUG event and
    /// fit for a metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Claimed => "claimed",
            Outcome::Retaken => "retaken",
            Outcome::Recorded => "recorded",
            Outcome::Released => "released",
            Outcome::LeaseLost => "lease_lost",
            Outcome::RecordDeferred => "record_deferred",
            Outcome::Replayed => "replayed",
            Outcome::InProgress => "in_progress",
            Outcome::KeyReuse => "key_reuse",
            Outcome::StoreUnavailable => "store_unavailable",
            Outcome::FailedOpen => "failed_open",
            Outcome::Rejected => "rejected",
            Outcome::Overloaded => "overloaded",
            Outcome::TimedOut => "timed_out",
            Outcome::StoreFull => "store_full",
            Outcome::QuotaExceeded => "quota_exceeded",
            Outcome::Expired => "expired",
        }
    }

    fn index(self) -> usize {
        Outcome::ALL
            .iter()
            .position(|o| *o == self)
            .unwrap_or_default()
    }
}

/// Counts of every [`Outcome`], cheap to update from many threads; clones share the counts.
///
/// ```
/// use axum_idempotency::{IdempotencyLayer, MemoryStore, Outcome, OutcomeCounters};
///
/// let counters = OutcomeCounters::new();
/// let layer = IdempotencyLayer::builder(MemoryStore::new())
///     .on_outcome(counters.hook())
///     .build()
///     .expect("valid settings");
/// // Export `counters.snapshot()` from your metrics endpoint.
/// assert_eq!(counters.get(Outcome::Replayed), 0);
/// # let _ = layer;
/// ```
#[derive(Clone, Default, Debug)]
pub struct OutcomeCounters {
    counts: Arc<[AtomicU64; Outcome::ALL.len()]>,
}

impl OutcomeCounters {
    /// All counts at zero.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one to `outcome`.
    pub fn add(&self, outcome: Outcome) {
        self.counts[outcome.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// The count of `outcome`.
    pub fn get(&self, outcome: Outcome) -> u64 {
        self.counts[outcome.index()].load(Ordering::Relaxed)
    }

    /// Every outcome's name and count.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        Outcome::ALL
            .iter()
            .map(|o| (o.as_str(), self.get(*o)))
            .collect()
    }

    /// A hook for [`IdempotencyLayerBuilder::on_outcome`](crate::IdempotencyLayerBuilder::on_outcome)
    /// that counts into these counters.
    pub fn hook(&self) -> impl Fn(Outcome) + Send + Sync + 'static {
        let counters = self.clone();
        move |outcome| counters.add(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_each_outcome_apart() {
        let counters = OutcomeCounters::new();
        let hook = counters.hook();
        hook(Outcome::Replayed);
        hook(Outcome::Replayed);
        hook(Outcome::Rejected);
        assert_eq!(counters.get(Outcome::Replayed), 2);
        assert_eq!(counters.get(Outcome::Rejected), 1);
        assert_eq!(counters.get(Outcome::Claimed), 0);
        let names: Vec<_> = counters.snapshot().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names.len(), Outcome::ALL.len());
        let unique: std::collections::HashSet<_> = names.iter().collect();
        assert_eq!(unique.len(), names.len(), "names are distinct");
    }
}
