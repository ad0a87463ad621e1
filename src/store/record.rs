//! What a store keeps: the scope of a record, its lease token, and the stored response.

use bytes::Bytes;
use http::{HeaderName, HeaderValue};
use std::hash::{BuildHasher, Hasher};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::store::Fingerprint;

/// The scope of one idempotent operation: the same key from another subject or on another endpoint is
/// another operation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct RecordKey {
    /// The `Idempotency-Key` header, validated.
    pub key: String,
    /// The authenticated subject; empty for the shared anonymous scope.
    pub subject: String,
    /// Method and path, e.g. `POST /orders/42/pay`.
    pub endpoint: String,
}

impl RecordKey {
    /// SHA-256 of the scope (key, subject and endpoint, each length-prefixed), for stores that index
    /// records by a fixed-size value: any subject or endpoint fits, whatever its length or bytes.
    pub fn digest(&self) -> [u8; 32] {
        let mut hasher = Sha256::new();
        for part in [&self.key, &self.subject, &self.endpoint] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part.as_bytes());
        }
        hasher.finalize().into()
    }
}

/// The fencing token of one claim. Completing or releasing a record is conditional on holding it, so
/// a worker presumed dead cannot overwrite the result of the one that retook its record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseToken(pub i64);

impl LeaseToken {
    /// A fresh token, unique with overwhelming probability across processes and machines.
    pub fn generate() -> Self {
        Self::from_u64(unique_u64s::<1>()[0])
    }

    fn from_u64(value: u64) -> Self {
        // 0 marks a released record in the stores: never a claim's token.
        match value as i64 {
            0 => LeaseToken(1),
            token => LeaseToken(token),
        }
    }
}

/// The token of one delete, written where a deleted record's fingerprint was, so that the same
/// delete sent again knows it was the one that deleted it: 32 unpredictable bytes, which no
/// request's fingerprint is.
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn delete_token() -> [u8; 32] {
    let mut token = [0u8; 32];
    for (at, value) in unique_u64s::<4>().into_iter().enumerate() {
        token[at * 8..at * 8 + 8].copy_from_slice(&value.to_be_bytes());
    }
    token
}

/// One unpredictable 64-bit value (see [`unique_u64s`]).
pub(crate) fn unique_u64() -> u64 {
    unique_u64s::<1>()[0]
}

/// `N` unpredictable 64-bit values, unique with overwhelming probability across threads,
/// processes and machines: a process-wide counter, the clock and the process id, hashed with keys
/// drawn from the operating system's randomness once per thread (std's `RandomState`), one hash
/// per value (each with its index). The process id keeps apart a forked child, which inherits
/// the forking thread's keys and the counter, whatever its clock reads.
fn unique_u64s<const N: usize>() -> [u64; N] {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    thread_local! {
        static KEYS: std::collections::hash_map::RandomState =
            std::collections::hash_map::RandomState::new();
    }
    let count = COUNTER.fetch_add(1, Ordering::Relaxed);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let pid = std::process::id();
    // The common part is hashed once and each value continues from a copy of that state: the
    // same values as hashing the whole input for each.
    let hash = |keys: &std::collections::hash_map::RandomState| {
        let mut common = keys.build_hasher();
        common.write_u64(count);
        common.write_u128(now);
        common.write_u32(pid);
        std::array::from_fn(|i| {
            let mut hasher = common.clone();
            hasher.write_usize(i);
            hasher.finish()
        })
    };
    KEYS.try_with(hash)
        // A thread whose thread-locals are being torn down: std's keys for this thread, taken
        // for this call.
        .unwrap_or_else(|_| hash(&std::collections::hash_map::RandomState::new()))
}

/// The generation of a record: 128 random bits chosen when its key is first claimed, kept by retakes
/// of that record, new when the key is claimed again after expiry or deletion. It tells apart two
/// operations that share a scope and a body (a key reused after retention), so that
/// [`IdempotencyContext::derived_key`](crate::IdempotencyContext::derived_key) names one operation
/// only.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Generation(pub [u8; 16]);

impl Generation {
    /// A fresh generation, unique with overwhelming probability across processes and machines.
    pub fn generate() -> Self {
        let [a, b] = unique_u64s::<2>();
        Self::from_halves(a, b)
    }

    fn from_halves(a: u64, b: u64) -> Self {
        let mut bytes = [0u8; 16];
        bytes[..8].copy_from_slice(&a.to_be_bytes());
        bytes[8..].copy_from_slice(&b.to_be_bytes());
        Generation(bytes)
    }

    /// A generation read back from a store, if it has the right length.
    pub fn from_slice(bytes: &[u8]) -> Option<Self> {
        bytes.try_into().ok().map(Generation)
    }
}

impl std::fmt::Debug for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Generation(")?;
        crate::util::hex::write(f, &self.0)?;
        write!(f, ")")
    }
}

/// Whether a finished record holds a success or a definitive failure. Both are replayed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Finished {
    /// The operation succeeded (by default: a 2xx answer).
    Completed,
    /// The operation failed for good (by default: a 4xx answer other than 408, 409, 425, 429).
    Failed,
}

impl Finished {
    /// The name stored in a database column.
    pub fn as_str(self) -> &'static str {
        match self {
            Finished::Completed => "completed",
            Finished::Failed => "failed",
        }
    }
}

/// A response as recorded for replay: status, the allowed headers in order, and the body.
///
/// Made by [`StoredResponse::new`] outside this crate (a store reading one back); its fields are
/// read directly.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct StoredResponse {
    /// Completed or failed.
    pub outcome: Finished,
    /// The HTTP status code.
    pub status: u16,
    /// Header names and values, repeated headers kept in their order.
    pub headers: Vec<(HeaderName, HeaderValue)>,
    /// The whole body; empty when `body_omitted`.
    pub body: Bytes,
    /// True when the body was not recorded (over the recording limit, followed by trailers, or its
    /// stream failed after the handler answered): a replay sends the status and headers with an empty
    /// body and `Idempotency-Replay: omitted`.
    pub body_omitted: bool,
    /// How long the record had left when its store read it for a claim, if the store tells (the
    /// memory, Postgres and Redis stores do). A [`CachedStore`](crate::store::CachedStore) keeps a
    /// record no longer than this. Ignored by
    /// [`complete`](crate::store::IdempotencyStore::complete): retention decides there.
    pub expires_in: Option<Duration>,
}

impl StoredResponse {
    /// A recorded answer: its outcome, status, headers (repeated ones in order) and body, `None`
    /// when the body was left out of the record. Its time left is not known
    /// ([`with_expires_in`](Self::with_expires_in) tells it).
    pub fn new(
        outcome: Finished,
        status: u16,
        headers: Vec<(HeaderName, HeaderValue)>,
        body: Option<Bytes>,
    ) -> Self {
        StoredResponse {
            outcome,
            status,
            headers,
            body_omitted: body.is_none(),
            body: body.unwrap_or_default(),
            expires_in: None,
        }
    }

    /// The same answer, read with `left` of its record's life.
    pub fn with_expires_in(self, left: Option<Duration>) -> Self {
        StoredResponse {
            expires_in: left,
            ..self
        }
    }
}

/// A claim to make: the record's scope and fingerprint, and the layer's time limits.
#[derive(Debug, Clone)]
pub struct ClaimRequest {
    /// The record's scope.
    pub key: RecordKey,
    /// The request's fingerprint.
    pub fingerprint: Fingerprint,
    /// The lease token the caller holds if the claim (or a retake) succeeds. The caller chooses it,
    /// so that a claim whose answer was lost (a timeout after the store committed it) can still be
    /// released by its token.
    pub lease: LeaseToken,
    /// The generation a record made by this claim gets (a retake keeps the record's own).
    pub generation: Generation,
    /// How long an `in_progress` record may stand before another request may retake it.
    pub in_progress_ttl: Duration,
    /// How long the in-progress record lives past its TTL: a claim that is never completed (nor
    /// renewed) is purged, and may be taken, after `in_progress_ttl + retention`. The engine
    /// gives its retention, or its maximum hold when that is longer, so that no record expires
    /// under work still running. (A completion gives the record's retention of its own.)
    pub retention: Duration,
}

impl ClaimRequest {
    /// The claim of `key` with `fingerprint` by a new request: a lease token and a generation of
    /// its own, and these time limits. (The engine draws its own lease tokens, which carry its
    /// process's presence; stores of your own and tests build their claims here.)
    pub fn new(
        key: RecordKey,
        fingerprint: Fingerprint,
        in_progress_ttl: Duration,
        retention: Duration,
    ) -> Self {
        ClaimRequest {
            key,
            fingerprint,
            lease: LeaseToken::generate(),
            generation: Generation::generate(),
            in_progress_ttl,
            retention,
        }
    }

    /// The same claim sent by another request: the same scope, fingerprint and time limits, with
    /// a lease token and a generation of its own.
    pub fn from_another_request(&self) -> Self {
        ClaimRequest::new(
            self.key.clone(),
            self.fingerprint,
            self.in_progress_ttl,
            self.retention,
        )
    }
}

/// A recovery point of a run (SPEC 28): the result a step of the work returned, recorded with
/// the record so that a run that takes the record over after its holder died returns it without
/// running the step again. `result` is the engine's encoding of it (JSON); a store keeps it as
/// bytes, as it was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedStep {
    /// The step's name, unique within one operation (1 to 64 bytes).
    pub name: String,
    /// What the step returned, encoded.
    pub result: Vec<u8>,
}

/// What a write fenced by a lease (complete, renew, release) found: the lease held the record and
/// the write was made, or it no longer held it and nothing changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub enum Fenced {
    /// The lease held the record: the write was made (for a completion: or this lease had made it
    /// already, an earlier attempt whose answer was lost).
    Done,
    /// The lease no longer holds the record (retaken, released, finished, or never held): nothing
    /// changed.
    LeaseLost,
}

impl Fenced {
    /// [`Done`](Fenced::Done) when `held`, else [`LeaseLost`](Fenced::LeaseLost).
    pub fn from_held(held: bool) -> Self {
        if held {
            Fenced::Done
        } else {
            Fenced::LeaseLost
        }
    }

    /// Whether the write was made.
    pub fn is_done(self) -> bool {
        self == Fenced::Done
    }
}

/// The answer of a store to a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClaimOutcome {
    /// The caller holds the record now and runs the operation.
    ///
    /// Whether this run is a retake ([`is_retake`](Self::is_retake)) follows from the generation,
    /// one rule for every store: a record the claim made (a new key, a key past its retention, a
    /// released record taken by another request) has the claim's own generation; a record that an
    /// earlier run of the same operation held (a stale one whose holder died, a released one taken
    /// by the same request, this claim's own earlier grant of either, sent again) keeps its own.
    Claimed {
        /// The token that completing or releasing the record needs.
        lease: LeaseToken,
        /// The record's generation: the claim's own for a record it made, the record's for a
        /// record an earlier run held. `None` for a record written before generations were kept
        /// (its derived key is the one it had then).
        generation: Option<Generation>,
    },
    /// A record exists with another fingerprint: the key was reused for a different request.
    KeyReuse,
    /// Another request holds the record and its lease has not expired.
    InProgress,
    /// The operation finished; replay its response.
    Finished(Arc<StoredResponse>),
}

impl ClaimOutcome {
    /// Whether this answer grants `request` a record that an earlier run of the same operation
    /// held (its effect may have been started): its generation is not the claim's own. False for
    /// every answer but [`Claimed`](Self::Claimed).
    pub fn is_retake(&self, request: &ClaimRequest) -> bool {
        matches!(self, ClaimOutcome::Claimed { generation, .. } if *generation != Some(request.generation))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// Pinned bytes: stores index records by this digest, so a change to it would make every
    /// record written before a deploy invisible after it (each in-flight key new again).
    #[test]
    fn the_scope_digest_is_pinned() {
        let key = RecordKey {
            key: "k-1".into(),
            subject: "alice".into(),
            endpoint: "POST /checkout".into(),
        };
        assert_eq!(
            crate::util::hex::encode(&key.digest()),
            "62aed668056a7b8d3bdce909cc15474ecf63e8f9fd43e69a285515e1f67bc350"
        );
    }

    #[test]
    fn tokens_and_generations_are_unique_across_threads() {
        let threads: Vec<_> = (0..4)
            .map(|_| {
                std::thread::spawn(|| {
                    (0..20_000)
                        .map(|i| match i % 2 {
                            0 => (LeaseToken::generate(), Generation::generate()),
                            _ => (
                                crate::store::Presence::generate().lease(i),
                                Generation::generate(),
                            ),
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        let mut tokens = HashSet::new();
        let mut generations = HashSet::new();
        for thread in threads {
            for (token, generation) in thread.join().expect("thread") {
                assert_ne!(token.0, 0, "0 marks a released record");
                assert!(tokens.insert(token), "a token came twice");
                assert_ne!(generation.0[..8], generation.0[8..], "two halves alike");
                assert!(generations.insert(generation), "a generation came twice");
            }
        }
        assert_eq!(tokens.len(), 80_000);
    }
}
