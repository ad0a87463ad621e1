//! Metrics (feature `metrics`): exact outcome counts and store timings for known request sequences,
//! counted by a recorder written here; and the checkout example's `GET /metrics`, scraped over HTTP
//! from the example binary on Postgres.
#![cfg(feature = "metrics")]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::http::{HeaderMap, Request, Response, StatusCode};
use axum::routing::post as route_post;
use axum_idempotency::store::IdempotencyStore;
use axum_idempotency::{IdempotencyLayer, MemoryStore};
use common::{eventually, post, send};
use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};
use tower::{Layer, ServiceExt};

const REQUESTS: &str = axum_idempotency::metrics::REQUESTS_TOTAL;
const STORE: &str = axum_idempotency::metrics::STORE_DURATION_SECONDS;

/// Counters and histogram samples by `name{label=value,...}` (labels sorted).
#[derive(Default)]
struct TestRecorder {
    counters: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
    histograms: Mutex<BTreeMap<String, Arc<Samples>>>,
    described: Mutex<BTreeSet<String>>,
}

#[derive(Default)]
struct Samples(Mutex<Vec<f64>>);

impl HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0.lock().expect("samples").push(value);
    }
}

fn series(name: &str, labels: &[(&str, &str)]) -> String {
    let mut labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    labels.sort();
    format!("{name}{{{}}}", labels.join(","))
}

fn series_of(key: &Key) -> String {
    let labels: Vec<(&str, &str)> = key.labels().map(|l| (l.key(), l.value())).collect();
    series(key.name(), &labels)
}

impl TestRecorder {
    /// `idempotency_requests_total{outcome, endpoint}`.
    fn outcome(&self, outcome: &str, endpoint: &str) -> u64 {
        let id = series(REQUESTS, &[("outcome", outcome), ("endpoint", endpoint)]);
        let counters = self.counters.lock().expect("counters");
        counters.get(&id).map_or(0, |c| c.load(Ordering::SeqCst))
    }

    /// Every outcome counted for `endpoint`, by outcome.
    fn outcomes(&self, endpoint: &str) -> BTreeMap<String, u64> {
        axum_idempotency::Outcome::ALL
            .iter()
            .map(|o| (o.as_str().to_owned(), self.outcome(o.as_str(), endpoint)))
            .filter(|(_, n)| *n > 0)
            .collect()
    }

    /// Every `endpoint` label value seen.
    fn endpoints(&self) -> BTreeSet<String> {
        let counters = self.counters.lock().expect("counters");
        counters
            .keys()
            .filter_map(|k| {
                let rest = k.split_once("endpoint=")?.1;
                Some(rest.split_once(",outcome=")?.0.to_owned())
            })
            .collect()
    }

    /// Samples of `idempotency_store_duration_seconds{operation, result}`.
    fn timings(&self, operation: &str, result: &str) -> Vec<f64> {
        let id = series(STORE, &[("operation", operation), ("result", result)]);
        let histograms = self.histograms.lock().expect("histograms");
        histograms
            .get(&id)
            .map(|s| s.0.lock().expect("samples").clone())
            .unwrap_or_default()
    }
}

impl Recorder for TestRecorder {
    fn describe_counter(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
        let mut described = self.described.lock().expect("described");
        described.insert(key.as_str().to_owned());
    }
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, _: SharedString) {
        assert_eq!(unit, Some(Unit::Seconds));
        let mut described = self.described.lock().expect("described");
        described.insert(key.as_str().to_owned());
    }
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut counters = self.counters.lock().expect("counters");
        Counter::from_arc(counters.entry(series_of(key)).or_default().clone())
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let mut histograms = self.histograms.lock().expect("histograms");
        Histogram::from_arc(histograms.entry(series_of(key)).or_default().clone())
    }
}

/// `POST /orders/{id}/pay`: waits `x-delay-ms`, answers `x-status` (default 201).
async fn pay(
    axum::extract::State(runs): axum::extract::State<Arc<AtomicUsize>>,
    headers: HeaderMap,
) -> (StatusCode, &'static str) {
    runs.fetch_add(1, Ordering::SeqCst);
    let num = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok())
    };
    if let Some(ms) = num("x-delay-ms") {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    let status = num("x-status")
        .and_then(|s| StatusCode::from_u16(s as u16).ok())
        .unwrap_or(StatusCode::CREATED);
    (status, "paid")
}

fn builder<S: IdempotencyStore>(store: S) -> axum_idempotency::IdempotencyLayerBuilder<S> {
    IdempotencyLayer::builder(store).subject_extractor(|parts: &http::request::Parts| {
        let user = parts.headers.get("x-user")?.to_str().ok()?;
        Some(user.to_owned())
    })
}

fn orders<S: IdempotencyStore>(layer: IdempotencyLayer<S>) -> (Router, Arc<AtomicUsize>) {
    let runs = Arc::new(AtomicUsize::new(0));
    let router = Router::new()
        .route("/orders/{id}/pay", route_post(pay))
        .route_layer(layer)
        .with_state(runs.clone());
    (router, runs)
}

const ORDERS: &str = "POST /orders/{id}/pay";

// `#[tokio::test]` runs every task of a test on its thread, so a recorder set for that thread sees
// all of the layer's work, background tasks included, and the tests of this file do not mix.

#[tokio::test]
async fn outcomes_and_store_timings_are_counted_exactly_by_route() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let layer = builder(MemoryStore::new())
        .require_key(true)
        .build()
        .expect("layer");
    let described = recorder.described.lock().expect("described").clone();
    assert_eq!(
        described,
        BTreeSet::from([REQUESTS.to_owned(), STORE.to_owned()])
    );
    let (router, runs) = orders(layer);
    let req = |path: &str, key: Option<&str>, body: &str| {
        let req = post(path).user("alice").json(body);
        match key {
            Some(key) => req.key(key),
            None => req,
        }
    };

    // A fresh key, its replay (on another order id: the same route), and its reuse for another body.
    let first = send(&router, req("/orders/1/pay", Some("k1"), r#"{"a":1}"#)).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let replay = send(&router, req("/orders/1/pay", Some("k1"), r#"{"a":1}"#)).await;
    assert!(replay.replayed());
    let reuse = send(&router, req("/orders/1/pay", Some("k1"), r#"{"a":2}"#)).await;
    assert_eq!(reuse.status, StatusCode::UNPROCESSABLE_ENTITY);
    // A retryable answer (released), then its retry (recorded).
    let flaky = send(
        &router,
        req("/orders/2/pay", Some("k2"), "{}").header("x-status", "503"),
    )
    .await;
    assert_eq!(flaky.status, StatusCode::SERVICE_UNAVAILABLE);
    let retried = send(&router, req("/orders/2/pay", Some("k2"), "{}")).await;
    assert_eq!(retried.status, StatusCode::CREATED);
    // No key where one is required.
    let refused = send(&router, req("/orders/3/pay", None, "{}")).await;
    assert_eq!(refused.status, StatusCode::BAD_REQUEST);
    // A duplicate while the first is running.
    let slow = tokio::spawn({
        let router = router.clone();
        async move {
            let slow = req("/orders/4/pay", Some("k4"), "{}").header("x-delay-ms", "300");
            send(&router, slow).await
        }
    });
    eventually(|| runs.load(Ordering::SeqCst) == 4).await;
    let duplicate = send(&router, req("/orders/4/pay", Some("k4"), "{}")).await;
    assert_eq!(duplicate.status, StatusCode::CONFLICT);
    assert_eq!(
        slow.await.expect("slow request").status,
        StatusCode::CREATED
    );

    // The retry of the released request is the same operation run again (it keeps the released
    // record's generation): a retake, not a fresh claim.
    let expected: BTreeMap<String, u64> = [
        ("claimed", 3),
        ("retaken", 1),
        ("recorded", 3),
        ("released", 1),
        ("replayed", 1),
        ("key_reuse", 1),
        ("rejected", 1),
        ("in_progress", 1),
    ]
    .into_iter()
    .map(|(o, n)| (o.to_owned(), n))
    .collect();
    assert_eq!(recorder.outcomes(ORDERS), expected);
    // One series per route, never per URL.
    assert_eq!(recorder.endpoints(), BTreeSet::from([ORDERS.to_owned()]));

    // Six claims reached the store (the refused request never got that far, and the duplicate was
    // answered by the layer's own hold on the key), three completions, one release.
    for (operation, ok) in [("claim", 6), ("complete", 3), ("release", 1)] {
        let samples = recorder.timings(operation, "ok");
        assert_eq!(samples.len(), ok, "{operation}");
        assert!(samples.iter().all(|s| *s >= 0.0 && *s < 5.0), "{samples:?}");
    }
    for operation in ["claim", "complete", "renew", "release", "purge"] {
        assert!(
            recorder.timings(operation, "error").is_empty(),
            "{operation}"
        );
    }
    assert!(
        recorder.timings("renew", "ok").is_empty(),
        "no heartbeat within 90 s"
    );
}

#[tokio::test]
async fn outside_a_router_outcomes_are_labelled_unmatched() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let service = tower::service_fn(|_: Request<Body>| async {
        Ok::<_, Infallible>(Response::new(Body::from("done")))
    });
    let request = |path: &str| post(path).user("bob").key("same-key").json("{}").build();
    // No `MatchedPath` here: the label is the method and "unmatched", never the raw path.
    let plain = builder(MemoryStore::new()).build().expect("layer");
    let answer = plain
        .layer(service)
        .oneshot(request("/raw/7"))
        .await
        .expect("infallible");
    assert_eq!(answer.status(), StatusCode::OK);
    assert_eq!(recorder.outcome("claimed", "POST unmatched"), 1);
    assert_eq!(recorder.outcome("recorded", "POST unmatched"), 1);
    // With an endpoint setting that names one scope for every path, the label is still not the
    // path, and the records are shared (the second request replays the first).
    let named = builder(MemoryStore::new())
        .endpoint(|_| "payments".to_owned())
        .build()
        .expect("layer");
    for path in ["/raw/8", "/raw/9"] {
        let answer = named
            .clone()
            .layer(service)
            .oneshot(request(path))
            .await
            .expect("infallible");
        assert_eq!(answer.status(), StatusCode::OK);
    }
    assert_eq!(recorder.outcome("claimed", "POST unmatched"), 2);
    assert_eq!(recorder.outcome("replayed", "POST unmatched"), 1);
    assert_eq!(
        recorder.endpoints(),
        BTreeSet::from(["POST unmatched".to_owned()])
    );
}

/// The process's global recorder, installed once: what threads of the crate's own (the lease
/// keepers') record goes there.
fn global_recorder() -> &'static TestRecorder {
    static GLOBAL: std::sync::OnceLock<&'static TestRecorder> = std::sync::OnceLock::new();
    GLOBAL.get_or_init(|| {
        let recorder: &'static TestRecorder = Box::leak(Box::default());
        if metrics::set_global_recorder(Global(recorder)).is_err() {
            panic!("the one global recorder");
        }
        recorder
    })
}

/// A recorder of the process that forwards to a test's.
struct Global(&'static TestRecorder);

impl Recorder for Global {
    fn describe_counter(&self, key: KeyName, unit: Option<Unit>, text: SharedString) {
        self.0.describe_counter(key, unit, text);
    }
    fn describe_gauge(&self, key: KeyName, unit: Option<Unit>, text: SharedString) {
        self.0.describe_gauge(key, unit, text);
    }
    fn describe_histogram(&self, key: KeyName, unit: Option<Unit>, text: SharedString) {
        self.0.describe_histogram(key, unit, text);
    }
    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        self.0.register_counter(key, metadata)
    }
    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        self.0.register_gauge(key, metadata)
    }
    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        self.0.register_histogram(key, metadata)
    }
}

#[tokio::test]
async fn heartbeats_purges_and_late_outcomes_are_timed_and_labelled() {
    global_recorder();
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    let store = MemoryStore::new();
    let purge = axum_idempotency::store::spawn_purge(store.clone(), Duration::from_secs(3600));
    let layer = builder(store)
        .in_progress_ttl(Duration::from_millis(60))
        .build()
        .expect("layer");
    let (router, _) = orders(layer);
    // Renewed every 20 ms while the handler runs 200 ms.
    let slow = post("/orders/5/pay")
        .user("carol")
        .key("hb")
        .json("{}")
        .header("x-delay-ms", "200");
    assert_eq!(send(&router, slow).await.status, StatusCode::CREATED);
    // The lease keeper renews on a thread of its own: its timings go to the global recorder, as
    // in an application (a recorder local to this thread does not see them).
    let renewals = global_recorder().timings("renew", "ok").len();
    assert!(renewals >= 3, "{renewals} renewals");
    // The outcome reported after the handler carries the route's label.
    assert_eq!(recorder.outcome("recorded", ORDERS), 1);
    eventually(|| recorder.timings("purge", "ok").len() == 1).await;
    purge.abort();
}

#[cfg(feature = "postgres")]
#[tokio::test]
async fn store_failures_are_timed_as_errors() {
    let recorder = TestRecorder::default();
    let _local = metrics::set_default_local_recorder(&recorder);
    // Nothing listens on port 1: every connection attempt is refused.
    let pool = sqlx::postgres::PgPoolOptions::new()
        .acquire_timeout(Duration::from_secs(2))
        .connect_lazy("postgres://postgres@127.0.0.1:1/test")
        .expect("lazy pool");
    let layer = builder(axum_idempotency::store::PostgresStore::new(pool))
        .build()
        .expect("layer");
    let (router, runs) = orders(layer);
    let answer = send(
        &router,
        post("/orders/6/pay").user("dan").key("down").json("{}"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(runs.load(Ordering::SeqCst), 0);
    assert_eq!(recorder.outcome("store_unavailable", ORDERS), 1);
    // A new subject's first claim counts its records first (the records share); the count failed,
    // so did the look-up that would have let an existing key through, and the claim was refused
    // before it was sent. Each failed operation is timed as an error.
    let counted = recorder.timings("count", "error");
    assert_eq!(counted.len(), 1);
    // The pool retried connecting until its acquire timeout: the wait is in the sample.
    assert!(counted[0] >= 1.0, "waited for the pool: {counted:?}");
    let looked = recorder.timings("lookup", "error");
    assert_eq!(looked.len(), 1);
    assert!(looked[0] >= 1.0, "waited for the pool: {looked:?}");
    for operation in ["count", "lookup", "claim"] {
        assert!(recorder.timings(operation, "ok").is_empty(), "{operation}");
    }
    assert!(recorder.timings("claim", "error").is_empty());
}

// ---- the example binary, scraped over HTTP ----

/// Prometheus' text format: `name{label="value",...} number` lines, comments skipped. Returns
/// (name, labels, value) of each sample.
#[cfg(feature = "postgres")]
fn parse(text: &str) -> Vec<(String, BTreeMap<String, String>, f64)> {
    let mut samples = Vec::new();
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let (series, value) = line.rsplit_once(' ').expect("a sample line");
        let value: f64 = value.parse().expect("a number");
        let (name, labels) = match series.split_once('{') {
            None => (series.to_owned(), BTreeMap::new()),
            Some((name, rest)) => {
                let body = rest.strip_suffix('}').expect("closing brace");
                (name.to_owned(), parse_labels(body))
            }
        };
        samples.push((name, labels, value));
    }
    samples
}

#[cfg(feature = "postgres")]
fn parse_labels(body: &str) -> BTreeMap<String, String> {
    let mut labels = BTreeMap::new();
    let mut chars = body.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        if key.is_empty() {
            return labels;
        }
        assert_eq!(chars.next(), Some('"'), "quoted value of {key}");
        let mut value = String::new();
        loop {
            match chars.next().expect("closing quote") {
                '"' => break,
                '\\' => match chars.next().expect("escape") {
                    'n' => value.push('\n'),
                    other => value.push(other),
                },
                c => value.push(c),
            }
        }
        labels.insert(key.trim_start_matches(',').to_owned(), value);
        if chars.peek() == Some(&',') {
            chars.next();
        }
    }
}

#[cfg(feature = "postgres")]
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn example_serves_its_metrics_to_prometheus() {
    use common::example::{self, database_url};

    let admin = sqlx::PgPool::connect(&database_url())
        .await
        .expect("PostgreSQL");
    let schema = format!(
        "idem_t_{}_{}_metrics",
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs(),
        std::process::id()
    );
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .expect("schema");
    // Every checkout pauses 1.5 s after its charge, before its answer.
    let (_child, addr) = example::start(&schema, &[("CHECKOUT_HOLD_MS", "1500".to_owned())]).await;
    let call = move |method: &'static str, path: &'static str, key: Option<&'static str>| {
        let body = r#"{"amount":1200}"#;
        example::request(
            addr,
            method,
            path,
            "mia",
            key,
            body,
            Duration::from_secs(30),
        )
    };
    let first = call("POST", "/checkout", Some("m-1"))
        .await
        .expect("checkout");
    assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
    let replay = call("POST", "/checkout", Some("m-1"))
        .await
        .expect("replay");
    assert!(replay.replayed(), "{replay:?}");
    // A slow checkout, and its duplicate once its charge is on record.
    let slow = tokio::spawn(call("POST", "/checkout", Some("m-2")));
    let mut charged = false;
    for _ in 0..100 {
        let list = call("GET", "/charges", None).await.expect("charges");
        if list.json()["provider_payments"] == 2 {
            charged = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(charged, "the slow checkout reached the provider");
    let duplicate = call("POST", "/checkout", Some("m-2")).await.expect("dup");
    assert_eq!(duplicate.status, StatusCode::CONFLICT, "{duplicate:?}");
    let slow = slow.await.expect("task").expect("slow checkout");
    assert_eq!(slow.status, StatusCode::CREATED);

    let scrape = call("GET", "/metrics", None).await.expect("scrape");
    assert_eq!(scrape.status, StatusCode::OK);
    assert!(
        scrape
            .header("content-type")
            .is_some_and(|c| c.starts_with("text/plain; version=0.0.4"))
    );
    let text = String::from_utf8(scrape.body.to_vec()).expect("UTF-8");
    assert!(
        text.contains(&format!("# TYPE {REQUESTS} counter")),
        "{text}"
    );
    assert!(
        text.contains(&format!("# TYPE {STORE} histogram")),
        "{text}"
    );
    let samples = parse(&text);
    let value = |name: &str, labels: &[(&str, &str)]| -> Option<f64> {
        samples
            .iter()
            .find(|(n, l, _)| {
                n == name
                    && l.len() == labels.len()
                    && labels
                        .iter()
                        .all(|(k, v)| l.get(*k).is_some_and(|x| x == v))
            })
            .map(|(_, _, v)| *v)
    };
    let outcome = |o: &str| value(REQUESTS, &[("outcome", o), ("endpoint", "POST /checkout")]);
    assert_eq!(outcome("claimed"), Some(2.0), "{text}");
    assert_eq!(outcome("recorded"), Some(2.0), "{text}");
    assert_eq!(outcome("replayed"), Some(1.0), "{text}");
    assert_eq!(outcome("in_progress"), Some(1.0), "{text}");
    assert_eq!(outcome("key_reuse"), None, "{text}");
    // Three claims reached the store: two checkouts and the replay (the duplicate was answered by
    // the instance's own hold on the key).
    let claim = [("operation", "claim"), ("result", "ok")];
    let count = value(&format!("{STORE}_count"), &claim);
    assert_eq!(count, Some(3.0), "{text}");
    let sum = value(&format!("{STORE}_sum"), &claim).expect("sum");
    assert!(sum > 0.0 && sum < 3.0 * 5.0, "{sum}");
    let inf = [("operation", "claim"), ("result", "ok"), ("le", "+Inf")];
    assert_eq!(value(&format!("{STORE}_bucket"), &inf), count);
    // The two completions were written in the handlers' transactions.
    let complete = [("operation", "complete"), ("result", "ok")];
    assert_eq!(value(&format!("{STORE}_count"), &complete), Some(2.0));
}
