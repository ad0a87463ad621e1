//! Statements together (SPEC 26): one batcher per store and kind of statement (claim, completion,
//! release) sends what arrives while a statement of its kind is in flight in the next statement.
//!
//! - **No timer, no added latency.** A request that finds no statement of its kind in flight sends
//!   at once, alone, through today's statement ([`Rows::one`]), in its own future. Requests that
//!   arrive meanwhile queue; when the statement in flight returns, everything queued (up to
//!   [`MAX_ROWS`]) goes in one statement ([`Rows::many`]), sent by a task of its own, and so on
//!   until the queue is empty. Under load a batch grows with the arrival rate times the round
//!   trip (group commit); alone, nothing changes.
//! - **One answer per request, its own.** A batch's answers come back in input order, one per row;
//!   a statement that failed (any row's error fails all) is sent again row by row through
//!   [`Rows::one`], so no request is answered with another's error.
//! - **Distinct rows.** Two requests of one scope never share a statement: the later waits for the
//!   next one.
//! - **Leaving.** A request dropped while queued leaves the queue (it is never sent). One whose
//!   row was in flight when it left has its answer handed to [`Rows::orphaned`], which undoes what
//!   the row did (a claim inserted for nobody is released by its lease).
//! - **Bounded waits.** A queued request waits at most its bound from the moment it queued, then
//!   gives up (as a statement that timed out: the caller treats it as no answer).
//!
//! A test setting ([`Forced`]) holds each batch until it has some rows (or a few milliseconds
//! passed) and sends every batch, even of one row, through [`Rows::many`], so that the conformance
//! kit and the soak run the batch statements everywhere.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

use crate::util::lock::lock;

/// The most rows one statement carries.
pub(crate) const MAX_ROWS: usize = 64;

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
    /// answer, in input order; `None` when the statement failed (then every row goes alone).
    fn many(
        store: &Self::Store,
        items: &[&Self::Item],
    ) -> impl Future<Output = Option<Vec<Self::Answer>>> + Send;

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

/// A queued request: its row, and where its answer goes.
struct Queued<R: Rows> {
    item: R::Item,
    /// The row goes back with its answer, so that a requester that left before reading it
    /// hands both to [`Rows::orphaned`].
    answer: oneshot::Sender<(R::Item, R::Answer)>,
}

struct State<R: Rows> {
    /// A statement of this kind is in flight (alone, in a request's future, or by the runner).
    busy: bool,
    queue: VecDeque<Queued<R>>,
}

/// The batcher of one kind of statement, shared by a store and its clones.
pub(crate) struct Batcher<R: Rows> {
    state: Mutex<State<R>>,
    forced: Option<Forced>,
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
    pub(crate) fn new(forced: Option<Forced>) -> Self {
        Batcher {
            state: Mutex::new(State {
                busy: false,
                queue: VecDeque::new(),
            }),
            forced,
            sent: AtomicU64::new(0),
            failed: AtomicU64::new(0),
        }
    }

    /// Batch statements sent, and those of them that failed.
    pub(crate) fn counts(&self) -> (u64, u64) {
        (
            self.sent.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
        )
    }

    /// Sends one request's row: `alone` (today's statement, borrowing the caller's data) when no
    /// statement of this kind is in flight, else the row `item()` makes, in the next batch.
    /// `None`: queued for longer than `wait`, or the batcher stopped (its runtime ended); the row
    /// may have been sent, as after a statement whose answer was lost.
    pub(crate) async fn send<A>(
        self: &Arc<Self>,
        store: &R::Store,
        alone: A,
        item: impl FnOnce() -> R::Item,
        wait: Duration,
    ) -> Option<R::Answer>
    where
        A: Future<Output = R::Answer>,
    {
        let queued = {
            let mut state = lock(&self.state);
            if !state.busy && self.forced.is_none() {
                state.busy = true;
                None
            } else {
                let (answer, receiver) = oneshot::channel();
                state.queue.push_back(Queued {
                    item: item(),
                    answer,
                });
                // Forced batches: nothing is sent alone; the runner starts with the first row.
                let start = !state.busy;
                state.busy = true;
                Some((receiver, start))
            }
        };
        let Some((receiver, start)) = queued else {
            let _busy = Busy {
                batcher: self,
                store,
            };
            return Some(alone.await);
        };
        if start {
            self.start(store.clone());
        }
        let mut waiting = Waiting::<R> {
            receiver,
            store,
            taken: false,
        };
        let answer = tokio::time::timeout(wait, &mut waiting.receiver).await;
        waiting.taken = true;
        match answer {
            Ok(Ok((_, answer))) => Some(answer),
            Ok(Err(_)) => None,
            Err(_) => {
                // Gave up; an answer that landed meanwhile is its orphan.
                waiting.taken = false;
                None
            }
        }
    }

    /// Starts the runner, which sends what is queued until the queue is empty. Without a runtime
    /// (a request's future dropped outside one), the queued requests are answered `None`.
    fn start(self: &Arc<Self>, store: R::Store) {
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                let batcher = self.clone();
                drop(runtime.spawn(async move { batcher.run(store).await }));
            }
            Err(_) => {
                let mut state = lock(&self.state);
                state.busy = false;
                let dropped = std::mem::take(&mut state.queue);
                drop(state);
                drop(dropped);
            }
        }
    }

    /// The statement in flight returned: the runner takes over what queued meanwhile, if anything.
    fn next(self: &Arc<Self>, store: &R::Store) {
        let mut state = lock(&self.state);
        state.queue.retain(|queued| !queued.answer.is_closed());
        if state.queue.is_empty() {
            state.busy = false;
            return;
        }
        drop(state);
        self.start(store.clone());
    }

    async fn run(self: Arc<Self>, store: R::Store) {
        let mut guard = Running {
            batcher: &self,
            finished: false,
        };
        loop {
            if let Some(forced) = self.forced {
                let until = tokio::time::Instant::now() + forced.hold;
                while lock(&self.state).queue.len() < forced.rows
                    && tokio::time::Instant::now() < until
                {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            let batch = {
                let mut state = lock(&self.state);
                let batch = take(&mut state.queue);
                if batch.is_empty() {
                    state.busy = false;
                    guard.finished = true;
                    return;
                }
                batch
            };
            self.send_batch(&store, batch).await;
        }
    }

    async fn send_batch(&self, store: &R::Store, batch: Vec<Queued<R>>) {
        let answers = if batch.len() == 1 && self.forced.is_none() {
            vec![R::one(store, &batch[0].item).await]
        } else {
            let items: Vec<&R::Item> = batch.iter().map(|queued| &queued.item).collect();
            self.sent.fetch_add(1, Ordering::Relaxed);
            match R::many(store, &items).await {
                Some(answers) if answers.len() == items.len() => answers,
                _ => {
                    self.failed.fetch_add(1, Ordering::Relaxed);
                    futures_util::future::join_all(items.iter().map(|item| R::one(store, item)))
                        .await
                }
            }
        };
        for (queued, answer) in batch.into_iter().zip(answers) {
            if let Err((item, answer)) = queued.answer.send((queued.item, answer)) {
                drop(tokio::spawn(R::orphaned(store.clone(), item, answer)));
            }
        }
    }

    /// How many requests are queued (for tests).
    #[cfg(test)]
    fn queued(&self) -> usize {
        lock(&self.state).queue.len()
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

/// The runner's task: if it ends before its queue is empty (a panic, its runtime shut down), the
/// requests still queued are answered `None` rather than left waiting, and the next request sends
/// alone again.
struct Running<'a, R: Rows> {
    batcher: &'a Batcher<R>,
    finished: bool,
}

impl<R: Rows> Drop for Running<'_, R> {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let mut state = lock(&self.batcher.state);
        state.busy = false;
        let dropped = std::mem::take(&mut state.queue);
        drop(state);
        drop(dropped);
    }
}

#[cfg(test)]
mod tests;
