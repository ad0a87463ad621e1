//! Claims and completions sent together (SPEC 26): what arrives while statements of its kind are
//! in flight goes in the next one, as multi-row statements that keep each row's own answer (see
//! `store::sql::batch`). A claim's answer is read back by its own lease, a completion's by its
//! own lease too. Retakes, marks of silent holders, renewals (the keeper already sends them
//! together), releases and completions in a handler's transaction are not batched.

use std::sync::Arc;
use std::time::Duration;

use sqlx::Row;

use super::claim::decide;
use super::statements::Completing;
use super::{Answer, MySqlStore, error_number, subject_digest};
use crate::store::sql::batch::{Batcher, Mode, Rows, release_orphan};
use crate::store::{ClaimOutcome, ClaimRequest, LeaseToken, StoreError, StoredResponse};

/// The most bytes of recorded answers (bodies and headers) one completion batch carries; a
/// completion past it goes alone. The batch is sent in hexadecimal, and the server's
/// `max_allowed_packet` is only required to hold one answer.
const COMPLETION_BYTES: usize = 256 * 1024;

/// The store's batchers, shared by its clones with the same settings.
#[derive(Debug)]
pub(super) struct Batches {
    pub(super) claims: Arc<Batcher<Claims>>,
    pub(super) completions: Arc<Batcher<Completions>>,
    pub(super) mode: Mode,
}

impl Batches {
    pub(super) fn new(mode: Mode) -> Self {
        Batches {
            claims: mode.batcher(),
            completions: mode.batcher(),
            mode,
        }
    }
}

impl Default for Batches {
    fn default() -> Self {
        Batches::new(Mode::default())
    }
}

/// A claim, as the batch needs it.
pub(super) struct Claim {
    request: ClaimRequest,
    scope: [u8; 32],
}

/// Claims. The answer is the claim's outcome.
#[derive(Debug)]
pub(super) struct Claims;

impl Rows for Claims {
    type Store = MySqlStore;
    type Item = Claim;
    type Answer = Result<ClaimOutcome, StoreError>;

    fn scope(item: &Claim) -> &[u8; 32] {
        &item.scope
    }

    async fn one(store: &MySqlStore, item: &Claim) -> Self::Answer {
        store.claim_alone(&item.request, &item.scope).await
    }

    async fn many(store: &MySqlStore, items: &[&Claim]) -> Option<Vec<Option<Self::Answer>>> {
        let claims: Vec<(&ClaimRequest, &[u8; 32])> =
            items.iter().map(|c| (&c.request, &c.scope)).collect();
        claim_rows(store, &claims).await
    }

    /// A claim whose request left while it was in flight: released by its lease (see
    /// `release_orphan`), unless its answer says it was not granted, or nothing was written.
    async fn orphaned(store: MySqlStore, item: Claim, answer: Self::Answer) {
        match &answer {
            Ok(ClaimOutcome::Claimed { .. }) => {}
            Err(e) if e.may_have_claimed() => {}
            _ => return,
        }
        release_orphan(&store, &item.request).await;
    }
}

/// The claims of `claims` (distinct scopes) in one round trip (see `Statements::claim_many`), each
/// answered with its outcome, or `None` for a claim that must go alone: its record is there to
/// take (past its expiry, released, or its holder silent), or was not there to read. `None` for
/// all when the server refused a statement before the insert answered (nothing was written). A
/// batch that failed after its insert answered, or whose connection failed, or without an answer
/// in time, answers every claim so: it may have claimed, and the engine releases it by its lease.
///
/// A batch whose insert waited on a lock past its bound (a table another session locked, or the
/// uncommitted insert of a key it carries) inserted nothing (the statement was rolled back): each
/// claim is answered from its record as committed now, read in one statement (as the single claim
/// answers after such a wait). One with no record is refused (`503`) when the statement was cut
/// at its time bound (a table lock: alone it would wait as long again), and goes alone after a row
/// lock's wait or a deadlock (one key's). If that read fails too, each claim is refused when the
/// insert was the statement cut (nothing was written), and answers an error that may have claimed
/// when the read was (the engine releases it by its lease).
async fn claim_rows(
    store: &MySqlStore,
    claims: &[(&ClaimRequest, &[u8; 32])],
) -> Option<Vec<Option<Result<ClaimOutcome, StoreError>>>> {
    let digests: Vec<[u8; 32]> = claims
        .iter()
        .map(|(request, _)| subject_digest(&request.key.subject))
        .collect();
    let rows: Vec<(&ClaimRequest, &[u8; 32], &[u8; 32])> = claims
        .iter()
        .zip(&digests)
        .map(|((request, scope), digest)| (*request, *scope, digest))
        .collect();
    let (answers, waited) = match store
        .batch_counted("claim", &store.sql.claim_many(&rows, true))
        .await
    {
        Ok(Ok(answers)) => (answers, None),
        // Its first two statements are the isolation level's and the insert's: the insert
        // answered (and committed) when two had.
        Ok(Err((e, answered))) if matches!(error_number(&e), Some(1205 | 1213 | 1969 | 3024)) => {
            let inserted = answered >= 2;
            match store
                .batch("claim", &store.sql.claim_many(&rows, false))
                .await
            {
                Ok(Ok(answers)) => (answers, Some(e)),
                // The insert was the statement cut (rolled back), and the records cannot be read
                // (the table is still locked): nothing was written; each claim is refused, never
                // run unguarded.
                Ok(Err(read)) if !inserted => {
                    let e = StoreError::refused_claim(format!(
                        "mysql claim: a lock wait ({e}) cut the insert, then the records could \
                         not be read: {read}"
                    ));
                    return Some(claims.iter().map(|_| Some(Err(e.copy()))).collect());
                }
                Err(read) if !inserted => {
                    let e = StoreError::refused_claim(format!(
                        "mysql claim: a lock wait ({e}) cut the insert, then the records could \
                         not be read: {read}"
                    ));
                    return Some(claims.iter().map(|_| Some(Err(e.copy()))).collect());
                }
                // The insert answered before the wait (the read was cut): each claim may have
                // been made, and is released by its lease.
                Ok(Err(read)) => {
                    let e = StoreError::new(
                        format!(
                            "mysql claim: a lock wait ({e}), then the records could not be read"
                        ),
                        read,
                    );
                    return Some(claims.iter().map(|_| Some(Err(e.copy()))).collect());
                }
                Err(read) => {
                    let e = StoreError::msg(format!(
                        "mysql claim: a lock wait ({e}), then the records could not be read: {read}"
                    ));
                    return Some(claims.iter().map(|_| Some(Err(e.copy()))).collect());
                }
            }
        }
        // The server refused a statement before the insert answered: nothing of this batch was
        // written, and each claim goes alone.
        Ok(Err((e, answered))) if e.as_database_error().is_some() && answered < 2 => {
            tracing::debug!(error = %e, rows = claims.len(), "mysql claims together failed; each goes alone");
            return None;
        }
        // The insert may have written (it answered, or the connection failed under it): each
        // claim may have been made, and is released by its lease (sent alone, a later attempt
        // that met a locked table could not tell that this one wrote).
        Ok(Err((e, _))) => {
            let e = StoreError::new("mysql claims together failed after their insert", e);
            return Some(claims.iter().map(|_| Some(Err(e.copy()))).collect());
        }
        Err(e) => return Some(claims.iter().map(|_| Some(Err(e.copy()))).collect()),
    };
    let Some((mut outcomes, found)) = answered(claims, &answers) else {
        let e = StoreError::msg("mysql claims together: their read answered another shape");
        return Some(claims.iter().map(|_| Some(Err(e.copy()))).collect());
    };
    // A statement cut at its time bound (a table another session locked: nothing the rows do):
    // a claim with no record is refused. A row lock's wait or a deadlock is one key's: a claim
    // with no record goes alone.
    if let Some(waited) = waited.filter(|e| matches!(error_number(e), Some(1969 | 3024))) {
        for (outcome, found) in outcomes.iter_mut().zip(found) {
            if !found {
                *outcome = Some(Err(StoreError::refused_claim(format!(
                    "mysql claim: the table is locked by another session: {waited}"
                ))));
            }
        }
    }
    Some(outcomes)
}

/// Each claim's outcome from the batch's read (`None` for one that goes alone), and whether its
/// record was found; `None` when the read has another shape.
#[allow(clippy::type_complexity)]
fn answered(
    claims: &[(&ClaimRequest, &[u8; 32])],
    answers: &[Answer],
) -> Option<(Vec<Option<Result<ClaimOutcome, StoreError>>>, Vec<bool>)> {
    let read = answers.last()?;
    let mut outcomes: Vec<Option<Result<ClaimOutcome, StoreError>>> =
        (0..claims.len()).map(|_| None).collect();
    let mut found = vec![false; claims.len()];
    for row in &read.rows {
        let (Ok(i), Ok(alone)) = (row.try_get::<i64, _>("i"), row.try_get::<i64, _>("alone"))
        else {
            return None;
        };
        let i = usize::try_from(i).ok()?;
        let (request, _) = claims.get(i)?;
        if std::mem::replace(found.get_mut(i)?, true) {
            return None;
        }
        if alone == 0 {
            outcomes[i] = Some(decide(request, row));
        }
    }
    Some((outcomes, found))
}

/// A completion, as the batch needs it.
pub(super) struct Completion {
    scope: [u8; 32],
    lease: LeaseToken,
    response: Arc<StoredResponse>,
    /// The response's headers, encoded.
    headers: Vec<u8>,
    retention: Duration,
}

/// Completions outside a handler's transaction. The answer: whether the lease finished the record
/// (by this completion, or an earlier attempt of it).
#[derive(Debug)]
pub(super) struct Completions;

impl Rows for Completions {
    type Store = MySqlStore;
    type Item = Completion;
    type Answer = Result<bool, StoreError>;

    fn scope(item: &Completion) -> &[u8; 32] {
        &item.scope
    }

    async fn one(store: &MySqlStore, item: &Completion) -> Self::Answer {
        store
            .complete_alone(
                &item.scope,
                item.lease,
                &item.response,
                &item.headers,
                item.retention,
            )
            .await
    }

    async fn many(store: &MySqlStore, items: &[&Completion]) -> Option<Vec<Option<Self::Answer>>> {
        // The batch carries answers up to its share of bytes, in order; the rest go alone.
        let mut bytes = 0;
        let carried: Vec<usize> = (0..items.len())
            .filter(|&i| {
                let size = items[i].response.body.len() + items[i].headers.len();
                let fits = bytes + size <= COMPLETION_BYTES;
                if fits {
                    bytes += size;
                }
                fits
            })
            .collect();
        let mut answers: Vec<Option<Self::Answer>> = (0..items.len()).map(|_| None).collect();
        if carried.is_empty() {
            return Some(answers);
        }
        let rows: Vec<Completing<'_>> = carried
            .iter()
            .map(|&i| Completing {
                scope: &items[i].scope,
                lease: items[i].lease,
                response: &items[i].response,
                headers: &items[i].headers,
                retention: items[i].retention,
            })
            .collect();
        let batch = store.sql.complete_many(&rows);
        let done = match store.batch("complete", &batch).await {
            Ok(Ok(statements)) => finished(&statements, carried.len())?,
            // Any statement failed: each completion goes again alone (a completion is safe to
            // repeat under its lease: the lease finished the record, or did not).
            Ok(Err(e)) => {
                tracing::debug!(error = %e, rows = carried.len(), "mysql completions together failed; each goes alone");
                return None;
            }
            // No answer in time: the rows it carried may have been written; each answers so.
            Err(e) => carried.iter().map(|_| Err(e.copy())).collect(),
        };
        for (i, answer) in carried.into_iter().zip(done) {
            answers[i] = Some(answer);
        }
        Some(answers)
    }

    /// A completion is the engine's to retry; a request that left needs nothing undone.
    async fn orphaned(_: MySqlStore, _: Completion, _: Self::Answer) {}
}

/// Each completion's answer from the batch's statements (the isolation level, the lock wait, the
/// update, the read): all of them updated, or the read shows the row finished by its lease. `None` when the
/// answers have another shape.
fn finished(answers: &[Answer], rows: usize) -> Option<Vec<Result<bool, StoreError>>> {
    let [_, _, update, read] = answers else {
        return None;
    };
    let all = update.affected == rows as u64;
    let mut done: Vec<Option<bool>> = vec![None; rows];
    for row in &read.rows {
        let i = usize::try_from(row.try_get::<i64, _>("i").ok()?).ok()?;
        let finished = row.try_get::<Option<i64>, _>("done").ok()?.unwrap_or(0) == 1;
        if done.get_mut(i)?.replace(all || finished).is_some() {
            return None;
        }
    }
    // A row the read did not find (the record deleted meanwhile): fenced, unless all updated.
    Some(done.into_iter().map(|d| Ok(d.unwrap_or(all))).collect())
}

impl MySqlStore {
    /// A claim alone: the batch of many with one row, which never waits on the lock of a record
    /// that is there (a handler's transaction committing it); the single claim
    /// (`claim_record`: insert, take, read) when that gave no answer (the record is there to
    /// take, or the batch failed).
    pub(super) async fn claim_alone(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
    ) -> Result<ClaimOutcome, StoreError> {
        match claim_rows(self, &[(request, scope)]).await {
            Some(mut answers) => match answers.pop().flatten() {
                Some(answer) => answer,
                None => self.claim_record(request).await,
            },
            None => self.claim_record(request).await,
        }
    }

    /// A claim, alone or together with others.
    pub(super) async fn claim_together(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        if self.batches.mode == Mode::Off {
            return self.claim_record(request).await;
        }
        let scope = request.key.digest();
        self.batches
            .claims
            .send(
                self,
                self.claim_alone(request, &scope),
                || Claim {
                    request: request.clone(),
                    scope,
                },
                self.timeout,
            )
            .await
            .into_result(
                || self.no_answer("claim"),
                || {
                    StoreError::refused_claim(
                        "mysql claim: queued behind the claims in flight past the operation \
                         timeout; nothing was sent",
                    )
                },
            )
    }

    /// The completion alone: its update, then whether the lease finished the record.
    async fn complete_alone(
        &self,
        scope: &[u8; 32],
        lease: LeaseToken,
        response: &StoredResponse,
        headers: &[u8],
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let batch = self
            .sql
            .complete(scope, lease, response, headers, retention);
        let answers = self.answers("complete", &batch).await?;
        Ok(matches!(
            super::held_after_completion(&answers)?,
            crate::store::Fenced::Done
        ))
    }

    /// A completion, alone or together with others: whether the lease finished the record.
    pub(super) async fn complete_together(
        &self,
        scope: &[u8; 32],
        lease: LeaseToken,
        response: Arc<StoredResponse>,
        retention: Duration,
    ) -> Result<bool, StoreError> {
        let mut headers = Vec::new();
        crate::store::header_list::write(&response.headers, &mut headers)
            .ok_or_else(|| StoreError::msg("mysql complete: too many headers"))?;
        let alone = self.complete_alone(scope, lease, &response, &headers, retention);
        self.batches
            .completions
            .send(
                self,
                alone,
                || Completion {
                    scope: *scope,
                    lease,
                    response: response.clone(),
                    headers: headers.clone(),
                    retention,
                },
                self.timeout,
            )
            .await
            .into_result(
                || self.no_answer("complete"),
                || StoreError::msg("mysql complete: queued past the operation timeout; not sent"),
            )
    }
}
