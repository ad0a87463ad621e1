//! Which responses are recorded for replay, and which release the key for another try.

use http::StatusCode;

/// What happens to a claimed record once the handler has answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Record the response as `completed` and replay it to every retry.
    Complete,
    /// Record the response as `failed` (a definitive error) and replay it to every retry.
    Fail,
    /// Delete the record, so that a retry runs the handler again.
    Release,
}

/// The default response policy.
///
/// - 2xx and 3xx: [`Disposition::Complete`] (a redirect such as `303 See Other` is a final answer);
/// - 4xx: [`Disposition::Fail`], except `408`, `409`, `425` and `429`, which say "try again" and so
///   [`Disposition::Release`];
/// - 5xx, and the informational 1xx that a handler should never return: [`Disposition::Release`].
pub fn default_policy(status: StatusCode) -> Disposition {
    match status.as_u16() {
        200..=399 => Disposition::Complete,
        408 | 409 | 425 | 429 => Disposition::Release,
        400..=499 => Disposition::Fail,
        _ => Disposition::Release,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn of(code: u16) -> Disposition {
        default_policy(StatusCode::from_u16(code).expect("valid status"))
    }

    #[test]
    fn default_policy_follows_the_spec() {
        for code in [200, 201, 202, 204, 299, 303] {
            assert_eq!(of(code), Disposition::Complete, "{code}");
        }
        for code in [400, 401, 402, 403, 404, 410, 422, 499] {
            assert_eq!(of(code), Disposition::Fail, "{code}");
        }
        for code in [408, 409, 425, 429, 500, 502, 503, 504, 599, 102] {
            assert_eq!(of(code), Disposition::Release, "{code}");
        }
    }
}
