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

use std::sync::Arc;
use std::time::Duration;

pub(crate) use local::LocalClaims;

use crate::Fingerprint;
use crate::record::{ClaimOutcome, ClaimRequest, Fenced, LeaseToken, RecordKey, StoredResponse};
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
        let scope = request.key.digest();
        match self.local.enter(scope, request.fingerprint, request.lease) {
            local::Entry::Answer(answer) => Ok(answer),
            local::Entry::Follow(leader, answer) => {
                match LocalClaims::follow(leader, request.fingerprint, answer).await? {
                    Some(answer) => Ok(answer),
                    None => self.inner.claim(request).await,
                }
            }
            local::Entry::Lead(leader) => {
                let outcome = self.inner.claim(request).await;
                leader.settle(
                    request.fingerprint,
                    request.in_progress_ttl,
                    outcome.as_ref(),
                );
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
            self.local.let_go(&key.digest(), lease);
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
            Ok(Fenced::Done) => self.local.renewed(&key.digest(), lease),
            Ok(Fenced::LeaseLost) => self.local.let_go(&key.digest(), lease),
            Err(_) => {}
        }
        renewed
    }

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
        // Not held here from now on, whatever the store answers: if the release failed, the store
        // still says "in progress", which is what this process would have said.
        self.local.let_go(&key.digest(), lease);
        self.inner.release(key, lease).await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.local.sweep();
        self.inner.purge_expired().await
    }

    fn capabilities(&self) -> Capabilities<'_> {
        self.inner.capabilities()
    }
}
