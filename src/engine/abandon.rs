//! Claims nobody can use, released by their token in the background: a claim that failed in
//! flight (a timeout or a lost connection: the store may still have committed it, or commit it
//! later when the statement is finally delivered), so that no retry waits a whole in-progress TTL
//! for a claim nobody holds; and releases that failed, retried.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::FutureExt;
use tokio::time::Instant;

use super::core::Engine;
use crate::store::{Fenced, IdempotencyStore, LeaseToken, RecordKey, StoreError};

/// Clean-ups of failed claims that may run at once in a process.
const MAX_ABANDONED: usize = 1024;

impl<St: IdempotencyStore> Engine<St> {
    /// Releases `token`'s record in the background until the release takes it, or the maximum
    /// hold and a TTL have passed. (By then its presence, which other leases of this process keep
    /// shown for at most their maximum hold, is let go of, and the record is retakeable after its
    /// TTL.)
    ///
    /// At most [`MAX_ABANDONED`] such clean-ups run at once in a process: during a long outage
    /// every request fails its claim, and beyond that many the records are left to their
    /// presence's end and their TTL rather than piling up tasks that all call the store when it
    /// comes back. A clean-up task
    /// that is dropped (the runtime shut down) gives its place back.
    pub(crate) fn abandon(&self, key: RecordKey, token: LeaseToken) {
        self.abandon_after(key, token, u32::MAX);
    }

    /// [`abandon`](Self::abandon), for a claim that was most likely never granted (a waiter's read
    /// of a finished record, cut at its bound): given up after three answers that nothing is held
    /// by it, so that such clean-ups, which a slow store can make many of, do not fill the bound
    /// on clean-ups for a TTL.
    pub(crate) fn abandon_briefly(&self, key: RecordKey, token: LeaseToken) {
        self.abandon_after(key, token, 3);
    }

    fn abandon_after(&self, key: RecordKey, token: LeaseToken, absent_answers: u32) {
        static RUNNING: AtomicUsize = AtomicUsize::new(0);
        /// Gives the place back however the task ends.
        struct Place;
        impl Drop for Place {
            fn drop(&mut self) {
                RUNNING.fetch_sub(1, Ordering::Relaxed);
            }
        }
        if RUNNING.fetch_add(1, Ordering::Relaxed) >= MAX_ABANDONED {
            RUNNING.fetch_sub(1, Ordering::Relaxed);
            tracing::warn!("too many failed claims being cleaned up; this one waits for its TTL");
            return;
        }
        let place = Place;
        let engine = self.clone();
        self.drain().spawn(async move {
            let _place = place;
            engine.keep_releasing(key, token, absent_answers).await;
        });
    }

    /// Tries to release `token`'s record until it is released, `absent_answers` answers said
    /// nothing was held by it, or, while the store answers, a TTL has passed; once the store has
    /// failed an attempt, the maximum hold and a TTL (at least one attempt is made): a record this
    /// process lets go of unsettled stays in progress while its presence is shown, which other
    /// leases of the presence may keep up to their maximum hold.
    pub(crate) async fn keep_releasing(
        &self,
        key: RecordKey,
        token: LeaseToken,
        absent_answers: u32,
    ) {
        let ttl = self.settings().in_progress_ttl;
        let start = Instant::now();
        // While the store answers that nothing is held by the token, a TTL (the claim may land
        // late); once it fails, the maximum hold and a TTL.
        let mut deadline = start + ttl;
        let mut pause = super::timing::abandon_pause(ttl);
        let mut absent = 0;
        loop {
            tokio::time::sleep(pause).await;
            if Instant::now() > deadline {
                return;
            }
            pause = (pause * 2).min(Duration::from_secs(2));
            match self.release_once(&key, token).await {
                Ok(Fenced::Done) => {
                    tracing::debug!("released a claim whose holder could not use it");
                    return;
                }
                Ok(Fenced::LeaseLost) => {
                    absent += 1;
                    if absent >= absent_answers {
                        return;
                    }
                }
                Err(e) => {
                    tracing::debug!(error = %e, "release not done yet");
                    deadline = deadline.max(start + self.settings().max_hold() + ttl);
                }
            }
        }
    }

    /// One release attempt; a store that panics has failed it (and the release is retried),
    /// rather than leave the record in progress until the TTL.
    pub(crate) async fn release_once(
        &self,
        key: &RecordKey,
        token: LeaseToken,
    ) -> Result<Fenced, StoreError> {
        AssertUnwindSafe(self.store_release(key, token))
            .catch_unwind()
            .await
            .unwrap_or_else(|_| Err(StoreError::msg("the store's release panicked")))
    }
}
