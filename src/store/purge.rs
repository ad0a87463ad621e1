//! Purging expired records on a timer, for applications without a scheduler of their own.

use std::time::Duration;

use super::IdempotencyStore;
use crate::util::metrics::timed;

/// Spawns a task that calls [`IdempotencyStore::purge_expired`] every `every`, logging failures, for
/// applications that want expired records removed without a scheduler of their own (at most once
/// a second). Abort the returned handle to stop it.
pub fn spawn_purge<S: IdempotencyStore>(store: S, every: Duration) -> tokio::task::JoinHandle<()> {
    // A zero period would make the interval panic; purging more than once a second is pointless.
    let every = every.max(Duration::from_secs(1));
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(every);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            match timed("purge", store.purge_expired()).await {
                Ok(0) => {}
                Ok(purged) => tracing::debug!(purged, "purged expired idempotency records"),
                Err(e) => tracing::warn!(error = %e, "purging expired idempotency records failed"),
            }
        }
    })
}
