//! Encryption at rest: `EncryptedStore` passes the shared behavioural suite over every store, the
//! raw Postgres rows and Redis hashes hold no plaintext of a recorded answer (the transactional path
//! included), keys rotate, and a record that does not open (its key is gone, or it was altered or
//! moved) is answered `503` without running the handler again.
#![cfg(feature = "encryption")]

use crate::common;
use axum_idempotency::store_suite;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::post;
use axum_idempotency::store::{EncryptedStore, EncryptionKeys, IdempotencyStore, KeyId};
use axum_idempotency::{IdempotencyLayer, MemoryStore, Subject};
use common::{Answer, send};

/// Key material for an id (tests only; real keys come from a secret store).
fn material(id: KeyId) -> [u8; 32] {
    [u8::try_from(id).expect("small id") ^ 0x5a; 32]
}

/// Keys with these ids, the newest first.
fn keys(ids: &[KeyId]) -> EncryptionKeys {
    EncryptionKeys::new(ids.iter().map(|&id| (id, material(id)))).expect("keys")
}

/// The secret of the keyed hashes (tests only).
const SECRET: [u8; 32] = [0x3c; 32];

/// The key as the inner store keeps it, for a request of alice's to `POST path`.
#[cfg(feature = "postgres")]
fn stored_key(key: &str, path: &str) -> String {
    use axum_idempotency::store::RecordKey;
    EncryptedStore::new(MemoryStore::new(), keys(&[1]), SECRET)
        .stored_scope(&RecordKey {
            key: key.into(),
            subject: "alice".into(),
            endpoint: format!("POST {path}"),
        })
        .key
}

/// A string found nowhere else: the personal data of one test.
fn marker() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "PERSONAL-{}-{}",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

#[cfg(any(feature = "postgres", feature = "redis"))]
fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[cfg(feature = "postgres")]
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[derive(Clone, Default)]
struct World {
    runs: Arc<AtomicUsize>,
    /// The schema of the `effects` table the transactional handler writes to.
    #[cfg(feature = "postgres")]
    schema: String,
}

impl World {
    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

/// The answer of a payment: the request body (the marker) in a stored header and in the body.
fn receipt(run: usize, marker: &[u8]) -> Response {
    receipt_with(StatusCode::CREATED, run, marker)
}

fn receipt_with(status: StatusCode, run: usize, marker: &[u8]) -> Response {
    let marker = String::from_utf8_lossy(marker);
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::LOCATION, format!("/receipts/{marker}"))
        .body(Body::from(
            serde_json::json!({ "receipt": marker, "run": run }).to_string(),
        ))
        .expect("valid response")
}

async fn pay(State(world): State<World>, body: Bytes) -> Response {
    let run = world.runs.fetch_add(1, Ordering::SeqCst) + 1;
    receipt(run, &body)
}

/// Writes an effect through the layer's transaction, then answers like [`pay`]; with `x-abort`, a
/// statement of the transaction fails afterwards and it answers `402`, a definitive failure.
#[cfg(feature = "postgres")]
async fn pay_in_transaction(
    State(world): State<World>,
    mut tx: axum_idempotency::IdempotencyTx<sqlx::Postgres>,
    headers: axum::http::HeaderMap,
    body: Bytes,
) -> Response {
    let run = world.runs.fetch_add(1, Ordering::SeqCst) + 1;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {}.effects (run) VALUES ($1)",
        world.schema
    )))
    .bind(i64::try_from(run).expect("small"))
    .execute(tx.conn().await.expect("begin"))
    .await
    .expect("the effect is written");
    if headers.contains_key("x-abort") {
        let failed = sqlx::query("SELECT 1 / 0")
            .execute(tx.conn().await.expect("begun"))
            .await;
        assert!(failed.is_err());
        return receipt_with(StatusCode::PAYMENT_REQUIRED, run, &body);
    }
    receipt(run, &body)
}

async fn auth(mut request: Request, next: Next) -> Response {
    request.extensions_mut().insert(Subject("alice".into()));
    next.run(request).await
}

/// `POST /pay` (and `POST /pay-tx`, transactional, on Postgres) behind `layer`.
fn router<S: IdempotencyStore>(layer: IdempotencyLayer<S>, world: &World) -> Router {
    let routes = Router::new().route("/pay", post(pay));
    #[cfg(feature = "postgres")]
    let routes = routes.route("/pay-tx", post(pay_in_transaction));
    routes
        .route_layer(layer)
        .layer(middleware::from_fn(auth))
        .with_state(world.clone())
}

/// The layer over `store`, bounding subjects' records where the store can count them.
fn layer<S: IdempotencyStore>(store: S) -> IdempotencyLayer<S> {
    let counts = store.counts_records();
    IdempotencyLayer::builder(store)
        .max_records_per_subject(counts.then_some(100_000))
        .build()
        .expect("valid settings")
}

/// The layer over a store with transactions, offering them to handlers.
#[cfg(feature = "postgres")]
fn transactional_layer<S>(store: S) -> IdempotencyLayer<S>
where
    S: axum_idempotency::store::TransactionalStore<
            Transaction = axum_idempotency::sqlx::Transaction<'static, sqlx::Postgres>,
        >,
{
    IdempotencyLayer::builder(store)
        .transactions(true)
        .build()
        .expect("valid settings")
}

async fn pay_with(router: &Router, path: &str, key: &str, marker: &str) -> Answer {
    send(
        router,
        common::post(path)
            .key(key)
            .body(Body::from(marker.to_owned())),
    )
    .await
}

/// The answer carries the marker in its stored header and its body.
fn assert_carries(answer: &Answer, marker: &str) {
    assert_carries_as(answer, marker, StatusCode::CREATED);
}

fn assert_carries_as(answer: &Answer, marker: &str, status: StatusCode) {
    assert_eq!(answer.status, status, "{answer:?}");
    let location = format!("/receipts/{marker}");
    assert_eq!(answer.header("location"), Some(location.as_str()));
    assert_eq!(answer.json()["receipt"], marker);
}

fn assert_unavailable(answer: &Answer) {
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    assert_eq!(answer.problem(), "idempotency_store_unavailable");
}

mod memory {
    use super::*;

    store_suite!(async { EncryptedStore::new(MemoryStore::new(), keys(&[1]), SECRET) });

    /// The whole suite again while records kept in clear are looked for.
    mod records_in_clear {
        use super::*;

        store_suite!(async {
            EncryptedStore::new(MemoryStore::new(), keys(&[1]), SECRET).with_records_in_clear()
        });
    }

    #[tokio::test]
    async fn replays_what_was_sealed_and_a_missing_key_is_503_even_failing_open() {
        let records = MemoryStore::new();
        let world = World::default();
        let old = router(
            layer(EncryptedStore::new(records.clone(), keys(&[1]), SECRET)),
            &world,
        );
        let marker = marker();
        assert_carries(&pay_with(&old, "/pay", "k", &marker).await, &marker);
        let replay = pay_with(&old, "/pay", "k", &marker).await;
        assert!(replay.replayed());
        assert_carries(&replay, &marker);
        let fail_open = IdempotencyLayer::builder(EncryptedStore::new(records, keys(&[2]), SECRET))
            .fail_open(true)
            .build()
            .expect("layer");
        let new = router(fail_open, &world);
        assert_unavailable(&pay_with(&new, "/pay", "k", &marker).await);
        assert_eq!(world.runs(), 1, "the handler never runs twice");
    }
}

#[cfg(feature = "postgres")]
mod postgres {
    use super::*;

    use std::time::Duration;

    use axum_idempotency::store::{CachedStore, PostgresStore};
    use sqlx::postgres::{PgPool, PgPoolOptions};

    fn database_url() -> String {
        crate::common::servers::database_url()
    }

    async fn pool(connections: u32) -> PgPool {
        PgPoolOptions::new()
            .max_connections(connections)
            .acquire_timeout(Duration::from_secs(30))
            .connect(&database_url())
            .await
            .expect("PostgreSQL must be running (see .ci/run)")
    }

    /// A store on a table in a schema of its own (named as the other tests name theirs, so stale
    /// ones are dropped by them), and an `effects` table beside it.
    async fn plain_store(connections: u32) -> (PostgresStore, String) {
        static N: AtomicUsize = AtomicUsize::new(0);
        let pool = pool(connections).await;
        let schema = format!(
            "idem_t_{}_{}_enc{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_secs(),
            std::process::id(),
            N.fetch_add(1, Ordering::SeqCst)
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "CREATE SCHEMA {schema}; CREATE TABLE {schema}.effects (run bigint NOT NULL)"
        )))
        .execute(&pool)
        .await
        .expect("schema");
        let store = PostgresStore::with_table(pool, &format!("{schema}.idempotency_records"))
            .expect("valid table name")
            .with_timeout(crate::common::SUITE_STORE_TIMEOUT);
        store.migrate().await.expect("migrate");
        (store, schema)
    }

    store_suite!(async { EncryptedStore::new(plain_store(34).await.0, keys(&[1]), SECRET) });

    /// The table holds keyed hashes of the key, the subject, the endpoint and the body's
    /// fingerprint (a leaked table cannot be brute-forced for an amount); replays and 422s work as
    /// before; and a record kept in clear (by an earlier version) is found while
    /// `with_records_in_clear` is on.
    #[tokio::test]
    async fn the_table_holds_keyed_hashes_and_records_in_clear_are_found() {
        use axum_idempotency::Fingerprint;
        use axum_idempotency::store::{
            ClaimOutcome, ClaimRequest, Finished, RecordKey, StoredResponse,
        };
        let (plain, _) = plain_store(4).await;
        let request = |key: &str, body: &[u8]| {
            ClaimRequest::new(
                RecordKey {
                    key: key.into(),
                    subject: "alice".into(),
                    endpoint: "POST /pay".into(),
                },
                Fingerprint::of(None, body),
                Duration::from_secs(60),
                Duration::from_secs(600),
            )
        };
        let store = EncryptedStore::new(plain.clone(), keys(&[1]), SECRET);
        let claim = request("new", br#"{"amount":100}"#);
        assert!(matches!(
            store.claim(&claim).await.expect("claim"),
            ClaimOutcome::Claimed { .. }
        ));
        let answer = Arc::new(StoredResponse::new(
            Finished::Completed,
            201,
            Vec::new(),
            Some(Bytes::from_static(b"charged")),
        ));
        let done = store
            .complete(
                &claim.key,
                claim.lease,
                &claim.fingerprint,
                answer,
                claim.retention,
            )
            .await
            .expect("complete");
        assert!(done.is_done());
        let table = plain.table();
        let rows: Vec<(String, String, String, Vec<u8>)> = sqlx::query_as(sqlx::AssertSqlSafe(
            format!("SELECT idempotency_key, subject, endpoint, fingerprint FROM {table}"),
        ))
        .fetch_all(plain.pool())
        .await
        .expect("rows");
        assert_eq!(rows.len(), 1);
        let (key, subject, endpoint, fingerprint) = &rows[0];
        assert_eq!(key, &stored_key("new", "/pay"));
        for hashed in [key, subject, endpoint] {
            assert_eq!(hashed.len(), 64, "{hashed}");
            assert!(!hashed.contains("new") && !hashed.contains("alice") && !hashed.contains('/'));
        }
        assert_ne!(
            fingerprint.as_slice(),
            claim.fingerprint.as_bytes(),
            "no plain SHA-256 of the body in the table"
        );
        assert!(matches!(
            store
                .claim(&request("new", br#"{"amount":100}"#))
                .await
                .expect("claim"),
            ClaimOutcome::Finished(_)
        ));
        assert_eq!(
            store
                .claim(&request("new", br#"{"amount":999}"#))
                .await
                .expect("claim"),
            ClaimOutcome::KeyReuse
        );

        // A record an earlier version kept in clear, still running: found while looked for.
        let running = request("old", br#"{"amount":100}"#);
        assert!(matches!(
            plain.claim(&running).await.expect("claim"),
            ClaimOutcome::Claimed { .. }
        ));
        let looking = store.clone().with_records_in_clear();
        assert_eq!(
            looking
                .claim(&request("old", br#"{"amount":100}"#))
                .await
                .expect("claim"),
            ClaimOutcome::InProgress
        );
        assert_eq!(
            looking
                .claim(&request("old", br#"{"amount":5}"#))
                .await
                .expect("claim"),
            ClaimOutcome::KeyReuse
        );
        assert!(
            looking
                .lookup(&running.key)
                .await
                .expect("lookup")
                .is_some()
        );
        assert!(store.lookup(&running.key).await.expect("lookup").is_none());
    }

    /// One record as it lies in the table.
    struct RawRow {
        status: String,
        response_status: Option<i16>,
        header_names: Option<Vec<String>>,
        header_values: Option<Vec<Vec<u8>>>,
        response_body: Option<Vec<u8>>,
        /// The whole row as PostgreSQL prints it.
        text: String,
    }

    async fn raw_row(store: &PostgresStore, key: &str) -> RawRow {
        let (status, response_status, header_names, header_values, response_body, text) =
            sqlx::query_as::<
                _,
                (
                    String,
                    Option<i16>,
                    Option<Vec<String>>,
                    Option<Vec<Vec<u8>>>,
                    Option<Vec<u8>>,
                    String,
                ),
            >(sqlx::AssertSqlSafe(format!(
                "SELECT status, response_status, header_names, header_values, response_body, \
                            t::text FROM {} t WHERE idempotency_key = $1",
                store.table()
            )))
            .bind(key)
            .fetch_one(store.pool())
            .await
            .expect("the record's row");
        RawRow {
            status,
            response_status,
            header_names,
            header_values,
            response_body,
            text,
        }
    }

    /// The marker is nowhere in the row: not in a column's bytes, not in the row's text.
    fn assert_sealed(row: &RawRow, marker: &str) {
        assert_sealed_as(row, marker, "completed", 201);
    }

    fn assert_sealed_as(row: &RawRow, marker: &str, status: &str, code: i16) {
        assert_eq!(row.status, status);
        assert_eq!(row.response_status, Some(code));
        assert_eq!(
            row.header_names.as_deref(),
            Some(&[][..]),
            "no header in clear"
        );
        assert_eq!(
            row.header_values.as_deref(),
            Some(&[][..]),
            "no header in clear"
        );
        let body = row.response_body.as_deref().expect("the sealed response");
        assert_eq!(body[0], 2, "format byte (2: the fingerprint bound)");
        assert!(!contains(body, marker.as_bytes()));
        assert!(!contains(body, b"/receipts/"));
        assert!(!contains(body, b"application/json"));
        assert!(!row.text.contains(marker), "{}", row.text);
        assert!(!row.text.contains(&hex(marker.as_bytes())), "{}", row.text);
        assert!(
            !row.text.contains(&hex(b"application/json")),
            "{}",
            row.text
        );
    }

    fn key_id_of(row: &RawRow) -> KeyId {
        let body = row.response_body.as_deref().expect("the sealed response");
        KeyId::from_be_bytes(body[2..6].try_into().expect("4 bytes"))
    }

    /// Without scope columns, a row holds nothing of the key, the subject or the endpoint; the
    /// key still replays and another body is still `422`.
    #[tokio::test]
    async fn without_scope_columns_rows_hold_no_key_subject_or_endpoint() {
        let (plain, schema) = plain_store(8).await;
        let world = World {
            schema,
            ..World::default()
        };
        let store = EncryptedStore::new(plain.clone().without_scope_columns(), keys(&[1]), SECRET);
        let app = router(layer(store), &world);
        let marker = marker();
        let key = format!("order-key-{marker}");
        assert_carries(&pay_with(&app, "/pay", &key, &marker).await, &marker);
        let replay = pay_with(&app, "/pay", &key, &marker).await;
        assert!(replay.replayed());
        assert_carries(&replay, &marker);
        let other = pay_with(&app, "/pay", &key, "another body").await;
        assert_eq!(other.status, StatusCode::UNPROCESSABLE_ENTITY, "{other:?}");
        assert_eq!(world.runs(), 1);
        let table = plain.table();
        let rows: Vec<(String, String, String, String)> = sqlx::query_as(sqlx::AssertSqlSafe(
            format!("SELECT idempotency_key, subject, endpoint, r::text FROM {table} r"),
        ))
        .fetch_all(plain.pool())
        .await
        .expect("rows");
        assert_eq!(rows.len(), 1);
        let (k, subject, endpoint, text) = &rows[0];
        assert_eq!(
            (k.as_str(), subject.as_str(), endpoint.as_str()),
            ("", "", "")
        );
        assert!(!text.contains(&key) && !text.contains("/pay"), "{text}");
    }

    #[tokio::test]
    async fn rows_hold_no_plaintext_and_replays_still_carry_it() {
        let (plain, schema) = plain_store(8).await;
        let world = World {
            schema,
            ..World::default()
        };
        let store = EncryptedStore::new(plain.clone(), keys(&[1]), SECRET);
        let app = router(layer(store.clone()), &world);
        let marker = marker();
        assert_carries(&pay_with(&app, "/pay", "k", &marker).await, &marker);
        let row = raw_row(&plain, &stored_key("k", "/pay")).await;
        assert_sealed(&row, &marker);
        assert_eq!(key_id_of(&row), 1);
        let replay = pay_with(&app, "/pay", "k", &marker).await;
        assert!(replay.replayed());
        assert_carries(&replay, &marker);

        // Recorded without its body (over the recording limit): the headers are still sealed.
        let small = IdempotencyLayer::builder(store)
            .response_limit(16)
            .build()
            .expect("layer");
        let app = router(small, &world);
        let marker = super::marker();
        assert_carries(&pay_with(&app, "/pay", "big", &marker).await, &marker);
        let row = raw_row(&plain, &stored_key("big", "/pay")).await;
        assert_sealed(&row, &marker);
        assert_eq!(
            row.response_body.as_deref().map(|b| b[1]),
            Some(1),
            "omitted flag"
        );
        let replay = pay_with(&app, "/pay", "big", &marker).await;
        assert!(replay.replayed());
        assert_eq!(replay.header("idempotency-replay"), Some("omitted"));
        let location = format!("/receipts/{marker}");
        assert_eq!(replay.header("location"), Some(location.as_str()));
        assert!(replay.body.is_empty());
        assert_eq!(world.runs(), 2);
    }

    /// A transactional answer through the store `wrap` makes of the plain one: the effect commits
    /// with a sealed record, and the replay carries the answer.
    async fn transactional_path_stores_no_plaintext<S>(wrap: impl FnOnce(PostgresStore) -> S)
    where
        S: axum_idempotency::store::TransactionalStore<
                Transaction = axum_idempotency::sqlx::Transaction<'static, sqlx::Postgres>,
            >,
    {
        let (plain, schema) = plain_store(8).await;
        let world = World {
            schema: schema.clone(),
            ..World::default()
        };
        let app = router(transactional_layer(wrap(plain.clone())), &world);
        let marker = marker();
        assert_carries(&pay_with(&app, "/pay-tx", "k", &marker).await, &marker);
        let (effects,): (i64,) = sqlx::query_as(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {schema}.effects"
        )))
        .fetch_one(plain.pool())
        .await
        .expect("count");
        assert_eq!(effects, 1, "the effect committed with its record");
        assert_sealed(&raw_row(&plain, &stored_key("k", "/pay-tx")).await, &marker);
        let replay = pay_with(&app, "/pay-tx", "k", &marker).await;
        assert!(replay.replayed());
        assert_carries(&replay, &marker);
        assert_eq!(world.runs(), 1);
    }

    #[tokio::test]
    async fn the_transactional_path_stores_no_plaintext() {
        transactional_path_stores_no_plaintext(|pg| EncryptedStore::new(pg, keys(&[1]), SECRET))
            .await;
    }

    #[tokio::test]
    async fn the_transactional_path_stores_no_plaintext_behind_a_cache() {
        transactional_path_stores_no_plaintext(|pg| {
            CachedStore::new(EncryptedStore::new(pg, keys(&[1]), SECRET))
        })
        .await;
    }

    #[tokio::test]
    async fn the_transactional_path_stores_no_plaintext_over_a_cache() {
        transactional_path_stores_no_plaintext(|pg| {
            EncryptedStore::new(CachedStore::new(pg), keys(&[1]), SECRET)
        })
        .await;
    }

    /// A handler whose transaction failed and that answered a definitive failure: nothing of the
    /// transaction commits, and its answer is recorded on its own, sealed too.
    #[tokio::test]
    async fn a_failure_recorded_outside_its_failed_transaction_is_sealed() {
        let (plain, schema) = plain_store(8).await;
        let world = World {
            schema,
            ..World::default()
        };
        let app = router(
            transactional_layer(EncryptedStore::new(plain.clone(), keys(&[1]), SECRET)),
            &world,
        );
        let marker = marker();
        let pay = || {
            common::post("/pay-tx")
                .key("k")
                .header("x-abort", "1")
                .body(Body::from(marker.clone()))
        };
        let answer = send(&app, pay()).await;
        assert_carries_as(&answer, &marker, StatusCode::PAYMENT_REQUIRED);
        let mut row = raw_row(&plain, &stored_key("k", "/pay-tx")).await;
        for _ in 0..100 {
            if row.status != "in_progress" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
            row = raw_row(&plain, &stored_key("k", "/pay-tx")).await;
        }
        assert_sealed_as(&row, &marker, "failed", 402);
        let replay = send(&app, pay()).await;
        assert!(replay.replayed());
        assert_carries_as(&replay, &marker, StatusCode::PAYMENT_REQUIRED);
        assert_eq!(world.runs(), 1);
    }

    #[tokio::test]
    async fn keys_rotate_and_a_record_whose_key_is_gone_is_503() {
        let (plain, schema) = plain_store(8).await;
        let world = World {
            schema,
            ..World::default()
        };
        let before = router(
            layer(EncryptedStore::new(plain.clone(), keys(&[1]), SECRET)),
            &world,
        );
        let old = marker();
        assert_carries(&pay_with(&before, "/pay", "old", &old).await, &old);
        assert_eq!(
            key_id_of(&raw_row(&plain, &stored_key("old", "/pay")).await),
            1
        );

        // Key 2 is the newest, key 1 still configured: the old record opens, new ones use key 2.
        let rotated = router(
            layer(EncryptedStore::new(plain.clone(), keys(&[2, 1]), SECRET)),
            &world,
        );
        let replay = pay_with(&rotated, "/pay", "old", &old).await;
        assert!(replay.replayed());
        assert_carries(&replay, &old);
        let new = marker();
        assert_carries(&pay_with(&rotated, "/pay", "new", &new).await, &new);
        let row = raw_row(&plain, &stored_key("new", "/pay")).await;
        assert_eq!(key_id_of(&row), 2);
        assert_sealed(&row, &new);
        assert_eq!(world.runs(), 2);

        // Key 1 dropped: the old record is unreadable, 503, and the handler does not run.
        let only_new = router(
            layer(EncryptedStore::new(plain.clone(), keys(&[2]), SECRET)),
            &world,
        );
        assert_unavailable(&pay_with(&only_new, "/pay", "old", &old).await);
        assert!(pay_with(&only_new, "/pay", "new", &new).await.replayed());
        assert_eq!(world.runs(), 2);
        // Still unreadable (not released, not retaken) on the next try.
        assert_unavailable(&pay_with(&only_new, "/pay", "old", &old).await);
        assert_eq!(
            raw_row(&plain, &stored_key("old", "/pay")).await.status,
            "completed"
        );
        assert_eq!(world.runs(), 2);
    }

    #[tokio::test]
    async fn an_altered_or_moved_ciphertext_is_503_and_runs_nothing() {
        let (plain, schema) = plain_store(8).await;
        let world = World {
            schema,
            ..World::default()
        };
        let app = router(
            transactional_layer(EncryptedStore::new(plain.clone(), keys(&[1]), SECRET)),
            &world,
        );
        let markers: Vec<String> = (0..4).map(|_| marker()).collect();
        for (i, marker) in markers.iter().enumerate() {
            let key = format!("k{i}");
            assert_carries(&pay_with(&app, "/pay", &key, marker).await, marker);
        }
        let table = plain.table().to_owned();
        let k = |key: &str| stored_key(key, "/pay");
        let edit = |sql: String| {
            let pool = plain.pool().clone();
            async move {
                let done = sqlx::query(sqlx::AssertSqlSafe(sql))
                    .execute(&pool)
                    .await
                    .expect("edit the row");
                assert_eq!(done.rows_affected(), 1);
            }
        };
        // k0: one bit of the ciphertext flipped.
        edit(format!(
            "UPDATE {table} SET response_body = set_byte(response_body, length(response_body) - 20, \
               get_byte(response_body, length(response_body) - 20) # 1) WHERE idempotency_key = '{}'",
            k("k0")
        ))
        .await;
        // k1: holds k2's ciphertext (same status and outcome).
        edit(format!(
            "UPDATE {table} SET response_body = \
               (SELECT response_body FROM {table} WHERE idempotency_key = '{}') \
             WHERE idempotency_key = '{}'",
            k("k2"),
            k("k1")
        ))
        .await;
        // k3: its status edited.
        edit(format!(
            "UPDATE {table} SET response_status = 200 WHERE idempotency_key = '{}'",
            k("k3")
        ))
        .await;
        for (i, marker) in markers.iter().enumerate() {
            let key = format!("k{i}");
            let answer = pay_with(&app, "/pay", &key, marker).await;
            if i == 2 {
                assert!(answer.replayed(), "the record left alone still replays");
                assert_carries(&answer, marker);
            } else {
                assert_unavailable(&answer);
                assert!(!contains(&answer.body, marker.as_bytes()));
            }
        }
        assert_eq!(world.runs(), 4, "no handler ran again");

        // An older genuine answer of the same scope, moved onto the record that a later request
        // made there (the key reused after its retention): bound to the older request's
        // fingerprint, it does not open for the later one.
        let older = marker();
        assert_carries(&pay_with(&app, "/pay", "reused", &older).await, &older);
        let saved: Vec<u8> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT response_body FROM {table} WHERE idempotency_key = '{}'",
            k("reused")
        )))
        .fetch_one(plain.pool())
        .await
        .expect("read the older answer");
        edit(format!(
            "DELETE FROM {table} WHERE idempotency_key = '{}'",
            k("reused")
        ))
        .await;
        let later = marker();
        assert_carries(&pay_with(&app, "/pay", "reused", &later).await, &later);
        let done = sqlx::query(sqlx::AssertSqlSafe(format!(
            "UPDATE {table} SET response_body = $1 WHERE idempotency_key = '{}'",
            k("reused")
        )))
        .bind(saved)
        .execute(plain.pool())
        .await
        .expect("move the older answer");
        assert_eq!(done.rows_affected(), 1);
        let answer = pay_with(&app, "/pay", "reused", &later).await;
        assert_unavailable(&answer);
        assert!(!contains(&answer.body, older.as_bytes()));
        assert_eq!(world.runs(), 6, "no handler ran again");

        // A record written without encryption (in clear) is unreadable too while records in
        // clear are looked for, never replayed as it is.
        let unencrypted = router(layer(plain.clone()), &world);
        let marker = marker();
        assert_carries(
            &pay_with(&unencrypted, "/pay", "plain", &marker).await,
            &marker,
        );
        let looking = router(
            layer(EncryptedStore::new(plain.clone(), keys(&[1]), SECRET).with_records_in_clear()),
            &world,
        );
        assert_unavailable(&pay_with(&looking, "/pay", "plain", &marker).await);
        assert_eq!(world.runs(), 7);
    }
}

#[cfg(feature = "redis")]
mod redis_store {
    use super::*;

    use axum_idempotency::store::RedisStore;

    fn client() -> redis::Client {
        let url = crate::common::servers::redis_url();
        redis::Client::open(url).expect("REDIS_URL")
    }

    fn prefix() -> String {
        static N: AtomicUsize = AtomicUsize::new(0);
        format!(
            "idem_test:enc:{}:{}:{}:",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_nanos(),
            N.fetch_add(1, Ordering::SeqCst)
        )
    }

    fn plain_store(prefix: &str) -> RedisStore {
        RedisStore::new(client())
            .expect("store")
            .with_prefix(prefix)
            .with_timeout(crate::common::SUITE_STORE_TIMEOUT)
    }

    store_suite!(
        async { EncryptedStore::new(plain_store(&prefix()), keys(&[1]), SECRET) },
        purged = 0
    );

    #[tokio::test]
    async fn hashes_hold_no_plaintext_and_replays_still_carry_it() {
        let prefix = prefix();
        let world = World::default();
        let app = router(
            layer(EncryptedStore::new(
                plain_store(&prefix),
                keys(&[1]),
                SECRET,
            )),
            &world,
        );
        let marker = marker();
        assert_carries(&pay_with(&app, "/pay", "k", &marker).await, &marker);

        let mut connection = client()
            .get_multiplexed_async_connection()
            .await
            .expect("Redis must be running (see .ci/run)");
        let names: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{prefix}*"))
            .query_async(&mut connection)
            .await
            .expect("keys");
        // The record, its subject's listing index (digests only, no response in it) and its
        // subject's account of bytes (numbers only); and, while the store probes its server, a
        // probe's key shaped as an index's or an account's (a number).
        let (index, account) = (format!("{prefix}subject:"), format!("{prefix}bytes:"));
        // Every name is a hash: the subject's index and account too.
        for name in &names {
            assert!(!name.contains("alice") && !name.contains("pay"), "{name}");
        }
        let names: Vec<String> = names
            .into_iter()
            .filter(|n| !n.starts_with(&index) && !n.starts_with(&account))
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        let fields: Vec<Vec<u8>> = redis::cmd("HGETALL")
            .arg(&names[0])
            .query_async(&mut connection)
            .await
            .expect("the record's hash");
        assert!(
            fields.iter().any(|f| f.as_slice() == b"resp"),
            "a recorded answer"
        );
        for field in &fields {
            assert!(!contains(field, marker.as_bytes()));
            assert!(!contains(field, b"/receipts/"));
            assert!(!contains(field, b"application/json"));
        }
        let dump: Vec<u8> = redis::cmd("DUMP")
            .arg(&names[0])
            .query_async(&mut connection)
            .await
            .expect("dump");
        assert!(!contains(&dump, marker.as_bytes()));

        let replay = pay_with(&app, "/pay", "k", &marker).await;
        assert!(replay.replayed());
        assert_carries(&replay, &marker);
        assert_eq!(world.runs(), 1);
    }
}
