//! [`OnceError`]: why a run-once call did not return an output.

use std::fmt;

use crate::store::StoreError;

/// Why [`RunOnce::run`](super::RunOnce::run) did not return an output.
#[derive(Debug)]
#[non_exhaustive]
pub enum OnceError<E> {
    /// Another run holds the record (here or in another process): try again later. Its lease is
    /// renewed while it runs; if its process died, the record is retaken after the in-progress TTL
    /// (on PostgreSQL, MySQL and Redis, a TTL after the first call that found it silent).
    InProgress,
    /// The scope was used with another fingerprint (another input) within the retention.
    KeyReuse,
    /// The scope's record expired within the tombstones' time
    /// ([`tombstones`](super::RunOnceBuilder::tombstones)): the operation was done, its output is
    /// gone, and it does not run again.
    Expired,
    /// The closure returned this error. The record was released: a later call runs it again.
    Failed(E),
    /// The closure panicked. The record was released: a later call runs it again.
    Panicked,
    /// The closure was still running at the maximum hold and was cancelled. Its effect may have
    /// happened, so the scope is settled as timed out: every later call within the retention gets
    /// this too, and the closure never runs again for it.
    TimedOut,
    /// The store failed (or answered the claim too late to be trusted), or the scope is one the
    /// engine keeps for itself (its endpoint starts with `" tombstone "`). Nothing ran; a claim the
    /// store may have made is released in the background.
    Store(StoreError),
    /// The closure ran (it returned, or was cancelled at the maximum hold), but the store did not
    /// take its settlement in time: it is recorded in the background (heartbeat running) and not
    /// returned, since it is not the record's yet. Do not take it as "nothing happened": call
    /// again with the same scope for the recorded output ([`InProgress`](Self::InProgress) until
    /// it is written).
    NotRecorded,
    /// The input or the output could not be serialized as JSON. For the output, the closure had
    /// run: the scope is settled as failed (later calls get [`Decode`](Self::Decode)), so its
    /// effect is not repeated.
    Encode(serde_json::Error),
    /// The replay check ([`RunOnceBuilder::replay_check`](super::RunOnceBuilder::replay_check))
    /// refused to return the recorded output, for this reason. Nothing ran; the record stands.
    ReplayRefused(String),
    /// The recorded output could not be read back as `T` (another type, a record made by the HTTP
    /// layer under the same scope, an output that did not serialize, or one the store kept
    /// without its body because it refused it several times while it took renewals).
    Decode(serde_json::Error),
}

impl<E: fmt::Display> fmt::Display for OnceError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OnceError::InProgress => f.write_str("the operation is in progress elsewhere"),
            OnceError::KeyReuse => {
                f.write_str("the scope was used for an operation with another input")
            }
            OnceError::Expired => f.write_str("the operation's record has expired"),
            OnceError::Failed(e) => write!(f, "the operation failed: {e}"),
            OnceError::Panicked => f.write_str("the operation panicked"),
            OnceError::TimedOut => f.write_str("the operation ran past the maximum hold"),
            OnceError::Store(e) => write!(f, "the idempotency store failed: {e}"),
            OnceError::NotRecorded => {
                f.write_str("the operation ran, but its output is not recorded yet")
            }
            OnceError::Encode(e) => write!(f, "the input or output did not serialize: {e}"),
            OnceError::Decode(e) => write!(f, "the recorded output could not be read: {e}"),
            OnceError::ReplayRefused(reason) => {
                write!(
                    f,
                    "the recorded output was refused by the replay check: {reason}"
                )
            }
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for OnceError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            OnceError::Failed(e) => Some(e),
            OnceError::Store(e) => Some(e),
            OnceError::Encode(e) | OnceError::Decode(e) => Some(e),
            _ => None,
        }
    }
}
