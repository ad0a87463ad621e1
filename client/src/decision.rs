//! Whether an answer or a failure is retried, and how long the server asks the client to wait.

use std::time::{Duration, SystemTime};

use http::{HeaderMap, StatusCode, header};

use crate::policy::RetryPolicy;

/// The `error` code of `422 idempotency_key_reuse`: the key belongs to another request. Final.
pub(crate) const KEY_REUSE: &str = "idempotency_key_reuse";
/// The `error` code of `410 idempotency_key_expired`: the key's record expired within the server's
/// tombstone time; the operation was done and is not run again. Final.
pub(crate) const KEY_EXPIRED: &str = "idempotency_key_expired";
/// The `error` code of `409 in_progress`: the first request with the key is still running.
pub(crate) const IN_PROGRESS: &str = "in_progress";

/// The members of an `application/problem+json` answer that decide a retry.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Problem {
    /// `error`: the stable code (`in_progress`, `idempotency_key_reuse`, ...).
    pub(crate) code: Option<String>,
    /// `retryable`: whether the same request with the same key may succeed later.
    pub(crate) retryable: Option<bool>,
    /// `retryAfterSeconds` (sent with `409 in_progress`).
    pub(crate) retry_after_seconds: Option<u64>,
}

impl Problem {
    /// The members of a problem body, or `None` when it is not a JSON object. Members of another
    /// type than the protocol's are ignored.
    pub(crate) fn parse(body: &[u8]) -> Option<Problem> {
        let value: serde_json::Value = serde_json::from_slice(body).ok()?;
        let object = value.as_object()?;
        Some(Problem {
            code: object
                .get("error")
                .and_then(serde_json::Value::as_str)
                .map(str::to_owned),
            retryable: object.get("retryable").and_then(serde_json::Value::as_bool),
            retry_after_seconds: object
                .get("retryAfterSeconds")
                .and_then(serde_json::Value::as_u64),
        })
    }
}

/// Whether `headers` say the body is `application/problem+json` (parameters and case aside).
pub(crate) fn is_problem(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|essence| {
            essence
                .trim()
                .eq_ignore_ascii_case("application/problem+json")
        })
}

/// Whether an answer is retried with the same key.
///
/// - A replay (`replayed`: the server's replay header says so): never, whatever it says of itself.
///   It is the recorded answer of the key's run, and the same key gets it again however often it
///   is sent (a recorded problem that said `retryable: true` when it was first answered is final
///   for this key now).
/// - `2xx` and `3xx`: never.
/// - A problem body: `idempotency_key_reuse` and `idempotency_key_expired` never (the key belongs
///   to another request, or to an operation done and forgotten; a new key would be a new
///   operation), `in_progress` always (the first request is still running: poll
///   it), otherwise its `retryable` member when it has one.
/// - Otherwise the policy's statuses (default `408`, `429`, `503`): a handler's `500`, `502` or
///   `504` without a problem body is final, since its effect may have happened.
pub(crate) fn retry_answer(
    status: StatusCode,
    problem: Option<&Problem>,
    replayed: bool,
    policy: &RetryPolicy,
) -> bool {
    if replayed || !(status.is_client_error() || status.is_server_error()) {
        return false;
    }
    if let Some(problem) = problem {
        match problem.code.as_deref() {
            Some(KEY_REUSE | KEY_EXPIRED) => return false,
            Some(IN_PROGRESS) => return true,
            _ => {}
        }
        if let Some(retryable) = problem.retryable {
            return retryable;
        }
    }
    policy.retryable_statuses.contains(&status)
}

/// Whether a failed attempt (no answer) is retried with the same key: a connection that could not
/// be made or broke, or a timeout. The server may have run the request; the key makes the retry
/// safe. Errors of building the request, of redirects and of other middleware are final.
pub(crate) fn retry_error(error: &reqwest_middleware::Error) -> bool {
    match error {
        reqwest_middleware::Error::Reqwest(e) => {
            !(e.is_builder() || e.is_redirect() || e.is_status() || e.is_decode())
                && (e.is_connect() || e.is_timeout() || e.is_request() || e.is_body())
        }
        reqwest_middleware::Error::Middleware(_) => false,
    }
}

/// The wait the server asks for: its `Retry-After` header (seconds, or an HTTP date), else the
/// problem's `retryAfterSeconds`.
pub(crate) fn server_wait(
    headers: &HeaderMap,
    problem: Option<&Problem>,
    now: SystemTime,
) -> Option<Duration> {
    headers
        .get(header::RETRY_AFTER)
        .and_then(|value| parse_retry_after(value.as_bytes(), now))
        .or_else(|| {
            problem
                .and_then(|p| p.retry_after_seconds)
                .map(Duration::from_secs)
        })
}

/// A `Retry-After` value (RFC 9110 §10.2.3): delay-seconds, or an HTTP date (the wait until then;
/// none for a date past). `None` for anything else.
pub(crate) fn parse_retry_after(value: &[u8], now: SystemTime) -> Option<Duration> {
    let text = std::str::from_utf8(value).ok()?.trim();
    if text.is_empty() {
        return None;
    }
    if text.bytes().all(|b| b.is_ascii_digit()) {
        // Too many digits for a u64 is still "a very long time".
        return Some(Duration::from_secs(text.parse().unwrap_or(u64::MAX)));
    }
    let at = httpdate::parse_http_date(text).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn problem(json: &str) -> Problem {
        Problem::parse(json.as_bytes()).expect("a problem object")
    }

    fn retried(status: u16, body: Option<&str>) -> bool {
        let status = StatusCode::from_u16(status).unwrap();
        let problem = body.map(problem);
        retry_answer(status, problem.as_ref(), false, &RetryPolicy::new())
    }

    #[test]
    fn the_layers_problems_are_retried_as_the_contract_says() {
        // Retryable by contract.
        for (status, code) in [
            (409, "in_progress"),
            (408, "request_timeout"),
            (503, "idempotency_store_unavailable"),
            (503, "idempotency_overloaded"),
        ] {
            let body = format!(r#"{{"status":{status},"error":"{code}","retryable":true}}"#);
            assert!(retried(status, Some(&body)), "{status} {code}");
        }
        // Final by contract.
        for (status, code) in [
            (400, "missing_idempotency_key"),
            (400, "invalid_idempotency_key"),
            (400, "unreadable_request_body"),
            (401, "missing_subject"),
            (413, "request_too_large"),
            (422, "idempotency_key_reuse"),
            (410, "idempotency_key_expired"),
            (504, "idempotency_handler_timeout"),
            (500, "internal_error"),
        ] {
            let body = format!(r#"{{"status":{status},"error":"{code}","retryable":false}}"#);
            assert!(!retried(status, Some(&body)), "{status} {code}");
        }
        // A handler timeout on the transactional path was rolled back: retryable when it says so.
        assert!(retried(
            504,
            Some(r#"{"error":"idempotency_handler_timeout","retryable":true}"#)
        ));
    }

    #[test]
    fn the_code_decides_over_a_wrong_retryable_member() {
        // A key reuse is never retried, whatever the body claims: only a new operation may have a
        // new key, and the same key would be refused again.
        assert!(!retried(
            422,
            Some(r#"{"error":"idempotency_key_reuse","retryable":true}"#)
        ));
        // Nor is an expired key: its operation was done.
        assert!(!retried(
            410,
            Some(r#"{"error":"idempotency_key_expired","retryable":true}"#)
        ));
        // In progress is always polled, even without (or with a wrong) `retryable`.
        assert!(retried(409, Some(r#"{"error":"in_progress"}"#)));
        assert!(retried(
            409,
            Some(r#"{"error":"in_progress","retryable":false}"#)
        ));
    }

    #[test]
    fn retryable_decides_over_the_status_list() {
        assert!(retried(500, Some(r#"{"retryable":true}"#)));
        assert!(retried(
            502,
            Some(r#"{"error":"upstream","retryable":true}"#)
        ));
        assert!(!retried(503, Some(r#"{"retryable":false}"#)));
        // Without the member, the status list decides.
        assert!(retried(503, Some(r#"{"error":"something"}"#)));
        assert!(!retried(500, Some(r#"{"error":"something"}"#)));
    }

    #[test]
    fn plain_answers_are_retried_by_status() {
        for status in [408, 429, 503] {
            assert!(retried(status, None), "{status}");
        }
        // A handler's own 5xx may have had its effect: final unless configured.
        for status in [400, 401, 402, 403, 404, 409, 410, 422, 500, 502, 504] {
            assert!(!retried(status, None), "{status}");
        }
        // Success and redirects are never retried, whatever a body says.
        for status in [200, 201, 202, 204, 301, 304] {
            assert!(!retried(status, None), "{status}");
            assert!(!retried(status, Some(r#"{"retryable":true}"#)), "{status}");
        }
        // The list is configurable.
        let policy = RetryPolicy::new().retry_status(StatusCode::BAD_GATEWAY);
        assert!(retry_answer(StatusCode::BAD_GATEWAY, None, false, &policy));
        let none = RetryPolicy::new().retryable_statuses([]);
        assert!(!retry_answer(
            StatusCode::SERVICE_UNAVAILABLE,
            None,
            false,
            &none
        ));
        // Even then, the protocol's retryable problems are retried.
        let in_progress = problem(r#"{"error":"in_progress","retryable":true}"#);
        assert!(retry_answer(
            StatusCode::CONFLICT,
            Some(&in_progress),
            false,
            &none
        ));
    }

    /// A replay is the key's recorded answer: sending the key again gets it again, so it is never
    /// retried, even a recorded problem that said it was retryable when first answered.
    #[test]
    fn a_replay_is_final_whatever_its_body_says() {
        let retryable = problem(r#"{"error":"upstream_unavailable","retryable":true}"#);
        let policy = RetryPolicy::new();
        assert!(retry_answer(
            StatusCode::SERVICE_UNAVAILABLE,
            Some(&retryable),
            false,
            &policy
        ));
        assert!(!retry_answer(
            StatusCode::SERVICE_UNAVAILABLE,
            Some(&retryable),
            true,
            &policy
        ));
        assert!(!retry_answer(
            StatusCode::SERVICE_UNAVAILABLE,
            None,
            true,
            &policy
        ));
    }

    #[test]
    fn problem_members_of_the_wrong_type_are_ignored() {
        assert_eq!(
            problem(r#"{"error":7,"retryable":"yes","retryAfterSeconds":-1}"#),
            Problem::default()
        );
        assert_eq!(Problem::parse(b"[1,2]"), None);
        assert_eq!(Problem::parse(b"not json"), None);
        assert_eq!(
            problem(r#"{"error":"in_progress","retryable":true,"retryAfterSeconds":2}"#),
            Problem {
                code: Some("in_progress".into()),
                retryable: Some(true),
                retry_after_seconds: Some(2),
            }
        );
    }

    #[test]
    fn problem_content_type() {
        let with = |ct: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::CONTENT_TYPE, ct.parse().unwrap());
            is_problem(&h)
        };
        assert!(with("application/problem+json"));
        assert!(with("Application/Problem+JSON; charset=utf-8"));
        assert!(!with("application/json"));
        assert!(!with("text/plain"));
        assert!(!is_problem(&HeaderMap::new()));
    }

    #[test]
    fn retry_after_in_seconds() {
        let now = SystemTime::now();
        let secs = |v: &str| parse_retry_after(v.as_bytes(), now);
        assert_eq!(secs("0"), Some(Duration::ZERO));
        assert_eq!(secs("2"), Some(Duration::from_secs(2)));
        assert_eq!(secs(" 120 "), Some(Duration::from_secs(120)));
        assert_eq!(
            secs("99999999999999999999999"),
            Some(Duration::from_secs(u64::MAX))
        );
        for bad in ["", " ", "-1", "1.5", "2s", "soon", "0x10"] {
            assert_eq!(secs(bad), None, "{bad:?}");
        }
        assert_eq!(parse_retry_after(b"\xff\xfe", now), None);
    }

    #[test]
    fn retry_after_as_an_http_date() {
        let now = httpdate::parse_http_date("Sun, 06 Nov 1994 08:49:37 GMT").unwrap();
        let at = |v: &str| parse_retry_after(v.as_bytes(), now);
        assert_eq!(
            at("Sun, 06 Nov 1994 08:49:47 GMT"),
            Some(Duration::from_secs(10))
        );
        // The obsolete forms HTTP still accepts.
        assert_eq!(
            at("Sunday, 06-Nov-94 08:50:37 GMT"),
            Some(Duration::from_secs(60))
        );
        assert_eq!(at("Sun Nov  6 08:49:38 1994"), Some(Duration::from_secs(1)));
        // A date past: retry now.
        assert_eq!(at("Sun, 06 Nov 1994 08:49:00 GMT"), Some(Duration::ZERO));
        assert_eq!(at("Sun, 06 Nov 1994 25:49:00 GMT"), None);
    }

    #[test]
    fn the_header_wins_over_the_problem_member() {
        let now = SystemTime::now();
        let p = problem(r#"{"error":"in_progress","retryAfterSeconds":5}"#);
        let mut headers = HeaderMap::new();
        assert_eq!(
            server_wait(&headers, Some(&p), now),
            Some(Duration::from_secs(5))
        );
        headers.insert(header::RETRY_AFTER, "2".parse().unwrap());
        assert_eq!(
            server_wait(&headers, Some(&p), now),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            server_wait(&headers, None, now),
            Some(Duration::from_secs(2))
        );
        assert_eq!(server_wait(&HeaderMap::new(), None, now), None);
    }

    #[tokio::test]
    async fn failures_on_the_way_are_retried_and_the_others_are_not() {
        let client = reqwest::Client::new();
        // Nothing listens on the port: connection refused.
        let port = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            listener.local_addr().unwrap().port()
        };
        let refused = client
            .post(format!("http://127.0.0.1:{port}/"))
            .send()
            .await
            .unwrap_err();
        assert!(retry_error(&refused.into()), "connection refused");

        // A server that accepts and never answers: reqwest's own timeout.
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = silent.local_addr().unwrap();
        let held = tokio::spawn(async move {
            let mut held = Vec::new();
            while let Ok((socket, _)) = silent.accept().await {
                held.push(socket);
            }
        });
        let timed_out = client
            .post(format!("http://{addr}/"))
            .timeout(Duration::from_millis(100))
            .send()
            .await
            .unwrap_err();
        assert!(timed_out.is_timeout());
        assert!(retry_error(&timed_out.into()), "timeout");
        held.abort();

        // A server that reads the request and closes: the answer was lost on the way.
        let closing = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = closing.local_addr().unwrap();
        tokio::spawn(async move {
            use tokio::io::AsyncReadExt;
            while let Ok((mut socket, _)) = closing.accept().await {
                let mut buf = [0u8; 1024];
                let _ = socket.read(&mut buf).await;
                drop(socket);
            }
        });
        let cut = client
            .post(format!("http://{addr}/"))
            .body("x")
            .send()
            .await
            .unwrap_err();
        assert!(
            retry_error(&cut.into()),
            "connection closed before the answer"
        );

        // The request could not be built: final.
        let bad = client.post("not a url").send().await.unwrap_err();
        assert!(bad.is_builder());
        assert!(!retry_error(&bad.into()), "builder error");

        // Another middleware's error: final, it is not ours to judge.
        let other = reqwest_middleware::Error::middleware(std::io::Error::other("policy"));
        assert!(!retry_error(&other));
    }
}
