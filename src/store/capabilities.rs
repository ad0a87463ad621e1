//! What a store offers the layer beyond storage, and what a store wrapping another must pass on:
//! one value, from one required method ([`IdempotencyStore::capabilities`]), so that a wrapper
//! cannot drop a capability of its inner store by leaving a provided method to its default (two
//! bugs came from that).

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use super::StoreError;
use crate::Fingerprint;
use crate::record::{RecordKey, StoredResponse};

#[cfg(feature = "postgres")]
use super::PostgresStore;

#[cfg(doc)]
use super::IdempotencyStore;

/// What a store offers beyond its five operations, as [`IdempotencyStore::capabilities`] answers
/// it. A store of its own answers [`Capabilities::none`] (with its operation timeout, if it bounds
/// its operations); a store wrapping another answers the inner store's, with what it adds.
///
/// **A wrapper that changes responses on their way into `complete`** (compresses, encrypts,
/// rewrites them) must add the same change as a [`ResponseTransform`]
/// ([`transformed_by`](Self::transformed_by)), or answer
/// [`without_postgres`](Self::without_postgres): records written in a handler's transaction
/// (`IdempotencyTx`) do not go through its `complete`, and would be written unchanged. A wrapper
/// that only forwards or observes passes the inner store's on as they are:
///
/// ```
/// # use axum_idempotency::store::Capabilities;
/// # use axum_idempotency::{IdempotencyStore, MemoryStore};
/// # struct Wrapper<S> { inner: S }
/// # impl<S: IdempotencyStore> Wrapper<S> {
/// fn capabilities(&self) -> Capabilities<'_> {
///     self.inner.capabilities()
/// }
/// # }
/// ```
///
/// - the **operation timeout**: the longest one operation of the store may take before it fails;
///   [`build`](crate::IdempotencyLayerBuilder::build) refuses an in-progress TTL under
///   [`TTL_PER_OPERATION_TIMEOUT`](crate::TTL_PER_OPERATION_TIMEOUT) times it;
/// - the **Postgres store** whose transactions handlers can take (`IdempotencyTx`, feature
///   `postgres`);
/// - the **response transforms**: how the wrappers change a response on its way into `complete`
///   (an `EncryptedStore` seals it), applied, outermost first, to a record the layer writes itself
///   in a handler's transaction.
#[must_use]
pub struct Capabilities<'a> {
    operation_timeout: Option<Duration>,
    #[cfg(feature = "postgres")]
    postgres: Option<&'a PostgresStore>,
    transforms: Vec<&'a dyn ResponseTransform>,
}

/// How a wrapper changes a response on its way into `complete`, for a record the layer writes in a
/// handler's transaction: it must write what `complete` would have written.
pub trait ResponseTransform: Send + Sync {
    /// `response` as this wrapper hands it to its inner store. `fingerprint` is the claim's as
    /// this wrapper receives it; set it to the one the inner store receives (a wrapper that keys
    /// fingerprints passes its keyed one on). An error rolls the transaction back and releases the
    /// record, as a failed completion does.
    fn transform(
        &self,
        key: &RecordKey,
        fingerprint: &mut Fingerprint,
        response: Arc<StoredResponse>,
    ) -> Result<Arc<StoredResponse>, StoreError>;
}

impl<'a> Capabilities<'a> {
    /// Nothing beyond storage: no operation timeout, no transactions, no transform.
    pub fn none() -> Self {
        Capabilities {
            operation_timeout: None,
            #[cfg(feature = "postgres")]
            postgres: None,
            transforms: Vec::new(),
        }
    }

    /// With the store's operation timeout.
    pub fn with_operation_timeout(mut self, timeout: Duration) -> Self {
        self.operation_timeout = Some(timeout);
        self
    }

    /// With the Postgres store whose transactions handlers take.
    #[cfg(feature = "postgres")]
    pub fn with_postgres(mut self, store: &'a PostgresStore) -> Self {
        self.postgres = Some(store);
        self
    }

    /// Without transactions: for a wrapper that changes responses in `complete` and cannot do the
    /// same as a [`ResponseTransform`].
    #[cfg(feature = "postgres")]
    pub fn without_postgres(mut self) -> Self {
        self.postgres = None;
        self
    }

    /// With `transform` applied before the inner stores' (a wrapper adds its own this way).
    pub fn transformed_by(mut self, transform: &'a dyn ResponseTransform) -> Self {
        self.transforms.insert(0, transform);
        self
    }

    /// The operation timeout, if the store bounds its operations.
    pub fn operation_timeout(&self) -> Option<Duration> {
        self.operation_timeout
    }

    /// The Postgres store whose transactions handlers can take, if any.
    #[cfg(feature = "postgres")]
    pub fn postgres(&self) -> Option<&'a PostgresStore> {
        self.postgres
    }

    /// `response` as the store would write it through `complete`: every transform applied,
    /// outermost first.
    pub fn transform(
        &self,
        key: &RecordKey,
        fingerprint: &Fingerprint,
        mut response: Arc<StoredResponse>,
    ) -> Result<Arc<StoredResponse>, StoreError> {
        let mut fingerprint = *fingerprint;
        for transform in &self.transforms {
            response = transform.transform(key, &mut fingerprint, response)?;
        }
        Ok(response)
    }
}

impl fmt::Debug for Capabilities<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut s = f.debug_struct("Capabilities");
        s.field("operation_timeout", &self.operation_timeout);
        #[cfg(feature = "postgres")]
        s.field("postgres", &self.postgres.is_some());
        s.field("transforms", &self.transforms.len()).finish()
    }
}
