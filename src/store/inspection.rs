//! What the inspection operations of a store answer ([`IdempotencyStore::lookup`](super::IdempotencyStore::lookup),
//! [`IdempotencyStore::delete`](super::IdempotencyStore::delete), [`IdempotencyStore::list`](super::IdempotencyStore::list)): a record as an operator or a client
//! sees it (its state, stored status and times), never its fingerprint, lease or response.
//!
//! Released records (kept by the stores as tombstones until their expiry, so a retry keeps its
//! generation) and records past their retention are not records to anyone outside: the next claim
//! runs the operation. Inspection answers them as absent.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use super::Finished;

/// The state of a record, as inspection shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RecordState {
    /// Claimed: a request holds it (or held it and died; it is retaken after the in-progress TTL,
    /// and on PostgreSQL, MySQL and Redis a TTL after a claim marked it).
    InProgress,
    /// Finished: completed (by default a 2xx answer) or failed for good (by default most 4xx).
    Finished(Finished),
}

impl RecordState {
    /// `in_progress`, `completed` or `failed`, as the stores' columns and fields keep it.
    pub fn as_str(self) -> &'static str {
        match self {
            RecordState::InProgress => "in_progress",
            RecordState::Finished(finished) => finished.as_str(),
        }
    }

    /// The state named `name` ([`as_str`](Self::as_str)'s inverse); `None` for any other name.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "in_progress" => Some(RecordState::InProgress),
            "completed" => Some(RecordState::Finished(Finished::Completed)),
            "failed" => Some(RecordState::Finished(Finished::Failed)),
            _ => None,
        }
    }

    /// Whether the record holds an answer (completed or failed).
    pub fn is_finished(self) -> bool {
        matches!(self, RecordState::Finished(_))
    }
}

impl fmt::Display for RecordState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What one subject holds in a store, as
/// [`IdempotencyStore::count_records`](super::IdempotencyStore::count_records) answers it: its live
/// records, and the bytes of the answers they keep (their bodies; a store may count more of each
/// record, never less). Both are counted no further than the bound asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SubjectUsage {
    /// Live records (released ones included: they are kept until their expiry).
    pub records: u64,
    /// Bytes of the recorded answers' bodies of those records.
    pub bytes: u64,
}

/// A record as [`IdempotencyStore::lookup`](super::IdempotencyStore::lookup) and [`IdempotencyStore::list`](super::IdempotencyStore::list) answer it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecordInfo {
    /// In progress, completed or failed.
    pub state: RecordState,
    /// The stored answer's status code; `None` while in progress.
    pub status: Option<u16>,
    /// When the key was first claimed (a retake keeps it).
    pub created_at: SystemTime,
    /// When the record expires and the key is new again, as the store has it now (an in-progress
    /// record's expiry moves with its heartbeat).
    pub expires_at: SystemTime,
}

impl RecordInfo {
    /// A record's description, for stores outside the crate.
    pub fn new(
        state: RecordState,
        status: Option<u16>,
        created_at: SystemTime,
        expires_at: SystemTime,
    ) -> Self {
        RecordInfo {
            state,
            status,
            created_at,
            expires_at,
        }
    }
}

/// What [`IdempotencyStore::delete`](super::IdempotencyStore::delete) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
#[must_use]
pub enum Deleted {
    /// A finished record was deleted: the key is new, and its next request runs.
    Deleted,
    /// The record is in progress and was left alone: deleting it would let a duplicate run while
    /// its holder still runs.
    InProgress,
    /// There is no record (none, past its retention, or released).
    NotFound,
}

/// The largest page [`IdempotencyStore::list`](super::IdempotencyStore::list) answers.
pub(crate) const MAX_LIST_LIMIT: usize = 100;

/// Where a listing stands: records are listed by the time they were created, then by their scope
/// digest ([`RecordKey::digest`](crate::store::RecordKey::digest)); a page lists those after its cursor.
///
/// Its text form (`Display`, `FromStr`) is what an API hands to clients as an opaque page token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ListCursor {
    /// Microseconds since the Unix epoch.
    created_us: i64,
    scope: [u8; 32],
}

impl ListCursor {
    /// The cursor of a record created at `created_at` with scope digest `scope`.
    pub fn new(created_at: SystemTime, scope: [u8; 32]) -> Self {
        ListCursor {
            created_us: micros(created_at),
            scope,
        }
    }

    /// When the record at the cursor was created, in microseconds since the Unix epoch.
    pub fn created_micros(&self) -> i64 {
        self.created_us
    }

    /// The scope digest of the record at the cursor.
    pub fn scope(&self) -> &[u8; 32] {
        &self.scope
    }
}

/// Microseconds since the Unix epoch (negative before it), saturating.
fn micros(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(e) => i64::try_from(e.duration().as_micros()).map_or(i64::MIN, |m| -m),
    }
}

/// A table row's state, stored status and times as inspection shows them: the status only for a
/// finished record. `store` names the backend in the error for a status it does not know.
#[cfg(sql)]
pub(crate) fn row_info(
    store: &str,
    status: &str,
    response: Option<i64>,
    created_us: i64,
    expires_us: i64,
) -> Result<RecordInfo, super::StoreError> {
    let state = RecordState::from_name(status).ok_or_else(|| {
        super::StoreError::msg(format!("{store} inspection: unexpected status {status:?}"))
    })?;
    let status = if state.is_finished() {
        response.and_then(|s| u16::try_from(s).ok())
    } else {
        None
    };
    Ok(RecordInfo::new(
        state,
        status,
        from_micros(created_us),
        from_micros(expires_us),
    ))
}

/// The time `us` microseconds after the Unix epoch.
#[cfg_attr(not(any(sql, feature = "redis")), allow(dead_code))]
pub(crate) fn from_micros(us: i64) -> SystemTime {
    if us >= 0 {
        UNIX_EPOCH + Duration::from_micros(us.unsigned_abs())
    } else {
        UNIX_EPOCH - Duration::from_micros(us.unsigned_abs())
    }
}

impl fmt::Display for ListCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.", self.created_us)?;
        crate::util::hex::write(f, &self.scope)
    }
}

/// A page token that is not a [`ListCursor`]'s text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidCursor;

impl fmt::Display for InvalidCursor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("not a listing cursor")
    }
}

impl std::error::Error for InvalidCursor {}

impl FromStr for ListCursor {
    type Err = InvalidCursor;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (created, scope) = s.split_once('.').ok_or(InvalidCursor)?;
        // Only the text `Display` writes: digits after an optional minus, lowercase or uppercase
        // hex; no sign inside the hex, no plus.
        let digits = created.strip_prefix('-').unwrap_or(created);
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(InvalidCursor);
        }
        let created_us = created.parse::<i64>().map_err(|_| InvalidCursor)?;
        if scope.len() != 64 || !scope.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(InvalidCursor);
        }
        let mut digest = [0u8; 32];
        for (i, byte) in digest.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&scope[2 * i..2 * i + 2], 16).map_err(|_| InvalidCursor)?;
        }
        Ok(ListCursor {
            created_us,
            scope: digest,
        })
    }
}

/// One page to list: the records after `after` (from the first when `None`), at most `limit` of
/// them (at most 100; a larger limit is taken as that).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListRequest {
    /// Where the previous page ended.
    pub after: Option<ListCursor>,
    /// How many records at most.
    pub limit: usize,
}

impl ListRequest {
    /// The first page of at most `limit` records.
    pub fn first(limit: usize) -> Self {
        ListRequest { after: None, limit }
    }

    /// The limit a store applies: `limit`, at least 1 and at most 100.
    pub fn bounded_limit(&self) -> usize {
        self.limit.clamp(1, MAX_LIST_LIMIT)
    }
}

/// One record of a listing.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListedRecord {
    /// The `Idempotency-Key`, as the store keeps it (empty where a store keeps no scope in clear,
    /// as a `PostgresStore` built `without_scope_columns`).
    pub key: String,
    /// The endpoint (`METHOD /path`), as the store keeps it.
    pub endpoint: String,
    /// State, status and times.
    pub info: RecordInfo,
    /// This record's place in the listing.
    pub cursor: ListCursor,
}

impl ListedRecord {
    /// A listed record, for stores outside the crate.
    pub fn new(key: String, endpoint: String, info: RecordInfo, cursor: ListCursor) -> Self {
        ListedRecord {
            key,
            endpoint,
            info,
            cursor,
        }
    }
}

/// A page of a subject's records, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct RecordPage {
    /// The records of this page.
    pub records: Vec<ListedRecord>,
    /// The cursor to ask the next page with; `None` when this page is the last.
    pub next: Option<ListCursor>,
}

impl RecordPage {
    /// A page of `records` (in listing order) asked with `limit`: it has a next page when it is
    /// full.
    pub fn new(records: Vec<ListedRecord>, limit: usize) -> Self {
        let next = if records.len() >= limit {
            records.last().map(|r| r.cursor)
        } else {
            None
        };
        RecordPage { records, next }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_refuse_garbage() {
        let at = UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
        let cursor = ListCursor::new(at, [0xab; 32]);
        let text = cursor.to_string();
        assert_eq!(text.parse::<ListCursor>(), Ok(cursor));
        assert_eq!(from_micros(cursor.created_micros()), at);
        for bad in [
            "",
            "1",
            "x.ab",
            "1.abc",
            &format!("1.{}", "zz".repeat(32)),
            "1.é",
        ] {
            assert_eq!(bad.parse::<ListCursor>(), Err(InvalidCursor), "{bad:?}");
        }
        let before = UNIX_EPOCH - Duration::from_micros(5);
        assert_eq!(from_micros(micros(before)), before);
    }

    #[test]
    fn a_full_page_has_a_next_one() {
        let info = RecordInfo::new(
            RecordState::Finished(Finished::Completed),
            Some(201),
            UNIX_EPOCH,
            UNIX_EPOCH,
        );
        let record = |n: u8| {
            ListedRecord::new(
                "k".into(),
                "POST /p".into(),
                info.clone(),
                ListCursor::new(UNIX_EPOCH, [n; 32]),
            )
        };
        let full = RecordPage::new(vec![record(1), record(2)], 2);
        assert_eq!(full.next, Some(ListCursor::new(UNIX_EPOCH, [2; 32])));
        assert_eq!(RecordPage::new(vec![record(1)], 2).next, None);
        assert_eq!(ListRequest::first(0).bounded_limit(), 1);
        assert_eq!(ListRequest::first(10_000).bounded_limit(), MAX_LIST_LIMIT);
    }
}
