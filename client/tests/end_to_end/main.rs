//! The client end to end: against the idempotency layer in-process, and against the server crate's
//! checkout example as a process (slowed, raced, cut off, restarted).
//!
//! One test binary for the group, so the server crate and reqwest are linked once.
#![allow(clippy::unwrap_used, clippy::expect_used, unreachable_pub)]

mod checkout;
mod layer;
mod support;
