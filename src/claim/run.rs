//! A granted claim: proven held if its answer came late, then the handler run under the lease, and
//! its answer recorded (or the record released).

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use axum::body::Body;
use futures_util::FutureExt;
use http::{Request, Response};
use tokio::time::Instant;
use tower::{BoxError, Service, ServiceExt};

use super::internal_error;
use crate::config::Config;
use crate::context::IdempotencyContext;
use crate::lease::{self, Lease, renewal_bound};
use crate::metrics::Label;
use crate::outcome::Outcome;
use crate::problem::ErrorKind;
use crate::record::{ClaimRequest, FRESH_FRACTION, Fenced, Generation};
use crate::recording;
use crate::replay;
use crate::report::report;
use crate::store::IdempotencyStore;

/// What the store said when it granted a claim.
pub(super) struct Granted {
    /// When the claim was sent.
    pub(super) sent: Instant,
    /// It was taken over from a holder that stopped renewing it.
    pub(super) retaken: bool,
    /// The record's generation, for the derived key.
    pub(super) generation: Option<Generation>,
}

/// Runs the handler for a granted claim, once the claim is proven held.
pub(super) async fn claimed<S, St, ResBody>(
    config: Arc<Config>,
    label: Label,
    store: St,
    inner: S,
    request: Request<Body>,
    claim: ClaimRequest,
    Granted {
        sent,
        retaken,
        generation,
    }: Granted,
) -> Result<Response<Body>, S::Error>
where
    S: Service<Request<Body>, Response = Response<ResBody>> + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    St: IdempotencyStore,
    ResBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    ResBody::Error: Into<BoxError>,
{
    let Some(held_since) = fresh(&config, &store, &claim, sent).await else {
        lease::abandon(&config, store, claim.key, claim.lease);
        report(&config, &label, Outcome::StoreUnavailable);
        tracing::warn!(
            "the claim was answered too late to be trusted and could not be proven held; \
             released, the handler did not run"
        );
        return Ok(config.problem(
            ErrorKind::StoreUnavailable,
            "the idempotency store answered too slowly; retry later",
            Some(config.retry_after_secs),
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
    run(config, label, store, inner, request, claim, held).await
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
    let key = Arc::new(claim.key);
    request.extensions_mut().insert(IdempotencyContext::new(
        key.clone(),
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
    // Its heartbeat runs before the handler does (see `Lease::started`).
    let lease = Lease::started(
        store,
        config.clone(),
        label,
        key,
        claim.fingerprint,
        claim.lease,
        held_since,
    )
    .await;
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
            // Boxed, as the transactional recording below: sqlx's futures are large, and
            // carried inline they would be moved with every request's future.
            Box::pin(crate::recording::transactional::rollback(&pg, tx)).await;
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
        let mut response = replay::fresh(&timeout);
        if config.expiry_header {
            replay::mark_expiry(response.headers_mut(), config.retention);
        }
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
            headers.remove(&crate::replay::IDEMPOTENCY_REPLAY_NAME);
            #[cfg(feature = "postgres")]
            match left {
                Some((pg, crate::transaction::Left::Transaction(tx))) => {
                    // Boxed: its commit's futures are the largest part of this state machine,
                    // and only requests that took a transaction need them.
                    return Ok(Box::pin(crate::recording::transactional::record_in(
                        &config, lease, &pg, tx, response,
                    ))
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
pub(crate) async fn fresh<St: IdempotencyStore>(
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
    // A store that panics has not confirmed the claim: given up (released by its token), as after
    // an error.
    let renewal = AssertUnwindSafe(store.renew(&claim.key, claim.lease, ttl + config.retention))
        .catch_unwind()
        .map(|renewed| {
            renewed.unwrap_or_else(|_| Err(crate::StoreError::msg("the store's renewal panicked")))
        });
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lease::tests::{config, request, store};
    use crate::record::ClaimOutcome;
    use std::sync::atomic::Ordering;

    #[tokio::test(start_paused = true)]
    async fn a_late_claim_whose_confirming_renewal_panics_is_given_up() {
        let (store, config) = (store(), config());
        let claim = request("late");
        assert!(matches!(
            store.claim(&claim).await.expect("claim"),
            ClaimOutcome::Claimed { .. }
        ));
        let sent = Instant::now();
        // Answered later than a tenth of the TTL: it must be confirmed by a renewal first.
        tokio::time::sleep(config.in_progress_ttl / 5).await;
        store.panic_once.store(true, Ordering::SeqCst);
        assert_eq!(fresh(&config, &store, &claim, sent).await, None);
        // The same, with a renewal that gets through: held since the renewal.
        let confirmed = fresh(&config, &store, &claim, sent).await;
        assert_eq!(confirmed, Some(Instant::now()));
    }
}
