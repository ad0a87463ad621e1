//! [`ResponseFuture`]: a request through the layer, which runs to its end once its body is read,
//! whether its client stays or not.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use axum::body::Body;
use http::Response;

use crate::engine::{Admitted, Stage};

pub(crate) type BoxedFuture<E> = Pin<Box<dyn Future<Output = Result<Response<Body>, E>> + Send>>;

/// The future of a request through the layer.
///
/// For a request with an `Idempotency-Key` to a guarded method, dropping it (hyper drops it when
/// the client goes away, an outer timeout when it fires) once the request's body is read does not
/// cancel the work: what is left (the claim, the handler, the recording) is moved onto a task of
/// its own and runs to the end, so no record is left claimed with nobody to finish it. Dropped
/// before its body is read, or while it only waits for another request's answer, it is dropped
/// outright: nothing was claimed, or nothing is left to finish. Other requests are cancelled as
/// usual.
pub struct ResponseFuture<E: 'static> {
    inner: Option<BoxedFuture<E>>,
    /// The request's place in the drain, from its admission to its end: moved onto the detached
    /// task when the future is dropped before it finished.
    admitted: Option<Admitted>,
    /// Where the request stands, deciding what a drop does.
    stage: Option<Arc<Stage>>,
}

impl<E: 'static> ResponseFuture<E> {
    /// A request the layer guards: counted from now, and run to its end once its body is read.
    pub(crate) fn guarded(inner: BoxedFuture<E>, admitted: Admitted, stage: Arc<Stage>) -> Self {
        ResponseFuture {
            inner: Some(inner),
            admitted: Some(admitted),
            stage: Some(stage),
        }
    }

    /// A request the layer passes through: cancelled as usual.
    pub(crate) fn passed(inner: BoxedFuture<E>) -> Self {
        ResponseFuture {
            inner: Some(inner),
            admitted: None,
            stage: None,
        }
    }
}

impl<E: 'static> std::fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture")
            .field("finished", &self.inner.is_none())
            .field("guarded", &self.admitted.is_some())
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
                self.admitted = None;
                Poll::Ready(out)
            }
            Err(panic) => {
                self.inner = None;
                self.admitted = None;
                std::panic::resume_unwind(panic)
            }
        }
    }
}

impl<E: 'static> Drop for ResponseFuture<E> {
    fn drop(&mut self) {
        let (Some(rest), Some(admitted)) = (self.inner.take(), self.admitted.take()) else {
            return;
        };
        if self.stage.as_ref().is_some_and(|stage| stage.client_left()) {
            admitted.detach(async move {
                let _ = rest.await;
            });
        }
    }
}
