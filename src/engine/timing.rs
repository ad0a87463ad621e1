//! Lease timing: every fraction of the in-progress TTL by which the engine trusts, renews, retries
//! and waits, named in one place. With the default TTL of 90 s: a claim is trusted when answered
//! within 9 s, a lease is renewed every 30 s (and 4.5 s after a failed renewal), one renewal may
//! take 15 s (or the store's operation timeout, up to 45 s).

use std::time::Duration;

/// A claim (or its confirming renewal) answered within this fraction of the TTL is trusted at
/// once; a later answer may describe a record another instance has retaken since, so the engine
/// proves it held (a guarded renewal) before running anything, and answers no duplicate from it.
const FRESH_FRACTION: u32 = 10;

/// How long after it was sent a claim's answer is still fresh (see [`FRESH_FRACTION`]); also how
/// long a duplicate of a claim this process is making waits for the leader's answer.
pub(crate) fn fresh_within(ttl: Duration) -> Duration {
    ttl / FRESH_FRACTION
}

/// How often a held lease is renewed: every third of the TTL, so that two renewals in a row may
/// fail before a retaker could take it. The keeper shows its presences as often, and lets its
/// task end after as long idle.
pub(crate) fn renew_every(ttl: Duration) -> Duration {
    ttl / 3
}

/// How soon a renewal that failed (or a keeper task that stopped) is tried again.
pub(crate) fn renew_retry(ttl: Duration) -> Duration {
    ttl / 20
}

/// Leases due within this much are renewed together with the one due now.
pub(crate) fn renew_together_within(ttl: Duration) -> Duration {
    ttl / 12
}

/// The longest the keeper sleeps between looks at its work: a sixth of the TTL, at most a second
/// (an engine the application dropped ends the keeper's task that soon).
pub(crate) fn keeper_nap(ttl: Duration) -> Duration {
    (ttl / 6).min(Duration::from_secs(1))
}

/// How long one renewal may take: a sixth of the TTL, or the store's own operation timeout when
/// that is longer (a healthy but slow store must not have every renewal cut short), at most half
/// the TTL.
pub(crate) fn renewal_bound(ttl: Duration, store_timeout: Option<Duration>) -> Duration {
    store_timeout
        .map_or(ttl / 6, |t| t.max(ttl / 6))
        .min(ttl / 2)
}

/// The longest pause between a completion's retries: a quarter of the TTL, at most a second.
pub(crate) fn completion_pause(ttl: Duration) -> Duration {
    (ttl / 4).min(Duration::from_secs(1))
}

/// The first pause of the release of a claim whose answer was lost: a tenth of the TTL, at most
/// 100 ms.
pub(crate) fn abandon_pause(ttl: Duration) -> Duration {
    (ttl / 10).min(Duration::from_millis(100))
}

/// How long the work's caller waits for a completion whose first attempt failed, retried in the
/// background, before it answers that the result is not recorded yet: a sixth of the TTL, at most
/// two seconds. A result is never answered before it is recorded: one the store never took (the
/// process died meanwhile) would be followed, after a retake, by another run's.
pub(crate) fn recorded_within(ttl: Duration) -> Duration {
    (ttl / 6).min(Duration::from_secs(2))
}
