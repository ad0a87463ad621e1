//! The keepers' runtime: a thread of its own with a single-threaded Tokio runtime, shared by every
//! lease keeper of the process. Handlers cannot starve it: a handler that blocks every worker of
//! the application's runtime (synchronous code after an await, outside `block_in_place`) stops
//! that runtime's timers and sockets, not this one's, and the keepers' connections are made here
//! (see `IdempotencyStore::keeper_session`), so this runtime drives them.
//!
//! The thread runs for as long as the process, its runtime with it. Should the runtime end anyway
//! (a panic in its driver; a test that stops it), the thread builds a new one and restarts on it
//! every keeper that still has leases, without waiting for a new claim.

use std::sync::{Arc, Mutex, Weak};

use tokio::runtime::Handle;

use crate::util::lock::lock;

/// A keeper that can be restarted on a new runtime.
pub(super) trait Restart: Send + Sync {
    /// Starts the keeper's task again on `runtime`, if it has work.
    fn restart(self: Arc<Self>, runtime: &Handle);
}

/// The shared runtime, while its thread runs.
struct Shared {
    handle: Handle,
    /// Ends the current runtime (tests), which the thread then replaces.
    #[cfg_attr(not(any(test, feature = "test-suite")), allow(dead_code))]
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

static SHARED: Mutex<Option<Shared>> = Mutex::new(None);

/// Every keeper started on the shared runtime, to restart on a new one.
static KEEPERS: Mutex<Vec<Weak<dyn Restart>>> = Mutex::new(Vec::new());

/// The shared runtime's handle, its thread started if it is not running; `None` when no thread or
/// runtime can be made (the keeper then runs on the caller's runtime, as a last resort).
pub(super) fn handle() -> Option<Handle> {
    let mut shared = lock(&SHARED);
    if let Some(running) = shared.as_ref() {
        return Some(running.handle.clone());
    }
    let (ready, started) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("idempotency-keeper".into())
        .spawn(move || serve(ready));
    if let Err(e) = spawned {
        tracing::error!(error = %e, "could not start the lease keepers' thread");
        return None;
    }
    match started.recv() {
        Ok(running) => {
            let handle = running.handle.clone();
            *shared = Some(running);
            Some(handle)
        }
        Err(_) => None,
    }
}

/// Remembers `keeper`, to restart it should the shared runtime be replaced.
pub(super) fn enlist(keeper: Weak<dyn Restart>) {
    let mut keepers = lock(&KEEPERS);
    keepers.retain(|k| k.strong_count() > 0);
    keepers.push(keeper);
}

/// The thread: a runtime, served until it is stopped, then another, for as long as the process.
fn serve(ready: std::sync::mpsc::Sender<Shared>) {
    let mut ready = Some(ready);
    loop {
        let runtime = match tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
        {
            Ok(runtime) => runtime,
            Err(e) => {
                tracing::error!(error = %e, "could not build the lease keepers' runtime");
                // The first one: `handle` holds the lock and waits on `ready`, which dropping
                // answers. A later one: the next `handle` starts a thread anew.
                if ready.is_none() {
                    *lock(&SHARED) = None;
                }
                return;
            }
        };
        let (stop, stopped) = tokio::sync::oneshot::channel();
        let running = Shared {
            handle: runtime.handle().clone(),
            stop: Some(stop),
        };
        match ready.take() {
            // The first runtime: the caller of `handle` publishes it.
            Some(ready) => {
                if ready.send(running).is_err() {
                    return;
                }
            }
            None => {
                *lock(&SHARED) = Some(running);
                let keepers: Vec<Arc<dyn Restart>> =
                    lock(&KEEPERS).iter().filter_map(Weak::upgrade).collect();
                for keeper in keepers {
                    keeper.restart(runtime.handle());
                }
            }
        }
        let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            runtime.block_on(async {
                // Never sent but by `stop_for_test`; a dropped sender (never) ends it too.
                let _ = stopped.await;
            })
        }));
        if served.is_err() {
            tracing::error!("the lease keepers' runtime panicked; starting another");
        }
        // Its tasks end with it; the keepers with leases start again on the next one.
        runtime.shutdown_background();
    }
}

/// Ends the shared runtime as if it had failed: the thread replaces it and restarts the keepers.
#[cfg(any(test, feature = "test-suite"))]
pub(crate) fn stop_for_test() -> bool {
    let stop = lock(&SHARED).as_mut().and_then(|shared| shared.stop.take());
    stop.is_some_and(|stop| stop.send(()).is_ok())
}
