//! A checkout API whose charges happen once, however often the client retries.
//!
//! ```text
//! cargo run --example checkout
//! curl -i localhost:3000/checkout -H 'Authorization: Bearer alice' \
//!      -H 'Idempotency-Key: order-1' -H 'Content-Type: application/json' -d '{"amount":1999}'
//! ```
//!
//! Environment: `BIND` (default `127.0.0.1:3000`), `DATABASE_URL` (`postgres://...`;
//! `sqlite://PATH` with the `sqlite` feature: records and charges in that SQLite file, made when
//! absent; `mysql://...` with the `mysql` feature, for MySQL or MariaDB; the memory store when
//! unset), `IDEMPOTENCY_IN_PROGRESS_TTL_SECS` (default 90), `CHECKOUT_DELAY_MS` (simulated payment
//! latency, default 0), `CHECKOUT_HOLD_MS` (a pause after the charge is written, before the answer,
//! to watch a crash at that point; default 0), `CHECKOUT_TRANSACTIONAL` (on the SQL stores, write
//! the charge in the layer's transaction so it commits with its record; default 1, 0 to write it
//! on its own as a handler without `IdempotencyTx` would). A checkout's body may add
//! `"latency_ms"`, the simulated provider latency of that one checkout (at most a minute).
//!
//! ```text
//! cargo run --example checkout --features sqlite    # with DATABASE_URL=sqlite://checkout.db
//! ```
//!
//! `IDEMPOTENCY_WAIT_MS` (default 0): how long a duplicate of a checkout still in progress waits
//! for its answer (the replay) before `409`.
//!
//! `GET /checkout/idempotency/{key}` answers the caller's own checkout with that key:
//! `{"state": "completed" | "failed" | "in_progress", "status": <stored status or null>,
//! "expires_at": "<RFC 3339>"}`, or 404; `DELETE` on the same path forgets a finished one (204; 409
//! while in progress; 404 when there is none), after which the key is new.
//!
//! `REDIS_URL` (feature `redis`) puts the idempotency records in that Redis, whatever
//! `DATABASE_URL` says; the charges stay in Postgres when `DATABASE_URL` is set, in memory
//! otherwise. Redis has no transaction to share with a handler: `IdempotencyTx` is `None` there,
//! and the charge is written on its own.
//!
//! The simulated payment provider deduplicates by the `Idempotency-Key` it is given, as real ones
//! do; the checkout gives it `IdempotencyContext::derived_key()`, so a retake that runs the handler
//! again (its process died) does not charge the card twice at the provider either.
//!
//! With the `metrics` feature, `GET /metrics` (no auth) serves the layer's metrics in Prometheus'
//! text format. With the `openapi` feature, `GET /openapi.json` (no auth) serves the API's OpenAPI
//! document, the idempotency layer's contract on `POST /checkout` and `POST /refund`.
//!
//! Around the API, the tower-http layers a production service has (see [`around`]): a request id
//! (`x-request-id`, kept when the caller sends one, returned on every answer), a trace span per
//! request that the layer's outcome and the `instance` of its problems are logged in, a panic
//! catcher, a timeout (`REQUEST_TIMEOUT_SECS`, default 30: the client gets `408`, the checkout runs
//! on and its retry gets the replay), compression, and a body limit of 64 KiB (`413`).
//!
//! On SIGINT or SIGTERM the server stops accepting, answers the requests it has, and waits for
//! what the idempotency layer still runs on its own (requests whose clients went away, completions
//! being retried, recorders of streamed bodies), all within one deadline from the signal
//! (`SHUTDOWN_GRACE_SECS`, default 20: below Kubernetes' default grace period of 30 s, so the
//! process exits before it is killed). A deploy that stops the process between a charge and its
//! record therefore still records it, and the retry after the restart gets the replay instead of a
//! second charge; a request still running at the deadline ends with the process, and its key is
//! retaken after the in-progress TTL.

// The example's own types are not a library's: they need no `Debug`.
#![allow(missing_debug_implementations)]

use std::collections::HashMap;
use std::error::Error;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{FromRequestParts, OptionalFromRequestParts, Path, Request, State};
use axum::handler::Handler;
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use axum_idempotency::layer::IdempotencyRejection;
use axum_idempotency::store::{Deleted, IdempotencyStore, PostgresStore, RecordKey};
use axum_idempotency::{
    Drain, IdempotencyContext, IdempotencyLayer, IdempotencyLayerBuilder, IdempotencyTx,
    MemoryStore, Subject,
};
use serde_json::{Value, json};
use sqlx::postgres::PgPoolOptions;
use sqlx::{PgConnection, PgPool};
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::compression::CompressionLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::{DefaultOnResponse, TraceLayer};

#[cfg(feature = "metrics")]
#[path = "support/prometheus.rs"]
mod prometheus;

#[cfg(feature = "openapi")]
#[path = "support/openapi.rs"]
mod openapi;

#[cfg(feature = "mysql")]
#[path = "support/mysql_ledger.rs"]
pub(crate) mod mysql_ledger;

/// What the example is configured with.
#[derive(Clone, Copy)]
pub(crate) struct Settings {
    pub in_progress_ttl: Duration,
    pub checkout_delay: Duration,
    pub checkout_hold: Duration,
    pub transactional: bool,
    /// How long a duplicate of a checkout in progress waits for its answer (0: `409` at once).
    pub wait: Duration,
    /// How long a client waits for its answer before `408` (the checkout itself runs on).
    pub request_timeout: Duration,
}

impl Settings {
    /// The defaults, with a TTL and a payment latency.
    #[allow(dead_code)] // for the tests that include this file
    pub(crate) fn new(in_progress_ttl: Duration, checkout_delay: Duration) -> Self {
        Settings {
            in_progress_ttl,
            checkout_delay,
            checkout_hold: Duration::ZERO,
            transactional: true,
            wait: Duration::ZERO,
            request_timeout: Duration::from_secs(30),
        }
    }
}

impl Settings {
    pub(crate) fn from_env() -> Result<Self, Box<dyn Error>> {
        let secs = |name: &str, default: u64| -> Result<u64, Box<dyn Error>> {
            match std::env::var(name) {
                Ok(v) => v.parse().map_err(|e| format!("{name}={v:?}: {e}").into()),
                Err(_) => Ok(default),
            }
        };
        Ok(Settings {
            in_progress_ttl: Duration::from_secs(secs("IDEMPOTENCY_IN_PROGRESS_TTL_SECS", 90)?),
            checkout_delay: Duration::from_millis(secs("CHECKOUT_DELAY_MS", 0)?),
            checkout_hold: Duration::from_millis(secs("CHECKOUT_HOLD_MS", 0)?),
            transactional: secs("CHECKOUT_TRANSACTIONAL", 1)? != 0,
            wait: Duration::from_millis(secs("IDEMPOTENCY_WAIT_MS", 0)?),
            request_timeout: Duration::from_secs(secs("REQUEST_TIMEOUT_SECS", 30)?),
        })
    }
}

/// Serialises the ledger set-up of concurrent instances (`pg_advisory_xact_lock` key). Its own key,
/// not the layer's: the two set-ups need not wait for each other.
const LEDGER_LOCK: i64 = 0x6368_6563_6b6f_7574; // "checkout" in ASCII

/// Charges and handler runs, per subject: in memory, or in Postgres, SQLite or MySQL tables that
/// survive restarts.
#[derive(Clone)]
pub(crate) enum Ledger {
    Memory(Arc<Mutex<MemoryLedger>>),
    Postgres(PgPool),
    #[cfg(feature = "sqlite")]
    Sqlite(sqlx::SqlitePool),
    #[cfg(feature = "mysql")]
    MySql(sqlx::MySqlPool),
}

/// The connection of the layer's transaction, on the ledger's database.
pub(crate) enum TxConn<'a> {
    Postgres(&'a mut PgConnection),
    #[cfg(feature = "sqlite")]
    Sqlite(&'a mut sqlx::SqliteConnection),
    #[cfg(feature = "mysql")]
    MySql(&'a mut sqlx::MySqlConnection),
}

#[derive(Default)]
pub(crate) struct MemoryLedger {
    next_id: i64,
    charges: Vec<(String, Value)>,
    attempts: HashMap<String, i64>,
    /// The simulated provider's payments: its idempotency key to (subject, payment id).
    payments: HashMap<String, (String, i64)>,
}

impl Ledger {
    pub(crate) fn memory() -> Self {
        Ledger::Memory(Arc::default())
    }

    /// The ledger in `pool`'s database, its tables created if missing. Safe to run from many
    /// instances at once: two concurrent `CREATE TABLE IF NOT EXISTS` of one table can both see it
    /// missing, and the loser fails on `pg_type_typname_nsp_index`. So, as
    /// `PostgresStore::migrate` does for its own table, one transaction takes an advisory lock
    /// (held until commit) before creating the tables, and the set-ups run one after another.
    pub(crate) async fn postgres(pool: PgPool) -> Result<Self, sqlx::Error> {
        let mut tx = pool.begin().await?;
        sqlx::query("SELECT pg_advisory_xact_lock($1)")
            .bind(LEDGER_LOCK)
            .execute(&mut *tx)
            .await?;
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS checkout_charges (
                 id bigserial PRIMARY KEY, subject text NOT NULL, kind text NOT NULL,
                 amount bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
             CREATE TABLE IF NOT EXISTS checkout_attempts (
                 subject text PRIMARY KEY, attempts bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS provider_payments (
                 id bigserial PRIMARY KEY, idempotency_key text NOT NULL UNIQUE,
                 subject text NOT NULL, amount bigint NOT NULL);",
        )
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(Ledger::Postgres(pool))
    }

    async fn count_attempt(&self, subject: &str) -> Result<(), sqlx::Error> {
        match self {
            Ledger::Memory(m) => {
                *lock(m).attempts.entry(subject.to_owned()).or_default() += 1;
            }
            Ledger::Postgres(pool) => {
                sqlx::query(
                    "INSERT INTO checkout_attempts VALUES ($1, 1) \
                     ON CONFLICT (subject) DO UPDATE SET attempts = checkout_attempts.attempts + 1",
                )
                .bind(subject)
                .execute(pool)
                .await?;
            }
            #[cfg(feature = "mysql")]
            Ledger::MySql(pool) => mysql_ledger::count_attempt(pool, subject).await?,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(pool) => sqlite_ledger::count_attempt(pool, subject).await?,
        }
        Ok(())
    }

    /// The simulated payment provider: charges the card once per idempotency key, and answers a
    /// repeated key with the first payment (its state is its own: not in the handler's
    /// transaction).
    async fn provider_charge(
        &self,
        key: &str,
        subject: &str,
        amount: i64,
    ) -> Result<i64, sqlx::Error> {
        match self {
            Ledger::Memory(m) => {
                let mut m = lock(m);
                let next = m.payments.len() as i64 + 1;
                let entry = m
                    .payments
                    .entry(key.to_owned())
                    .or_insert_with(|| (subject.to_owned(), next));
                Ok(entry.1)
            }
            Ledger::Postgres(pool) => {
                let (id,): (i64,) = sqlx::query_as(
                    "INSERT INTO provider_payments (idempotency_key, subject, amount) \
                     VALUES ($1, $2, $3) ON CONFLICT (idempotency_key) \
                     DO UPDATE SET amount = provider_payments.amount RETURNING id",
                )
                .bind(key)
                .bind(subject)
                .bind(amount)
                .fetch_one(pool)
                .await?;
                Ok(id)
            }
            #[cfg(feature = "mysql")]
            Ledger::MySql(pool) => mysql_ledger::provider_charge(pool, key, subject, amount).await,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(pool) => {
                sqlite_ledger::provider_charge(pool, key, subject, amount).await
            }
        }
    }

    /// Records a charge: in the layer's transaction (committed with the record) when there is one;
    /// the transaction begins here, at its first use.
    async fn record(
        &self,
        subject: &str,
        kind: &str,
        amount: i64,
        tx: Option<TxConn<'_>>,
    ) -> Result<i64, sqlx::Error> {
        let insert = sqlx::query_as(
            "INSERT INTO checkout_charges (subject, kind, amount) VALUES ($1, $2, $3) RETURNING id",
        )
        .bind(subject)
        .bind(kind)
        .bind(amount);
        match (self, tx) {
            (Ledger::Postgres(_), Some(TxConn::Postgres(tx))) => {
                let (id,): (i64,) = insert.fetch_one(tx).await?;
                Ok(id)
            }
            #[cfg(feature = "sqlite")]
            (Ledger::Sqlite(pool), tx) => {
                sqlite_ledger::record(pool, subject, kind, amount, tx).await
            }
            #[cfg(feature = "mysql")]
            (Ledger::MySql(pool), tx) => {
                let tx = match tx {
                    Some(TxConn::MySql(conn)) => Some(conn),
                    _ => None,
                };
                mysql_ledger::record(pool, subject, kind, amount, tx).await
            }
            (Ledger::Memory(m), _) => {
                let mut m = lock(m);
                m.next_id += 1;
                let id = m.next_id;
                let entry = json!({"id": id, "kind": kind, "amount": amount});
                m.charges.push((subject.to_owned(), entry));
                Ok(id)
            }
            (Ledger::Postgres(pool), _) => {
                let (id,): (i64,) = insert.fetch_one(pool).await?;
                Ok(id)
            }
        }
    }

    /// The subject's charges, handler runs, and payments at the provider.
    async fn list(&self, subject: &str) -> Result<(Vec<Value>, i64, i64), sqlx::Error> {
        match self {
            Ledger::Memory(m) => {
                let m = lock(m);
                let charges = m.charges.iter().filter(|(s, _)| s == subject);
                let charges = charges.map(|(_, c)| c.clone()).collect();
                let payments = m.payments.values().filter(|(s, _)| s == subject).count();
                Ok((
                    charges,
                    m.attempts.get(subject).copied().unwrap_or(0),
                    payments as i64,
                ))
            }
            Ledger::Postgres(pool) => {
                let rows: Vec<(i64, String, i64)> = sqlx::query_as(
                    "SELECT id, kind, amount FROM checkout_charges WHERE subject = $1 ORDER BY id",
                )
                .bind(subject)
                .fetch_all(pool)
                .await?;
                let (attempts,): (i64,) = sqlx::query_as(
                    "SELECT coalesce(sum(attempts), 0)::bigint FROM checkout_attempts WHERE subject = $1",
                )
                .bind(subject)
                .fetch_one(pool)
                .await?;
                let (payments,): (i64,) =
                    sqlx::query_as("SELECT count(*) FROM provider_payments WHERE subject = $1")
                        .bind(subject)
                        .fetch_one(pool)
                        .await?;
                let charges = rows
                    .into_iter()
                    .map(|(id, kind, amount)| json!({"id": id, "kind": kind, "amount": amount}))
                    .collect();
                Ok((charges, attempts, payments))
            }
            #[cfg(feature = "mysql")]
            Ledger::MySql(pool) => mysql_ledger::list(pool, subject).await,
            #[cfg(feature = "sqlite")]
            Ledger::Sqlite(pool) => sqlite_ledger::list(pool, subject).await,
        }
    }
}

/// The ledger in a SQLite file: the file of the idempotency records, so that a charge written in
/// the layer's transaction commits with its record.
#[cfg(feature = "sqlite")]
mod sqlite_ledger {
    use super::{Ledger, TxConn, Value, json};
    use sqlx::SqlitePool;

    impl Ledger {
        /// The ledger in `pool`'s file, its tables created if missing (SQLite runs one writer at a
        /// time: instances setting it up at once take turns).
        pub(crate) async fn sqlite(pool: SqlitePool) -> Result<Self, sqlx::Error> {
            sqlx::raw_sql(
                "CREATE TABLE IF NOT EXISTS checkout_charges (
                     id INTEGER PRIMARY KEY AUTOINCREMENT, subject TEXT NOT NULL,
                     kind TEXT NOT NULL, amount INTEGER NOT NULL,
                     created_at TEXT NOT NULL DEFAULT CURRENT_TIMESTAMP);
                 CREATE TABLE IF NOT EXISTS checkout_attempts (
                     subject TEXT PRIMARY KEY, attempts INTEGER NOT NULL);
                 CREATE TABLE IF NOT EXISTS provider_payments (
                     id INTEGER PRIMARY KEY AUTOINCREMENT, idempotency_key TEXT NOT NULL UNIQUE,
                     subject TEXT NOT NULL, amount INTEGER NOT NULL);",
            )
            .execute(&pool)
            .await?;
            Ok(Ledger::Sqlite(pool))
        }
    }

    pub(super) async fn count_attempt(pool: &SqlitePool, subject: &str) -> sqlx::Result<()> {
        sqlx::query(
            "INSERT INTO checkout_attempts VALUES (?1, 1) \
             ON CONFLICT (subject) DO UPDATE SET attempts = attempts + 1",
        )
        .bind(subject)
        .execute(pool)
        .await?;
        Ok(())
    }

    pub(super) async fn provider_charge(
        pool: &SqlitePool,
        key: &str,
        subject: &str,
        amount: i64,
    ) -> sqlx::Result<i64> {
        let (id,): (i64,) = sqlx::query_as(
            "INSERT INTO provider_payments (idempotency_key, subject, amount) VALUES (?1, ?2, ?3) \
             ON CONFLICT (idempotency_key) DO UPDATE SET amount = amount RETURNING id",
        )
        .bind(key)
        .bind(subject)
        .bind(amount)
        .fetch_one(pool)
        .await?;
        Ok(id)
    }

    /// In the layer's transaction when given, else on its own.
    pub(super) async fn record(
        pool: &SqlitePool,
        subject: &str,
        kind: &str,
        amount: i64,
        tx: Option<TxConn<'_>>,
    ) -> sqlx::Result<i64> {
        let insert = sqlx::query_as(
            "INSERT INTO checkout_charges (subject, kind, amount) VALUES (?1, ?2, ?3) RETURNING id",
        )
        .bind(subject)
        .bind(kind)
        .bind(amount);
        let (id,): (i64,) = match tx {
            Some(TxConn::Sqlite(tx)) => insert.fetch_one(tx).await?,
            _ => insert.fetch_one(pool).await?,
        };
        Ok(id)
    }

    pub(super) async fn list(
        pool: &SqlitePool,
        subject: &str,
    ) -> sqlx::Result<(Vec<Value>, i64, i64)> {
        let rows: Vec<(i64, String, i64)> = sqlx::query_as(
            "SELECT id, kind, amount FROM checkout_charges WHERE subject = ?1 ORDER BY id",
        )
        .bind(subject)
        .fetch_all(pool)
        .await?;
        let (attempts,): (i64,) = sqlx::query_as(
            "SELECT coalesce(sum(attempts), 0) FROM checkout_attempts WHERE subject = ?1",
        )
        .bind(subject)
        .fetch_one(pool)
        .await?;
        let (payments,): (i64,) =
            sqlx::query_as("SELECT count(*) FROM provider_payments WHERE subject = ?1")
                .bind(subject)
                .fetch_one(pool)
                .await?;
        let charges = rows
            .into_iter()
            .map(|(id, kind, amount)| json!({"id": id, "kind": kind, "amount": amount}))
            .collect();
        Ok((charges, attempts, payments))
    }
}

fn lock(m: &Mutex<MemoryLedger>) -> std::sync::MutexGuard<'_, MemoryLedger> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[derive(Clone)]
struct AppState {
    ledger: Ledger,
    settings: Settings,
}

/// The idempotency layer of the payment routes, as this API sets it, on `store`.
pub(crate) fn idempotency<S: IdempotencyStore>(
    store: S,
    settings: &Settings,
) -> IdempotencyLayerBuilder<S> {
    IdempotencyLayer::builder(store)
        .require_key(true)
        .in_progress_ttl(settings.in_progress_ttl)
        .wait(settings.wait)
        .drain(drain())
        // Logged in the request's span (see `around`), so each outcome carries the request id.
        .on_outcome(|outcome| tracing::info!(outcome = outcome.as_str(), "idempotency outcome"))
}

/// The API: `POST /checkout` and `POST /refund` behind the idempotency layer, `GET /charges`.
pub(crate) fn app<S: IdempotencyStore>(
    idempotency: IdempotencyLayer<S>,
    ledger: Ledger,
    settings: Settings,
) -> Result<Router, Box<dyn Error>> {
    let store = idempotency.store().clone();
    #[cfg(feature = "openapi")]
    let document = axum::body::Bytes::from(openapi::document(&idempotency)?);
    // On Postgres and SQLite the charge is written in the layer's transaction (`IdempotencyTx`), so
    // it commits with its record; `CHECKOUT_TRANSACTIONAL=0` writes it on its own instead, to compare.
    // The layer wraps each handler (`handler.layer(..)`), not the route: a method the route does not
    // serve (`PATCH /checkout`) gets the router's own 405, untouched and never recorded.
    let routes = if settings.transactional {
        Router::new()
            .route("/checkout", post(checkout.layer(idempotency.clone())))
            .route("/refund", post(refund.layer(idempotency)))
    } else {
        Router::new()
            .route(
                "/checkout",
                post(checkout_separately.layer(idempotency.clone())),
            )
            .route("/refund", post(refund_separately.layer(idempotency)))
    };
    let router = routes
        .route(
            "/checkout/idempotency/{key}",
            get(inspect::<S>).delete(forget::<S>).with_state(store),
        )
        .route("/charges", get(charges))
        .layer(middleware::from_fn(demo_auth))
        .with_state(AppState { ledger, settings });
    // Added after the auth layer, so a scraper needs no token.
    #[cfg(feature = "metrics")]
    let router = router.route("/metrics", get(prometheus::scrape));
    // The API's description, with the idempotency layer's contract on its guarded routes; no auth.
    #[cfg(feature = "openapi")]
    let router = router.route(
        "/openapi.json",
        get(move || std::future::ready(([(header::CONTENT_TYPE, "application/json")], document))),
    );
    Ok(around(router, &settings))
}

/// The request id's header: kept when the caller (or a proxy) sent one, made otherwise.
const REQUEST_ID: header::HeaderName = header::HeaderName::from_static("x-request-id");

/// The largest request body: under the idempotency layer's own limit (1 MiB), so this one decides.
const BODY_LIMIT: usize = 64 * 1024;

/// The tower-http layers around the API, outermost first. Every one is outside the idempotency
/// layer, which wraps the payment handlers themselves.
fn around(router: Router, settings: &Settings) -> Router {
    router.layer(
        ServiceBuilder::new()
            // First, so that everything below, the trace span included, sees the id.
            .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
            // One span per request, with its id: the idempotency layer's span opens inside it, so
            // its outcomes and the `instance` of each problem it answers are logged with the id.
            .layer(
                TraceLayer::new_for_http()
                    .make_span_with(request_span)
                    .on_response(DefaultOnResponse::new().level(tracing::Level::INFO)),
            )
            // Outside the panic catcher and the timeout, so their answers carry the id too.
            .layer(PropagateRequestIdLayer::new(REQUEST_ID))
            // A handler's panic never gets this far: the idempotency layer catches it under its
            // lease, releases the record and answers 500, so the retry runs the checkout again.
            // This catches the rest (the auth, the unguarded routes) and turns it into a 500.
            .layer(CatchPanicLayer::new())
            // Outside, so the record holds the plain bytes and each answer, replays included, is
            // encoded for the Accept-Encoding of the request it answers.
            .layer(CompressionLayer::new())
            // A body over the limit is 413 (with Content-Length, here; chunked, from the
            // idempotency layer, which finds this limit in the body's error); nothing is claimed.
            .layer(RequestBodyLimitLayer::new(BODY_LIMIT))
            // The client gets 408, but the idempotency layer runs a request whose body it has
            // read to its end: the checkout finishes, is recorded, and the retry gets the replay.
            // Inside the layer it would cancel the checkout midway, and its 408 would release
            // the key for the retry to run it again.
            .layer(TimeoutLayer::with_status_code(
                StatusCode::REQUEST_TIMEOUT,
                settings.request_timeout,
            )),
    )
}

/// The span of one request: its id, method and path.
fn request_span(request: &Request) -> tracing::Span {
    let id = request
        .headers()
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    tracing::info_span!("request", id, method = %request.method(), path = request.uri().path())
}

/// The store's operation timeout: 5 s (the Postgres store's default), or less when the in-progress
/// TTL is short, since the TTL must be at least twice it.
fn store_timeout(settings: &Settings) -> Duration {
    Duration::from_secs(5).min(settings.in_progress_ttl / 2)
}

/// The process's one drain, shared by every idempotency layer it builds: `main` waits for it at
/// shutdown.
pub(crate) fn drain() -> Drain {
    static DRAIN: std::sync::OnceLock<Drain> = std::sync::OnceLock::new();
    DRAIN.get_or_init(Drain::new).clone()
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (what a deploy sends).
async fn shutdown_signal() {
    let terminate = async {
        #[cfg(unix)]
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
        #[cfg(not(unix))]
        std::future::pending::<()>().await;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: no new connections; finishing the requests in flight");
}

/// The caller's own checkout record of `key`, in the scope the layer gives it.
/// `None` for a key the layer would refuse (the same rules as the header's): it is not looked up.
fn checkout_scope(subject: &Subject, key: &str) -> Option<RecordKey> {
    axum_idempotency::layer::key::parse(key.as_bytes())
        .ok()
        .map(|key| RecordKey {
            key,
            subject: subject.0.clone(),
            endpoint: "POST /checkout".into(),
        })
}

fn invalid_key() -> Response {
    error(StatusCode::BAD_REQUEST, "invalid_idempotency_key")
}

fn store_unavailable() -> Response {
    problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "idempotency_store_unavailable",
        true,
    )
}

/// `GET /checkout/idempotency/{key}`: the state of the caller's own checkout with that key.
async fn inspect<S: IdempotencyStore>(
    State(store): State<S>,
    Extension(subject): Extension<Subject>,
    Path(key): Path<String>,
) -> Response {
    let Some(scope) = checkout_scope(&subject, &key) else {
        return invalid_key();
    };
    match store.lookup(&scope).await {
        Ok(Some(info)) => Json(json!({
            "state": info.state.as_str(),
            "status": info.status,
            "expires_at": humantime::format_rfc3339_seconds(info.expires_at).to_string(),
        }))
        .into_response(),
        Ok(None) => error(StatusCode::NOT_FOUND, "not_found"),
        Err(_) => store_unavailable(),
    }
}

/// `DELETE /checkout/idempotency/{key}`: forget the caller's finished checkout with that key, so
/// the key is new; refused while it is in progress.
async fn forget<S: IdempotencyStore>(
    State(store): State<S>,
    Extension(subject): Extension<Subject>,
    Path(key): Path<String>,
) -> Response {
    let Some(scope) = checkout_scope(&subject, &key) else {
        return invalid_key();
    };
    match store.delete(&scope).await {
        Ok(Deleted::Deleted) => StatusCode::NO_CONTENT.into_response(),
        Ok(Deleted::InProgress) => problem(StatusCode::CONFLICT, "in_progress", true),
        Ok(_) => error(StatusCode::NOT_FOUND, "not_found"),
        Err(_) => store_unavailable(),
    }
}

/// Demo auth: `Authorization: Bearer <subject>` makes `<subject>` the subject.
async fn demo_auth(mut request: Request, next: Next) -> Response {
    let subject = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned);
    match subject {
        Some(subject) => {
            request.extensions_mut().insert(Subject(subject));
            next.run(request).await
        }
        None => error(StatusCode::UNAUTHORIZED, "unauthenticated"),
    }
}

/// The layer's transaction on the records' database: PostgreSQL's, SQLite's or MySQL's, none on
/// the memory and Redis stores (or with `CHECKOUT_TRANSACTIONAL=0`).
pub(crate) enum HandlerTx {
    None,
    Postgres(IdempotencyTx),
    #[cfg(feature = "sqlite")]
    Sqlite(IdempotencyTx<sqlx::Sqlite>),
    #[cfg(feature = "mysql")]
    MySql(IdempotencyTx<sqlx::MySql>),
}

impl HandlerTx {
    /// The transaction's connection (begun at the first call), if there is a transaction.
    async fn conn(&mut self) -> Result<Option<TxConn<'_>>, sqlx::Error> {
        Ok(match self {
            HandlerTx::None => None,
            HandlerTx::Postgres(tx) => Some(TxConn::Postgres(tx.conn().await?)),
            #[cfg(feature = "sqlite")]
            HandlerTx::Sqlite(tx) => Some(TxConn::Sqlite(tx.conn().await?)),
            #[cfg(feature = "mysql")]
            HandlerTx::MySql(tx) => Some(TxConn::MySql(tx.conn().await?)),
        })
    }
}

impl<S: Send + Sync> FromRequestParts<S> for HandlerTx {
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &S,
    ) -> Result<Self, Self::Rejection> {
        let postgres =
            <IdempotencyTx as OptionalFromRequestParts<S>>::from_request_parts(parts, state);
        if let Some(tx) = postgres.await? {
            return Ok(HandlerTx::Postgres(tx));
        }
        #[cfg(feature = "sqlite")]
        {
            let sqlite =
                <IdempotencyTx<sqlx::Sqlite> as OptionalFromRequestParts<S>>::from_request_parts(
                    parts, state,
                );
            if let Some(tx) = sqlite.await? {
                return Ok(HandlerTx::Sqlite(tx));
            }
        }
        #[cfg(feature = "mysql")]
        {
            let mysql =
                <IdempotencyTx<sqlx::MySql> as OptionalFromRequestParts<S>>::from_request_parts(
                    parts, state,
                );
            if let Some(tx) = mysql.await? {
                return Ok(HandlerTx::MySql(tx));
            }
        }
        Ok(HandlerTx::None)
    }
}

/// `POST /checkout`. There is no transaction on the memory and Redis stores.
async fn checkout(
    State(state): State<AppState>,
    Extension(subject): Extension<Subject>,
    context: IdempotencyContext,
    tx: HandlerTx,
    body: axum::body::Bytes,
) -> Response {
    pay(&state, &subject.0, "charge", &context, tx, &body).await
}

async fn refund(
    State(state): State<AppState>,
    Extension(subject): Extension<Subject>,
    context: IdempotencyContext,
    tx: HandlerTx,
    body: axum::body::Bytes,
) -> Response {
    pay(&state, &subject.0, "refund", &context, tx, &body).await
}

async fn checkout_separately(
    State(state): State<AppState>,
    Extension(subject): Extension<Subject>,
    context: IdempotencyContext,
    body: axum::body::Bytes,
) -> Response {
    pay(
        &state,
        &subject.0,
        "charge",
        &context,
        HandlerTx::None,
        &body,
    )
    .await
}

async fn refund_separately(
    State(state): State<AppState>,
    Extension(subject): Extension<Subject>,
    context: IdempotencyContext,
    body: axum::body::Bytes,
) -> Response {
    pay(
        &state,
        &subject.0,
        "refund",
        &context,
        HandlerTx::None,
        &body,
    )
    .await
}

/// The simulated payment: wait, count the attempt (outside any transaction, so handler runs are
/// counted even when rolled back), then decline, fail, or charge at the provider (by the derived
/// key) and record the charge (in `tx` when given).
async fn pay(
    state: &AppState,
    subject: &str,
    kind: &str,
    context: &IdempotencyContext,
    mut tx: HandlerTx,
    body: &[u8],
) -> Response {
    let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let Some(amount) = request.get("amount").and_then(Value::as_i64) else {
        return error(StatusCode::BAD_REQUEST, "invalid_amount");
    };
    let latency = request
        .get("latency_ms")
        .and_then(Value::as_u64)
        .map_or(Duration::ZERO, |ms| Duration::from_millis(ms.min(60_000)));
    tokio::time::sleep(state.settings.checkout_delay.saturating_add(latency)).await;
    if let Err(e) = state.ledger.count_attempt(subject).await {
        tracing::error!(error = %e, "could not count the attempt");
        return error(StatusCode::SERVICE_UNAVAILABLE, "ledger_unavailable");
    }
    match request.get("card").and_then(Value::as_str) {
        Some("declined") => return error(StatusCode::PAYMENT_REQUIRED, "card_declined"),
        Some("flaky") => return error(StatusCode::SERVICE_UNAVAILABLE, "provider_unavailable"),
        _ => {}
    }
    let payment = match state
        .ledger
        .provider_charge(&context.derived_key(), subject, amount)
        .await
    {
        Ok(payment) => payment,
        Err(e) => {
            tracing::error!(error = %e, "the provider could not be reached");
            return error(StatusCode::SERVICE_UNAVAILABLE, "provider_unavailable");
        }
    };
    // The layer's transaction begins here, at its first use: the provider call above held none.
    let conn = match tx.conn().await {
        Ok(conn) => conn,
        Err(e) => {
            tracing::error!(error = %e, "could not begin the transaction");
            return error(StatusCode::SERVICE_UNAVAILABLE, "ledger_unavailable");
        }
    };
    let recorded = state.ledger.record(subject, kind, amount, conn).await;
    tokio::time::sleep(state.settings.checkout_hold).await;
    match recorded {
        Ok(id) => (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/charges/{id}"))],
            Json(json!({
                "id": id, "kind": kind, "amount": amount, "status": "succeeded",
                "payment": payment,
            })),
        )
            .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "could not record the charge");
            error(StatusCode::SERVICE_UNAVAILABLE, "ledger_unavailable")
        }
    }
}

async fn charges(
    State(state): State<AppState>,
    Extension(subject): Extension<Subject>,
) -> Response {
    match state.ledger.list(&subject.0).await {
        Ok((charges, attempts, payments)) => Json(json!({
            "charges": charges, "attempts": attempts, "provider_payments": payments,
        }))
        .into_response(),
        Err(e) => {
            tracing::error!(error = %e, "could not list charges");
            error(StatusCode::SERVICE_UNAVAILABLE, "ledger_unavailable")
        }
    }
}

/// The example's own error answers, as problem details (RFC 9457) like the layer's: a client of
/// the protocol reads `retryable` (and `Retry-After`) the same way on both. A `503` (the provider
/// or the ledger unavailable) is retryable: the layer released its record.
fn error(status: StatusCode, code: &str) -> Response {
    problem(status, code, status == StatusCode::SERVICE_UNAVAILABLE)
}

fn problem(status: StatusCode, code: &str, retryable: bool) -> Response {
    let body = json!({
        "type": "about:blank",
        "title": status.canonical_reason().unwrap_or("Error"),
        "status": status.as_u16(),
        "error": code,
        "retryable": retryable,
    });
    let mut response = (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        body.to_string(),
    )
        .into_response();
    if retryable {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, header::HeaderValue::from_static("2"));
    }
    response
}

/// The router on the store `REDIS_URL` or `DATABASE_URL` names: Redis, Postgres (migrated on start)
/// or memory.
pub(crate) async fn router_from_env(settings: Settings) -> Result<Router, Box<dyn Error>> {
    if let Ok(url) = std::env::var("REDIS_URL") {
        return redis_router(&url, settings).await;
    }
    match std::env::var("DATABASE_URL") {
        Ok(url) if url.starts_with("sqlite:") => sqlite_router(&url, settings).await,
        #[cfg(feature = "mysql")]
        Ok(url) if url.starts_with("mysql:") || url.starts_with("mariadb:") => {
            mysql_ledger::router(&url, settings).await
        }
        Ok(url) => {
            // Three pools, so none can starve another: the layer's own statements (claims,
            // heartbeats, completions), the handlers' transactions (each held while its checkout
            // runs), and the ledger's and provider's statements (which a handler issues while it
            // holds its transaction). The layer's connections are opened up front and kept open: a
            // cold pool makes the first burst of duplicates wait on connection set-up (20
            // simultaneous duplicates of one key answered their 409s at ~35 ms p50 cold, against
            // ~6.5 ms warm).
            let records = PgPoolOptions::new()
                .min_connections(5)
                .max_connections(10)
                .connect(&url)
                .await?;
            let transactions = PgPoolOptions::new()
                .max_connections(20)
                .connect(&url)
                .await?;
            let ledger = PgPoolOptions::new()
                .max_connections(10)
                .connect(&url)
                .await?;
            // A short TTL (as tests set) needs a store timeout under half of it.
            let store = PostgresStore::new(records)
                .with_transaction_pool(transactions)
                .with_timeout(store_timeout(&settings));
            store.migrate().await?;
            axum_idempotency::store::spawn_purge(store.clone(), Duration::from_secs(3600));
            tracing::info!("idempotency records and charges in PostgreSQL");
            let idempotency = idempotency(store, &settings)
                .transactions(settings.transactional)
                .build()?;
            app(idempotency, Ledger::postgres(ledger).await?, settings)
        }
        Err(_) => {
            tracing::info!(
                "idempotency records and charges in memory (set DATABASE_URL for Postgres or SQLite)"
            );
            app(
                idempotency(MemoryStore::new(), &settings).build()?,
                Ledger::memory(),
                settings,
            )
        }
    }
}

/// Records and charges in one SQLite file (`sqlite://PATH`, made when absent): a charge written in
/// the layer's transaction commits with its record, and both survive restarts and crashes.
#[cfg(feature = "sqlite")]
async fn sqlite_router(url: &str, settings: Settings) -> Result<Router, Box<dyn Error>> {
    use axum_idempotency::store::SqliteStore;
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use std::str::FromStr;
    // One pool for the records, the handlers' transactions and the ledger: SQLite writes one at a
    // time whatever the pools, and several connections let reads (replays, 409s) go on meanwhile.
    // The busy timeout stays under the store's, so SQLite answers a wait on another writer first.
    let timeout = store_timeout(&settings);
    let options = SqliteStore::connect_options(SqliteConnectOptions::from_str(url)?)
        .busy_timeout(timeout * 4 / 5);
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await?;
    let store = SqliteStore::new(pool.clone()).with_timeout(timeout);
    store.migrate().await?;
    axum_idempotency::store::spawn_purge(store.clone(), Duration::from_secs(3600));
    tracing::info!("idempotency records and charges in SQLite");
    let idempotency = idempotency(store, &settings)
        .transactions(settings.transactional)
        .build()?;
    app(idempotency, Ledger::sqlite(pool).await?, settings)
}

#[cfg(not(feature = "sqlite"))]
async fn sqlite_router(_: &str, _: Settings) -> Result<Router, Box<dyn Error>> {
    Err("DATABASE_URL names SQLite, but the example was built without the `sqlite` feature".into())
}

/// Idempotency records in the Redis at `url`; charges in Postgres (`DATABASE_URL`) or memory. The
/// layer has no transaction to give on Redis: `Option<IdempotencyTx>` is `None`, and the charge is
/// written on its own, as with `CHECKOUT_TRANSACTIONAL=0` on Postgres.
#[cfg(feature = "redis")]
async fn redis_router(url: &str, settings: Settings) -> Result<Router, Box<dyn Error>> {
    let store = axum_idempotency::store::RedisStore::new(redis::Client::open(url)?)?
        .with_timeout(store_timeout(&settings).min(Duration::from_secs(2)));
    let ledger = match std::env::var("DATABASE_URL") {
        Ok(db) => {
            let pool = PgPoolOptions::new()
                .max_connections(10)
                .connect(&db)
                .await?;
            tracing::info!("idempotency records in Redis, charges in PostgreSQL");
            Ledger::postgres(pool).await?
        }
        Err(_) => {
            tracing::info!("idempotency records in Redis, charges in memory");
            Ledger::memory()
        }
    };
    app(idempotency(store, &settings).build()?, ledger, settings)
}

#[cfg(not(feature = "redis"))]
async fn redis_router(_: &str, _: Settings) -> Result<Router, Box<dyn Error>> {
    Err("REDIS_URL is set, but the example was built without the `redis` feature".into())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,sqlx=warn".into()),
        )
        .init();
    #[cfg(feature = "metrics")]
    prometheus::install()?;
    let settings = Settings::from_env()?;
    let router = router_from_env(settings).await?;
    let bind = std::env::var("BIND").unwrap_or_else(|_| "127.0.0.1:3000".to_owned());
    let listener = tokio::net::TcpListener::bind(&bind).await?;
    tracing::info!("listening on http://{}", listener.local_addr()?);
    // One deadline for the whole shutdown, from the signal: the graceful phase (the server
    // answers the requests it has) and the drain (what the layer still runs on its own) together.
    let grace = Duration::from_secs(
        std::env::var("SHUTDOWN_GRACE_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(20),
    );
    let (deadline_tx, mut deadline_rx) = tokio::sync::watch::channel(None);
    let server = axum::serve(listener, router).with_graceful_shutdown(async move {
        shutdown_signal().await;
        deadline_tx.send_replace(Some(tokio::time::Instant::now() + grace));
    });
    let deadline = {
        let mut deadline_rx = deadline_rx.clone();
        async move {
            let Ok(deadline) = deadline_rx.wait_for(Option::is_some).await else {
                return std::future::pending().await;
            };
            let deadline = deadline.unwrap_or_else(tokio::time::Instant::now);
            tokio::time::sleep_until(deadline).await;
        }
    };
    tokio::select! {
        served = std::future::IntoFuture::into_future(server) => served?,
        () = deadline => tracing::warn!(
            "the shutdown deadline passed with requests still being answered; they end with the \
             process, their keys retakable after the in-progress TTL"
        ),
    }
    // Every guarded request counts in the drain until it ends, attached to its client or not:
    // what is left (a checkout whose client gave up, a record still being written) gets what is
    // left of the deadline.
    let deadline = deadline_rx
        .borrow_and_update()
        .unwrap_or_else(tokio::time::Instant::now);
    let drain = drain();
    tracing::info!(running = drain.running(), "draining the idempotency layer");
    if drain
        .wait(deadline.saturating_duration_since(tokio::time::Instant::now()))
        .await
    {
        tracing::info!("drained; exiting");
    } else {
        tracing::warn!(
            running = drain.running(),
            "the shutdown deadline passed with idempotent work still running"
        );
    }
    Ok(())
}
