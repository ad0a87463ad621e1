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
//! | `in_progress` past the in-progress TTL | same | retaken by compare-and-swap on its lease |
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
//! # fn app() -> Router {
//! let store = MemoryStore::new();
//! // On the handler: a method the route does not serve gets the router's own 405.
//! Router::new().route(
//!     "/checkout",
//!     post(checkout.layer(IdempotencyLayer::new(store))),
//! )
//! // Your auth middleware inserts `axum_idempotency::Subject` into the request extensions.
//! # }
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
//! use axum_idempotency::{CachedStore, spawn_purge};
//! use axum_idempotency::{IdempotencyContext, IdempotencyLayer, IdempotencyTx, PostgresStore};
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
//! let idempotency = IdempotencyLayer::builder(store).require_key(true).build()?;
//! let drain = idempotency.drain();
//!
//! async fn checkout(
//!     ctx: IdempotencyContext,
//!     mut tx: IdempotencyTx,
//!     Json(order): Json<Value>,
//! ) -> Result<(StatusCode, Json<Value>), StatusCode> {
//!     // An outside provider gets ctx.derived_key() as its own idempotency key.
//!     let _provider_key = ctx.derived_key();
//!     // Effects in the layer's transaction: committed with the record of this answer, or not.
//!     sqlx::query("INSERT INTO charges (amount) VALUES ($1)")
//!         .bind(order["amount"].as_i64())
//!         .execute(&mut *tx)
//!         .await
//!         .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
//!     Ok((StatusCode::CREATED, Json(order)))
//! }
//!
//! let app: Router = Router::new().route("/checkout", post(checkout.layer(idempotency)));
//! // Add your auth layer (it inserts `Subject`), serve with a graceful shutdown, then:
//! drain.wait(Duration::from_secs(30)).await;
//! # let _ = app;
//! # Ok(()) }
//! ```
//!
//! Settings are changed through [`IdempotencyLayer::builder`]:
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
//! Every setting, its default and its bounds are in the table on [`IdempotencyLayerBuilder`].
//!
//! Every error the layer itself answers with is `application/problem+json` with a stable `error`
//! field; see [`ErrorKind`].
//!
//! Outside HTTP (a queue consumer, a webhook, a scheduled job), [`RunOnce`] guards a function call
//! with the same stores, lease and recording: given a scope and a fingerprint, it runs an async
//! closure once and returns its recorded output to every later call.
//!
//! # Waiting, hooks, expiry, inspection, and run-once
//!
//! - **Wait instead of 409**: [`IdempotencyLayerBuilder::wait`] lets a duplicate of a request in
//!   progress wait (at most [`MAX_WAIT`]) for its answer and get the replay; no connection or lock
//!   is held while it waits, and a wait never runs the handler.
//! - **Hooks**: [`IdempotencyLayerBuilder::on_replay`] sees every replay and changes its headers;
//!   [`IdempotencyLayerBuilder::render_errors`] renders the layer's own errors ([`Problem`]).
//! - **Expiry for clients**: recorded and replayed answers carry [`IDEMPOTENCY_EXPIRES`], the HTTP
//!   date when the key's record expires.
//! - **Inspection**: every store answers [`IdempotencyStore::lookup`],
//!   [`IdempotencyStore::delete`] (finished records only) and [`IdempotencyStore::list`] (a
//!   subject's records, paged by [`ListCursor`]); the example serves them for the caller's own
//!   checkouts.
//! - **Run once outside HTTP**: [`RunOnce`] guards an async closure (a queue consumer, a webhook,
//!   a job) with the same stores, lease and recording, and returns its recorded output (serde) to
//!   every later call.
//!
//! # Feature flags
//!
//! | feature | default | what it adds |
//! |---|---|---|
//! | `postgres` | on | `PostgresStore` (sqlx 0.9, re-exported as `axum_idempotency::sqlx`) and the handler transaction `IdempotencyTx` |
//! | `redis` | off | `RedisStore` on one server or a Redis Cluster (redis 1, re-exported as `axum_idempotency::redis`) |
//! | `encryption` | off | `EncryptedStore`: recorded headers and bodies sealed with AES-256-GCM over any store |
//! | `metrics` | off | outcome counters by route and store latency histograms through the `metrics` facade |
//! | `test-suite` | off | `conformance`, `store_suite!` and `cache_suite!`: the behaviour suite every store passes, for stores of your own (tests only) |
//!
//! # Implementing a store
//!
//! A store is a type that implements [`IdempotencyStore`]: five atomic operations (claim, complete,
//! renew, release, purge) and three for inspection (lookup, delete, list), whose contracts the
//! trait's documentation states, with an example of a
//! store wrapping another. Check one against the contract with the `test-suite` feature: its
//! `store_suite!` runs the same behaviour suite as the crate's own stores (races, fencing,
//! retention, disconnects, streams) on yours.
//!
//! Stores implement [`IdempotencyStore`]: [`MemoryStore`] (one process, the default for examples
//! and tests), `PostgresStore` (feature `postgres`, on by default) and `RedisStore` (feature
//! `redis`; one server or a Redis Cluster); [`CachedStore`] in front of any of them answers replays
//! without a round trip, and the layer answers duplicates of a request this instance is running
//! without one, over every store. What counts as the same
//! request can be narrowed ([`IdempotencyLayerBuilder::fingerprint_ignore`]). While a request holds
//! its claim, the layer renews it
//! (a heartbeat), so only a claim whose holder died is retaken. On a `PostgresStore`, a handler that takes `IdempotencyTx` writes
//! its effects in the same transaction as the record of its answer: they commit together or not at
//! all. Every claimed request carries an [`IdempotencyContext`], whose derived key is meant for
//! downstream providers. With the feature `encryption`, `EncryptedStore` wraps any store and
//! encrypts the recorded headers and bodies at rest (AES-256-GCM). Outcomes (claimed, replayed, 409, 422, recorded, released, ...) are reported to the
//! tracing span of each request and to an optional hook; see [`OutcomeCounters`]. With the
//! `metrics` feature, they are also counted by route, and every store operation timed, through
//! the `metrics` facade: see the `metrics` module (`idempotency_requests_total{outcome,endpoint}`
//! and `idempotency_store_duration_seconds{operation,result}`).

#![forbid(unsafe_code)]
#![cfg_attr(docsrs, feature(doc_cfg))]
#![warn(missing_docs)]

mod body;
mod builder;
mod canonical_json;
mod claim;
mod coalesce;
mod config;
#[cfg(feature = "test-suite")]
#[cfg_attr(docsrs, doc(cfg(feature = "test-suite")))]
pub mod conformance;
mod context;
mod drain;
mod fingerprint;
#[cfg(test)]
mod forwarding;
mod header_policy;
mod hex;
mod hmac;
mod json_pointer;
pub mod key;
mod layer;
mod lease;
mod lock;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(not(feature = "metrics"))]
mod metrics;
pub mod once;
mod outcome;
mod policy;
mod problem;
mod purge;
mod record;
mod recording;
mod replay;
mod report;
mod secret;
mod service;
pub mod store;
mod subject;
mod time_text;
#[cfg(feature = "postgres")]
mod transaction;
mod wait;

pub use builder::IdempotencyLayerBuilder;
pub use canonical_json::{MAX_DEPTH, canonicalize};
pub use config::{
    ConfigError, DEFAULT_MAX_HOLD, DEFAULT_MAX_RUNNING, DEFAULT_MAX_WAITERS,
    DEFAULT_STORED_HEADERS, DENIED_HEADERS, MAX_BODY_LIMIT, MAX_DURATION, MAX_RESPONSE_LIMIT,
    MAX_WAIT, MIN_IN_PROGRESS_TTL, MIN_RETENTION, TTL_PER_OPERATION_TIMEOUT,
};
pub use context::IdempotencyContext;
pub use drain::Drain;
pub use fingerprint::Fingerprint;
pub use layer::IdempotencyLayer;
#[cfg(feature = "postgres")]
pub use once::OnceTransaction;
pub use once::{OnceError, RunOnce, RunOnceBuilder};
pub use outcome::{Outcome, OutcomeCounters};
pub use policy::{Disposition, default_policy};
pub use problem::{ErrorKind, IdempotencyRejection, Problem};
pub use purge::spawn_purge;
pub use record::{
    ClaimOutcome, ClaimRequest, Fenced, Finished, Generation, LeaseToken, RecordKey, StoredResponse,
};
pub use replay::{IDEMPOTENCY_EXPIRES, IDEMPOTENCY_REPLAY, IDEMPOTENT_REPLAYED};
pub use service::{IdempotencyService, ResponseFuture};
#[cfg(feature = "redis")]
pub use store::RedisStore;
pub use store::{
    CachedStore, Deleted, IdempotencyStore, ListCursor, ListRequest, MemoryStore, RecordInfo,
    RecordPage, RecordState, StoreError,
};
#[cfg(feature = "encryption")]
pub use store::{EncryptedStore, EncryptionKeys, EncryptionKeysError, KeyId};
#[cfg(feature = "postgres")]
pub use store::{PostgresStore, PostgresStoreError};
pub use time_text::rfc3339;
#[cfg(feature = "postgres")]
pub use transaction::IdempotencyTx;

/// The former name of [`IdempotencyTx`], kept for one release.
#[cfg(feature = "postgres")]
#[deprecated(
    since = "0.2.0",
    note = "renamed IdempotencyTx: every type of the crate is Idempotency…"
)]
pub type IdempotentTx = IdempotencyTx;

/// The sqlx the Postgres store is built on: build your `PgPool` with it (or with sqlx of the same
/// major version).
#[cfg(feature = "postgres")]
#[doc(no_inline)]
pub use sqlx;

/// The redis crate the Redis store is built on: build your `redis::Client` with it (or with redis
/// of the same major version).
#[cfg(feature = "redis")]
#[doc(no_inline)]
pub use redis;
pub use subject::{Subject, SubjectExtension, SubjectExtractor};
