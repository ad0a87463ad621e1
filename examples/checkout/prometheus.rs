//! A small `metrics` recorder for the checkout example: counters and histograms, rendered in
//! Prometheus' text exposition format at `GET /metrics`. Enough for the layer's two metrics; an
//! application with more needs would install an exporter crate instead (gauges are ignored here).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

/// Histogram bucket bounds, in seconds: from half a millisecond to ten seconds.
const BUCKETS: [f64; 14] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

static INSTALLED: OnceLock<Prometheus> = OnceLock::new();

/// Installs the recorder process-wide; `GET /metrics` renders it from then on.
pub(crate) fn install() -> Result<(), Box<dyn std::error::Error>> {
    let recorder = INSTALLED.get_or_init(Prometheus::default).clone();
    metrics::set_global_recorder(recorder).map_err(|e| format!("metrics recorder: {e}"))?;
    axum_idempotency::metrics::describe();
    Ok(())
}

/// `GET /metrics`: every series in the text format, or `404` when no recorder was installed (the
/// router served on its own, as the tests do).
pub(crate) async fn scrape() -> Response {
    match INSTALLED.get() {
        Some(recorder) => (
            [(
                header::CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8",
            )],
            recorder.render(),
        )
            .into_response(),
        None => (
            StatusCode::NOT_FOUND,
            axum::Json(serde_json::json!({"error": "metrics_not_installed"})),
        )
            .into_response(),
    }
}

#[derive(Clone, Default)]
struct Prometheus {
    registry: Arc<Mutex<Registry>>,
}

#[derive(Default)]
struct Registry {
    help: BTreeMap<String, String>,
    counters: BTreeMap<Key, Arc<AtomicU64>>,
    histograms: BTreeMap<Key, Arc<Buckets>>,
}

/// One histogram series: counts per bucket (not cumulative; the last is `+Inf`), sum and count.
#[derive(Default)]
struct Buckets {
    state: Mutex<(Vec<u64>, f64, u64)>,
}

impl HistogramFn for Buckets {
    fn record(&self, value: f64) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let (counts, sum, count) = &mut *state;
        if counts.is_empty() {
            counts.resize(BUCKETS.len() + 1, 0);
        }
        let at = BUCKETS
            .iter()
            .position(|bound| value <= *bound)
            .unwrap_or(BUCKETS.len());
        counts[at] += 1;
        *sum += value;
        *count += 1;
    }
}

impl Prometheus {
    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn describe(&self, key: KeyName, description: SharedString) {
        let help = description.replace('\\', "\\\\").replace('\n', "\\n");
        self.registry().help.insert(key.as_str().to_owned(), help);
    }

    fn render(&self) -> String {
        let registry = self.registry();
        let mut out = String::new();
        // `# HELP` and `# TYPE` once per metric name, before its first series (keys sort by name).
        let mut named = String::new();
        let mut head = |out: &mut String, name: &str, kind: &str| {
            if named != name {
                if let Some(help) = registry.help.get(name) {
                    let _ = writeln!(out, "# HELP {name} {help}");
                }
                let _ = writeln!(out, "# TYPE {name} {kind}");
                named = name.to_owned();
            }
        };
        for (key, value) in &registry.counters {
            head(&mut out, key.name(), "counter");
            let value = value.load(Ordering::Relaxed);
            let _ = writeln!(out, "{}{} {value}", key.name(), labels(key, None));
        }
        for (key, buckets) in &registry.histograms {
            let name = key.name();
            head(&mut out, name, "histogram");
            let (counts, sum, count) = {
                let state = buckets.state.lock().unwrap_or_else(|p| p.into_inner());
                state.clone()
            };
            let mut cumulative = 0;
            for (i, bound) in BUCKETS.iter().enumerate() {
                cumulative += counts.get(i).copied().unwrap_or(0);
                let le = labels(key, Some(&bound.to_string()));
                let _ = writeln!(out, "{name}_bucket{le} {cumulative}");
            }
            let _ = writeln!(out, "{name}_bucket{} {count}", labels(key, Some("+Inf")));
            let _ = writeln!(out, "{name}_sum{} {sum}", labels(key, None));
            let _ = writeln!(out, "{name}_count{} {count}", labels(key, None));
        }
        out
    }
}

/// `{a="x",b="y"}` with `le` last when given; empty without labels.
fn labels(key: &Key, le: Option<&str>) -> String {
    let mut pairs: Vec<(&str, &str)> = key.labels().map(|l| (l.key(), l.value())).collect();
    if let Some(le) = le {
        pairs.push(("le", le));
    }
    if pairs.is_empty() {
        return String::new();
    }
    let inner: Vec<String> = pairs
        .iter()
        .map(|(k, v)| {
            let v = v
                .replace('\\', "\\\\")
                .replace('"', "\\\"")
                .replace('\n', "\\n");
            format!("{k}=\"{v}\"")
        })
        .collect();
    format!("{{{}}}", inner.join(","))
}

impl Recorder for Prometheus {
    fn describe_counter(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.describe(key, description);
    }

    fn describe_gauge(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.describe(key, description);
    }

    fn describe_histogram(&self, key: KeyName, _: Option<Unit>, description: SharedString) {
        self.describe(key, description);
    }

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut registry = self.registry();
        Counter::from_arc(registry.counters.entry(key.clone()).or_default().clone())
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let mut registry = self.registry();
        Histogram::from_arc(registry.histograms.entry(key.clone()).or_default().clone())
    }
}
