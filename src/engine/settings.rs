//! The engine's settings, validated once, and [`ConfigError`], which says which setting is wrong.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::outcome::Outcome;
use crate::util::secret::Secret;

/// The longest in-progress TTL, retention or maximum hold: ten years. Longer ones would overflow
/// clocks or the stores' timestamps.
pub(crate) const MAX_DURATION: Duration = Duration::from_secs(10 * 365 * 24 * 60 * 60);

/// The shortest in-progress TTL. The holder renews its lease every third of the TTL, and no store
/// can promise a round trip much faster than this.
pub(crate) const MIN_IN_PROGRESS_TTL: Duration = Duration::from_millis(30);

/// How long a claim may be held by its handler and its body, by default: ten minutes.
pub(crate) const DEFAULT_MAX_HOLD: Duration = Duration::from_secs(10 * 60);

/// How many times the store's operation timeout the in-progress TTL must be at least: a claim
/// answered at the end of its timeout must leave most of the TTL to prove it holds the record.
pub(crate) const TTL_PER_OPERATION_TIMEOUT: u32 = 2;

/// The longest wait of a duplicate for its answer.
pub(crate) const MAX_WAIT: Duration = Duration::from_secs(5);

/// The shortest retention: against a retention of zero or a few nanoseconds, which would let a
/// retry that follows the answer at once run the handler again.
pub(crate) const MIN_RETENTION: Duration = Duration::from_millis(100);

/// The shortest deployment secret of derived keys.
pub(crate) const MIN_SECRET_LEN: usize = 16;

/// Why a configuration was refused: the setting at fault, and what is wrong with it.
///
/// ```
/// use std::time::Duration;
/// use axum_idempotency::{IdempotencyLayer, MemoryStore};
///
/// let refused = IdempotencyLayer::builder(MemoryStore::new())
///     .in_progress_ttl(Duration::ZERO)
///     .build()
///     .unwrap_err();
/// assert_eq!(refused.setting(), "in_progress_ttl");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    setting: &'static str,
    reason: String,
}

impl ConfigError {
    pub(crate) fn new(setting: &'static str, reason: impl Into<String>) -> Self {
        ConfigError {
            setting,
            reason: reason.into(),
        }
    }

    /// The name of the setting at fault, as its builder method is named (`in_progress_ttl`,
    /// `store_header`, ...).
    pub fn setting(&self) -> &str {
        self.setting
    }

    /// What is wrong with it.
    pub fn reason(&self) -> &str {
        &self.reason
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid idempotency setting `{}`: {}",
            self.setting, self.reason
        )
    }
}

impl std::error::Error for ConfigError {}

pub(crate) type OutcomeFn = dyn Fn(Outcome) + Send + Sync;

/// What the engine needs to know, the same for every door (the HTTP layer, `RunOnce`).
#[derive(Clone)]
pub(crate) struct Settings {
    pub(crate) in_progress_ttl: Duration,
    pub(crate) retention: Duration,
    /// The longest a claim may be held by its handler (and its body), if set (see
    /// [`max_hold`](Self::max_hold)).
    pub(crate) max_hold: Option<Duration>,
    /// Requests running detached (their clients went away) before new ones are refused.
    pub(crate) max_running: usize,
    /// How long a duplicate of a request in progress waits for its answer; zero: not at all.
    pub(crate) wait: Duration,
    /// How many duplicates may wait on one key at this instance.
    pub(crate) max_waiters: usize,
    /// How many duplicates of one subject may wait at this instance.
    pub(crate) max_waiters_per_subject: usize,
    /// How many duplicates may wait at this instance, all subjects together.
    pub(crate) max_waiting: usize,
    /// How many requests of one subject may be in flight at this instance.
    pub(crate) max_in_flight_per_subject: usize,
    /// How many live records one subject may have in the store; `None`: no bound.
    pub(crate) max_records_per_subject: Option<u64>,
    /// Whether a store failure lets the work run unguarded.
    pub(crate) fail_open: bool,
    /// The deployment secret mixed into derived keys (HMAC), if any.
    pub(crate) derived_key_secret: Option<Arc<Secret>>,
    /// The application's hook on outcomes.
    pub(crate) on_outcome: Option<Arc<OutcomeFn>>,
    /// Whether subjects and endpoints are logged as they are (otherwise hashed).
    pub(crate) log_scope: bool,
}

impl Default for Settings {
    fn default() -> Self {
        Settings {
            in_progress_ttl: Duration::from_secs(90),
            retention: Duration::from_secs(24 * 60 * 60),
            max_hold: None,
            max_running: 1024,
            wait: Duration::ZERO,
            max_waiters: 16,
            max_waiters_per_subject: 64,
            max_waiting: 1024,
            max_in_flight_per_subject: 256,
            max_records_per_subject: Some(100_000),
            fail_open: false,
            derived_key_secret: None,
            on_outcome: None,
            log_scope: false,
        }
    }
}

impl fmt::Debug for Settings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The settings an operator reads; functions and the secret are left out.
        f.debug_struct("Settings")
            .field("in_progress_ttl", &self.in_progress_ttl)
            .field("retention", &self.retention)
            .field("max_hold", &self.max_hold)
            .field("max_running", &self.max_running)
            .field("wait", &self.wait)
            .field("max_waiters", &self.max_waiters)
            .field("max_waiters_per_subject", &self.max_waiters_per_subject)
            .field("max_waiting", &self.max_waiting)
            .field("max_in_flight_per_subject", &self.max_in_flight_per_subject)
            .field("max_records_per_subject", &self.max_records_per_subject)
            .field("fail_open", &self.fail_open)
            .finish_non_exhaustive()
    }
}

impl Settings {
    /// The longest a claim may be held: as set, or ten minutes, or the TTL when that is longer
    /// (the default never refuses a long TTL).
    pub(crate) fn max_hold(&self) -> Duration {
        self.max_hold
            .unwrap_or(DEFAULT_MAX_HOLD.max(self.in_progress_ttl))
    }

    /// Checks the settings against each other and against the store's operation timeout.
    pub(crate) fn validate(&self, operation_timeout: Option<Duration>) -> Result<(), ConfigError> {
        let ttl = self.in_progress_ttl;
        if ttl < MIN_IN_PROGRESS_TTL || ttl > MAX_DURATION {
            return Err(ConfigError::new(
                "in_progress_ttl",
                "must be from 30 ms to ten years",
            ));
        }
        if let Some(timeout) = operation_timeout
            && ttl < timeout * TTL_PER_OPERATION_TIMEOUT
        {
            return Err(ConfigError::new(
                "in_progress_ttl",
                format!(
                    "{ttl:?} must be at least {TTL_PER_OPERATION_TIMEOUT} times the store's \
                     operation timeout ({timeout:?}): a claim answered late must still leave time \
                     to prove it holds the record"
                ),
            ));
        }
        if self.retention < MIN_RETENTION || self.retention > MAX_DURATION {
            return Err(ConfigError::new(
                "retention",
                "must be from 100 ms to ten years",
            ));
        }
        let max_hold = self.max_hold();
        if max_hold < ttl || max_hold > MAX_DURATION {
            return Err(ConfigError::new(
                "max_hold",
                "must be from the in-progress TTL to ten years",
            ));
        }
        if self.max_running == 0 {
            return Err(ConfigError::new("max_running", "must be at least 1"));
        }
        if self
            .derived_key_secret
            .as_ref()
            .is_some_and(|s| s.bytes().len() < MIN_SECRET_LEN)
        {
            return Err(ConfigError::new(
                "derived_key_secret",
                "must be at least 16 bytes",
            ));
        }
        if self.wait > MAX_WAIT {
            return Err(ConfigError::new(
                "wait",
                "must be at most 5 s: a duplicate is not held longer",
            ));
        }
        if !self.wait.is_zero() && self.max_waiters == 0 {
            return Err(ConfigError::new(
                "max_waiters",
                "must be at least 1 when the wait is on",
            ));
        }
        for (setting, value) in [
            ("max_waiters_per_subject", self.max_waiters_per_subject),
            ("max_waiting", self.max_waiting),
            ("max_in_flight_per_subject", self.max_in_flight_per_subject),
        ] {
            if value == 0 {
                return Err(ConfigError::new(setting, "must be at least 1"));
            }
        }
        if self.max_records_per_subject == Some(0) {
            return Err(ConfigError::new(
                "max_records_per_subject",
                "must be at least 1 (or None, for no bound)",
            ));
        }
        Ok(())
    }
}
