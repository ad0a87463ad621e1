//! Tombstones (opt-in): a record of its own, on a scope no request can name, that outlives a
//! finished record by a set time and holds no answer. A claim that takes a key whose tombstone
//! lives (its record expired within that time) answers "expired" instead of running again.
//!
//! They are written and read through the store's own operations, so every store keeps them, and a
//! wrapper such as `EncryptedStore` hashes their scope as it hashes any other.

use std::sync::Arc;
use std::time::Duration;

use super::core::Engine;
use crate::store::{
    ClaimOutcome, ClaimRequest, Fenced, Fingerprint, Finished, IdempotencyStore, RecordKey,
    RecordState, StoredResponse,
};

/// What starts the endpoint of a tombstone's scope: a space, which starts no HTTP method (the
/// layer's endpoints start with theirs). The engine refuses any other claim of such a scope.
pub(crate) const TOMBSTONE_PREFIX: &str = " tombstone ";

/// The status a tombstone's record keeps (it is never replayed).
const TOMBSTONE_STATUS: u16 = 410;

/// Attempts at writing a tombstone before it is given up (the key then runs again after its
/// record expires, as without tombstones).
const ATTEMPTS: u32 = 4;

/// The scope of the tombstone of `key`'s record: the same key and subject, on an endpoint no
/// request can name. An application that deletes a record of its own (inspection) and wants the
/// key new at once deletes this scope too.
pub fn tombstone_of(key: &RecordKey) -> RecordKey {
    RecordKey {
        key: key.key.clone(),
        subject: key.subject.clone(),
        endpoint: format!("{TOMBSTONE_PREFIX}{}", key.endpoint),
    }
}

/// Whether `key` is a tombstone's scope (inspection lists them with their subject's records).
pub fn is_tombstone(key: &RecordKey) -> bool {
    key.endpoint.starts_with(TOMBSTONE_PREFIX)
}

fn fingerprint() -> Fingerprint {
    Fingerprint::of_material(b"axum-idempotency tombstone")
}

/// What a look at a key's tombstone found.
pub(crate) enum Grave {
    /// None lives: the key's record never finished, or expired longer ago than the tombstones
    /// last.
    Empty,
    /// One lives: the key's record finished and expired within the tombstones' time.
    Found,
}

impl<St: IdempotencyStore> Engine<St> {
    /// Whether tombstones are kept (the settings say how long).
    pub(crate) fn keeps_tombstones(&self) -> bool {
        self.settings().tombstones.is_some()
    }

    /// Writes the tombstone of `key`, whose record was just recorded, to live the retention and
    /// the tombstones' time from now: once before this returns, so that the answer reaches its
    /// client after its tombstone is written (an application that deletes the record once it has
    /// the answer finds the tombstone to delete too), then in the background while the store
    /// fails. Nothing when tombstones are off.
    pub(crate) async fn entomb(&self, key: &RecordKey) {
        let Some(after) = self.settings().tombstones else {
            return;
        };
        let settings = self.settings();
        let lifetime = settings.retention.saturating_add(after);
        // One claim for every attempt: a resend by its own lease is granted again (or answered
        // finished), so an attempt whose claim landed but whose answer was lost is not locked out
        // by its own record. In progress it lives as any claim does; finished, `lifetime`.
        // No work runs under its claim: in progress, it lives two TTLs at most.
        let request = ClaimRequest::new(
            tombstone_of(key),
            fingerprint(),
            settings.in_progress_ttl,
            settings.in_progress_ttl,
        );
        let inline = super::timing::recorded_within(settings.in_progress_ttl);
        let first = tokio::time::timeout(inline, write(self.store(), &request, lifetime)).await;
        if matches!(first, Ok(Ok(()))) {
            self.unless_deleted(key, &request.key).await;
            return;
        }
        let (engine, record) = (self.clone(), key.clone());
        self.drain().spawn(async move {
            let bound = engine.renewal_bound();
            let store = engine.store();
            let mut pause = Duration::from_millis(100);
            for attempt in 2..=ATTEMPTS {
                tokio::time::sleep(pause).await;
                pause *= 4;
                // A record deleted meanwhile (the application made its key new) gets none.
                if let Ok(Ok(None)) = tokio::time::timeout(bound, store.lookup(&record)).await {
                    break;
                }
                let written = tokio::time::timeout(bound, write(store, &request, lifetime)).await;
                match written {
                    Ok(Ok(())) => {
                        engine.unless_deleted(&record, &request.key).await;
                        return;
                    }
                    _ if attempt < ATTEMPTS => {}
                    failed => {
                        let error = match failed {
                            Ok(Err(e)) => e.to_string(),
                            _ => "timed out".to_owned(),
                        };
                        tracing::error!(
                            %error,
                            "the key's tombstone could not be written; once its record expires \
                             the key runs again"
                        );
                    }
                }
            }
            // A claim of it that landed is not left in progress for a TTL.
            let _ = tokio::time::timeout(bound, store.release(&request.key, request.lease)).await;
        });
    }

    /// Deletes the tombstone `tomb` just written for `key` if `key`'s record is gone: an
    /// application deleted it (to make the key new) while the tombstone was being written, and
    /// found none to delete with it. A look-up that fails keeps the tombstone.
    async fn unless_deleted(&self, key: &RecordKey, tomb: &RecordKey) {
        let bound = self.renewal_bound();
        if let Ok(Ok(None)) = tokio::time::timeout(bound, self.store_lookup(key)).await {
            let _ = tokio::time::timeout(bound, self.store().delete(tomb)).await;
        }
    }

    /// Looks for a living tombstone of `key`.
    pub(crate) async fn grave(&self, key: &RecordKey) -> Result<Grave, crate::store::StoreError> {
        match self.store_lookup(&tombstone_of(key)).await? {
            Some(info) if info.state != RecordState::InProgress => Ok(Grave::Found),
            _ => Ok(Grave::Empty),
        }
    }
}

/// [`write_once`], a store that panics taken for one that failed: the answer it follows is
/// recorded, and must reach its client.
async fn write<St: IdempotencyStore>(
    store: &St,
    request: &ClaimRequest,
    lifetime: Duration,
) -> Result<(), crate::store::StoreError> {
    use futures_util::FutureExt;
    std::panic::AssertUnwindSafe(write_once(store, request, lifetime))
        .catch_unwind()
        .await
        .unwrap_or_else(|_| Err(crate::store::StoreError::msg("the store panicked")))
}

/// Claims the tombstone's scope and completes it with an empty answer, to live `lifetime`. A
/// tombstone that lives already (this claim's own, written by an earlier attempt) is left as it
/// is.
async fn write_once<St: IdempotencyStore>(
    store: &St,
    request: &ClaimRequest,
    lifetime: Duration,
) -> Result<(), crate::store::StoreError> {
    match store.claim(request).await? {
        ClaimOutcome::Claimed { lease, .. } => {
            let empty = Arc::new(StoredResponse::new(
                Finished::Completed,
                TOMBSTONE_STATUS,
                Vec::new(),
                Some(bytes::Bytes::new()),
            ));
            let key = &request.key;
            match store
                .complete(key, lease, &request.fingerprint, empty, lifetime)
                .await?
            {
                Fenced::Done => Ok(()),
                Fenced::LeaseLost => Err(crate::store::StoreError::msg(
                    "the tombstone's claim was taken before it was written",
                )),
            }
        }
        ClaimOutcome::Finished(_) => Ok(()),
        ClaimOutcome::InProgress | ClaimOutcome::KeyReuse => Err(crate::store::StoreError::msg(
            "the tombstone's scope is held by another write",
        )),
    }
}
