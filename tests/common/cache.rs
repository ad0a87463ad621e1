//! The cache suite from the crate's conformance kit (`axum_idempotency::conformance::cache`).
//! `cache_suite!` instantiates it, and the whole behavioural suite behind a `CachedStore`.

#[allow(unused_imports)]
pub use axum_idempotency::conformance::cache::*;
