//! A store for the crate's own unit tests: the memory store, with each renewal's time noted and a
//! renewal or a completion that panics on demand.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::{
    ClaimOutcome, ClaimRequest, Deleted, Fenced, Fingerprint, IdempotencyStore, LeaseToken,
    ListRequest, MemoryStore, RecordInfo, RecordKey, RecordPage, StoreError, StoredResponse,
};
use crate::util::lock::lock;

#[derive(Clone, Default, Debug)]
pub(crate) struct Faulty {
    pub(crate) inner: MemoryStore,
    renewals: Arc<Mutex<Vec<Instant>>>,
    /// How many leases each call to `renew_many` renewed.
    batches: Arc<Mutex<Vec<usize>>>,
    panic_renewal: Arc<AtomicBool>,
    panic_completion: Arc<AtomicBool>,
    refuse_completions: Arc<AtomicBool>,
    operation_timeout: Option<Duration>,
}

impl Faulty {
    /// The same store, saying its operations take at most `timeout`.
    pub(crate) fn with_operation_timeout(self, timeout: Duration) -> Self {
        Faulty {
            operation_timeout: Some(timeout),
            ..self
        }
    }

    /// When each renewal reached the store (on the test's clock).
    pub(crate) fn renewals(&self) -> Vec<Instant> {
        lock(&self.renewals).clone()
    }

    /// How many leases each call to `renew_many` renewed, in order.
    pub(crate) fn batches(&self) -> Vec<usize> {
        lock(&self.batches).clone()
    }

    /// The next renewal panics.
    pub(crate) fn panic_next_renewal(&self) {
        self.panic_renewal.store(true, Ordering::SeqCst);
    }

    /// The next completion panics.
    pub(crate) fn panic_next_completion(&self) {
        self.panic_completion.store(true, Ordering::SeqCst);
    }

    /// Completions fail (an error, as a store that is down answers) while `refused`.
    pub(crate) fn refuse_completions(&self, refused: bool) {
        self.refuse_completions.store(refused, Ordering::SeqCst);
    }
}

impl IdempotencyStore for Faulty {
    async fn claim(&self, request: &ClaimRequest) -> Result<ClaimOutcome, StoreError> {
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
        if self.panic_completion.swap(false, Ordering::SeqCst) {
            panic!("a store bug in complete");
        }
        if self.refuse_completions.load(Ordering::SeqCst) {
            return Err(StoreError::msg("the store refuses completions"));
        }
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
        lock(&self.renewals).push(Instant::now());
        if self.panic_renewal.swap(false, Ordering::SeqCst) {
            panic!("a store bug in renew");
        }
        self.inner.renew(key, lease, lifetime).await
    }

    async fn renew_many(
        &self,
        leases: &[(&RecordKey, LeaseToken)],
        lifetime: Duration,
    ) -> Vec<Result<Fenced, StoreError>> {
        lock(&self.batches).push(leases.len());
        let mut answers = Vec::with_capacity(leases.len());
        for (key, lease) in leases {
            answers.push(self.renew(key, *lease, lifetime).await);
        }
        answers
    }

    async fn release(&self, key: &RecordKey, lease: LeaseToken) -> Result<Fenced, StoreError> {
        self.inner.release(key, lease).await
    }

    async fn purge_expired(&self) -> Result<u64, StoreError> {
        self.inner.purge_expired().await
    }

    async fn lookup(&self, key: &RecordKey) -> Result<Option<RecordInfo>, StoreError> {
        self.inner.lookup(key).await
    }

    async fn delete(&self, key: &RecordKey) -> Result<Deleted, StoreError> {
        self.inner.delete(key).await
    }

    async fn list(&self, subject: &str, request: ListRequest) -> Result<RecordPage, StoreError> {
        self.inner.list(subject, request).await
    }

    async fn count_records(
        &self,
        subject: &str,
        up_to: u64,
    ) -> Result<Option<crate::store::SubjectUsage>, StoreError> {
        self.inner.count_records(subject, up_to).await
    }

    fn counts_records(&self) -> bool {
        true
    }

    fn operation_timeout(&self) -> Option<Duration> {
        self.operation_timeout
    }

    async fn keeper_session(&self) -> Result<Self, StoreError> {
        Ok(self.clone())
    }

    async fn show_presences(
        &self,
        live: &[super::Presence],
        lapse: Duration,
    ) -> Result<(), StoreError> {
        self.inner.show_presences(live, lapse).await
    }
}
