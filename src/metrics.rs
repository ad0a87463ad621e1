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
//! Calls of [`RunOnce`](crate::RunOnce) are counted under the one endpoint label `run_once`
//! ([`RUN_ONCE_LABEL`](crate::once::RUN_ONCE_LABEL)), whatever their scope.
//!
//! **`idempotency_store_duration_seconds`** is the wall-clock time of each store operation the layer
//! runs: `operation` is `claim`, `complete` (also the completion written in the handler's
//! transaction), `renew` (the heartbeat), `release` (also the background clean-ups), `purge`
//! (through [`spawn_purge`](crate::spawn_purge)), or `lookup` (the look-ups of a duplicate that
//! waits, see [`wait`](crate::IdempotencyLayerBuilder::wait); inspection called on the store itself
//! is not timed); `result` is `ok` when the store answered,
//! whatever it answered (a completion refused because the lease was lost is `ok`), and `error` when
//! it failed, timed out, or the operation was given up before it finished. It times the store the
//! layer was given: behind a [`CachedStore`](crate::store::CachedStore), a claim answered from the
//! cache is a (fast) `claim` too.
//!
//! The layer describes both metrics (help text and unit) to the recorder installed when a layer is
//! built; [`describe`] does it again for a recorder installed later.
//!
//! [`MatchedPath`]: axum::extract::MatchedPath

#[cfg(feature = "metrics")]
pub use enabled::*;

#[cfg(not(feature = "metrics"))]
pub(crate) use disabled::*;

#[cfg(feature = "metrics")]
mod enabled {
    use std::future::Future;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use http::request::Parts;

    use crate::Fingerprint;
    use crate::outcome::Outcome;
    use crate::record::{
        ClaimOutcome, ClaimRequest, Fenced, LeaseToken, RecordKey, StoredResponse,
    };
    use crate::store::{IdempotencyStore, StoreError};

    /// The counter of request outcomes: labels `outcome` and `endpoint`.
    pub const REQUESTS_TOTAL: &str = "idempotency_requests_total";

    /// The histogram of store operation latency, in seconds: labels `operation` and `result`.
    pub const STORE_DURATION_SECONDS: &str = "idempotency_store_duration_seconds";

    /// Describes both metrics (help text and unit) to the installed recorder. The layer does it when
    /// it is built; call this after installing a recorder once layers already exist.
    pub fn describe() {
        ::metrics::describe_counter!(
            REQUESTS_TOTAL,
            ::metrics::Unit::Count,
            "What the idempotency layer did with guarded requests, by outcome and endpoint"
        );
        ::metrics::describe_histogram!(
            STORE_DURATION_SECONDS,
            ::metrics::Unit::Seconds,
            "Latency of idempotency store operations, by operation and result"
        );
    }

    /// The `endpoint` label of one request's outcomes, kept with its lease so that outcomes
    /// reported after the handler carry it too.
    #[derive(Clone, Debug)]
    pub(crate) struct Label(Arc<str>);

    impl Label {
        /// Method and route template when axum matched one, else method and `unmatched`: a raw path
        /// would make one series per URL.
        pub(crate) fn of(parts: &Parts) -> Self {
            let value = match parts.extensions.get::<axum::extract::MatchedPath>() {
                Some(route) => format!("{} {}", parts.method, route.as_str()),
                None => format!("{} unmatched", parts.method),
            };
            Label(value.into())
        }

        /// A fixed label, for outcomes outside HTTP (see [`RunOnce`](crate::RunOnce)).
        pub(crate) fn named(name: &str) -> Self {
            Label(name.into())
        }

        /// Counts `outcome` for this endpoint.
        pub(crate) fn count(&self, outcome: Outcome) {
            ::metrics::counter!(
                REQUESTS_TOTAL,
                "outcome" => outcome.as_str(),
                "endpoint" => self.0.clone(),
            )
            .increment(1);
        }
    }

    /// The store the layer uses: `store` with each operation timed.
    pub(crate) fn store<St: IdempotencyStore>(store: St) -> Timed<St> {
        Timed(store)
    }

    /// A store whose operations are timed into [`STORE_DURATION_SECONDS`].
    #[derive(Clone, Debug)]
    pub(crate) struct Timed<St>(St);

    /// The store as the layer uses it.
    pub(crate) type Measured<St> = Timed<St>;

    impl<St: IdempotencyStore> IdempotencyStore for Timed<St> {
        fn claim(
            &self,
            request: &ClaimRequest,
        ) -> impl Future<Output = Result<ClaimOutcome, StoreError>> + Send {
            timed("claim", self.0.claim(request))
        }

        fn complete(
            &self,
            key: &RecordKey,
            lease: LeaseToken,
            fingerprint: &Fingerprint,
            response: Arc<StoredResponse>,
            retention: Duration,
        ) -> impl Future<Output = Result<Fenced, StoreError>> + Send {
            timed(
                "complete",
                self.0
                    .complete(key, lease, fingerprint, response, retention),
            )
        }

        fn renew(
            &self,
            key: &RecordKey,
            lease: LeaseToken,
            lifetime: Duration,
        ) -> impl Future<Output = Result<Fenced, StoreError>> + Send {
            timed("renew", self.0.renew(key, lease, lifetime))
        }

        fn release(
            &self,
            key: &RecordKey,
            lease: LeaseToken,
        ) -> impl Future<Output = Result<Fenced, StoreError>> + Send {
            timed("release", self.0.release(key, lease))
        }

        fn purge_expired(&self) -> impl Future<Output = Result<u64, StoreError>> + Send {
            timed("purge", self.0.purge_expired())
        }

        fn capabilities(&self) -> crate::store::Capabilities<'_> {
            self.0.capabilities()
        }

        fn lookup(
            &self,
            key: &RecordKey,
        ) -> impl Future<Output = Result<Option<crate::store::RecordInfo>, StoreError>> + Send
        {
            timed("lookup", self.0.lookup(key))
        }

        fn delete(
            &self,
            key: &RecordKey,
        ) -> impl Future<Output = Result<crate::store::Deleted, StoreError>> + Send {
            timed("delete", self.0.delete(key))
        }

        fn list(
            &self,
            subject: &str,
            request: crate::store::ListRequest,
        ) -> impl Future<Output = Result<crate::store::RecordPage, StoreError>> + Send {
            timed("list", self.0.list(subject, request))
        }
    }

    /// Runs a store operation and records how long it took and whether it succeeded. An operation
    /// dropped before it finished (given up on a timeout) is recorded as an error.
    pub(crate) async fn timed<T, E>(
        operation: &'static str,
        work: impl Future<Output = Result<T, E>>,
    ) -> Result<T, E> {
        let mut timer = Timer {
            operation,
            started: Instant::now(),
            ok: false,
        };
        let out = work.await;
        timer.ok = out.is_ok();
        out
    }

    struct Timer {
        operation: &'static str,
        started: Instant,
        ok: bool,
    }

    impl Drop for Timer {
        fn drop(&mut self) {
            let result = if self.ok { "ok" } else { "error" };
            ::metrics::histogram!(
                STORE_DURATION_SECONDS,
                "operation" => self.operation,
                "result" => result,
            )
            .record(self.started.elapsed().as_secs_f64());
        }
    }
}

/// Without the feature: a label of no size and calls that compile to nothing.
#[cfg(not(feature = "metrics"))]
mod disabled {
    use http::request::Parts;

    use crate::outcome::Outcome;

    #[derive(Clone, Debug)]
    pub(crate) struct Label;

    impl Label {
        #[inline(always)]
        pub(crate) fn of(_: &Parts) -> Self {
            Label
        }

        #[inline(always)]
        pub(crate) fn named(_: &str) -> Self {
            Label
        }

        #[inline(always)]
        pub(crate) fn count(&self, _: Outcome) {}
    }

    #[inline(always)]
    pub(crate) fn store<St>(store: St) -> St {
        store
    }

    /// The store as the layer uses it: itself.
    pub(crate) type Measured<St> = St;

    #[cfg(feature = "postgres")]
    #[inline(always)]
    pub(crate) fn timed<F: std::future::Future>(_: &'static str, work: F) -> F {
        work
    }
}
