//! [`IdempotencyContext`] as an axum extractor: the operation a guarded handler runs.

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use http::request::Parts;

use super::problem::{ErrorKind, IdempotencyRejection};
use crate::engine::IdempotencyContext;

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
    type Rejection = IdempotencyRejection;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        match parts.extensions.get::<IdempotencyContext>() {
            Some(context) => Ok(context.clone()),
            None => {
                tracing::error!(
                    "IdempotencyContext was asked for on a request the idempotency layer did not \
                     claim (no layer on the route, or no Idempotency-Key); use \
                     Option<IdempotencyContext> where the key is optional"
                );
                Err(IdempotencyRejection::plain(
                    ErrorKind::InternalError,
                    "this handler needs an idempotent request, and this one was not claimed",
                ))
            }
        }
    }
}

impl<S: Send + Sync> OptionalFromRequestParts<S> for IdempotencyContext {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(
        parts: &mut Parts,
        _state: &S,
    ) -> Result<Option<Self>, Self::Rejection> {
        Ok(parts.extensions.get::<IdempotencyContext>().cloned())
    }
}
