//! The checkout example end to end: served on real listeners over real HTTP on the memory,
//! Postgres and SQLite stores, run as a process of its own (killed and restarted), and with its
//! records in Redis.
//!
//! One test binary for the group (each binary links the whole crate once); every module is one
//! former test file.

#[path = "../common/mod.rs"]
mod common;

mod e2e;
mod example_redis;
mod openapi;
mod sqlite;
mod steps;
