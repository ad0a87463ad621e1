//! The life of a held claim: its heartbeat while the handler runs and while its answer is recorded,
//! then exactly one of complete or release, retried until the store answers.
//!
//! - **Heartbeat.** While a [`Lease`] exists (the handler, the body, every completion attempt), a
//!   task of its own renews the record a third of the in-progress TTL after the last renewal that
//!   got through, and, when a renewal fails, again a twentieth of the TTL later; each renewal may
//!   take at most a sixth of the TTL. The task is not the handler's: a handler that blocks its
//!   thread (a synchronous SDK, `block_in_place`, a CPU loop) does not stop it on a multi-threaded
//!   runtime. It is aborted when the lease is dropped. So "older than the TTL" means "no heartbeat
//!   for a TTL": the holder died. A live handler, however slow, is never retaken while the store
//!   can be reached.
//! - **Complete.** Once the handler has answered with a response the policy records, the effect
//!   has happened and the record is never released. When the store fails, the completion is
//!   retried in the background, heartbeat running, until it succeeds or the lease is lost; never
//!   given up on a timer. After three attempts that failed while the store took renewals between
//!   them (it is reachable; the completion itself fails), the body is left out of the record: a body
//!   too large for the store, or for its timeout, must not keep the key in progress for ever.
//! - **Release.** Retried in the background until the store answers, for at most the in-progress TTL
//!   (after which the record is retakeable anyway).
//! - **Background work** (retried completions and releases, clean-ups) is spawned through the
//!   layer's [`Drain`](crate::Drain), so a graceful shutdown waits for it.
//! - **Claims whose answer was lost** (a store timeout after the claim may have committed, and may
//!   still land later) are released by their token in the background ([`abandon`]) until the
//!   release deletes them or the TTL has passed, so a retry is not stuck until the TTL.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::Fingerprint;
use crate::config::Config;
use crate::metrics::Label;
use crate::outcome::Outcome;
use crate::record::{Fenced, LeaseToken, RecordKey, StoredResponse};
use crate::report::report;
use crate::store::{IdempotencyStore, StoreError};
use tracing::Instrument;

/// A held claim: completed or released exactly once. Dropped before either (a panic while the
/// answer was being read, say), it releases the record if the handler had not answered, and
/// records the answer without its body if it had ([`Lease::answered`]): an effect that happened is
/// never released.
pub(crate) struct Lease<St: IdempotencyStore> {
    held: Arc<Held<St>>,
    /// The endpoint label of the outcomes this lease reports.
    label: Label,
    done: bool,
    /// The answer's status and headers, once the handler answered with a response to record.
    answered: Option<StoredResponse>,
    /// The heartbeat's task, aborted when the lease is dropped.
    heartbeat: Option<AbortHandle>,
    /// When the handler and its body must be done: the claim plus the maximum hold.
    deadline: Instant,
}

/// What [`Lease::complete`] did with its first attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Completed {
    /// The answer is recorded.
    Recorded,
    /// The lease was lost (the record was retaken): this answer is not the record's.
    Lost,
    /// The store failed; the completion goes on in the background.
    Retrying,
}

/// How a record was settled outside its lease (see [`Lease::settled_outside`]).
#[cfg(feature = "postgres")]
pub(crate) enum Settled {
    /// Completed in the handler's transaction, which committed.
    Recorded {
        /// The recorded status.
        status: u16,
    },
    /// Released by the store's own statement (after a failed commit).
    Released,
    /// The lease turned out to be lost: nothing of this run is recorded, nothing is released.
    Lost,
    /// Whether the handler's transaction committed is unknown (the store could not be asked).
    Unknown,
}

/// What the lease and its heartbeat task share.
struct Held<St> {
    store: St,
    config: Arc<Config>,
    /// Shared with the handler's `IdempotencyContext` rather than copied for it.
    key: Arc<RecordKey>,
    /// The claim's fingerprint, which the completion passes on to the store.
    fingerprint: Fingerprint,
    token: LeaseToken,
    /// Renewals that got through.
    renewals: AtomicU64,
    /// When the lease was last proven held (the claim, or the last renewal that got through, as
    /// sent): a lease made anew for the same claim (on the drop path) starts its schedule there.
    held_since: std::sync::Mutex<Instant>,
}

impl<St: IdempotencyStore> Lease<St> {
    /// The lease of a claim sent (or last proven held) at `held_since`, with its heartbeat started.
    pub(crate) fn new(
        store: St,
        config: Arc<Config>,
        label: Label,
        key: impl Into<Arc<RecordKey>>,
        fingerprint: Fingerprint,
        token: LeaseToken,
        held_since: Instant,
    ) -> Self {
        let key = key.into();
        let deadline = held_since + config.max_hold;
        let held = Arc::new(Held {
            store,
            config,
            key,
            fingerprint,
            token,
            renewals: AtomicU64::new(0),
            held_since: std::sync::Mutex::new(held_since),
        });
        let heartbeat = tokio::runtime::Handle::try_current().ok().map(|runtime| {
            runtime
                .spawn(heartbeat(held.clone(), held_since).in_current_span())
                .abort_handle()
        });
        Lease {
            held,
            label,
            done: false,
            answered: None,
            heartbeat,
            deadline,
        }
    }

    /// The lease of `claim`, held since `held_since`, once its heartbeat has started: for a
    /// handler or a closure about to run under it.
    ///
    /// The heartbeat's task was just spawned into this worker's LIFO slot, which other workers
    /// cannot steal from: were the handler to block this thread at its first poll, the heartbeat
    /// would never start. Yielding once lets it run (and arm its timer) first; its later wake-ups
    /// come from the timer and the store's sockets, on whichever worker drives them.
    pub(crate) async fn started(
        store: St,
        config: Arc<Config>,
        label: Label,
        key: Arc<RecordKey>,
        fingerprint: Fingerprint,
        token: LeaseToken,
        held_since: Instant,
    ) -> Self {
        let lease = Lease::new(store, config, label, key, fingerprint, token, held_since);
        tokio::task::yield_now().await;
        lease
    }

    /// When the handler and its body must be done (the maximum hold).
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
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

    /// The handler or its body ran past the maximum hold.
    pub(crate) fn timed_out(&self) {
        report(&self.held.config, &self.label, Outcome::TimedOut);
    }

    /// The endpoint label of the request's outcomes.
    #[cfg(feature = "postgres")]
    pub(crate) fn label(&self) -> &Label {
        &self.label
    }

    /// The record's scope.
    #[cfg(feature = "postgres")]
    pub(crate) fn key(&self) -> &RecordKey {
        &self.held.key
    }

    /// The claim's fingerprint.
    #[cfg(feature = "postgres")]
    pub(crate) fn fingerprint(&self) -> &Fingerprint {
        &self.held.fingerprint
    }

    /// The store the lease is held in.
    #[cfg(feature = "postgres")]
    pub(crate) fn store(&self) -> &St {
        &self.held.store
    }

    /// The lease token.
    #[cfg(feature = "postgres")]
    pub(crate) fn token(&self) -> LeaseToken {
        self.held.token
    }

    /// The record was settled outside the lease, by a statement of the handler's transaction or
    /// of the Postgres store's own: nothing is left to complete or release, except for
    /// [`Settled::Unknown`], which is released by its token in the background.
    #[cfg(feature = "postgres")]
    pub(crate) fn settled_outside(mut self, how: Settled) {
        self.done = true;
        let held = &self.held;
        held.config
            .local
            .let_go(&crate::coalesce::Scope::of(&held.key), held.token);
        match how {
            Settled::Recorded { status } => {
                report(&held.config, &self.label, Outcome::Recorded);
                tracing::debug!(status, "recorded in the handler's transaction");
            }
            Settled::Released => report(&held.config, &self.label, Outcome::Released),
            Settled::Lost => report(&held.config, &self.label, Outcome::LeaseLost),
            // A release only deletes a record still in progress under this lease, so a landed
            // commit stays (the retry gets its replay) and one that did not land lets the retry
            // run, rather than wait for the TTL.
            Settled::Unknown => abandon(
                &held.config,
                held.store.clone(),
                RecordKey::clone(&held.key),
                held.token,
            ),
        }
    }

    /// Records the response. When the store fails, the record is not released (the effect has
    /// happened): the completion is retried in the background, heartbeat running, until it succeeds
    /// or the lease is lost. Returns after the first attempt, with what it did.
    pub(crate) async fn complete(mut self, stored: Arc<StoredResponse>) -> Completed {
        self.done = true;
        let first = self.attempt(stored.clone()).await;
        if let Some(completed) = self.settled(first, stored.status) {
            return completed;
        }
        report(&self.held.config, &self.label, Outcome::RecordDeferred);
        let drain = self.held.config.drain.clone();
        drain.spawn(async move { self.keep_completing(stored).await });
        Completed::Retrying
    }

    async fn keep_completing(self, mut stored: Arc<StoredResponse>) {
        let held = &self.held;
        let mut pause = Duration::from_millis(50);
        // Failed attempts with a renewal that got through since the previous failure: the store
        // is reachable and takes renewals but refuses this completion, so the body is the trouble
        // (too large for the store or its timeout), not an outage.
        let mut refused = 0;
        let mut renewals_seen = held.renewals.load(Ordering::Relaxed);
        loop {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(self.longest_pause());
            if refused >= OMIT_BODY_AFTER && !stored.body_omitted {
                tracing::warn!(
                    "the store takes renewals but not this response; recording it without its body"
                );
                stored = Arc::new(StoredResponse {
                    body: bytes::Bytes::new(),
                    body_omitted: true,
                    ..(*stored).clone()
                });
            }
            let attempt = self.attempt(stored.clone()).await;
            if attempt.is_err() {
                let renewals = held.renewals.load(Ordering::Relaxed);
                if renewals > renewals_seen {
                    refused += 1;
                }
                renewals_seen = renewals;
            }
            if self.settled(attempt, stored.status).is_some() {
                return;
            }
        }
    }

    /// One completion attempt. A store that panics has failed this attempt, like one that answered
    /// an error: the panic must not end the request's task with the record left in progress, to be
    /// retaken (and the handler run again) after the TTL.
    async fn attempt(&self, stored: Arc<StoredResponse>) -> Result<Fenced, StoreError> {
        let held = &self.held;
        let completion = held.store.complete(
            &held.key,
            held.token,
            &held.fingerprint,
            stored,
            held.config.retention,
        );
        AssertUnwindSafe(completion)
            .catch_unwind()
            .await
            .unwrap_or_else(|_| Err(StoreError::msg("the store's completion panicked")))
    }

    /// The longest pause between retries: a quarter of the in-progress TTL, at most a second.
    fn longest_pause(&self) -> Duration {
        (self.held.config.in_progress_ttl / 4).min(Duration::from_secs(1))
    }

    /// Reports what a completion attempt did; `None` when the store failed.
    fn settled(&self, attempt: Result<Fenced, StoreError>, status: u16) -> Option<Completed> {
        let config = &self.held.config;
        match attempt {
            Ok(Fenced::Done) => {
                report(config, &self.label, Outcome::Recorded);
                tracing::debug!(status, "recorded");
                Some(Completed::Recorded)
            }
            Ok(Fenced::LeaseLost) => {
                report(config, &self.label, Outcome::LeaseLost);
                tracing::warn!(
                    "the lease was lost (the record was retaken after a TTL without heartbeat); \
                     this late result was not recorded"
                );
                Some(Completed::Lost)
            }
            Err(e) => {
                tracing::error!(error = %e, "the response could not be recorded yet; retrying");
                None
            }
        }
    }

    /// Releases the record (see `IdempotencyStore::release`) so that a retry runs again. When the store fails, the release is retried
    /// in the background for up to the in-progress TTL.
    pub(crate) async fn release(mut self, why: &str) {
        self.done = true;
        let held = &self.held;
        report(&held.config, &self.label, Outcome::Released);
        tracing::debug!(reason = why, "releasing the record");
        match release_once(&held.store, &held.key, held.token).await {
            Ok(Fenced::Done) => {}
            Ok(Fenced::LeaseLost) => {
                tracing::warn!("the lease was lost before the release; nothing changed")
            }
            Err(e) => {
                tracing::error!(error = %e, "the record could not be released yet; retrying");
                let (store, key, token) =
                    (held.store.clone(), RecordKey::clone(&held.key), held.token);
                let ttl = held.config.in_progress_ttl;
                held.config
                    .drain
                    .spawn(keep_releasing(store, key, token, ttl, 1));
            }
        }
    }
}

/// Renews the lease on its schedule until aborted; stops once the lease is lost. The first renewal
/// is due a third of the TTL after `since`, when the claim was sent.
async fn heartbeat<St: IdempotencyStore>(held: Arc<Held<St>>, since: Instant) {
    let ttl = held.config.in_progress_ttl;
    let lifetime = ttl + held.config.retention;
    let mut due = since + ttl / 3;
    loop {
        tokio::time::sleep_until(due).await;
        let started = Instant::now();
        // A store whose renewal panics must not end the heartbeat (the task would end with it,
        // and a live handler be retaken after the TTL): a panic counts as a failed renewal.
        let renewal = AssertUnwindSafe(held.store.renew(&held.key, held.token, lifetime))
            .catch_unwind()
            .map(|renewed| {
                renewed.unwrap_or_else(|_| Err(StoreError::msg("the store's renewal panicked")))
            });
        due = match tokio::time::timeout(renewal_bound(&held.config, &held.store), renewal).await {
            Ok(Ok(Fenced::Done)) => {
                tracing::trace!("lease renewed");
                held.renewals.fetch_add(1, Ordering::Relaxed);
                *crate::lock::lock(&held.held_since) = started;
                started + ttl / 3
            }
            Ok(Ok(Fenced::LeaseLost)) => {
                tracing::info!(
                    "the lease was lost while the handler or its recording was running (the \
                     record was retaken after a TTL without heartbeat)"
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

/// How long one renewal may take: a sixth of the TTL, or the store's own operation timeout when that
/// is longer (a healthy but slow store must not have every renewal cut short), at most half the TTL.
pub(crate) fn renewal_bound<St: IdempotencyStore>(config: &Config, store: &St) -> Duration {
    let ttl = config.in_progress_ttl;
    store
        .capabilities()
        .operation_timeout()
        .map_or(ttl / 6, |t| t.max(ttl / 6))
        .min(ttl / 2)
}

impl<St: IdempotencyStore> Drop for Lease<St> {
    fn drop(&mut self) {
        if let Some(heartbeat) = self.heartbeat.take() {
            heartbeat.abort();
        }
        if self.done {
            return;
        }
        let held = &self.held;
        let (store, config, label, key, fingerprint, token) = (
            held.store.clone(),
            held.config.clone(),
            self.label.clone(),
            held.key.clone(),
            held.fingerprint,
            held.token,
        );
        let answered = self.answered.take();
        let held_since = *crate::lock::lock(&held.held_since);
        // The new lease is made inside the task: a task the runtime drops unpolled (it is shutting
        // down) then owns no lease whose drop would spawn again.
        let drain = config.drain.clone();
        drain.spawn(async move {
            let lease = Lease::new(store, config, label, key, fingerprint, token, held_since);
            match answered {
                Some(head) => {
                    tracing::error!(
                        "the answer could not be read to the end; recording it without body"
                    );
                    lease.complete(Arc::new(head)).await;
                }
                None => lease.release("the request was dropped").await,
            }
        });
    }
}

/// Completion attempts refused while the store took renewals, after which the body is left out of
/// the record.
const OMIT_BODY_AFTER: u32 = 3;

/// After a claim that failed in flight (a timeout or a lost connection: the store may still have
/// committed it, or commit it later when the statement is finally delivered), releases the record
/// by its token in the background, so that no retry waits a whole in-progress TTL for a claim nobody
/// holds. Stops once the release took it, or after the TTL (the record is retakeable then).
///
/// At most [`MAX_ABANDONED`] such clean-ups run at once in a process: during a long outage every
/// request fails its claim, and beyond that many the records are left to their TTL rather than
/// piling up tasks that all call the store when it comes back. A clean-up task that is dropped (the
/// runtime shut down) gives its place back.
pub(crate) fn abandon<St: IdempotencyStore>(
    config: &Config,
    store: St,
    key: RecordKey,
    token: LeaseToken,
) {
    abandon_after(config, store, key, token, u32::MAX);
}

/// [`abandon`], for a claim that was most likely never granted (a waiter's read of a finished
/// record, cut at its bound): given up after three answers that nothing is held by it, so that
/// such clean-ups, which a slow store can make many of, do not fill the bound on clean-ups for a
/// TTL.
pub(crate) fn abandon_briefly<St: IdempotencyStore>(
    config: &Config,
    store: St,
    key: RecordKey,
    token: LeaseToken,
) {
    abandon_after(config, store, key, token, 3);
}

fn abandon_after<St: IdempotencyStore>(
    config: &Config,
    store: St,
    key: RecordKey,
    token: LeaseToken,
    absent_answers: u32,
) {
    static RUNNING: AtomicUsize = AtomicUsize::new(0);
    /// Gives the place back however the task ends.
    struct Place;
    impl Drop for Place {
        fn drop(&mut self) {
            RUNNING.fetch_sub(1, Ordering::Relaxed);
        }
    }
    if RUNNING.fetch_add(1, Ordering::Relaxed) >= MAX_ABANDONED {
        RUNNING.fetch_sub(1, Ordering::Relaxed);
        tracing::warn!("too many failed claims being cleaned up; this one waits for its TTL");
        return;
    }
    let place = Place;
    let ttl = config.in_progress_ttl;
    config.drain.spawn(async move {
        let _place = place;
        keep_releasing(store, key, token, ttl, absent_answers).await;
    });
}

/// Clean-ups of failed claims that may run at once in a process.
const MAX_ABANDONED: usize = 1024;

/// Tries to release `token`'s record until it is released, `absent_answers` answers said nothing was
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
        match release_once(&store, &key, token).await {
            Ok(Fenced::Done) => {
                tracing::debug!("released a claim whose holder could not use it");
                return;
            }
            Ok(Fenced::LeaseLost) => {
                absent += 1;
                if absent >= absent_answers {
                    return;
                }
            }
            Err(e) => tracing::debug!(error = %e, "release not done yet"),
        }
    }
}

/// One release attempt; a store that panics has failed it (and the release is retried), rather
/// than leave the record in progress until the TTL.
async fn release_once<St: IdempotencyStore>(
    store: &St,
    key: &RecordKey,
    token: LeaseToken,
) -> Result<Fenced, StoreError> {
    AssertUnwindSafe(store.release(key, token))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| Err(StoreError::msg("the store's release panicked")))
}

#[cfg(test)]
pub(crate) mod tests {
    //! The lease's schedule under a paused clock, over the memory store.

    use super::*;
    use crate::Fingerprint;
    use crate::record::{ClaimOutcome, ClaimRequest, Finished, Generation};
    use crate::store::MemoryStore;

    /// The memory store, noting when each renewal reached it (on the paused clock).
    #[derive(Clone)]
    pub(crate) struct Timed {
        pub(crate) inner: MemoryStore,
        renewals: Arc<std::sync::Mutex<Vec<Instant>>>,
        /// Its next renewal panics.
        pub(crate) panic_once: Arc<std::sync::atomic::AtomicBool>,
        /// Its next completion panics.
        pub(crate) complete_panics: Arc<std::sync::atomic::AtomicBool>,
    }

    impl IdempotencyStore for Timed {
        async fn claim(
            &self,
            request: &ClaimRequest,
        ) -> Result<crate::record::ClaimOutcome, StoreError> {
            self.inner.claim(request).await
        }
        async fn complete(
            &self,
            key: &RecordKey,
            lease: LeaseToken,
            fingerprint: &Fingerprint,
            response: Arc<StoredResponse>,
            retention: Duration,
        ) -> Result<Fenced, StoreError> {
            if self.complete_panics.swap(false, Ordering::SeqCst) {
                panic!("a store bug in complete");
            }
            self.inner
                .complete(key, lease, fingerprint, response, retention)
                .await
        }
        async fn renew(
            &self,
            key: &RecordKey,
            lease: LeaseToken,
            lifetime: Duration,
        ) -> Result<Fenced, StoreError> {
            crate::lock::lock(&self.renewals).push(Instant::now());
            if self.panic_once.swap(false, Ordering::SeqCst) {
                panic!("a store bug in renew");
            }
            self.inner.renew(key, lease, lifetime).await
        }
        async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
            self.inner.release(key, lease).await
        }
        async fn purge_expired(&self) -> Result<u64, StoreError> {
            self.inner.purge_expired().await
        }
        async fn lookup(
            &self,
            key: &crate::RecordKey,
        ) -> Result<Option<crate::store::RecordInfo>, crate::StoreError> {
            self.inner.lookup(key).await
        }
        async fn delete(
            &self,
            key: &crate::RecordKey,
        ) -> Result<crate::store::Deleted, crate::StoreError> {
            self.inner.delete(key).await
        }
        async fn list(
            &self,
            subject: &str,
            request: crate::store::ListRequest,
        ) -> Result<crate::store::RecordPage, crate::StoreError> {
            self.inner.list(subject, request).await
        }
        fn capabilities(&self) -> crate::store::Capabilities<'_> {
            self.inner.capabilities()
        }
    }

    const TTL: Duration = Duration::from_millis(900);

    pub(crate) fn config() -> Arc<Config> {
        Arc::new(Config {
            in_progress_ttl: TTL,
            ..Config::default()
        })
    }

    pub(crate) fn request(key: &str) -> ClaimRequest {
        ClaimRequest {
            key: RecordKey {
                key: key.into(),
                subject: "alice".into(),
                endpoint: "POST /pay".into(),
            },
            fingerprint: Fingerprint::of(None, b"{}"),
            lease: LeaseToken::generate(),
            generation: Generation::generate(),
            in_progress_ttl: TTL,
            retention: Duration::from_secs(60),
        }
    }

    fn label() -> Label {
        let (parts, ()) = http::Request::new(()).into_parts();
        Label::of(&parts)
    }

    /// A claimed record and its lease, made as the layer makes them.
    pub(crate) async fn claimed<St: IdempotencyStore>(
        store: &St,
        config: &Arc<Config>,
        key: &str,
    ) -> (ClaimRequest, Lease<St>) {
        let request = request(key);
        assert!(matches!(
            store.claim(&request).await.expect("claim"),
            ClaimOutcome::Claimed { .. }
        ));
        let lease = Lease::new(
            store.clone(),
            config.clone(),
            label(),
            request.key.clone(),
            request.fingerprint,
            request.lease,
            Instant::now(),
        );
        (request, lease)
    }

    pub(crate) fn store() -> Timed {
        Timed {
            inner: MemoryStore::new(),
            renewals: Arc::default(),
            panic_once: Arc::default(),
            complete_panics: Arc::default(),
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_heartbeat_renews_every_third_of_the_ttl_from_the_claim() {
        let (store, config) = (store(), config());
        let start = Instant::now();
        let (_request, lease) = claimed(&store, &config, "k").await;
        tokio::time::sleep(TTL * 3 + TTL / 6).await;
        let renewals = crate::lock::lock(&store.renewals).clone();
        let offsets: Vec<Duration> = renewals.iter().map(|at| *at - start).collect();
        let expected: Vec<Duration> = (1..=9).map(|n| TTL / 3 * n).collect();
        assert_eq!(offsets, expected);
        assert_eq!(lease.held.renewals.load(Ordering::Relaxed), 9);
        drop(lease);
        // The heartbeat stops with its lease.
        tokio::time::sleep(TTL * 2).await;
        assert_eq!(crate::lock::lock(&store.renewals).len(), 9);
    }

    #[tokio::test(start_paused = true)]
    async fn the_heartbeat_stops_once_the_lease_is_lost() {
        let (store, config) = (store(), config());
        let (request, lease) = claimed(&store, &config, "k").await;
        tokio::time::sleep(TTL / 3 + TTL / 6).await;
        assert_eq!(crate::lock::lock(&store.renewals).len(), 1);
        // Another process retakes the record (here: its lease is released under it).
        assert!(
            store
                .inner
                .release(&request.key, request.lease)
                .await
                .expect("release")
                .is_done()
        );
        tokio::time::sleep(TTL * 3).await;
        assert_eq!(
            crate::lock::lock(&store.renewals).len(),
            2,
            "one renewal finds the lease lost, then none"
        );
        lease.complete(Arc::new(head(201))).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_that_panics_is_retried_and_the_heartbeat_goes_on() {
        let (store, config) = (store(), config());
        store.panic_once.store(true, Ordering::SeqCst);
        let start = Instant::now();
        let (_request, lease) = claimed(&store, &config, "k").await;
        tokio::time::sleep(TTL + TTL / 6).await;
        let renewals = crate::lock::lock(&store.renewals).clone();
        let offsets: Vec<Duration> = renewals.iter().map(|at| *at - start).collect();
        // The first panicked; the retry a twentieth of the TTL later got through, and the
        // schedule goes on from it.
        let retried = TTL / 3 + TTL / 20;
        assert_eq!(
            offsets,
            vec![TTL / 3, retried, retried + TTL / 3, retried + TTL / 3 * 2]
        );
        assert_eq!(lease.held.renewals.load(Ordering::Relaxed), 3);
    }

    #[tokio::test(start_paused = true)]
    async fn a_completion_that_panics_is_retried_and_the_answer_recorded() {
        let (store, config) = (store(), config());
        store.complete_panics.store(true, Ordering::SeqCst);
        let (request, lease) = claimed(&store, &config, "k").await;
        // The panic is the first attempt's failure, not the request's.
        assert!(matches!(
            lease.complete(Arc::new(head(201))).await,
            Completed::Retrying
        ));
        assert!(config.drain.wait(Duration::from_secs(5)).await);
        assert_eq!(recorded_status(&store, request).await, 201);
    }

    #[tokio::test(start_paused = true)]
    async fn an_outcome_hook_that_panics_does_not_stop_the_lease_from_settling() {
        let store = store();
        let config = Arc::new(Config {
            in_progress_ttl: TTL,
            on_outcome: Some(Arc::new(|outcome| {
                if matches!(outcome, Outcome::RecordDeferred | Outcome::TimedOut) {
                    panic!("an application hook bug");
                }
            })),
            ..Config::default()
        });
        // A first completion attempt that fails reports `RecordDeferred`: the retries go on.
        store.complete_panics.store(true, Ordering::SeqCst);
        let (request, lease) = claimed(&store, &config, "k").await;
        lease.timed_out();
        assert!(matches!(
            lease.complete(Arc::new(head(504))).await,
            Completed::Retrying
        ));
        assert!(config.drain.wait(Duration::from_secs(5)).await);
        assert_eq!(recorded_status(&store, request).await, 504);
    }

    /// The status `request`'s record holds, as a retry of it finds it (it must be finished).
    async fn recorded_status(store: &Timed, request: ClaimRequest) -> u16 {
        let retry = ClaimRequest {
            lease: LeaseToken::generate(),
            ..request
        };
        match store.claim(&retry).await.expect("claim") {
            ClaimOutcome::Finished(stored) => stored.status,
            other => panic!("expected the record, got {other:?}"),
        }
    }

    fn head(status: u16) -> StoredResponse {
        StoredResponse {
            outcome: Finished::Completed,
            status,
            headers: Vec::new(),
            body: bytes::Bytes::from_static(b"{\"id\":1}"),
            body_omitted: false,
            expires_in: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_dropped_before_the_answer_releases_and_after_it_records_the_head() {
        let (store, config) = (store(), config());
        // Dropped before the handler answered: released for another try.
        let (request, lease) = claimed(&store, &config, "released").await;
        drop(lease);
        assert!(config.drain.wait(Duration::from_secs(5)).await);
        let retry = ClaimRequest {
            lease: LeaseToken::generate(),
            ..request.clone()
        };
        assert!(matches!(
            store.claim(&retry).await.expect("claim"),
            ClaimOutcome::Claimed { retaken: false, .. }
        ));

        // Dropped after it answered: its status and headers are recorded, without the body.
        let (answered, mut lease) = claimed(&store, &config, "answered").await;
        lease.answered(&head(201));
        drop(lease);
        assert!(config.drain.wait(Duration::from_secs(5)).await);
        let replay = ClaimRequest {
            lease: LeaseToken::generate(),
            ..answered
        };
        match store.claim(&replay).await.expect("claim") {
            ClaimOutcome::Finished(stored) => {
                assert_eq!(stored.status, 201);
                assert!(stored.body_omitted);
                assert!(stored.body.is_empty());
            }
            other => panic!("expected the recorded head, got {other:?}"),
        }
    }
}
