//! [`RunOnceBuilder`]: the settings of a [`RunOnce`], checked when it is built.

use std::fmt;
use std::sync::Arc;

#[cfg(doc)]
use super::OnceError;
use super::{RUN_ONCE_LABEL, ReplayCheckFn, RunOnce};
use crate::engine::{ConfigError, Drain, Engine, Settings};
use crate::store::IdempotencyStore;
use crate::util::metrics::Label;

/// Builds a [`RunOnce`]; [`build`](Self::build) checks the settings with the bounds of
/// [`IdempotencyLayerBuilder::build`](crate::IdempotencyLayerBuilder::build).
pub struct RunOnceBuilder<St> {
    store: St,
    settings: Settings,
    drain: Drain,
    replay_check: Option<Arc<ReplayCheckFn>>,
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
                max_bytes_per_subject: None,
                ..Settings::default()
            },
            drain: Drain::new(),
            replay_check: None,
        }
    }

    crate::engine::engine_setters!(settings);

    /// How many live records one subject may have in the store (default: no bound). Past it, new
    /// scopes of the subject answer [`OnceError::Store`] with a
    /// [`quota_exceeded`](crate::store::StoreError::is_quota_exceeded) error until some of its
    /// records expire; its recorded outputs are still returned. For subjects that stand for
    /// tenants.
    pub fn max_records_per_subject(mut self, records: Option<u64>) -> Self {
        self.settings.max_records_per_subject = records;
        self
    }

    /// How many bytes of recorded outputs one subject may have in the store (default: no bound),
    /// counted with its records (so [`max_records_per_subject`](Self::max_records_per_subject)
    /// must be set too). Past it, as past the share of records.
    pub fn max_bytes_per_subject(mut self, bytes: Option<u64>) -> Self {
        self.settings.max_bytes_per_subject = bytes;
        self
    }

    /// Counts the calls and background work in `drain`, shared with layers or other `RunOnce`s.
    pub fn drain(mut self, drain: Drain) -> Self {
        self.drain = drain;
        self
    }

    /// Runs `check` before a recorded output is returned, with the record
    /// ([`ReplayInfo`](crate::ReplayInfo): its scope and its recorded answer). Its future answers
    /// `None` to let the output be returned, or `Some(reason)` to refuse it:
    /// [`OnceError::ReplayRefused`], and nothing of the record. A check that panics refuses.
    pub fn replay_check<F, Fut>(mut self, check: F) -> Self
    where
        F: Fn(&crate::ReplayInfo<'_>) -> Fut + Send + Sync + 'static,
        Fut: std::future::Future<Output = Option<String>> + Send + 'static,
    {
        self.replay_check = Some(Arc::new(move |info| Box::pin(check(info))));
        self
    }

    /// Checks the settings and builds the [`RunOnce`].
    pub fn build(self) -> Result<RunOnce<St>, ConfigError> {
        Ok(RunOnce {
            engine: Engine::new(self.store, self.settings, self.drain)?,
            label: Label::named(RUN_ONCE_LABEL),
            replay_check: self.replay_check,
        })
    }
}
