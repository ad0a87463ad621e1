//! The lease keeper: one task per engine renews every lease this process holds, and shows the
//! presences its leases were issued under (see [`Presence`]), so that a live holder is known, not
//! guessed from the age of its last renewal (SPEC 24).
//!
//! **Its own thread, runtime and connections.** The task runs on the keepers' runtime (a thread of
//! its own, see `runtime.rs`), through the store's keeper session
//! (`IdempotencyStore::keeper_session`: connections of its own, made on that runtime). A handler
//! that blocks every worker of the application's runtime, or holds every connection of its pool,
//! stops neither its renewals nor its presences; if the runtime itself ends, the thread starts
//! another and the keeper on it.
//!
//! **Presences.** Every lease token the engine draws ([`Keeper::token`]) carries the keeper's
//! current presence in its high bits; a presence is drawn anew every in-progress TTL (at least a
//! second). The keeper shows, through its session, every presence that one of its leases holds,
//! and any that issued a token within the last TTL (a claim still on its way); it lets go of the
//! rest. A claim of any instance never retakes a record whose lease's presence is shown. A record
//! this process let go of without settling it (its release failed for good) is retakeable by the
//! TTL once no lease of its presence is left. Stores that cannot show presences judge by the TTL.
//!
//! **Renewals.** Each lease is due a third of the in-progress TTL after the last renewal that got
//! through (or after its claim), and, when a renewal fails, again a twentieth of the TTL later;
//! the keeper wakes at the earliest due lease (a sixth of the TTL apart at most) and renews, in
//! one call to the store ([`IdempotencyStore::renew_many`]: one statement on the SQL stores),
//! every lease due by then or within a twelfth of the TTL. A call may take at most the engine's
//! renewal bound. The task ends once it has had no lease, and no token drawn, for a TTL; its
//! session (and the presences it showed) goes with it.
//!
//! [`IdempotencyStore::renew_many`]: crate::store::IdempotencyStore::renew_many

mod runtime;

use std::collections::{BTreeSet, HashMap};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::runtime::Handle;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tokio::time::Instant;

use super::timing::{keeper_nap, renew_every, renew_retry, renew_together_within};
use crate::store::{Fenced, Fingerprint, LeaseToken, Presence, RecordKey, StoreError};
use crate::util::lock::lock;

#[cfg(any(test, feature = "test-suite"))]
pub(crate) use runtime::stop_for_test;

/// The shortest time one presence issues tokens before the next is drawn.
const MIN_PRESENCE_TERM: Duration = Duration::from_secs(1);

/// What the keeper needs of the engine (the engine implements it; the keeper knows no more).
pub(super) trait Renewer: Clone + Send + Sync + 'static {
    /// What renewals and presences go through: the store's keeper session.
    type Session: Clone + Send + Sync + 'static;
    /// The engine without its hold on the keeper: what the keeper's task keeps, so that an
    /// engine the application dropped ends the task rather than live on in it.
    type Weak: Send + Sync + 'static;
    fn downgrade(&self) -> Self::Weak;
    /// The engine again, while anything else holds its keeper.
    fn upgrade(weak: &Self::Weak) -> Option<Self>;
    /// The in-progress TTL.
    fn in_progress_ttl(&self) -> Duration;
    /// How long one call renewing leases (or showing presences) may take.
    fn renewal_bound(&self) -> Duration;
    /// Whether the keeper runs on the runtime of whoever starts it rather than on its own thread:
    /// for the crate's tests under a paused clock, which must drive the keeper's timers too.
    fn keeper_on_callers_runtime(&self) -> bool;
    /// The engine's keeper.
    fn keeper(&self) -> &Arc<Keeper<Self>>;
    /// Opens the keeper's session (`IdempotencyStore::keeper_session`).
    fn open_session(&self) -> impl Future<Output = Result<Self::Session, StoreError>> + Send;
    /// The store itself, to renew through while no session could be opened.
    fn without_session(&self) -> Self::Session;
    /// Renews `leases` in one call through `session`, each with its own answer.
    fn renew_many<'a>(
        &'a self,
        session: &'a Self::Session,
        leases: &'a [(&'a RecordKey, LeaseToken)],
    ) -> impl Future<Output = Vec<Result<Fenced, StoreError>>> + Send + 'a;
    /// Shows exactly `live` through `session` (`IdempotencyStore::show_presences`), to lapse
    /// after a TTL without another call.
    fn show_presences<'a>(
        &'a self,
        session: &'a Self::Session,
        live: &'a [Presence],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a;
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

/// The leases this process holds under one engine, the presences it shows, and the task that
/// keeps both.
pub(crate) struct Keeper<E> {
    inner: Mutex<Kept<E>>,
    /// Wakes the task: a new presence to show, or a new lease. The task runs on a runtime of its
    /// own, so a wake from a handler's worker puts it on that runtime, never in the worker's slot.
    wake: Notify,
    /// Itself, for the task it starts.
    this: Weak<Keeper<E>>,
}

struct Kept<E> {
    leases: HashMap<u64, Entry<E>>,
    next_id: u64,
    /// The task, while it runs.
    task: Option<AbortHandle>,
    /// The presence tokens are drawn under now, when it was drawn, and the number of its next
    /// token.
    current: Option<(Presence, Instant, u32)>,
    /// When each presence last issued a token.
    issued: HashMap<Presence, Instant>,
    /// Since when no lease is left and no token was drawn within the TTL.
    idle_since: Option<Instant>,
    /// Whether the task was ever started on the keepers' runtime (then enlisted for restarts).
    enlisted: bool,
}

struct Entry<E> {
    held: Arc<Held<E>>,
    due: Instant,
    /// Whether it may be renewed before it is due, with others (not when retrying a failure: the
    /// retry waits its twentieth of the TTL).
    early: bool,
}

impl<E> Keeper<E> {
    /// A keeper with no lease, its task not started.
    pub(super) fn new() -> Arc<Self> {
        Arc::new_cyclic(|this| Keeper {
            inner: Mutex::new(Kept {
                leases: HashMap::new(),
                next_id: 0,
                task: None,
                current: None,
                issued: HashMap::new(),
                idle_since: None,
                enlisted: false,
            }),
            wake: Notify::new(),
            this: this.clone(),
        })
    }
}

#[cfg(test)]
impl<E> Keeper<E> {
    /// Whether the task runs, as the keeper has it.
    pub(super) fn task_running(&self) -> bool {
        lock(&self.inner).task.is_some()
    }

    /// How many leases it keeps.
    pub(super) fn leases(&self) -> usize {
        lock(&self.inner).leases.len()
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

/// What registering a lease did: whether the keeper's task was started for it on the caller's
/// runtime (the caller may yield once so that it runs before work that could block the thread).
pub(super) struct Registered<E> {
    pub(super) registration: Registration<E>,
    pub(super) started_task: bool,
}

impl<E: Renewer> Keeper<E> {
    /// A lease token for a claim about to be sent, under the current presence (drawn anew every
    /// TTL, at least a second), which the keeper shows from now on.
    pub(super) fn token(&self, engine: &E) -> LeaseToken {
        let ttl = engine.in_progress_ttl();
        let now = Instant::now();
        let mut kept = lock(&self.inner);
        let (presence, number) = match &mut kept.current {
            Some((presence, since, next)) if now < *since + ttl.max(MIN_PRESENCE_TERM) => {
                let number = *next;
                *next = next.wrapping_add(1);
                (*presence, number)
            }
            _ => {
                let (presence, number) = (Presence::generate(), Presence::first_number());
                kept.current = Some((presence, now, number.wrapping_add(1)));
                (presence, number)
            }
        };
        let new = kept.issued.insert(presence, now).is_none();
        let started = self.ensure_task(&mut kept, engine);
        drop(kept);
        if new && !started {
            self.wake.notify_one();
        }
        presence.lease(number)
    }

    /// Keeps `held` renewed, its first renewal due a third of the TTL after `since`, until the
    /// returned registration is dropped.
    pub(super) fn register(&self, held: Arc<Held<E>>, since: Instant) -> Registered<E> {
        let due = since + renew_every(held.engine.in_progress_ttl());
        let engine = held.engine.clone();
        let mut kept = lock(&self.inner);
        let id = kept.next_id;
        kept.next_id += 1;
        // A lease of a presence the keeper does not show now (a claim answered after its
        // presence's term) gets it shown again at once.
        let new_presence = Presence::of(held.token).is_some_and(|p| {
            !kept.issued.contains_key(&p)
                && !kept
                    .leases
                    .values()
                    .any(|e| Presence::of(e.held.token) == Some(p))
        });
        kept.leases.insert(
            id,
            Entry {
                held,
                due,
                early: true,
            },
        );
        let started = self.ensure_task(&mut kept, &engine);
        drop(kept);
        if new_presence && !started {
            self.wake.notify_one();
        }
        let keeper = self
            .this
            .upgrade()
            .expect("a keeper is registered through its Arc");
        Registered {
            registration: Registration { keeper, id },
            started_task: started && engine.keeper_on_callers_runtime(),
        }
    }

    /// Starts the task if it does not run; true when it was started now.
    fn ensure_task(&self, kept: &mut Kept<E>, engine: &E) -> bool {
        if kept.task.as_ref().is_some_and(|task| !task.is_finished()) {
            return false;
        }
        let runtime = if engine.keeper_on_callers_runtime() {
            Handle::try_current().ok()
        } else {
            let shared = runtime::handle();
            if shared.is_some() && !kept.enlisted {
                kept.enlisted = true;
                if let Some(this) = self.this.upgrade() {
                    runtime::enlist(Arc::downgrade(&(this as Arc<dyn runtime::Restart>)));
                }
            }
            shared.or_else(|| Handle::try_current().ok())
        };
        let Some(runtime) = runtime else {
            return false;
        };
        kept.task = Some(
            runtime
                .spawn(supervise::<E>(engine.downgrade()))
                .abort_handle(),
        );
        true
    }
}

impl<E: Renewer> runtime::Restart for Keeper<E> {
    fn restart(self: Arc<Self>, runtime: &Handle) {
        let mut kept = lock(&self.inner);
        // Without a lease, the next claim starts the task again.
        let Some(engine) = kept.leases.values().next().map(|e| e.held.engine.clone()) else {
            kept.task = None;
            return;
        };
        tracing::warn!("the lease keepers' runtime was replaced; the keeper starts again");
        kept.task = Some(
            runtime
                .spawn(supervise::<E>(engine.downgrade()))
                .abort_handle(),
        );
    }
}

/// The task, started again should it panic (a bug; a store's panics are caught where they
/// happen), for as long as the keeper has work and its engine lives.
async fn supervise<E: Renewer>(engine: E::Weak) {
    loop {
        let ran = AssertUnwindSafe(run::<E>(&engine)).catch_unwind().await;
        let Some(pause) = E::upgrade(&engine).map(|e| renew_retry(e.in_progress_ttl())) else {
            return;
        };
        if ran.is_ok() {
            return;
        }
        tracing::error!("the lease keeper panicked; starting it again");
        tokio::time::sleep(pause).await;
    }
}

/// What the task does next.
enum Step<E> {
    /// No lease, no presence: the task ends (and says so, under the lock).
    End,
    /// Show `live`; renew `due` (due now, or within a twelfth of the TTL); then sleep to `until`.
    Work {
        live: Vec<Presence>,
        due: Vec<(u64, Arc<Held<E>>)>,
        until: Instant,
    },
}

/// The keeper's task: shows its presences, renews the due leases, sleeps to the next due one or
/// a wake; ends when it has had nothing to keep for a third of the TTL.
async fn run<E: Renewer>(weak: &E::Weak) {
    let Some((ttl, bound)) = E::upgrade(weak).map(|e| (e.in_progress_ttl(), e.renewal_bound()))
    else {
        return;
    };
    let mut session: Option<E::Session> = None;
    let mut next_try = Instant::now();
    // What the session shows, as far as the keeper knows, and when it last said so.
    let mut shown: Option<(Vec<Presence>, Instant)> = None;
    loop {
        // Held for this turn only: an engine dropped meanwhile ends the task at the next.
        let Some(engine) = E::upgrade(weak) else {
            return;
        };
        let keeper = engine.keeper().clone();
        let (live, due, until) = match next_step(&keeper, ttl) {
            Step::End => {
                // Let go of what the session shows now rather than when its connections close.
                if let Some(session) = &session
                    && shown.as_ref().is_none_or(|(set, _)| !set.is_empty())
                {
                    show(&engine, session, &[], bound).await;
                }
                return;
            }
            Step::Work { live, due, until } => (live, due, until),
        };
        if session.is_none() && Instant::now() >= next_try {
            let opened = match tokio::time::timeout(bound, engine.open_session()).await {
                Ok(opened) => opened,
                Err(_) => Err(StoreError::msg("no answer in time")),
            };
            match opened {
                Ok(opened) => session = Some(opened),
                Err(e) => {
                    tracing::warn!(
                        error = %e,
                        "the lease keeper could not open its session; renewing through the \
                         store's own connections meanwhile"
                    );
                    next_try = Instant::now() + renew_every(ttl);
                }
            }
        }
        if let Some(session) = &session {
            let stale = shown
                .as_ref()
                .is_none_or(|(set, at)| *set != live || at.elapsed() >= renew_every(ttl));
            if stale {
                shown = show(&engine, session, &live, bound)
                    .await
                    .then(|| (live, Instant::now()));
            }
        }
        if !due.is_empty() {
            let through = session.clone().unwrap_or_else(|| engine.without_session());
            renew(&keeper, &engine, &through, due).await;
            // What is due next is counted from the answers.
            continue;
        }
        drop(engine);
        tokio::select! {
            () = tokio::time::sleep_until(until) => {}
            () = keeper.wake.notified() => {}
        }
    }
}

/// Shows `live` through `session`; whether the store took it.
async fn show<E: Renewer>(
    engine: &E,
    session: &E::Session,
    live: &[Presence],
    bound: Duration,
) -> bool {
    let shown = AssertUnwindSafe(engine.show_presences(session, live))
        .catch_unwind()
        .map(|shown| shown.unwrap_or_else(|_| Err(StoreError::msg("the store panicked"))));
    match tokio::time::timeout(bound, shown).await {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "the lease keeper could not show its presences; will retry");
            false
        }
        Err(_) => {
            tracing::warn!("the lease keeper's presences were not shown in time; will retry");
            false
        }
    }
}

fn next_step<E>(keeper: &Keeper<E>, ttl: Duration) -> Step<E> {
    let mut kept = lock(&keeper.inner);
    let now = Instant::now();
    let horizon = now + renew_together_within(ttl);
    // Presences that issued a token within the TTL: a claim of theirs may still be on its way.
    kept.issued.retain(|_, at| now < *at + ttl);
    if kept
        .current
        .is_some_and(|(presence, _, _)| !kept.issued.contains_key(&presence))
    {
        kept.current = None;
    }
    let mut live: BTreeSet<Presence> = kept.issued.keys().copied().collect();
    let mut next = None::<Instant>;
    let mut due = Vec::new();
    for (id, entry) in &kept.leases {
        live.extend(Presence::of(entry.held.token));
        if entry.due <= now || (entry.early && entry.due <= horizon) {
            due.push((*id, entry.held.clone()));
        } else if next.is_none_or(|at| entry.due < at) {
            next = Some(entry.due);
        }
    }
    if kept.leases.is_empty() && kept.issued.is_empty() {
        let idle_since = *kept.idle_since.get_or_insert(now);
        if now >= idle_since + renew_every(ttl) {
            kept.task = None;
            kept.idle_since = None;
            return Step::End;
        }
        next = Some(idle_since + renew_every(ttl));
    } else {
        kept.idle_since = None;
    }
    // The earliest token that leaves the TTL window changes what is shown.
    if let Some(leaves) = kept.issued.values().map(|at| *at + ttl).min() {
        next = Some(next.map_or(leaves, |at| at.min(leaves)));
    }
    // At most a sixth of the TTL (the presences are shown again every third of it, which puts
    // back those a lost connection dropped), and a second: an engine the application dropped
    // ends the task (and closes its session's connections) that soon.
    let nap = keeper_nap(ttl);
    let until = next.unwrap_or(now + nap).min(now + nap).max(now);
    Step::Work {
        live: live.into_iter().collect(),
        due,
        until,
    }
}

/// Renews `due` in one call through `session`; records what each renewal found.
async fn renew<E: Renewer>(
    keeper: &Keeper<E>,
    engine: &E,
    session: &E::Session,
    due: Vec<(u64, Arc<Held<E>>)>,
) {
    let ttl = engine.in_progress_ttl();
    let started = Instant::now();
    let leases: Vec<(&RecordKey, LeaseToken)> = due
        .iter()
        .map(|(_, held)| (&*held.key, held.token))
        .collect();
    // A store whose renewal panics must not end the keeper (every live handler would be retaken
    // after the TTL): a panic counts as a failed renewal of the whole call.
    let renewal = AssertUnwindSafe(engine.renew_many(session, &leases))
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
                Some((started + renew_every(ttl), true))
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
                Some((Instant::now() + renew_retry(ttl), false))
            }
            // Timed out, or a store that answered fewer renewals than it was asked.
            None => Some((Instant::now() + renew_retry(ttl), false)),
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
