//! The lease's heartbeat: while a claim is held, a task of its own renews the record a third of the
//! in-progress TTL after the last renewal that got through, and, when a renewal fails, again a
//! twentieth of the TTL later; each renewal may take at most the engine's renewal bound. The task
//! is not the work's: a handler that blocks its thread (a synchronous SDK, `block_in_place`, a CPU
//! loop) does not stop it on a multi-threaded runtime. So "older than the TTL" means "no heartbeat
//! for a TTL": the holder died. A live holder, however slow, is never retaken while the store can
//! be reached.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use futures_util::FutureExt;
use tokio::time::Instant;

use super::core::Engine;
use crate::store::{Fenced, Fingerprint, IdempotencyStore, LeaseToken, RecordKey, StoreError};

/// What the lease and its heartbeat task share.
pub(super) struct Held<St> {
    pub(super) engine: Engine<St>,
    /// Shared with the work's `IdempotencyContext` rather than copied for it.
    pub(super) key: Arc<RecordKey>,
    /// The claim's fingerprint, which the completion passes on to the store.
    pub(super) fingerprint: Fingerprint,
    pub(super) token: LeaseToken,
    /// Renewals that got through.
    pub(super) renewals: AtomicU64,
    /// When the lease was last proven held (the claim, or the last renewal that got through, as
    /// sent): a lease made anew for the same claim (on the drop path) starts its schedule there.
    pub(super) held_since: std::sync::Mutex<Instant>,
}

/// Renews the lease on its schedule until aborted; stops once the lease is lost. The first renewal
/// is due a third of the TTL after `since`, when the claim was sent.
pub(super) async fn heartbeat<St: IdempotencyStore>(held: Arc<Held<St>>, since: Instant) {
    let engine = &held.engine;
    let ttl = engine.settings().in_progress_ttl;
    let mut due = since + ttl / 3;
    loop {
        tokio::time::sleep_until(due).await;
        let started = Instant::now();
        // A store whose renewal panics must not end the heartbeat (the task would end with it,
        // and a live handler be retaken after the TTL): a panic counts as a failed renewal.
        let renewal = AssertUnwindSafe(engine.store_renew(&held.key, held.token))
            .catch_unwind()
            .map(|renewed| {
                renewed.unwrap_or_else(|_| Err(StoreError::msg("the store's renewal panicked")))
            });
        due = match tokio::time::timeout(engine.renewal_bound(), renewal).await {
            Ok(Ok(Fenced::Done)) => {
                tracing::trace!("lease renewed");
                held.renewals.fetch_add(1, Ordering::Relaxed);
                *crate::util::lock::lock(&held.held_since) = started;
                started + ttl / 3
            }
            Ok(Ok(Fenced::LeaseLost)) => {
                tracing::info!(
                    "the lease was lost while the work or its recording was running (the record \
                     was retaken after a TTL without heartbeat)"
                );
                return;
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "the lease could not be renewed; will retry");
                Instant::now() + ttl / 20
            }
            Err(_) => {
                tracing::warn!("the lease renewal timed out; will retry");
                Instant::now() + ttl / 20
            }
        };
    }
}
