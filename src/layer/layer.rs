//! [`IdempotencyLayer`]: what an application puts on its routes.

use std::sync::Arc;

use tower::Layer;

use super::handler::Transactions;
use super::service::IdempotencyService;
use super::settings::LayerSettings;
use crate::engine::{Drain, Engine};
use crate::store::IdempotencyStore;

/// Makes the routes it wraps safe to retry with the `Idempotency-Key` header.
///
/// `IdempotencyLayer::new(store)` takes the defaults; [`IdempotencyLayer::builder`] changes them.
/// Both check the settings (against the store's operation timeout too). Clones share the store,
/// the settings and the state of the claims this process holds.
pub struct IdempotencyLayer<Store> {
    pub(super) engine: Engine<Store>,
    pub(super) http: Arc<LayerSettings>,
    pub(super) transactions: Option<Arc<dyn Transactions<Store>>>,
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

    /// What this layer is set to, to write into an OpenAPI document: the key parameter, its error
    /// answers and the replay headers on the operations it guards (see
    /// [`openapi`](crate::openapi)).
    #[cfg(feature = "openapi")]
    #[cfg_attr(docsrs, doc(cfg(feature = "openapi")))]
    pub fn openapi(&self) -> crate::openapi::IdempotencyOpenApi {
        crate::openapi::IdempotencyOpenApi::new(self.http.clone())
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
