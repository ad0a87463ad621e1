//! The cache suite from the crate's conformance kit (`axum_idempotency::conformance::cache`).
//! `cache_suite!` instantiates it, and the whole behavioural suite behind a `CachedStore`.

#[allow(unused_imports)]
pub use axum_idempotency::conformance::cache::*;

/// Instantiates the cache suite for a store: `axum_idempotency::cache_suite!`.
#[macro_export]
macro_rules! cache_suite {
    ($($args:tt)*) => {
        axum_idempotency::cache_suite!($($args)*);
    };
}
