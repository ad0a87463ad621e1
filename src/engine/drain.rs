//! [`Drain`]: every guarded request from its admission to its end, and the work the engine runs on
//! tasks of its own, counted, so that a shutdown can wait for it and admission can be bounded by
//! it.
//!
//! A guarded request is counted from the moment the layer admits it until its future ends, whether
//! its client is still attached or went away (then the rest of it runs detached, and is counted as
//! detached too: what admission bounds). Besides, the engine moves work off the request's own
//! future in four places: a completion retried after the store failed, a streamed body's recorder,
//! a release retried in the background and the clean-up of a claim whose answer was lost. Each of
//! them, if killed with the runtime at shutdown, can leave an effect without its record, and the
//! retry after the restart would run it again. Every such task is spawned through a [`Drain`],
//! which counts it until it ends (or is dropped by a dying runtime), so the application can wait
//! for the count to reach zero, within one deadline, after its server stopped accepting.
//!
//! The counting is tokio-util's [`TaskTracker`], the ecosystem's "spawn tracked, wait at
//! shutdown": a task is spawned through it, a request holds one of its tokens. The tracker is
//! closed from the start (closing stops nothing from being tracked; it only lets `wait` return
//! once nothing is), so [`Drain::wait`] can be called any number of times, by anyone sharing the
//! drain. What it does not count, the requests detached from their clients, is a counter beside it.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio_util::task::TaskTracker;
use tokio_util::task::task_tracker::TaskTrackerToken;
use tracing::Instrument;

/// Counts what a layer (or several, sharing one) still runs on tasks of its own, and waits for it at
/// shutdown.
///
/// Get it from [`IdempotencyLayer::drain`](crate::IdempotencyLayer::drain), or make one and give it
/// to several layers with [`IdempotencyLayerBuilder::drain`](crate::IdempotencyLayerBuilder::drain).
/// It counts requests still attached to their clients too, so one deadline can bound the whole
/// shutdown: stop accepting, then wait for the drain with what is left of the grace period.
///
/// ```no_run
/// # use std::time::Duration;
/// # use axum::{Router, routing::post};
/// # use axum_idempotency::{IdempotencyLayer, MemoryStore};
/// # async fn run(listener: tokio::net::TcpListener) -> std::io::Result<()> {
/// let layer = IdempotencyLayer::new(MemoryStore::new()).expect("valid settings");
/// let drain = layer.drain();
/// # use axum::handler::Handler;
/// async fn checkout() -> &'static str { "charged" }
/// let app = Router::new().route("/checkout", post(checkout.layer(layer)));
/// let _ = tokio::signal::ctrl_c().await;
/// // One deadline for the whole shutdown, below the orchestrator's grace period.
/// let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
/// let server = axum::serve(listener, app).with_graceful_shutdown(async {});
/// // The server stops accepting at once; connections still open are given until the deadline.
/// let _ = tokio::time::timeout_at(deadline, server).await;
/// // Requests still running (attached or not), completions still being retried, recorders of
/// // streamed bodies: finish them before the runtime ends, or their effects may be repeated by
/// // a retry.
/// let left = deadline.saturating_duration_since(tokio::time::Instant::now());
/// if !drain.wait(left).await {
///     eprintln!("{} idempotent requests were still running at exit", drain.running());
/// }
/// # Ok(()) }
/// ```
///
/// Clones share the count.
#[derive(Clone)]
pub struct Drain {
    inner: Arc<Inner>,
}

struct Inner {
    /// Requests admitted and not ended, and tasks running.
    tracker: TaskTracker,
    /// Of those, the requests detached from clients that went away: what admission bounds.
    detached: AtomicUsize,
}

impl Default for Drain {
    fn default() -> Self {
        let tracker = TaskTracker::new();
        // Closed for good: `wait` returns whenever nothing is tracked, and tracking goes on.
        tracker.close();
        Self {
            inner: Arc::new(Inner {
                tracker,
                detached: AtomicUsize::new(0),
            }),
        }
    }
}

impl fmt::Debug for Drain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Drain")
            .field("running", &self.running())
            .field("detached", &self.detached())
            .finish()
    }
}

impl Drain {
    /// A drain with nothing running.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many guarded requests (attached to their clients or not) and background tasks are
    /// running now.
    pub fn running(&self) -> usize {
        self.inner.tracker.len()
    }

    /// How many requests whose clients went away are running on their own now (part of
    /// [`running`](Self::running)); what [`max_running`](crate::IdempotencyLayerBuilder::max_running)
    /// bounds.
    pub fn detached(&self) -> usize {
        self.inner.detached.load(Ordering::Acquire)
    }

    /// Waits until nothing is running, or `deadline` has passed; true when nothing is running.
    /// Work started while it waits is waited for too.
    pub async fn wait(&self, deadline: Duration) -> bool {
        // `None`: a deadline too far to date, never reached.
        let until = tokio::time::Instant::now().checked_add(deadline);
        loop {
            if self.running() == 0 {
                return true;
            }
            // The tracker's wait ends when it was told the count reached zero, which work counted
            // since (a request on a connection still open, a `RunOnce` sharing the drain) may have
            // undone: the count is read again, and waited for again, until the deadline.
            let emptied = self.inner.tracker.wait();
            match until {
                Some(until) => {
                    if tokio::time::timeout_at(until, emptied).await.is_err() {
                        return self.running() == 0;
                    }
                }
                None => emptied.await,
            }
        }
    }

    /// Spawns `work` on the current runtime, counted until it ends or is dropped. Nothing is spawned
    /// outside a runtime.
    pub(crate) fn spawn<F>(&self, work: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(self.inner.tracker.track_future(work.in_current_span()));
    }

    /// Counts a request admitted by the layer until the returned guard is dropped (its future
    /// ended, or its detached task did).
    pub(crate) fn admit(&self) -> Admitted {
        Admitted {
            _token: self.inner.tracker.token(),
            inner: self.inner.clone(),
            detached: false,
        }
    }
}

/// One counted request; dropping it (it ended, or the runtime dropped it) uncounts it.
pub(crate) struct Admitted {
    /// Held, never read: the tracker counts the request while it lives.
    _token: TaskTrackerToken,
    inner: Arc<Inner>,
    detached: bool,
}

impl fmt::Debug for Admitted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admitted")
            .field("detached", &self.detached)
            .finish()
    }
}

impl Admitted {
    /// Spawns the rest of a request whose client went away, counted as detached until it ends (or
    /// is dropped), under this admission, which counted it so far.
    pub(crate) fn detach<F>(mut self, work: F)
    where
        F: Future<Output = ()> + Send + 'static,
    {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        if !self.detached {
            self.detached = true;
            self.inner.detached.fetch_add(1, Ordering::AcqRel);
        }
        runtime.spawn(
            async move {
                work.await;
                drop(self);
            }
            .in_current_span(),
        );
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        if self.detached {
            self.inner.detached.fetch_sub(1, Ordering::AcqRel);
        }
        // The tracker's token is dropped after this (fields go after `drop`): `running` never
        // reads below `detached`.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn waits_for_work_and_the_work_it_starts() {
        let drain = Drain::new();
        let inner = drain.clone();
        drain.spawn(async move {
            tokio::time::sleep(Duration::from_secs(5)).await;
            // Work started by counted work is counted before its parent ends.
            inner.spawn(async {
                tokio::time::sleep(Duration::from_secs(5)).await;
            });
        });
        assert_eq!(drain.running(), 1);
        let started = tokio::time::Instant::now();
        assert!(drain.wait(Duration::from_secs(60)).await);
        assert_eq!(started.elapsed(), Duration::from_secs(10));
        assert_eq!(drain.running(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn gives_up_at_the_deadline() {
        let drain = Drain::new();
        drain.spawn(std::future::pending());
        let started = tokio::time::Instant::now();
        assert!(!drain.wait(Duration::from_secs(3)).await);
        assert_eq!(started.elapsed(), Duration::from_secs(3));
        assert_eq!(drain.running(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn work_counted_after_the_count_reached_zero_is_waited_for() {
        let drain = Drain::new();
        let admitted = drain.admit();
        let waiter = tokio::spawn({
            let drain = drain.clone();
            async move { drain.wait(Duration::from_secs(10)).await }
        });
        // The waiter is waiting; the count reaches zero, then new work is counted before the
        // waiter runs again.
        tokio::task::yield_now().await;
        drop(admitted);
        drain.spawn(std::future::pending());
        let started = tokio::time::Instant::now();
        assert!(!waiter.await.expect("waiter"), "returned with work running");
        assert_eq!(started.elapsed(), Duration::from_secs(10));
        assert_eq!(drain.running(), 1);
    }

    #[tokio::test]
    async fn a_deadline_too_far_to_date_waits_for_the_work() {
        let drain = Drain::new();
        drain.spawn(tokio::time::sleep(Duration::from_millis(10)));
        assert!(drain.wait(Duration::MAX).await);
    }

    #[tokio::test]
    async fn an_empty_drain_returns_at_once() {
        assert!(Drain::new().wait(Duration::ZERO).await);
    }

    #[tokio::test(start_paused = true)]
    async fn counts_admitted_requests_and_their_detached_rest_and_waits_again() {
        let drain = Drain::new();
        let admitted = drain.admit();
        assert_eq!((drain.running(), drain.detached()), (1, 0));
        admitted.detach(async {
            tokio::time::sleep(Duration::from_secs(2)).await;
        });
        assert_eq!((drain.running(), drain.detached()), (1, 1));
        assert!(!drain.wait(Duration::from_secs(1)).await);
        assert!(drain.wait(Duration::from_secs(5)).await);
        assert_eq!((drain.running(), drain.detached()), (0, 0));
        // A drain waited for once still counts, and waits, as before.
        drain.spawn(async {
            tokio::time::sleep(Duration::from_secs(1)).await;
        });
        assert_eq!(drain.running(), 1);
        let started = tokio::time::Instant::now();
        assert!(drain.wait(Duration::from_secs(5)).await);
        assert_eq!(started.elapsed(), Duration::from_secs(1));
    }
}
