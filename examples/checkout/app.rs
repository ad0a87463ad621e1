//! The application: the idempotency layer as this API sets it, the routes, the tower-http layers
//! around them, the demo authentication and the shutdown signal.

use std::error::Error;
use std::time::Duration;

use axum::Router;
use axum::extract::Request;
use axum::handler::Handler;
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::Response;
use axum::routing::{get, post};
use axum_idempotency::store::IdempotencyStore;
use axum_idempotency::{Drain, IdempotencyLayer, IdempotencyLayerBuilder, Subject};
use tower::ServiceBuilder;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::compression::CompressionLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::request_id::{MakeRequestUuid, PropagateRequestIdLayer, SetRequestIdLayer};
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::{DefaultOnResponse, TraceLayer};

use super::handlers::{
    charges, checkout, checkout_separately, close_account, is_closed, refund, refund_separately,
};
use super::inspection::{forget, inspect};
#[cfg(feature = "openapi")]
use super::openapi;
#[cfg(feature = "metrics")]
use super::prometheus;
use super::{Ledger, Settings, error};

#[derive(Clone)]
pub(crate) struct AppState {
    pub(crate) ledger: Ledger,
    pub(crate) settings: Settings,
}

/// The idempotency layer of the payment routes, as this API sets it, on `store`.
pub(crate) fn idempotency<S: IdempotencyStore>(
    store: S,
    settings: &Settings,
) -> IdempotencyLayerBuilder<S> {
    let builder = IdempotencyLayer::builder(store)
        .require_key(true)
        .in_progress_ttl(settings.in_progress_ttl)
        .wait(settings.wait)
        .drain(drain())
        // Logged in the request's span (see `around`), so each outcome carries the request id.
        .on_outcome(|outcome| tracing::info!(outcome = outcome.as_str(), "idempotency outcome"))
        // A replay sends an earlier answer again: not to an account closed since.
        .replay_check(|parts, _record| {
            let closed = parts
                .extensions
                .get::<Subject>()
                .is_none_or(|subject| is_closed(&subject.0));
            std::future::ready(closed.then(|| error(StatusCode::FORBIDDEN, "account_closed")))
        });
    // A retry after the record expired is told so (410), not charged again.
    if settings.tombstones.is_zero() {
        builder
    } else {
        builder.tombstones(settings.tombstones)
    }
}

/// The field of the body that keys `POST /v2/checkout`, as AIP-155 puts it.
pub(crate) const REQUEST_ID_FIELD: &str = "/request_id";

/// The API: `POST /checkout` and `POST /refund` behind the idempotency layer, `GET /charges`.
pub(crate) fn app<S: IdempotencyStore>(
    idempotency: IdempotencyLayer<S>,
    ledger: Ledger,
    settings: Settings,
) -> Result<Router, Box<dyn Error>> {
    let store = idempotency.store().clone();
    // `POST /v2/checkout`: the same checkout, keyed by the body's `request_id` rather than a
    // header (its charge written on its own: this layer offers no transaction).
    let by_body = self::idempotency(store.clone(), &settings)
        .key_from_body(REQUEST_ID_FIELD)
        .build()?;
    #[cfg(feature = "openapi")]
    let document = axum::body::Bytes::from(openapi::document(&idempotency, &by_body)?);
    // On Postgres and SQLite the charge is written in the layer's transaction (`IdempotencyTx`), so
    // it commits with its record; `CHECKOUT_TRANSACTIONAL=0` writes it on its own instead, to compare.
    // The layer wraps each handler (`handler.layer(..)`), not the route: a method the route does not
    // serve (`PATCH /checkout`) gets the router's own 405, untouched and never recorded.
    let routes = if settings.transactional {
        Router::new()
            .route("/checkout", post(checkout.layer(idempotency.clone())))
            .route("/refund", post(refund.layer(idempotency)))
    } else {
        Router::new()
            .route(
                "/checkout",
                post(checkout_separately.layer(idempotency.clone())),
            )
            .route("/refund", post(refund_separately.layer(idempotency)))
    };
    let router = routes
        .route("/v2/checkout", post(checkout_separately.layer(by_body)))
        .route("/account/close", post(close_account))
        .route(
            "/checkout/idempotency/{key}",
            get(inspect::<S>).delete(forget::<S>).with_state(store),
        )
        .route("/charges", get(charges))
        .layer(middleware::from_fn(demo_auth))
        .with_state(AppState { ledger, settings });
    // Added after the auth layer, so a scraper needs no token.
    #[cfg(feature = "metrics")]
    let router = router.route("/metrics", get(prometheus::scrape));
    // The API's description, with the idempotency layer's contract on its guarded routes; no auth.
    #[cfg(feature = "openapi")]
    let router = router.route(
        "/openapi.json",
        get(move || std::future::ready(([(header::CONTENT_TYPE, "application/json")], document))),
    );
    Ok(around(router, &settings))
}

/// The request id's header: kept when the caller (or a proxy) sent one, made otherwise.
const REQUEST_ID: header::HeaderName = header::HeaderName::from_static("x-request-id");

/// The largest request body: under the idempotency layer's own limit (1 MiB), so this one decides.
const BODY_LIMIT: usize = 64 * 1024;

/// The tower-http layers around the API, outermost first. Every one is outside the idempotency
/// layer, which wraps the payment handlers themselves.
pub(crate) fn around(router: Router, settings: &Settings) -> Router {
    router.layer(
        ServiceBuilder::new()
            // First, so that everything below, the trace span included, sees the id.
            .layer(SetRequestIdLayer::new(REQUEST_ID, MakeRequestUuid))
            // One span per request, with its id: the idempotency layer's span opens inside it, so
            // its outcomes and the `instance` of each problem it answers are logged with the id.
            .layer(
                TraceLayer::new_for_http()
                    .make_span_with(request_span)
                    .on_response(DefaultOnResponse::new().level(tracing::Level::INFO)),
            )
            // Outside the panic catcher and the timeout, so their answers carry the id too.
            .layer(PropagateRequestIdLayer::new(REQUEST_ID))
            // A handler's panic never gets this far: the idempotency layer catches it under its
            // lease, releases the record and answers 500, so the retry runs the checkout again.
            // This catches the rest (the auth, the unguarded routes) and turns it into a 500.
            .layer(CatchPanicLayer::new())
            // Outside, so the record holds the plain bytes and each answer, replays included, is
            // encoded for the Accept-Encoding of the request it answers.
            .layer(CompressionLayer::new())
            // A body over the limit is 413 (with Content-Length, here; chunked, from the
            // idempotency layer, which finds this limit in the body's error); nothing is claimed.
            .layer(RequestBodyLimitLayer::new(BODY_LIMIT))
            // The client gets 408, but the idempotency layer runs a request whose body it has
            // read to its end: the checkout finishes, is recorded, and the retry gets the replay.
            // Inside the layer it would cancel the checkout midway, and its 408 would release
            // the key for the retry to run it again.
            .layer(TimeoutLayer::with_status_code(
                StatusCode::REQUEST_TIMEOUT,
                settings.request_timeout,
            )),
    )
}

/// The span of one request: its id, method and path.
fn request_span(request: &Request) -> tracing::Span {
    let id = request
        .headers()
        .get(&REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default();
    tracing::info_span!("request", id, method = %request.method(), path = request.uri().path())
}

/// The store's operation timeout: 5 s (the Postgres store's default), or less when the in-progress
/// TTL is short, since the TTL must be at least twice it.
pub(crate) fn store_timeout(settings: &Settings) -> Duration {
    Duration::from_secs(5).min(settings.in_progress_ttl / 2)
}

/// The process's one drain, shared by every idempotency layer it builds: `main` waits for it at
/// shutdown.
pub(crate) fn drain() -> Drain {
    static DRAIN: std::sync::OnceLock<Drain> = std::sync::OnceLock::new();
    DRAIN.get_or_init(Drain::new).clone()
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (what a deploy sends).
pub(crate) async fn shutdown_signal() {
    let terminate = async {
        #[cfg(unix)]
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
        #[cfg(not(unix))]
        std::future::pending::<()>().await;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
    tracing::info!("shutting down: no new connections; finishing the requests in flight");
}

/// Demo auth: `Authorization: Bearer <subject>` makes `<subject>` the subject.
async fn demo_auth(mut request: Request, next: Next) -> Response {
    let subject = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned);
    match subject {
        Some(subject) => {
            request.extensions_mut().insert(Subject(subject));
            next.run(request).await
        }
        None => error(StatusCode::UNAUTHORIZED, "unauthenticated"),
    }
}
