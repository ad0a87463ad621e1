//! The claim flow of one guarded request: key, subject, body, fingerprint, claim, then replay, refuse,
//! or run the handler and record what it answered.

use std::fmt;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use axum::body::Body;
use futures_util::FutureExt;
use http::{Request, Response};
use sha2::{Digest, Sha256};
use tokio::time::Instant;
use tower::{BoxError, Service, ServiceExt};
use tracing::Instrument;

use crate::body::{self, RequestBodyError};
use crate::config::Config;
use crate::context::IdempotencyContext;
use crate::key;
use crate::lease::{self, Lease, renewal_bound};
use crate::metrics::Label;
use crate::outcome::Outcome;
use crate::problem::ErrorKind;
use crate::record::Fenced;
use crate::record::{ClaimOutcome, ClaimRequest, Generation, LeaseToken, RecordKey};
use crate::recording;
use crate::replay;
use crate::report::report;
use crate::store::IdempotencyStore;

/// Runs one request through the layer. `inner` is a ready clone of the wrapped service.
pub(crate) async fn guard<S, St, ResBody>(
    config: Arc<Config>,
    store: St,
    inner: S,
    request: Request<Body>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let (parts, body) = request.into_parts();
    let key = match key::from_headers(&parts.headers) {
        Ok(Some(key)) if key.len() < config.min_key_length => {
            report(&config, &Label::of(&parts), Outcome::Rejected);
            let detail = format!(
                "the Idempotency-Key must be at least {} characters long here",
                config.min_key_length
            );
            return Ok(config.problem(ErrorKind::InvalidIdempotencyKey, &detail, None));
        }
        Ok(Some(key)) => key,
        Ok(None) if config.require_key => {
            report(&config, &Label::of(&parts), Outcome::Rejected);
            return Ok(config.problem(
                ErrorKind::MissingIdempotencyKey,
                "this endpoint requires an Idempotency-Key header",
                None,
            ));
        }
        Ok(None) => return pass_through(inner, Request::from_parts(parts, body)).await,
        Err(e) => {
            report(&config, &Label::of(&parts), Outcome::Rejected);
            return Ok(config.problem(ErrorKind::InvalidIdempotencyKey, e.detail(), None));
        }
    };
    // The endpoint label of this request's metrics (nothing without the `metrics` feature).
    let label = Label::of(&parts);
    let subject = match config.subject.subject(&parts).filter(|s| !s.is_empty()) {
        Some(subject) => subject,
        None if config.allow_anonymous => String::new(),
        None => {
            report(&config, &label, Outcome::Rejected);
            return Ok(config.problem(
                ErrorKind::MissingSubject,
                "an idempotent request must come from an authenticated subject",
                None,
            ));
        }
    };
    // Admission: what runs detached is bounded, so a client that resets requests in a loop cannot
    // make the server run unbounded work. Refused before the body is read or anything claimed.
    if config.drain.detached() >= config.max_running {
        report(&config, &label, Outcome::Overloaded);
        tracing::warn!(
            detached = config.drain.detached(),
            "too many idempotent requests running on their own; refusing a new one"
        );
        return Ok(config.problem(
            ErrorKind::Overloaded,
            "too many idempotent requests are running; retry later",
            Some(config.retry_after_secs),
        ));
    }
    let endpoint = (config.endpoint)(&parts);
    // Subjects and endpoints are personal data, and a forged one could fake log lines: only their
    // hashes are logged, unless the application opts in (`log_scope`).
    let span = if config.log_scope {
        tracing::info_span!(
            "idempotency",
            key_hash = %KeyHash(&key),
            subject = ?subject,
            endpoint = ?endpoint,
        )
    } else {
        tracing::info_span!(
            "idempotency",
            key_hash = %KeyHash(&key),
            subject_hash = %KeyHash(&subject),
            endpoint_hash = %KeyHash(&endpoint),
        )
    };
    async move {
        let bytes = match body::read_request(&parts.headers, body, config.body_limit).await {
            Ok(bytes) => bytes,
            Err(RequestBodyError::TooLarge) => {
                report(&config, &label, Outcome::Rejected);
                let detail = format!(
                    "the request body is over the limit of {} bytes",
                    config.body_limit
                );
                return Ok(config.problem(ErrorKind::RequestTooLarge, &detail, None));
            }
            Err(RequestBodyError::Unreadable(reason)) => {
                report(&config, &label, Outcome::Rejected);
                // The reason stays in the log: internal error text is not sent to clients.
                tracing::debug!(%reason, "the request body could not be read");
                return Ok(config.problem(
                    ErrorKind::UnreadableBody,
                    "the request body could not be read to its end",
                    None,
                ));
            }
        };
        let claim = ClaimRequest {
            key: RecordKey {
                key,
                subject,
                endpoint,
            },
            fingerprint: config.fingerprint.of(&parts, &bytes),
            lease: LeaseToken::generate(),
            generation: Generation::generate(),
            in_progress_ttl: config.in_progress_ttl,
            retention: config.retention,
        };
        let request = Request::from_parts(parts, Body::from(bytes));
        let sent = Instant::now();
        let outcome = store.claim(&claim).await;
        let retry_after = config.retry_after_secs;
        match outcome {
            Ok(ClaimOutcome::Claimed {
                lease,
                retaken,
                generation,
            }) => {
                let claim = ClaimRequest { lease, ..claim };
                let Some(held_since) = fresh(&config, &store, &claim, sent).await else {
                    lease::abandon(&config, store, claim.key, claim.lease);
                    report(&config, &label, Outcome::StoreUnavailable);
                    tracing::warn!(
                        "the claim was answered too late to be trusted and could not be proven \
                         held; released, the handler did not run"
                    );
                    return Ok(config.problem(
                        ErrorKind::StoreUnavailable,
                        "the idempotency store answered too slowly; retry later",
                        Some(retry_after),
                    ));
                };
                report(
                    &config,
                    &label,
                    if retaken {
                        Outcome::Retaken
                    } else {
                        Outcome::Claimed
                    },
                );
                if retaken {
                    tracing::info!("retook a claim whose holder stopped renewing it");
                } else {
                    tracing::debug!("claimed; running the handler");
                }
                let held = Held {
                    retaken,
                    held_since,
                    generation,
                };
                // Boxed: the handler's part of the state machine is large, and a request future
                // that carried it inline would be moved whole (replays and 409s included).
                Box::pin(run(config, label, store, inner, request, claim, held)).await
            }
            Ok(ClaimOutcome::FingerprintMismatch) => {
                report(&config, &label, Outcome::KeyReuse);
                tracing::debug!("key reused for a different request");
                Ok(config.problem(
                    ErrorKind::IdempotencyKeyReuse,
                    "this Idempotency-Key was used for a request with a different body or query",
                    None,
                ))
            }
            Ok(ClaimOutcome::InProgress) => {
                report(&config, &label, Outcome::InProgress);
                tracing::debug!("duplicate while in progress");
                Ok(config.problem(
                    ErrorKind::InProgress,
                    "a request with this Idempotency-Key is still being processed; retry later",
                    Some(retry_after),
                ))
            }
            Ok(ClaimOutcome::Finished(stored)) => {
                report(&config, &label, Outcome::Replayed);
                tracing::debug!(status = stored.status, "replayed");
                Ok(replay::replay(
                    &stored,
                    &config.replay_header,
                    &config.stored_headers,
                ))
            }
            // A record that exists but cannot be read (it does not decrypt) records an operation
            // that happened: running the handler unguarded would repeat it.
            Err(e) if config.fail_open && !e.is_unreadable_record() && !e.is_refused_claim() => {
                lease::abandon(&config, store, claim.key, claim.lease);
                report(&config, &label, Outcome::FailedOpen);
                tracing::warn!(error = %e, "idempotency store failed; running unguarded");
                pass_through(inner, request).await
            }
            Err(e) => {
                // An unreadable record was read whole: the store answered, and made no claim that
                // could need cleaning up.
                if !e.is_unreadable_record() && !e.is_refused_claim() {
                    lease::abandon(&config, store, claim.key, claim.lease);
                }
                report(&config, &label, Outcome::StoreUnavailable);
                tracing::error!(error = %e, "idempotency store failed; refusing the request");
                Ok(config.problem(
                    ErrorKind::StoreUnavailable,
                    "the idempotency store is unavailable; retry later",
                    Some(retry_after),
                ))
            }
        }
    }
    .instrument(span)
    .await
}

async fn pass_through<S, ResBody>(
    inner: S,
    request: Request<Body>,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>>,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    Ok(inner.oneshot(request).await?.map(Body::new))
}

/// Runs the handler for a claimed record, renewing the lease while it runs, and records (or
/// releases) what it answered. The request future this runs in is detached onto a task of its own
/// if the client goes away (see [`ResponseFuture`](crate::ResponseFuture)), so a disconnect cancels
/// neither the effect nor its recording.
async fn run<S, St, ResBody>(
    config: Arc<Config>,
    label: Label,
    store: St,
    inner: S,
    mut request: Request<Body>,
    claim: ClaimRequest,
    Held {
        retaken,
        held_since,
        generation,
    }: Held,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    request.extensions_mut().insert(IdempotencyContext::new(
        claim.key.clone(),
        claim.fingerprint,
        retaken,
        generation,
        config.derived_key_secret.clone(),
    ));
    #[cfg(feature = "postgres")]
    let slot = store.capabilities().postgres().map(|pg| {
        let slot = crate::transaction::TxSlot::new(pg.clone(), &config);
        request.extensions_mut().insert(slot.clone());
        (pg.clone(), slot)
    });
    let lease = Lease::new(
        store,
        config.clone(),
        label,
        claim.key,
        claim.fingerprint,
        claim.lease,
        held_since,
    );
    // The heartbeat's task was just spawned into this worker's LIFO slot, which other workers
    // cannot steal from: were the handler to block this thread at its first poll, the heartbeat
    // would never start. Yielding once lets it run (and arm its timer) first; its later wake-ups
    // come from the timer and the store's sockets, on whichever worker drives them.
    tokio::task::yield_now().await;
    // The handler runs until it answers or the maximum hold; the heartbeat runs on a task of its
    // own meanwhile.
    let handler = AssertUnwindSafe(inner.oneshot(request)).catch_unwind();
    let answer = tokio::time::timeout_at(lease.deadline(), handler).await;
    // A transaction the handler took is rolled back on every path but a recorded answer.
    #[cfg(feature = "postgres")]
    let left = slot.map(|(pg, slot)| (pg, slot.take_back()));
    let Ok(answer) = answer else {
        // Cancelled at the maximum hold. A transaction it took was never committed: it is rolled
        // back, then the key released. Otherwise (or when the handler moved its transaction into
        // a task that may still commit it) its effect may have happened: the timeout is recorded
        // as the key's definitive answer.
        lease.timed_out();
        #[cfg(feature = "postgres")]
        if let Some((pg, crate::transaction::Left::Transaction(tx))) = left {
            tracing::warn!("the handler was still running at the maximum hold; rolled back");
            crate::recording::transactional::rollback(&pg, tx).await;
            lease.release("the handler ran past the maximum hold").await;
            return Ok(config.problem(
                ErrorKind::HandlerTimeout,
                "the operation did not finish in time and was rolled back; retry later",
                Some(config.retry_after_secs),
            ));
        }
        tracing::warn!(
            "the handler was still running at the maximum hold; cancelled, and recorded as a \
             timeout"
        );
        let timeout = recording::handler_timeout(&config);
        let response = replay::fresh(&timeout);
        lease.complete(Arc::new(timeout)).await;
        return Ok(response);
    };
    match answer {
        Ok(Ok(response)) => {
            let mut response = response.map(Body::new);
            // A fresh answer never says it is a replay: a client told so would take a new charge
            // for an old one.
            let headers = response.headers_mut();
            headers.remove(&config.replay_header);
            headers.remove(crate::replay::IDEMPOTENCY_REPLAY);
            #[cfg(feature = "postgres")]
            match left {
                Some((pg, crate::transaction::Left::Transaction(tx))) => {
                    return Ok(crate::recording::transactional::record_in(
                        &config, lease, &pg, tx, response,
                    )
                    .await);
                }
                Some((_, crate::transaction::Left::Kept)) => {
                    tracing::error!(
                        "the handler kept its IdempotencyTx beyond its answer; it cannot be \
                         committed with the record, so the record is released"
                    );
                    lease.release("the handler kept its transaction").await;
                    return Ok(internal_error(&config));
                }
                _ => {}
            }
            Ok(recording::record(&config, lease, response).await)
        }
        Ok(Err(e)) => {
            lease.release("the handler returned an error").await;
            Err(e)
        }
        Err(_panic) => {
            lease.release("the handler panicked").await;
            Ok(internal_error(&config))
        }
    }
}

/// Whether the claim sent at `sent` can be trusted as held now: at once when its answer came
/// within a tenth of the in-progress TTL, otherwise after a guarded renewal (a late answer, from a
/// slow commit, a lost packet or a throttled process, may describe a claim that another instance
/// has retaken meanwhile). Gives when the lease was last proven held, or `None` to give it up.
async fn fresh<St: IdempotencyStore>(
    config: &Config,
    store: &St,
    claim: &ClaimRequest,
    sent: Instant,
) -> Option<Instant> {
    let ttl = config.in_progress_ttl;
    if sent.elapsed() <= ttl / FRESH_FRACTION {
        return Some(sent);
    }
    let renewing = Instant::now();
    let renewal = store.renew(&claim.key, claim.lease, ttl + config.retention);
    match tokio::time::timeout(renewal_bound(config, store), renewal).await {
        // A renewal answered late is no better than the claim: give up rather than trust it.
        Ok(Ok(Fenced::Done)) if renewing.elapsed() <= ttl / FRESH_FRACTION => Some(renewing),
        Ok(Ok(Fenced::Done)) => {
            tracing::warn!("a late claim answer was confirmed too late to be trusted");
            None
        }
        Ok(Ok(Fenced::LeaseLost)) => {
            tracing::warn!("a late claim answer: the record was retaken meanwhile");
            None
        }
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "a late claim answer could not be confirmed");
            None
        }
        Err(_) => None,
    }
}

/// How a claim came to be held.
struct Held {
    /// It was taken over from a holder that stopped renewing it.
    retaken: bool,
    /// When it was last proven held: the claim, or the renewal that confirmed a late claim.
    held_since: Instant,
    /// The record's generation, for the derived key.
    generation: Option<Generation>,
}

/// A claim answered within this fraction of the in-progress TTL is used at once.
pub(crate) const FRESH_FRACTION: u32 = 10;

fn internal_error(config: &Config) -> Response<Body> {
    config.problem(
        ErrorKind::InternalError,
        "the request failed; it was not recorded and may be retried",
        None,
    )
}

/// The first 8 bytes of the key's SHA-256 in hex, computed only if a subscriber records the span.
struct KeyHash<'a>(&'a str);

impl fmt::Display for KeyHash<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        crate::hex::write(f, &Sha256::digest(self.0.as_bytes())[..8])
    }
}
