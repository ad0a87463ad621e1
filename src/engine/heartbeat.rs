//! The lease's heartbeat: while a claim is held, a task of its own renews the record a third of the
//! in-progress TTL after the last renewal that got through, and, when a renewal fails, again a
//! twentieth of the TTL later; each renewal may take at most the engine's renewal bound. The task
//! is not the work's: a handler that blocks its thread (a synchronous SDK, `block_in_place`, a CPU
//! loop) does not stop it on a multi-threaded runtime. So "older than the TTL" means "no heartbeat
//! for a TTL": the holder died. A live holder, however slow, is never retaken while the store can
//! be reached.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use futures_util::FutureExt;
use tokio::time::Instant;

use super::lease::Held;
use crate::store::{Fenced, IdempotencyStore, StoreError};

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
