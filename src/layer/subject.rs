//! The authenticated subject a record belongs to, read from request extensions.

use http::request::Parts;

/// The authenticated identity of a request, as the application's auth layer inserts it into the
/// request extensions. The default extractor reads this type.
///
/// ```
/// use axum_idempotency::Subject;
/// let mut request = http::Request::new(());
/// request.extensions_mut().insert(Subject("user-42".to_owned()));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Subject(pub String);

/// Reads the subject of a request. Never read it from the body or from an unauthenticated header:
/// the subject is what keeps one user's replay from being served to another.
///
/// Any `Fn(&Parts) -> Option<String>` closure is an extractor. `None`, or an empty string, means the
/// request has no subject.
pub trait SubjectExtractor: Send + Sync + 'static {
    /// The subject of the request, if it is authenticated.
    fn subject(&self, parts: &Parts) -> Option<String>;
}

impl<F> SubjectExtractor for F
where
    F: Fn(&Parts) -> Option<String> + Send + Sync + 'static,
{
    fn subject(&self, parts: &Parts) -> Option<String> {
        self(parts)
    }
}

/// The default extractor: the [`Subject`] extension.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SubjectExtension;

impl SubjectExtractor for SubjectExtension {
    fn subject(&self, parts: &Parts) -> Option<String> {
        parts.extensions.get::<Subject>().map(|s| s.0.clone())
    }
}
