//! In-process coalescing of duplicates: what this process knows of its own claims and leases, so a
//! duplicate arriving at the instance that holds (or is claiming) its key is answered without a
//! round trip to the store. It is knowledge of this layer's leases, so it lives beside them and
//! works over every store; the store only ever answers claims.
//!
//! [`Coalesced`] is the store as the layer's requests use it: claims go through [`LocalClaims`]
//! first, and completions, renewals and releases keep its holds current. Records settled outside
//! the store's operations (in a handler's transaction) let go through
//! [`LocalClaims::let_go`] directly.

mod local;
mod scope;

use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

pub(crate) use local::LocalClaims;
pub(crate) use scope::{ByScope, Scope};

use crate::Fingerprint;
use crate::record::{
    ClaimOutcome, ClaimRequest, FRESH_FRACTION, Fenced, LeaseToken, RecordKey, StoredResponse,
};
use crate::store::{Capabilities, IdempotencyStore, StoreError};

/// `St` with duplicates at this process answered from its own claims (see the module docs).
#[derive(Clone, Debug)]
pub(crate) struct Coalesced<St> {
    inner: St,
    local: Arc<LocalClaims>,
}

impl std::fmt::Debug for LocalClaims {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalClaims").finish_non_exhaustive()
    }
}

impl<St> Coalesced<St> {
    /// `inner`, coalesced through `local` (the layer's, shared by its clones and services).
    pub(crate) fn new(inner: St, local: Arc<LocalClaims>) -> Self {
        Coalesced { inner, local }
    }
}

impl<St: IdempotencyStore> IdempotencyStore for Coalesced<St> {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
        let scope = Scope::of(&request.key);
        match self.local.enter(scope, request.fingerprint, request.lease) {
            local::Entry::Answer(answer) => Ok(answer),
            local::Entry::Follow(leader, answer) => {
                let patience = request.in_progress_ttl / FRESH_FRACTION;
                match LocalClaims::follow(leader, request.fingerprint, answer, patience).await? {
                    Some(answer) => Ok(answer),
                    None => self.inner.claim(request).await,
                }
            }
            local::Entry::Lead(leader) => {
                let sent = Instant::now();
                let outcome = self.inner.claim(request).await;
                if sent.elapsed() > request.in_progress_ttl / FRESH_FRACTION {
                    // A late answer may describe a record that another instance has retaken since
                    // (the layer proves a late grant held before it runs anything): it settles no
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

    async fn complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> Result<Fenced, StoreError> {
        let done = self
            .inner
            .complete(key, lease, fingerprint, response, retention)
            .await;
        // Finished, or lost: either way not held here any more. After an error the completion is
        // tried again, and the record is still in progress as far as anyone knows.
        if done.is_ok() {
            self.local.let_go(&Scope::of(key), lease);
        }
        done
    }

    async fn renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        lifetime: Duration,
    ) -> Result<Fenced, StoreError> {
        let renewed = self.inner.renew(key, lease, lifetime).await;
        match renewed {
            Ok(Fenced::Done) => self.local.renewed(&Scope::of(key), lease),
            Ok(Fenced::LeaseLost) => self.local.let_go(&Scope::of(key), lease),
            Err(_) => {}
        }
        renewed
    }

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
        // Not held here from now on, whatever the store answers: if the release failed, the store
        // still says "in progress", which is what this process would have said.
        self.local.let_go(&Scope::of(key), lease);
        self.inner.release(key, lease).await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        // Holds past their TTL are also swept every 1024 claims of a shard (see `LocalClaims`),
        // which bounds them when nothing purges through the layer.
        self.local.sweep();
        self.inner.purge_expired().await
    }

    fn capabilities(&self) -> Capabilities<'_> {
        self.inner.capabilities()
    }

    async fn lookup(
        &self,
        key: &RecordKey,
    ) -> Result<Option<crate::store::RecordInfo>, StoreError> {
        self.inner.lookup(key).await
    }

    /// Only a finished record is deleted, and a hold of this process is let go when its record is
    /// finished (or, for a completion whose answer was lost, when its retry or the next renewal
    /// finds it finished): nothing here changes. Until then a duplicate here still gets `409`.
    async fn delete(&self, key: &RecordKey) -> Result<crate::store::Deleted, StoreError> {
        self.inner.delete(key).await
    }

    async fn list(
        &self,
        subject: &str,
        request: crate::store::ListRequest,
    ) -> Result<crate::store::RecordPage, StoreError> {
        self.inner.list(subject, request).await
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

    use super::*;
    use crate::record::Generation;
    use crate::store::MemoryStore;

    /// The memory store, its claims counted and answered after a delay.
    #[derive(Clone, Default)]
    struct Slow {
        inner: MemoryStore,
        delay_ms: Arc<AtomicU64>,
        claims: Arc<AtomicUsize>,
    }

    impl IdempotencyStore for Slow {
        async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
            self.claims.fetch_add(1, Ordering::SeqCst);
            let delay = Duration::from_millis(self.delay_ms.load(Ordering::SeqCst));
            tokio::time::sleep(delay).await;
            self.inner.claim(request).await
        }
        async fn complete(
            &self,
            key: &RecordKey,
            lease: LeaseToken,
            fingerprint: &Fingerprint,
            response: Arc<StoredResponse>,
            retention: Duration,
        ) -> Result<Fenced, StoreError> {
            self.inner
                .complete(key, lease, fingerprint, response, retention)
                .await
        }
        async fn renew(
            &self,
            key: &RecordKey,
            lease: LeaseToken,
            lifetime: Duration,
        ) -> Result<Fenced, StoreError> {
            self.inner.renew(key, lease, lifetime).await
        }
        async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
            self.inner.release(key, lease).await
        }
        async fn purge_expired(&self) -> Result<u64, StoreError> {
            self.inner.purge_expired().await
        }
        async fn lookup(
            &self,
            key: &crate::RecordKey,
        ) -> Result<Option<crate::store::RecordInfo>, crate::StoreError> {
            self.inner.lookup(key).await
        }
        async fn delete(
            &self,
            key: &crate::RecordKey,
        ) -> Result<crate::store::Deleted, crate::StoreError> {
            self.inner.delete(key).await
        }
        async fn list(
            &self,
            subject: &str,
            request: crate::store::ListRequest,
        ) -> Result<crate::store::RecordPage, crate::StoreError> {
            self.inner.list(subject, request).await
        }
        fn capabilities(&self) -> Capabilities<'_> {
            self.inner.capabilities()
        }
    }

    const TTL: Duration = Duration::from_millis(900);

    fn request(key: &str) -> ClaimRequest {
        ClaimRequest {
            key: RecordKey {
                key: key.into(),
                subject: "alice".into(),
                endpoint: "POST /pay".into(),
            },
            fingerprint: Fingerprint::of(None, b"{}"),
            lease: LeaseToken::generate(),
            generation: Generation::generate(),
            in_progress_ttl: TTL,
            retention: Duration::from_secs(60),
        }
    }

    /// A claim answered on time settles its followers and holds the key; one answered later than a
    /// tenth of the TTL does neither: its followers stop waiting at that bound and ask the store,
    /// and the next duplicate asks it too.
    #[tokio::test(start_paused = true)]
    async fn only_a_claim_answered_on_time_settles_followers_and_holds_the_key() {
        for (delay_ms, late) in [(10, false), (200, true)] {
            let slow = Slow::default();
            slow.delay_ms.store(delay_ms, Ordering::SeqCst);
            let store = Coalesced::new(slow.clone(), Arc::default());
            let leader = tokio::spawn({
                let store = store.clone();
                async move { store.claim(&request("k")).await }
            });
            tokio::time::sleep(Duration::from_millis(1)).await;
            let follower = store.claim(&request("k")).await.expect("follower");
            assert_eq!(follower, ClaimOutcome::InProgress);
            let leader = leader.await.expect("task").expect("leader");
            assert!(matches!(leader, ClaimOutcome::Claimed { .. }));
            assert_eq!(
                slow.claims.load(Ordering::SeqCst),
                if late { 2 } else { 1 },
                "late: {late}"
            );
            let duplicate = store.claim(&request("k")).await.expect("duplicate");
            assert_eq!(duplicate, ClaimOutcome::InProgress);
            assert_eq!(
                slow.claims.load(Ordering::SeqCst),
                if late { 3 } else { 1 },
                "a hold only after a claim on time (late: {late})"
            );
        }
    }
}
