//! The life of a held claim: its heartbeat while the handler runs and while its answer is recorded,
//! then exactly one of complete or release, retried until the store answers.
//!
//! - **Heartbeat.** While a [`Lease`] holds a record ([`Lease::hold`]: the handler, the body, every
//!   completion attempt), it renews it a third of the in-progress TTL after the last renewal that
//!   got through, and, when a renewal fails, again a twentieth of the TTL later; each renewal may
//!   take at most a sixth of the TTL. The schedule belongs to the lease, not to one phase, so
//!   "older than the TTL" means "no heartbeat for a TTL": the holder died. A live handler, however
//!   slow, is never retaken while the store can be reached.
//! - **Complete.** Once the handler has answered with a response the policy records, the effect
//!   has happened and the record is never released. When the store fails, the completion is
//!   retried in the background, heartbeat running, until it succeeds or the lease is lost; never
//!   given up on a timer. After three attempts that failed while the store took renewals between
//!   them (it is reachable; the completion itself fails), the body is left out of the record: a body
//!   too large for the store, or for its timeout, must not keep the key in progress for ever.
//! - **Release.** Retried in the background until the store answers, for at most the in-progress TTL
//!   (after which the record is retakeable anyway).
//! - **Claims whose answer was lost** (a store timeout after the claim may have committed, and may
//!   still land later) are released by their token in the background ([`abandon`]) until the
//!   release deletes them or the TTL has passed, so a retry is not stuck until the TTL.

use std::future::{Future, poll_fn};
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use tokio::time::Instant;
use tracing::Instrument;

use crate::config::Config;
use crate::metrics::Label;
use crate::outcome::{Outcome, report};
use crate::record::{LeaseToken, RecordKey, StoredResponse};
use crate::store::{IdempotencyStore, StoreError};

/// A held claim: completed or released exactly once. Dropped before either (a panic while the
/// answer was being read, say), it releases the record if the handler had not answered, and
/// records the answer without its body if it had ([`Lease::answered`]): an effect that happened is
/// never released.
pub(crate) struct Lease<St: IdempotencyStore> {
    store: St,
    config: Arc<Config>,
    /// The endpoint label of the outcomes this lease reports.
    label: Label,
    key: RecordKey,
    token: LeaseToken,
    done: bool,
    /// The answer's status and headers, once the handler answered with a response to record.
    answered: Option<StoredResponse>,
    /// When the next renewal is due; shared by every phase of the lease.
    next_renewal: Mutex<Instant>,
    /// Renewals that got through.
    renewals: AtomicU64,
}

impl<St: IdempotencyStore> Lease<St> {
    pub(crate) fn new(
        store: St,
        config: Arc<Config>,
        label: Label,
        key: RecordKey,
        token: LeaseToken,
    ) -> Self {
        let first = Instant::now() + config.in_progress_ttl / 3;
        Lease {
            store,
            config,
            label,
            key,
            token,
            done: false,
            answered: None,
            next_renewal: Mutex::new(first),
            renewals: AtomicU64::new(0),
        }
    }

    /// The handler answered with a response the policy records (`head`: its status and headers,
    /// body omitted): from now on the record is never released.
    pub(crate) fn answered(&mut self, head: &StoredResponse) {
        self.answered = Some(StoredResponse {
            body: bytes::Bytes::new(),
            body_omitted: true,
            ..head.clone()
        });
    }

    /// The endpoint label of the request's outcomes.
    #[cfg(feature = "postgres")]
    pub(crate) fn label(&self) -> &Label {
        &self.label
    }

    /// The record's scope.
    #[cfg(feature = "postgres")]
    pub(crate) fn key(&self) -> &RecordKey {
        &self.key
    }

    /// The store the lease is held in.
    #[cfg(feature = "postgres")]
    pub(crate) fn store(&self) -> &St {
        &self.store
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
        self.store.settled_elsewhere(&self.key, self.token);
        report(&self.config, &self.label, Outcome::Recorded);
        tracing::info!(status, "recorded in the handler's transaction");
    }

    /// The record was released by the store's own statement (after a failed commit).
    #[cfg(feature = "postgres")]
    pub(crate) fn released_elsewhere(mut self) {
        self.done = true;
        self.store.settled_elsewhere(&self.key, self.token);
        report(&self.config, &self.label, Outcome::Released);
    }

    /// The lease turned out to be lost: nothing of this run is recorded, nothing is released.
    #[cfg(feature = "postgres")]
    pub(crate) fn lost(mut self) {
        self.done = true;
        self.store.settled_elsewhere(&self.key, self.token);
        report(&self.config, &self.label, Outcome::LeaseLost);
    }

    /// Whether the handler's transaction committed is unknown (the store could not be asked): the
    /// record is either finished by this lease or still in progress under it with nothing
    /// committed. It is released by its token in the background (see [`abandon`]): a release only
    /// deletes a record still in progress, so a landed commit stays and the retry gets its replay,
    /// and one that did not land lets the retry run, rather than wait for the TTL.
    #[cfg(feature = "postgres")]
    pub(crate) fn outcome_unknown(mut self) {
        self.done = true;
        self.store.settled_elsewhere(&self.key, self.token);
        abandon(
            self.store.clone(),
            self.key.clone(),
            self.token,
            self.config.in_progress_ttl,
        );
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

    /// Renews the lease on its schedule forever (until dropped); stops once the lease is lost.
    async fn heartbeat(&self) {
        let ttl = self.config.in_progress_ttl;
        let lifetime = ttl + self.config.retention;
        loop {
            let due = *lock(&self.next_renewal);
            tokio::time::sleep_until(due).await;
            let started = Instant::now();
            let renewal = self.store.renew(&self.key, self.token, lifetime);
            let next = match tokio::time::timeout(ttl / 6, renewal).await {
                Ok(Ok(true)) => {
                    tracing::trace!("lease renewed");
                    self.renewals.fetch_add(1, Ordering::Relaxed);
                    started + ttl / 3
                }
                Ok(Ok(false)) => {
                    tracing::warn!(
                        "the lease was lost while the handler or its recording was running \
                         (the record was retaken after a TTL without heartbeat)"
                    );
                    return std::future::pending().await;
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
            *lock(&self.next_renewal) = next;
        }
    }

    /// Records the response. When the store fails, the record is not released (the effect has
    /// happened): the completion is retried in the background, heartbeat running, until it succeeds
    /// or the lease is lost. Returns after the first attempt.
    pub(crate) async fn complete(mut self, stored: Arc<StoredResponse>) {
        self.done = true;
        let first = self
            .hold(
                self.store
                    .complete(&self.key, self.token, stored.clone(), self.config.retention),
            )
            .await;
        if self.settled(first, stored.status) {
            return;
        }
        report(&self.config, &self.label, Outcome::RecordDeferred);
        tokio::spawn(async move { self.keep_completing(stored).await }.in_current_span());
    }

    async fn keep_completing(self, mut stored: Arc<StoredResponse>) {
        let retries = async {
            let mut pause = Duration::from_millis(50);
            // Failed attempts with a renewal that got through since the previous failure: the store
            // is reachable and takes renewals but refuses this completion, so the body is the
            // trouble (too large for the store or its timeout), not an outage.
            let mut refused = 0;
            let mut renewals_seen = self.renewals.load(Ordering::Relaxed);
            loop {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(self.longest_pause());
                if refused >= OMIT_BODY_AFTER && !stored.body_omitted {
                    tracing::warn!(
                        "the store takes renewals but not this response; recording it without its \
                         body"
                    );
                    stored = Arc::new(StoredResponse {
                        body: bytes::Bytes::new(),
                        body_omitted: true,
                        ..(*stored).clone()
                    });
                }
                let attempt = self
                    .store
                    .complete(&self.key, self.token, stored.clone(), self.config.retention)
                    .await;
                if attempt.is_err() {
                    let renewals = self.renewals.load(Ordering::Relaxed);
                    if renewals > renewals_seen {
                        refused += 1;
                    }
                    renewals_seen = renewals;
                }
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
                report(&self.config, &self.label, Outcome::Recorded);
                tracing::info!(status, "recorded");
                true
            }
            Ok(false) => {
                report(&self.config, &self.label, Outcome::LeaseLost);
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
        report(&self.config, &self.label, Outcome::Released);
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
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let (store, config, label, key, token) = (
            self.store.clone(),
            self.config.clone(),
            self.label.clone(),
            self.key.clone(),
            self.token,
        );
        let answered = self.answered.take();
        // The new lease is made inside the task: a task the runtime drops unpolled (it is shutting
        // down) then owns no lease whose drop would spawn again.
        runtime.spawn(
            async move {
                let lease = Lease::new(store, config, label, key, token);
                match answered {
                    Some(head) => {
                        tracing::error!(
                            "the answer could not be read to the end; recording it without body"
                        );
                        lease.complete(Arc::new(head)).await;
                    }
                    None => lease.release("the request was dropped").await,
                }
            }
            .in_current_span(),
        );
    }
}

fn lock(next: &Mutex<Instant>) -> std::sync::MutexGuard<'_, Instant> {
    next.lock().unwrap_or_else(|p| p.into_inner())
}

/// Completion attempts refused while the store took renewals, after which the body is left out of
/// the record.
const OMIT_BODY_AFTER: u32 = 3;

/// After a claim that failed in flight (a timeout or a lost connection: the store may still have
/// committed it, or commit it later when the statement is finally delivered), releases the record
/// by its token in the background, so that no retry waits a whole in-progress TTL for a claim nobody
/// holds. Stops once the release deleted it, or after the TTL (the record is retakeable then).
///
/// At most [`MAX_ABANDONED`] such clean-ups run at once in a process: during a long outage every
/// request fails its claim, and beyond that many the records are left to their TTL rather than
/// piling up tasks that all call the store when it comes back.
pub(crate) fn abandon<St: IdempotencyStore>(
    store: St,
    key: RecordKey,
    token: LeaseToken,
    ttl: Duration,
) {
    static RUNNING: AtomicU64 = AtomicU64::new(0);
    if RUNNING.fetch_add(1, Ordering::Relaxed) >= MAX_ABANDONED {
        RUNNING.fetch_sub(1, Ordering::Relaxed);
        tracing::warn!("too many failed claims being cleaned up; this one waits for its TTL");
        return;
    }
    tokio::spawn(
        async move {
            keep_releasing(store, key, token, ttl, u32::MAX).await;
            RUNNING.fetch_sub(1, Ordering::Relaxed);
        }
        .in_current_span(),
    );
}

/// Clean-ups of failed claims that may run at once in a process.
const MAX_ABANDONED: u64 = 1024;

/// Tries to release `token`'s record until it is deleted, `absent_answers` answers said nothing was
/// held by it, or `ttl` has passed (at least one attempt is made).
async fn keep_releasing<St: IdempotencyStore>(
    store: St,
    key: RecordKey,
    token: LeaseToken,
    ttl: Duration,
    absent_answers: u32,
) {
    let deadline = Instant::now() + ttl;
    let mut pause = (ttl / 10).min(Duration::from_millis(100));
    let mut absent = 0;
    loop {
        tokio::time::sleep(pause).await;
        if Instant::now() > deadline {
            return;
        }
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
