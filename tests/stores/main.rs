//! The stores under the layer: the shared behavioural suite on the memory store, Postgres, SQLite,
//! Redis and a Redis Cluster, the cache of finished records, encryption at rest, and the property
//! tests of the fingerprint and the key grammar.
//!
//! One test binary for the group (each binary links the whole crate once); every module is one
//! former test file.

#[path = "../common/mod.rs"]
mod common;

mod encryption;
mod flood;
mod liveness;
mod locked_rows;
mod memory;
mod mysql;
mod postgres;
mod properties;
mod redis_cluster;
mod redis_store;
mod sql_backends;
mod sqlite;
#[cfg(any(feature = "postgres", feature = "sqlite"))]
mod together;
