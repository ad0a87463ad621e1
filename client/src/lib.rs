//! The client half of the `Idempotency-Key` protocol, as a [`reqwest_middleware`] middleware.
//!
//! A server that guards its unsafe endpoints with an idempotency key (such as one built with the
//! `axum-idempotency` layer) runs each operation once, however often it is sent, only if the client
//! does its part: **the same key on every retry of one operation**, polling on `409 in_progress`
//! after `Retry-After` instead of giving up or holding the line, and **never a new key** to get
//! past an error of an operation that may have happened. This crate does that part.
//!
//! ```no_run
//! use std::time::Duration;
//! use axum_idempotency_client::{
//!     IdempotencyMiddleware, IdempotentRequestExt, IdempotentResponseExt, RetryPolicy,
//! };
//! use reqwest_middleware::ClientBuilder;
//!
//! # async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let client = ClientBuilder::new(reqwest::Client::new())
//!     .with(IdempotencyMiddleware::new(
//!         RetryPolicy::new().deadline(Duration::from_secs(30)),
//!     ))
//!     .build();
//!
//! let response = client
//!     .post("http://127.0.0.1:3000/checkout")
//!     .bearer_auth("alice")
//!     .header("content-type", "application/json")
//!     .body(r#"{"amount":1999}"#)
//!     .idempotency_key("order-1842-payment") // or `.idempotent()` for a generated key
//!     .send()
//!     .await?;
//!
//! if let Some(info) = response.idempotency() {
//!     println!(
//!         "{} after {} attempt(s), replayed: {}, key {} expires {:?}",
//!         response.status(),
//!         info.attempts(),
//!         info.replayed(),
//!         info.key(),
//!         info.expires_at(),
//!     );
//! }
//! # Ok(())
//! # }
//! ```
//!
//! # What is retried
//!
//! A request marked idempotent ([`IdempotentRequestExt::idempotent`] or
//! [`idempotency_key`](IdempotentRequestExt::idempotency_key), or one that already carries an
//! `Idempotency-Key` header) is sent again, with the same method, URL, headers, body and key:
//!
//! - when no answer came back: the connection could not be made or broke (also after the server
//!   received the request: the key makes the retry safe), or a timeout (reqwest's own, per attempt);
//! - on `409 in_progress`, polling after its `Retry-After` until the first request's answer comes
//!   back as a replay;
//! - on an `application/problem+json` answer with `"retryable": true` (the layer's `408`, `409`,
//!   `503`, and a `504 idempotency_handler_timeout` that was rolled back);
//! - on `408`, `429` and `503` without a problem body ([configurable](RetryPolicy::retry_status)).
//!
//! It waits the server's `Retry-After` (seconds or an HTTP date; the problem's
//! `retryAfterSeconds` otherwise), never less, with jitter above it; without one, exponential
//! backoff with jitter. A total [deadline](RetryPolicy::deadline) (default 60 s) and an
//! [attempt limit](RetryPolicy::max_attempts) (default 20) bound the whole operation.
//!
//! # What is never done
//!
//! - **No new key for the same operation**: one key is generated per send (or given by the
//!   caller) and every attempt carries it.
//! - **No retry of a final answer**: `422 idempotency_key_reuse` (the key belongs to another
//!   request) stops at once, as do every `2xx`/`3xx`, every other `4xx`, a problem with
//!   `"retryable": false`, and a handler's own `500`, `502` or `504` without a problem body (its
//!   effect may have happened; [`RetryPolicy::retry_status`] opts in where you know it is safe).
//! - **No retry of a body that cannot be sent twice**: a streaming body
//!   (`reqwest::Body::wrap_stream`, [`reqwest::Body::wrap`]) cannot be cloned, so such a request
//!   is sent once, still with its key; send it again yourself with the key from the error or the
//!   response to finish the operation.
//!
//! # What the caller is told
//!
//! Every answer to an idempotent request carries an [`IdempotencyInfo`] in its extensions
//! ([`IdempotentResponseExt::idempotency`]): the key, how many attempts it took, whether it is a
//! replay of an earlier run (`Idempotent-Replayed: true`, header name
//! [configurable](RetryPolicy::replayed_header)), whether the replay's body was omitted
//! (`Idempotency-Replay: omitted`), when the key expires (`Idempotency-Expires`), and whether the
//! retries stopped on an answer that was still retryable (the deadline or attempt limit came
//! first). When no answer came at all, the error is an [`IdempotencyError`] (inside
//! [`reqwest_middleware::Error::Middleware`]) with the key and the number of attempts: the
//! operation's outcome is unknown, and sending it again **with that key** is how to learn it.
//!
//! The middleware reads a problem body (up to 64 KiB) to decide; the response the caller gets has
//! it whole. Other bodies are not touched, and a response streams as reqwest gives it.
//!
//! # Placement
//!
//! Put this middleware before (outside) middleware that changes the request per attempt (signing,
//! auth refresh): those then run on every attempt. Do not stack another retrying middleware
//! (`reqwest-retry`) around it for the same requests: it would not know about keys, and multiplies
//! the attempts.
//!
//! It waits with Tokio's timers: run it on a Tokio runtime with time enabled (`#[tokio::main]`
//! does), as reqwest's own timeouts need.
#![forbid(unsafe_code)]

mod decision;
mod error;
mod key;
mod middleware;
mod policy;
mod response;

use std::time::SystemTime;

use http::HeaderName;

pub use error::{ErrorKind, IdempotencyError};
pub use key::{IdempotencyKey, InvalidKey, MAX_KEY_LEN};
pub use middleware::{IdempotencyMiddleware, Idempotent};
pub use policy::RetryPolicy;

use middleware::RequestPolicy;

/// `Idempotency-Key`: the request header that names the operation.
pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
/// `Idempotent-Replayed`: the default response header that marks a replay (value `true`).
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
/// `Idempotency-Replay`: `omitted` on a replay whose body the server did not record.
pub const IDEMPOTENCY_REPLAY: HeaderName = HeaderName::from_static("idempotency-replay");
/// `Idempotency-Expires`: the HTTP date when the server forgets the key's record.
pub const IDEMPOTENCY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-expires");

/// What the middleware learnt about an idempotent request's answer; in the response's extensions
/// (read it with [`IdempotentResponseExt::idempotency`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdempotencyInfo {
    key: IdempotencyKey,
    attempts: u32,
    replayed: bool,
    body_omitted: bool,
    expires_at: Option<SystemTime>,
    gave_up: bool,
    error_code: Option<String>,
}

impl IdempotencyInfo {
    /// The key every attempt carried.
    pub fn key(&self) -> &IdempotencyKey {
        &self.key
    }

    /// How many attempts were sent, the first included.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the answer is a replay of an earlier run of the operation (the replay header is
    /// `true`): the server did not run it again for this request.
    pub fn replayed(&self) -> bool {
        self.replayed
    }

    /// Whether the replay came without its body (`Idempotency-Replay: omitted`): the server
    /// recorded the status and headers only (the body was too large to record, or its stream
    /// failed). The operation happened; fetch its result another way.
    pub fn body_omitted(&self) -> bool {
        self.body_omitted
    }

    /// When the server forgets the key (`Idempotency-Expires`): after that the same key is a new
    /// operation. `None` when the server did not say.
    pub fn expires_at(&self) -> Option<SystemTime> {
        self.expires_at
    }

    /// Whether the answer is one the protocol says to retry (`409 in_progress`, a retryable `503`,
    /// ...) and the retries stopped: on the deadline, on the attempt limit, or because the body
    /// cannot be sent again (a stream). The operation may still finish: send the same request
    /// again later with [`key`](Self::key).
    pub fn gave_up(&self) -> bool {
        self.gave_up
    }

    /// The `error` code of the answer's problem body (`idempotency_key_reuse`, `in_progress`, ...),
    /// when it had one.
    pub fn error_code(&self) -> Option<&str> {
        self.error_code.as_deref()
    }
}

/// Marks requests of a [`reqwest_middleware::RequestBuilder`] idempotent for
/// [`IdempotencyMiddleware`].
pub trait IdempotentRequestExt: Sized {
    /// Idempotent, with a key generated when the request is sent, kept for every retry of it.
    fn idempotent(self) -> Self;

    /// Idempotent, with `key` (1 to 255 visible ASCII characters; an invalid one fails the send
    /// with [`ErrorKind::InvalidKey`] before anything is sent).
    fn idempotency_key(self, key: impl Into<String>) -> Self;

    /// This request's retry policy, instead of the middleware's (for an idempotent request; it
    /// marks none).
    fn retry_policy(self, policy: RetryPolicy) -> Self;
}

impl IdempotentRequestExt for reqwest_middleware::RequestBuilder {
    fn idempotent(self) -> Self {
        self.with_extension(Idempotent::new())
    }

    fn idempotency_key(self, key: impl Into<String>) -> Self {
        self.with_extension(Idempotent::with_key(key))
    }

    fn retry_policy(self, policy: RetryPolicy) -> Self {
        self.with_extension(RequestPolicy(policy))
    }
}

/// Reads the [`IdempotencyInfo`] of a response.
pub trait IdempotentResponseExt {
    /// What the middleware learnt, when the request was idempotent.
    fn idempotency(&self) -> Option<&IdempotencyInfo>;
}

impl IdempotentResponseExt for reqwest::Response {
    fn idempotency(&self) -> Option<&IdempotencyInfo> {
        self.extensions().get()
    }
}
