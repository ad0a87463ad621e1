//! The configurations: one handler, bare or behind each layer and store. Every one has the same
//! route (`POST /checkout`), the same handler (a `201` with a small JSON body, counting its calls)
//! and an authentication step that turns the `authorization` header into the subject the layer
//! scopes keys by, in the form that layer reads it.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::http::header::{CONTENT_TYPE, LOCATION};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum_idempotency::store::RedisStore;
use axum_idempotency::{IdempotencyLayer, MemoryStore, Subject};

/// One configuration of the handler.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Kind {
    /// The handler alone, behind the same authentication step.
    Bare,
    /// This crate's layer, default settings, `MemoryStore`.
    OursMemory,
    /// `idempotent` 1.0's layer, default settings, its memory store, keys scoped by the subject.
    IdempotentMemory,
    /// footing 0.6's layer, default settings, its memory store with room for every key of the run.
    FootingMemory,
    /// This crate's layer, default settings, `RedisStore`.
    OursRedis,
    /// The same, with the store's listing index and the subjects' shares turned off
    /// (`without_scope_fields()`, `max_records_per_subject(None)`): what the Redis store costs
    /// without the round trips those add.
    OursRedisLean,
    /// `idempotent` 1.0's layer, default settings, its Valkey/Redis store, keys scoped by the
    /// subject.
    IdempotentValkey,
}

impl Kind {
    pub(crate) const ALL: [Kind; 7] = [
        Kind::Bare,
        Kind::OursMemory,
        Kind::IdempotentMemory,
        Kind::FootingMemory,
        Kind::OursRedis,
        Kind::OursRedisLean,
        Kind::IdempotentValkey,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Kind::Bare => "bare route (no idempotency)",
            Kind::OursMemory => "axum-idempotency, MemoryStore",
            Kind::IdempotentMemory => "idempotent 1.0, memory store",
            Kind::FootingMemory => "footing 0.6, memory store",
            Kind::OursRedis => "axum-idempotency, RedisStore",
            Kind::OursRedisLean => {
                "axum-idempotency, RedisStore without scope fields or shares (explanatory)"
            }
            Kind::IdempotentValkey => "idempotent 1.0, Valkey/Redis store",
        }
    }

    pub(crate) fn redis(self) -> bool {
        matches!(
            self,
            Kind::OursRedis | Kind::OursRedisLean | Kind::IdempotentValkey
        )
    }
}

/// Calls of one configuration's handler.
pub(crate) type Calls = Arc<AtomicU64>;

/// The handler of every configuration: `201` with a small JSON body and a `Location`, counting its
/// calls (a replay must not reach it).
async fn created(State(calls): State<Calls>, _body: Bytes) -> Response {
    let id = calls.fetch_add(1, Ordering::Relaxed) + 1;
    (
        StatusCode::CREATED,
        [(CONTENT_TYPE, "application/json"), (LOCATION, "/charges/1")],
        format!(r#"{{"id":{id},"status":"succeeded"}}"#),
    )
        .into_response()
}

/// The authentication step of the bare route and of the layers that read a `Subject` extension
/// (this crate's directly, `idempotent`'s through its scope hook): the `authorization` header is
/// the subject.
async fn auth(mut request: Request, next: Next) -> Response {
    if let Some(s) = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
    {
        let subject = Subject(s.to_owned());
        request.extensions_mut().insert(subject);
    }
    next.run(request).await
}

/// The same step for footing, whose layer reads a verified subject as an `IdempotencyScope`
/// extension (a SHA-256 of the subject) and refuses (`403`) a request with an `authorization`
/// header that has none.
async fn auth_footing(mut request: Request, next: Next) -> Response {
    if let Some(s) = request
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
    {
        let scope = footing::http::idempotency::IdempotencyScope::new(s);
        request.extensions_mut().insert(scope);
    }
    next.run(request).await
}

/// Where the Redis configurations keep their keys.
pub(crate) struct RedisPlace<'a> {
    pub(crate) url: &'a str,
    /// A prefix of this run's own (no `:`, which `idempotent` refuses in a prefix).
    pub(crate) prefix: &'a str,
}

/// `kind`'s router and its handler's call counter. Call it on the server thread: the stores'
/// connections and tasks are made on the runtime that calls it.
pub(crate) async fn router(kind: Kind, redis: &RedisPlace<'_>, capacity: usize) -> (Router, Calls) {
    let calls: Calls = Arc::new(AtomicU64::new(0));
    let route = Router::new().route("/checkout", post(created));
    let router = match kind {
        Kind::Bare => route.layer(middleware::from_fn(auth)),
        Kind::OursMemory => {
            let layer = IdempotencyLayer::new(MemoryStore::new()).expect("valid settings");
            route.route_layer(layer).layer(middleware::from_fn(auth))
        }
        Kind::OursRedis | Kind::OursRedisLean => {
            let client = axum_idempotency::redis::Client::open(redis.url).expect("REDIS_URL");
            let store = RedisStore::new(client).expect("redis store");
            let layer = if kind == Kind::OursRedis {
                let store = store.with_prefix(&format!("{}ours:", redis.prefix));
                IdempotencyLayer::new(store).expect("valid settings")
            } else {
                let store = store
                    .with_prefix(&format!("{}lean:", redis.prefix))
                    .without_scope_fields();
                IdempotencyLayer::builder(store)
                    .max_records_per_subject(None)
                    .build()
                    .expect("valid settings")
            };
            route.route_layer(layer).layer(middleware::from_fn(auth))
        }
        Kind::IdempotentMemory => {
            let store = idempotent::memory::MemoryStore::builder()
                .try_build()
                .expect("idempotent memory store");
            route
                .route_layer(idempotent_layer(store))
                .layer(middleware::from_fn(auth))
        }
        Kind::IdempotentValkey => {
            let store = idempotent::valkey::ValkeyStore::with_url(redis.url)
                .prefix(format!("{}theirs", redis.prefix))
                .try_build()
                .await
                .expect("idempotent Valkey store (is Redis running at REDIS_URL?)");
            route
                .route_layer(idempotent_layer(store))
                .layer(middleware::from_fn(auth))
        }
        Kind::FootingMemory => {
            use footing::http::idempotency::{
                IdempotencyConfig, IdempotencyLayer, IdempotencyRuntime, MemoryIdempotencyStore,
            };
            // Its default capacity is 1 024 records, after which new keys get `503`: raised past
            // every key of the run.
            let store = MemoryIdempotencyStore::with_clock_and_max_records(
                footing::clock::system_clock(),
                capacity,
            )
            .expect("footing memory store");
            let runtime = IdempotencyRuntime::new(Arc::new(store), IdempotencyConfig::default());
            route
                .route_layer(IdempotencyLayer::new(runtime))
                .layer(middleware::from_fn(auth_footing))
        }
    };
    (router.with_state(calls.clone()), calls)
}

/// `idempotent`'s layer over `store`, default settings, keys scoped by the `Subject` the
/// authentication step put in the request (its README: "Scope every key by the caller in a
/// service with more than one client").
fn idempotent_layer<S>(store: S) -> idempotent::middleware::IdempotencyLayer<S> {
    idempotent::middleware::IdempotencyLayer::new(store).scope(|parts| {
        parts
            .extensions
            .get::<Subject>()
            .map(|subject| subject.0.clone())
    })
}
