//! [`IdempotencyService`]: the middleware the layer builds around a route.

use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use http::{Method, Request, Response};
use tower::{BoxError, Service};

use super::future::ResponseFuture;
use super::handler::Transactions;
use super::settings::LayerSettings;
use crate::engine::{Engine, Stage};
use crate::store::IdempotencyStore;

/// Guards an inner service; built by [`IdempotencyLayer`](crate::IdempotencyLayer).
pub struct IdempotencyService<S, Store> {
    inner: S,
    engine: Engine<Store>,
    http: Arc<LayerSettings>,
    transactions: Option<Arc<dyn Transactions<Store>>>,
}

impl<S: std::fmt::Debug, Store: std::fmt::Debug> std::fmt::Debug for IdempotencyService<S, Store> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyService")
            .field("inner", &self.inner)
            .field("engine", &self.engine)
            .finish_non_exhaustive()
    }
}

impl<S, Store> IdempotencyService<S, Store> {
    pub(crate) fn new(
        inner: S,
        engine: Engine<Store>,
        http: Arc<LayerSettings>,
        transactions: Option<Arc<dyn Transactions<Store>>>,
    ) -> Self {
        IdempotencyService {
            inner,
            engine,
            http,
            transactions,
        }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// The wrapped service, mutably.
    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }

    /// The wrapped service, the layer taken off.
    pub fn into_inner(self) -> S {
        self.inner
    }
}

impl<S: Clone, Store: Clone> Clone for IdempotencyService<S, Store> {
    fn clone(&self) -> Self {
        IdempotencyService {
            inner: self.inner.clone(),
            engine: self.engine.clone(),
            http: self.http.clone(),
            transactions: self.transactions.clone(),
        }
    }
}

impl<S, Store, ResBody> Service<Request<Body>> for IdempotencyService<S, Store>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    Store: IdempotencyStore,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = ResponseFuture<S::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // Take the service that was polled ready and leave a clone in its place.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        // A gRPC layer guards the unary methods it is told of; another call with a key is refused
        // or passes through, as it is set.
        #[cfg(feature = "grpc")]
        if let Some(grpc) = &self.http.grpc
            && !grpc.guards(&request)
        {
            let (parts, body) = request.into_parts();
            // Refused only a gRPC call (a request that is not gRPC passes: a gRPC answer would
            // read as a success to it), and only with a key (or what would be refused as one),
            // wherever the layer is set to read it.
            if grpc.refuses_others()
                && super::grpc::is_grpc(&parts.headers)
                && !matches!(
                    self.http.key_source.in_parts(&parts),
                    Ok(super::key::Found::Absent)
                )
            {
                let refused = super::grpc::unguarded_call();
                return ResponseFuture::passed(Box::pin(async move { Ok(refused) }));
            }
            let future = inner.call(Request::from_parts(parts, body));
            return ResponseFuture::passed(Box::pin(
                async move { Ok(future.await?.map(Body::new)) },
            ));
        }
        if !guards(&self.http, request.method())
            || self.http.key_source.surely_absent(request.headers()) && !self.http.require_key
        {
            let future = inner.call(request);
            return ResponseFuture::passed(Box::pin(
                async move { Ok(future.await?.map(Body::new)) },
            ));
        }
        let stage = Arc::new(Stage::default());
        let admitted = self.engine.drain().admit();
        ResponseFuture::guarded(
            Box::pin(super::run::guard(
                self.engine.clone(),
                self.http.clone(),
                self.transactions.clone(),
                inner,
                request,
                stage.clone(),
            )),
            admitted,
            stage,
        )
    }
}

/// Whether the layer guards requests with `method`: the methods it is set to guard, and every
/// extension method (any but the nine of RFC 9110, such as a lower-case `post` on a route that
/// takes any method): its meaning is unknown, so it is not taken for safe.
pub(crate) fn guards(http: &LayerSettings, method: &Method) -> bool {
    const STANDARD: [Method; 9] = [
        Method::GET,
        Method::HEAD,
        Method::POST,
        Method::PUT,
        Method::DELETE,
        Method::CONNECT,
        Method::OPTIONS,
        Method::TRACE,
        Method::PATCH,
    ];
    http.methods.contains(method) || !STANDARD.contains(method)
}
