//! Admission: what the layer does with a request from its headers and its authenticated subject,
//! before its body is read or anything claimed.

use axum::body::Body;
use http::Response;
use http::request::Parts;

use super::key;
use super::label;
use super::problem::ErrorKind;
use super::settings::LayerSettings;
use crate::engine::{Engine, Outcome};
use crate::store::IdempotencyStore;
use crate::util::metrics::Label;

/// What the layer does with a request.
pub(super) enum Admission {
    /// Claimed under this key, for this subject.
    Guarded {
        key: String,
        subject: String,
        label: Label,
    },
    /// No key, where none is required: the request runs as if the layer were not there.
    Unguarded,
    /// Answered at once, without its body read or anything claimed.
    Refused(Response<Body>),
}

/// Reads the key and the subject, and checks the engine's admission bound.
pub(super) fn admit<St: IdempotencyStore>(
    engine: &Engine<St>,
    http: &LayerSettings,
    parts: &Parts,
) -> Admission {
    let refuse = |kind, detail: &str, retry_after| {
        engine.report(&label::of(parts), Outcome::Rejected);
        Admission::Refused(http.problem(kind, detail, retry_after))
    };
    let key = match key::from_headers(&parts.headers) {
        Ok(Some(key)) if key.len() < http.min_key_length => {
            let detail = format!(
                "the Idempotency-Key must be at least {} characters long here",
                http.min_key_length
            );
            return refuse(ErrorKind::InvalidIdempotencyKey, &detail, None);
        }
        Ok(Some(key)) => key,
        Ok(None) if http.require_key => {
            return refuse(
                ErrorKind::MissingIdempotencyKey,
                "this endpoint requires an Idempotency-Key header",
                None,
            );
        }
        Ok(None) => return Admission::Unguarded,
        Err(e) => return refuse(ErrorKind::InvalidIdempotencyKey, e.detail(), None),
    };
    let subject = match http.subject.subject(parts).filter(|s| !s.is_empty()) {
        Some(subject) => subject,
        None if http.allow_anonymous => String::new(),
        None => {
            return refuse(
                ErrorKind::MissingSubject,
                "an idempotent request must come from an authenticated subject",
                None,
            );
        }
    };
    // The endpoint label of this request's metrics (nothing without the `metrics` feature).
    let label = label::of(parts);
    // What runs detached is bounded, so a client that resets requests in a loop cannot make the
    // server run unbounded work. Refused before the body is read or anything claimed.
    let drain = engine.drain();
    if drain.detached() >= engine.settings().max_running {
        engine.report(&label, Outcome::Overloaded);
        tracing::warn!(
            detached = drain.detached(),
            "too many idempotent requests running on their own; refusing a new one"
        );
        return Admission::Refused(http.retryable(
            ErrorKind::Overloaded,
            "too many idempotent requests are running; retry later",
        ));
    }
    Admission::Guarded {
        key,
        subject,
        label,
    }
}
