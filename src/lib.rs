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
//! Every error the layer itself answers with is `application/problem+json` with a stable `error`
//! field; see [`ErrorKind`].
//!
//! Stores implement [`IdempotencyStore`]: [`MemoryStore`] (one process, the default for examples
//! and tests), `PostgresStore` (feature `postgres`, on by default) and `RedisStore` (feature
//! `redis`; one server or a Redis Cluster); [`CachedStore`] in front of any of them answers replays,
//! and duplicates arriving at the same instance, without a round trip. What counts as the same
//! request can be narrowed ([`IdempotencyLayerBuilder::fingerprint_ignore`]). While a request holds
//! its claim, the layer renews it
//! (a heartbeat), so only a claim whose holder died is retaken. On a `PostgresStore`, a handler that takes `IdempotentTx` writes
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
mod canonical_json;
mod claim;
mod config;
mod context;
mod drain;
mod fingerprint;
mod json_pointer;
pub mod key;
mod layer;
mod lease;
#[cfg(feature = "metrics")]
pub mod metrics;
#[cfg(not(feature = "metrics"))]
mod metrics;
mod outcome;
mod policy;
mod problem;
mod record;
mod recording;
mod replay;
mod service;
pub mod store;
mod subject;

pub use canonical_json::{MAX_DEPTH, canonicalize};
pub use config::{
    ConfigError, DEFAULT_MAX_HOLD, DEFAULT_MAX_RUNNING, DEFAULT_STORED_HEADERS, DENIED_HEADERS,
    IdempotencyLayerBuilder, MAX_BODY_LIMIT, MAX_DURATION, MAX_RESPONSE_LIMIT, MIN_IN_PROGRESS_TTL,
    MIN_RETENTION, TTL_PER_OPERATION_TIMEOUT,
};
pub use context::IdempotencyContext;
pub use drain::Drain;
pub use fingerprint::Fingerprint;
pub use layer::IdempotencyLayer;
pub use outcome::{Outcome, OutcomeCounters};
pub use policy::{Disposition, default_policy};
pub use problem::ErrorKind;
pub use record::{
    ClaimOutcome, ClaimRequest, Finished, Generation, LeaseToken, RecordKey, StoredResponse,
};
pub use replay::{IDEMPOTENCY_REPLAY, IDEMPOTENT_REPLAYED};
pub use service::{IdempotencyService, ResponseFuture};
#[cfg(feature = "redis")]
pub use store::RedisStore;
pub use store::{CachedStore, IdempotencyStore, MemoryStore, StoreError};
#[cfg(feature = "encryption")]
pub use store::{EncryptedStore, EncryptionKeys, EncryptionKeysError, KeyId};
#[cfg(feature = "postgres")]
pub use store::{IdempotentTx, PostgresStore, PostgresStoreError};
pub use subject::{Subject, SubjectExtension, SubjectExtractor};
