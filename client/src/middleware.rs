//! The middleware: one key per operation, kept across every attempt.

use std::time::{Instant, SystemTime};

use http::Extensions;
use reqwest::{Request, Response};
use reqwest_middleware::{Middleware, Next};

use crate::decision::{retry_answer, retry_error, server_wait};
use crate::error::{ErrorKind, IdempotencyError};
use crate::key::IdempotencyKey;
use crate::policy::{RetryPolicy, jitter, next_attempt_at, random_u64};
use crate::response::{Answer, read_answer};
use crate::{IDEMPOTENCY_EXPIRES, IDEMPOTENCY_KEY, IDEMPOTENCY_REPLAY, IdempotencyInfo};

/// A [`reqwest_middleware`] middleware that makes requests marked [`Idempotent`] safe to retry:
/// each gets one `Idempotency-Key` (the caller's, or one generated for it) that every retry of it
/// carries, and is retried by its [`RetryPolicy`].
///
/// Requests that are not marked, and carry no `Idempotency-Key` header, pass through untouched.
///
/// ```no_run
/// use axum_idempotency_client::{IdempotencyMiddleware, IdempotentRequestExt, RetryPolicy};
/// use reqwest_middleware::ClientBuilder;
///
/// # async fn run() -> Result<(), reqwest_middleware::Error> {
/// let client = ClientBuilder::new(reqwest::Client::new())
///     .with(IdempotencyMiddleware::new(RetryPolicy::new()))
///     .build();
/// let response = client
///     .post("http://127.0.0.1:3000/checkout")
///     .header("content-type", "application/json")
///     .body(r#"{"amount":100}"#)
///     .idempotent()
///     .send()
///     .await?;
/// # let _ = response;
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default)]
pub struct IdempotencyMiddleware {
    policy: RetryPolicy,
}

impl IdempotencyMiddleware {
    /// The middleware with `policy` for every idempotent request (a request may bring its own, see
    /// [`IdempotentRequestExt::retry_policy`](crate::IdempotentRequestExt::retry_policy)).
    pub fn new(policy: RetryPolicy) -> Self {
        IdempotencyMiddleware { policy }
    }

    /// The policy requests get unless they bring their own.
    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }
}

/// Marks a request idempotent: put it in the request's extensions (with
/// [`IdempotentRequestExt`](crate::IdempotentRequestExt), or `with_extension`), or in a client's
/// with `reqwest_middleware::Extension` to mark every request of that client.
///
/// Without a key, the middleware generates one when the request is sent, and keeps it for every
/// retry of that send. To resume an operation later (after a crash, or after the middleware gave
/// up), give it its key again: [`Idempotent::with_key`].
#[derive(Debug, Clone, Default)]
pub struct Idempotent {
    pub(crate) key: Option<String>,
}

impl Idempotent {
    /// Idempotent, with a key generated when the request is sent.
    pub fn new() -> Self {
        Idempotent { key: None }
    }

    /// Idempotent, with the caller's key: 1 to 255 visible ASCII characters (checked when the
    /// request is sent). Derive it from what names the operation on your side (an order id, a
    /// payment attempt id), so that a retry after a crash sends the same one.
    pub fn with_key(key: impl Into<String>) -> Self {
        Idempotent {
            key: Some(key.into()),
        }
    }
}

/// A policy for one request, over the middleware's.
#[derive(Debug, Clone)]
pub(crate) struct RequestPolicy(pub(crate) RetryPolicy);

#[async_trait::async_trait]
impl Middleware for IdempotencyMiddleware {
    async fn handle(
        &self,
        mut req: Request,
        extensions: &mut Extensions,
        next: Next<'_>,
    ) -> reqwest_middleware::Result<Response> {
        let marker = extensions.get::<Idempotent>().cloned();
        let header = req.headers().get(&IDEMPOTENCY_KEY).cloned();
        if marker.is_none() && header.is_none() {
            return next.run(req, extensions).await;
        }
        let key = resolve_key(marker, header.as_ref())?;
        req.headers_mut()
            .insert(IDEMPOTENCY_KEY, key.header_value());
        let policy = extensions
            .get::<RequestPolicy>()
            .map(|p| p.0.clone())
            .unwrap_or_else(|| self.policy.clone());
        run(&policy, key, req, extensions, next).await
    }
}

/// The operation's key: the marker's, else the request's header, else a new one.
fn resolve_key(
    marker: Option<Idempotent>,
    header: Option<&http::HeaderValue>,
) -> Result<IdempotencyKey, IdempotencyError> {
    let invalid = |e| IdempotencyError::new(ErrorKind::InvalidKey, None, 0).with_source(e);
    let from_header = header
        .map(IdempotencyKey::from_header)
        .transpose()
        .map_err(invalid)?;
    match (marker.and_then(|m| m.key), from_header) {
        (Some(given), from_header) => {
            let key = IdempotencyKey::new(given).map_err(invalid)?;
            match from_header {
                Some(other) if other != key => Err(IdempotencyError::new(
                    ErrorKind::ConflictingKey,
                    Some(key),
                    0,
                )),
                _ => Ok(key),
            }
        }
        (None, Some(key)) => Ok(key),
        (None, None) => IdempotencyKey::generate(),
    }
}

/// Sends `req` until an answer is final, the policy stops it, or an error is not retried.
async fn run(
    policy: &RetryPolicy,
    key: IdempotencyKey,
    req: Request,
    extensions: &mut Extensions,
    next: Next<'_>,
) -> reqwest_middleware::Result<Response> {
    let start = Instant::now();
    let deadline = policy.deadline_from(start);
    let mut attempts: u32 = 0;
    let mut pending = Some(req);
    while let Some(req) = pending.take() {
        attempts += 1;
        // The copy for the next attempt, made before this one consumes the request. A body that
        // cannot be copied (a stream) is sent once.
        let spare = req.try_clone();
        let may_retry = spare.is_some() && attempts < policy.max_attempts;
        let sent = next.clone().run(req, extensions);
        let outcome = async {
            match sent.await {
                Ok(response) => read_answer(response).await.map_err(Into::into),
                Err(e) => Err(e),
            }
        };
        let outcome = match deadline {
            None => outcome.await,
            Some(deadline) => {
                match tokio::time::timeout_at(deadline.into(), outcome).await {
                    Ok(outcome) => outcome,
                    // The deadline passed with the attempt in flight: the operation's outcome is
                    // unknown, and the key is the caller's way to learn it.
                    Err(_) => {
                        return Err(
                            IdempotencyError::new(ErrorKind::GaveUp, Some(key), attempts).into(),
                        );
                    }
                }
            }
        };
        let (retryable, hint) = match &outcome {
            Ok(Answer { response, problem }) => (
                retry_answer(
                    response.status(),
                    problem.as_ref(),
                    replayed(response.headers(), policy),
                    policy,
                ),
                server_wait(response.headers(), problem.as_ref(), SystemTime::now()),
            ),
            Err(e) => (retry_error(e), None),
        };
        if retryable && may_retry {
            let (low, high) = policy.wait_range(attempts, hint);
            let wait = jitter(low, high, random_u64());
            if let Some(at) = next_attempt_at(Instant::now(), wait, deadline) {
                tokio::time::sleep_until(at.into()).await;
                pending = spare;
                continue;
            }
        }
        return match outcome {
            Ok(Answer { response, problem }) => Ok(finish(
                response,
                key,
                attempts,
                retryable,
                problem.and_then(|p| p.code),
                policy,
            )),
            Err(e) => {
                // Gave up: a retry was possible and the deadline or the limit came first. Failed:
                // the error is final, or the body cannot be sent again.
                let kind = if retryable && spare.is_some() {
                    ErrorKind::GaveUp
                } else {
                    ErrorKind::Failed
                };
                Err(IdempotencyError::new(kind, Some(key), attempts)
                    .with_source(e)
                    .into())
            }
        };
    }
    // Unreachable: the loop returns on its last attempt. Kept without a panic.
    Err(IdempotencyError::new(ErrorKind::Failed, Some(key), attempts).into())
}

/// Whether the server's replay header marks the answer as a replay.
fn replayed(headers: &http::HeaderMap, policy: &RetryPolicy) -> bool {
    headers
        .get(&policy.replayed_header)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
}

/// The final answer, with what the caller needs to know in its extensions.
fn finish(
    mut response: Response,
    key: IdempotencyKey,
    attempts: u32,
    gave_up: bool,
    error_code: Option<String>,
    policy: &RetryPolicy,
) -> Response {
    let headers = response.headers();
    let replayed = replayed(headers, policy);
    let body_omitted = headers
        .get(&IDEMPOTENCY_REPLAY)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("omitted"));
    let expires_at = headers
        .get(&IDEMPOTENCY_EXPIRES)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| httpdate::parse_http_date(v.trim()).ok());
    let info = IdempotencyInfo {
        key,
        attempts,
        replayed,
        body_omitted,
        expires_at,
        gave_up,
        error_code,
    };
    response.extensions_mut().insert(info);
    response
}
