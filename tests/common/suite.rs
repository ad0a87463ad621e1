//! The behavioural suite every store passes, from the crate's conformance kit
//! (`axum_idempotency::conformance`): the crate's own stores run it as store authors do.
//! `store_suite!` instantiates it for a store.

#[allow(unused_imports)]
pub use axum_idempotency::conformance::suite::*;
