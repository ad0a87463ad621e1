//! Reporting what the layer did with a request: to the request's span, the application's hook and
//! the metrics.

use crate::config::Config;
use crate::metrics::Label;
use crate::outcome::Outcome;

/// Reports an outcome as a DEBUG event of the current span (one per outcome: a span field recorded
/// twice would print twice), to the configured hook and, with the `metrics` feature, to the
/// outcome counter under the request's endpoint `label`.
pub(crate) fn report(config: &Config, label: &Label, outcome: Outcome) {
    tracing::debug!(outcome = outcome.as_str(), "idempotency outcome");
    if let Some(hook) = &config.on_outcome {
        hook(outcome);
    }
    label.count(outcome);
}
