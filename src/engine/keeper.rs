//! The lease keeper: one task per engine renews every lease this process holds, instead of a timer
//! task per request. Each lease is due a third of the in-progress TTL after the last renewal that
//! got through (or after its claim), and, when a renewal fails, again a twentieth of the TTL later;
//! the keeper wakes at the earliest due lease (a sixth of the TTL apart at most) and renews, in one
//! call to the store
//! ([`IdempotencyStore::renew_many`]: one statement on Postgres), every lease due by then or within
//! a twelfth of the TTL (renewing a little early costs nothing and gathers more per call). A call
//! may take at most the engine's renewal bound.
//!
//! The keeper is not the work's task, and no request ever wakes it (a wake from a handler's worker
//! would put it in that worker's own slot, stuck there if the handler then blocks): it wakes on its
//! own timer. So a handler that blocks its thread (a synchronous SDK, a CPU loop) from its first
//! poll, or inside `block_in_place`, does not stop it on a multi-threaded runtime, and "older than
//! the TTL" means "no renewal for a TTL": the holder died. What it cannot survive is a handler that
//! blocks a worker outside `block_in_place` after an await: that worker may be the one driving the
//! runtime's timers and sockets, which then stop for every task, the keeper's renewals with them
//! (a Tokio limit; blocking work belongs in `spawn_blocking` or `block_in_place`). The task ends once no lease has been left for a third
//! of the TTL, and starts again with the next one (on the runtime of that lease, should the first
//! one be gone).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use crate::store::{Fenced, Fingerprint, LeaseToken, RecordKey, StoreError};
use crate::util::lock::lock;

/// What the keeper needs of the engine (the engine implements it; the keeper knows no more).
pub(super) trait Renewer: Clone + Send + Sync + 'static {
    /// The in-progress TTL.
    fn in_progress_ttl(&self) -> Duration;
    /// How long one call renewing leases may take.
    fn renewal_bound(&self) -> Duration;
    /// Renews `leases` in one call to the store, each with its own answer.
    fn renew_many<'a>(
        &'a self,
        leases: &'a [(&'a RecordKey, LeaseToken)],
    ) -> impl Future<Output = Vec<Result<Fenced, StoreError>>> + Send + 'a;
}

/// What a lease and the keeper share.
pub(super) struct Held<E> {
    pub(super) engine: E,
    /// Shared with the work's `IdempotencyContext` rather than copied for it.
    pub(super) key: Arc<RecordKey>,
    /// The claim's fingerprint, which the completion passes on to the store.
    pub(super) fingerprint: Fingerprint,
    pub(super) token: LeaseToken,
    /// Renewals that got through.
    pub(super) renewals: AtomicU64,
    /// When the lease was last proven held (the claim, or the last renewal that got through, as
    /// sent): a lease made anew for the same claim (on the drop path) starts its schedule there.
    pub(super) held_since: Mutex<Instant>,
}

/// The leases this process holds under one engine, and the task that renews them.
pub(crate) struct Keeper<E> {
    inner: Mutex<Kept<E>>,
}

struct Kept<E> {
    leases: HashMap<u64, Entry<E>>,
    next_id: u64,
    /// The task, while it runs.
    task: Option<AbortHandle>,
    /// Since when no lease is left (the task lingers a third of the TTL for the next one, rather
    /// than end and be spawned again for every request of a sequential load).
    idle_since: Option<Instant>,
}

struct Entry<E> {
    held: Arc<Held<E>>,
    due: Instant,
    /// Whether it may be renewed before it is due, with others (not when retrying a failure: the
    /// retry waits its twentieth of the TTL).
    early: bool,
}

impl<E> Default for Keeper<E> {
    fn default() -> Self {
        Keeper {
            inner: Mutex::new(Kept {
                leases: HashMap::new(),
                next_id: 0,
                task: None,
                idle_since: None,
            }),
        }
    }
}

#[cfg(test)]
impl<E> Keeper<E> {
    /// Whether the task runs, as the keeper has it.
    pub(super) fn task_running(&self) -> bool {
        lock(&self.inner).task.is_some()
    }
}

/// A lease kept by the keeper until this is dropped.
pub(super) struct Registration<E> {
    keeper: Arc<Keeper<E>>,
    id: u64,
}

impl<E> Drop for Registration<E> {
    fn drop(&mut self) {
        lock(&self.keeper.inner).leases.remove(&self.id);
    }
}

/// What registering a lease did: whether the keeper's task was started for it (the caller may
/// yield once so that it runs before work that could block the thread).
pub(super) struct Registered<E> {
    pub(super) registration: Registration<E>,
    pub(super) started_task: bool,
}

impl<E: Renewer> Keeper<E> {
    /// Keeps `held` renewed, its first renewal due a third of the TTL after `since`, until the
    /// returned registration is dropped. Outside a runtime nothing renews it.
    pub(super) fn register(self: &Arc<Self>, held: Arc<Held<E>>, since: Instant) -> Registered<E> {
        let due = since + held.engine.in_progress_ttl() / 3;
        let engine = held.engine.clone();
        let mut kept = lock(&self.inner);
        let id = kept.next_id;
        kept.next_id += 1;
        kept.leases.insert(
            id,
            Entry {
                held,
                due,
                early: true,
            },
        );
        let running = kept.task.as_ref().is_some_and(|task| !task.is_finished());
        let mut started_task = false;
        if !running {
            kept.task = tokio::runtime::Handle::try_current().ok().map(|runtime| {
                started_task = true;
                runtime.spawn(run(self.clone(), engine)).abort_handle()
            });
        }
        drop(kept);
        Registered {
            registration: Registration {
                keeper: self.clone(),
                id,
            },
            started_task,
        }
    }
}

/// The keeper's task: renews the due leases, sleeps to the next due one; ends when none is left.
async fn run<E: Renewer>(keeper: Arc<Keeper<E>>, engine: E) {
    let ttl = engine.in_progress_ttl();
    loop {
        match next_step(&keeper, ttl) {
            Step::End => return,
            Step::Sleep(until) => {
                tokio::time::sleep_until(until).await;
            }
            Step::Renew(due) => renew(&keeper, &engine, due).await,
        }
    }
}

enum Step<E> {
    /// No lease is left: the task ends (and says so, under the lock).
    End,
    /// Nothing is due before this.
    Sleep(Instant),
    /// These are due now, or within a twelfth of the TTL: renewed together.
    Renew(Vec<(u64, Arc<Held<E>>)>),
}

fn next_step<E>(keeper: &Keeper<E>, ttl: Duration) -> Step<E> {
    let mut kept = lock(&keeper.inner);
    let now = Instant::now();
    let horizon = now + ttl / 12;
    let mut next = None::<Instant>;
    let mut due = Vec::new();
    for (id, entry) in &kept.leases {
        if entry.due <= now || (entry.early && entry.due <= horizon) {
            due.push((*id, entry.held.clone()));
        } else if next.is_none_or(|at| entry.due < at) {
            next = Some(entry.due);
        }
    }
    if !due.is_empty() {
        return Step::Renew(due);
    }
    if kept.leases.is_empty() {
        let idle_since = *kept.idle_since.get_or_insert(now);
        if now >= idle_since + ttl / 3 {
            kept.task = None;
            kept.idle_since = None;
            return Step::End;
        }
        next = Some(idle_since + ttl / 3);
    } else {
        kept.idle_since = None;
    }
    match next {
        // At most a sixth of the TTL: a lease registered meanwhile is looked at by then (it is
        // due a third of the TTL after its claim, or earlier when made anew for a claim held
        // since long ago). The keeper is never woken by a request: a wake from a handler's
        // worker would put it in that worker's own slot, stuck there if the handler blocks.
        Some(at) => Step::Sleep(at.min(now + ttl / 6)),
        None => Step::End,
    }
}

/// Renews `due` in one call; records what each renewal found.
async fn renew<E: Renewer>(keeper: &Keeper<E>, engine: &E, due: Vec<(u64, Arc<Held<E>>)>) {
    let ttl = engine.in_progress_ttl();
    let started = Instant::now();
    let leases: Vec<(&RecordKey, LeaseToken)> = due
        .iter()
        .map(|(_, held)| (&*held.key, held.token))
        .collect();
    // A store whose renewal panics must not end the keeper (every live handler would be retaken
    // after the TTL): a panic counts as a failed renewal of the whole call.
    let renewal = AssertUnwindSafe(engine.renew_many(&leases))
        .catch_unwind()
        .map(|renewed| {
            renewed.unwrap_or_else(|_| {
                leases
                    .iter()
                    .map(|_| Err(StoreError::msg("the store's renewal panicked")))
                    .collect()
            })
        });
    let answers = match tokio::time::timeout(engine.renewal_bound(), renewal).await {
        Ok(answers) => answers,
        Err(_) => {
            tracing::warn!(
                leases = due.len(),
                "the lease renewal timed out; will retry"
            );
            Vec::new()
        }
    };
    let mut kept = lock(&keeper.inner);
    for (at, (id, held)) in due.iter().enumerate() {
        let next = match answers.get(at) {
            Some(Ok(Fenced::Done)) => {
                tracing::trace!("lease renewed");
                held.renewals.fetch_add(1, Ordering::Relaxed);
                *lock(&held.held_since) = started;
                Some((started + ttl / 3, true))
            }
            Some(Ok(Fenced::LeaseLost)) => {
                tracing::info!(
                    "the lease no longer holds its record in progress: completed in the work's \
                     own transaction, or retaken after a TTL without renewal"
                );
                None
            }
            Some(Err(e)) => {
                tracing::warn!(error = %e, "the lease could not be renewed; will retry");
                Some((Instant::now() + ttl / 20, false))
            }
            // Timed out, or a store that answered fewer renewals than it was asked.
            None => Some((Instant::now() + ttl / 20, false)),
        };
        match next {
            Some((due, early)) => {
                if let Some(entry) = kept.leases.get_mut(id) {
                    entry.due = due;
                    entry.early = early;
                }
            }
            None => {
                kept.leases.remove(id);
            }
        }
    }
}
