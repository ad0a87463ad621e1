//! Where records live: the [`IdempotencyStore`] trait, the vocabulary it speaks, and its backends.
//!
//! This module is a leaf: it imports nothing of the layer, the engine or `RunOnce`. A store author
//! finds everything here: the record's scope ([`RecordKey`]), the claim ([`ClaimRequest`],
//! [`ClaimOutcome`]), the fencing token ([`LeaseToken`], [`Fenced`]), the recorded answer
//! ([`StoredResponse`], [`Finished`]), inspection ([`RecordInfo`], [`ListRequest`], ...), errors
//! ([`StoreError`]), the lease keeper's liveness ([`Presence`]), and the capability only some
//! stores have ([`TransactionalStore`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

mod cached;
mod error;
#[cfg(any(
    feature = "redis",
    feature = "encryption",
    feature = "mysql",
    feature = "sqlite"
))]
mod header_list;
mod inspection;
mod memory;
mod presence;
mod purge;
mod record;
#[cfg(sql)]
pub(crate) mod sql;
#[cfg(any(feature = "redis", feature = "mysql", feature = "sqlite"))]
pub(crate) mod step_list;
#[cfg(test)]
pub(crate) mod testing;
mod transactional;

pub use crate::fingerprint::Fingerprint;
pub use cached::CachedStore;
pub use error::StoreError;
#[cfg(any(sql, feature = "redis"))]
pub(crate) use inspection::from_micros;
#[cfg(sql)]
pub(crate) use inspection::row_info;
pub use inspection::{
    Deleted, InvalidCursor, ListCursor, ListRequest, ListedRecord, RecordInfo, RecordPage,
    RecordState, SubjectUsage,
};
#[cfg(sql)]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql")))
)]
pub use sql::InvalidTableName;

pub use memory::MemoryStore;
pub use presence::Presence;
pub use purge::spawn_purge;
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) use record::delete_token;
pub use record::{
    ClaimOutcome, ClaimRequest, Fenced, Finished, Generation, LeaseToken, RecordKey, RecordedStep,
    StoredResponse,
};
pub use transactional::{FailedCommit, TransactionalStore};

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "postgres")]
pub use postgres::PostgresStore;

#[cfg(feature = "sqlite")]
mod sqlite;
#[cfg(feature = "sqlite")]
pub use sqlite::SqliteStore;
#[cfg(feature = "mysql")]
mod mysql;
#[cfg(feature = "mysql")]
pub use mysql::MySqlStore;

#[cfg(feature = "encryption")]
mod encrypted;
#[cfg(feature = "encryption")]
pub use encrypted::{EncryptedStore, EncryptionKeys, EncryptionKeysError, KeyId};

#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
pub use self::redis::RedisStore;

/// A backend for idempotency records.
///
/// Every method is a single atomic step; none of them may hold a lock or a transaction open after
/// it returns. The behaviour suite (feature `test-suite`: `axum_idempotency::conformance` and
/// `store_suite!`) checks an implementation against all of this; every store of the crate runs it.
///
/// A store that wraps another forwards every operation, and its inner store's
/// [`operation_timeout`](Self::operation_timeout), [`keeper_session`](Self::keeper_session) and
/// [`show_presences`](Self::show_presences) (required methods, so that a wrapper cannot drop them
/// by leaving a default in place), and its steps ([`record_step`](Self::record_step),
/// [`steps`](Self::steps) and [`recorded_steps`](Self::recorded_steps): a wrapper that leaves
/// their defaults keeps none, and a step on it fails before its work runs). A wrapper of a [`TransactionalStore`] implements that
/// trait too, to pass the capability on. Here, a wrapper counting claims:
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::time::Duration;
/// use axum_idempotency::store::{
///     ClaimOutcome, ClaimRequest, Deleted, Fenced, Fingerprint, IdempotencyStore, LeaseToken,
///     ListRequest, MemoryStore, Presence, RecordInfo, RecordKey, RecordPage, RecordedStep,
///     StoreError, StoredResponse, SubjectUsage,
/// };
/// use axum_idempotency::IdempotencyLayer;
///
/// #[derive(Clone, Debug)]
/// struct Counted<S> {
///     inner: S,
///     claims: Arc<AtomicU64>,
/// }
///
/// impl<S: IdempotencyStore> IdempotencyStore for Counted<S> {
///     async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
///         self.claims.fetch_add(1, Ordering::Relaxed);
///         self.inner.claim(request).await
///     }
///     async fn complete(
///         &self,
///         key: &RecordKey,
///         lease: LeaseToken,
///         fingerprint: &Fingerprint,
///         response: Arc<StoredResponse>,
///         retention: Duration,
///     ) -> Result<Fenced, StoreError> {
///         self.inner.complete(key, lease, fingerprint, response, retention).await
///     }
///     async fn renew(
///         &self,
///         key: &RecordKey,
///         lease: LeaseToken,
///         lifetime: Duration,
///     ) -> Result<Fenced, StoreError> {
///         self.inner.renew(key, lease, lifetime).await
///     }
///     async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
///         self.inner.release(key, lease).await
///     }
///     async fn record_step(
///         &self,
///         key: &RecordKey,
///         lease: LeaseToken,
///         step: &RecordedStep,
///     ) -> Result<Fenced, StoreError> {
///         self.inner.record_step(key, lease, step).await
///     }
///     async fn steps(
///         &self,
///         key: &RecordKey,
///         lease: LeaseToken,
///     ) -> Result<Option<Vec<RecordedStep>>, StoreError> {
///         self.inner.steps(key, lease).await
///     }
///     async fn recorded_steps(&self, key: &RecordKey) -> Result<Vec<RecordedStep>, StoreError> {
///         self.inner.recorded_steps(key).await
///     }
///     async fn purge_expired(&self) -> Result<u64, StoreError> {
///         self.inner.purge_expired().await
///     }
///     async fn lookup(&self, key: &RecordKey) -> Result<Option<RecordInfo>, StoreError> {
///         self.inner.lookup(key).await
///     }
///     async fn delete(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
///         self.inner.delete(key).await
///     }
///     async fn list(&self, subject: &str, page: ListRequest) -> Result<RecordPage, StoreError> {
///         self.inner.list(subject, page).await
///     }
///     async fn count_records(
///         &self,
///         subject: &str,
///         up_to: u64,
///     ) -> Result<Option<SubjectUsage>, StoreError> {
///         self.inner.count_records(subject, up_to).await
///     }
///     fn counts_records(&self) -> bool {
///         self.inner.counts_records()
///     }
///     fn operation_timeout(&self) -> Option<Duration> {
///         self.inner.operation_timeout()
///     }
///     async fn keeper_session(&self) -> Result<Self, StoreError> {
///         let inner = self.inner.keeper_session().await?;
///         Ok(Counted { inner, claims: self.claims.clone() })
///     }
///     async fn show_presences(&self, live: &[Presence], lapse: Duration) -> Result<(), StoreError> {
///         self.inner.show_presences(live, lapse).await
///     }
/// }
///
/// let store = Counted { inner: MemoryStore::new(), claims: Arc::default() };
/// let layer = IdempotencyLayer::new(store).expect("valid settings");
/// # let _ = layer;
/// ```
pub trait IdempotencyStore: Clone + Send + Sync + 'static {
    /// Claims a record, atomically:
    ///
    /// - no record, or one whose retention has passed: create it `in_progress` held by
    ///   `request.lease`, committed before this returns, and answer [`ClaimOutcome::Claimed`];
    /// - a record with another fingerprint: [`ClaimOutcome::KeyReuse`], changing nothing;
    /// - a finished record: [`ClaimOutcome::Finished`] with its response;
    /// - an `in_progress` record claimed or renewed less than `in_progress_ttl` ago, or whose
    ///   lease's [`Presence`] the store shows (its holder lives, whatever delayed its renewals):
    ///   [`ClaimOutcome::InProgress`];
    /// - an `in_progress` record held by `request.lease` itself (this claim, sent twice: a resend
    ///   after its answer was lost): [`ClaimOutcome::Claimed`], changing nothing;
    /// - an older one (its holder stopped renewing it: presumed dead): replace its lease with
    ///   `request.lease` by compare-and-swap on the old token, so that of many concurrent retakers
    ///   exactly one gets `Claimed { retaken: true }` and the rest `InProgress`. A store whose
    ///   holders' liveness can end without the store showing it (a failover, a restarted proxy)
    ///   may instead mark the record at the first such claim, answering `InProgress`, and take it
    ///   only at a claim a TTL after the mark with no renewal in between, as the crate's
    ///   PostgreSQL, MySQL and Redis stores do; the conformance kit accepts either.
    ///
    /// Every scope the layer lets through must be accepted: any subject or endpoint, of any length,
    /// with any characters (NUL included).
    fn claim(
        &self,
        request: &ClaimRequest,
    ) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send;

    /// Stores the response of a claimed record and marks it finished, to live for `retention`.
    /// Answers [`Fenced::LeaseLost`], changing nothing, when `lease` no longer holds the record. A
    /// record that `lease` already completed (an earlier attempt committed, but its answer was
    /// lost) answers [`Fenced::Done`] and is left as it is. `fingerprint` is the claim's (the record's own): a store may
    /// bind what it writes to it, as `EncryptedStore` binds its ciphertext, so that an answer
    /// moved onto the record of another request does not open.
    fn complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> impl Future<Output = Result<Fenced, StoreError>> + Send;

    /// The lease's heartbeat: while `lease` holds the `in_progress` record, restart its
    /// in-progress TTL from now and push its expiry to `lifetime` from now. Answers
    /// [`Fenced::LeaseLost`], changing nothing, when `lease` no longer holds it (it was retaken,
    /// released or finished).
    fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> impl Future<Output = Result<Fenced, StoreError>> + Send;

    /// Renews many leases at once, as [`renew`](Self::renew) renews one (each with its own
    /// answer, in the order asked): the engine's lease keeper renews every lease of this process
    /// that is due in one call. The default renews them concurrently, one call each; a store that
    /// can renew many in one statement or script (the Postgres store does) overrides it. An error
    /// for one lease must not be reported for another that was renewed.
    fn renew_many(
        &self,
        leases: &[(&RecordKey, LeaseToken)],
        lifetime: Duration,
    ) -> impl Future<Output = Vec<Result<Fenced, StoreError>>> + Send {
        futures_util::future::join_all(
            leases
                .iter()
                .map(|(key, lease)| self.renew(key, *lease, lifetime)),
        )
    }

    /// Releases a claimed record so that a retry runs again: **not deleted**, but kept, held by
    /// no lease, until its expiry, with its fingerprint and generation. The next claim takes it at
    /// once: the same request (same fingerprint) keeps the record's generation (the retry of a
    /// released run is the same operation to a provider, which the released run may have called);
    /// another request gets its own (a new operation, not a `422`). Lease `0` is no claim's token
    /// (`LeaseToken::generate` never gives it): stores may use it to mark released records, and
    /// must never let it complete, renew or release anything. Answers [`Fenced::LeaseLost`],
    /// changing nothing, when `lease` no longer holds the record.
    fn release(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> impl Future<Output = Result<Fenced, StoreError>> + Send;

    /// Records `step` on the record that `lease` holds in progress (a recovery point, SPEC 28),
    /// durably before this returns, and answers [`Fenced::Done`]; a step of that name recorded
    /// before in the same operation (an earlier attempt whose answer was lost) is left as it is,
    /// and answers `Done` too. Answers [`Fenced::LeaseLost`], changing nothing, when `lease` no
    /// longer holds the record in progress: a holder presumed dead that wakes up records nothing.
    ///
    /// Steps belong to the operation, as its [`Generation`] does: they are kept while the record
    /// is retaken, or released and claimed again by the same request, and gone when the record
    /// gets a generation of its own (another request takes a released record, or the key is
    /// claimed again after its retention). The engine bounds their number and size before it
    /// asks.
    ///
    /// The default answers an error: the store keeps no steps (the engine reads
    /// [`steps`](Self::steps) at a run's first step, so a step on it fails before its work runs).
    /// Every store of the crate keeps them; a wrapper forwards both methods, and
    /// [`recorded_steps`](Self::recorded_steps), as `CachedStore` does (`EncryptedStore` seals
    /// each result).
    fn record_step(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        step: &RecordedStep,
    ) -> impl Future<Output = Result<Fenced, StoreError>> + Send {
        let _ = (key, lease, step);
        std::future::ready(Err(StoreError::no_steps()))
    }

    /// The steps recorded in the operation whose record `lease` holds in progress, in the order
    /// they were recorded; `None`, reading nothing else, when `lease` does not hold it (see
    /// [`record_step`](Self::record_step)). The default answers the error of a store that keeps
    /// no steps.
    fn steps(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> impl Future<Output = Result<Option<Vec<RecordedStep>>, StoreError>> + Send {
        let _ = (key, lease);
        std::future::ready(Err(StoreError::no_steps()))
    }

    /// The steps recorded in the operation of `key`'s live record, for inspection (SPEC 28): in
    /// the order they were recorded, whatever the record's state (in progress, or finished: a
    /// finished record keeps the steps of the run that finished it). Empty when there is no live
    /// record, as [`lookup`](Self::lookup) finds none (never claimed, past its retention, or
    /// released), or it recorded none. Changes nothing, and waits on no lock. The default answers
    /// the error of a store that keeps no steps; a wrapper forwards it with the other two.
    fn recorded_steps(
        &self,
        key: &RecordKey,
    ) -> impl Future<Output = Result<Vec<RecordedStep>, StoreError>> + Send {
        let _ = key;
        std::future::ready(Err(StoreError::no_steps()))
    }

    /// Deletes every record whose retention has passed; returns how many.
    fn purge_expired(&self) -> impl Future<Output = Result<u64, StoreError>> + Send;

    /// The record of `key`, as inspection shows it ([`RecordInfo`]: state, stored status, created,
    /// expires), or `None` when there is none: never claimed, past its retention, or released (the
    /// next claim runs the operation). Changes nothing.
    fn lookup(
        &self,
        key: &RecordKey,
    ) -> impl Future<Output = Result<Option<RecordInfo>, StoreError>> + Send;

    /// Deletes the record of `key` if it is finished (completed or failed), atomically: the key is
    /// new afterwards, and its next request runs. A record in progress is left alone
    /// ([`Deleted::InProgress`]): deleting it would let a duplicate run beside its holder. No
    /// record (or one past its retention, or released): [`Deleted::NotFound`].
    fn delete(&self, key: &RecordKey) -> impl Future<Output = Result<Deleted, StoreError>> + Send;

    /// A page of `subject`'s live records (not past their retention, not released), on every
    /// endpoint, ordered by creation time then scope digest ([`ListCursor`]), after
    /// `request.after`, at most [`ListRequest::bounded_limit`] of them. The empty subject lists the
    /// shared anonymous scope.
    fn list(
        &self,
        subject: &str,
        request: ListRequest,
    ) -> impl Future<Output = Result<RecordPage, StoreError>> + Send;

    /// How many live records (not past their retention; released ones included, since they are
    /// kept until then) `subject` has on every endpoint, and the bytes of the answers they keep,
    /// counting no further than `up_to` records: a store may stop there, and answer `up_to` (with
    /// the bytes of the records it counted). The engine asks it now and then to hold each subject
    /// to its share of the store (`max_records_per_subject`, `max_bytes_per_subject`); an estimate
    /// close to the count, or above it, is enough. `None` when the store cannot tell (it keeps no
    /// subject with its records): then no share is enforced on it.
    fn count_records(
        &self,
        subject: &str,
        up_to: u64,
    ) -> impl Future<Output = Result<Option<SubjectUsage>, StoreError>> + Send;

    /// Whether [`count_records`](Self::count_records) counts: `false` for a store that keeps no
    /// subject with its records (it answers `None`). A layer with `max_records_per_subject` on
    /// such a store is refused when it is built, rather than bound nothing. A wrapper answers its
    /// inner store's.
    fn counts_records(&self) -> bool;

    /// The longest one operation of the store may take before it fails, if the store bounds its
    /// operations (the Postgres and Redis stores do). The layer refuses an in-progress TTL under
    /// twice this (a claim answered at the end of its timeout must leave time to prove it holds
    /// the record), and bounds the heartbeat's renewals by it. A wrapper answers its inner
    /// store's.
    fn operation_timeout(&self) -> Option<Duration>;

    /// The lease keeper's own copy of this store: the same records, reached through connections
    /// of its own, opened now, on the calling runtime (the keeper's, on a thread of its own). The
    /// keeper renews its leases and shows its presences through it, so that neither handlers
    /// holding every pooled connection nor a runtime whose workers are all blocked stop them. The
    /// keeper drops it once it has no lease left, which closes those connections.
    ///
    /// A store without connections (memory) answers a clone of itself; a wrapper wraps its inner
    /// store's session. An error leaves the keeper renewing through the store itself meanwhile.
    fn keeper_session(&self) -> impl Future<Output = Result<Self, StoreError>> + Send;

    /// Called on a [`keeper_session`](Self::keeper_session), again and again: shows exactly the
    /// presences in `live` from now on (see [`Presence`]), taking what is new and letting go of
    /// what is not in it, and re-shows what a lost connection dropped. While a presence is shown,
    /// a claim of any instance sharing the records never retakes a record held by a lease of it,
    /// however long ago it was renewed.
    ///
    /// What is shown lapses when no further call comes within `lapse` (the keeper calls again
    /// well within it, a third of the in-progress TTL apart), when the session is dropped, and
    /// when its process dies: a holder that died, or was cut off from the store, without closing
    /// its connections (a machine that lost power) is not shown alive for longer than that.
    ///
    /// A store that cannot show presences (memory, in one process; Redis) answers `Ok(())` and
    /// judges holders by the in-progress TTL alone. A presence it could not show now (held by
    /// another session a moment) is tried again at the next call.
    fn show_presences(
        &self,
        live: &[Presence],
        lapse: Duration,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;
}
