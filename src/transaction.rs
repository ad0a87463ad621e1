//! The handler's transaction (`IdempotencyTx`): a handler's effects and its record commit together.
//!
//! The claim stays in its own committed statement. A handler behind a [`PostgresStore`] layer that
//! takes an [`IdempotencyTx`] writes its effects through that transaction; once it has answered, the
//! layer writes the record's completion in the same transaction (conditional on the lease) and
//! commits, and only then does the client see the response. So the effect and the record that says
//! it happened commit together or not at all.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use http::request::Parts;
use sqlx::{PgConnection, Postgres, Transaction};

use crate::config::Config;
use crate::problem::{ErrorKind, IdempotencyRejection};
use crate::store::PostgresStore;

/// The transaction of an idempotent request on a [`PostgresStore`]: write the handler's effects
/// through it, and the layer commits them together with the record of the response.
///
/// ```
/// use axum::{Json, http::StatusCode};
/// use axum_idempotency::{IdempotencyTx, sqlx};
/// use serde_json::{Value, json};
///
/// async fn checkout(
///     mut tx: IdempotencyTx,
///     Json(order): Json<Value>,
/// ) -> Result<(StatusCode, Json<Value>), StatusCode> {
///     let (id,): (i64,) = sqlx::query_as("INSERT INTO charges (amount) VALUES ($1) RETURNING id")
///         .bind(order["amount"].as_i64())
///         .fetch_one(&mut *tx)
///         .await
///         .map_err(|_| StatusCode::SERVICE_UNAVAILABLE)?;
///     Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
/// }
/// # let _ = checkout;
/// ```
///
/// - Do not commit it: the layer does, after writing the record in it. It dereferences to the
///   transaction's [`PgConnection`], so queries take `&mut *tx`.
/// - It is rolled back, and the record released for another try, when the handler panics, returns
///   an error, or answers a status the policy releases (5xx by default). If the record was retaken
///   meanwhile (the lease was lost), it is rolled back and the client gets `409 in_progress`: the
///   retaker's run is the one that counts. If the commit fails, the client gets
///   `503 idempotency_store_unavailable` and the record is released: the effect did not happen.
/// - It holds one pool connection from extraction until the response is recorded, besides the
///   connections the layer uses for claims and heartbeats: size the pool for your concurrent
///   transactional requests plus a few.
/// - The session may stay idle in the transaction (between two of its statements) for at most the
///   in-progress TTL; past it PostgreSQL ends the session, the transaction rolls back and the
///   record is released for another try. A handler that calls something slow while holding it
///   (another service, a provider) should make that call before its first statement, or keep the
///   TTL above it.
/// - Bound the handler's time with the layer's `max_hold` (past it the transaction is rolled
///   back), not with a middleware between the layer and the handler that cancels the handler and
///   answers on its own: the layer cannot tell that answer from the handler's, and commits what the
///   handler had written so far if the policy records its status.
/// - On a route whose layer is not on a `PostgresStore` (or that the layer did not claim: no key,
///   or a failing store with `fail_open`), extracting it answers `500 internal_error` and logs why;
///   the handler does not run without its transaction.
pub struct IdempotencyTx {
    tx: Option<Transaction<'static, Postgres>>,
    slot: Arc<TxSlot>,
}

impl std::fmt::Debug for IdempotencyTx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyTx").finish_non_exhaustive()
    }
}

impl Deref for IdempotencyTx {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        match &self.tx {
            Some(tx) => tx,
            None => unreachable!("the transaction is only taken when IdempotencyTx is dropped"),
        }
    }
}

impl DerefMut for IdempotencyTx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        match &mut self.tx {
            Some(tx) => tx,
            None => unreachable!("the transaction is only taken when IdempotencyTx is dropped"),
        }
    }
}

impl Drop for IdempotencyTx {
    fn drop(&mut self) {
        if let Some(tx) = self.tx.take() {
            *self.slot.lock() = SlotState::Returned(tx);
        }
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyTx {
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let Some(slot) = parts.extensions.get::<Arc<TxSlot>>().cloned() else {
            tracing::error!(
                "IdempotencyTx needs this route's IdempotencyLayer to be on a PostgresStore and the \
                 request to be claimed (an Idempotency-Key, a working store); the handler was not \
                 run without its transaction"
            );
            return Err(IdempotencyRejection::plain(
                ErrorKind::InternalError,
                "this operation needs a transaction the idempotency layer did not provide",
            ));
        };
        take(slot).await
    }
}

/// `Option<IdempotencyTx>`: `None` where the layer offers no transaction (its store is not a
/// `PostgresStore`, or it did not claim the request), for handlers that also run on other stores.
impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyTx {
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        match parts.extensions.get::<Arc<TxSlot>>().cloned() {
            Some(slot) => take(slot).await.map(Some),
            None => Ok(None),
        }
    }
}

/// Begins the transaction in `slot` for the handler.
async fn take(slot: Arc<TxSlot>) -> Result<IdempotencyTx, IdempotencyRejection> {
    {
        let mut state = slot.lock();
        if !matches!(*state, SlotState::Unused) {
            tracing::error!("IdempotencyTx was extracted twice for one request");
            return Err(IdempotencyRejection::new(
                &slot.problems,
                ErrorKind::InternalError,
                "the transaction of this request was already taken",
                None,
            ));
        }
        *state = SlotState::Taken;
    }
    match slot.store.begin(slot.idle).await {
        Ok(tx) => Ok(IdempotencyTx { tx: Some(tx), slot }),
        Err(e) => {
            *slot.lock() = SlotState::Unused;
            tracing::error!(error = %e, "could not begin the handler's transaction");
            Err(IdempotencyRejection::new(
                &slot.problems,
                ErrorKind::StoreUnavailable,
                "the idempotency store is unavailable; retry later",
                Some(slot.retry_after),
            ))
        }
    }
}

/// Where the layer hands the transaction to the handler and gets it back.
pub(crate) struct TxSlot {
    store: PostgresStore,
    /// The longest the transaction may stay idle: the in-progress TTL.
    idle: std::time::Duration,
    /// The layer's `Retry-After` and error types, for the extractor's rejections.
    retry_after: u32,
    problems: crate::problem::ProblemTypes,
    state: Mutex<SlotState>,
}

enum SlotState {
    /// The handler did not take a transaction.
    Unused,
    /// The handler holds it.
    Taken,
    /// The handler dropped it, uncommitted: the layer completes the record in it.
    Returned(Transaction<'static, Postgres>),
    /// The layer took it back.
    Done,
}

/// What the handler left in the slot.
pub(crate) enum Left {
    /// No transaction was taken: record as usual.
    Nothing,
    /// The handler's transaction, to complete and commit.
    Transaction(Transaction<'static, Postgres>),
    /// The handler kept the transaction beyond its answer (moved it into a task): it cannot be
    /// completed atomically.
    Kept,
}

impl TxSlot {
    pub(crate) fn new(store: PostgresStore, config: &Config) -> Arc<Self> {
        Arc::new(TxSlot {
            store,
            idle: config.in_progress_ttl,
            retry_after: config.retry_after_secs,
            problems: config.problems.clone(),
            state: Mutex::new(SlotState::Unused),
        })
    }

    fn lock(&self) -> MutexGuard<'_, SlotState> {
        crate::lock::lock(&self.state)
    }

    /// Takes back what the handler left, once it has answered.
    pub(crate) fn take_back(&self) -> Left {
        match std::mem::replace(&mut *self.lock(), SlotState::Done) {
            SlotState::Unused | SlotState::Done => Left::Nothing,
            SlotState::Taken => Left::Kept,
            SlotState::Returned(tx) => Left::Transaction(tx),
        }
    }
}
