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
    pub(crate) max_waiters_per_key: usize,
    /// How many duplicates of one subject may wait at this instance.
    pub(crate) max_waiters_per_subject: usize,
    /// How many duplicates may wait at this instance, all subjects together.
    pub(crate) max_waiters_total: usize,
    /// How many requests of one subject may be in flight at this instance.
    pub(crate) max_in_flight_per_subject: usize,
    /// How many live records one subject may have in the store; `None`: no bound.
    pub(crate) max_records_per_subject: Option<u64>,
    /// How many bytes of recorded answers one subject may have in the store, counted with its
    /// records; `None`: no bound.
    pub(crate) max_bytes_per_subject: Option<u64>,
    /// Whether a store failure lets the work run unguarded.
    pub(crate) fail_open: bool,
    /// How long a finished record's tombstone outlives it; `None`: no tombstones.
    pub(crate) tombstones: Option<Duration>,
    /// The deployment secret mixed into derived keys (HMAC), if any.
    pub(crate) derived_key_secret: Option<Arc<Secret>>,
    /// The application's hook on outcomes.
    pub(crate) on_outcome: Option<Arc<OutcomeFn>>,
    /// Whether subjects and endpoints are logged as they are (otherwise hashed).
    pub(crate) log_scope: bool,
    /// Whether the lease keeper runs on the runtime of the request that starts it rather than on
    /// its own thread: only for the crate's tests under a paused clock, which must drive it.
    pub(crate) keeper_on_callers_runtime: bool,
}

/// The default share of bytes of one subject's recorded answers in the store: 256 MiB.
pub(crate) const DEFAULT_MAX_BYTES_PER_SUBJECT: u64 = 256 * 1024 * 1024;

impl Default for Settings {
    fn default() -> Self {
        Settings {
            in_progress_ttl: Duration::from_secs(90),
            retention: Duration::from_secs(24 * 60 * 60),
            max_hold: None,
            max_running: 1024,
            wait: Duration::ZERO,
            max_waiters_per_key: 16,
            max_waiters_per_subject: 64,
            max_waiters_total: 1024,
            max_in_flight_per_subject: 256,
            max_records_per_subject: Some(100_000),
            max_bytes_per_subject: Some(DEFAULT_MAX_BYTES_PER_SUBJECT),
            fail_open: false,
            tombstones: None,
            derived_key_secret: None,
            on_outcome: None,
            log_scope: false,
            keeper_on_callers_runtime: false,
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
            .field("max_waiters_per_key", &self.max_waiters_per_key)
            .field("max_waiters_per_subject", &self.max_waiters_per_subject)
            .field("max_waiters_total", &self.max_waiters_total)
            .field("max_in_flight_per_subject", &self.max_in_flight_per_subject)
            .field("max_records_per_subject", &self.max_records_per_subject)
            .field("max_bytes_per_subject", &self.max_bytes_per_subject)
            .field("fail_open", &self.fail_open)
            .field("tombstones", &self.tombstones)
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

    /// How long an in-progress record lives past its last renewal: the TTL and the retention, or
    /// the maximum hold when that is longer. A record past its life is taken (or purged) with no
    /// look at its holder, so it must outlive any work still under its lease however long the
    /// store could not take renewals (a short retention must not let an outage of a few TTLs
    /// retake a live holder).
    pub(crate) fn in_progress_lifetime(&self) -> Duration {
        self.in_progress_ttl + self.in_progress_retention()
    }

    /// What claims give the store as their `retention` (see
    /// [`in_progress_lifetime`](Self::in_progress_lifetime)).
    pub(crate) fn in_progress_retention(&self) -> Duration {
        self.retention.max(self.max_hold())
    }

    /// Checks the settings against each other and against the store: its operation timeout, and
    /// whether it counts a subject's records.
    pub(crate) fn validate(
        &self,
        operation_timeout: Option<Duration>,
        counts_records: bool,
    ) -> Result<(), ConfigError> {
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
        if let Some(after) = self.tombstones
            && (after < MIN_RETENTION || after > MAX_DURATION)
        {
            return Err(ConfigError::new(
                "tombstones",
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
        // A subject's own bound above the instance's would let one subject take every place.
        for (setting, each, all, total) in [
            (
                "max_in_flight_per_subject",
                self.max_in_flight_per_subject,
                "max_running",
                self.max_running,
            ),
            (
                "max_waiters_per_subject",
                self.max_waiters_per_subject,
                "max_waiters_total",
                self.max_waiters_total,
            ),
        ] {
            if each > total {
                return Err(ConfigError::new(
                    setting,
                    format!("must be at most {all} ({total}): one subject would take every place"),
                ));
            }
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
        if !self.wait.is_zero() && self.max_waiters_per_key == 0 {
            return Err(ConfigError::new(
                "max_waiters_per_key",
                "must be at least 1 when the wait is on",
            ));
        }
        for (setting, value) in [
            ("max_waiters_per_subject", self.max_waiters_per_subject),
            ("max_waiters_total", self.max_waiters_total),
            ("max_in_flight_per_subject", self.max_in_flight_per_subject),
        ] {
            if value == 0 {
                return Err(ConfigError::new(setting, "must be at least 1"));
            }
        }
        if self.max_records_per_subject.is_some() && !counts_records {
            return Err(ConfigError::new(
                "max_records_per_subject",
                "the store keeps no subject with its records (Postgres without scope columns, \
                 Redis without scope fields), so it cannot bound them: set None, or keep them",
            ));
        }
        if self.max_records_per_subject == Some(0) {
            return Err(ConfigError::new(
                "max_records_per_subject",
                "must be at least 1 (or None, for no bound)",
            ));
        }
        if self.max_bytes_per_subject == Some(0) {
            return Err(ConfigError::new(
                "max_bytes_per_subject",
                "must be at least 1 (or None, for no bound)",
            ));
        }
        if self.max_bytes_per_subject.is_some() && self.max_records_per_subject.is_none() {
            return Err(ConfigError::new(
                "max_bytes_per_subject",
                "a subject's bytes are counted with its records: set max_records_per_subject \
                 too (or None here)",
            ));
        }
        Ok(())
    }
}

/// The engine's setters, the same on both doors' builders (the layer's and `RunOnce`'s), written
/// once: each sets the field of the builder's engine settings (`$settings`) of its name.
macro_rules! engine_setters {
    ($settings:ident) => {
        /// How long an `in_progress` record may go without a heartbeat before it is presumed
        /// abandoned (its process died) and may be retaken. The holder renews it every third of
        /// this and shows it is alive meanwhile, so live work, however slow, is never retaken;
        /// keep it well above the longest store outage you want to ride out. From 30 ms to 10
        /// years, and at least twice the store's operation timeout. Default: 90 s.
        ///
        /// The record keeps its holder's TTL, and a claim presumes the holder dead only after the
        /// longer of its own and the holder's: instances configured differently (a rolling deploy
        /// that lowers it) do not retake each other's live claims. Versions before the one that
        /// kept it neither keep nor read it: lower the TTL in a deploy after the one that brings
        /// a version that does.
        pub fn in_progress_ttl(mut self, ttl: std::time::Duration) -> Self {
            self.$settings.in_progress_ttl = ttl;
            self
        }

        /// How long finished records are kept and replayed; after that the key (or the scope) is
        /// new again. From 100 ms to 10 years; keep it above the longest horizon over which your
        /// clients (or your queue) send the same operation again. Default: 24 h.
        pub fn retention(mut self, retention: std::time::Duration) -> Self {
            self.$settings.retention = retention;
            self
        }

        /// The longest a claim may be held: from the claim until the work has answered (for the
        /// layer, until its response body has ended). Work still running then is cancelled. Its
        /// effect may have happened, so the record becomes a definitive timeout that replays and
        /// the work never runs again for that key: the layer's `504 idempotency_handler_timeout`,
        /// `RunOnce`'s `OnceError::TimedOut`. Work in the handler's transaction committed nothing,
        /// so that transaction is rolled back and the key released instead. A streamed body still
        /// running then is cut, and the response recorded without its body (its client saw the
        /// handler's status). From the in-progress TTL to 10 years. Default: 10 minutes, or the
        /// in-progress TTL when that is longer.
        pub fn max_hold(mut self, hold: std::time::Duration) -> Self {
            self.$settings.max_hold = Some(hold);
            self
        }

        /// A deployment secret (at least 16 bytes) mixed into
        /// [`IdempotencyContext::derived_key`](crate::IdempotencyContext::derived_key) as an
        /// HMAC-SHA-256 key. Set one per deployment whenever two deployments (staging and
        /// production, two tenants' apps, two services) share one account at a downstream
        /// provider: without it, the same subject, key, endpoint and body would give both the same
        /// provider key, and one would get the other's result. Keep it stable: changing it changes
        /// every derived key, so a retake after the change is a new operation at the provider.
        /// Default: none.
        pub fn derived_key_secret(mut self, secret: impl AsRef<[u8]>) -> Self {
            self.$settings.derived_key_secret = Some(std::sync::Arc::new(
                crate::util::secret::Secret::new(secret.as_ref()),
            ));
            self
        }

        /// Lets a duplicate of work still in progress wait up to `wait` for its answer instead of
        /// being told at once that it is in progress (the layer's `409`, `RunOnce`'s
        /// `OnceError::InProgress`): it then gets the recorded answer, or, for another body, the
        /// layer's `422` (`RunOnce`'s `OnceError::KeyReuse`). Default: zero (off); at most 5 s.
        ///
        /// A waiter holds no store connection or lock: it wakes when this process's holder lets
        /// the record go, and otherwise looks the record up every 25 ms, doubling to 250 ms. When
        /// the record was released (a retryable answer), deleted, or is still in progress at the
        /// bound, it is in progress as without a wait, and the client's retry settles it. A wait
        /// never runs the work: a claim granted to a waiter (the record vanished in between) is
        /// released at once. At most 16 wait on one key at an instance (the layer's
        /// `max_waiters_per_key`); the others are told at once.
        pub fn wait(mut self, wait: std::time::Duration) -> Self {
            self.$settings.wait = wait;
            self
        }

        /// Keeps a tombstone of every finished record for `after` past the record's retention
        /// (default: none). A request whose key's record expired within that time is answered
        /// "expired" (the layer's `410 idempotency_key_expired`, `RunOnce`'s
        /// `OnceError::Expired`), not run again: a client that retries a day late gets told, not
        /// charged twice. From 100 ms to 10 years.
        ///
        /// A tombstone holds no answer: the key, subject and endpoint (hashed under
        /// `EncryptedStore`), in a record of its own whose endpoint is the record's with
        /// `" tombstone "` before it ([`tombstone_of`](crate::tombstone_of)), written through the
        /// store's own operations, so every store keeps them. Such scopes are the engine's: a claim
        /// of one (a custom endpoint, a run-once scope) is refused (the layer's `500`,
        /// `OnceError::Store`). It costs a look-up on every claim that runs, and a write (a claim, a
        /// completion and a look-up of the record) after every recorded answer, before the answer
        /// is sent; it counts as one of
        /// its subject's records. A tombstone that could not be written (the store failed once
        /// inline and three times in the background) is logged, and that key runs again once its
        /// record expires. Deleting a record through
        /// the store does not delete its tombstone: delete `tombstone_of(scope)` too, to make the
        /// key new at once.
        pub fn tombstones(mut self, after: std::time::Duration) -> Self {
            self.$settings.tombstones = Some(after);
            self
        }

        /// Calls `hook` with every [`Outcome`](crate::Outcome) (its docs list them all: claimed,
        /// replayed, in progress, recorded, released, refused by a share, ...), for metrics; see
        /// [`OutcomeCounters`](crate::OutcomeCounters). It runs on the request's path: keep it
        /// cheap.
        pub fn on_outcome(mut self, hook: impl Fn(crate::Outcome) + Send + Sync + 'static) -> Self {
            self.$settings.on_outcome = Some(std::sync::Arc::new(hook));
            self
        }
    };
}
pub(crate) use engine_setters;
