//! What the middleware answers when it has no response to give.

use std::fmt;

use crate::key::IdempotencyKey;

/// Why an idempotent request ended without a response.
///
/// It reaches the caller inside [`reqwest_middleware::Error::Middleware`]; get it back with
/// [`IdempotencyError::from_error`]. The error of the last attempt, if any, is its
/// [`source`](std::error::Error::source).
#[derive(Debug)]
pub struct IdempotencyError {
    kind: ErrorKind,
    key: Option<IdempotencyKey>,
    attempts: u32,
    source: Option<Box<dyn std::error::Error + Send + Sync>>,
}

/// The kinds of [`IdempotencyError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The key given for the request is not one the protocol accepts (1 to 255 visible ASCII
    /// characters). Nothing was sent.
    InvalidKey,
    /// The request carries an `Idempotency-Key` header and was given another key through
    /// [`idempotency_key`](crate::IdempotentRequestExt::idempotency_key). Nothing was sent: one
    /// operation has one key.
    ConflictingKey,
    /// No key could be generated: the operating system's random source failed. Nothing was sent.
    KeyGeneration,
    /// The last attempt failed with an error that is not retried (the request could not be built,
    /// a redirect failed, another middleware failed), or with a connection error on a request
    /// whose body cannot be sent twice. The request may have reached the server.
    Failed,
    /// Every attempt failed on the way (connection refused or cut, timed out) until the total
    /// deadline or the attempt limit: the operation may or may not have happened. Sending the same
    /// request again later with [`key`](IdempotencyError::key) is safe.
    GaveUp,
}

impl IdempotencyError {
    pub(crate) fn new(kind: ErrorKind, key: Option<IdempotencyKey>, attempts: u32) -> Self {
        IdempotencyError {
            kind,
            key,
            attempts,
            source: None,
        }
    }

    pub(crate) fn with_source(
        mut self,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> Self {
        self.source = Some(source.into());
        self
    }

    /// What went wrong.
    pub fn kind(&self) -> ErrorKind {
        self.kind
    }

    /// The operation's key, when it had one: send it again with this key (never a new one) to
    /// learn what happened, or to finish the operation.
    pub fn key(&self) -> Option<&IdempotencyKey> {
        self.key.as_ref()
    }

    /// How many attempts were sent (0 when none was).
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the request may have reached the server, so its effect may have happened: an
    /// attempt was made. Retry with the same key to find out; a new key could do it twice.
    pub fn outcome_unknown(&self) -> bool {
        self.attempts > 0
    }

    /// The `IdempotencyError` inside an error of a [`ClientWithMiddleware`] request, if the
    /// middleware gave one.
    ///
    /// [`ClientWithMiddleware`]: reqwest_middleware::ClientWithMiddleware
    pub fn from_error(error: &reqwest_middleware::Error) -> Option<&IdempotencyError> {
        match error {
            reqwest_middleware::Error::Middleware(inner) => inner.downcast_ref(),
            reqwest_middleware::Error::Reqwest(_) => None,
        }
    }

    /// Whether the last attempt timed out (reqwest's own timeout, or the total deadline reached
    /// while it was in flight).
    pub fn is_timeout(&self) -> bool {
        match self.source.as_deref() {
            None => self.kind == ErrorKind::GaveUp,
            Some(source) => source
                .downcast_ref::<reqwest_middleware::Error>()
                .is_some_and(reqwest_middleware::Error::is_timeout),
        }
    }
}

impl fmt::Display for IdempotencyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            ErrorKind::InvalidKey => "invalid idempotency key",
            ErrorKind::ConflictingKey => {
                "the request's Idempotency-Key header differs from the key it was given"
            }
            ErrorKind::KeyGeneration => "no idempotency key could be generated",
            ErrorKind::Failed => "idempotent request failed",
            ErrorKind::GaveUp => "idempotent request gave up",
        };
        f.write_str(what)?;
        if self.attempts > 0 {
            let s = if self.attempts == 1 { "" } else { "s" };
            write!(f, " after {} attempt{s}", self.attempts)?;
        }
        if self.kind == ErrorKind::GaveUp && self.source.is_none() {
            f.write_str(" (the deadline passed with an attempt in flight)")?;
        }
        if let Some(key) = &self.key {
            write!(f, " (Idempotency-Key {key})")?;
        }
        if let Some(source) = &self.source {
            write!(f, ": {source}")?;
        }
        Ok(())
    }
}

impl std::error::Error for IdempotencyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

impl From<IdempotencyError> for reqwest_middleware::Error {
    fn from(error: IdempotencyError) -> Self {
        reqwest_middleware::Error::middleware(error)
    }
}
