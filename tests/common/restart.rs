//! A restart of the store's server does not count against a live holder (SPEC 24): the one
//! scenario, run on every store whose server a test can restart (a private PostgreSQL, MariaDB,
//! and a Redis that keeps its records).
//!
//! A restart ends every keeper's presences and stops renewals while it lasts. A record in progress
//! is taken only on a mark made a TTL before by the server process that takes it, however old its
//! last renewal and its mark from before the restart, so the time the server was down does not
//! count against a live holder (whose keeper shows its presences, and renews, again once the server
//! is back). After that, a holder that shows and renews nothing is dead, and its record is retaken.

use std::time::Duration;

use axum_idempotency::Fingerprint;
use axum_idempotency::store::{ClaimOutcome, ClaimRequest, IdempotencyStore, RecordKey};
use tokio::time::Instant;

/// Claims a record under a lease whose presence no keeper shows (after a restart, a live holder's
/// keeper may not have shown its own again yet); a TTL later, another claim marks it silent; has
/// `restart` restart the server half a TTL after the mark (it must take well under half a TTL),
/// then claims again: `409` a TTL after the mark (made by the server before its restart: this
/// claim marks the record again), and a retake a TTL after that.
pub async fn a_restart_does_not_count_against_a_holder<S: IdempotencyStore>(
    store: &S,
    ttl: Duration,
    restart: impl FnOnce() + Send + 'static,
) {
    let held = ClaimRequest::new(
        RecordKey {
            key: "restarted".into(),
            subject: "alice".into(),
            endpoint: "POST /pay".into(),
        },
        Fingerprint::of(None, b"{}"),
        ttl,
        Duration::from_secs(600),
    );
    let claimed = store.claim(&held).await.expect("claim");
    assert!(
        matches!(claimed, ClaimOutcome::Claimed { .. }),
        "{claimed:?}"
    );
    // Silent for a TTL, its presence shown by nobody: the first claim that finds it so marks it,
    // and takes nothing (a live holder's presence may have ended without the server showing it).
    tokio::time::sleep(ttl + Duration::from_millis(200)).await;
    let noticed = store.claim(&held.from_another_request()).await;
    assert!(
        matches!(noticed, Ok(ClaimOutcome::InProgress)),
        "taken at the first look: {noticed:?}"
    );
    let marked_at = Instant::now();
    tokio::time::sleep_until(marked_at + ttl / 2).await;
    tokio::task::spawn_blocking(restart).await.expect("restart");
    let up_at = Instant::now();
    assert!(
        up_at < marked_at + ttl - Duration::from_millis(300),
        "the restart took {:?}: too long for this test's TTL",
        up_at - marked_at - ttl / 2
    );
    // The mark is a TTL old and nothing was renewed since, but it was made by the server before
    // its restart: only that holds the record. (The store's connections died with the server:
    // the claim is retried until it answers.)
    tokio::time::sleep_until(marked_at + ttl + Duration::from_millis(200)).await;
    let early = loop {
        match store.claim(&held.from_another_request()).await {
            Ok(outcome) => break outcome,
            // Still well within a TTL of the server's return: the check means something.
            Err(_) if up_at.elapsed() < ttl - Duration::from_millis(500) => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(e) => panic!("no claim after the restart: {e}"),
        }
    };
    assert!(
        matches!(early, ClaimOutcome::InProgress),
        "retaken {:?} after the server came back, {:?} after the mark: {early:?}",
        up_at.elapsed(),
        marked_at.elapsed()
    );
    // That claim marked the record again, on the restarted server.
    let marked_again_at = Instant::now();
    // A TTL after that mark, nobody has shown or renewed anything: the holder is dead.
    tokio::time::sleep_until(marked_again_at + ttl + Duration::from_millis(200)).await;
    let retaker = held.from_another_request();
    let late = store
        .claim(&retaker)
        .await
        .expect("claim a TTL after the restart");
    assert!(late.is_retake(&retaker), "{late:?}");
}
