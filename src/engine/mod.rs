//! The engine: the life of one idempotent operation, the same whichever door it came through (the
//! HTTP layer or [`RunOnce`](crate::once::RunOnce)), and knowing nothing of HTTP.
//!
//! 1. **Claim** ([`Engine::claim`]): a duplicate of a claim this process holds or is making is
//!    answered without the store (see `coalesce`); otherwise the store is asked. A grant answered
//!    late is proven still held (a guarded renewal) before anything runs.
//! 2. **Hold** ([`Lease`]): while the work runs and its answer is recorded, a heartbeat renews the
//!    lease; the work is bounded by the maximum hold.
//! 3. **Settle**: exactly one of complete (retried until the store answers or the lease is lost)
//!    or release. A claim whose answer was lost is released by its token in the background
//!    (`abandon`).
//! 4. **Wait** (opt-in): a duplicate of work in progress waits for its answer instead of `409`.
//! 5. **Drain**: everything run on a task of its own is counted, to wait for at shutdown.
//! 6. **Observe**: every outcome goes to the span, the application's hook and the metrics.
//!
//! Its settings are immutable and validated once ([`Settings`]); its runtime state (the claims
//! this process holds, the duplicates waiting, the drain) lives in one shared [`State`].

mod abandon;
mod claim;
mod coalesce;
mod context;
mod core;
mod drain;
mod keeper;
mod lease;
mod outcome;
mod recheck;
mod report;
mod settings;
mod shares;
mod steps;
mod timing;
mod tombstone;
mod transactional;
mod wait;
mod waiters;

pub(crate) use self::claim::{Claim, Unavailable, span};
pub use self::context::IdempotencyContext;
pub(crate) use self::core::Engine;
pub(crate) use self::drain::Admitted;
pub use self::drain::Drain;
#[cfg(any(test, feature = "test-suite"))]
pub(crate) use self::keeper::stop_for_test as stop_keepers_runtime;
#[cfg(test)]
pub(crate) use self::lease::tests;
pub(crate) use self::lease::{Completed, Lease, Ran};
pub use self::outcome::{Outcome, OutcomeCounters};
pub(crate) use self::recheck::REPLAY_CHECK_BOUND;
pub use self::recheck::ReplayInfo;
pub use self::settings::ConfigError;
#[cfg(test)]
pub(crate) use self::settings::MAX_DURATION;
pub(crate) use self::settings::{DEFAULT_MAX_BYTES_PER_SUBJECT, Settings, engine_setters};
pub(crate) use self::shares::{InFlight, Refused};
pub use self::steps::{MAX_STEP_NAME, MAX_STEP_RESULT, MAX_STEPS, StepError};
pub use self::tombstone::{is_tombstone, tombstone_of};
pub(crate) use self::transactional::{InTransaction, commit_with_record, rollback};
pub(crate) use self::wait::Stage;
