//! The endpoint label of a request's metrics (feature `metrics`): its method and axum's route
//! template ([`MatchedPath`](axum::extract::MatchedPath)), or `unmatched`: never a raw path, which
//! would make one series per URL.

use http::request::Parts;

use crate::util::metrics::Label;

/// The label of `parts`' outcomes; nothing is computed without the feature.
pub(super) fn of(parts: &Parts) -> Label {
    Label::made(|| {
        #[cfg(feature = "metrics")]
        if let Some(route) = parts.extensions.get::<axum::extract::MatchedPath>() {
            return format!("{} {}", parts.method, route.as_str());
        }
        format!("{} unmatched", parts.method)
    })
}
