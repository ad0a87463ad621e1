//! [`IdempotencyService`]: the middleware the layer builds around a route.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use http::{Request, Response};
use tower::{BoxError, Service};

use crate::claim;
use crate::coalesce::Coalesced;
use crate::config::Config;
use crate::drain::Drain;
use crate::metrics::Measured;
use crate::store::IdempotencyStore;

type BoxedFuture<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

/// The future of a request through the layer.
///
/// For a request with an `Idempotency-Key` to a guarded method, dropping it before it finishes
/// (hyper drops it when the client goes away) does not cancel the work: what is left (the claim,
/// the handler, the recording) is moved onto a task of its own and runs to the end, so no record is
/// left claimed with nobody to finish it. Other requests are cancelled as usual.
pub struct ResponseFuture<E: 'static> {
    inner: Option<BoxedFuture<E>>,
    /// Where the rest is detached to (and counted) when the future is dropped before it finished.
    detach_to: Option<Drain>,
    /// Whether the request only waits for its original's answer: dropped then, it is dropped
    /// outright (it has nothing to finish), not detached.
    waiting: Option<Arc<crate::wait::WaitState>>,
}

impl<E: 'static> std::fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("finished", &self.inner.is_none())
            .field("detaches_on_drop", &self.detach_to.is_some())
            .finish()
    }
}

impl<E: 'static> Future for ResponseFuture<E> {
    type Output = Result<Response<Body>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let Some(inner) = self.inner.as_mut() else {
            panic!("ResponseFuture polled after it finished");
        };
        // A panic inside leaves nothing to detach: the future must not be polled again.
        let polled =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.as_mut().poll(cx)));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(out)) => {
                self.inner = None;
                Poll::Ready(out)
            }
            Err(panic) => {
                self.inner = None;
                std::panic::resume_unwind(panic)
            }
        }
    }
}

impl<E: 'static> Drop for ResponseFuture<E> {
    fn drop(&mut self) {
        if self.waiting.as_ref().is_some_and(|w| w.client_left()) {
            return;
        }
        if let (Some(rest), Some(drain)) = (self.inner.take(), self.detach_to.take()) {
            drain.spawn_detached(async move {
                let _ = rest.await;
            });
        }
    }
}

/// Guards an inner service; built by [`IdempotencyLayer`](crate::IdempotencyLayer).
pub struct IdempotencyService<Inner, S> {
    inner: Inner,
    /// Duplicates at this process answered from the layer's own claims, and each operation timed
    /// with the `metrics` feature (wrapped once, when the layer built this service).
    store: Coalesced<Measured<S>>,
    config: Arc<Config>,
}

impl<Inner: std::fmt::Debug, S: std::fmt::Debug> std::fmt::Debug for IdempotencyService<Inner, S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("store", &self.store)
            .finish_non_exhaustive()
    }
}

impl<Inner, S> IdempotencyService<Inner, S> {
    /// The wrapped service.
    pub fn get_ref(&self) -> &Inner {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut Inner {
        &mut self.inner
    }

    /// The wrapped service, the layer taken off.
    pub fn into_inner(self) -> Inner {
        self.inner
    }
}

impl<Inner, S> IdempotencyService<Inner, S> {
    pub(crate) fn new(inner: Inner, store: Coalesced<Measured<S>>, config: Arc<Config>) -> Self {
        IdempotencyService {
            inner,
            store,
            config,
        }
    }
}

impl<Inner: Clone, S: Clone> Clone for IdempotencyService<Inner, S> {
    fn clone(&self) -> Self {
        IdempotencyService {
            inner: self.inner.clone(),
            store: self.store.clone(),
            config: self.config.clone(),
        }
    }
}

impl<Inner, S, ResBody> Service<Request<Body>> for IdempotencyService<Inner, S>
where
    Inner: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    Inner::Future: Send + 'static,
    Inner::Error: Send + 'static,
    S: IdempotencyStore,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = Inner::Error;
    type Future = ResponseFuture<Inner::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // Take the service that was polled ready and leave a clone in its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        if !self.config.methods.contains(request.method()) {
            let future = inner.call(request);
            return ResponseFuture {
                inner: Some(Box::pin(async move { Ok(future.await?.map(Body::new)) })),
                detach_to: None,
                waiting: None,
            };
        }
        let has_key = request.headers().contains_key(crate::key::IDEMPOTENCY_KEY);
        let waiting =
            (has_key && !self.config.wait.is_zero()).then(|| Arc::new(Default::default()));
        ResponseFuture {
            inner: Some(Box::pin(claim::guard(
                self.config.clone(),
                self.store.clone(),
                inner,
                request,
                waiting.clone(),
            ))),
            detach_to: has_key.then(|| self.config.drain.clone()),
            waiting,
        }
    }
}
