//! In-process coalescing of duplicates: what this process knows of its own claims and leases, so a
//! duplicate arriving at the instance that holds (or is claiming) its key is answered without a
//! round trip to the store. It is knowledge of the engine's own leases, so it lives beside them and
//! works over every store; the store only ever answers claims.
//!
//! [`claim`] is how the engine asks the store for a claim: through [`LocalClaims`] first. The
//! engine's completions, renewals and releases keep its holds current
//! ([`LocalClaims::let_go`], [`LocalClaims::renewed`]).

mod local;
mod scope;

use std::future::Future;

use tokio::time::Instant;

pub(crate) use local::LocalClaims;
pub(crate) use scope::{ByScope, Scope};

use super::timing::fresh_within;
use crate::store::{ClaimOutcome, ClaimRequest, StoreError};

/// The answer to `request`: from this process's own claims when it holds or is claiming the
/// scope, else from the store (`ask`), whose answer then settles the duplicates that followed it.
pub(crate) async fn claim<'a, F, Fut>(
    local: &std::sync::Arc<LocalClaims>,
    request: &'a ClaimRequest,
    ask: F,
) -> Result<ClaimOutcome, StoreError>
where
    F: Fn(&'a ClaimRequest) -> Fut,
    Fut: Future<Output = Result<ClaimOutcome, StoreError>>,
{
    let scope = Scope::of(&request.key);
    match local.enter(scope, request.fingerprint, request.lease) {
        local::Entry::Answer(answer) => Ok(answer),
        local::Entry::Follow(leader, answer) => {
            let patience = fresh_within(request.in_progress_ttl);
            match LocalClaims::follow(leader, request.fingerprint, answer, patience).await? {
                Some(answer) => Ok(answer),
                None => ask(request).await,
            }
        }
        local::Entry::Lead(leader) => {
            let sent = Instant::now();
            let outcome = ask(request).await;
            if sent.elapsed() > fresh_within(request.in_progress_ttl) {
                // A late answer may describe a record that another instance has retaken since
                // (the engine proves a late grant held before it runs anything): it settles no
                // follower and makes no hold. Dropped, the leader sends its followers to the
                // store.
                drop(leader);
            } else {
                leader.settle(
                    request.fingerprint,
                    request.in_progress_ttl,
                    outcome.as_ref(),
                );
            }
            outcome
        }
    }
}

impl std::fmt::Debug for LocalClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalClaims").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::store::{IdempotencyStore, MemoryStore};

    const TTL: Duration = Duration::from_millis(900);

    fn request(key: &str) -> ClaimRequest {
        crate::engine::tests::request_with_ttl(key, TTL)
    }

    /// A claim answered on time settles its followers and holds the key; one answered later than a
    /// tenth of the TTL does neither: its followers stop waiting at that bound and ask the store,
    /// and the next duplicate asks it too.
    #[tokio::test(start_paused = true)]
    async fn only_a_claim_answered_on_time_settles_followers_and_holds_the_key() {
        for (delay_ms, late) in [(10, false), (200, true)] {
            let store = MemoryStore::new();
            let local = Arc::new(LocalClaims::default());
            let claims = Arc::new(AtomicUsize::new(0));
            // The memory store, its claims counted and answered after a delay.
            let slow = {
                let (store, claims) = (store.clone(), claims.clone());
                move |request: ClaimRequest| {
                    let (store, claims) = (store.clone(), claims.clone());
                    async move {
                        claims.fetch_add(1, Ordering::SeqCst);
                        tokio::time::sleep(Duration::from_millis(delay_ms)).await;
                        store.claim(&request).await
                    }
                }
            };
            let leader = tokio::spawn({
                let (local, slow) = (local.clone(), slow.clone());
                async move {
                    let request = request("k");
                    claim(&local, &request, |r| slow(r.clone())).await
                }
            });
            tokio::time::sleep(Duration::from_millis(1)).await;
            let follower = request("k");
            let follower = claim(&local, &follower, |r| slow(r.clone()))
                .await
                .expect("follower");
            assert_eq!(follower, ClaimOutcome::InProgress);
            let leader = leader.await.expect("task").expect("leader");
            assert!(matches!(leader, ClaimOutcome::Claimed { .. }));
            assert_eq!(
                claims.load(Ordering::SeqCst),
                if late { 2 } else { 1 },
                "late: {late}"
            );
            let duplicate = request("k");
            let duplicate = claim(&local, &duplicate, |r| slow(r.clone()))
                .await
                .expect("duplicate");
            assert_eq!(duplicate, ClaimOutcome::InProgress);
            assert_eq!(
                claims.load(Ordering::SeqCst),
                if late { 3 } else { 1 },
                "a hold only after a claim on time (late: {late})"
            );
        }
    }
}
