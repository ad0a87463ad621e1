//! The MySQL store under load (feature `mysql`; `MYSQL_URL`, default
//! `mysql://root@127.0.0.1:3306/test`): fresh keys and replays through the layer, against the same
//! statements (the store's claim, and its completion for a fresh key) issued by a bare handler
//! without the layer, the floor.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::HeaderValue;
use axum::middleware;
use axum::response::Response;
use axum::routing::post;
use axum_idempotency::Fingerprint;
use axum_idempotency::store::{
    ClaimOutcome, ClaimRequest, Finished, IdempotencyStore, MySqlStore, RecordKey, StoredResponse,
};
use http_body_util::BodyExt;
use sqlx::mysql::MySqlPoolOptions;

use super::support::created;
use super::{MakeRequest, auth, fresh_keys, guarded, load, paired, row, scale, serve, table};

/// The floor: a handler that sends the store's claim itself and, for a fresh key, its completion;
/// a replay's claim answers the record, and the handler answers without running anything.
fn direct(store: MySqlStore) -> Router {
    async fn handler(State(store): State<MySqlStore>, request: Request) -> Response {
        let (parts, body) = request.into_parts();
        let header = |name: &str| parts.headers[name].to_str().unwrap_or_default().to_owned();
        let body = body.collect().await.expect("body").to_bytes();
        let claim = ClaimRequest::new(
            RecordKey {
                key: header("idempotency-key"),
                subject: header("authorization"),
                endpoint: "POST /checkout".into(),
            },
            Fingerprint::of(None, &body),
            Duration::from_secs(90),
            Duration::from_secs(86_400),
        );
        match store.claim(&claim).await.expect("claim") {
            ClaimOutcome::Claimed { lease, .. } => {
                let response = StoredResponse::new(
                    Finished::Completed,
                    201,
                    vec![
                        (
                            http::header::CONTENT_TYPE,
                            HeaderValue::from_static("application/json"),
                        ),
                        (
                            http::header::LOCATION,
                            HeaderValue::from_static("/charges/1"),
                        ),
                    ],
                    Some(axum::body::Bytes::from_static(
                        br#"{"id":1,"status":"succeeded"}"#,
                    )),
                );
                let done = store
                    .complete(
                        &claim.key,
                        lease,
                        &claim.fingerprint,
                        Arc::new(response),
                        claim.retention,
                    )
                    .await
                    .expect("complete");
                assert!(done.is_done(), "the bench's own claim completes");
            }
            ClaimOutcome::Finished(_) => {}
            other => panic!("fresh keys and replays only: {other:?}"),
        }
        created(body).await
    }
    Router::new()
        .route("/checkout", post(handler))
        .layer(middleware::from_fn(auth))
        .with_state(store)
}

/// Fresh keys, then replays, through the layer on the MySQL store against the floor.
pub(crate) async fn mysql_vs_direct_sql() {
    const CONCURRENCY: usize = 16;
    let url = std::env::var("MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let pool = MySqlPoolOptions::new()
        .max_connections(CONCURRENCY as u32)
        .min_connections(CONCURRENCY as u32)
        .connect(&url)
        .await
        .expect("MySQL must be running");
    let table_name = format!("idem_bench_{}", std::process::id());
    let drop = format!("DROP TABLE IF EXISTS `{table_name}`");
    sqlx::raw_sql(sqlx::AssertSqlSafe(drop.clone()))
        .execute(&pool)
        .await
        .expect("drop");
    let store = MySqlStore::with_table(pool.clone(), &table_name).expect("table");
    store.migrate().await.expect("migrate");
    let n = scale(6_000);
    let direct_addr = serve(direct(store.clone())).await;
    let layer_addr = serve(guarded(store.clone())).await;
    load(direct_addr, CONCURRENCY, 500, fresh_keys("warm-d")).await;
    load(layer_addr, CONCURRENCY, 500, fresh_keys("warm-l")).await;

    println!(
        "\n### Layer + MySQL store vs the same statements issued by the handler (floor) ({CONCURRENCY} connections and {CONCURRENCY} pooled database connections, {n} requests a round, median of 3 rounds)\n"
    );
    table("floor", "layer");
    let (b, s) = paired(
        3,
        |r| {
            load(
                direct_addr,
                CONCURRENCY,
                n,
                fresh_keys(&format!("direct{r}")),
            )
        },
        |r| load(layer_addr, CONCURRENCY, n, fresh_keys(&format!("layer{r}"))),
    )
    .await;
    row("fresh keys", b, s);
    // Replays of keys recorded by each server (the same table).
    let recorded = 2_000.min(n);
    load(direct_addr, CONCURRENCY, recorded, fresh_keys("rec-d")).await;
    load(layer_addr, CONCURRENCY, recorded, fresh_keys("rec-l")).await;
    let replays = |prefix: &'static str| -> MakeRequest {
        Arc::new(move |i| {
            let k = i % recorded;
            (
                "/checkout".into(),
                format!("user-{}", k % 1000),
                format!("{prefix}-{k}"),
            )
        })
    };
    let (b, s) = paired(
        3,
        |_| load(direct_addr, CONCURRENCY, n, replays("rec-d")),
        |_| load(layer_addr, CONCURRENCY, n, replays("rec-l")),
    )
    .await;
    row("replays", b, s);
    sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
        .execute(&pool)
        .await
        .expect("drop");
    pool.close().await;
}

/// Statements together (SPEC 26; the part `together` with the `mysql` feature): fresh keys through
/// the layer with claims and completions alone (as before batching) and together (multi-row
/// statements), beside the floor (the store's statements sent by a bare handler, each alone), at 8
/// and 64 clients with as many pooled connections, in the same run.
pub(crate) async fn mysql_together() {
    const ROUNDS: usize = 2;
    let url = std::env::var("MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let n = scale(6_000);
    println!(
        "\n### MySQL fresh keys, statements alone and together, beside the floor (`-- together` with the `mysql` feature; {n} requests a run, {ROUNDS} alternating runs)\n"
    );
    println!(
        "| clients | run | floor req/s | layer alone req/s | vs floor | layer together req/s | vs floor |"
    );
    println!("|---|---|---|---|---|---|---|");
    for clients in [8_usize, 64] {
        let pool = MySqlPoolOptions::new()
            .max_connections(clients as u32)
            .min_connections(clients as u32)
            .connect(&url)
            .await
            .expect("MySQL must be running");
        let table_name = format!("idem_together_{}_{clients}", std::process::id());
        let drop = format!("DROP TABLE IF EXISTS `{table_name}`");
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop.clone()))
            .execute(&pool)
            .await
            .expect("drop");
        let store = MySqlStore::with_table(pool.clone(), &table_name).expect("table");
        store.migrate().await.expect("migrate");
        let floor = serve(direct(store.clone().without_batches())).await;
        let alone = serve(guarded(store.clone().without_batches())).await;
        let together = serve(guarded(store.clone())).await;
        for (addr, name) in [(floor, "floor"), (alone, "alone"), (together, "together")] {
            load(addr, clients, 300, fresh_keys(&format!("warm-{name}"))).await;
        }
        for round in 0..ROUNDS {
            let f = load(floor, clients, n, fresh_keys(&format!("f{round}"))).await;
            let a = load(alone, clients, n, fresh_keys(&format!("a{round}"))).await;
            let t = load(together, clients, n, fresh_keys(&format!("t{round}"))).await;
            println!(
                "| {clients} | {} | {:.0} | {:.0} | {:.2}x | {:.0} | **{:.2}x** |",
                round + 1,
                f.rps,
                a.rps,
                a.rps / f.rps,
                t.rps,
                t.rps / f.rps
            );
        }
        sqlx::raw_sql(sqlx::AssertSqlSafe(drop))
            .execute(&pool)
            .await
            .expect("drop");
        pool.close().await;
    }
}
