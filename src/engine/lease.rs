//! The life of a held claim: its heartbeat while the work runs and while its answer is recorded,
//! then exactly one of complete or release, retried until the store answers.
//!
//! - **Heartbeat** (see `keeper`): while a [`Lease`] exists (the work, the body, every completion
//!   attempt), the engine's lease keeper renews the record and shows its presence, on a thread of
//!   its own, until the lease is dropped.
//! - **Complete.** Once the work has answered with a result to record, the effect has happened and
//!   the record is never released. When the store fails, the completion is retried in the
//!   background, heartbeat running, until it succeeds or the lease is lost; never given up on a
//!   timer. The caller waits for it a moment ([`recorded_within`](super::timing::recorded_within)),
//!   then answers that the result is not recorded yet ([`Completed::Retrying`]), never the result
//!   itself: a result sent before its record could be followed by another run's, should this
//!   process die before the record is written. After three attempts that failed while the store
//!   took renewals between them (it is reachable; the completion itself fails), the body is left
//!   out of the record: a body too large for the store, or for its timeout, must not keep the key
//!   in progress for ever.
//! - **Release.** Retried in the background until the store answers, for at most the maximum
//!   hold and a TTL (by then no lease of its presence is left, and the record is retakeable after
//!   its TTL).
//! - **Background work** (retried completions and releases, clean-ups) is spawned through the
//!   engine's [`Drain`](super::Drain), so a graceful shutdown waits for it.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::time::Instant;

use super::core::Engine;
use super::keeper::{Held, Registration};
use super::outcome::Outcome;
use super::shares::InFlight;
use crate::store::{
    Fenced, Fingerprint, IdempotencyStore, LeaseToken, RecordKey, StoreError, StoredResponse,
};
use crate::util::metrics::Label;

/// A held claim: completed or released exactly once. Dropped before either (a panic while the
/// answer was being read, say), it releases the record if the work had not answered, and records
/// the answer without its body if it had ([`Lease::answered`]): an effect that happened is never
/// released.
pub(crate) struct Lease<St: IdempotencyStore> {
    held: Arc<Held<Engine<St>>>,
    /// The endpoint label of the outcomes this lease reports.
    label: Label,
    done: bool,
    /// The answer's status and headers, once the work answered with a result to record.
    answered: Option<StoredResponse>,
    /// The lease keeper renews the record until this is dropped.
    /// Taken by the drop path into the task that settles the record, so the keeper renews it and
    /// shows its presence without a gap, however long that task waits for its runtime.
    kept: Option<Registration<Engine<St>>>,
    /// When the work and its body must be done: the claim plus the maximum hold.
    deadline: Instant,
    /// The subject's place in flight, when the work's request holds one: given back with the
    /// lease, so a response still streaming into its record (on a task of its own, after the
    /// request's future ended) still counts against its subject's share.
    share: Option<InFlight>,
}

/// What [`Lease::complete`] did with its first attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Completed {
    /// The answer is recorded.
    Recorded,
    /// The lease was lost (the record was retaken): this answer is not the record's.
    Lost,
    /// The store failed, and had not taken a retry of the completion within
    /// [`recorded_within`](super::timing::recorded_within): the completion goes on in the
    /// background. The result must not be answered (it is not the record's yet); a retry of the
    /// request gets the record's answer once it is written.
    Retrying,
}

/// How a record was settled outside its lease (see [`Lease::settled_outside`]).
pub(crate) enum Settled {
    /// Completed in the work's transaction, which committed.
    Recorded {
        /// The recorded status.
        status: u16,
    },
    /// Released by the store's own statement (after a failed commit).
    Released,
    /// The lease turned out to be lost: nothing of this run is recorded, nothing is released.
    Lost,
    /// Whether the work's transaction committed is unknown (the store could not be asked).
    Unknown,
}

/// How work run under a lease ([`Lease::run`]) ended.
#[derive(Debug)]
pub(crate) enum Ran<T> {
    /// It ended with this.
    Ended(T),
    /// It panicked: it gave no answer to record.
    Panicked,
    /// It was cancelled at the maximum hold (reported as timed out).
    TimedOut,
}

impl<St: IdempotencyStore> Lease<St> {
    /// The lease of a claim sent (or last proven held) at `held_since`, kept renewed by the
    /// engine's lease keeper.
    #[cfg(test)]
    pub(crate) fn new(
        engine: Engine<St>,
        label: Label,
        key: Arc<RecordKey>,
        fingerprint: Fingerprint,
        token: LeaseToken,
        held_since: Instant,
    ) -> Self {
        Self::kept(engine, label, key, fingerprint, token, held_since).0
    }

    /// [`new`](Self::new), and whether the keeper's task was started for it.
    fn kept(
        engine: Engine<St>,
        label: Label,
        key: Arc<RecordKey>,
        fingerprint: Fingerprint,
        token: LeaseToken,
        held_since: Instant,
    ) -> (Self, bool) {
        let deadline = held_since + engine.settings().max_hold();
        let keeper = engine.keeper.clone();
        let held = Arc::new(Held {
            engine,
            key,
            fingerprint,
            token,
            renewals: AtomicU64::new(0),
            held_since: std::sync::Mutex::new(held_since),
        });
        let registered = keeper.register(held.clone(), held_since);
        let lease = Lease {
            held,
            label,
            done: false,
            answered: None,
            kept: Some(registered.registration),
            deadline,
            share: None,
        };
        (lease, registered.started_task)
    }

    /// Holds the subject's place in flight until the lease ends (its record completed or
    /// released), rather than until the request's future ends.
    pub(crate) fn hold_share(&mut self, share: InFlight) {
        self.share = Some(share);
    }

    /// The lease of a claim held since `held_since`, kept renewed: for work about to run under it.
    ///
    /// Yields once before the work runs, on a multi-threaded runtime: what the claim left in this
    /// worker's LIFO slot, which other workers cannot steal from (the return of a pooled
    /// connection to its pool, a task the claim woke), runs first, rather than wait behind work
    /// that blocks this thread from its first poll. (On a current-thread runtime such work stops
    /// every task anyway; there it yields only when the keeper was just spawned on it, in the
    /// crate's tests.)
    pub(crate) async fn started(
        engine: Engine<St>,
        label: Label,
        key: Arc<RecordKey>,
        fingerprint: Fingerprint,
        token: LeaseToken,
        held_since: Instant,
    ) -> Self {
        let (lease, started_task) = Lease::kept(engine, label, key, fingerprint, token, held_since);
        let shared = tokio::runtime::Handle::try_current().is_ok_and(|runtime| {
            runtime.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread
        });
        if shared || started_task {
            tokio::task::yield_now().await;
        }
        lease
    }

    /// When the work and its body must be done (the maximum hold).
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Runs `work` under this lease, for both doors: until it ends, panics, or reaches the
    /// maximum hold (it is then cancelled, and the timeout reported). The keeper renews the lease
    /// meanwhile; settling the record (complete or release) is the caller's, by what it ran to.
    pub(crate) async fn run<F: Future>(&self, work: F) -> Ran<F::Output> {
        let work = AssertUnwindSafe(work).catch_unwind();
        match tokio::time::timeout_at(self.deadline, work).await {
            Ok(Ok(ended)) => Ran::Ended(ended),
            Ok(Err(_panic)) => Ran::Panicked,
            Err(_) => {
                self.timed_out();
                Ran::TimedOut
            }
        }
    }

    /// The engine the lease is held in.
    pub(crate) fn engine(&self) -> &Engine<St> {
        &self.held.engine
    }

    /// The record's scope.
    pub(crate) fn key(&self) -> &RecordKey {
        &self.held.key
    }

    /// The claim's fingerprint.
    pub(crate) fn fingerprint(&self) -> &Fingerprint {
        &self.held.fingerprint
    }

    /// The lease token.
    pub(crate) fn token(&self) -> LeaseToken {
        self.held.token
    }

    /// The endpoint label of the outcomes this lease reports.
    #[cfg_attr(not(sql), allow(dead_code))]
    pub(crate) fn label(&self) -> &Label {
        &self.label
    }

    /// Reports `outcome` under this lease's label.
    pub(crate) fn report(&self, outcome: Outcome) {
        self.held.engine.report(&self.label, outcome);
    }

    /// The work answered with a result to record (`head`: its status and headers, body omitted):
    /// from now on the record is never released.
    pub(crate) fn answered(&mut self, head: &StoredResponse) {
        self.answered = Some(StoredResponse {
            body: bytes::Bytes::new(),
            body_omitted: true,
            ..head.clone()
        });
    }

    /// The work or its body ran past the maximum hold.
    pub(crate) fn timed_out(&self) {
        self.report(Outcome::TimedOut);
    }

    /// The record was settled outside the lease, by a statement of the work's transaction or of
    /// the store's own: nothing is left to complete or release, except for [`Settled::Unknown`],
    /// which is released by its token in the background.
    pub(crate) fn settled_outside(mut self, how: Settled) {
        self.done = true;
        let held = &self.held;
        held.engine.let_go(&held.key, held.token);
        match how {
            Settled::Recorded { status } => {
                self.report(Outcome::Recorded);
                tracing::debug!(status, "recorded in the work's transaction");
            }
            Settled::Released => self.report(Outcome::Released),
            Settled::Lost => self.report(Outcome::LeaseLost),
            // A release only deletes a record still in progress under this lease, so a landed
            // commit stays (the retry gets its replay) and one that did not land lets the retry
            // run, rather than wait for the TTL.
            Settled::Unknown => held.engine.abandon(RecordKey::clone(&held.key), held.token),
        }
    }

    /// Records the answer. When the store fails, the record is not released (the effect has
    /// happened): the completion is retried in the background, heartbeat running, until it
    /// succeeds or the lease is lost. Returns once recorded (or lost), or after
    /// [`recorded_within`](super::timing::recorded_within) of retries with [`Completed::Retrying`].
    pub(crate) async fn complete(mut self, stored: Arc<StoredResponse>) -> Completed {
        self.done = true;
        let first = self.attempt(stored.clone()).await;
        if let Some(completed) = self.settled(first, stored.status) {
            if completed == Completed::Recorded && self.held.engine.keeps_tombstones() {
                // The lease (its registration with the keeper, its share) goes first: the record
                // is finished.
                let held = self.held.clone();
                drop(self);
                held.engine.entomb(&held.key).await;
            }
            return completed;
        }
        self.report(Outcome::RecordDeferred);
        let wait = super::timing::recorded_within(self.held.engine.settings().in_progress_ttl);
        let (settled, told) = tokio::sync::oneshot::channel();
        let drain = self.held.engine.drain().clone();
        drain.spawn(async move { self.keep_completing(stored, settled).await });
        match tokio::time::timeout(wait, told).await {
            Ok(Ok(completed)) => completed,
            // Not yet (or the task was dropped at a runtime's shutdown): not recorded.
            Ok(Err(_)) | Err(_) => Completed::Retrying,
        }
    }

    /// Retries the completion until the store settles it, telling `settled` how.
    async fn keep_completing(
        self,
        mut stored: Arc<StoredResponse>,
        settled: tokio::sync::oneshot::Sender<Completed>,
    ) {
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
                    "the store takes renewals but not this answer; recording it without its body"
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
            if let Some(completed) = self.settled(attempt, stored.status) {
                // The tombstone first, as on the first attempt: nobody gets the answer before it
                // is written (a caller whose wait runs out meanwhile is told to retry).
                if completed == Completed::Recorded && self.held.engine.keeps_tombstones() {
                    let held = self.held.clone();
                    drop(self);
                    held.engine.entomb(&held.key).await;
                }
                // The caller may have stopped waiting: then nobody is told.
                let _ = settled.send(completed);
                return;
            }
        }
    }

    /// One completion attempt. A store that panics has failed this attempt, like one that answered
    /// an error: the panic must not end the request's task with the record left in progress, to be
    /// retaken (and the work run again) after the TTL.
    async fn attempt(&self, stored: Arc<StoredResponse>) -> Result<Fenced, StoreError> {
        let held = &self.held;
        let completion =
            held.engine
                .store_complete(&held.key, held.token, &held.fingerprint, stored);
        AssertUnwindSafe(completion)
            .catch_unwind()
            .await
            .unwrap_or_else(|_| Err(StoreError::msg("the store's completion panicked")))
    }

    /// The longest pause between retries.
    fn longest_pause(&self) -> Duration {
        super::timing::completion_pause(self.held.engine.settings().in_progress_ttl)
    }

    /// Reports what a completion attempt did; `None` when the store failed.
    fn settled(&self, attempt: Result<Fenced, StoreError>, status: u16) -> Option<Completed> {
        match attempt {
            Ok(Fenced::Done) => {
                self.report(Outcome::Recorded);
                tracing::debug!(status, "recorded");
                Some(Completed::Recorded)
            }
            Ok(Fenced::LeaseLost) => {
                self.report(Outcome::LeaseLost);
                tracing::warn!(
                    "the lease was lost (the record was retaken after a TTL without heartbeat); \
                     this late result was not recorded"
                );
                Some(Completed::Lost)
            }
            Err(e) => {
                tracing::error!(error = %e, "the answer could not be recorded yet; retrying");
                None
            }
        }
    }

    /// Releases the record (see `IdempotencyStore::release`) so that a retry runs again. When the
    /// store fails, the release is retried in the background for up to the in-progress TTL.
    pub(crate) async fn release(mut self, why: &str) {
        self.done = true;
        let held = &self.held;
        self.report(Outcome::Released);
        tracing::debug!(reason = why, "releasing the record");
        match held.engine.release_once(&held.key, held.token).await {
            Ok(Fenced::Done) => {}
            Ok(Fenced::LeaseLost) => {
                tracing::warn!("the lease was lost before the release; nothing changed")
            }
            Err(e) => {
                tracing::error!(error = %e, "the record could not be released yet; retrying");
                let (engine, key, token) =
                    (held.engine.clone(), RecordKey::clone(&held.key), held.token);
                held.engine
                    .drain()
                    .spawn(async move { engine.keep_releasing(key, token, 1).await });
            }
        }
    }
}

impl<St: IdempotencyStore> Drop for Lease<St> {
    fn drop(&mut self) {
        // The registration, dropped with the lease, stops its renewals.
        if self.done {
            return;
        }
        let (held, label, deadline) = (self.held.clone(), self.label.clone(), self.deadline);
        let answered = self.answered.take();
        // The registration goes with the task: the record is renewed, and its presence shown,
        // until the task settles it, with no gap while the task waits to run (a runtime whose
        // workers are all blocked). The new lease is made inside the task: a task the runtime drops
        // unpolled (it is shutting down) then owns no lease whose drop would spawn again, and its
        // registration goes with it.
        let kept = self.kept.take();
        let drain = held.engine.drain().clone();
        drain.spawn(async move {
            let lease = Lease {
                held,
                label,
                done: false,
                answered: None,
                kept,
                deadline,
                share: None,
            };
            match answered {
                Some(head) => {
                    tracing::error!(
                        "the answer could not be read to the end; recording it without body"
                    );
                    lease.complete(Arc::new(head)).await;
                }
                None => lease.release("the work was dropped").await,
            }
        });
    }
}

/// Completion attempts refused while the store took renewals, after which the body is left out of
/// the record.
const OMIT_BODY_AFTER: u32 = 3;

#[cfg(test)]
pub(crate) mod tests {
    //! The lease's schedule under a paused clock, over the memory store.

    use super::*;
    use crate::engine::Claim;
    use crate::engine::{Drain, Settings};
    use crate::store::testing::Faulty;
    use crate::store::{ClaimOutcome, ClaimRequest, Finished};

    const TTL: Duration = Duration::from_millis(900);

    /// An engine over the test store with a TTL of 900 ms, and the store.
    pub(crate) fn engine() -> (Engine<Faulty>, Faulty) {
        engine_with(Settings {
            in_progress_ttl: TTL,
            ..Settings::default()
        })
    }

    /// An engine over the test store with `settings`, and the store.
    /// The keeper runs on the test's runtime, whose paused clock drives it.
    pub(crate) fn engine_with(settings: Settings) -> (Engine<Faulty>, Faulty) {
        let settings = Settings {
            keeper_on_callers_runtime: true,
            ..settings
        };
        let store = Faulty::default();
        let engine = Engine::new(store.clone(), settings, Drain::new()).expect("valid settings");
        (engine, store)
    }

    pub(crate) fn request(key: &str) -> ClaimRequest {
        request_with_ttl(key, TTL)
    }

    /// The claim of `POST /pay` by alice with `key`, an empty JSON body and the in-progress TTL
    /// `ttl`: every engine test's claim is built here.
    pub(crate) fn request_with_ttl(key: &str, ttl: Duration) -> ClaimRequest {
        ClaimRequest::new(
            RecordKey {
                key: key.into(),
                subject: "alice".into(),
                endpoint: "POST /pay".into(),
            },
            Fingerprint::of(None, b"{}"),
            ttl,
            Duration::from_secs(60),
        )
    }

    /// A claimed record and its lease, made as the engine makes them.
    pub(crate) async fn claimed<St: IdempotencyStore>(
        engine: &Engine<St>,
        key: &str,
    ) -> (ClaimRequest, Lease<St>) {
        let request = request(key);
        assert!(matches!(
            engine.store().claim(&request).await.expect("claim"),
            ClaimOutcome::Claimed { .. }
        ));
        let lease = Lease::new(
            engine.clone(),
            Label::named("test"),
            Arc::new(request.key.clone()),
            request.fingerprint,
            request.lease,
            Instant::now(),
        );
        (request, lease)
    }

    #[tokio::test(start_paused = true)]
    async fn the_heartbeat_renews_every_third_of_the_ttl_from_the_claim() {
        let (engine, store) = engine();
        let start = Instant::now();
        let (_request, lease) = claimed(&engine, "k").await;
        tokio::time::sleep(TTL * 3 + TTL / 6).await;
        let renewals = store.renewals();
        let offsets: Vec<Duration> = renewals.iter().map(|at| *at - start).collect();
        let expected: Vec<Duration> = (1..=9).map(|n| TTL / 3 * n).collect();
        assert_eq!(offsets, expected);
        assert_eq!(lease.held.renewals.load(Ordering::Relaxed), 9);
        drop(lease);
        // The heartbeat stops with its lease.
        tokio::time::sleep(TTL * 2).await;
        assert_eq!(store.renewals().len(), 9);
    }

    /// One keeper renews every lease of the engine, those due about together in one call, and
    /// stops when none is left: no task per lease.
    #[tokio::test(start_paused = true)]
    async fn one_keeper_renews_the_leases_due_together_in_one_call() {
        let (engine, store) = engine();
        let mut leases = Vec::new();
        for n in 0..10 {
            leases.push(claimed(&engine, &format!("k{n}")).await.1);
            // Claimed over a twentieth of the TTL: all within the early window of the first.
            tokio::time::sleep(TTL / 200).await;
        }
        tokio::time::sleep(TTL / 3).await;
        assert_eq!(
            store.batches(),
            vec![10],
            "the ten due together, in one call"
        );
        tokio::time::sleep(TTL).await;
        assert_eq!(store.batches(), vec![10; 4]);
        assert!(
            leases
                .iter()
                .all(|l| l.held.renewals.load(Ordering::Relaxed) == 4)
        );
        drop(leases);
        tokio::time::sleep(TTL).await;
        assert_eq!(
            store.batches().len(),
            4,
            "no renewal once the leases are gone"
        );
        assert!(!engine.keeper.task_running(), "the keeper's task ended");
    }

    #[tokio::test(start_paused = true)]
    async fn the_heartbeat_stops_once_the_lease_is_lost() {
        let (engine, store) = engine();
        let (request, lease) = claimed(&engine, "k").await;
        tokio::time::sleep(TTL / 3 + TTL / 6).await;
        assert_eq!(store.renewals().len(), 1);
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
            store.renewals().len(),
            2,
            "one renewal finds the lease lost, then none"
        );
        lease.complete(Arc::new(head(201))).await;
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_that_panics_is_retried_and_the_heartbeat_goes_on() {
        let (engine, store) = engine();
        store.panic_next_renewal();
        let start = Instant::now();
        let (_request, lease) = claimed(&engine, "k").await;
        tokio::time::sleep(TTL + TTL / 6).await;
        let renewals = store.renewals();
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
        let (engine, store) = engine();
        store.panic_next_completion();
        let (request, lease) = claimed(&engine, "k").await;
        // The panic is the first attempt's failure, not the request's; the retry records it
        // while the caller waits.
        assert_eq!(
            lease.complete(Arc::new(head(201))).await,
            Completed::Recorded
        );
        assert_eq!(recorded_status(&store, request).await, 201);
    }

    /// A completion the store does not take within `recorded_within` is not the caller's to
    /// answer (`Retrying`); it goes on in the background until the store takes it.
    #[tokio::test(start_paused = true)]
    async fn a_completion_not_taken_in_time_is_not_answered_and_is_recorded_later() {
        let (engine, store) = engine();
        store.refuse_completions(true);
        let (request, lease) = claimed(&engine, "k").await;
        let started = Instant::now();
        assert_eq!(
            lease.complete(Arc::new(head(201))).await,
            Completed::Retrying
        );
        let waited = started.elapsed();
        let bound = crate::engine::timing::recorded_within(engine.settings().in_progress_ttl);
        assert!(waited >= bound && waited < bound * 2, "{waited:?}");
        tokio::time::sleep(TTL).await;
        store.refuse_completions(false);
        assert!(engine.drain().wait(Duration::from_secs(5)).await);
        assert_eq!(recorded_status(&store, request).await, 201);
    }

    #[tokio::test(start_paused = true)]
    async fn an_outcome_hook_that_panics_does_not_stop_the_lease_from_settling() {
        let (engine, store) = engine_with(Settings {
            in_progress_ttl: TTL,
            on_outcome: Some(Arc::new(|outcome| {
                if matches!(outcome, Outcome::RecordDeferred | Outcome::TimedOut) {
                    panic!("an application hook bug");
                }
            })),
            ..Settings::default()
        });
        // A first completion attempt that fails reports `RecordDeferred`: the retries go on.
        store.panic_next_completion();
        let (request, lease) = claimed(&engine, "k").await;
        lease.timed_out();
        assert_eq!(
            lease.complete(Arc::new(head(504))).await,
            Completed::Recorded
        );
        assert!(engine.drain().wait(Duration::from_secs(5)).await);
        assert_eq!(recorded_status(&store, request).await, 504);
    }

    /// An in-progress record outlives any work still under its lease: it lives its TTL and the
    /// maximum hold past its last renewal even when the retention is shorter, since a record past
    /// its life is taken (or purged) with no look at its holder.
    #[tokio::test(start_paused = true)]
    async fn an_in_progress_record_lives_at_least_the_maximum_hold() {
        let max_hold = Duration::from_secs(30);
        let (engine, store) = engine_with(Settings {
            in_progress_ttl: TTL,
            retention: Duration::from_millis(100),
            max_hold: Some(max_hold),
            ..Settings::default()
        });
        let key = request("short").key;
        let claimed_at = std::time::SystemTime::now();
        let Claim::Held(lease, _) = engine
            .claim(
                Label::named("test"),
                key.clone(),
                Fingerprint::of(None, b"{}"),
                None,
            )
            .await
        else {
            panic!("not held");
        };
        let info = store
            .lookup(&key)
            .await
            .expect("lookup")
            .expect("the record");
        let lives = info
            .expires_at
            .duration_since(claimed_at)
            .expect("expires after the claim");
        assert!(
            lives >= TTL + max_hold - Duration::from_millis(50),
            "{lives:?}"
        );
        lease.release("the test is over").await;
    }

    /// The status `request`'s record holds, as a retry of it finds it (it must be finished).
    async fn recorded_status(store: &Faulty, request: ClaimRequest) -> u16 {
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

    /// A lease dropped before it settled hands its registration to the task that settles it: the
    /// keeper keeps renewing the record, and showing its presence, with no gap while that task
    /// waits for its runtime (one whose workers are all blocked).
    #[tokio::test(start_paused = true)]
    async fn a_dropped_lease_is_kept_until_its_record_is_settled() {
        let (engine, store) = engine();
        let (_request, mut lease) = claimed(&engine, "dropped").await;
        lease.answered(&head(201));
        assert_eq!(engine.keeper.leases(), 1);
        drop(lease);
        // The settling task has not run yet.
        assert_eq!(
            engine.keeper.leases(),
            1,
            "kept while the record is unsettled"
        );
        assert!(engine.drain().wait(Duration::from_secs(5)).await);
        assert_eq!(engine.keeper.leases(), 0, "let go of once settled");
        drop(store);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_dropped_before_the_answer_releases_and_after_it_records_the_head() {
        let (engine, store) = engine();
        // Dropped before the work answered: released for another try.
        let (request, lease) = claimed(&engine, "released").await;
        drop(lease);
        assert!(engine.drain().wait(Duration::from_secs(5)).await);
        let retry = request.from_another_request();
        // The same operation again: its generation, so a retake.
        let retaken = store.claim(&retry).await.expect("claim");
        assert!(retaken.is_retake(&retry), "{retaken:?}");

        // Dropped after it answered: its status and headers are recorded, without the body.
        let (answered, mut lease) = claimed(&engine, "answered").await;
        lease.answered(&head(201));
        drop(lease);
        assert!(engine.drain().wait(Duration::from_secs(5)).await);
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
