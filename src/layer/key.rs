//! The `Idempotency-Key` header: what a valid key is, and how a header value is read as one.

use http::HeaderMap;

use crate::header::IDEMPOTENCY_KEY;

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
}

/// Reads the key from the request headers: `Ok(None)` when there is none.
pub fn from_headers(headers: &HeaderMap) -> Result<Option<String>, KeyError> {
    let mut values = headers.get_all(&IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyError::Repeated);
    }
    parse(value.as_bytes()).map(Some)
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
