//! What the example is configured with, from the environment.

use std::error::Error;
use std::time::Duration;

/// What the example is configured with.
#[derive(Clone, Copy)]
pub(crate) struct Settings {
    pub in_progress_ttl: Duration,
    pub checkout_delay: Duration,
    pub checkout_hold: Duration,
    /// For the tests that kill the process between two steps: after which step of a checkout
    /// (1 reserve, 2 charge, 3 receipt; 0: none) it pauses, and for how long. The pause is
    /// counted as a call to the service `pause` once the step is recorded.
    pub pause_after_step: u64,
    pub step_pause: Duration,
    pub transactional: bool,
    /// How long a duplicate of a checkout in progress waits for its answer (0: `409` at once).
    pub wait: Duration,
    /// How long a client waits for its answer before `408` (the checkout itself runs on).
    pub request_timeout: Duration,
    /// How long a checkout's tombstone outlives its record (0: none): a retry within it is told
    /// `410 idempotency_key_expired` rather than charged again.
    pub tombstones: Duration,
    /// A test setting of the soak (0: off): the Postgres store holds each batch of claims,
    /// completions and releases until it has this many rows, so that every statement goes through
    /// the batch statements. Only with the crate's `test-suite` feature.
    pub batches_held: usize,
}

impl Settings {
    pub(crate) fn from_env() -> Result<Self, Box<dyn Error>> {
        let secs = |name: &str, default: u64| -> Result<u64, Box<dyn Error>> {
            match std::env::var(name) {
                Ok(v) => v.parse().map_err(|e| format!("{name}={v:?}: {e}").into()),
                Err(_) => Ok(default),
            }
        };
        Ok(Settings {
            in_progress_ttl: Duration::from_secs(secs("IDEMPOTENCY_IN_PROGRESS_TTL_SECS", 90)?),
            checkout_delay: Duration::from_millis(secs("CHECKOUT_DELAY_MS", 0)?),
            checkout_hold: Duration::from_millis(secs("CHECKOUT_HOLD_MS", 0)?),
            pause_after_step: secs("CHECKOUT_PAUSE_AFTER_STEP", 0)?,
            step_pause: Duration::from_millis(secs("CHECKOUT_STEP_PAUSE_MS", 20_000)?),
            transactional: secs("CHECKOUT_TRANSACTIONAL", 1)? != 0,
            wait: Duration::from_millis(secs("IDEMPOTENCY_WAIT_MS", 0)?),
            request_timeout: Duration::from_secs(secs("REQUEST_TIMEOUT_SECS", 30)?),
            tombstones: Duration::from_secs(secs("IDEMPOTENCY_TOMBSTONE_SECS", 7 * 24 * 3600)?),
            batches_held: usize::try_from(secs("TEST_BATCHES_HELD", 0)?)?,
        })
    }
}
