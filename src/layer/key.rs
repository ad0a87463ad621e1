//! The `Idempotency-Key` header: what a valid key is, and how a header value is read as one; and
//! where else a layer may be set to find the key (another header, the request's parts, a field of
//! the JSON body).

use std::sync::Arc;

use http::request::Parts;
use http::{HeaderMap, HeaderName};

use crate::fingerprint::json_pointer::Pointer;

use crate::header::IDEMPOTENCY_KEY;

/// The application's own key extractor: the key from the request's parts, `None` when it has none.
pub(crate) type KeyFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// Where the layer finds a request's key. Whichever it is, a key also sent in the draft's
/// `Idempotency-Key` header must be the same, and a request with the header alone is keyed by it:
/// a client that sends the draft's header is never run unguarded, nor under another key.
#[derive(Clone)]
pub(crate) enum KeySource {
    /// A header: `Idempotency-Key` by default.
    Header(HeaderName),
    /// The application's extractor.
    Parts(Arc<KeyFn>),
    /// A string field of the JSON body, by JSON pointer (RFC 6901), as AIP-155's `request_id`:
    /// the pointer as written, and parsed.
    Body(String, Pointer),
}

impl Default for KeySource {
    fn default() -> Self {
        KeySource::Header(IDEMPOTENCY_KEY)
    }
}

/// A key source as the builder was given it, checked when the layer is built.
pub(crate) enum KeySpec {
    Header(String),
    Parts(Arc<KeyFn>),
    Body(String),
}

impl KeySpec {
    /// The source, or why it is not one.
    pub(crate) fn checked(self) -> Result<KeySource, crate::ConfigError> {
        match self {
            KeySpec::Header(name) => HeaderName::try_from(name.as_str())
                .map(KeySource::Header)
                .map_err(|_| {
                    crate::ConfigError::new(
                        "key_header",
                        format!("{name:?} is not a valid header name"),
                    )
                }),
            KeySpec::Parts(f) => Ok(KeySource::Parts(f)),
            KeySpec::Body(text) => {
                let pointer = Pointer::parse(&text)
                    .map_err(|e| crate::ConfigError::new("key_from_body", e))?;
                Ok(KeySource::Body(text, pointer))
            }
        }
    }
}

/// What a source found before the body is read.
pub(crate) enum Found {
    /// The key.
    Key(String),
    /// No key.
    Absent,
    /// The key is in the body, to be read once it is.
    InBody,
}

/// Why a key was refused: the detail of the `400`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refused(pub(crate) String);

impl KeySource {
    /// Whether a request with these headers surely has no key (so the layer need not look
    /// further); `false` when it may have one.
    pub(crate) fn surely_absent(&self, headers: &HeaderMap) -> bool {
        match self {
            KeySource::Header(name) => {
                !headers.contains_key(name) && !headers.contains_key(&IDEMPOTENCY_KEY)
            }
            // A body declared as something JSON is not holds no field: without the draft's
            // header, no key. (One sent without a type, or as text, is read: clients send JSON so.)
            KeySource::Body(..) => {
                !headers.contains_key(&IDEMPOTENCY_KEY) && declared_not_json(headers)
            }
            KeySource::Parts(_) => false,
        }
    }

    /// The key, from the request's parts (or `InBody`).
    pub(crate) fn in_parts(&self, parts: &Parts) -> Result<Found, Refused> {
        let draft = from_headers(&parts.headers).map_err(|e| Refused(e.detail().to_owned()))?;
        let found =
            match self {
                KeySource::Header(name) if *name == IDEMPOTENCY_KEY => {
                    return Ok(found_or_absent(draft));
                }
                KeySource::Header(name) => from_header(&parts.headers, name)
                    .map_err(|e| Refused(format!("the {name} header: {}", e.detail_of_value())))?,
                KeySource::Parts(f) => match f(parts) {
                    Some(key) => Some(parse(key.as_bytes()).map_err(|e| {
                        Refused(format!("the request's key: {}", e.detail_of_value()))
                    })?),
                    None => None,
                },
                // The draft's header (valid, if sent) is checked against the field once it is read.
                KeySource::Body(..) => return Ok(Found::InBody),
            };
        agreed(found, draft, self).map(found_or_absent)
    }

    /// The key, from the body of a request whose source is a body field: the field's string, or
    /// the draft's header's when the body has none.
    pub(crate) fn in_body(&self, headers: &HeaderMap, body: &[u8]) -> Result<Found, Refused> {
        let KeySource::Body(text, pointer) = self else {
            return Ok(Found::Absent);
        };
        let draft = from_headers(headers).map_err(|e| Refused(e.detail().to_owned()))?;
        // An encoded body (gzip, ...) cannot be read here: a key field in it would go unseen, and
        // the request run unguarded by a handler that decodes it. Decoding belongs outside the
        // layer; keyed by the draft's header, the request may go on.
        let encoded = headers
            .get_all(http::header::CONTENT_ENCODING)
            .iter()
            .any(|v| !v.as_bytes().eq_ignore_ascii_case(b"identity"));
        if encoded {
            return match draft {
                Some(key) => Ok(Found::Key(key)),
                None => Err(Refused(format!(
                    "the body is sent encoded (Content-Encoding), so its {text} field cannot be \
                     read for the key; send it unencoded, or the key in the Idempotency-Key header"
                ))),
            };
        }
        // The field is looked for as the body is parsed, without building the document.
        let mut parser = serde_json::Deserializer::from_slice(body);
        let walked = serde::de::DeserializeSeed::deserialize(Walk(pointer.tokens()), &mut parser)
            // Nothing but whitespace may follow the document.
            .and_then(|field| parser.end().map(|()| field));
        let field = match walked {
            Ok(Some(Field::Text(key))) => Some(parse(key.as_bytes()).map_err(|e| {
                Refused(format!("the body's {text} field: {}", e.detail_of_value()))
            })?),
            Ok(Some(Field::Other)) => {
                return Err(Refused(format!(
                    "the body's {text} field must be a string, the request's key"
                )));
            }
            // No such field, `null`, or a body that is not JSON: no field to read.
            Ok(None) | Err(_) => None,
        };
        agreed(field, draft, self).map(found_or_absent)
    }

    /// Where the key is, as the layer's answers name it.
    pub(crate) fn describe(&self) -> String {
        match self {
            KeySource::Header(name) if *name == IDEMPOTENCY_KEY => {
                "the Idempotency-Key header".to_owned()
            }
            KeySource::Header(name) => format!("the {name} header"),
            KeySource::Parts(_) => "the request's key".to_owned(),
            KeySource::Body(text, _) => format!("the body's {text} field"),
        }
    }
}

fn found_or_absent(key: Option<String>) -> Found {
    key.map_or(Found::Absent, Found::Key)
}

/// Whether the request declares a body that is not JSON: a form, a multipart upload, raw bytes,
/// an image, audio, video, a font or a PDF. Without a type, or as text, it may be JSON.
fn declared_not_json(headers: &HeaderMap) -> bool {
    let Some(media) = headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .map(|v| v.trim().to_ascii_lowercase())
    else {
        return false;
    };
    ["multipart/", "image/", "audio/", "video/", "font/"]
        .iter()
        .any(|top| media.starts_with(top))
        || [
            "application/x-www-form-urlencoded",
            "application/octet-stream",
            "application/pdf",
            "application/zip",
            "application/gzip",
            "application/x-tar",
            "application/x-7z-compressed",
        ]
        .contains(&media.as_str())
}

/// What is at the pointer.
enum Field {
    /// A string: the key.
    Text(String),
    /// Anything else but `null`.
    Other,
}

/// Walks a JSON document down `tokens` as it is parsed, skipping everything else: the field at
/// the end, `None` when there is none (or it is `null`). The last of repeated members counts, as
/// the fingerprint's parser takes it.
struct Walk<'a>(&'a [String]);

impl<'de> serde::de::DeserializeSeed<'de> for Walk<'_> {
    type Value = Option<Field>;

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_any(self)
    }
}

impl<'de> serde::de::Visitor<'de> for Walk<'_> {
    type Value = Option<Field>;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a JSON value")
    }

    fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
        Ok(self.0.is_empty().then(|| Field::Text(v.to_owned())))
    }

    fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Self::Value, E> {
        Ok(self.0.is_empty().then_some(Field::Text(v)))
    }

    fn visit_unit<E: serde::de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_bool<E: serde::de::Error>(self, _: bool) -> Result<Self::Value, E> {
        Ok(self.0.is_empty().then_some(Field::Other))
    }

    fn visit_i64<E: serde::de::Error>(self, _: i64) -> Result<Self::Value, E> {
        Ok(self.0.is_empty().then_some(Field::Other))
    }

    fn visit_u64<E: serde::de::Error>(self, _: u64) -> Result<Self::Value, E> {
        Ok(self.0.is_empty().then_some(Field::Other))
    }

    fn visit_f64<E: serde::de::Error>(self, _: f64) -> Result<Self::Value, E> {
        Ok(self.0.is_empty().then_some(Field::Other))
    }

    fn visit_map<A: serde::de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut found = None;
        while let Some(name) = map.next_key::<String>()? {
            match self.0.split_first() {
                Some((first, rest)) if *first == name => found = map.next_value_seed(Walk(rest))?,
                _ => {
                    map.next_value::<serde::de::IgnoredAny>()?;
                }
            }
        }
        Ok(match self.0.is_empty() {
            true => Some(Field::Other),
            false => found,
        })
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        // An element is named by its index, written in decimal without leading zeros.
        let index = self.0.first().and_then(|first| {
            let digits = !first.is_empty() && first.bytes().all(|b| b.is_ascii_digit());
            let canonical = digits && (first == "0" || !first.starts_with('0'));
            canonical.then(|| first.parse::<usize>().ok()).flatten()
        });
        let mut found = None;
        let mut at = 0;
        loop {
            let next = match index {
                Some(i) if i == at => seq.next_element_seed(Walk(&self.0[1..]))?,
                _ => seq.next_element::<serde::de::IgnoredAny>()?.map(|_| None),
            };
            match next {
                Some(field) => {
                    if index == Some(at) {
                        found = field;
                    }
                    at += 1;
                }
                None => break,
            }
        }
        Ok(match self.0.is_empty() {
            true => Some(Field::Other),
            false => found,
        })
    }
}

/// The key from the source, or from the draft's header; both, only when they are the same.
fn agreed(
    key: Option<String>,
    draft: Option<String>,
    source: &KeySource,
) -> Result<Option<String>, Refused> {
    match (key, draft) {
        (Some(key), Some(draft)) if key != draft => Err(Refused(format!(
            "{} and the Idempotency-Key header name different keys; send one key",
            source.describe()
        ))),
        (Some(key), _) => Ok(Some(key)),
        (None, draft) => Ok(draft),
    }
}

/// One header's key: `Ok(None)` when it is absent.
fn from_header(headers: &HeaderMap, name: &HeaderName) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(name).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    parse(value.as_bytes()).map(Some)
}

/// The longest key accepted, in characters (all keys are ASCII).
pub(crate) const MAX_KEY_LEN: usize = 255;

/// Why an `Idempotency-Key` header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyError {
    /// The header was sent more than once.
    Repeated,
    /// Nothing is left after trimming (and unquoting).
    Empty,
    /// Longer than 255 characters.
    TooLong,
    /// A byte outside visible ASCII and the space: a control character or non-ASCII.
    InvalidCharacter,
    /// Starts with `"` but is not a valid quoted sf-string.
    BadQuoting,
}

impl KeyError {
    /// A sentence for the problem details `detail` field.
    pub fn detail(self) -> &'static str {
        match self {
            KeyError::Repeated => "the Idempotency-Key header must be sent once",
            KeyError::Empty => "the Idempotency-Key header is empty",
            KeyError::TooLong => "the Idempotency-Key header is longer than 255 characters",
            KeyError::InvalidCharacter => {
                "the Idempotency-Key header may hold only visible ASCII characters and spaces"
            }
            KeyError::BadQuoting => "the Idempotency-Key header is not a valid quoted string",
        }
    }

    /// The same, of a key found elsewhere than the `Idempotency-Key` header.
    fn detail_of_value(self) -> &'static str {
        match self {
            KeyError::Repeated => "must be sent once",
            KeyError::Empty => "is empty",
            KeyError::TooLong => "is longer than 255 characters",
            KeyError::InvalidCharacter => "may hold only visible ASCII characters and spaces",
            KeyError::BadQuoting => "is not a valid quoted string",
        }
    }
}

/// Reads the key from the request headers: `Ok(None)` when there is none.
pub fn from_headers(headers: &HeaderMap) -> Result<Option<String>, KeyError> {
    from_header(headers, &IDEMPOTENCY_KEY)
}

/// Parses one header value into a key.
///
/// Rules: leading and trailing spaces and tabs are trimmed; a value in double quotes is a structured
/// field string (RFC 8941): its `\"` and `\\` escapes are undone and its content trimmed the same way,
/// so `abc`, ` abc ` and `"abc"` are one key. What remains must be 1 to 255 characters from
/// 0x20 to 0x7E.
pub fn parse(value: &[u8]) -> Result<String, KeyError> {
    let trimmed = trim(value);
    let unquoted;
    let key = if trimmed.first() == Some(&b'"') {
        unquoted = unquote(trimmed)?;
        trim(&unquoted)
    } else {
        trimmed
    };
    if key.is_empty() {
        return Err(KeyError::Empty);
    }
    if !key.iter().all(|b| (0x20..=0x7E).contains(b)) {
        return Err(KeyError::InvalidCharacter);
    }
    if key.len() > MAX_KEY_LEN {
        return Err(KeyError::TooLong);
    }
    // Only ASCII is left.
    String::from_utf8(key.to_vec()).map_err(|_| KeyError::InvalidCharacter)
}

fn trim(bytes: &[u8]) -> &[u8] {
    let is_ws = |b: &u8| *b == b' ' || *b == b'\t';
    let start = bytes.iter().position(|b| !is_ws(b)).unwrap_or(bytes.len());
    let end = bytes
        .iter()
        .rposition(|b| !is_ws(b))
        .map_or(start, |i| i + 1);
    &bytes[start..end]
}

fn unquote(quoted: &[u8]) -> Result<Vec<u8>, KeyError> {
    if quoted.len() < 2 || quoted.last() != Some(&b'"') {
        return Err(KeyError::BadQuoting);
    }
    let inner = &quoted[1..quoted.len() - 1];
    let mut out = Vec::with_capacity(inner.len());
    let mut bytes = inner.iter();
    while let Some(&b) = bytes.next() {
        match b {
            b'\\' => match bytes.next() {
                Some(&e @ (b'"' | b'\\')) => out.push(e),
                _ => return Err(KeyError::BadQuoting),
            },
            b'"' => return Err(KeyError::BadQuoting),
            _ => out.push(b),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    #[test]
    fn accepts_visible_ascii_with_inner_spaces() {
        assert_eq!(parse(b"abc-123").as_deref(), Ok("abc-123"));
        assert_eq!(parse(b"  a b  ").as_deref(), Ok("a b"));
        assert_eq!(parse(b"\tkey\t").as_deref(), Ok("key"));
        assert_eq!(parse(b"!~").as_deref(), Ok("!~"));
        let longest = "k".repeat(MAX_KEY_LEN);
        assert_eq!(parse(longest.as_bytes()), Ok(longest));
    }

    #[test]
    fn unquotes_sf_strings() {
        assert_eq!(parse(b"\"abc\"").as_deref(), Ok("abc"));
        assert_eq!(parse(b" \" abc \" ").as_deref(), Ok("abc"));
        assert_eq!(parse(br#""a\"b\\c""#).as_deref(), Ok(r#"a"b\c"#));
        // A quote that is not at the start is an ordinary character.
        assert_eq!(parse(b"a\"b").as_deref(), Ok("a\"b"));
    }

    #[test]
    fn refuses_bad_keys() {
        assert_eq!(parse(b""), Err(KeyError::Empty));
        assert_eq!(parse(b"   "), Err(KeyError::Empty));
        assert_eq!(parse(b"\"\""), Err(KeyError::Empty));
        assert_eq!(
            parse("k".repeat(MAX_KEY_LEN + 1).as_bytes()),
            Err(KeyError::TooLong)
        );
        assert_eq!(parse("clé".as_bytes()), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"a\x01b"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"a\tb"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"a\x7fb"), Err(KeyError::InvalidCharacter));
        assert_eq!(parse(b"\"abc"), Err(KeyError::BadQuoting));
        assert_eq!(parse(b"\""), Err(KeyError::BadQuoting));
        assert_eq!(parse(br#""a\b""#), Err(KeyError::BadQuoting));
        assert_eq!(parse(br#""a"b""#), Err(KeyError::BadQuoting));
    }

    fn body_key(pointer: &str, body: &str) -> Result<Option<String>, Refused> {
        let source = KeySpec::Body(pointer.to_owned())
            .checked()
            .expect("pointer");
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        source
            .in_body(&headers, body.as_bytes())
            .map(|found| match found {
                Found::Key(key) => Some(key),
                Found::Absent | Found::InBody => None,
            })
    }

    #[test]
    fn a_body_field_is_found_as_the_document_is_parsed() {
        let key = |pointer: &str, body: &str| body_key(pointer, body).expect("not refused");
        assert_eq!(
            key("/request_id", r#"{"request_id":"r1"}"#).as_deref(),
            Some("r1")
        );
        // Nested, among other members and arrays, escaped, after whitespace.
        let body = r#" {"a":[1,{"x":2}],"meta":{"z":null,"request_id":"r\u0032"},"b":"c"} "#;
        assert_eq!(key("/meta/request_id", body).as_deref(), Some("r2"));
        assert_eq!(
            key("/list/1", r#"{"list":["a","b","c"]}"#).as_deref(),
            Some("b")
        );
        assert_eq!(
            key("/a~1b/c~0d", r#"{"a/b":{"c~d":"k"}}"#).as_deref(),
            Some("k")
        );
        // The last of repeated members.
        assert_eq!(
            key("/id", r#"{"id":"one","id":"two"}"#).as_deref(),
            Some("two")
        );
        // None: absent, null, an index that is none, a body that is not JSON, or followed by more.
        assert_eq!(key("/request_id", r#"{"other":"r1"}"#), None);
        assert_eq!(key("/request_id", r#"{"request_id":null}"#), None);
        assert_eq!(key("/list/01", r#"{"list":["a","b"]}"#), None);
        assert_eq!(key("/list/+1", r#"{"list":["a","b"]}"#), None);
        assert_eq!(key("/list/9", r#"{"list":["a","b"]}"#), None);
        assert_eq!(key("/request_id", "request_id=r1"), None);
        assert_eq!(key("/request_id", r#"{"request_id":"r1"} trailing"#), None);
        assert_eq!(key("/request_id", &"[".repeat(10_000)), None);
        // A field that is not a string, or not a valid key, is refused.
        for body in [
            r#"{"request_id":7}"#,
            r#"{"request_id":{"x":"y"}}"#,
            r#"{"request_id":["r1"]}"#,
            r#"{"request_id":true}"#,
            r#"{"request_id":""}"#,
            r#"{"request_id":"caf\u00e9"}"#,
        ] {
            assert!(body_key("/request_id", body).is_err(), "{body}");
        }
    }

    #[test]
    fn an_encoded_body_is_keyed_by_the_draft_header_or_refused() {
        let source = KeySpec::Body("/request_id".into())
            .checked()
            .expect("pointer");
        let mut headers = HeaderMap::new();
        headers.insert(
            http::header::CONTENT_ENCODING,
            HeaderValue::from_static("gzip"),
        );
        // Whatever the bytes say: they are not read.
        let body = br#"{"request_id":"r1"}"#;
        assert!(source.in_body(&headers, body).is_err());
        headers.insert(IDEMPOTENCY_KEY, HeaderValue::from_static("h1"));
        assert!(matches!(source.in_body(&headers, body), Ok(Found::Key(k)) if k == "h1"));
        // `identity` is no encoding.
        let mut identity = HeaderMap::new();
        identity.insert(
            http::header::CONTENT_ENCODING,
            HeaderValue::from_static("identity"),
        );
        assert!(matches!(source.in_body(&identity, body), Ok(Found::Key(k)) if k == "r1"));
    }

    #[test]
    fn only_a_body_declared_as_not_json_is_left_unread() {
        let source = KeySpec::Body("/request_id".into())
            .checked()
            .expect("pointer");
        let with = |value: Option<&'static str>| {
            let mut headers = HeaderMap::new();
            if let Some(value) = value {
                headers.insert(http::header::CONTENT_TYPE, HeaderValue::from_static(value));
            }
            headers
        };
        for unread in [
            "multipart/form-data; boundary=x",
            "application/x-www-form-urlencoded",
            "application/octet-stream",
            "image/png",
            "Application/PDF",
        ] {
            assert!(source.surely_absent(&with(Some(unread))), "{unread}");
        }
        for read in [
            None,
            Some("application/json"),
            Some("text/plain"),
            Some("application/problem+json"),
        ] {
            assert!(!source.surely_absent(&with(read)), "{read:?}");
        }
        // The draft's header makes the request keyed whatever its body.
        let mut keyed = with(Some("image/png"));
        keyed.insert(IDEMPOTENCY_KEY, HeaderValue::from_static("k"));
        assert!(!source.surely_absent(&keyed));
    }

    #[test]
    fn header_sent_twice_is_refused() {
        let mut headers = HeaderMap::new();
        assert_eq!(from_headers(&headers), Ok(None));
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(from_headers(&headers), Ok(Some("a".into())));
        headers.append(IDEMPOTENCY_KEY, HeaderValue::from_static("a"));
        assert_eq!(from_headers(&headers), Err(KeyError::Repeated));
    }
}
