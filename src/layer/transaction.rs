//! The handler's transaction ([`IdempotencyTx`]): a handler's effects and its record commit
//! together, on a store that has transactions (a [`TransactionalStore`] over sqlx).
//!
//! The claim stays in its own committed statement. A handler that takes an [`IdempotencyTx`]
//! writes its effects through it; the transaction begins at its first use, not at extraction, so a
//! handler that calls something slow first (a payment provider) holds no connection in a
//! transaction meanwhile. Once the handler has answered, the layer writes the record's completion
//! in the same transaction (conditional on the lease) and commits, and only then does the client
//! see the response. So the effect and the record that says it happened commit together or not at
//! all.

use std::sync::{Arc, Mutex, MutexGuard};

use axum::body::Body;
use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use futures_util::future::BoxFuture;
use http::request::Parts;
use http::{Request, Response};

use super::handler::{Left, Offered, Transactions, Written};
use super::problem::{ErrorKind, IdempotencyRejection, ProblemTypes};
use super::recording::transactional::record_in;
use super::settings::LayerSettings;
use crate::engine::{IdempotencyContext, Lease, rollback};
use crate::store::{StoreError, TransactionalStore};

/// The transaction of an idempotent request on a store that has transactions (the SQL stores, and
/// wrappers of them): write the handler's effects through it, and the layer commits them together
/// with the record of the response. The layer must be built with
/// [`transactions(true)`](crate::IdempotencyLayerBuilder::transactions). `DB` is the store's
/// database, always written: `IdempotencyTx<sqlx::Postgres>`, `IdempotencyTx<sqlx::Sqlite>`,
/// `IdempotencyTx<sqlx::MySql>`. One of another database than the route's store answers `500`
/// with a log that names both, and its handler does not run.
///
/// ```
/// # #[cfg(feature = "postgres")] {
/// use axum::{Json, http::StatusCode};
/// use axum_idempotency::{IdempotencyTx, sqlx};
/// use serde_json::{Value, json};
///
/// async fn checkout(
///     mut tx: IdempotencyTx<sqlx::Postgres>,
///     Json(order): Json<Value>,
/// ) -> Result<(StatusCode, Json<Value>), StatusCode> {
///     // A slow call to a provider may come first: no transaction is open yet.
///     let unavailable = |_| StatusCode::SERVICE_UNAVAILABLE;
///     let (id,): (i64,) = sqlx::query_as("INSERT INTO charges (amount) VALUES ($1) RETURNING id")
///         .bind(order["amount"].as_i64())
///         .fetch_one(tx.conn().await.map_err(unavailable)?)
///         .await
///         .map_err(unavailable)?;
///     Ok((StatusCode::CREATED, Json(json!({ "id": id }))))
/// }
/// # let _ = checkout;
/// # }
/// ```
///
/// - [`conn`](Self::conn) gives the transaction's connection; the first call begins the
///   transaction. Do not commit it: the layer does, after writing the record in it. A handler that
///   takes it but never calls `conn` is recorded as any other.
/// - It is rolled back, and the record released for another try, when the handler panics, returns
///   an error, or answers a status the policy releases (5xx by default). If the record was retaken
///   meanwhile (the lease was lost), it is rolled back and the client gets `409 in_progress`: the
///   retaker's run is the one that counts. If the commit fails, the client gets
///   `503 idempotency_store_unavailable` and the record is released: the effect did not happen.
/// - Once begun, it holds one pool connection until the response is recorded, besides the
///   connections the layer uses for claims and heartbeats: size the pool for your concurrent
///   transactional requests plus a few (or give the store a pool of its own for transactions).
/// - A live handler may take as long as the maximum hold between, before or after its statements:
///   the transaction is not ended for being idle before that. What a process that died holding it
///   can keep locked is bounded by the maximum hold (its effects' rows) and by about an
///   in-progress TTL (the record's row, locked only from the completion to the commit).
/// - Bound the handler's time with the layer's `max_hold` (past it the transaction is rolled
///   back), not with a middleware between the layer and the handler that cancels the handler and
///   answers on its own: the layer cannot tell that answer from the handler's, and commits what the
///   handler had written so far if the policy records its status.
/// - On a route whose layer offers no transactions (its store has none, `transactions(true)` was
///   not set, or the layer did not claim the request: no key, or a failing store with
///   `fail_open`), extracting it answers `500 internal_error` and logs why; the handler does not
///   run without its transaction. `Option<IdempotencyTx<DB>>` is `None` there instead.
pub struct IdempotencyTx<DB: sqlx::Database> {
    slot: Arc<TxSlot<DB>>,
    tx: Option<sqlx::Transaction<'static, DB>>,
}

impl<DB: sqlx::Database> std::fmt::Debug for IdempotencyTx<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyTx")
            .field("begun", &self.tx.is_some())
            .finish_non_exhaustive()
    }
}

impl<DB: sqlx::Database> IdempotencyTx<DB> {
    /// The transaction's connection, for queries: `query.execute(tx.conn().await?)`. The first
    /// call begins the transaction (within the store's operation timeout); a failure to begin is
    /// the error, and a later call tries again.
    pub async fn conn(&mut self) -> Result<&mut DB::Connection, sqlx::Error> {
        let tx = match self.tx.take() {
            Some(tx) => tx,
            None => {
                let tx = (self.slot.begin)().await.map_err(|e| {
                    tracing::error!(error = %e, "could not begin the handler's transaction");
                    sqlx::Error::Io(std::io::Error::other(e))
                })?;
                // The run's steps from now on are recorded in it (see `IdempotencyContext::step`).
                if let Some(context) = &self.slot.context {
                    context.transaction_begun();
                }
                tx
            }
        };
        Ok(&mut **self.tx.insert(tx))
    }
}

impl<DB: sqlx::Database> Drop for IdempotencyTx<DB> {
    fn drop(&mut self) {
        *self.slot.lock() = SlotState::Returned(self.tx.take());
    }
}

impl<S: Send + Sync, DB: sqlx::Database> FromRequestParts<S> for IdempotencyTx<DB> {
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        let Some(slot) = parts.extensions.get::<Arc<TxSlot<DB>>>().cloned() else {
            if let Some(OfferedDatabase(offered)) = parts.extensions.get::<OfferedDatabase>() {
                // A transaction of another database than the store's: a mistake in the code,
                // said as such rather than as a missing transaction.
                tracing::error!(
                    asked = DB::NAME,
                    offered,
                    "the handler takes an IdempotencyTx of another database than its route's \
                     store: take IdempotencyTx<sqlx::{}>; the handler was not run",
                    sqlx_type(offered)
                );
                return Err(IdempotencyRejection::plain(
                    ErrorKind::InternalError,
                    "this operation's transaction is of another database than the idempotency \
                     store's",
                ));
            }
            tracing::error!(
                "IdempotencyTx needs this route's IdempotencyLayer to be built with \
                 transactions(true) on a store of this database, and the request to be claimed \
                 (an Idempotency-Key, a working store); the handler was not run without its \
                 transaction"
            );
            return Err(IdempotencyRejection::plain(
                ErrorKind::InternalError,
                "this operation needs a transaction the idempotency layer did not provide",
            ));
        };
        take(slot)
    }
}

/// `Option<IdempotencyTx>`: `None` where the layer offers no transaction (its store has none, or
/// it did not claim the request), for handlers that also run on other stores.
impl<S: Send + Sync, DB: sqlx::Database> OptionalFromRequestParts<S> for IdempotencyTx<DB> {
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        match parts.extensions.get::<Arc<TxSlot<DB>>>().cloned() {
            Some(slot) => take(slot).map(Some),
            None => Ok(None),
        }
    }
}

/// Hands the slot's transaction to the handler (not begun yet). The error is the extractors'
/// rejection, which axum takes by value.
#[allow(clippy::result_large_err)]
fn take<DB: sqlx::Database>(
    slot: Arc<TxSlot<DB>>,
) -> Result<IdempotencyTx<DB>, IdempotencyRejection> {
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
    drop(state);
    Ok(IdempotencyTx { slot, tx: None })
}

type Begin<DB> = dyn Fn() -> BoxFuture<'static, Result<sqlx::Transaction<'static, DB>, StoreError>>
    + Send
    + Sync;

/// The name of sqlx's type for the database called `name` (`sqlx::Database::NAME`).
fn sqlx_type(name: &str) -> &str {
    match name {
        "PostgreSQL" => "Postgres",
        "SQLite" => "Sqlite",
        "MySQL" => "MySql",
        other => other,
    }
}

/// The database of the transaction the layer offered for a request (`sqlx::Database::NAME`), so
/// that a handler asking for another database's is told so.
#[derive(Clone, Copy)]
struct OfferedDatabase(&'static str);

/// Where the layer hands the transaction to the handler and gets it back.
pub(crate) struct TxSlot<DB: sqlx::Database> {
    /// Begins the transaction, bounded to be idle no longer than the claim may be held.
    begin: Box<Begin<DB>>,
    /// The layer's error types, for the extractor's rejections.
    problems: ProblemTypes,
    /// The run's context, told when the transaction begins (its steps are then recorded in it).
    context: Option<IdempotencyContext>,
    state: Mutex<SlotState<DB>>,
}

enum SlotState<DB: sqlx::Database> {
    /// The handler did not take a transaction.
    Unused,
    /// The handler holds it.
    Taken,
    /// The handler dropped it, uncommitted (`None`: never begun).
    Returned(Option<sqlx::Transaction<'static, DB>>),
    /// The layer took it back.
    Done,
}

impl<DB: sqlx::Database> TxSlot<DB> {
    fn lock(&self) -> MutexGuard<'_, SlotState<DB>> {
        crate::util::lock::lock(&self.state)
    }
}

/// The layer's transactions on a store whose transactions are sqlx's, of database `DB`.
pub(crate) struct SqlTransactions<DB>(std::marker::PhantomData<fn() -> DB>);

impl<DB> SqlTransactions<DB> {
    pub(crate) fn new() -> Self {
        SqlTransactions(std::marker::PhantomData)
    }
}

impl<St, DB> Transactions<St> for SqlTransactions<DB>
where
    DB: sqlx::Database,
    St: TransactionalStore<Transaction = sqlx::Transaction<'static, DB>>,
{
    fn offer(
        &self,
        lease: &Lease<St>,
        http: &LayerSettings,
        request: &mut Request<Body>,
    ) -> Box<dyn Offered<St>> {
        let store = lease.engine().store().clone();
        let deadline = lease.deadline();
        let begin = {
            let store = store.clone();
            move || -> BoxFuture<'static, _> {
                let store = store.clone();
                Box::pin(async move {
                    // Idle for at most what is left of the maximum hold: a live handler is never
                    // cut for being slow, and a dead one's locks go with its hold.
                    let idle = deadline.saturating_duration_since(tokio::time::Instant::now());
                    store.begin(idle).await
                })
            }
        };
        let slot = Arc::new(TxSlot {
            begin: Box::new(begin),
            problems: http.problems.clone(),
            context: request.extensions().get::<IdempotencyContext>().cloned(),
            state: Mutex::new(SlotState::Unused),
        });
        request.extensions_mut().insert(slot.clone());
        request.extensions_mut().insert(OfferedDatabase(DB::NAME));
        Box::new(SlotEnd { slot, store })
    }
}

/// The layer's end of an offered slot.
struct SlotEnd<St, DB: sqlx::Database> {
    slot: Arc<TxSlot<DB>>,
    store: St,
}

impl<St, DB> Offered<St> for SlotEnd<St, DB>
where
    DB: sqlx::Database,
    St: TransactionalStore<Transaction = sqlx::Transaction<'static, DB>>,
{
    fn take_back(self: Box<Self>) -> Left<St> {
        match std::mem::replace(&mut *self.slot.lock(), SlotState::Done) {
            SlotState::Unused | SlotState::Done | SlotState::Returned(None) => Left::Nothing,
            SlotState::Taken => Left::Kept,
            SlotState::Returned(Some(tx)) => Left::Written(Box::new(WrittenTx {
                tx,
                store: self.store,
                context: self.slot.context.clone(),
            })),
        }
    }
}

/// A transaction the handler wrote through.
struct WrittenTx<St: TransactionalStore> {
    tx: St::Transaction,
    store: St,
    /// The run's context: the steps it took in the transaction are written with the record.
    context: Option<IdempotencyContext>,
}

impl<St: TransactionalStore> Written<St> for WrittenTx<St> {
    fn rollback(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(async move { rollback(&self.store, self.tx).await })
    }

    fn record(
        self: Box<Self>,
        http: Arc<LayerSettings>,
        lease: Lease<St>,
        response: Response<Body>,
    ) -> BoxFuture<'static, Response<Body>> {
        Box::pin(async move {
            let steps = self
                .context
                .as_ref()
                .map(IdempotencyContext::take_transaction_steps)
                .unwrap_or_default();
            record_in(&http, lease, self.tx, response, &steps).await
        })
    }
}
