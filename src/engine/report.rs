//! Reporting what the engine did with an operation: to its span, the application's hook and the
//! metrics.

use super::core::Engine;
use super::outcome::Outcome;
use crate::store::IdempotencyStore;
use crate::util::metrics::Label;

impl<St: IdempotencyStore> Engine<St> {
    /// Reports an outcome as a DEBUG event of the current span (one per outcome: a span field
    /// recorded twice would print twice), to the configured hook and, with the `metrics` feature,
    /// to the outcome counter under the operation's endpoint `label`.
    ///
    /// The hook and the metrics recorder are the application's. One that panics is logged and
    /// ignored: outcomes are reported from inside the lease's life (a timeout before its record, a
    /// deferred completion before its retries start), and a panic unwinding from there would drop
    /// the lease unsettled, releasing a record whose effect may have happened or leaving it to be
    /// retaken.
    pub(crate) fn report(&self, label: &Label, outcome: Outcome) {
        tracing::debug!(outcome = outcome.as_str(), "idempotency outcome");
        let reported = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            if let Some(hook) = &self.settings().on_outcome {
                hook(outcome);
            }
            label.count(outcome.as_str());
        }));
        if reported.is_err() {
            tracing::error!(
                outcome = outcome.as_str(),
                "the outcome hook or the metrics recorder panicked; ignored"
            );
        }
    }
}
