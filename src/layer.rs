//! [`IdempotencyLayer`]: what an application puts on its routes.

use std::sync::Arc;

use tower::Layer;

use crate::coalesce::Coalesced;
use crate::config::Config;
use crate::drain::Drain;
use crate::service::IdempotencyService;
use crate::store::IdempotencyStore;

/// Makes the routes it wraps safe to retry with the `Idempotency-Key` header.
///
/// `IdempotencyLayer::new(store)` takes the defaults; [`IdempotencyLayer::builder`] changes them.
/// Clones share the store and the settings.
pub struct IdempotencyLayer<S> {
    store: S,
    config: Arc<Config>,
}

impl<S: std::fmt::Debug> std::fmt::Debug for IdempotencyLayer<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyLayer")
            .field("store", &self.store)
            .field("config", &self.config)
            .finish()
    }
}

impl<S: IdempotencyStore> IdempotencyLayer<S> {
    /// A layer with the default settings (see the crate docs' configuration table).
    pub fn new(store: S) -> Self {
        Self::from_parts(store, Config::default())
    }

    pub(crate) fn from_parts(store: S, config: Config) -> Self {
        #[cfg(feature = "metrics")]
        crate::metrics::describe();
        IdempotencyLayer {
            store,
            config: Arc::new(config),
        }
    }

    /// The count of what this layer runs on tasks of its own, to wait for at shutdown (see
    /// [`Drain`]). Clones of the layer, and layers given the same drain, share it.
    pub fn drain(&self) -> Drain {
        self.config.drain.clone()
    }

    /// The store the layer records into.
    pub fn store(&self) -> &S {
        &self.store
    }
}

impl<S: Clone> Clone for IdempotencyLayer<S> {
    fn clone(&self) -> Self {
        IdempotencyLayer {
            store: self.store.clone(),
            config: self.config.clone(),
        }
    }
}

impl<Inner, S: IdempotencyStore> Layer<Inner> for IdempotencyLayer<S> {
    type Service = IdempotencyService<Inner, S>;

    fn layer(&self, inner: Inner) -> Self::Service {
        let store = crate::metrics::store(self.store.clone());
        IdempotencyService::new(
            inner,
            Coalesced::new(store, self.config.local.clone()),
            self.config.clone(),
        )
    }
}
