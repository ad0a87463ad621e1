//! Helpers shared by the integration tests: a test app with a counting handler, and request builders.
#![allow(dead_code, unreachable_pub)]

pub mod cache;
#[cfg(feature = "postgres")]
pub mod example;
pub mod openapi;
pub mod proxy;
pub mod restart;
pub mod servers;
#[cfg(feature = "sqlite")]
pub mod sqlite;
pub mod suite;

// The test app, its request and answer helpers, and the behaviour suite are the crate's
// conformance kit (feature `test-suite`): the crate's own stores run it as store authors do.
#[allow(unused_imports)]
pub use axum_idempotency::conformance::app::*;
