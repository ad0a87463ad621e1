//! Every wrapper store of the crate passes on what its inner store does in the provided methods:
//! a provided method left to its default drops it silently (two bugs came from that).

use crate::record::Fenced;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use super::{IdempotencyStore, MemoryStore, StoreError};
use crate::Fingerprint;
use crate::record::{ClaimOutcome, ClaimRequest, LeaseToken, RecordKey, StoredResponse};

const TIMEOUT: Duration = Duration::from_millis(777);

/// A store that notes every provided method called on it.
#[derive(Clone)]
struct Probe {
    inner: MemoryStore,
    settled: Arc<AtomicUsize>,
    prepared: Arc<AtomicUsize>,
    #[cfg(feature = "postgres")]
    postgres: super::PostgresStore,
}

impl IdempotencyStore for Probe {
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
    fn operation_timeout(&self) -> Option<Duration> {
        Some(TIMEOUT)
    }
    fn settled_elsewhere(&self, _: &RecordKey, _: LeaseToken) {
        self.settled.fetch_add(1, Ordering::SeqCst);
    }
    #[cfg(feature = "postgres")]
    fn postgres(&self) -> Option<&super::PostgresStore> {
        Some(&self.postgres)
    }
    #[cfg(feature = "postgres")]
    fn prepare_response(
        &self,
        _: &RecordKey,
        _: &Fingerprint,
        response: Arc<StoredResponse>,
    ) -> Result<Arc<StoredResponse>, StoreError> {
        self.prepared.fetch_add(1, Ordering::SeqCst);
        Ok(response)
    }
}

fn probe() -> Probe {
    Probe {
        inner: MemoryStore::new(),
        settled: Arc::default(),
        prepared: Arc::default(),
        #[cfg(feature = "postgres")]
        postgres: super::PostgresStore::new(
            sqlx::postgres::PgPoolOptions::new().connect_lazy_with(Default::default()),
        ),
    }
}

/// Calls every provided method of `wrapper` once and checks that each reached `probe`.
fn passes_on<W: IdempotencyStore>(name: &str, wrapper: &W, probe: &Probe) {
    let key = RecordKey {
        key: "k".into(),
        subject: "alice".into(),
        endpoint: "POST /pay".into(),
    };
    assert_eq!(
        wrapper.operation_timeout(),
        Some(TIMEOUT),
        "{name}: operation_timeout"
    );
    let settled = probe.settled.load(Ordering::SeqCst);
    wrapper.settled_elsewhere(&key, LeaseToken(7));
    assert_eq!(
        probe.settled.load(Ordering::SeqCst),
        settled + 1,
        "{name}: settled_elsewhere"
    );
    #[cfg(feature = "postgres")]
    {
        assert!(wrapper.postgres().is_some(), "{name}: postgres()");
        let prepared = probe.prepared.load(Ordering::SeqCst);
        let response = Arc::new(StoredResponse {
            outcome: crate::Finished::Completed,
            status: 201,
            headers: Vec::new(),
            body: bytes::Bytes::from_static(b"{}"),
            body_omitted: false,
            expires_in: None,
        });
        wrapper
            .prepare_response(&key, &Fingerprint::of(None, b"{}"), response)
            .expect("prepare");
        assert_eq!(
            probe.prepared.load(Ordering::SeqCst),
            prepared + 1,
            "{name}: prepare_response"
        );
    }
}

#[tokio::test]
async fn every_wrapper_passes_on_the_provided_methods() {
    let p = probe();
    passes_on("CachedStore", &super::CachedStore::new(p.clone()), &p);
    passes_on("metrics", &crate::metrics::store(p.clone()), &p);
    passes_on(
        "CachedStore over metrics",
        &super::CachedStore::new(crate::metrics::store(p.clone())),
        &p,
    );
    #[cfg(feature = "encryption")]
    {
        let keys = || super::EncryptionKeys::single(1, [3; 32]);
        passes_on(
            "EncryptedStore",
            &super::EncryptedStore::new(p.clone(), keys()),
            &p,
        );
        passes_on(
            "EncryptedStore with keyed fingerprints",
            &super::EncryptedStore::new(p.clone(), keys()).with_fingerprint_secret([4; 32]),
            &p,
        );
        passes_on(
            "CachedStore over EncryptedStore",
            &super::CachedStore::new(super::EncryptedStore::new(p.clone(), keys())),
            &p,
        );
        passes_on(
            "EncryptedStore over CachedStore",
            &super::EncryptedStore::new(super::CachedStore::new(p.clone()), keys()),
            &p,
        );
    }
    #[cfg(feature = "test-suite")]
    passes_on(
        "conformance Counting",
        &crate::conformance::cache::Counting::new(p.clone()),
        &p,
    );
}
