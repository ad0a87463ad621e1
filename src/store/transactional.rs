//! [`TransactionalStore`]: what a store offers when a handler's effects can commit in the same
//! transaction as the record of its answer. Only some stores can; wrappers pass it on by type (a
//! wrapper of a transactional store is transactional), so the generic [`IdempotencyStore`] names
//! no backend.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use super::{
    Fenced, Fingerprint, IdempotencyStore, LeaseToken, RecordKey, RecordedStep, StoreError,
    StoredResponse,
};

/// A store whose records live in a database that the handler's own effects can share a
/// transaction with: the layer begins the transaction when the handler first uses it, writes the
/// completion of the record in it once the handler answered, and commits both together, so that
/// the effect and the record that says it happened commit together or not at all.
///
/// The claim itself never runs in this transaction: it is committed on its own before the handler
/// starts ([`IdempotencyStore::claim`]).
///
/// A wrapper that changes what `complete` writes (an `EncryptedStore` seals the response) must do
/// the same in [`complete_in`](Self::complete_in), or not implement this trait.
pub trait TransactionalStore: IdempotencyStore {
    /// The transaction the handler's effects are written through.
    type Transaction: Send + 'static;

    /// Begins a transaction for a handler. It may stay idle between two statements for at most
    /// `idle` (the time the claim may still be held): the database ends it past that, so a
    /// process that died holding it holds no lock for longer.
    fn begin(
        &self,
        idle: Duration,
    ) -> impl Future<Output = Result<Self::Transaction, StoreError>> + Send;

    /// Completes the record held by `lease` inside `tx` (not committed here), as
    /// [`complete`](IdempotencyStore::complete) would: [`Fenced::LeaseLost`] when the lease no
    /// longer holds it. From here to the commit the record's row is held by `tx`: the store bounds
    /// how long the transaction may then stay idle by the in-progress TTL, so a process that dies
    /// between this and the commit leaves the key retakable within about a TTL. A statement of
    /// the handler's that had failed in `tx` makes this fail with
    /// [`StoreError::aborted_transaction`].
    ///
    /// `steps` are the recovery points the work took in the transaction (SPEC 28): each is
    /// recorded in `tx` before the completion, as [`record_step`](IdempotencyStore::record_step)
    /// records one, so a step and the effects it wrote in the transaction commit together or not
    /// at all. Written only once the transaction is known to be the one that began (the check
    /// above), never on their own. A store that keeps no steps answers its error when `steps` is
    /// not empty.
    #[allow(clippy::too_many_arguments)]
    fn complete_in(
        &self,
        tx: &mut Self::Transaction,
        key: &RecordKey,
        lease: LeaseToken,
        fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
        retention: Duration,
        steps: &[RecordedStep],
    ) -> impl Future<Output = Result<Fenced, StoreError>> + Send;

    /// Commits `tx`.
    fn commit(&self, tx: Self::Transaction) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// Rolls `tx` back.
    fn rollback(
        &self,
        tx: Self::Transaction,
    ) -> impl Future<Output = Result<(), StoreError>> + Send;

    /// After a commit of a transaction holding the completion of `lease`'s record failed: whether
    /// it landed. Releases the record if it did not ([`FailedCommit::Released`]); answers
    /// [`FailedCommit::Landed`] when the record is finished by `lease` (the commit happened, its
    /// answer was lost).
    fn settle_failed_commit(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> impl Future<Output = Result<FailedCommit, StoreError>> + Send;
}

/// What [`TransactionalStore::settle_failed_commit`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailedCommit {
    /// The commit did not land; the record was released (or is no longer this lease's): the
    /// effects did not happen.
    Released,
    /// The commit landed: the record is finished by this lease.
    Landed,
}
