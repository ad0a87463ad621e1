//! A claim that meets a row or a file locked by another transaction (SPEC 24): a duplicate of a
//! request whose handler's transaction holds its record, completed and not yet committed, is in
//! progress (`409`), neither an error nor a reason to run unguarded under `fail_open`; once the
//! transaction commits, it is the replay. A claim that could not write for a lock held elsewhere
//! is refused (`503`), never run unguarded either.

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use axum::http::StatusCode;
use axum_idempotency::store::{
    ClaimOutcome, ClaimRequest, Finished, IdempotencyStore, LeaseToken, StoredResponse,
    TransactionalStore,
};
use axum_idempotency::{Fingerprint, IdempotencyLayer};
use common::{app, post, send};

fn stored() -> Arc<StoredResponse> {
    Arc::new(StoredResponse::new(
        Finished::Completed,
        201,
        Vec::new(),
        Some(axum::body::Bytes::from_static(b"{\"id\":1}")),
    ))
}

/// The record of `first` completed in a transaction left open, as a handler's whose commit is
/// slow: duplicates of it, at the store and through a layer that fails open, are in progress,
/// and its replay once the transaction commits. `first` is the claim the layer makes of
/// `POST /pay` by alice with its key and no body.
pub(crate) async fn a_duplicate_meeting_a_slow_commit_is_in_progress<S: TransactionalStore>(
    store: S,
    first: ClaimRequest,
) {
    let ClaimOutcome::Claimed { lease, .. } = store.claim(&first).await.expect("claim") else {
        panic!("the first claim wins");
    };
    let mut tx = store.begin(Duration::from_secs(30)).await.expect("begin");
    assert!(
        store
            .complete_in(
                &mut tx,
                &first.key,
                lease,
                &first.fingerprint,
                stored(),
                first.retention,
                &[],
            )
            .await
            .expect("complete in the transaction")
            .is_done()
    );
    let duplicate = ClaimRequest {
        lease: LeaseToken::generate(),
        ..first.clone()
    };
    let answer = store.claim(&duplicate).await;
    assert!(
        matches!(answer, Ok(ClaimOutcome::InProgress)),
        "a duplicate meeting the locked row: {answer:?}"
    );
    let layer = IdempotencyLayer::builder(store.clone())
        .fail_open(true)
        .build()
        .expect("layer");
    let (router, runs) = app(layer);
    let request = || post("/pay").key(&first.key.key).user("alice");
    let through = send(&router, request()).await;
    assert_eq!(
        through.status,
        StatusCode::CONFLICT,
        "in progress, never run unguarded: {through:?}"
    );
    assert_eq!(runs.started(), 0, "the handler never ran unguarded");
    store.commit(tx).await.expect("commit");
    assert!(matches!(
        store.claim(&duplicate).await.expect("claim"),
        ClaimOutcome::Finished(_)
    ));
    let replay = send(&router, request()).await;
    assert!(replay.replayed(), "{replay:?}");
    assert_eq!(runs.started(), 0);
}

#[cfg(feature = "sqlite")]
mod sqlite {
    use super::*;
    use axum_idempotency::store::SqliteStore;
    use sqlx::Connection;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqlitePoolOptions};

    /// Another writer holds the file's lock past the busy timeout: a claim that must write (a
    /// fresh key; a released record) wrote nothing, and is refused or in progress, never run
    /// unguarded under `fail_open`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_claim_that_cannot_write_is_never_run_unguarded() {
        let path = common::sqlite::fresh_path();
        let options = SqliteStore::connect_options(SqliteConnectOptions::new().filename(&path))
            .busy_timeout(Duration::from_millis(200));
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options.clone())
            .await
            .expect("open");
        let store = SqliteStore::new(pool).with_timeout(Duration::from_secs(1));
        store.migrate().await.expect("migrate");
        // A record released for another try: the next claim must write to take it.
        let mut released = crate::sqlite::claim_request("released", b"");
        released.fingerprint = Fingerprint::of(None, b"");
        let ClaimOutcome::Claimed { lease, .. } = store.claim(&released).await.expect("claim")
        else {
            panic!("claimed");
        };
        assert!(
            store
                .release(&released.key, lease)
                .await
                .expect("release")
                .is_done()
        );
        let layer = IdempotencyLayer::builder(store)
            .fail_open(true)
            .build()
            .expect("layer");
        let (router, runs) = app(layer);
        let mut writer = SqliteConnection::connect_with(&options)
            .await
            .expect("open");
        sqlx::raw_sql("BEGIN IMMEDIATE")
            .execute(&mut writer)
            .await
            .expect("take the write lock");
        let fresh = send(&router, post("/pay").key("fresh").user("alice")).await;
        assert_eq!(fresh.status, StatusCode::SERVICE_UNAVAILABLE, "{fresh:?}");
        let retry = send(&router, post("/pay").key("released").user("alice")).await;
        assert_eq!(retry.status, StatusCode::CONFLICT, "{retry:?}");
        assert_eq!(runs.started(), 0, "nothing ran unguarded");
        sqlx::raw_sql("ROLLBACK")
            .execute(&mut writer)
            .await
            .expect("give the lock back");
        let served = send(&router, post("/pay").key("fresh").user("alice")).await;
        assert_eq!(served.status, StatusCode::CREATED);
        assert_eq!(runs.started(), 1);
    }
}
