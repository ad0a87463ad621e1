//! The claim: one operation's key asked of the store (through this process's own claims first),
//! and what its answer means for the door that asked: run the work under a lease, or answer.
//! Written once, for the HTTP layer and `RunOnce` alike.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use futures_util::FutureExt;
use tokio::time::Instant;

use super::context::IdempotencyContext;
use super::core::Engine;
use super::lease::Lease;
use super::outcome::Outcome;
use super::settings::Settings;
use super::shares::Records;
use super::timing::fresh_within;
use super::wait::Stage;
use crate::store::{
    ClaimOutcome, ClaimRequest, Fenced, Fingerprint, Generation, IdempotencyStore, RecordKey,
    StoreError, StoredResponse, SubjectUsage,
};
use crate::util::metrics::{Label, timed};

/// What the store's answer to a claim means for the door that asked.
pub(crate) enum Claim<St: IdempotencyStore> {
    /// The claim is held, and proven fresh: run the work under the lease, with this context.
    Held(Lease<St>, IdempotencyContext),
    /// The operation finished: its recorded answer, and when the claim was sent (the store
    /// counted the record's time left from a moment after it).
    Finished(Arc<StoredResponse>, Instant),
    /// Another holder runs it now (or waiting for its answer ran out).
    InProgress,
    /// The key was used for another request within the retention.
    KeyReuse,
    /// The key's record expired within the tombstones' time: nothing runs.
    Expired,
    /// The scope is one the engine keeps for itself (a tombstone's): a fault of the application's
    /// endpoint or scope, not of the request; nothing runs.
    Reserved,
    /// The store failed, and the settings say to run the work unguarded (`fail_open`).
    Unguarded,
    /// The store failed (or answered the claim too late to be trusted): nothing runs.
    Unavailable(Unavailable),
}

/// What a subject's share of the store's records says of a claim.
enum ShareOfRecords {
    /// Claim it (a new key: pending until the store answers).
    Within(Option<super::shares::NewKey>),
    /// Refused: the subject holds its share.
    Over,
    /// Refused a moment: the subject's records could not be counted.
    Unknown,
}

/// Why a claim could not be made.
pub(crate) enum Unavailable {
    /// The store failed.
    Store(StoreError),
    /// The store granted the claim too late to trust it, and it could not be proven held.
    TooLate,
}

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Unavailable::Store(e) => e.fmt(f),
            Unavailable::TooLate => {
                f.write_str("the idempotency store answered the claim too late to be trusted")
            }
        }
    }
}

impl<St: IdempotencyStore> Engine<St> {
    /// Claims `key` for an operation with `fingerprint`, its outcomes counted under `label`.
    ///
    /// A duplicate of work in progress waits for its answer when the settings say so; `waiting`,
    /// when given, tells its door's future when nothing but look-ups are under way (see
    /// [`Stage`]).
    pub(crate) async fn claim(
        &self,
        label: Label,
        key: RecordKey,
        fingerprint: Fingerprint,
        waiting: Option<&Stage>,
    ) -> Claim<St> {
        let settings = self.settings();
        // The tombstones' scopes are the engine's own: a request that could name one (a custom
        // endpoint, a run-once scope) would plant a tombstone on a key never used.
        if super::tombstone::is_tombstone(&key) {
            self.report(&label, Outcome::Rejected);
            tracing::error!(
                "a scope whose endpoint starts as a tombstone's was refused: the application's \
                 endpoint (or run-once scope) must not start with \" tombstone \""
            );
            return Claim::Reserved;
        }
        // The lease's token carries the keeper's presence (see `keeper`).
        let (lease, generation) = (self.keeper.token(self), Generation::generate());
        let request = ClaimRequest {
            key,
            fingerprint,
            lease,
            generation,
            in_progress_ttl: settings.in_progress_ttl,
            // The in-progress record's life past the TTL: at least the maximum hold.
            retention: settings.in_progress_retention(),
        };
        // A new key let through the subject's share stays pending until the store answers.
        let mut _new_key = None;
        if let Some(max) = settings.max_records_per_subject {
            let max_bytes = settings.max_bytes_per_subject;
            match self.share_of_records(&request.key, max, max_bytes).await {
                ShareOfRecords::Within(key) => _new_key = key,
                ShareOfRecords::Over => {
                    self.report(&label, Outcome::QuotaExceeded);
                    tracing::info!(
                        "the subject holds its share of the store's records; a new key refused"
                    );
                    return Claim::Unavailable(Unavailable::Store(StoreError::quota_exceeded(
                        "the subject holds its share of the store's records",
                    )));
                }
                ShareOfRecords::Unknown => {
                    self.report(&label, Outcome::StoreUnavailable);
                    tracing::warn!(
                        "the subject's records could not be counted; its new keys are refused a \
                         moment"
                    );
                    return Claim::Unavailable(Unavailable::Store(StoreError::refused_claim(
                        "the subject's records could not be counted",
                    )));
                }
            }
        }
        let sent = Instant::now();
        let outcome = self.store_claim(&request).await;
        drop(_new_key);
        match outcome {
            Ok(ClaimOutcome::Claimed { lease, generation }) => {
                // One rule for every store: a record an earlier run held keeps its generation.
                let retaken = generation != Some(request.generation);
                let request = ClaimRequest { lease, ..request };
                // A key whose record expired within the tombstones' time is not run again. Every
                // grant is looked at: a request that got "expired" released its claim, and the
                // same request sent again takes that record back as a retake. Looked at before
                // the grant is proven fresh, so that the time the look-up took counts.
                if settings.tombstones.is_some() {
                    let grave =
                        tokio::time::timeout(self.renewal_bound(), self.grave(&request.key)).await;
                    let grave = grave.unwrap_or_else(|_| {
                        Err(StoreError::msg("the tombstone's look-up timed out"))
                    });
                    if !matches!(grave, Ok(super::tombstone::Grave::Empty)) {
                        self.release_unused(request.key, request.lease).await;
                        return match grave {
                            Err(e) => {
                                self.report(&label, Outcome::StoreUnavailable);
                                tracing::error!(
                                    error = %e,
                                    "the key's tombstone could not be looked up; refusing the \
                                     request"
                                );
                                Claim::Unavailable(Unavailable::Store(e))
                            }
                            Ok(_) => {
                                self.report(&label, Outcome::Expired);
                                tracing::info!("the key's record expired; answered expired");
                                Claim::Expired
                            }
                        };
                    }
                }
                let Some(held_since) = self.fresh(&request, sent).await else {
                    self.abandon(request.key, request.lease);
                    self.report(&label, Outcome::StoreUnavailable);
                    tracing::warn!(
                        "the claim was answered too late to be trusted and could not be proven \
                         held; released, nothing ran"
                    );
                    return Claim::Unavailable(Unavailable::TooLate);
                };
                if retaken {
                    self.report(&label, Outcome::Retaken);
                    tracing::info!("retook a claim whose holder stopped renewing it");
                } else {
                    self.report(&label, Outcome::Claimed);
                    tracing::debug!("claimed; running");
                }
                let key = Arc::new(request.key);
                let context = IdempotencyContext::new(
                    key.clone(),
                    request.fingerprint,
                    retaken,
                    generation,
                    settings.derived_key_secret.clone(),
                )
                .with_steps(super::steps::EngineSteps {
                    engine: self.clone(),
                    key: key.clone(),
                    lease: request.lease,
                });
                // Its heartbeat runs before the work does (see `Lease::started`).
                let lease = Lease::started(
                    self.clone(),
                    label,
                    key,
                    request.fingerprint,
                    request.lease,
                    held_since,
                )
                .await;
                Claim::Held(lease, context)
            }
            // A duplicate of work in progress waits for its answer, when the settings say so.
            Ok(ClaimOutcome::InProgress) if !settings.wait.is_zero() => {
                let (waited, sent) = self.wait_for_answer(&request, waiting).await;
                self.answer(&label, waited, sent)
            }
            Ok(answered) => self.answer(&label, answered, sent),
            Err(e) => {
                // A claim whose answer was lost may have been made, and is released by its
                // token; an unreadable record or a refused claim made none.
                if e.may_have_claimed() {
                    self.abandon(request.key, request.lease);
                }
                // An unreadable record records an operation that happened, and a refused claim
                // a store that is full: running unguarded would repeat it, or run every retry.
                if settings.fail_open && e.may_have_claimed() {
                    self.report(&label, Outcome::FailedOpen);
                    tracing::warn!(error = %e, "idempotency store failed; running unguarded");
                    return Claim::Unguarded;
                }
                if e.is_quota_exceeded() {
                    self.report(&label, Outcome::QuotaExceeded);
                    tracing::info!(error = %e, "the subject holds its share of the store");
                } else if e.is_store_full() {
                    self.report(&label, Outcome::StoreFull);
                    tracing::error!(error = %e, "the idempotency store is full");
                } else {
                    self.report(&label, Outcome::StoreUnavailable);
                    tracing::error!(error = %e, "idempotency store failed; refusing the request");
                }
                Claim::Unavailable(Unavailable::Store(e))
            }
        }
    }

    /// Releases a grant that is not used (its key expired): at once, within a renewal's bound,
    /// else in the background until the release takes it.
    async fn release_unused(&self, key: RecordKey, lease: crate::store::LeaseToken) {
        let release = tokio::time::timeout(self.renewal_bound(), self.store_release(&key, lease));
        if !matches!(release.await, Ok(Ok(_))) {
            self.abandon(key, lease);
        }
    }

    /// The claim's answer when it lost to a record: reported, and passed on.
    fn answer(&self, label: &Label, outcome: ClaimOutcome, sent: Instant) -> Claim<St> {
        match outcome {
            ClaimOutcome::KeyReuse => {
                self.report(label, Outcome::KeyReuse);
                tracing::debug!("key reused for a different request");
                Claim::KeyReuse
            }
            ClaimOutcome::Finished(stored) => {
                self.report(label, Outcome::Replayed);
                tracing::debug!(status = stored.status, "replayed");
                Claim::Finished(stored, sent)
            }
            // In progress (and, never reached, a grant: `claim` handles it).
            ClaimOutcome::InProgress | ClaimOutcome::Claimed { .. } => {
                self.report(label, Outcome::InProgress);
                tracing::debug!("duplicate while in progress");
                Claim::InProgress
            }
        }
    }

    /// What the subject's share (`max`) of the store's records says of a claim of `key` (see
    /// [`Shares::records`]): one claim of the subject counts at a time, the others wait for it;
    /// while the subject is over its share, only a key whose record exists is claimed (its replay,
    /// `409` or retake); a count that failed refuses the subject's new keys a moment. A look-up
    /// that fails (or is not answered in time) refuses the claim as a new key would be, and so
    /// does a count that failed, unless the settings fail open.
    async fn share_of_records(
        &self,
        key: &RecordKey,
        max: u64,
        max_bytes: Option<u64>,
    ) -> ShareOfRecords {
        let shares = &self.state.shares;
        let id = shares.id(&key.subject);
        // Waits and counts are each bounded, and so are the turns: a claim that finds no room in
        // eight (its subject's other claims take the budgets as they come, or its counts keep
        // being cut short by cancellations) is refused as over its share (`429`, retry later).
        for _ in 0..8 {
            match shares.records(id, max, max_bytes) {
                Records::Within(new_key) => return ShareOfRecords::Within(Some(new_key)),
                Records::Over => return self.over(key, ShareOfRecords::Over).await,
                Records::Unknown => return self.over(key, ShareOfRecords::Unknown).await,
                Records::Wait(mut counting) => {
                    let _ = tokio::time::timeout(self.renewal_bound(), counting.changed()).await;
                }
                Records::Later(wait) => tokio::time::sleep(wait).await,
                Records::Count(ticket) => {
                    let count = timed("count", self.store().count_records(&key.subject, max));
                    let count = match tokio::time::timeout(self.renewal_bound(), count).await {
                        Ok(Ok(Some(usage))) => Ok(usage),
                        // A store that keeps no subjects counts nothing (`build()` refuses the
                        // share on one that says so; this is one that found out later).
                        Ok(Ok(None)) => Ok(SubjectUsage::default()),
                        Ok(Err(e)) => {
                            tracing::debug!(error = %e, "a subject's records could not be counted");
                            Err(())
                        }
                        Err(_) => Err(()),
                    };
                    if ticket.counted(count) {
                        return self.over(key, ShareOfRecords::Over).await;
                    }
                }
            }
        }
        self.over(key, ShareOfRecords::Over).await
    }

    /// A claim of `key` while its subject is over its share (or could not be counted): claimed
    /// when its record exists (a replay, a `409`, a retake), `refused` when it is a new key or
    /// the store could not say which (unless the settings fail open: then the claim goes on, and
    /// fails open as any claim would if the store fails it too).
    async fn over(&self, key: &RecordKey, refused: ShareOfRecords) -> ShareOfRecords {
        // A count that failed is a failure of the store: with fail_open, the claim goes on (and
        // fails open should the store fail it too).
        if matches!(refused, ShareOfRecords::Unknown) && self.settings().fail_open {
            return ShareOfRecords::Within(None);
        }
        let lookup = tokio::time::timeout(self.renewal_bound(), self.store_lookup(key));
        match lookup.await {
            Ok(Ok(Some(_))) => ShareOfRecords::Within(None),
            Ok(Err(_)) | Err(_) if self.settings().fail_open => ShareOfRecords::Within(None),
            _ => refused,
        }
    }

    /// Whether the claim sent at `sent` can be trusted as held now: at once when its answer came
    /// within a tenth of the in-progress TTL, otherwise after a guarded renewal (a late answer,
    /// from a slow commit, a lost packet or a throttled process, may describe a claim that another
    /// instance has retaken meanwhile). Gives when the lease was last proven held, or `None` to
    /// give it up.
    pub(crate) async fn fresh(&self, claim: &ClaimRequest, sent: Instant) -> Option<Instant> {
        let ttl = self.settings().in_progress_ttl;
        if sent.elapsed() <= fresh_within(ttl) {
            return Some(sent);
        }
        let renewing = Instant::now();
        // A store that panics has not confirmed the claim: given up (released by its token), as
        // after an error.
        let renewal = AssertUnwindSafe(self.store_renew(&claim.key, claim.lease))
            .catch_unwind()
            .map(|renewed| {
                renewed.unwrap_or_else(|_| Err(StoreError::msg("the store's renewal panicked")))
            });
        match tokio::time::timeout(self.renewal_bound(), renewal).await {
            // A renewal answered late is no better than the claim: give up rather than trust it.
            Ok(Ok(Fenced::Done)) if renewing.elapsed() <= fresh_within(ttl) => Some(renewing),
            Ok(Ok(Fenced::Done)) => {
                tracing::warn!("a late claim answer was confirmed too late to be trusted");
                None
            }
            Ok(Ok(Fenced::LeaseLost)) => {
                tracing::warn!("a late claim answer: the record was retaken meanwhile");
                None
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "a late claim answer could not be confirmed");
                None
            }
            Err(_) => None,
        }
    }
}

/// The span of one operation. Subjects and endpoints are personal data, and a forged one could
/// fake log lines: only their keyed hashes are logged, unless the application opts in
/// (`log_scope`). The hashes are keyed with the deployment secret (`derived_key_secret`) when it
/// is set, so that every instance logs an operation under the same hashes, and otherwise with a
/// key drawn once per process: a log reader cannot hash a guessed user id and look for it.
pub(crate) fn span(settings: &Settings, key: &RecordKey) -> tracing::Span {
    let log_key = log_key(settings);
    if settings.log_scope {
        tracing::info_span!(
            "idempotency",
            key_hash = %LogHash(log_key, &key.key),
            subject = ?key.subject,
            endpoint = ?key.endpoint,
        )
    } else {
        tracing::info_span!(
            "idempotency",
            key_hash = %LogHash(log_key, &key.key),
            subject_hash = %LogHash(log_key, &key.subject),
            endpoint_hash = %LogHash(log_key, &key.endpoint),
        )
    }
}

/// The key of the logged hashes: the deployment secret, or a key of this process's.
fn log_key(settings: &Settings) -> &[u8] {
    match settings.derived_key_secret.as_deref() {
        Some(secret) => secret.bytes(),
        None => process_log_key(),
    }
}

/// The key of logged hashes when no deployment secret is set: random, drawn once per process.
fn process_log_key() -> &'static [u8] {
    static KEY: std::sync::OnceLock<[u8; 32]> = std::sync::OnceLock::new();
    KEY.get_or_init(|| {
        // Keyed by the operating system's randomness (see `Generation::generate`).
        let mut key = [0u8; 32];
        key[..16].copy_from_slice(&crate::store::Generation::generate().0);
        key[16..].copy_from_slice(&crate::store::Generation::generate().0);
        key
    })
}

/// The first 8 bytes of a value's HMAC-SHA-256 under a log key, in hex, computed only if a
/// subscriber records the span.
struct LogHash<'a>(&'a [u8], &'a str);

impl fmt::Display for LogHash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mac = crate::util::hmac::hmac_sha256(
            self.0,
            &[b"axum-idempotency log hash v1\0", self.1.as_bytes()],
        );
        crate::util::hex::write(f, &mac[..8])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::lease::tests::{engine, request};

    #[tokio::test(start_paused = true)]
    async fn a_late_claim_whose_confirming_renewal_panics_is_given_up() {
        let (engine, store) = engine();
        let claim = request("late");
        assert!(matches!(
            store.claim(&claim).await.expect("claim"),
            ClaimOutcome::Claimed { .. }
        ));
        let sent = Instant::now();
        // Answered later than a tenth of the TTL: it must be confirmed by a renewal first.
        tokio::time::sleep(engine.settings().in_progress_ttl / 5).await;
        store.panic_next_renewal();
        assert_eq!(engine.fresh(&claim, sent).await, None);
        // The same, with a renewal that gets through: held since the renewal.
        let confirmed = engine.fresh(&claim, sent).await;
        assert_eq!(confirmed, Some(Instant::now()));
    }
}
