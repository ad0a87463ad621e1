//! Admission: what the layer does with a request from its headers, its authenticated subject and
//! its path, before its body is read or anything claimed. Every bound a client could use to take
//! what others need is checked here: the scope's lengths, the instance's requests running
//! detached, and the subject's share of requests in flight.

use axum::body::Body;
use http::Response;
use http::request::Parts;

use super::key::{self, Found};
use super::label;
use super::problem::ErrorKind;
use super::settings::LayerSettings;
use crate::engine::{Engine, InFlight, Outcome, Refused};
use crate::store::{IdempotencyStore, RecordKey};
use crate::util::metrics::Label;

/// The longest subject the layer takes, in bytes: every store keeps it whole.
pub(crate) const MAX_SUBJECT_LEN: usize = 1024;

/// The longest endpoint (method and path) the layer takes, in bytes: every store keeps it whole.
pub(crate) const MAX_ENDPOINT_LEN: usize = 4096;

/// What the layer does with a request.
pub(super) enum Admission {
    /// Claimed under this scope; the subject's place in flight is held until the request ends.
    Guarded {
        scope: RecordKey,
        label: Label,
        in_flight: InFlight,
    },
    /// No key, where none is required: the request runs as if the layer were not there.
    Unguarded,
    /// Answered at once, without its body read or anything claimed.
    Refused(Response<Body>),
}

/// Reads the key (unless it was `found` in the body already), the subject and the endpoint, and
/// checks the bounds.
pub(super) fn admit<St: IdempotencyStore>(
    engine: &Engine<St>,
    http: &LayerSettings,
    parts: &Parts,
    found: Option<String>,
) -> Admission {
    let refuse = |kind, detail: &str| {
        engine.report(&label::of(parts), Outcome::Rejected);
        Admission::Refused(http.problem(kind, detail, None))
    };
    let found = match found {
        Some(key) => Ok(Found::Key(key)),
        None => http.key_source.in_parts(parts),
    };
    let key = match found {
        Ok(Found::Key(key)) => match checked(http, key) {
            Ok(key) => key,
            Err(detail) => return refuse(ErrorKind::InvalidIdempotencyKey, &detail),
        },
        // Never reached: a key in the body is read before admission. Were it reached, the
        // request would have a key nobody read; it is refused rather than run unguarded.
        Ok(Found::InBody) => {
            return Admission::Refused(super::handler::internal_error(http));
        }
        Ok(Found::Absent) if http.require_key => {
            let detail = format!(
                "this endpoint requires a key in {}",
                http.key_source.describe()
            );
            return refuse(ErrorKind::MissingIdempotencyKey, &detail);
        }
        Ok(Found::Absent) => return Admission::Unguarded,
        Err(key::Refused(detail)) => return refuse(ErrorKind::InvalidIdempotencyKey, &detail),
    };
    let subject = match http.subject.subject(parts).filter(|s| !s.is_empty()) {
        Some(subject) => subject,
        // A request with credentials is somebody's: never put in the scope every anonymous caller
        // shares, where another caller with its key would get its answer.
        None if http.allow_anonymous && !carries_credentials(http, parts) => String::new(),
        None if http.allow_anonymous => {
            return refuse(
                ErrorKind::MissingSubject,
                "the request carries credentials but no authenticated subject reached the \
                 idempotency layer",
            );
        }
        None => {
            return refuse(
                ErrorKind::MissingSubject,
                "an idempotent request must come from an authenticated subject",
            );
        }
    };
    if subject.len() > MAX_SUBJECT_LEN {
        return refuse(
            ErrorKind::SubjectTooLong,
            "the authenticated subject is longer than 1024 bytes",
        );
    }
    let endpoint = (http.endpoint)(parts);
    if endpoint.len() > MAX_ENDPOINT_LEN {
        return refuse(
            ErrorKind::EndpointTooLong,
            "the request's method and path are longer than 4096 bytes",
        );
    }
    // The endpoint label of this request's metrics (nothing without the `metrics` feature).
    let label = label::of(parts);
    // What runs detached is bounded, so a client that resets requests in a loop cannot make the
    // server run unbounded work.
    let drain = engine.drain();
    if drain.detached() >= engine.settings().max_running {
        engine.report(&label, Outcome::Overloaded);
        tracing::warn!(
            detached = drain.detached(),
            "too many idempotent requests running on their own; refusing a new one"
        );
        return overloaded(http);
    }
    // And so is what one subject has in flight, its own bound and its share of the instance's
    // places, so that no subject and no group of subjects fill them for the others. Anonymous
    // callers share their records' scope; their shares of the instance are told apart when the
    // application says how.
    let caller = match (&http.anonymous_shares, subject.is_empty()) {
        (Some(by), true) => by.subject(parts),
        _ => None,
    };
    let in_flight = match caller {
        Some(caller) => engine.anonymous_in_flight(&caller),
        None => engine.in_flight(&subject),
    };
    let in_flight = match in_flight {
        Ok(in_flight) => in_flight,
        Err(Refused::Full) => {
            engine.report(&label, Outcome::Overloaded);
            tracing::warn!("every place for idempotent requests is taken; refusing a new one");
            return overloaded(http);
        }
        Err(refused) => {
            engine.report(&label, Outcome::QuotaExceeded);
            tracing::info!(
                ?refused,
                "a subject has its share of idempotent requests in flight; refusing one"
            );
            return Admission::Refused(http.retryable(
                ErrorKind::QuotaExceeded,
                "too many idempotent requests of this subject are in flight; retry later",
            ));
        }
    };
    Admission::Guarded {
        scope: RecordKey {
            key,
            subject,
            endpoint,
        },
        label,
        in_flight,
    }
}

/// `key`, if it is long enough here; else why not.
pub(super) fn checked(http: &LayerSettings, key: String) -> Result<String, String> {
    if key.len() < http.min_key_length {
        return Err(format!(
            "the idempotency key must be at least {} characters long here",
            http.min_key_length
        ));
    }
    Ok(key)
}

/// `503 idempotency_overloaded`: the instance runs as many guarded requests as it takes.
fn overloaded(http: &LayerSettings) -> Admission {
    Admission::Refused(http.retryable(
        ErrorKind::Overloaded,
        "too many idempotent requests are running; retry later",
    ))
}

/// Whether the request carries one of the headers that count as credentials.
fn carries_credentials(http: &LayerSettings, parts: &Parts) -> bool {
    http.credential_headers
        .iter()
        .any(|name| parts.headers.contains_key(name))
}
