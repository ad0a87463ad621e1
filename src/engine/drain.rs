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

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
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
#[derive(Clone, Default)]
pub struct Drain {
    inner: Arc<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Requests admitted and not ended, and tasks running.
    running: AtomicUsize,
    /// Of `running`, the requests detached from clients that went away: what admission bounds.
    detached: AtomicUsize,
    idle: Notify,
}

impl fmt::Debug for Drain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Drain")
            .field("running", &self.running())
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
        self.inner.running.load(Ordering::Acquire)
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
        let until = tokio::time::Instant::now() + deadline;
        loop {
            let idle = self.inner.idle.notified();
            tokio::pin!(idle);
            idle.as_mut().enable();
            if self.running() == 0 {
                return true;
            }
            if tokio::time::timeout_at(until, idle).await.is_err() {
                return self.running() == 0;
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
        let guard = self.track();
        runtime.spawn(
            async move {
                work.await;
                drop(guard);
            }
            .in_current_span(),
        );
    }

    /// Counts a request admitted by the layer until the returned guard is dropped (its future
    /// ended, or its detached task did).
    pub(crate) fn admit(&self) -> Admitted {
        self.track()
    }

    /// Counts one running task or request until the guard is dropped.
    fn track(&self) -> Admitted {
        self.inner.running.fetch_add(1, Ordering::AcqRel);
        Admitted {
            inner: self.inner.clone(),
            detached: false,
        }
    }
}

/// One counted request or task; dropping it (it ended, or the runtime dropped it) uncounts it.
pub(crate) struct Admitted {
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
        if self.inner.running.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.inner.idle.notify_waiters();
        }
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

    #[tokio::test]
    async fn an_empty_drain_returns_at_once() {
        assert!(Drain::new().wait(Duration::ZERO).await);
    }
}
