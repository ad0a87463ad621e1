//! [`IdempotencyContext`]: what a guarded handler knows about the operation it runs.

use std::fmt;

use axum::extract::{FromRequestParts, OptionalFromRequestParts};
use axum::response::Response;
use http::request::Parts;
use sha2::{Digest, Sha256};

use crate::fingerprint::Fingerprint;
use crate::problem::{ErrorKind, problem};
use crate::record::RecordKey;

/// The idempotent operation a guarded handler is running, in its request extensions whenever the
/// layer claimed a record for the request.
///
/// Take it as an extractor (`ctx: IdempotencyContext`, or `Option<IdempotencyContext>` on routes
/// where a key is optional) or read it with `Extension<IdempotencyContext>`.
///
/// Forward [`derived_key`](Self::derived_key) to the providers your handler calls (a payment
/// provider's own `Idempotency-Key`, say): when the handler runs again after its process died (a
/// retake, [`is_retake`](Self::is_retake)), the provider sees the same key and does not charge twice.
#[derive(Clone)]
pub struct IdempotencyContext {
    scope: RecordKey,
    fingerprint: Fingerprint,
    retake: bool,
}

impl IdempotencyContext {
    pub(crate) fn new(scope: RecordKey, fingerprint: Fingerprint, retake: bool) -> Self {
        IdempotencyContext {
            scope,
            fingerprint,
            retake,
        }
    }

    /// The `Idempotency-Key` of the request, as validated (trimmed, unquoted).
    pub fn key(&self) -> &str {
        &self.scope.key
    }

    /// The authenticated subject; empty in the shared anonymous scope.
    pub fn subject(&self) -> &str {
        &self.scope.subject
    }

    /// The endpoint part of the scope, e.g. `POST /checkout`.
    pub fn endpoint(&self) -> &str {
        &self.scope.endpoint
    }

    /// True when this run retook a record whose previous holder stopped renewing it (its process
    /// presumably died): the effect may have been started before. Use
    /// [`derived_key`](Self::derived_key) downstream so it is not repeated.
    pub fn is_retake(&self) -> bool {
        self.retake
    }

    /// A key for downstream providers: 64 lower-case hex characters, the same for every run of this
    /// operation (same key, subject, endpoint and request fingerprint), in every instance, retakes
    /// included; different when any of them differs, so a key reused after retention for another
    /// body is another operation downstream too. It is a SHA-256 of the scope and the fingerprint
    /// under a fixed label: whoever receives it learns nothing of them, short of guessing the key,
    /// subject, endpoint and body together.
    pub fn derived_key(&self) -> String {
        let mut hasher = Sha256::new();
        hasher.update(b"axum-idempotency derived key v1\0");
        hasher.update(self.scope.digest());
        hasher.update(self.fingerprint.as_bytes());
        let mut hex = String::with_capacity(64);
        for b in hasher.finalize() {
            hex.push(char::from(HEX[usize::from(b >> 4)]));
            hex.push(char::from(HEX[usize::from(b & 15)]));
        }
        hex
    }
}

const HEX: &[u8; 16] = b"0123456789abcdef";

impl fmt::Debug for IdempotencyContext {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The raw key is a client secret of sorts: keep it out of logs.
        f.debug_struct("IdempotencyContext")
            .field("subject", &self.scope.subject)
            .field("endpoint", &self.scope.endpoint)
            .field("retake", &self.retake)
            .finish_non_exhaustive()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for IdempotencyContext {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, Self::Rejection> {
        match parts.extensions.get::<IdempotencyContext>() {
            Some(context) => Ok(context.clone()),
            None => {
                tracing::error!(
                    "IdempotencyContext was asked for on a request the idempotency layer did not \
                     claim (no layer on the route, or no Idempotency-Key); use \
                     Option<IdempotencyContext> where the key is optional"
                );
                Err(problem(
                    ErrorKind::InternalError,
                    "this handler needs an idempotent request, and this one was not claimed",
                    None,
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
