//! The glue to the [`metrics`](https://docs.rs/metrics) facade (feature `metrics`): the endpoint
//! label of a request's outcomes, counting an outcome under it, and timing a store operation.
//! Without the feature every call compiles to nothing. What is counted and timed is documented in
//! the public `metrics` module.

#[cfg(feature = "metrics")]
pub(crate) use enabled::*;

#[cfg(not(feature = "metrics"))]
pub(crate) use disabled::*;

#[cfg(feature = "metrics")]
mod enabled {
    use std::future::Future;
    use std::sync::Arc;
    use std::time::Instant;

    /// The counter of request outcomes: labels `outcome` and `endpoint`.
    pub(crate) const REQUESTS_TOTAL: &str = "idempotency_requests_total";

    /// The histogram of store operation latency, in seconds: labels `operation` and `result`.
    pub(crate) const STORE_DURATION_SECONDS: &str = "idempotency_store_duration_seconds";

    /// Describes both metrics (help text and unit) to the installed recorder.
    pub(crate) fn describe() {
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

    /// The `endpoint` label of one operation's outcomes, kept with its lease so that outcomes
    /// reported after the handler carry it too.
    #[derive(Clone, Debug)]
    pub(crate) struct Label(Arc<str>);

    impl Label {
        /// A label made by `name`, called only when metrics are compiled in.
        #[inline]
        pub(crate) fn made(name: impl FnOnce() -> String) -> Self {
            Label(name().into())
        }

        /// A fixed label.
        pub(crate) fn named(name: &str) -> Self {
            Label(name.into())
        }

        /// Counts `outcome` (its metric name) for this endpoint.
        pub(crate) fn count(&self, outcome: &'static str) {
            ::metrics::counter!(
                REQUESTS_TOTAL,
                "outcome" => outcome,
                "endpoint" => self.0.clone(),
            )
            .increment(1);
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
    #[derive(Clone, Debug)]
    pub(crate) struct Label;

    impl Label {
        #[inline(always)]
        pub(crate) fn made(_: impl FnOnce() -> String) -> Self {
            Label
        }

        #[inline(always)]
        pub(crate) fn named(_: &str) -> Self {
            Label
        }

        #[inline(always)]
        pub(crate) fn count(&self, _: &'static str) {}
    }

    #[inline(always)]
    pub(crate) fn timed<F: std::future::Future>(_: &'static str, work: F) -> F {
        work
    }
}
