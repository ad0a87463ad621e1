//! The HTTP door: [`IdempotencyLayer`] and the service it builds. It reads what the engine needs
//! from a request (the key, the subject, the endpoint, the body and its fingerprint), hands the
//! claim to the engine, runs the handler under the lease the engine gives, records the answer as
//! it reaches the client, and turns the engine's other answers into replays and problem details.
//!
//! | file | what it does |
//! |---|---|
//! | `builder.rs`, `settings.rs` | the layer's settings and their checks |
//! | `service.rs`, `future.rs` | the tower service and its future (detached when the client leaves) |
//! | `admission.rs` | key, subject and admission, before anything is read |
//! | `run.rs` | one guarded request: body, fingerprint, claim, answer |
//! | `handler.rs` | the handler run under its lease |
//! | `recording/` | the answer recorded while it reaches the client (and in a handler's transaction) |
//! | `replay.rs`, `problem.rs` | a record back into a response; the layer's own error answers |
//! | `transaction.rs` | `IdempotencyTx`, the handler's transaction |

mod admission;
mod body;
mod builder;
mod extract;
mod future;
mod handler;
mod header_policy;
pub mod key;
mod label;
mod policy;
mod problem;
mod recording;
mod replay;
mod run;
mod service;
mod settings;
mod subject;
#[cfg(feature = "postgres")]
mod transaction;

use std::sync::Arc;

use tower::Layer;

pub use self::builder::IdempotencyLayerBuilder;
pub use self::future::ResponseFuture;
pub use self::policy::{Disposition, default_policy};
pub use self::problem::{ErrorKind, IdempotencyRejection, Problem};
pub use self::service::IdempotencyService;
pub use self::subject::{Subject, SubjectExtractor};
#[cfg(feature = "postgres")]
pub use self::transaction::IdempotencyTx;

use self::handler::Transactions;
use self::settings::LayerSettings;
use crate::engine::{Drain, Engine};
use crate::store::IdempotencyStore;

/// Makes the routes it wraps safe to retry with the `Idempotency-Key` header.
///
/// `IdempotencyLayer::new(store)` takes the defaults; [`IdempotencyLayer::builder`] changes them.
/// Both check the settings (against the store's operation timeout too). Clones share the store,
/// the settings and the state of the claims this process holds.
pub struct IdempotencyLayer<Store> {
    engine: Engine<Store>,
    http: Arc<LayerSettings>,
    transactions: Option<Arc<dyn Transactions<Store>>>,
}

impl<Store: std::fmt::Debug> std::fmt::Debug for IdempotencyLayer<Store> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("engine", &self.engine)
            .field("settings", &self.http)
            .field("transactions", &self.transactions.is_some())
            .finish()
    }
}

impl<Store: IdempotencyStore> IdempotencyLayer<Store> {
    /// A layer with the default settings (the table on [`IdempotencyLayerBuilder`]), or why they
    /// do not fit `store` (an in-progress TTL under twice its operation timeout).
    pub fn new(store: Store) -> Result<Self, crate::ConfigError> {
        Self::builder(store).build()
    }

    /// A builder to change the settings; [`IdempotencyLayerBuilder::build`] checks them.
    pub fn builder(store: Store) -> IdempotencyLayerBuilder<Store> {
        IdempotencyLayerBuilder::new(store)
    }

    /// Every guarded request from its admission to its end, and what the layer runs on tasks of
    /// its own, to wait for at shutdown (see [`Drain`]). Clones of the layer, and layers given
    /// the same drain, share it.
    pub fn drain(&self) -> Drain {
        self.engine.drain().clone()
    }

    /// The store the layer records into.
    pub fn store(&self) -> &Store {
        self.engine.store()
    }
}

impl<Store: Clone> Clone for IdempotencyLayer<Store> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            engine: self.engine.clone(),
            http: self.http.clone(),
            transactions: self.transactions.clone(),
        }
    }
}

impl<S, Store: IdempotencyStore> Layer<S> for IdempotencyLayer<Store> {
    type Service = IdempotencyService<S, Store>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService::new(
            inner,
            self.engine.clone(),
            self.http.clone(),
            self.transactions.clone(),
        )
    }
}
