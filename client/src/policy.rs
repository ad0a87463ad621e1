//! How long and how often an idempotent request is retried.

use std::time::{Duration, Instant};

use http::{HeaderName, StatusCode};

use crate::IDEMPOTENT_REPLAYED;

/// How an idempotent request is retried: the total deadline, the attempt limit, the backoff, which
/// statuses are retried without a problem body saying so, and the name of the replay header.
///
/// ```
/// use std::time::Duration;
/// use axum_idempotency_client::RetryPolicy;
///
/// let policy = RetryPolicy::new()
///     .deadline(Duration::from_secs(30))
///     .max_attempts(8)
///     .backoff(Duration::from_millis(200), Duration::from_secs(5));
/// # let _ = policy;
/// ```
#[derive(Debug, Clone)]
pub struct RetryPolicy {
    pub(crate) deadline: Duration,
    pub(crate) max_attempts: u32,
    pub(crate) initial_backoff: Duration,
    pub(crate) max_backoff: Duration,
    pub(crate) retryable_statuses: Vec<StatusCode>,
    pub(crate) replayed_header: HeaderName,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy::new()
    }
}

impl RetryPolicy {
    /// The defaults: a 60 s total deadline, at most 20 attempts, backoff from 250 ms doubling up
    /// to 10 s, statuses `408`, `429` and `503` retried, replays marked by `Idempotent-Replayed`.
    pub fn new() -> Self {
        RetryPolicy {
            deadline: Duration::from_secs(60),
            max_attempts: 20,
            initial_backoff: Duration::from_millis(250),
            max_backoff: Duration::from_secs(10),
            retryable_statuses: vec![
                StatusCode::REQUEST_TIMEOUT,
                StatusCode::TOO_MANY_REQUESTS,
                StatusCode::SERVICE_UNAVAILABLE,
            ],
            replayed_header: IDEMPOTENT_REPLAYED,
        }
    }

    /// The longest the whole operation may take, from the first attempt's start: no attempt starts
    /// after it, a wait that would end after it is not made (the last answer is returned), and an
    /// attempt still in flight when it passes is abandoned. Default: 60 s. `Duration::MAX` for
    /// none (then [`max_attempts`](Self::max_attempts) alone bounds it).
    pub fn deadline(mut self, deadline: Duration) -> Self {
        self.deadline = deadline;
        self
    }

    /// The most attempts, the first included (at least 1). Default: 20.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts.max(1);
        self
    }

    /// The backoff when the server gave no `Retry-After`: the n-th retry waits between half and all
    /// of `initial × 2ⁿ⁻¹`, at most `max`. Defaults: 250 ms and 10 s.
    pub fn backoff(mut self, initial: Duration, max: Duration) -> Self {
        self.initial_backoff = initial;
        self.max_backoff = max.max(initial);
        self
    }

    /// Also retries answers with `status` and no problem body that says otherwise (for example
    /// `502` from a gateway you know to be transient).
    pub fn retry_status(mut self, status: StatusCode) -> Self {
        if !self.retryable_statuses.contains(&status) {
            self.retryable_statuses.push(status);
        }
        self
    }

    /// Replaces the statuses retried without a problem body (default `408`, `429`, `503`). A
    /// problem body's `retryable` member decides over this list, either way; `2xx` and `3xx` are
    /// never retried.
    pub fn retryable_statuses(mut self, statuses: impl IntoIterator<Item = StatusCode>) -> Self {
        self.retryable_statuses = statuses.into_iter().collect();
        self
    }

    /// The response header that marks a replay, when the server was configured with another name
    /// (default `Idempotent-Replayed`). Its value is `true` on a replay.
    pub fn replayed_header(mut self, name: HeaderName) -> Self {
        self.replayed_header = name;
        self
    }

    /// The deadline as an instant, for an operation that started at `start` (`None`: none).
    pub(crate) fn deadline_from(&self, start: Instant) -> Option<Instant> {
        start.checked_add(self.deadline)
    }

    /// The backoff step of the `retry`-th retry (1 for the first): `initial × 2^(retry-1)`, at most
    /// `max`.
    pub(crate) fn backoff_step(&self, retry: u32) -> Duration {
        let factor = 2u32.saturating_pow(retry.saturating_sub(1));
        self.initial_backoff
            .saturating_mul(factor)
            .min(self.max_backoff)
    }

    /// The range the wait before the `retry`-th retry is drawn from. Without a hint from the
    /// server: half to all of the backoff step. With `Retry-After` (`hint`): never earlier than it,
    /// and up to half a backoff step later, so that callers told the same `Retry-After` do not
    /// come back in lockstep.
    pub(crate) fn wait_range(&self, retry: u32, hint: Option<Duration>) -> (Duration, Duration) {
        let step = self.backoff_step(retry);
        match hint {
            None => (step / 2, step),
            Some(hint) => (hint, hint.saturating_add(step / 2)),
        }
    }
}

/// A point in `[low, high]` chosen by `random` (uniform over `u64`, uniform over the range).
pub(crate) fn jitter(low: Duration, high: Duration, random: u64) -> Duration {
    if high <= low {
        return low;
    }
    let span = (high - low).as_nanos();
    // Exact while the span fits in 584 years of nanoseconds; past that, close enough.
    let offset = match span.checked_mul(u128::from(random)) {
        Some(product) => product / u128::from(u64::MAX),
        None => span / u128::from(u64::MAX) * u128::from(random),
    };
    let secs = u64::try_from(offset / 1_000_000_000).unwrap_or(u64::MAX);
    let nanos = u32::try_from(offset % 1_000_000_000).unwrap_or(0);
    low.saturating_add(Duration::new(secs, nanos))
}

/// A random `u64` from the operating system; the middle of the range if it fails (a wait is still
/// made, only without spread).
pub(crate) fn random_u64() -> u64 {
    getrandom::u64().unwrap_or(u64::MAX / 2)
}

/// When the next attempt may start: `now + wait`, or `None` when that is at or past the deadline
/// (then no further attempt is made).
pub(crate) fn next_attempt_at(
    now: Instant,
    wait: Duration,
    deadline: Option<Instant>,
) -> Option<Instant> {
    let at = now.checked_add(wait)?;
    match deadline {
        Some(deadline) if at >= deadline => None,
        _ => Some(at),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        let policy = RetryPolicy::new().backoff(100 * MS, 1000 * MS);
        let steps: Vec<_> = (1..=6).map(|n| policy.backoff_step(n)).collect();
        assert_eq!(
            steps,
            [100 * MS, 200 * MS, 400 * MS, 800 * MS, 1000 * MS, 1000 * MS]
        );
        // Far retries neither overflow nor pass the cap.
        assert_eq!(policy.backoff_step(u32::MAX), 1000 * MS);
    }

    #[test]
    fn jitter_stays_within_its_bounds() {
        let (low, high) = (500 * MS, 1500 * MS);
        assert_eq!(jitter(low, high, 0), low);
        assert_eq!(jitter(low, high, u64::MAX), high);
        assert_eq!(
            jitter(low, high, u64::MAX / 2),
            1000 * MS - Duration::from_nanos(1)
        );
        for _ in 0..10_000 {
            let d = jitter(low, high, random_u64());
            assert!(low <= d && d <= high, "{d:?} outside [{low:?}, {high:?}]");
        }
        // An empty or inverted range gives its low end.
        assert_eq!(jitter(high, high, random_u64()), high);
        assert_eq!(jitter(high, low, random_u64()), high);
        // Extreme ranges do not overflow.
        for random in [0, 1, u64::MAX / 2, u64::MAX - 1, u64::MAX] {
            let d = jitter(Duration::ZERO, Duration::MAX, random);
            assert!(random < u64::MAX / 2 || d >= Duration::MAX / 3, "{d:?}");
        }
    }

    #[test]
    fn jitter_spreads_over_the_range() {
        // Across draws the waits are not all the same: both halves of the range are used.
        let (low, high) = (Duration::ZERO, 1000 * MS);
        let draws: Vec<_> = (0..200).map(|_| jitter(low, high, random_u64())).collect();
        assert!(draws.iter().any(|d| *d < 500 * MS));
        assert!(draws.iter().any(|d| *d > 500 * MS));
    }

    #[test]
    fn a_retry_after_is_a_floor_never_a_ceiling() {
        let policy = RetryPolicy::new().backoff(200 * MS, 10_000 * MS);
        let hint = Duration::from_secs(2);
        for retry in 1..=8 {
            let (low, high) = policy.wait_range(retry, Some(hint));
            assert_eq!(low, hint, "never earlier than the server asked");
            assert_eq!(high, hint + policy.backoff_step(retry) / 2);
            for _ in 0..100 {
                assert!(jitter(low, high, random_u64()) >= hint);
            }
        }
        // Without a hint: half to all of the step.
        assert_eq!(policy.wait_range(3, None), (400 * MS, 800 * MS));
        // `Retry-After: 0` still spreads the callers a little.
        assert_eq!(
            policy.wait_range(1, Some(Duration::ZERO)),
            (Duration::ZERO, 100 * MS)
        );
    }

    #[test]
    fn no_attempt_is_planned_at_or_past_the_deadline() {
        let now = Instant::now();
        let deadline = Some(now + Duration::from_secs(10));
        assert_eq!(
            next_attempt_at(now, Duration::from_secs(3), deadline),
            Some(now + Duration::from_secs(3))
        );
        assert_eq!(
            next_attempt_at(now, Duration::from_secs(10), deadline),
            None
        );
        assert_eq!(
            next_attempt_at(now, Duration::from_secs(11), deadline),
            None
        );
        // Past the deadline already: even no wait is refused.
        let later = now + Duration::from_secs(12);
        assert_eq!(next_attempt_at(later, Duration::ZERO, deadline), None);
        // No deadline: any wait that fits in an Instant.
        assert!(next_attempt_at(now, Duration::from_secs(86_400), None).is_some());
        assert_eq!(next_attempt_at(now, Duration::MAX, None), None);
    }

    #[test]
    fn the_deadline_is_counted_from_the_start_and_may_be_none() {
        let start = Instant::now();
        let policy = RetryPolicy::new().deadline(Duration::from_secs(30));
        assert_eq!(
            policy.deadline_from(start),
            Some(start + Duration::from_secs(30))
        );
        assert_eq!(
            RetryPolicy::new()
                .deadline(Duration::MAX)
                .deadline_from(start),
            None
        );
    }

    #[test]
    fn statuses_and_limits_are_configurable() {
        let policy = RetryPolicy::new()
            .retry_status(StatusCode::BAD_GATEWAY)
            .retry_status(StatusCode::BAD_GATEWAY)
            .max_attempts(0);
        assert_eq!(policy.max_attempts, 1, "at least the first attempt");
        assert_eq!(
            policy.retryable_statuses,
            [
                StatusCode::REQUEST_TIMEOUT,
                StatusCode::TOO_MANY_REQUESTS,
                StatusCode::SERVICE_UNAVAILABLE,
                StatusCode::BAD_GATEWAY
            ]
        );
        let only = RetryPolicy::new().retryable_statuses([StatusCode::TOO_MANY_REQUESTS]);
        assert_eq!(only.retryable_statuses, [StatusCode::TOO_MANY_REQUESTS]);
    }
}
