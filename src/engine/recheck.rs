//! What a replay check sees of the record whose answer is about to be replayed: both doors (the
//! layer's `replay_check`, `RunOnce`'s) give it, and may refuse the replay on it.

use std::time::Duration;

use crate::store::{RecordKey, StoredResponse};

/// The longest a replay check may take: past it the replay is refused (the layer's `503`, retryable;
/// `RunOnce`'s `ReplayRefused`), so that a check that hangs holds no request for ever.
pub(crate) const REPLAY_CHECK_BOUND: Duration = Duration::from_secs(10);

/// The record a replay would send: its scope and its recorded answer. Given to the checks that
/// run before a replay is sent (`IdempotencyLayerBuilder::replay_check`,
/// `RunOnceBuilder::replay_check`).
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub struct ReplayInfo<'a> {
    /// The record's scope: key, subject and endpoint.
    pub scope: &'a RecordKey,
    /// Its recorded answer: outcome, status, headers, body, and the time it had left.
    pub record: &'a StoredResponse,
}

impl<'a> ReplayInfo<'a> {
    /// The record of `scope` whose answer is `record`.
    pub fn new(scope: &'a RecordKey, record: &'a StoredResponse) -> Self {
        ReplayInfo { scope, record }
    }
}
