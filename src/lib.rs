//! Make unsafe HTTP endpoints (checkout, payments, order creation) safe to retry with the
//! `Idempotency-Key` header.
//!
//! Put [`IdempotencyLayer`] on the routes whose effect must happen once. A request with a key is
//! fingerprinted, its key claimed in the store (committed before the handler runs), and then:
//!
//! | existing record | fingerprint | answer |
//! |---|---|---|
//! | none, or past retention | - | claim, run the handler, record its answer |
//! | any | differs | `422 idempotency_key_reuse` |
//! | `completed` / `failed` | same | the stored answer again, with `Idempotent-Replayed: true` |
//! | `in_progress` | same | `409 in_progress` at once, with `Retry-After` |
//! | `in_progress` past the in-progress TTL | same | retaken by compare-and-swap on its lease (on PostgreSQL, MySQL and Redis, marked by the first such claim, `409`, and retaken a TTL after the mark) |
//!
//! A record is scoped by (key, [subject](Subject), endpoint): the same key from another user or on
//! another route is another operation.
//!
//! ```no_run
//! use axum::{Router, handler::Handler, routing::post};
//! use axum_idempotency::{IdempotencyLayer, MemoryStore};
//!
//! async fn checkout() -> &'static str { "charged" }
//!
//! # fn app() -> Result<Router, axum_idempotency::ConfigError> {
//! let layer = IdempotencyLayer::new(MemoryStore::new())?;
//! // On the handler: a method the route does not serve gets the router's own 405.
//! let app = Router::new().route("/checkout", post(checkout.layer(layer)));
//! // Your auth middleware inserts `axum_idempotency::Subject` into the request extensions.
//! # Ok(app) }
//! ```
//!
//! A complete setup on Postgres: two pools, the migration, a cache of finished records, purging,
//! a handler whose effects commit with their record, and the drain to wait for at shutdown.
//!
//! ```no_run
//! # #[cfg(feature = "postgres")]
//! # async fn setup(url: &str) -> Result<(), Box<dyn std::error::Error>> {
//! use std::time::Duration;
//! use axum::{Json, Router, handler::Handler, http::StatusCode, routing::post};
//! use axum_idempotency::sqlx::{self, postgres::PgPoolOptions};
//! use axum_idempotency::store::{CachedStore, PostgresStore, spawn_purge};
//! use axum_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyTx};
//! use serde_json::Value;
//!
//! // Two pools: claims, heartbeats and completions never wait behind handlers' transactions.
//! let records = PgPoolOptions::new().max_connections(10).connect(url).await?;
//! let transactions = PgPoolOptions::new().max_connections(20).connect(url).await?;
//! let postgres = PostgresStore::new(records).with_transaction_pool(transactions);
//! postgres.migrate().await?; // on the store itself, before wrapping it
//! spawn_purge(postgres.clone(), Duration::from_secs(3600));
//! // Replays of finished records without a round trip (the layer itself answers duplicates at
//! // this instance); clones share the cache.
//! let store = CachedStore::new(postgres);
//! let idempotency = IdempotencyLayer::builder(store)
//!     .require_key(true)
//!     .transactions(true)
//!     .build()?;
//! let drain = idempotency.drain();
//!
//! async fn checkout(
//!     ctx: IdempotencyContext,
//!     mut tx: IdempotencyTx<sqlx::Postgres>,
//!     Json(order): Json<Value>,
//! ) -> Result<(StatusCode, Json<Value>), StatusCode> {
//!     // An outside provider gets ctx.derived_key() as its own idempotency key; a slow call
//!     // here holds no transaction open.
//!     let _provider_key = ctx.derived_key();
//!     let unavailable = |_| StatusCode::SERVICE_UNAVAILABLE;
//!     // Effects in the layer's transaction (begun here, at its first use): committed with the
//!     // record of this answer, or not at all.
//!     sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
//!         .bind(order["amount"].as_i64())
//!         .execute(tx.conn().await.map_err(unavailable)?)
//!         .await
//!         .map_err(unavailable)?;
//!     Ok((StatusCode::CREATED, Json(order)))
//! }
//!
//! let app: Router = Router::new().route("/checkout", post(checkout.layer(idempotency)));
//! // Add your auth layer (it inserts `Subject`) and serve. At shutdown, one deadline for all:
//! // stop accepting, then wait for every guarded request and its recording.
//! drain.wait(Duration::from_secs(20)).await;
//! # let _ = app;
//! # Ok(()) }
//! ```
//!
//! Settings are changed through [`IdempotencyLayer::builder`]; every setting, its default and its
//! bounds are in the table on [`IdempotencyLayerBuilder`], and a refused one is named by
//! [`ConfigError::setting`]:
//!
//! ```
//! use std::time::Duration;
//! use axum_idempotency::{IdempotencyLayer, MemoryStore};
//!
//! let layer = IdempotencyLayer::builder(MemoryStore::new())
//!     .require_key(true)
//!     .in_progress_ttl(Duration::from_secs(120))
//!     .store_header("x-request-id")
//!     .build()
//!     .expect("valid settings");
//! # let _ = layer;
//! ```
//!
//! Every error the layer itself answers with is `application/problem+json` with a stable `error`
//! field; see [`ErrorKind`].
//!
//! # How the crate is cut
//!
//! | module | for whom | what |
//! |---|---|---|
//! | the root | application authors | the layer, its builder, the handler's context and transaction, the subject, the drain, outcomes and errors |
//! | [`store`] | everyone choosing a store; store authors | the backends ([`MemoryStore`], `PostgresStore`, `SqliteStore`, `RedisStore`, [`CachedStore`](store::CachedStore), `EncryptedStore`), the [`IdempotencyStore`](store::IdempotencyStore) trait and its whole vocabulary, [`TransactionalStore`](store::TransactionalStore), [`spawn_purge`](store::spawn_purge) |
//! | [`once`] | consumers, webhooks, jobs | [`RunOnce`](once::RunOnce): the same guarantee for a function call |
//! | [`header`] | clients and tests | the header names, as `HeaderName` constants |
//! | [`layer`] | middleware plumbing | the tower service and its future, the extractors' rejection, the default policy, key parsing |
//! | [`fingerprint`] | tools | the `Fingerprint` of a request, and the canonical JSON it hashes |
//! | `metrics` (feature) | operators | the metric names |
//! | `openapi` (feature) | API authors | the layer's contract in an OpenAPI document |
//! | `layer::grpc` (feature) | gRPC service authors | the gRPC mode: unary calls guarded, trailers replayed, gRPC statuses |
//! | `conformance` (feature `test-suite`) | store authors | the behaviour suite every store passes |
//!
//! Inside, dependencies go one way: `util <- fingerprint <- store <- engine <- {layer, once}`. The
//! engine owns the life of a key (claim, lease and heartbeat, maximum hold, complete or release,
//! duplicates at this instance, the wait, the drain, outcomes) and knows nothing of HTTP; the layer
//! and `RunOnce` are its two doors.
//!
//! # Feature flags
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `postgres` | off | `store::PostgresStore` (sqlx 0.9, re-exported as `axum_idempotency::sqlx`) and the handler transaction `IdempotencyTx<sqlx::Postgres>` |
//! | `sqlite` | off | `store::SqliteStore`: records in one SQLite file (compiled in), for one machine without a database server, and `IdempotencyTx<sqlx::Sqlite>` |
//! | `mysql` | off | `store::MySqlStore` on MySQL 8 or MariaDB 10.6+ (sqlx 0.9), and the handler transaction `IdempotencyTx<sqlx::MySql>` |
//! | `redis` | off | `store::RedisStore` on one server or a Redis Cluster (redis 1, re-exported as `axum_idempotency::redis`) |
//! | `encryption` | off | `store::EncryptedStore`: recorded headers and bodies sealed with AES-256-GCM over any store |
//! | `metrics` | off | outcome counters by route and store latency histograms through the `metrics` facade |
//! | `openapi` | off | `openapi`: the layer's contract (the `Idempotency-Key` parameter, its problem answers, the replay headers) written into a utoipa 6 `OpenApi` by `IdempotencyLayer::openapi` (utoipa re-exported as `axum_idempotency::utoipa`) |
//! | `grpc` | off | `layer::grpc`: the layer guards unary gRPC calls (the `idempotency-key` metadata, the answer decided by its `grpc-status`, its trailers replayed, the layer's answers as gRPC statuses); no dependency added |
//! | `test-suite` | off | `conformance`, `store_suite!` and `cache_suite!`: the behaviour suite every store passes, for stores of your own (tests only) |
//!
//! # Implementing a store
//!
//! A store is a type that implements [`IdempotencyStore`](store::IdempotencyStore): five atomic
//! operations (claim, complete, renew, release, purge) and three for inspection (lookup, delete,
//! list), whose contracts the trait's documentation states, with an example of a store wrapping
//! another. Check one against the contract with the `test-suite` feature: its `store_suite!` runs
//! the same behaviour suite as the crate's own stores (races, fencing, retention, disconnects,
//! streams) on yours.

#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

// Dependencies go one way: util <- fingerprint <- store <- engine <- {layer, once} <- this root.
// (The fingerprint sits under the store: the store keeps the `Fingerprint` type, which lives whole
// in its module, and the module needs nothing but `util`.)
mod util;

pub mod fingerprint;

pub mod store;

mod engine;

pub mod layer;

pub mod once;

pub mod header;

#[cfg(feature = "test-suite")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-suite")))]
pub mod conformance;

#[cfg(feature = "metrics")]
#[cfg_attr(docsrs, doc(cfg(feature = "metrics")))]
pub mod metrics;

#[cfg(feature = "openapi")]
#[cfg_attr(docsrs, doc(cfg(feature = "openapi")))]
pub mod openapi;

pub use engine::{
    ConfigError, Drain, IdempotencyContext, MAX_STEP_NAME, MAX_STEP_RESULT, MAX_STEPS, Outcome,
    OutcomeCounters, ReplayInfo, StepError, is_tombstone, tombstone_of,
};
pub use fingerprint::Fingerprint;
#[cfg(sql)]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql")))
)]
pub use layer::IdempotencyTx;
pub use layer::{
    Disposition, ErrorKind, IdempotencyLayer, IdempotencyLayerBuilder, Problem, Subject,
    SubjectExtractor,
};
pub use store::MemoryStore;

/// The sqlx the SQL stores are built on: build your pools with it (or with sqlx of the same
/// major version).
#[cfg(sql)]
#[cfg_attr(
    docsrs,
    doc(cfg(any(feature = "postgres", feature = "sqlite", feature = "mysql")))
)]
#[doc(no_inline)]
pub use sqlx;

/// The redis crate the Redis store is built on: build your `redis::Client` with it (or with redis
/// of the same major version).
#[cfg(feature = "redis")]
#[doc(no_inline)]
pub use redis;

/// The utoipa the OpenAPI description is written with: build your document with it (or with
/// utoipa of the same major version).
#[cfg(feature = "openapi")]
#[doc(no_inline)]
pub use utoipa;
