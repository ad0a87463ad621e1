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
//! | any | differs | [`OnceError::FingerprintMismatch`] |
//! | finished | same | the recorded output, deserialized (the closure does not run) |
//! | in progress | same | [`OnceError::InProgress`] at once |
//! | in progress, not renewed for the in-progress TTL | same | retaken: the closure runs again, [`IdempotencyContext::is_retake`] |
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
//! **Effects downstream.** The output is recorded through the store's own statements, not in a
//! transaction of the closure's (the layer's `IdempotencyTx` is not offered here): a run that
//! wrote its effect and died before recording it is retaken and runs again. Make its effects
//! idempotent downstream with [`IdempotencyContext::derived_key`], stable across retakes: a payment
//! provider's own idempotency key, a unique constraint on your table.
//!
//! ```no_run
//! use axum_idempotency::{MemoryStore, OnceError, RecordKey, RunOnce};
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

#[cfg(feature = "postgres")]
mod transactional;
#[cfg(feature = "postgres")]
pub use transactional::OnceTransaction;

use std::fmt;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use futures_util::FutureExt;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio::time::Instant;
use tracing::Instrument;

use crate::claim::{fresh, span};
use crate::coalesce::Coalesced;
use crate::config::{Config, ConfigError};
use crate::context::IdempotencyContext;
use crate::drain::Drain;
use crate::fingerprint::Fingerprint;
use crate::lease::{self, Completed, Lease};
use crate::metrics::{Label, Measured};
use crate::outcome::Outcome;
use crate::record::{ClaimOutcome, ClaimRequest, Finished, RecordKey, StoredResponse};
use crate::report::report;
use crate::store::{IdempotencyStore, StoreError};

/// The `endpoint` label of run-once outcomes in the metrics (feature `metrics`): one series for
/// every scope, whatever its endpoint, so that message ids never become label values.
pub const RUN_ONCE_LABEL: &str = "run_once";

/// The status of a recorded output.
const OUTPUT: u16 = 200;
/// The status recorded when the output could not be serialized.
const UNSERIALIZABLE: u16 = 500;

/// Runs async closures at most once per scope and fingerprint, and answers later calls with the
/// recorded output (see the [module docs](self)).
///
/// `RunOnce::new(store)` takes the layer's defaults (in-progress TTL 90 s, retention 24 h, maximum
/// hold 10 minutes); [`RunOnce::builder`] changes them. Clones share the store, the settings and
/// the in-process coalescing of duplicates.
pub struct RunOnce<St> {
    store: Coalesced<Measured<St>>,
    config: Arc<Config>,
    label: Label,
}

impl<St: Clone> Clone for RunOnce<St> {
    fn clone(&self) -> Self {
        RunOnce {
            store: self.store.clone(),
            config: self.config.clone(),
            label: self.label.clone(),
        }
    }
}

impl<St: fmt::Debug> fmt::Debug for RunOnce<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunOnce")
            .field("store", &self.store)
            .field("config", &self.config)
            .finish()
    }
}

impl<St: IdempotencyStore> RunOnce<St> {
    /// Runs closures over `store` with the default settings.
    pub fn new(store: St) -> Self {
        Self::from_parts(store, Config::default())
    }

    /// A builder to change the settings; [`RunOnceBuilder::build`] validates them.
    pub fn builder(store: St) -> RunOnceBuilder<St> {
        RunOnceBuilder {
            store,
            config: Config::default(),
            max_hold_set: false,
        }
    }

    fn from_parts(store: St, config: Config) -> Self {
        #[cfg(feature = "metrics")]
        crate::metrics::describe();
        let local = config.local.clone();
        RunOnce {
            store: Coalesced::new(crate::metrics::store(store), local),
            config: Arc::new(config),
            label: Label::named(RUN_ONCE_LABEL),
        }
    }

    /// The count of what this runs on tasks of its own (every call, and the retried recordings and
    /// releases), to wait for at shutdown, as the layer's [`Drain`].
    pub fn drain(&self) -> Drain {
        self.config.drain.clone()
    }

    /// Runs `f` once for `scope` and `fingerprint`, or answers with what the run that did recorded.
    ///
    /// - The first call (or the first after a release, or after the retention) claims the record,
    ///   runs `f` with the operation's [`IdempotencyContext`] and, when it returns `Ok(value)`,
    ///   records `value` as JSON and returns it.
    /// - Later calls with the same fingerprint return the recorded value, deserialized as `T`,
    ///   without running `f`; with another fingerprint, [`OnceError::FingerprintMismatch`]; while a
    ///   run holds the record, [`OnceError::InProgress`].
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
        self.on_its_own_task(scope, fingerprint, |config, lease, ctx| async move {
            held(&config, lease, ctx, f).await
        })
        .await
    }

    /// Runs one call (`once`, with `runner` once the claim is held) on a task of its own, counted
    /// in the drain, and answers what it came to.
    async fn on_its_own_task<T, E, R, RF>(
        &self,
        scope: RecordKey,
        fingerprint: Fingerprint,
        runner: R,
    ) -> Result<T, OnceError<E>>
    where
        T: DeserializeOwned + Send + 'static,
        E: Send + 'static,
        R: FnOnce(Arc<Config>, Lease<Coalesced<Measured<St>>>, IdempotencyContext) -> RF
            + Send
            + 'static,
        RF: Future<Output = Result<T, OnceError<E>>> + Send,
    {
        let span = span(&self.config, &scope.key, &scope.subject, &scope.endpoint);
        let (config, store, label) = (self.config.clone(), self.store.clone(), self.label.clone());
        let (answer, answered) = tokio::sync::oneshot::channel();
        let work = async move {
            let outcome = once(config, store, label, scope, fingerprint, runner).await;
            // The caller may have stopped waiting: the run and its record stand all the same.
            let _ = answer.send(outcome);
        };
        self.config.drain.spawn(work.instrument(span));
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

/// Why [`RunOnce::run`] did not return an output.
#[derive(Debug)]
#[non_exhaustive]
pub enum OnceError<E> {
    /// Another run holds the record (here or in another process): try again later. Its lease is
    /// renewed while it runs; if its process died, the record is retaken after the in-progress TTL.
    InProgress,
    /// The scope was used with another fingerprint (another input) within the retention.
    FingerprintMismatch,
    /// The closure returned this error. The record was released: a later call runs it again.
    Failed(E),
    /// The closure panicked. The record was released: a later call runs it again.
    Panicked,
    /// The closure was still running at the maximum hold and was cancelled. Its effect may have
    /// happened, so the scope is settled as timed out: every later call within the retention gets
    /// this too, and the closure never runs again for it.
    TimedOut,
    /// The store failed (or answered the claim too late to be trusted). Nothing ran; a claim the
    /// store may have made is released in the background.
    Store(StoreError),
    /// The input or the output could not be serialized as JSON. For the output, the closure had
    /// run: the scope is settled as failed (later calls get [`Decode`](Self::Decode)), so its
    /// effect is not repeated.
    Encode(serde_json::Error),
    /// The recorded output could not be read back as `T` (another type, a record made by the HTTP
    /// layer under the same scope, an output that did not serialize, or one the store kept
    /// without its body because it refused it several times while it took renewals).
    Decode(serde_json::Error),
}

impl<E: fmt::Display> fmt::Display for OnceError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OnceError::InProgress => f.write_str("the operation is in progress elsewhere"),
            OnceError::FingerprintMismatch => {
                f.write_str("the scope was used for an operation with another input")
            }
            OnceError::Failed(e) => write!(f, "the operation failed: {e}"),
            OnceError::Panicked => f.write_str("the operation panicked"),
            OnceError::TimedOut => f.write_str("the operation ran past the maximum hold"),
            OnceError::Store(e) => write!(f, "the idempotency store failed: {e}"),
            OnceError::Encode(e) => write!(f, "the input or output did not serialize: {e}"),
            OnceError::Decode(e) => write!(f, "the recorded output could not be read: {e}"),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for OnceError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            OnceError::Failed(e) => Some(e),
            OnceError::Store(e) => Some(e),
            OnceError::Encode(e) | OnceError::Decode(e) => Some(e),
            _ => None,
        }
    }
}

/// Builds a [`RunOnce`]; [`build`](Self::build) checks the settings with the bounds of
/// [`IdempotencyLayerBuilder::build`](crate::IdempotencyLayerBuilder::build).
pub struct RunOnceBuilder<St> {
    store: St,
    config: Config,
    max_hold_set: bool,
}

impl<St> fmt::Debug for RunOnceBuilder<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunOnceBuilder")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl<St: IdempotencyStore> RunOnceBuilder<St> {
    /// How long an in-progress record may go without a heartbeat before it is presumed abandoned
    /// (its process died) and retaken. From [`MIN_IN_PROGRESS_TTL`](crate::MIN_IN_PROGRESS_TTL)
    /// to [`MAX_DURATION`](crate::MAX_DURATION), and at least
    /// [`TTL_PER_OPERATION_TIMEOUT`](crate::TTL_PER_OPERATION_TIMEOUT) times the store's operation
    /// timeout. Default: 90 s.
    pub fn in_progress_ttl(mut self, ttl: Duration) -> Self {
        self.config.in_progress_ttl = ttl;
        self
    }

    /// How long recorded outputs are kept and returned; after that the scope is new again. From
    /// [`MIN_RETENTION`](crate::MIN_RETENTION) to [`MAX_DURATION`](crate::MAX_DURATION); keep it above the longest
    /// redelivery horizon of your queue. Default: 24 h.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.config.retention = retention;
        self
    }

    /// The longest a run may hold its claim; a closure still running then is cancelled and the
    /// scope settled as [`OnceError::TimedOut`]. From the in-progress TTL to
    /// [`MAX_DURATION`](crate::MAX_DURATION). Default: 10 minutes, or the TTL when that is longer.
    pub fn max_hold(mut self, hold: Duration) -> Self {
        self.config.max_hold = hold;
        self.max_hold_set = true;
        self
    }

    /// The deployment secret (at least 16 bytes) mixed into
    /// [`IdempotencyContext::derived_key`], as
    /// [`IdempotencyLayerBuilder::derived_key_secret`](crate::IdempotencyLayerBuilder::derived_key_secret).
    pub fn derived_key_secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.config.derived_key_secret =
            Some(Arc::new(crate::secret::Secret::new(secret.as_ref())));
        self
    }

    /// Lets a call that finds the scope in progress wait up to `wait` for the holder's output
    /// instead of answering [`OnceError::InProgress`] at once, as
    /// [`IdempotencyLayerBuilder::wait`](crate::IdempotencyLayerBuilder::wait) does for requests:
    /// no connection or lock is held, `f` never runs for a waiter, and a released or vanished
    /// record ends the wait with `InProgress`. Default: zero (off); at most
    /// [`MAX_WAIT`](crate::MAX_WAIT).
    pub fn wait(mut self, wait: Duration) -> Self {
        self.config.wait = wait;
        self
    }

    /// Counts the calls and background work in `drain`, shared with layers or other `RunOnce`s.
    pub fn drain(mut self, drain: Drain) -> Self {
        self.config.drain = drain;
        self
    }

    /// Calls `hook` with every [`Outcome`] of a call (claimed, retaken, recorded, released,
    /// replayed, in progress, key reuse, store unavailable, timed out).
    pub fn on_outcome(mut self, hook: impl Fn(Outcome) + Send + Sync + 'static) -> Self {
        self.config.on_outcome = Some(Arc::new(hook));
        self
    }

    /// Checks the settings and builds the [`RunOnce`].
    pub fn build(self) -> Result<RunOnce<St>, ConfigError> {
        let mut config = self.config;
        crate::builder::check_times(&mut config, &self.store, self.max_hold_set)?;
        Ok(RunOnce::from_parts(self.store, config))
    }
}

/// One call, on its own task: the claim, then the answer or the run (by `runner`, once the claim
/// is held: the plain run, or the run in a transaction).
async fn once<St, T, E, R, RF>(
    config: Arc<Config>,
    store: Coalesced<Measured<St>>,
    label: Label,
    scope: RecordKey,
    fingerprint: Fingerprint,
    runner: R,
) -> Result<T, OnceError<E>>
where
    St: IdempotencyStore,
    T: DeserializeOwned,
    R: FnOnce(Arc<Config>, Lease<Coalesced<Measured<St>>>, IdempotencyContext) -> RF,
    RF: Future<Output = Result<T, OnceError<E>>>,
{
    let (lease, generation) = crate::record::claim_ids();
    let claim = ClaimRequest {
        key: scope,
        fingerprint,
        lease,
        generation,
        in_progress_ttl: config.in_progress_ttl,
        retention: config.retention,
    };
    let sent = Instant::now();
    match store.claim(&claim).await {
        Ok(ClaimOutcome::Claimed {
            lease,
            retaken,
            generation,
        }) => {
            let claim = ClaimRequest { lease, ..claim };
            let Some(held_since) = fresh(&config, &store, &claim, sent).await else {
                lease::abandon(&config, store, claim.key, claim.lease);
                report(&config, &label, Outcome::StoreUnavailable);
                tracing::warn!(
                    "the claim was answered too late to be trusted and could not be proven held; \
                     released, the closure did not run"
                );
                return Err(OnceError::Store(StoreError::msg(
                    "the idempotency store answered the claim too late to be trusted",
                )));
            };
            report(
                &config,
                &label,
                if retaken {
                    Outcome::Retaken
                } else {
                    Outcome::Claimed
                },
            );
            if retaken {
                tracing::info!("retook a claim whose holder stopped renewing it");
            }
            let key = Arc::new(claim.key);
            let context = IdempotencyContext::new(
                key.clone(),
                claim.fingerprint,
                retaken,
                generation,
                config.derived_key_secret.clone(),
            );
            // Its heartbeat runs before the closure does, as the layer's (see `Lease::started`).
            let lease = Lease::started(
                store,
                config.clone(),
                label,
                key,
                claim.fingerprint,
                claim.lease,
                held_since,
            )
            .await;
            runner(config, lease, context).await
        }
        Ok(ClaimOutcome::InProgress) if !config.wait.is_zero() => {
            // Waits for the holder's output, as a duplicate request does (never runs `f`).
            let waited = crate::wait::for_answer(&config, &store, &claim, None).await;
            answered(&config, &label, waited)
        }
        Ok(other) => answered(&config, &label, other),
        Err(e) => {
            // As the layer: a claim whose answer was lost may have been made, and is released by
            // its token; an unreadable record or a refused claim made none.
            if !e.is_unreadable_record() && !e.is_refused_claim() {
                lease::abandon(&config, store, claim.key, claim.lease);
            }
            report(&config, &label, Outcome::StoreUnavailable);
            tracing::error!(error = %e, "idempotency store failed; the closure did not run");
            Err(OnceError::Store(e))
        }
    }
}

/// The answer of a claim that lost to a record: the recorded output, or why there is none.
fn answered<T: DeserializeOwned, E>(
    config: &Config,
    label: &Label,
    outcome: ClaimOutcome,
) -> Result<T, OnceError<E>> {
    match outcome {
        ClaimOutcome::Finished(stored) => {
            report(config, label, Outcome::Replayed);
            decode(&stored)
        }
        ClaimOutcome::FingerprintMismatch => {
            report(config, label, Outcome::KeyReuse);
            Err(OnceError::FingerprintMismatch)
        }
        // In progress (and, never reached, a grant: `once` handles it).
        _ => {
            report(config, label, Outcome::InProgress);
            Err(OnceError::InProgress)
        }
    }
}

/// Runs the closure under its lease, until it ends or the maximum hold, and records its output or
/// releases the record.
async fn held<St, T, E, F, Fut>(
    config: &Config,
    mut lease: Lease<St>,
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
    let run = AssertUnwindSafe(async move { f(context).await }).catch_unwind();
    let Ok(ended) = tokio::time::timeout_at(lease.deadline(), run).await else {
        lease.timed_out();
        tracing::warn!(
            "the closure was still running at the maximum hold; cancelled, and recorded as a \
             timeout"
        );
        lease
            .complete(Arc::new(crate::recording::handler_timeout(config)))
            .await;
        return Err(OnceError::TimedOut);
    };
    match ended {
        Ok(Ok(value)) => {
            // The effect has happened: from here on, a panic before the completion starts records
            // this head without its body rather than releasing the record. (A task dropped while
            // the completion is under way, at a runtime's shutdown, leaves the record in progress,
            // retaken after the TTL: wait for `drain()` at shutdown, as for the layer.)
            lease.answered(&recorded(OUTPUT, Vec::new()));
            // A `Serialize` that panics must not release the record either.
            let serialized =
                std::panic::catch_unwind(AssertUnwindSafe(|| serde_json::to_vec(&value)))
                    .unwrap_or_else(|_| {
                        Err(<serde_json::Error as serde::ser::Error>::custom(
                            "the output's Serialize panicked",
                        ))
                    });
            match serialized {
                Ok(body) => match lease.complete(Arc::new(recorded(OUTPUT, body))).await {
                    // Retaken while it ran (no heartbeat got through for a TTL): the retaker's
                    // output is the record's, and later calls get it; this one is not answered.
                    Completed::Lost => Err(OnceError::InProgress),
                    Completed::Recorded | Completed::Retrying => Ok(value),
                },
                Err(e) => {
                    tracing::error!(error = %e, "the output did not serialize; recorded as failed");
                    let body = format!("the output did not serialize: {e}").into_bytes();
                    let _ = lease
                        .complete(Arc::new(recorded(UNSERIALIZABLE, body)))
                        .await;
                    Err(OnceError::Encode(e))
                }
            }
        }
        Ok(Err(e)) => {
            lease.release("the closure returned an error").await;
            Err(OnceError::Failed(e))
        }
        Err(_panic) => {
            lease.release("the closure panicked").await;
            Err(OnceError::Panicked)
        }
    }
}

/// The record of an output (`200`) or of an output that did not serialize (`500`, failed).
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
    if stored.outcome == Finished::Failed
        && stored.status == crate::ErrorKind::HandlerTimeout.status().as_u16()
    {
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
