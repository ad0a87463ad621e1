//! The behaviour suite every store must pass, for authors of stores outside the crate (feature
//! `test-suite`). The crate's own stores (memory, Postgres, Redis, Redis Cluster, and every wrapper
//! over them) run exactly this suite.
//!
//! [`store_suite!`](crate::store_suite) instantiates one `#[tokio::test]` per behaviour for a
//! store: one per row of the claim table (fresh, replay, `422`, `409`, retake), races of many tasks
//! on one key, lease fencing, retention, disconnects, panics, streamed and oversized bodies, a
//! handler that blocks its thread, generations, and the layer's answers through a real router.
//! [`cache_suite!`](crate::cache_suite) runs it again behind a [`CachedStore`](crate::store::CachedStore)
//! with the cache's own tests. Every test takes a fresh store from the expression you give, so a
//! store on a shared server should give each one a table, schema or key prefix of its own.
//!
//! In `tests/store.rs` of a crate with a store `MyStore` (a dev-dependency on this crate with the
//! feature `test-suite`, and on tokio with `macros` and `rt-multi-thread`):
//!
//! ```no_run
//! # use axum_idempotency::MemoryStore as MyStore;
//! // Five expired records are purged by `purge_expired` (0 for a backend that expires records
//! // itself, as Redis does).
//! axum_idempotency::store_suite!(async { MyStore::new() }, purged = 5);
//! axum_idempotency::cache_suite!(async { MyStore::new() }, purged = 5);
//! # fn main() {}
//! ```
//!
//! Each behaviour is also a plain async function, to run on its own:
//!
//! ```
//! use axum_idempotency::MemoryStore;
//! use axum_idempotency::conformance::suite;
//!
//! #[tokio::main]
//! async fn main() {
//!     suite::fresh_key_runs_once_then_replays(MemoryStore::new()).await;
//!     suite::same_key_race_runs_once(MemoryStore::new()).await;
//!     suite::stale_retake_race_has_one_winner(MemoryStore::new()).await;
//! }
//! ```
//!
//! For tests only: the test app ([`app::app`]) takes the subject from a request header, which no
//! real application may do; nothing in the kit is meant for a server.
//!
//! The suite's in-progress TTLs are short (a few hundred milliseconds), and never under
//! twice the store's operation timeout
//! ([`operation_timeout`](crate::store::IdempotencyStore::operation_timeout)): give the store under test a
//! short one ([`SUITE_STORE_TIMEOUT`](app::SUITE_STORE_TIMEOUT)) to keep the suite fast. Its tests
//! panic on the first behaviour that differs, naming it.

pub mod app;
pub mod cache;
mod inspection;
pub mod locked;
mod steps;
pub mod suite;
pub mod tenants;
mod tombstones;
mod waiting;

/// Ends the lease keepers' runtime (the thread every keeper of the process renews on) as if it
/// had failed: its thread starts another and restarts on it every keeper that has leases, with no
/// new claim needed. For tests that the keeper restarts by itself; `false` when it was not running.
pub fn fail_the_keepers_runtime() -> bool {
    crate::engine::stop_keepers_runtime()
}
