//! Statements together (SPEC 26): one batcher per store and kind of statement (claim, completion,
//! release) sends what arrives while statements of its kind are in flight in the next one.
//!
//! - **No timer, no added latency.** A request that finds fewer than [`IN_FLIGHT`] statements of
//!   its kind in flight sends at once, alone, in its own future (the statement its caller gives).
//!   Requests that arrive while they are all in flight queue; when one returns, everything
//!   queued (up to [`MAX_ROWS`]) goes in one statement ([`Rows::many`]), sent by a task of its
//!   own in that place, and so on until the queue is empty. Under load a batch grows with the
//!   arrival rate times the round trip (group commit); alone, nothing waits.
//! - **One answer per request, its own.** A batch's answers come back in input order, one per row;
//!   a statement that failed (any row's error fails all) is sent again row by row through
//!   [`Rows::one`], so no request is answered with another's error.
//! - **Distinct rows.** Two requests of one scope never share a statement: the later waits for the
//!   next one.
//! - **Leaving.** A request dropped while queued leaves the queue (it is never sent). One whose
//!   row was in flight when it left has its answer handed to [`Rows::orphaned`], which undoes what
//!   the row did (a claim granted to nobody is released by its lease).
//! - **Bounded waits.** A queued request waits at most its bound from the moment it queued; still
//!   queued then, it leaves, never sent ([`Fate::NotSent`]: nothing was written). Once its row is
//!   in flight it waits at most three bounds more (its batch, then alone), then gives up as after
//!   a statement whose answer was lost ([`Fate::NoAnswer`]).
//!
//! A test setting ([`Forced`]) holds each batch until it has some rows (or a few milliseconds
//! passed) and sends every request through [`Rows::many`], so that the conformance kit and the
//! soak run the batch statements everywhere.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::store::{ClaimRequest, IdempotencyStore};
use crate::util::lock::lock;

/// The most rows one statement carries.
pub(crate) const MAX_ROWS: usize = 64;

/// How many bounds a row in flight gets once its bound in the queue has passed: a batch, then the
/// row alone (a statement, and the plain read after a lock wait) each have the store's bound, and a
/// row answered "no answer" may run unguarded under `fail_open` where its statements would have
/// refused it.
const IN_FLIGHT_BOUNDS: u32 = 3;

/// Statements of one kind in flight at once, each alone or a batch. Two: on two cores, against a
/// PostgreSQL on the same machine, one in flight at a time lost the parallelism the server has
/// (64 clients: 1.38-1.41x `pgbench`'s rate against 1.67-1.74x with two), and four made batches
/// too small to gain (1.13-1.21x); see BENCHMARKS.md.
#[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
pub(crate) const IN_FLIGHT: usize = 2;

/// One kind of statement, alone or for many. Implemented by a marker type; the store the
/// statements go through is [`Rows::Store`].
pub(crate) trait Rows: Send + Sync + 'static {
    type Store: Clone + Send + Sync + 'static;
    type Item: Send + Sync + 'static;
    type Answer: Send + 'static;

    /// The row's identity: no two rows of one statement share it.
    fn scope(item: &Self::Item) -> &[u8; 32];

    /// Today's statement, for one request.
    fn one(store: &Self::Store, item: &Self::Item) -> impl Future<Output = Self::Answer> + Send;

    /// One statement for all of `items` (distinct scopes, at most [`MAX_ROWS`]): each row's
    /// answer, in input order, `None` for a row that must go alone (its answer was not in the
    /// statement's); `None` when the statement failed (then every row goes alone). Rows that go
    /// alone are sent by tasks of their own, outside the places in flight, so that one that waits
    /// (on a row lock) holds up no other request.
    fn many(
        store: &Self::Store,
        items: &[&Self::Item],
    ) -> impl Future<Output = Option<Vec<Option<Self::Answer>>>> + Send;

    /// The answer of a row whose request left while it was in flight: undo what the row did.
    fn orphaned(
        store: Self::Store,
        item: Self::Item,
        answer: Self::Answer,
    ) -> impl Future<Output = ()> + Send;
}

/// The test setting: hold each batch until it has `rows` rows or `hold` passed, and send every
/// batch through [`Rows::many`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Forced {
    pub(crate) rows: usize,
    pub(crate) hold: Duration,
}

impl Forced {
    /// Each batch held until it has `rows` rows (at least one) or 5 ms passed.
    #[cfg(any(test, feature = "test-suite"))]
    pub(crate) fn holding(rows: usize) -> Self {
        Forced {
            rows: rows.max(1),
            hold: Duration::from_millis(5),
        }
    }
}

/// How a store's batchers send. A store whose settings change makes new batchers in the same
/// mode: a batch goes through the store that started it, so clones with other settings must not
/// share one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) enum Mode {
    /// What queues behind the statements in flight goes together in the next one.
    #[default]
    AsTheyCome,
    /// Each batch held (a test setting, see [`Forced`]).
    #[cfg_attr(not(any(test, feature = "test-suite")), allow(dead_code))]
    Held(Forced),
    /// Every request alone, as before statements went together: a benchmark's baseline.
    Off,
}

impl Mode {
    /// A batcher in this mode with [`IN_FLIGHT`] statements of its kind in flight.
    #[cfg_attr(not(any(feature = "postgres", feature = "mysql")), allow(dead_code))]
    pub(crate) fn batcher<R: Rows>(self) -> Arc<Batcher<R>> {
        Arc::new(Batcher::with(self, IN_FLIGHT))
    }

    /// A batcher in this mode with one statement in flight: for a database that takes one writer.
    #[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
    pub(crate) fn one_at_a_time<R: Rows>(self) -> Arc<Batcher<R>> {
        Arc::new(Batcher::with(self, 1))
    }
}

/// Releases by its lease the claim of `request`, whose request left while its row was in flight
/// (the release matches nothing unless the claim was granted): tried again while the store fails
/// for as long as the engine's abandon path tries (the in-progress TTL and the in-progress
/// record's life past it, which is at least the maximum hold); until then, a record whose
/// holder's presence is shown is not retaken.
pub(crate) async fn release_orphan<S: IdempotencyStore>(store: &S, request: &ClaimRequest) {
    let ttl = request.in_progress_ttl;
    let until = tokio::time::Instant::now() + ttl + request.retention;
    loop {
        match store.release(&request.key, request.lease).await {
            Ok(_) => return,
            Err(e) if tokio::time::Instant::now() >= until => {
                tracing::warn!(
                    error = %e,
                    "a claim granted to a request that left could not be released; the record is \
                     retaken once nothing of its holder's presence is left"
                );
                return;
            }
            Err(_) => tokio::time::sleep((ttl / 10).max(Duration::from_millis(100))).await,
        }
    }
}

/// A queued request: its row, and where its answer goes.
struct Queued<R: Rows> {
    /// Its place in the queue's order, to find it again.
    id: u64,
    item: R::Item,
    /// The row goes back with its answer, so that a requester that left before reading it
    /// hands both to [`Rows::orphaned`].
    answer: oneshot::Sender<(R::Item, R::Answer)>,
}

struct State<R: Rows> {
    /// Statements of this kind in flight: alone, each in its request's future, or by a runner.
    in_flight: usize,
    queue: VecDeque<Queued<R>>,
    next_id: u64,
}

/// The batcher of one kind of statement, shared by a store and its clones.
pub(crate) struct Batcher<R: Rows> {
    state: Mutex<State<R>>,
    forced: Option<Forced>,
    /// Statements of this kind in flight at most.
    limit: usize,
    /// Every request alone, as before batching (a benchmark's baseline).
    off: bool,
    /// Batch statements sent, and those that failed (then sent again row by row): for tests.
    sent: AtomicU64,
    failed: AtomicU64,
}

impl<R: Rows> std::fmt::Debug for Batcher<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Batcher")
            .field("forced", &self.forced)
            .finish_non_exhaustive()
    }
}

impl<R: Rows> Batcher<R> {
    /// A batcher in `mode` with at most `limit` statements in flight.
    fn with(mode: Mode, limit: usize) -> Self {
        Batcher {
            state: Mutex::new(State {
                in_flight: 0,
                queue: VecDeque::new(),
                next_id: 0,
            }),
            forced: match mode {
                Mode::Held(forced) => Some(forced),
                _ => None,
            },
            limit,
            off: mode == Mode::Off,
            sent: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        }
    }

    /// A batcher with [`IN_FLIGHT`] statements in flight, as requests come or held.
    #[cfg(test)]
    pub(crate) fn new(forced: Option<Forced>) -> Self {
        Batcher::with(forced.map_or(Mode::AsTheyCome, Mode::Held), IN_FLIGHT)
    }

    /// Batch statements sent, and those of them that failed.
    #[cfg(any(test, feature = "test-suite"))]
    pub(crate) fn counts(&self) -> (u64, u64) {
        (
            self.sent.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }

    /// Sends one request's row: `alone` (the caller's statement, borrowing its data) when fewer
    /// than the limit of this kind are in flight, else the row `item()` makes, in a batch. A
    /// queued row waits at most `wait` in the queue (then it leaves, never sent), and, once it is
    /// in flight, at most [`IN_FLIGHT_BOUNDS`] times `wait` more.
    pub(crate) async fn send<A>(
        self: &Arc<Self>,
        store: &R::Store,
        alone: A,
        item: impl FnOnce() -> R::Item,
        wait: Duration,
    ) -> Fate<R::Answer>
    where
        A: Future<Output = R::Answer>,
    {
        if self.off {
            return Fate::Answer(alone.await);
        }
        let queued = {
            let mut state = lock(&self.state);
            if state.in_flight < self.limit && self.forced.is_none() {
                state.in_flight += 1;
                None
            } else {
                let (answer, receiver) = oneshot::channel();
                let id = state.next_id;
                state.next_id += 1;
                state.queue.push_back(Queued {
                    id,
                    item: item(),
                    answer,
                });
                // Forced batches: nothing is sent alone; one runner starts with the first row.
                let start = state.in_flight == 0;
                if start {
                    state.in_flight = 1;
                }
                Some((receiver, start, id))
            }
        };
        let Some((receiver, start, id)) = queued else {
            let _busy = Busy {
                batcher: self,
                store,
            };
            return Fate::Answer(alone.await);
        };
        if start {
            self.start(store.clone());
        }
        let mut waiting = Waiting::<R> {
            receiver,
            store,
            taken: false,
        };
        let answer = match tokio::time::timeout(wait, &mut waiting.receiver).await {
            Ok(answer) => answer,
            Err(_) => {
                // Past the bound in the queue: still queued, the row leaves and was never sent.
                // Taken, it is in flight (in a batch, or alone after it), and gets its
                // statement's own time once more rather than be answered "no answer" for the
                // time it queued.
                let left = {
                    let mut state = lock(&self.state);
                    let place = state.queue.iter().position(|queued| queued.id == id);
                    place.and_then(|place| state.queue.remove(place))
                };
                if left.is_some() {
                    drop(left);
                    waiting.taken = true;
                    return Fate::NotSent;
                }
                match tokio::time::timeout(wait * IN_FLIGHT_BOUNDS, &mut waiting.receiver).await {
                    Ok(answer) => answer,
                    // An answer that lands now is its orphan (`Waiting`'s drop, or the
                    // hand-over that finds it gone).
                    Err(_) => return Fate::NoAnswer,
                }
            }
        };
        waiting.taken = true;
        match answer {
            Ok((_, answer)) => Fate::Answer(answer),
            // The batcher stopped (its runtime ended) with the row queued or in flight.
            Err(_) => Fate::NoAnswer,
        }
    }

    /// Starts a runner in the place in flight the caller holds: it sends what is queued until the
    /// queue is empty. Its guard is made first and moves into the task, so that a task dropped
    /// before it ever ran (its runtime shutting down) still gives its place back. Without a
    /// runtime, the place is given back at once.
    fn start(self: &Arc<Self>, store: R::Store) {
        let guard = Running {
            batcher: self.clone(),
            finished: false,
        };
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                drop(runtime.spawn(async move { run(guard, store).await }));
            }
            Err(_) => drop(guard),
        }
    }

    /// A statement sent alone returned: a runner takes over its place in flight and what queued
    /// meanwhile, if anything.
    fn next(self: &Arc<Self>, store: &R::Store) {
        let mut state = lock(&self.state);
        state.queue.retain(|queued| !queued.answer.is_closed());
        if state.queue.is_empty() {
            state.in_flight -= 1;
            return;
        }
        drop(state);
        self.start(store.clone());
    }

    async fn send_batch(&self, store: &R::Store, batch: Vec<Queued<R>>) {
        let answers = {
            let items: Vec<&R::Item> = batch.iter().map(|queued| &queued.item).collect();
            self.sent.fetch_add(1, Ordering::Relaxed);
            match R::many(store, &items).await {
                Some(answers) if answers.len() == items.len() => answers,
                _ => {
                    self.failed.fetch_add(1, Ordering::Relaxed);
                    items.iter().map(|_| None).collect()
                }
            }
        };
        for (queued, answer) in batch.into_iter().zip(answers) {
            match answer {
                Some(answer) => hand_over(store, queued, answer),
                // Alone, in a task of its own: its wait holds no place in flight. Also when its
                // request left: a batch of several statements may have written the row before
                // it failed, and the row's answer alone goes to `orphaned`, which undoes it.
                None => {
                    let store = store.clone();
                    drop(tokio::spawn(async move {
                        let answer = R::one(&store, &queued.item).await;
                        hand_over(&store, queued, answer);
                    }));
                }
            }
        }
    }

    /// How many requests are queued (for tests).
    #[cfg(test)]
    fn queued(&self) -> usize {
        lock(&self.state).queue.len()
    }
}

/// Gives `answer` to the request that queued `queued`, or, if it left, to [`Rows::orphaned`].
fn hand_over<R: Rows>(store: &R::Store, queued: Queued<R>, answer: R::Answer) {
    if let Err((item, answer)) = queued.answer.send((queued.item, answer)) {
        drop(tokio::spawn(R::orphaned(store.clone(), item, answer)));
    }
}

/// What became of a request's row.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Fate<A> {
    /// Its statement's answer.
    Answer(A),
    /// It waited in the queue past its bound and left: nothing was sent.
    NotSent,
    /// It was in a statement whose answer did not come within its bound (or the batcher
    /// stopped): the row may have been written, as after a statement whose answer was lost.
    NoAnswer,
}

impl<T, E> Fate<Result<T, E>> {
    /// The answer, or the error a row that got none answers with: `no_answer` when it may have
    /// been written, `not_sent` when it never left the queue.
    pub(crate) fn into_result(
        self,
        no_answer: impl FnOnce() -> E,
        not_sent: impl FnOnce() -> E,
    ) -> Result<T, E> {
        match self {
            Fate::Answer(answer) => answer,
            Fate::NoAnswer => Err(no_answer()),
            Fate::NotSent => Err(not_sent()),
        }
    }
}

/// The runner: sends what is queued, a batch at a time, until the queue is empty.
async fn run<R: Rows>(mut guard: Running<R>, store: R::Store) {
    let batcher = guard.batcher.clone();
    loop {
        if let Some(forced) = batcher.forced {
            let until = tokio::time::Instant::now() + forced.hold;
            while lock(&batcher.state).queue.len() < forced.rows
                && tokio::time::Instant::now() < until
            {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        let batch = {
            let mut state = lock(&batcher.state);
            let batch = take(&mut state.queue);
            if batch.is_empty() {
                state.in_flight -= 1;
                guard.finished = true;
                return;
            }
            batch
        };
        batcher.send_batch(&store, batch).await;
    }
}

/// Takes the next batch from `queue`: the requests still waiting, in order, at most [`MAX_ROWS`],
/// each scope once (a later request of a scope already taken stays, in its place, for the next).
fn take<R: Rows>(queue: &mut VecDeque<Queued<R>>) -> Vec<Queued<R>> {
    let mut batch: Vec<Queued<R>> = Vec::new();
    let mut deferred: Vec<Queued<R>> = Vec::new();
    while batch.len() < MAX_ROWS {
        let Some(queued) = queue.pop_front() else {
            break;
        };
        if queued.answer.is_closed() {
            continue;
        }
        let scope = R::scope(&queued.item);
        if batch.iter().any(|taken| R::scope(&taken.item) == scope) {
            deferred.push(queued);
        } else {
            batch.push(queued);
        }
    }
    for queued in deferred.into_iter().rev() {
        queue.push_front(queued);
    }
    batch
}

/// A statement sent alone is in flight: when it returns (or its request is dropped), what queued
/// meanwhile goes next.
struct Busy<'a, R: Rows> {
    batcher: &'a Arc<Batcher<R>>,
    store: &'a R::Store,
}

impl<R: Rows> Drop for Busy<'_, R> {
    fn drop(&mut self) {
        self.batcher.next(self.store);
    }
}

/// A queued request's wait for its answer. Dropped before it read an answer that came (its
/// request left, or its bound ran out, just as the batch returned), it hands the row and the
/// answer to [`Rows::orphaned`]: the runner's send succeeded, so nobody else will.
struct Waiting<'a, R: Rows> {
    receiver: oneshot::Receiver<(R::Item, R::Answer)>,
    store: &'a R::Store,
    taken: bool,
}

impl<R: Rows> Drop for Waiting<'_, R> {
    fn drop(&mut self) {
        if self.taken {
            return;
        }
        self.receiver.close();
        if let Ok((item, answer)) = self.receiver.try_recv() {
            let orphaned = R::orphaned(self.store.clone(), item, answer);
            if let Ok(runtime) = tokio::runtime::Handle::try_current() {
                drop(runtime.spawn(orphaned));
            }
        }
    }
}

/// A runner's place in flight: if its task ends before its queue is empty (a panic, its runtime
/// shut down, before or after it first ran), the place is given back, and, when it was the last
/// one, the requests still queued are answered `None` rather than left waiting.
struct Running<R: Rows> {
    batcher: Arc<Batcher<R>>,
    finished: bool,
}

impl<R: Rows> Drop for Running<R> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let mut state = lock(&self.batcher.state);
        state.in_flight -= 1;
        // The last place in flight: nothing else would take what is queued.
        let dropped = (state.in_flight == 0).then(|| std::mem::take(&mut state.queue));
        drop(state);
        drop(dropped);
    }
}

#[cfg(test)]
mod tests;
