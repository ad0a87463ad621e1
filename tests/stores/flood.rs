//! Sixteen subjects flood each store for `FLOOD_SECS` seconds (20 by default) while a seventeenth
//! is served every checkout (SPEC 25; `conformance::tenants`): here the memory store and Redis, the
//! SQL backends in `sql_backends`.

use axum_idempotency::conformance::tenants::a_flood_of_sixteen_subjects_shuts_out_no_other as flood;
use axum_idempotency::store::MemoryStore;

use crate::sql_backends::{DEPLOYED_TIMEOUT, flood_secs as secs};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory() {
    // Small enough for the flood to reach it: no group of subjects fills it for the others.
    flood(MemoryStore::with_capacity(4 * 1024 * 1024), secs()).await;
}

#[cfg(feature = "redis")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis() {
    flood(
        crate::redis_store::store()
            .await
            .with_timeout(DEPLOYED_TIMEOUT),
        secs(),
    )
    .await;
}

/// One subject's large answers are held to its share of bytes on every store (SPEC 25).
mod bytes {
    use axum_idempotency::conformance::tenants::a_subject_past_its_share_of_bytes_is_refused_new_keys_only as bytes_share;
    use axum_idempotency::store::MemoryStore;

    #[tokio::test]
    async fn memory() {
        bytes_share(MemoryStore::new()).await;
    }

    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn redis() {
        bytes_share(crate::redis_store::store().await).await;
    }

    #[cfg(feature = "redis")]
    #[tokio::test]
    async fn redis_cluster() {
        bytes_share(crate::redis_cluster::store().await).await;
    }
}
