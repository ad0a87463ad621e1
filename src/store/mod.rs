//! Where records live: the [`IdempotencyStore`] trait and its backends.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use crate::Fingerprint;
use crate::record::{ClaimOutcome, ClaimRequest, Fenced, LeaseToken, RecordKey, StoredResponse};

mod cached;
mod capabilities;
#[cfg(any(feature = "redis", feature = "encryption"))]
mod header_list;
mod inspection;
mod memory;
pub use cached::{CachedStore, DEFAULT_CACHE_BYTES, DEFAULT_CACHE_MAX_AGE};
pub use capabilities::{Capabilities, ResponseTransform};
#[cfg(any(feature = "postgres", feature = "redis"))]
pub(crate) use inspection::from_micros;
pub use inspection::{
    Deleted, InvalidCursor, ListCursor, ListRequest, ListedRecord, MAX_LIST_LIMIT, RecordInfo,
    RecordPage, RecordState,
};
pub use memory::{DEFAULT_MEMORY_CAPACITY, MemoryStore};

#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "postgres")]
pub(crate) use postgres::CompleteInError;
#[cfg(feature = "postgres")]
pub use postgres::{
    DEFAULT_OPERATION_TIMEOUT, MIN_MIGRATE_TIMEOUT, MIN_OPERATION_TIMEOUT, PostgresStore,
    PostgresStoreError,
};

#[cfg(feature = "encryption")]
mod encrypted;
#[cfg(feature = "encryption")]
pub use encrypted::{EncryptedStore, EncryptionKeys, EncryptionKeysError, KeyId};

#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "redis")]
pub use self::redis::{DEFAULT_REDIS_TIMEOUT, RedisStore};

/// An error from a store: the layer answers `503 idempotency_store_unavailable` (or, when configured
/// to fail open, runs the handler unguarded).
#[derive(Debug)]
pub struct StoreError {
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
    unreadable: bool,
    refused: bool,
}

impl StoreError {
    /// An error with a message and the error that caused it.
    pub fn new(
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        StoreError {
            message: message.into(),
            source: Some(source.into()),
            unreadable: false,
            refused: false,
        }
    }

    /// An error with only a message.
    pub fn msg(message: impl Into<String>) -> Self {
        StoreError {
            message: message.into(),
            source: None,
            unreadable: false,
            refused: false,
        }
    }

    /// A finished record exists but cannot be read (it does not decrypt, say): the operation it
    /// records has happened, so the layer answers `503 idempotency_store_unavailable` even when
    /// configured to fail open. Running the handler again would repeat the operation.
    pub fn unreadable_record(message: impl Into<String>) -> Self {
        StoreError {
            unreadable: true,
            ..StoreError::msg(message)
        }
    }

    /// The store refused the claim and wrote nothing (it is full): the layer answers `503`, even
    /// when configured to fail open (running unguarded would let every retry run again), and
    /// starts no clean-up of a claim that was never made.
    pub fn refused_claim(message: impl Into<String>) -> Self {
        StoreError {
            refused: true,
            ..StoreError::msg(message)
        }
    }

    /// True for an error made by [`StoreError::refused_claim`].
    pub fn is_refused_claim(&self) -> bool {
        self.refused
    }

    /// True for an error made by [`StoreError::unreadable_record`].
    pub fn is_unreadable_record(&self) -> bool {
        self.unreadable
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.source {
            Some(source) => write!(f, "{}: {}", self.message, source),
            None => f.write_str(&self.message),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

/// A backend for idempotency records.
///
/// Every method is a single atomic step; none of them may hold a lock or a transaction open after
/// it returns. The behaviour suite (feature `test-suite`: `axum_idempotency::conformance` and
/// `store_suite!`) checks an implementation against all of this; every store of the crate runs it.
///
/// A store that wraps another forwards every operation and answers its inner store's
/// [`capabilities`](Self::capabilities), with what it adds: that one required method is what a
/// wrapper passes on (the operation timeout, the transactional store and the response
/// transforms), so that none can be dropped by leaving a default in place. Here, a
/// wrapper counting claims:
///
/// ```
/// use std::sync::Arc;
/// use std::sync::atomic::{AtomicU64, Ordering};
/// use std::time::Duration;
/// use axum_idempotency::store::{Capabilities, Deleted, ListRequest, RecordInfo, RecordPage};
/// use axum_idempotency::{
///     ClaimOutcome, ClaimRequest, Fenced, Fingerprint, IdempotencyLayer, IdempotencyStore,
///     LeaseToken, MemoryStore, RecordKey, StoreError, StoredResponse,
/// };
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
///     // What the inner store offers, passed on (a counter adds nothing).
///     fn capabilities(&self) -> Capabilities<'_> {
///         self.inner.capabilities()
///     }
/// }
///
/// let store = Counted { inner: MemoryStore::new(), claims: Arc::default() };
/// let layer = IdempotencyLayer::new(store);
/// # let _ = layer;
/// ```
pub trait IdempotencyStore: Clone + Send + Sync + 'static {
    /// Claims a record, atomically:
    ///
    /// - no record, or one whose retention has passed: create it `in_progress` held by
    ///   `request.lease`, committed before this returns, and answer [`ClaimOutcome::Claimed`];
    /// - a record with another fingerprint: [`ClaimOutcome::FingerprintMismatch`], changing nothing;
    /// - a finished record: [`ClaimOutcome::Finished`] with its response;
    /// - an `in_progress` record claimed or renewed less than `in_progress_ttl` ago:
    ///   [`ClaimOutcome::InProgress`];
    /// - an `in_progress` record held by `request.lease` itself (this claim, sent twice: a resend
    ///   after its answer was lost): [`ClaimOutcome::Claimed`], changing nothing;
    /// - an older one (its holder stopped renewing it: presumed dead): replace its lease with
    ///   `request.lease` by compare-and-swap on the old token, so that of many concurrent retakers
    ///   exactly one gets `Claimed { retaken: true }` and the rest `InProgress`.
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

    /// What the store offers beyond storage ([`Capabilities`]): its operation timeout, the Postgres
    /// store whose transactions handlers take and the response transforms. A
    /// store of its own answers [`Capabilities::none`] (with its operation timeout, if it bounds
    /// its operations); a store wrapping another answers the inner store's, with what it adds.
    fn capabilities(&self) -> Capabilities<'_>;
}
