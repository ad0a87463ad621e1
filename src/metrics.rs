//! Metrics through the [`metrics`](https://docs.rs/metrics) facade (feature `metrics`, off by
//! default): the layer counts what it did with each request and times every store operation,
//! into whatever recorder the application installed (Prometheus, StatsD, OpenTelemetry, ...).
//! Without an installed recorder the calls do nothing; without the feature they are not compiled.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | [`idempotency_requests_total`](REQUESTS_TOTAL) | counter | `outcome`, `endpoint` |
//! | [`idempotency_store_duration_seconds`](STORE_DURATION_SECONDS) | histogram, seconds | `operation`, `result` |
//!
//! **`idempotency_requests_total`** counts every [`Outcome`](crate::Outcome) of a guarded request;
//! `outcome` is its [`as_str`](crate::Outcome::as_str) name (`claimed`, `retaken`, `recorded`,
//! `released`, `lease_lost`, `record_deferred`, `replayed`, `in_progress`, `key_reuse`,
//! `store_unavailable`, `failed_open`, `rejected`). A request that runs the handler counts two: how
//! it was claimed, then whether its answer was recorded or released; so `claimed + retaken` is the
//! number of handler runs. Requests without a key that pass through unguarded, and methods the
//! layer does not guard, are not counted.
//!
//! `endpoint` is the request's method and axum's route template ([`MatchedPath`]), e.g.
//! `POST /orders/{id}/pay`, so that a label value is a route, not a URL: `/orders/42/pay` and
//! `/orders/43/pay` are one series. A request without a `MatchedPath` (the layer around a service
//! outside a `Router`, or around a router's fallback) is labelled with its method and `unmatched`,
//! e.g. `POST unmatched`: never a raw path, which would make one series per URL. (Do not narrow
//! [`IdempotencyLayerBuilder::endpoint`](crate::IdempotencyLayerBuilder::endpoint) to bound labels:
//! it names the records, and two paths with one endpoint share their records.) Outcomes reported after the
//! handler (`recorded`, `released`, `lease_lost`, `record_deferred`, also from background retries)
//! carry the same label as the claim.
//! Calls of [`RunOnce`](crate::once::RunOnce) are counted under the one endpoint label `run_once`
//! , whatever their scope.
//!
//! **`idempotency_store_duration_seconds`** is the wall-clock time of each store operation the layer
//! runs: `operation` is `claim`, `complete` (also the completion written in the handler's
//! transaction), `renew` (the heartbeat), `release` (also the background clean-ups), `purge`
//! (through [`spawn_purge`](crate::store::spawn_purge)), `lookup` (the look-ups of a duplicate that
//! waits, see [`wait`](crate::IdempotencyLayerBuilder::wait); inspection called on the store itself
//! is not timed), or `steps` and `record_step` (a recovery point's read and write, see
//! [`IdempotencyContext::step`](crate::IdempotencyContext::step)); `result` is `ok` when the store answered,
//! whatever it answered (a completion refused because the lease was lost is `ok`), and `error` when
//! it failed, timed out, or the operation was given up before it finished. It times the store the
//! layer was given: behind a [`CachedStore`](crate::store::CachedStore), a claim answered from the
//! cache is a (fast) `claim` too.
//!
//! The layer describes both metrics (help text and unit) to the recorder installed when a layer is
//! built; [`describe`] does it again for a recorder installed later.
//!
//! [`MatchedPath`]: axum::extract::MatchedPath

/// The counter of request outcomes: labels `outcome` and `endpoint`.
pub const REQUESTS_TOTAL: &str = crate::util::metrics::REQUESTS_TOTAL;

/// The histogram of store operation latency, in seconds: labels `operation` and `result`.
pub const STORE_DURATION_SECONDS: &str = crate::util::metrics::STORE_DURATION_SECONDS;

/// Describes both metrics (help text and unit) to the installed recorder. The layer does it when
/// it is built; call this after installing a recorder once layers already exist.
pub fn describe() {
    crate::util::metrics::describe();
}
