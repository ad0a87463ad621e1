//! [`RunOnceBuilder`]: the settings of a [`RunOnce`], checked when it is built.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

#[cfg(doc)]
use super::OnceError;
use super::{RUN_ONCE_LABEL, RunOnce};
#[cfg(doc)]
use crate::engine::IdempotencyContext;
use crate::engine::{ConfigError, Drain, Engine, Outcome, Settings};
use crate::store::IdempotencyStore;
use crate::util::metrics::Label;

/// Builds a [`RunOnce`]; [`build`](Self::build) checks the settings with the bounds of
/// [`IdempotencyLayerBuilder::build`](crate::IdempotencyLayerBuilder::build).
pub struct RunOnceBuilder<St> {
    store: St,
    settings: Settings,
    drain: Drain,
}

impl<St> fmt::Debug for RunOnceBuilder<St> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RunOnceBuilder")
            .field("settings", &self.settings)
            .finish_non_exhaustive()
    }
}

impl<St: IdempotencyStore> RunOnceBuilder<St> {
    pub(super) fn new(store: St) -> Self {
        RunOnceBuilder {
            store,
            // A run-once subject is a consumer or a job, not a tenant: no share of records.
            settings: Settings {
                max_records_per_subject: None,
                ..Settings::default()
            },
            drain: Drain::new(),
        }
    }

    /// How many live records one subject may have in the store (default: no bound). Past it, new
    /// scopes of the subject answer [`OnceError::Store`] with a
    /// [`quota_exceeded`](crate::store::StoreError::is_quota_exceeded) error until some of its
    /// records expire; its recorded outputs are still returned. For subjects that stand for
    /// tenants.
    pub fn max_records_per_subject(mut self, records: Option<u64>) -> Self {
        self.settings.max_records_per_subject = records;
        self
    }

    /// How long an in-progress record may go without a heartbeat before it is presumed abandoned
    /// (its process died) and retaken. From 30 ms to 10 years, and at least twice the store's
    /// operation timeout. Default: 90 s.
    pub fn in_progress_ttl(mut self, ttl: Duration) -> Self {
        self.settings.in_progress_ttl = ttl;
        self
    }

    /// How long recorded outputs are kept and returned; after that the scope is new again. From
    /// 100 ms to 10 years; keep it above the longest redelivery horizon of your queue. Default:
    /// 24 h.
    pub fn retention(mut self, retention: Duration) -> Self {
        self.settings.retention = retention;
        self
    }

    /// The longest a run may hold its claim; a closure still running then is cancelled and the
    /// scope settled as [`OnceError::TimedOut`]. From the in-progress TTL to
    /// 10 years. Default: 10 minutes, or the TTL when that is longer.
    pub fn max_hold(mut self, hold: Duration) -> Self {
        self.settings.max_hold = Some(hold);
        self
    }

    /// The deployment secret (at least 16 bytes) mixed into
    /// [`IdempotencyContext::derived_key`], as
    /// [`IdempotencyLayerBuilder::derived_key_secret`](crate::IdempotencyLayerBuilder::derived_key_secret).
    pub fn derived_key_secret(mut self, secret: impl AsRef<[u8]>) -> Self {
        self.settings.derived_key_secret =
            Some(Arc::new(crate::util::secret::Secret::new(secret.as_ref())));
        self
    }

    /// Lets a call that finds the scope in progress wait up to `wait` for the holder's output
    /// instead of answering [`OnceError::InProgress`] at once, as
    /// [`IdempotencyLayerBuilder::wait`](crate::IdempotencyLayerBuilder::wait) does for requests:
    /// no connection or lock is held, `f` never runs for a waiter, and a released or vanished
    /// record ends the wait with `InProgress`. Default: zero (off); at most 5 s.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.settings.wait = wait;
        self
    }

    /// Counts the calls and background work in `drain`, shared with layers or other `RunOnce`s.
    pub fn drain(mut self, drain: Drain) -> Self {
        self.drain = drain;
        self
    }

    /// Calls `hook` with every [`Outcome`] of a call (claimed, retaken, recorded, released,
    /// replayed, in progress, key reuse, store unavailable, timed out).
    pub fn on_outcome(mut self, hook: impl Fn(Outcome) + Send + Sync + 'static) -> Self {
        self.settings.on_outcome = Some(Arc::new(hook));
        self
    }

    /// Checks the settings and builds the [`RunOnce`].
    pub fn build(self) -> Result<RunOnce<St>, ConfigError> {
        Ok(RunOnce {
            engine: Engine::new(self.store, self.settings, self.drain)?,
            label: Label::named(RUN_ONCE_LABEL),
        })
    }
}
