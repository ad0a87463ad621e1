//! Recovery points (SPEC 28): [`IdempotencyContext::step`](super::IdempotencyContext::step) runs a
//! step of the work once per operation and records its result with the record, so that a run that
//! takes the record over after its holder died returns what the dead run's steps returned and runs
//! only what is left.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use super::core::Engine;
use crate::store::{Fenced, IdempotencyStore, LeaseToken, RecordKey, RecordedStep, StoreError};

/// The most steps one operation records.
pub const MAX_STEPS: usize = 16;
/// The longest step name, in bytes.
pub const MAX_STEP_NAME: usize = 64;
/// The most bytes one step's result takes once encoded (JSON).
pub const MAX_STEP_RESULT: usize = 16 * 1024;

type Boxed<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The store's steps of one held record, whatever the store: what a context calls.
pub(super) trait StepLog: Send + Sync {
    /// The steps recorded, `None` when the lease no longer holds the record.
    fn load(&self) -> Boxed<'_, Result<Option<Vec<RecordedStep>>, StoreError>>;
    /// Records one step, fenced by the lease.
    fn record<'a>(&'a self, step: &'a RecordedStep) -> Boxed<'a, Result<Fenced, StoreError>>;
    /// How long a step's record is tried again while the store fails: the maximum hold.
    fn patience(&self) -> std::time::Duration;
    /// How long the read before a step is tried again while the store fails: the in-progress TTL.
    fn read_patience(&self) -> std::time::Duration;
}

/// The engine's store, the record and the lease that holds it.
pub(super) struct EngineSteps<St> {
    pub(super) engine: Engine<St>,
    pub(super) key: Arc<RecordKey>,
    pub(super) lease: LeaseToken,
}

impl<St: IdempotencyStore> StepLog for EngineSteps<St> {
    fn load(&self) -> Boxed<'_, Result<Option<Vec<RecordedStep>>, StoreError>> {
        Box::pin(async move {
            let bound = self.engine.renewal_bound();
            let read = crate::util::metrics::timed(
                "steps",
                self.engine.store().steps(&self.key, self.lease),
            );
            tokio::time::timeout(bound, read)
                .await
                .unwrap_or_else(|_| Err(StoreError::msg("reading the steps timed out")))
        })
    }

    fn patience(&self) -> std::time::Duration {
        self.engine.settings().max_hold()
    }

    fn read_patience(&self) -> std::time::Duration {
        self.engine.settings().in_progress_ttl
    }

    fn record<'a>(&'a self, step: &'a RecordedStep) -> Boxed<'a, Result<Fenced, StoreError>> {
        Box::pin(async move {
            let bound = self.engine.renewal_bound();
            let write = crate::util::metrics::timed(
                "record_step",
                self.engine.store().record_step(&self.key, self.lease, step),
            );
            let written = tokio::time::timeout(bound, write)
                .await
                .unwrap_or_else(|_| {
                    Err(StoreError::msg(
                        "recording the step timed out (it may have been recorded)",
                    ))
                });
            if matches!(written, Ok(Fenced::Done)) {
                // Its bytes count in the subject's share, as an answer's do.
                self.engine
                    .recorded(&self.key.subject, step.name.len() + step.result.len());
            }
            written
        })
    }
}

/// The steps of one run: read from the store before each step, so that a step runs only while
/// the run still holds its record and only when it was not recorded. Made with its log in one
/// allocation (`Arc<Steps<EngineSteps<St>>>`), and held as `Arc<Steps>`: the log's type is the
/// engine's store, which the context does not name.
pub(super) struct Steps<L: ?Sized = dyn StepLog> {
    /// Held while a step runs: steps of one run go one after another.
    busy: tokio::sync::Mutex<()>,
    /// Whether the run's own transaction (`IdempotencyTx`, `OnceTransaction`) has begun.
    transaction: std::sync::atomic::AtomicBool,
    /// The steps taken in the run's transaction, in order: written in it with the completion,
    /// and committed with the effects they wrote there (see `commit_with_record`). `None` once
    /// the completion took them: a step after that is not recorded.
    in_transaction: std::sync::Mutex<Option<Vec<RecordedStep>>>,
    /// The store's steps as this run last read them, with those it recorded since: what a step
    /// in the run's transaction goes by, rather than read again on a second connection while the
    /// transaction holds one.
    known: std::sync::Mutex<Option<Vec<RecordedStep>>>,
    log: L,
}

impl<L: StepLog> Steps<L> {
    pub(super) fn new(log: L) -> Self {
        Steps {
            busy: tokio::sync::Mutex::new(()),
            transaction: std::sync::atomic::AtomicBool::new(false),
            in_transaction: std::sync::Mutex::new(Some(Vec::new())),
            known: std::sync::Mutex::new(None),
            log,
        }
    }
}

impl Steps {
    /// The run's own transaction has begun: steps from now on are recorded in it.
    pub(super) fn transaction_begun(&self) {
        self.transaction
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// The steps taken in the run's transaction, for its completion to write; none are left.
    pub(super) fn take_in_transaction(&self) -> Vec<RecordedStep> {
        crate::util::lock::lock(&self.in_transaction)
            .take()
            .unwrap_or_default()
    }

    /// Runs `f` as the step `name` unless it was recorded (see `IdempotencyContext::step`).
    pub(super) async fn step<T, E, F, Fut>(&self, name: &str, f: F) -> Result<T, StepError<E>>
    where
        T: serde::Serialize + serde::de::DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, E>>,
    {
        // Every store takes these names (PostgreSQL's text refuses NUL).
        if name.is_empty() || name.len() > MAX_STEP_NAME || name.contains('\0') {
            return Err(StepError::Name);
        }
        // One step at a time: a step and its record are one unit for the steps that follow. One
        // that comes while another runs (a step in a step, or two joined) is refused rather than
        // left waiting: a step in a step would wait for itself.
        let Ok(_busy) = self.busy.try_lock() else {
            return Err(StepError::Concurrent);
        };
        // A step after the run's own transaction began is recorded in it, with its completion:
        // the step and the effects it wrote there commit together or not at all (a run that dies
        // before the commit leaves neither, and its retake runs the step again). Written apart,
        // it would wait on that transaction's lock (SQLite's file has one writer), or take a
        // second connection while the run holds one.
        let in_transaction = self.transaction.load(std::sync::atomic::Ordering::SeqCst);
        let known = crate::util::lock::lock(&self.known).clone();
        let steps = match known {
            // In the transaction, the steps as this run knows them: a lost lease is found by the
            // completion, which is fenced, and rolls the step back with its effects.
            Some(known) if in_transaction => known,
            // Read before every other step, by the lease: a run whose record was retaken
            // meanwhile (it was presumed dead, and woke up) learns it here, before its work runs,
            // and the steps are the store's as they are now (a write whose answer was lost may
            // have landed). Nothing ran yet: a read the store fails is tried again for up to the
            // in-progress TTL before the step fails.
            _ => {
                let read = retried(name, "reading the steps", self.log.read_patience(), || {
                    self.log.load()
                });
                match read.await.map_err(StepError::Store)? {
                    Some(steps) => {
                        *crate::util::lock::lock(&self.known) = Some(steps.clone());
                        steps
                    }
                    None => return Err(StepError::LeaseLost),
                }
            }
        };
        let taken = self.taken_in_transaction(name);
        if let Some(result) = steps
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.result.as_slice())
            .or(taken.found.as_deref())
        {
            return serde_json::from_slice(result).map_err(StepError::Decode);
        }
        if steps.len() + taken.count >= MAX_STEPS {
            return Err(StepError::TooMany);
        }
        let value = f().await.map_err(StepError::Failed)?;
        let result = serde_json::to_vec(&value).map_err(StepError::Encode)?;
        if result.len() > MAX_STEP_RESULT {
            return Err(StepError::TooLarge(result.len()));
        }
        let step = RecordedStep {
            name: name.to_owned(),
            result,
        };
        // Also when the transaction began while the work ran (its likeliest cause: the step's own
        // `tx.conn()`): written apart, the step would stay recorded if the transaction that holds
        // its effects rolled back, and on SQLite it would wait on that transaction's own lock.
        if self.transaction.load(std::sync::atomic::Ordering::SeqCst) {
            return match crate::util::lock::lock(&self.in_transaction).as_mut() {
                Some(taken) => {
                    taken.push(step);
                    Ok(value)
                }
                None => Err(StepError::Store(StoreError::msg(
                    "the run's transaction was completed before this step ended: its result was \
                     not recorded",
                ))),
            };
        }
        // The work ran: its record is tried again while the store fails (a busy SQLite file, a
        // connection lost, a table locked by another program), until it is taken, the lease is
        // lost, or the maximum hold (which cancels the run anyway), rather than have the run fail
        // and its retry run the work again. Every write is fenced by the lease, and one sent
        // again counts once.
        let write = retried(name, "recording a step", self.log.patience(), || {
            self.log.record(&step)
        });
        match write.await.map_err(StepError::Store)? {
            Fenced::Done => {
                if let Some(known) = crate::util::lock::lock(&self.known).as_mut() {
                    known.push(step);
                }
                Ok(value)
            }
            Fenced::LeaseLost => Err(StepError::LeaseLost),
        }
    }
}

/// `attempt` until the store answers, tried again while it fails (pausing 50 ms, doubling to
/// 1 s) for up to `patience`; at once when no try changes the error (a store that keeps no steps,
/// a table not migrated for them, a list that does not read).
async fn retried<'a, T>(
    name: &str,
    what: &'static str,
    patience: std::time::Duration,
    mut attempt: impl FnMut() -> Boxed<'a, Result<T, StoreError>>,
) -> Result<T, StoreError> {
    let give_up = tokio::time::Instant::now() + patience;
    let mut pause = std::time::Duration::from_millis(50);
    loop {
        match attempt().await {
            Ok(answer) => return Ok(answer),
            Err(e)
                if e.is_unsupported()
                    || e.is_unreadable_record()
                    || tokio::time::Instant::now() + pause >= give_up =>
            {
                return Err(e);
            }
            Err(e) => {
                tracing::warn!(step = name, error = %e, "{what} failed; trying again");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_secs(1));
            }
        }
    }
}

/// What the run's transaction holds of one step name: how many steps it took, and that name's
/// result if it took it.
struct Taken {
    count: usize,
    found: Option<Vec<u8>>,
}

impl Steps {
    fn taken_in_transaction(&self, name: &str) -> Taken {
        let taken = crate::util::lock::lock(&self.in_transaction);
        let taken = taken.as_deref().unwrap_or_default();
        Taken {
            count: taken.len(),
            found: taken
                .iter()
                .find(|s| s.name == name)
                .map(|s| s.result.clone()),
        }
    }
}

/// Why [`IdempotencyContext::step`](super::IdempotencyContext::step) did not return the step's
/// result. Only [`Failed`](Self::Failed) comes from the step's own work; every other error means
/// the run should stop (answer an error, which releases the record, or let the retake go on).
#[derive(Debug)]
#[non_exhaustive]
pub enum StepError<E> {
    /// The step's work returned this error; nothing was recorded, and a later run of the
    /// operation runs the step again.
    Failed(E),
    /// The record is no longer held by this run (it was presumed dead and retaken, or finished):
    /// this step's result was not recorded (or was, by an earlier try whose answer was lost, just
    /// before the record was taken), and the run must not go on with effects of its own.
    LeaseLost,
    /// The store failed: the steps could not be read within an in-progress TTL of tries, or it
    /// keeps no steps (the work did not run); or the step's result could not be recorded (the
    /// work ran; the last write may or may not have committed). A write is tried again until the
    /// run's maximum hold, which ends the run first: a handler sees this for a write only when
    /// the store cannot keep steps, or when a step ended after the run's transaction was
    /// completed (a step left running beside the answer).
    Store(StoreError),
    /// The name is empty, longer than [`MAX_STEP_NAME`] bytes, or holds a NUL; nothing ran.
    Name,
    /// The operation recorded [`MAX_STEPS`] steps already; this one did not run.
    TooMany,
    /// Another step of this run was running (this one was called inside it, or beside it): steps
    /// of one run go one after another. This one did not run.
    Concurrent,
    /// The step's result, encoded, takes this many bytes, over [`MAX_STEP_RESULT`]: the work ran
    /// and its result was not recorded.
    TooLarge(usize),
    /// The step's result did not encode as JSON: the work ran and its result was not recorded.
    Encode(serde_json::Error),
    /// A recorded result did not decode as the step's type (the code changed its type between the
    /// run that recorded it and this one); nothing ran.
    Decode(serde_json::Error),
}

impl<E: fmt::Display> fmt::Display for StepError<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StepError::Failed(e) => write!(f, "the step failed: {e}"),
            StepError::LeaseLost => f.write_str(
                "the run no longer holds its record (retaken or finished): the step's result was \
                 not recorded by this try",
            ),
            StepError::Store(e) => write!(f, "the step's record: {e}"),
            StepError::Name => write!(
                f,
                "a step's name is 1 to {MAX_STEP_NAME} bytes, without NUL; the step did not run"
            ),
            StepError::TooMany => write!(
                f,
                "an operation records at most {MAX_STEPS} steps; the step did not run"
            ),
            StepError::Concurrent => f.write_str(
                "another step of this run was running: steps go one after another, and do not \
                 nest; the step did not run",
            ),
            StepError::TooLarge(n) => write!(
                f,
                "the step's result takes {n} bytes, over {MAX_STEP_RESULT}: it ran, and was not \
                 recorded"
            ),
            StepError::Encode(e) => write!(f, "the step's result does not encode as JSON: {e}"),
            StepError::Decode(e) => write!(
                f,
                "the step's recorded result does not decode as its type: {e}"
            ),
        }
    }
}

impl<E: std::error::Error + 'static> std::error::Error for StepError<E> {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            StepError::Failed(e) => Some(e),
            StepError::Store(e) => Some(e),
            StepError::Encode(e) | StepError::Decode(e) => Some(e),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;
    use crate::Fingerprint;
    use crate::once::RunOnce;
    use crate::store::MemoryStore;

    fn scope(key: &str) -> RecordKey {
        RecordKey {
            key: key.into(),
            subject: "alice".into(),
            endpoint: "steps".into(),
        }
    }

    async fn one() -> Result<u8, ()> {
        Ok(1)
    }

    #[tokio::test]
    async fn bounds_are_checked_and_a_step_in_a_step_is_refused() {
        let once = RunOnce::new(MemoryStore::new()).expect("run once");
        let checked = once
            .run(
                scope("bounds"),
                Fingerprint::of(None, b"{}"),
                |ctx| async move {
                    assert!(matches!(ctx.step("", one).await, Err(StepError::Name)));
                    let long = "x".repeat(MAX_STEP_NAME + 1);
                    assert!(matches!(ctx.step(&long, one).await, Err(StepError::Name)));
                    assert!(matches!(ctx.step("a\0b", one).await, Err(StepError::Name)));
                    let inner = ctx.clone();
                    let outer = ctx
                        .step("outer", || async move {
                            let nested = inner.step("inner", one).await;
                            assert!(matches!(nested, Err(StepError::Concurrent)), "{nested:?}");
                            Ok::<u8, ()>(2)
                        })
                        .await;
                    assert_eq!(outer.ok(), Some(2));
                    // Recorded: the same name returns it without running, and as another type fails.
                    let again = ctx.step("outer", || async { Ok::<u8, ()>(99) }).await;
                    assert_eq!(again.ok(), Some(2));
                    let other = ctx.step("outer", || async { Ok::<String, ()>("x".into()) });
                    assert!(matches!(other.await, Err(StepError::Decode(_))));
                    let big =
                        ctx.step("big", || async { Ok::<_, ()>("x".repeat(MAX_STEP_RESULT)) });
                    assert!(matches!(big.await, Err(StepError::TooLarge(_))));
                    let failed = ctx.step("failed", || async { Err::<u8, _>("no") });
                    assert!(matches!(failed.await, Err(StepError::Failed("no"))));
                    // "outer" is one; fifteen more fill the operation's steps.
                    for i in 1..MAX_STEPS {
                        let done = ctx.step(&format!("step {i}"), one).await;
                        assert_eq!(done.ok(), Some(1), "step {i}");
                    }
                    let past = ctx.step("one more", one).await;
                    assert!(matches!(past, Err(StepError::TooMany)), "{past:?}");
                    Ok::<_, ()>(true)
                },
            )
            .await;
        assert!(matches!(checked, Ok(true)), "{checked:?}");
    }

    #[tokio::test]
    async fn on_a_store_that_keeps_no_steps_the_first_step_fails_before_its_work() {
        let once = RunOnce::new(crate::store::testing::Faulty::default()).expect("run once");
        let ran = Arc::new(AtomicUsize::new(0));
        let counted = ran.clone();
        let out = once
            .run(
                scope("none"),
                Fingerprint::of(None, b"{}"),
                |ctx| async move {
                    let step = ctx.step("charge", || async move {
                        counted.fetch_add(1, Ordering::SeqCst);
                        Ok::<u8, ()>(1)
                    });
                    match step.await {
                        Err(StepError::Store(e)) => Err::<u8, String>(e.to_string()),
                        other => panic!("{other:?}"),
                    }
                },
            )
            .await;
        assert!(
            matches!(&out, Err(crate::once::OnceError::Failed(e)) if e.contains("keeps no steps")),
            "{out:?}"
        );
        assert_eq!(ran.load(Ordering::SeqCst), 0, "the step's work did not run");
    }
}
