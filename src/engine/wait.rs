//! The bounded wait of a duplicate for its original's answer (opt-in:
//! [`wait`](crate::IdempotencyLayerBuilder::wait)), instead of `409` at once.
//!
//! - **No connection or lock is held while waiting.** A waiter sleeps; it wakes when this process
//!   lets go of the key (its own holder completed or released it), and otherwise looks the record
//!   up in the store every 25 ms, doubling to 250 ms, so a holder at another instance is seen too.
//! - **A wait never runs the handler.** Only a finished record is answered from (by a claim, which
//!   answers the replay, or `422` for another body); a record released (a retryable answer),
//!   deleted or past its retention gives `409` at once, and the client's retry settles it. A claim
//!   that is granted to a waiter anyway (the record vanished between the look-up and the claim) is
//!   released by its token in the background (as every claim whose answer is not used), and
//!   answered `409`.
//! - **Bounded.** Look-ups are cut at the configured time (a few seconds); the last look-up, and
//!   the claim that reads a finished record's answer, get what is left of it and at least
//!   [`LAST_CLAIM`] each: a waiter is answered within the wait plus half a second. At most
//!   `max_waiters_per_key` waiters a key at this instance; the others get `409` at once.
//! - **A waiter whose client went away is dropped**, not detached as a running request is: it has
//!   nothing to finish, and must not take a place in the layer's admission bound. Only its last
//!   claim, which may need releasing, runs on if the client leaves during it.

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Duration;

use tokio::time::Instant;

use super::coalesce::Scope;
use super::core::Engine;
use crate::store::{ClaimOutcome, ClaimRequest, IdempotencyStore};

/// The first pause between two look-ups of the record; it doubles up to [`LONGEST_POLL`].
const FIRST_POLL: Duration = Duration::from_millis(25);
/// The longest pause between two look-ups of the record.
const LONGEST_POLL: Duration = Duration::from_millis(250);
/// The least time given to the claim that reads a finished record's answer, past the wait.
pub(crate) const LAST_CLAIM: Duration = Duration::from_millis(250);

/// Where a request stands, shared with its door's future: reading its body, running (claiming,
/// running the work, recording or reading the answer), waiting (nothing but look-ups under way),
/// or its client gone. It decides what a future dropped by its client does: before the body is
/// read, and while only waiting, it is dropped outright (nothing is claimed, or nothing is left to
/// finish); once the body is read, what is left runs on, detached.
#[derive(Debug, Default)]
pub(crate) struct Stage(AtomicU8);

const READING: u8 = 0;
const RUNNING: u8 = 1;
const WAITING: u8 = 2;
const GONE: u8 = 3;

impl Stage {
    /// The body is read: from now on the request runs to its end, whether its client stays or
    /// not.
    pub(crate) fn body_read(&self) {
        let _ = self
            .0
            .compare_exchange(READING, RUNNING, Ordering::AcqRel, Ordering::Acquire);
    }

    /// Starts waiting; `false` when the client has gone already (then there is nobody to wait
    /// for: answer at once).
    fn start(&self) -> bool {
        self.0
            .compare_exchange(RUNNING, WAITING, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Stops waiting, before the claim that reads the answer (which must run on if dropped).
    fn stop(&self) {
        let _ = self
            .0
            .compare_exchange(WAITING, RUNNING, Ordering::AcqRel, Ordering::Acquire);
    }

    /// The request's future is dropped (its client went away): `true` when what is left must run
    /// on, detached (the body is read, and it is not only waiting). It is marked gone, so that it
    /// neither starts waiting nor claims once detached.
    pub(crate) fn client_left(&self) -> bool {
        let mut now = self.0.load(Ordering::Acquire);
        loop {
            let (next, detach) = match now {
                READING => (GONE, false),
                RUNNING => (GONE, true),
                _ => return false,
            };
            match self
                .0
                .compare_exchange(now, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return detach,
                Err(actual) => now = actual,
            }
        }
    }
}

impl<St: IdempotencyStore> Engine<St> {
    /// What a duplicate that was answered "in progress" answers after waiting (see the module
    /// docs): the replay or a mismatch from a finished record, or [`ClaimOutcome::InProgress`]
    /// (`409`); with when the claim that read that answer was sent (a replay's expiry is dated
    /// from it, so the waiter's is the holder's).
    ///
    /// `state`, when given, says while nothing but look-ups are under way: a request future
    /// dropped then (its client went away) is dropped outright rather than detached; one whose
    /// client left before the wait does not wait.
    pub(super) async fn wait_for_answer(
        &self,
        claim: &ClaimRequest,
        state: Option<&Stage>,
    ) -> (ClaimOutcome, Instant) {
        let in_progress = || (ClaimOutcome::InProgress, Instant::now());
        if state.is_some_and(|s| !s.start()) {
            return in_progress();
        }
        let scope = Scope::of(&claim.key);
        let settings = self.settings();
        let shares = &self.state.shares;
        let subject = shares.id(&claim.key.subject);
        let Some(_waiting) = shares.wait(
            subject,
            settings.max_waiters_per_subject,
            settings.max_waiters_total,
        ) else {
            tracing::debug!(
                "this subject (or this instance) has its share of waiters; not waiting"
            );
            return in_progress();
        };
        let Some(_place) = self
            .state
            .waiters
            .enter(scope, settings.max_waiters_per_key)
        else {
            tracing::debug!("too many duplicates wait on this key; not waiting");
            return in_progress();
        };
        let deadline = Instant::now() + settings.wait;
        let finished = self.poll_until_finished(claim, scope, deadline).await;
        if let Some(state) = state {
            state.stop();
        }
        if finished {
            let sent = Instant::now();
            let bound = deadline.max(sent + LAST_CLAIM);
            (self.answer_of_finished(claim, bound).await, sent)
        } else {
            in_progress()
        }
    }

    /// Sleeps and looks the record up until it is finished (`true`), or it is gone, still in
    /// progress at `deadline`, or cannot be read (`false`). Every look-up is cut at `deadline`
    /// (the last one, started there, at [`LAST_CLAIM`] after it).
    async fn poll_until_finished(
        &self,
        claim: &ClaimRequest,
        scope: Scope,
        deadline: Instant,
    ) -> bool {
        let mut pause = FIRST_POLL;
        loop {
            let wake = deadline.min(Instant::now() + pause);
            match self.state.local.watch(&scope) {
                // Held here: its let-go wakes this at once, whatever the pause.
                Some(mut released) => {
                    let _ = tokio::time::timeout_at(wake, released.changed()).await;
                }
                None => tokio::time::sleep_until(wake).await,
            }
            pause = (pause * 2).min(LONGEST_POLL);
            // The last look-up starts at the bound: it gets a little time of its own to answer.
            let cut = deadline.max(Instant::now() + LAST_CLAIM);
            match tokio::time::timeout_at(cut, self.store_lookup(&claim.key)).await {
                Ok(Ok(Some(info))) if info.state.is_finished() => return true,
                Ok(Ok(Some(_in_progress))) => {}
                // Released, deleted or expired: the retry runs it, not this wait.
                Ok(Ok(None)) => return false,
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "the record could not be looked up while waiting");
                    return false;
                }
                Err(_) => return false,
            }
            if Instant::now() >= deadline {
                return false;
            }
        }
    }

    /// The answer of a finished record to this request: asked of the store by a claim, which
    /// checks the fingerprint (as its wrappers key it) and opens the record. The claim carries a
    /// lease of its own, so that if it is granted after all it is released by that token, and
    /// nothing runs.
    async fn answer_of_finished(&self, claim: &ClaimRequest, bound: Instant) -> ClaimOutcome {
        let ask = claim.from_another_request();
        let Ok(asked) = tokio::time::timeout_at(bound, self.store_claim(&ask)).await else {
            // Cut: it may have been granted and committed all the same (the record would have to
            // have vanished since the look-up found it finished, so most likely it was not).
            self.abandon_briefly(ask.key, ask.lease);
            return ClaimOutcome::InProgress;
        };
        match asked {
            Ok(ClaimOutcome::Claimed { lease, .. }) => {
                tracing::debug!("the record vanished while a duplicate waited; released, not run");
                self.abandon(ask.key, lease);
                ClaimOutcome::InProgress
            }
            Ok(answer) => answer,
            Err(e) => {
                // Nothing was claimed that needs cleaning up unless the store may have made it.
                if e.may_have_claimed() {
                    self.abandon(ask.key, ask.lease);
                }
                tracing::debug!(error = %e, "a finished record could not be read while waiting");
                ClaimOutcome::InProgress
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_runs_on_only_once_its_body_is_read_and_while_it_does_more_than_wait() {
        let stage = Stage::default();
        assert!(!stage.client_left(), "reading its body: dropped outright");
        let stage = Stage::default();
        stage.body_read();
        assert!(stage.client_left(), "running: detached, and marked gone");
        assert!(!stage.start(), "gone: it does not start waiting");
        let stage = Stage::default();
        stage.body_read();
        assert!(stage.start());
        assert!(!stage.client_left(), "waiting: dropped outright");
        let stage = Stage::default();
        stage.body_read();
        assert!(stage.start());
        stage.stop();
        assert!(stage.client_left(), "reading the answer: detached");
    }
}
