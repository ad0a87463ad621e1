//! Every wrapper store of the crate (the public ones, and the layer's own: metrics, coalescing)
//! passes on its inner store's capabilities: the operation timeout, the transactional store and
//! the response transforms.

use crate::record::Fenced;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use crate::Fingerprint;
use crate::record::{ClaimOutcome, ClaimRequest, LeaseToken, RecordKey, StoredResponse};
use crate::store::{Capabilities, IdempotencyStore, MemoryStore, ResponseTransform, StoreError};

const TIMEOUT: Duration = Duration::from_millis(777);

/// A store with every capability, noting each use of them.
#[derive(Clone)]
struct Probe {
    inner: MemoryStore,
    prepared: Arc<AtomicUsize>,
    /// The fingerprint the last transform received.
    handed: Arc<std::sync::Mutex<Option<Fingerprint>>>,
    #[cfg(feature = "postgres")]
    postgres: crate::store::PostgresStore,
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
        let capabilities = Capabilities::none()
            .with_operation_timeout(TIMEOUT)
            .transformed_by(self);
        #[cfg(feature = "postgres")]
        let capabilities = capabilities.with_postgres(&self.postgres);
        capabilities
    }
}

impl ResponseTransform for Probe {
    fn transform(
        &self,
        _: &RecordKey,
        fingerprint: &mut Fingerprint,
        response: Arc<StoredResponse>,
    ) -> Result<Arc<StoredResponse>, StoreError> {
        self.prepared.fetch_add(1, Ordering::SeqCst);
        *crate::lock::lock(&self.handed) = Some(*fingerprint);
        Ok(response)
    }
}

fn probe() -> Probe {
    Probe {
        inner: MemoryStore::new(),
        prepared: Arc::default(),
        handed: Arc::default(),
        #[cfg(feature = "postgres")]
        postgres: crate::store::PostgresStore::new(
            sqlx::postgres::PgPoolOptions::new().connect_lazy_with(Default::default()),
        ),
    }
}

/// Uses every capability of `wrapper` once and checks that each reached `probe`.
fn passes_on<W: IdempotencyStore>(name: &str, wrapper: &W, probe: &Probe) {
    let key = RecordKey {
        key: "k".into(),
        subject: "alice".into(),
        endpoint: "POST /pay".into(),
    };
    let capabilities = wrapper.capabilities();
    assert_eq!(
        capabilities.operation_timeout(),
        Some(TIMEOUT),
        "{name}: operation timeout"
    );
    let prepared = probe.prepared.load(Ordering::SeqCst);
    let response = Arc::new(StoredResponse {
        outcome: crate::Finished::Completed,
        status: 201,
        headers: Vec::new(),
        body: bytes::Bytes::from_static(b"{}"),
        body_omitted: false,
        expires_in: None,
    });
    capabilities
        .transform(&key, &Fingerprint::of(None, b"{}"), response)
        .expect("transform");
    assert_eq!(
        probe.prepared.load(Ordering::SeqCst),
        prepared + 1,
        "{name}: response transforms"
    );
    #[cfg(feature = "postgres")]
    assert!(capabilities.postgres().is_some(), "{name}: postgres");
}

#[tokio::test]
async fn every_wrapper_passes_on_its_inner_stores_capabilities() {
    let p = probe();
    passes_on(
        "CachedStore",
        &crate::store::CachedStore::new(p.clone()),
        &p,
    );
    passes_on("metrics", &crate::metrics::store(p.clone()), &p);
    passes_on(
        "the layer's coalescing",
        &crate::coalesce::Coalesced::new(crate::metrics::store(p.clone()), Arc::default()),
        &p,
    );
    passes_on(
        "CachedStore over metrics",
        &crate::store::CachedStore::new(crate::metrics::store(p.clone())),
        &p,
    );
    #[cfg(feature = "encryption")]
    {
        let keys = || crate::store::EncryptionKeys::single(1, [3; 32]);
        let plain = Fingerprint::of(None, b"{}");
        passes_on(
            "EncryptedStore",
            &crate::store::EncryptedStore::new(p.clone(), keys()),
            &p,
        );
        assert_eq!(
            *crate::lock::lock(&p.handed),
            Some(plain),
            "the claim's fingerprint"
        );
        passes_on(
            "EncryptedStore with keyed fingerprints",
            &crate::store::EncryptedStore::new(p.clone(), keys()).with_fingerprint_secret([4; 32]),
            &p,
        );
        let handed = *crate::lock::lock(&p.handed);
        assert!(
            handed.is_some() && handed != Some(plain),
            "the inner store's transform gets the keyed fingerprint, as its complete does"
        );
        passes_on(
            "CachedStore over EncryptedStore",
            &crate::store::CachedStore::new(crate::store::EncryptedStore::new(p.clone(), keys())),
            &p,
        );
        passes_on(
            "EncryptedStore over CachedStore",
            &crate::store::EncryptedStore::new(crate::store::CachedStore::new(p.clone()), keys()),
            &p,
        );
    }
    #[cfg(feature = "test-suite")]
    passes_on(
        "conformance Counting",
        &crate::conformance::app::Counting::new(p.clone()),
        &p,
    );
}
