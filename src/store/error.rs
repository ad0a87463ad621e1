//! [`StoreError`]: what a store answers when it could not do what it was asked.

use std::fmt;

/// An error from a store: the layer answers `503 idempotency_store_unavailable` (or, when configured
/// to fail open and the error allows it, runs the handler unguarded).
#[derive(Debug)]
pub struct StoreError {
    message: String,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
    kind: Kind,
}

/// What kind of failure a [`StoreError`] is, beyond its message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// The store may or may not have done it (a timeout, a lost connection, a server error).
    Failed,
    /// A finished record exists but cannot be read.
    Unreadable,
    /// The claim was refused and nothing was written (the store is full).
    Refused,
    /// The claim was refused and nothing was written: the subject holds its share of the store.
    Quota,
    /// The claim was refused and nothing was written: the store has no room left.
    Full,
    /// A statement of the transaction had failed before: nothing in it can commit.
    AbortedTransaction,
    /// The store cannot do this at all (it keeps no steps, or its table lacks their columns):
    /// trying again changes nothing.
    Unsupported,
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
            kind: Kind::Failed,
        }
    }

    /// The same error (message and kind), without its source: for each of the requests that one
    /// statement failed.
    #[cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql"))]
    pub(crate) fn copy(&self) -> Self {
        StoreError {
            message: self.to_string(),
            source: None,
            kind: self.kind,
        }
    }

    /// The store keeps no steps (recovery points, SPEC 28): a step run on it fails before its
    /// work runs.
    pub fn no_steps() -> Self {
        StoreError::unsupported(
            "this store keeps no steps (recovery points): run the step outside `step`, or use \
             a store that keeps them (every store of this crate does)",
        )
    }

    /// What the store cannot do at all (trying again changes nothing): it keeps no steps, or its
    /// table lacks a column this version needs until `migrate()` runs.
    pub fn unsupported(message: impl Into<String>) -> Self {
        StoreError {
            kind: Kind::Unsupported,
            ..StoreError::msg(message)
        }
    }

    /// True for an error made by [`StoreError::unsupported`] (or [`StoreError::no_steps`]).
    pub fn is_unsupported(&self) -> bool {
        self.kind == Kind::Unsupported
    }

    /// An error with only a message.
    pub fn msg(message: impl Into<String>) -> Self {
        StoreError {
            message: message.into(),
            source: None,
            kind: Kind::Failed,
        }
    }

    /// A finished record exists but cannot be read (it does not decrypt, say): the operation it
    /// records has happened, so the layer answers `503 idempotency_store_unavailable` even when
    /// configured to fail open. Running the handler again would repeat the operation.
    pub fn unreadable_record(message: impl Into<String>) -> Self {
        StoreError {
            kind: Kind::Unreadable,
            ..StoreError::msg(message)
        }
    }

    /// The store refused the claim and wrote nothing: the layer answers `503`, even when
    /// configured to fail open (running unguarded would let every retry run again), and starts no
    /// clean-up of a claim that was never made. [`store_full`](Self::store_full) and
    /// [`quota_exceeded`](Self::quota_exceeded) are refused claims too.
    pub fn refused_claim(message: impl Into<String>) -> Self {
        StoreError {
            kind: Kind::Refused,
            ..StoreError::msg(message)
        }
    }

    /// The store refused the claim of a new record and wrote nothing because the subject's
    /// records hold its share of the store: the layer answers `429 idempotency_quota_exceeded`
    /// (never fails open), and other subjects are served.
    pub fn quota_exceeded(message: impl Into<String>) -> Self {
        StoreError {
            kind: Kind::Quota,
            ..StoreError::msg(message)
        }
    }

    /// True for an error made by [`StoreError::quota_exceeded`].
    pub fn is_quota_exceeded(&self) -> bool {
        self.kind == Kind::Quota
    }

    /// A completion written in a handler's transaction failed because a statement of the handler
    /// had already failed in that transaction: nothing of it can commit (see
    /// [`TransactionalStore::complete_in`](super::TransactionalStore::complete_in)).
    pub fn aborted_transaction(
        message: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        StoreError {
            kind: Kind::AbortedTransaction,
            ..StoreError::new(message, source)
        }
    }

    /// The store (or its server) refused the write for lack of room and wrote nothing: a memory
    /// store at its capacity, a Redis at `maxmemory` under `noeviction` (`OOM`), a database whose
    /// disk or memory is exhausted. A refused claim ([`refused_claim`](Self::refused_claim)) that
    /// the layer answers `503 idempotency_store_full`, never by running unguarded.
    pub fn store_full(message: impl Into<String>) -> Self {
        StoreError {
            kind: Kind::Full,
            ..StoreError::msg(message)
        }
    }

    /// True for an error made by [`StoreError::store_full`].
    pub fn is_store_full(&self) -> bool {
        self.kind == Kind::Full
    }

    /// True for an error made by [`StoreError::refused_claim`].
    pub fn is_refused_claim(&self) -> bool {
        matches!(self.kind, Kind::Refused | Kind::Full | Kind::Quota)
    }

    /// True for an error made by [`StoreError::unreadable_record`].
    pub fn is_unreadable_record(&self) -> bool {
        self.kind == Kind::Unreadable
    }

    /// True for an error made by [`StoreError::aborted_transaction`].
    pub fn is_aborted_transaction(&self) -> bool {
        self.kind == Kind::AbortedTransaction
    }

    /// Whether a claim that failed with this error may have been made all the same (a timeout or
    /// a lost connection after the store committed it): then it is released by its token in the
    /// background. A refused claim wrote nothing, and an unreadable record was read whole: neither
    /// made a claim.
    pub fn may_have_claimed(&self) -> bool {
        !matches!(
            self.kind,
            Kind::Unreadable | Kind::Refused | Kind::Full | Kind::Quota
        )
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
