//! The life of a held claim: its heartbeat while the handler runs and while its answer is recorded,
//! then exactly one of complete or release, retried until the store answers.
//!
//! - **Heartbeat.** While a [`Lease`] holds a record ([`Lease::hold`]), it renews it every third of
//!   the in-progress TTL, so "older than the TTL" means "no heartbeat for a TTL": the holder died. A
//!   live handler, however slow, is never retaken.
//! - **Complete.** Once the handler's answer is recorded the effect is on record. When the store
//!   fails, the completion is retried in the background, with the heartbeat still running, until it
//!   succeeds or the lease is lost; never given up on a timer, and never released (the effect has
//!   happened: a release would let a retry run it again).
//! - **Release.** Retried in the background until the store answers, for at most the in-progress TTL
//!   (after which the record is retakeable anyway).
//! - **Claims whose answer was lost** (a store timeout after the claim may have committed) are
//!   released by their token in the background ([`abandon`]), so a retry is not stuck until the TTL.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::config::Config;
use crate::outcome::{Outcome, report};
use crate::record::{LeaseToken, RecordKey, StoredResponse};
use crate::store::{IdempotencyStore, StoreError};

/// A held claim: completed or released exactly once, and released on drop if neither happened (the
/// runtime shut down), so this process never leaves a record `in_progress` on purpose.
pub(crate) struct Lease<St: IdempotencyStore> {
    store: St,
    config: Arc<Config>,
    key: RecordKey,
    token: LeaseToken,
    done: bool,
}

impl<St: IdempotencyStore> Lease<St> {
    pub(crate) fn new(store: St, config: Arc<Config>, key: RecordKey, token: LeaseToken) -> Self {
        Lease {
            store,
            config,
            key,
            token,
            done: false,
        }
    }

    /// The record's scope.
    #[cfg(feature = "postgres")]
    pub(crate) fn key(&self) -> &RecordKey {
        &self.key
    }

    /// The lease token.
    #[cfg(feature = "postgres")]
    pub(crate) fn token(&self) -> LeaseToken {
        self.token
    }

    /// The record was completed in the handler's transaction, which committed.
    #[cfg(feature = "postgres")]
    pub(crate) fn recorded_in_transaction(mut self, status: u16) {
        self.done = true;
        report(&self.config, Outcome::Recorded);
        tracing::info!(status, "recorded in the handler's transaction");
    }

    /// The lease turned out to be lost: nothing of this run is recorded, nothing is released.
    #[cfg(feature = "postgres")]
    pub(crate) fn lost(mut self) {
        self.done = true;
        report(&self.config, Outcome::LeaseLost);
    }

    /// Runs `work` while renewing the lease every third of the in-progress TTL. Work that finishes
    /// at its first poll (the usual fast handler) never starts a timer.
    pub(crate) async fn hold<F: Future>(&self, work: F) -> F::Output {
        let mut work = pin!(work);
        let mut heartbeat = pin!(self.heartbeat());
        poll_fn(|cx| {
            if let Poll::Ready(out) = work.as_mut().poll(cx) {
                return Poll::Ready(out);
            }
            // The heartbeat never finishes; polling it only arms its timer or sends a renewal.
            let _ = heartbeat.as_mut().poll(cx);
            Poll::Pending
        })
        .await
    }

    /// Renews the lease forever (until dropped); stops renewing once the lease is lost.
    async fn heartbeat(&self) {
        let every = self.config.in_progress_ttl / 3;
        let lifetime = self.config.in_progress_ttl + self.config.retention;
        loop {
            tokio::time::sleep(every).await;
            match self.store.renew(&self.key, self.token, lifetime).await {
                Ok(true) => tracing::trace!("lease renewed"),
                Ok(false) => {
                    tracing::warn!(
                        "the lease was lost while the handler or its recording was running \
                         (the record was retaken after a TTL without heartbeat)"
                    );
                    return std::future::pending().await;
                }
                Err(e) => tracing::warn!(error = %e, "the lease could not be renewed; will retry"),
            }
        }
    }

    /// Records the response. When the store fails, the record is not released (the effect has
    /// happened): the completion is retried in the background, heartbeat running, until it succeeds
    /// or the lease is lost. Returns after the first attempt.
    pub(crate) async fn complete(mut self, stored: Arc<StoredResponse>) {
        self.done = true;
        let first = self
            .store
            .complete(&self.key, self.token, stored.clone(), self.config.retention)
            .await;
        if self.settled(first, stored.status) {
            return;
        }
        report(&self.config, Outcome::RecordDeferred);
        tokio::spawn(async move { self.keep_completing(stored).await }.in_current_span());
    }

    async fn keep_completing(self, stored: Arc<StoredResponse>) {
        let retries = async {
            let mut pause = Duration::from_millis(50);
            loop {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(self.longest_pause());
                let attempt = self
                    .store
                    .complete(&self.key, self.token, stored.clone(), self.config.retention)
                    .await;
                if self.settled(attempt, stored.status) {
                    return;
                }
            }
        };
        self.hold(retries).await;
    }

    /// The longest pause between retries: a quarter of the in-progress TTL, at most a second.
    fn longest_pause(&self) -> Duration {
        (self.config.in_progress_ttl / 4).min(Duration::from_secs(1))
    }

    /// Reports what a completion attempt did; false when the store failed.
    fn settled(&self, attempt: Result<bool, StoreError>, status: u16) -> bool {
        match attempt {
            Ok(true) => {
                report(&self.config, Outcome::Recorded);
                tracing::info!(status, "recorded");
                true
            }
            Ok(false) => {
                report(&self.config, Outcome::LeaseLost);
                tracing::warn!(
                    "the lease was lost (the record was retaken after a TTL without heartbeat); \
                     this late result was not recorded"
                );
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "the response could not be recorded yet; retrying");
                false
            }
        }
    }

    /// Deletes the record so that a retry runs again. When the store fails, the release is retried
    /// in the background for up to the in-progress TTL.
    pub(crate) async fn release(mut self, why: &str) {
        self.done = true;
        report(&self.config, Outcome::Released);
        tracing::info!(reason = why, "releasing the record");
        match self.store.release(&self.key, self.token).await {
            Ok(true) => {}
            Ok(false) => tracing::warn!("the lease was lost before the release; nothing changed"),
            Err(e) => {
                tracing::error!(error = %e, "the record could not be released yet; retrying");
                let (store, key, token) = (self.store.clone(), self.key.clone(), self.token);
                let ttl = self.config.in_progress_ttl;
                tokio::spawn(keep_releasing(store, key, token, ttl, 1).in_current_span());
            }
        }
    }
}

impl<St: IdempotencyStore> Drop for Lease<St> {
    fn drop(&mut self) {
        if self.done {
            return;
        }
        if let Ok(runtime) = tokio::runtime::Handle::try_current() {
            let store = self.store.clone();
            let key = self.key.clone();
            let token = self.token;
            runtime.spawn(async move {
                let _ = store.release(&key, token).await;
            });
        }
    }
}

/// After a claim that failed in flight (a timeout or a lost connection: the store may still have
/// committed it), releases the record by its token in the background, so that no retry waits a whole
/// in-progress TTL for a claim nobody holds. Stops once the release deleted it, after three answers
/// that nothing is there, or after the TTL.
pub(crate) fn abandon<St: IdempotencyStore>(
    store: St,
    key: RecordKey,
    token: LeaseToken,
    ttl: Duration,
) {
    tokio::spawn(keep_releasing(store, key, token, ttl, 3).in_current_span());
}

/// Tries to release `token`'s record until it is deleted, `absent_answers` answers said nothing was
/// held by it, or `ttl` has passed.
async fn keep_releasing<St: IdempotencyStore>(
    store: St,
    key: RecordKey,
    token: LeaseToken,
    ttl: Duration,
    absent_answers: u32,
) {
    let deadline = Instant::now() + ttl;
    let mut pause = Duration::from_millis(100);
    let mut absent = 0;
    while Instant::now() + pause < deadline {
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_secs(2));
        match store.release(&key, token).await {
            Ok(true) => {
                tracing::info!("released a claim whose holder could not use it");
                return;
            }
            Ok(false) => {
                absent += 1;
                if absent >= absent_answers {
                    return;
                }
            }
            Err(e) => tracing::debug!(error = %e, "release not done yet"),
        }
    }
}
