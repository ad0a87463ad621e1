//! [`RunOnce`]: the layer's guarantee for a function call outside HTTP (a queue consumer, a
//! webhook, a scheduled job).
//!
//! **The rule.** Given a scope ([`RecordKey`]: a message id, the consumer, the queue) and a
//! fingerprint of its input, [`RunOnce::run`] runs an async closure at most once for as long as the
//! record is retained, and answers every later call with the closure's recorded output, as the layer
//! answers a retried request with its recorded response:
//!
//! | existing record | fingerprint | answer |
//! |---|---|---|
//! | none, or past retention | - | claim, run the closure, record its output |
//! | any | differs | [`OnceError::KeyReuse`] |
//! | finished | same | the recorded output, deserialized (the closure does not run) |
//! | in progress | same | [`OnceError::InProgress`] at once |
//! | in progress, not renewed for the in-progress TTL | same | retaken: the closure runs again, [`IdempotencyContext::is_retake`] (on PostgreSQL, MySQL and Redis, the first such call only marks the record and gets [`OnceError::InProgress`]; a call a TTL later retakes it) |
//!
//! **The reason.** Queues, webhooks and schedulers deliver at least once: a message is redelivered
//! when its consumer died or was slow to acknowledge, a webhook is resent when its answer was lost,
//! a job fires twice when two schedulers overlap. The effect (a charge, an e-mail, a shipment) must
//! happen once all the same. The same stores, lease and recording that guard an HTTP handler guard
//! the closure: the claim is committed before it runs, a heartbeat renews it while it runs (so a
//! slow run is never taken over, and a dead one is after the TTL), and its output is recorded with
//! a fencing token (so a run presumed dead cannot overwrite the output of the one that retook it).
//!
//! **What is recorded.** An `Ok` output, serialized with `serde_json`, is recorded and returned by
//! every later call. An `Err` is not: the record is released and a later call runs the closure
//! again (return `Ok` of a type that says "rejected" to record a definitive failure). A panic
//! releases the record too ([`OnceError::Panicked`]). A closure still running at the maximum hold is
//! cancelled, and since its effect may have happened, the key is settled as
//! [`OnceError::TimedOut`] for the retention: it never runs again.
//!
//! **The call runs on a task of its own** (counted in [`RunOnce::drain`]), so a caller that stops
//! waiting (a consumer's shutdown timeout, a `select!` on a cancel signal) cancels neither the
//! closure halfway nor the recording of its output: a redelivery then gets the output, or
//! [`OnceError::InProgress`] while the run goes on. Hence the `Send + 'static` bounds. At shutdown,
//! wait for [`RunOnce::drain`] (`drain.wait(deadline)`) before the runtime stops: a run cut there
//! is left in progress and retaken, so run again, after the in-progress TTL.
//!
//! **Scopes.** A scope shares the store with the layer's records: choose an `endpoint` no route
//! has (`"queue orders"`, not `"POST /orders"`), or a subject no user can be, so that a call and a
//! request never meet on one record.
//!
//! **Effects downstream.** [`RunOnce::run`] records the output through the store's own statements,
//! not in a transaction of the closure's: a run that wrote its effect and died before recording it
//! is retaken and runs again. Make its effects idempotent downstream with
//! [`IdempotencyContext::derived_key`], stable across retakes: a payment provider's own idempotency
//! key, a unique constraint on your table. On a store with transactions,
//! [`RunOnce::run_in_transaction`] commits the closure's effects with the record of its output.
//!
//! ```no_run
//! use axum_idempotency::MemoryStore;
//! use axum_idempotency::once::{OnceError, RunOnce};
//! use axum_idempotency::store::RecordKey;
//!
//! # async fn consume(once: RunOnce<MemoryStore>, message_id: String, amount: u64)
//! # -> Result<(), Box<dyn std::error::Error>> {
//! let scope = RecordKey {
//!     key: message_id,
//!     subject: "billing-consumer".into(),
//!     endpoint: "queue orders".into(),
//! };
//! let charged = once
//!     .run_json(scope, &amount, move |ctx| async move {
//!         // The provider deduplicates by ctx.derived_key(): a retake does not charge again.
//!         let _provider_key = ctx.derived_key();
//!         Ok::<_, std::io::Error>(format!("charged {amount}"))
//!     })
//!     .await;
//! match charged {
//!     Ok(receipt) => println!("{receipt}"), // acknowledge the message
//!     Err(OnceError::InProgress) => {}       // another consumer runs it: redeliver later
//!     Err(e) => return Err(e.into()),
//! }
//! # Ok(()) }
//! ```

mod builder;
mod error;
mod transactional;

pub use self::builder::RunOnceBuilder;
pub use self::error::OnceError;
pub use self::transactional::OnceTransaction;

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use serde::Serialize;
use serde::de::DeserializeOwned;
use tracing::Instrument;

pub use crate::engine::IdempotencyContext;
use crate::engine::{
    Claim, Completed, ConfigError, Drain, Engine, Lease, Ran, ReplayInfo, Unavailable, span,
};
pub use crate::store::{Fingerprint, RecordKey};
use crate::store::{Finished, IdempotencyStore, StoreError, StoredResponse};
use crate::util::metrics::Label;

/// Why the replay check refuses to return `stored`, if it does. A check that panics refuses it: it
/// did not say the output may be returned.
async fn recheck(
    check: &ReplayCheckFn,
    scope: &RecordKey,
    stored: &StoredResponse,
) -> Option<String> {
    use futures_util::FutureExt;
    let info = ReplayInfo::new(scope, stored);
    let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| check(&info)));
    let answer = match checked {
        Ok(future) => {
            let checking = std::panic::AssertUnwindSafe(future).catch_unwind();
            match tokio::time::timeout(crate::engine::REPLAY_CHECK_BOUND, checking).await {
                Ok(answer) => answer,
                Err(_) => return Some("the replay check did not answer in time".to_owned()),
            }
        }
        Err(panic) => Err(panic),
    };
    answer.unwrap_or_else(|_| {
        tracing::error!("the replay check panicked; the recorded output is not returned");
        Some("the replay check panicked".to_owned())
    })
}

/// The `endpoint` label of run-once outcomes in the metrics (feature `metrics`): one series for
/// every scope, whatever its endpoint, so that message ids never become label values.
const RUN_ONCE_LABEL: &str = "run_once";

/// The status of a recorded output.
const OUTPUT: u16 = 200;
/// The status recorded when the output could not be serialized.
const UNSERIALIZABLE: u16 = 500;
/// The status recorded for a run cancelled at the maximum hold.
const TIMED_OUT: u16 = 504;

/// Runs async closures at most once per scope and fingerprint, and answers later calls with the
/// recorded output (see the [module docs](self)).
///
/// `RunOnce::new(store)` takes the defaults (in-progress TTL 90 s, retention 24 h, maximum hold
/// 10 minutes); [`RunOnce::builder`] changes them. Both check the settings. Clones share the
/// store, the settings and the in-process coalescing of duplicates.
pub struct RunOnce<St> {
    engine: Engine<St>,
    label: Label,
    replay_check: Option<Arc<ReplayCheckFn>>,
}

/// The check run before a recorded output is returned (see [`RunOnceBuilder::replay_check`]).
pub(crate) type ReplayCheckFn = dyn Fn(&ReplayInfo<'_>) -> futures_util::future::BoxFuture<'static, Option<String>>
    + Send
    + Sync;

impl<St: Clone> Clone for RunOnce<St> {
    fn clone(&self) -> Self {
        RunOnce {
            engine: self.engine.clone(),
            label: self.label.clone(),
            replay_check: self.replay_check.clone(),
        }
    }
}

impl<St: fmt::Debug> fmt::Debug for RunOnce<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunOnce")
            .field("engine", &self.engine)
            .finish()
    }
}

impl<St: IdempotencyStore> RunOnce<St> {
    /// Runs closures over `store` with the default settings, or says why they do not fit it.
    pub fn new(store: St) -> Result<Self, ConfigError> {
        Self::builder(store).build()
    }

    /// A builder to change the settings; [`RunOnceBuilder::build`] checks them.
    pub fn builder(store: St) -> RunOnceBuilder<St> {
        RunOnceBuilder::new(store)
    }

    /// The count of what this runs on tasks of its own (every call, and the retried recordings and
    /// releases), to wait for at shutdown, as the layer's [`Drain`].
    pub fn drain(&self) -> Drain {
        self.engine.drain().clone()
    }

    /// Runs `f` once for `scope` and `fingerprint`, or answers with what the run that did recorded.
    ///
    /// - The first call (or the first after a release, or after the retention) claims the record,
    ///   runs `f` with the operation's [`IdempotencyContext`] and, when it returns `Ok(value)`,
    ///   records `value` as JSON and returns it.
    /// - Later calls with the same fingerprint return the recorded value, deserialized as `T`,
    ///   without running `f`; with another fingerprint, [`OnceError::KeyReuse`]; while a run holds
    ///   the record, [`OnceError::InProgress`].
    /// - `Err(e)` from `f` releases the record: [`OnceError::Failed`], and a later call runs again.
    ///
    /// The whole call runs on a task of its own: dropping the returned future does not cancel `f`.
    pub async fn run<T, E, F, Fut>(
        &self,
        scope: RecordKey,
        fingerprint: Fingerprint,
        f: F,
    ) -> Result<T, OnceError<E>>
    where
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(IdempotencyContext) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        self.on_its_own_task(scope, fingerprint, |lease, ctx| async move {
            held(lease, ctx, f).await
        })
        .await
    }

    /// Runs one call (the claim, then the answer or `runner` once the claim is held) on a task of
    /// its own, counted in the drain, and answers what it came to.
    async fn on_its_own_task<T, E, R, RF>(
        &self,
        scope: RecordKey,
        fingerprint: Fingerprint,
        runner: R,
    ) -> Result<T, OnceError<E>>
    where
        T: DeserializeOwned + Send + 'static,
        E: Send + 'static,
        R: FnOnce(Lease<St>, IdempotencyContext) -> RF + Send + 'static,
        RF: Future<Output = Result<T, OnceError<E>>> + Send,
    {
        let span = span(self.engine.settings(), &scope);
        let (engine, label) = (self.engine.clone(), self.label.clone());
        let check = self.replay_check.clone();
        // The scope a replay check is shown (kept only when there is one).
        let checked_scope = check.as_ref().map(|_| scope.clone());
        let (answer, answered) = tokio::sync::oneshot::channel();
        let work = async move {
            let outcome = match engine.claim(label, scope, fingerprint, None).await {
                Claim::Held(lease, context) => runner(lease, context).await,
                Claim::Finished(stored, _) => match (check, checked_scope) {
                    (Some(check), Some(scope)) => match recheck(&*check, &scope, &stored).await {
                        Some(reason) => Err(OnceError::ReplayRefused(reason)),
                        None => decode(&stored),
                    },
                    _ => decode(&stored),
                },
                Claim::InProgress => Err(OnceError::InProgress),
                Claim::KeyReuse => Err(OnceError::KeyReuse),
                Claim::Expired => Err(OnceError::Expired),
                Claim::Reserved => Err(OnceError::Store(StoreError::refused_claim(
                    "the scope's endpoint starts as a tombstone's (\" tombstone \"), which only \
                     the engine writes",
                ))),
                Claim::Unavailable(Unavailable::Store(e)) => Err(OnceError::Store(e)),
                Claim::Unavailable(Unavailable::TooLate) | Claim::Unguarded => Err(
                    OnceError::Store(StoreError::msg(Unavailable::TooLate.to_string())),
                ),
            };
            // The caller may have stopped waiting: the run and its record stand all the same.
            let _ = answer.send(outcome);
        };
        self.engine.drain().spawn(work.instrument(span));
        match answered.await {
            Ok(outcome) => outcome,
            // Dropped unfinished: the runtime is shutting down (or there is none).
            Err(_) => Err(OnceError::Store(StoreError::msg(
                "the run was dropped before it settled: no runtime to run it on",
            ))),
        }
    }

    /// [`run`](Self::run) with the fingerprint of `input` as canonical JSON
    /// ([`Fingerprint::of_json`]): the same input, however its fields are ordered, is the same
    /// operation. An input that does not serialize gives [`OnceError::Encode`], and `f` does not run.
    pub async fn run_json<I, T, E, F, Fut>(
        &self,
        scope: RecordKey,
        input: &I,
        f: F,
    ) -> Result<T, OnceError<E>>
    where
        I: Serialize + ?Sized,
        T: Serialize + DeserializeOwned + Send + 'static,
        E: Send + 'static,
        F: FnOnce(IdempotencyContext) -> Fut + Send + 'static,
        Fut: Future<Output = Result<T, E>> + Send + 'static,
    {
        let fingerprint = Fingerprint::of_json(input).map_err(OnceError::Encode)?;
        self.run(scope, fingerprint, f).await
    }
}

/// Runs the closure under its lease, until it ends or the maximum hold, and records its output or
/// releases the record.
async fn held<St, T, E, F, Fut>(
    lease: Lease<St>,
    context: IdempotencyContext,
    f: F,
) -> Result<T, OnceError<E>>
where
    St: IdempotencyStore,
    T: Serialize + Send + 'static,
    F: FnOnce(IdempotencyContext) -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    // The call of `f` itself is inside, so that a closure that panics before its first await is
    // caught too.
    let ended = match lease.run(async move { f(context).await }).await {
        Ran::Ended(ended) => ended,
        Ran::Panicked => {
            lease.release("the closure panicked").await;
            return Err(OnceError::Panicked);
        }
        Ran::TimedOut => {
            tracing::warn!(
                "the closure was still running at the maximum hold; cancelled, and recorded as a \
             timeout"
            );
            return timed_out(lease).await;
        }
    };
    match ended {
        Ok(value) => record_output(lease, value).await,
        Err(e) => {
            lease.release("the closure returned an error").await;
            Err(OnceError::Failed(e))
        }
    }
}

/// Records `value`, the output of a closure whose effect has happened, and returns it once it is
/// the record's; an output that does not serialize is settled as failed. Never released.
async fn record_output<St, T, E>(mut lease: Lease<St>, value: T) -> Result<T, OnceError<E>>
where
    St: IdempotencyStore,
    T: Serialize,
{
    // The effect has happened: from here on, a panic before the completion starts records this
    // head without its body rather than releasing the record. (A task dropped while the
    // completion is under way, at a runtime's shutdown, leaves the record in progress, retaken
    // after the TTL: wait for `drain()` at shutdown, as for the layer.)
    lease.answered(&recorded(OUTPUT, Vec::new()));
    match serialized(&value) {
        Ok(body) => settled(
            lease.complete(Arc::new(recorded(OUTPUT, body))).await,
            Ok(value),
        ),
        Err(e) => {
            tracing::error!(error = %e, "the output did not serialize; recorded as failed");
            let body = format!("the output did not serialize: {e}").into_bytes();
            let completed = lease
                .complete(Arc::new(recorded(UNSERIALIZABLE, body)))
                .await;
            settled(completed, Err(OnceError::Encode(e)))
        }
    }
}

/// Settles the record of a closure cancelled at the maximum hold (its effect may have happened)
/// as timed out.
async fn timed_out<St, T, E>(lease: Lease<St>) -> Result<T, OnceError<E>>
where
    St: IdempotencyStore,
{
    let completed = lease
        .complete(Arc::new(recorded(TIMED_OUT, Vec::new())))
        .await;
    settled(completed, Err(OnceError::TimedOut))
}

/// What a call answers once its lease settled the record: `written` when the record is this
/// run's settlement. Lost (retaken while it ran: no heartbeat got through for a TTL), the
/// retaker's settlement is the record's, and later calls get it. Not written yet, it is not the
/// record's: were this process to die before it lands, a later call would run the closure again
/// and get another.
fn settled<T, E>(
    completed: Completed,
    written: Result<T, OnceError<E>>,
) -> Result<T, OnceError<E>> {
    match completed {
        Completed::Recorded => written,
        Completed::Lost => Err(OnceError::InProgress),
        Completed::Retrying => Err(OnceError::NotRecorded),
    }
}

/// `value` as JSON; a `Serialize` that panics is an output that does not serialize (and must not
/// release the record).
fn serialized<T: Serialize>(value: &T) -> Result<Vec<u8>, serde_json::Error> {
    std::panic::catch_unwind(AssertUnwindSafe(|| serde_json::to_vec(value))).unwrap_or_else(|_| {
        Err(<serde_json::Error as serde::ser::Error>::custom(
            "the output's Serialize panicked",
        ))
    })
}

/// The record of an output (`200`), of an output that did not serialize (`500`, failed), or of a
/// run cancelled at the maximum hold (`504`, failed).
fn recorded(status: u16, body: Vec<u8>) -> StoredResponse {
    StoredResponse {
        outcome: if status == OUTPUT {
            Finished::Completed
        } else {
            Finished::Failed
        },
        status,
        headers: Vec::new(),
        body: bytes::Bytes::from(body),
        body_omitted: false,
        expires_in: None,
    }
}

/// The recorded output, as `T`, or what the record says instead.
fn decode<T: DeserializeOwned, E>(stored: &StoredResponse) -> Result<T, OnceError<E>> {
    let unreadable = |why: String| OnceError::Decode(serde::de::Error::custom(why));
    if stored.outcome == Finished::Failed && stored.status == TIMED_OUT {
        return Err(OnceError::TimedOut);
    }
    if stored.body_omitted {
        return Err(unreadable(
            "the output was recorded without its body (the store refused it)".to_owned(),
        ));
    }
    match (stored.outcome, stored.status) {
        (Finished::Completed, OUTPUT) => {
            serde_json::from_slice(&stored.body).map_err(OnceError::Decode)
        }
        (Finished::Failed, UNSERIALIZABLE) => Err(unreadable(format!(
            "the run's output was not recorded: {}",
            String::from_utf8_lossy(&stored.body)
        ))),
        (_, status) => Err(unreadable(format!(
            "the record under this scope is not a run-once output (status {status})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::store::testing::Faulty;

    /// An output the store does not take in time is not returned (it is not the record's yet): the
    /// caller is told, and a later call gets the output once the background records it, without
    /// running the closure again.
    #[tokio::test(start_paused = true)]
    async fn an_output_not_recorded_in_time_is_not_returned_and_a_later_call_gets_it() {
        let store = Faulty::default();
        let once = RunOnce::new(store.clone()).expect("settings");
        let runs = Arc::new(AtomicUsize::new(0));
        let scope = || RecordKey {
            key: "k".into(),
            subject: "consumer".into(),
            endpoint: "charge".into(),
        };
        let call = |runs: Arc<AtomicUsize>| {
            once.run(scope(), Fingerprint::of(None, b"1"), move |_| async move {
                runs.fetch_add(1, Ordering::SeqCst);
                Ok::<_, std::io::Error>(7u32)
            })
        };
        store.refuse_completions(true);
        let first = call(runs.clone()).await;
        assert!(matches!(first, Err(OnceError::NotRecorded)), "{first:?}");
        store.refuse_completions(false);
        assert!(once.drain().wait(Duration::from_secs(5)).await);
        let later = call(runs.clone()).await;
        assert_eq!(later.ok(), Some(7));
        assert_eq!(runs.load(Ordering::SeqCst), 1);
    }
}
