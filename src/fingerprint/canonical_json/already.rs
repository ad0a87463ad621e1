//! Whether a document is in canonical form already, so that the usual body (compact, members in
//! key order, strings without escapes, integer amounts) is fingerprinted as it came, without
//! writing a copy of it.
//!
//! The check is conservative: it says yes only when [`canonicalize`](super::canonicalize) would
//! give back the input unchanged. A document with an escape, a number other than a plain integer,
//! or anything else it does not look into is left to the canonicaliser, which may find it canonical
//! all the same. Every answer of either path is the same bytes (the property tests compare them).

use super::{MAX_DEPTH, STRING_STOPS, utf16_cmp};

/// Whether `input` is its own canonical form (see the module docs; `false` may still be).
pub(super) fn is_canonical(input: &[u8]) -> bool {
    let mut check = Check { input, pos: 0 };
    check.value(0) && check.pos == input.len()
}

struct Check<'a> {
    input: &'a [u8],
    pos: usize,
}

impl<'a> Check<'a> {
    fn next(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn value(&mut self, depth: usize) -> bool {
        match self.next() {
            Some(b'{') => self.object(depth + 1),
            Some(b'[') => self.array(depth + 1),
            Some(b'"') => self.string().is_some(),
            Some(b't') => self.literal(b"true"),
            Some(b'f') => self.literal(b"false"),
            Some(b'n') => self.literal(b"null"),
            Some(b'-' | b'0'..=b'9') => self.integer(),
            _ => false,
        }
    }

    fn literal(&mut self, word: &[u8]) -> bool {
        let found = self.input[self.pos..].starts_with(word);
        if found {
            self.pos += word.len();
        }
        found
    }

    fn array(&mut self, depth: usize) -> bool {
        if depth > MAX_DEPTH {
            return false;
        }
        self.pos += 1;
        if self.next() == Some(b']') {
            self.pos += 1;
            return true;
        }
        loop {
            if !self.value(depth) {
                return false;
            }
            match self.next() {
                Some(b',') => self.pos += 1,
                Some(b']') => {
                    self.pos += 1;
                    return true;
                }
                _ => return false,
            }
        }
    }

    fn object(&mut self, depth: usize) -> bool {
        if depth > MAX_DEPTH {
            return false;
        }
        self.pos += 1;
        if self.next() == Some(b'}') {
            self.pos += 1;
            return true;
        }
        let mut previous: Option<&'a [u8]> = None;
        loop {
            if self.next() != Some(b'"') {
                return false;
            }
            let Some(key) = self.string() else {
                return false;
            };
            // Strictly after the previous key: in order, and no key twice. Without escapes, a
            // key's bytes are its decoded bytes, which the canonicaliser compares.
            if previous.is_some_and(|previous| !utf16_cmp(previous, key).is_lt()) {
                return false;
            }
            previous = Some(key);
            if self.next() != Some(b':') {
                return false;
            }
            self.pos += 1;
            if !self.value(depth) {
                return false;
            }
            match self.next() {
                Some(b',') => self.pos += 1,
                Some(b'}') => {
                    self.pos += 1;
                    return true;
                }
                _ => return false,
            }
        }
    }

    /// A string without escapes or raw control characters, in valid UTF-8: its content.
    fn string(&mut self) -> Option<&'a [u8]> {
        let input: &'a [u8] = self.input;
        let start = self.pos + 1;
        let rest = input.get(start..)?;
        let len = rest.iter().position(|&b| STRING_STOPS[usize::from(b)])?;
        if rest[len] != b'"' {
            return None; // an escape, or a control character
        }
        let content = &rest[..len];
        if !content.is_ascii() && std::str::from_utf8(content).is_err() {
            return None;
        }
        self.pos = start + len + 1;
        Some(content)
    }

    /// A plain integer as the canonical form writes it: no sign on zero, no leading zero, at most
    /// 21 digits (longer ones are written in exponent form).
    fn integer(&mut self) -> bool {
        let negative = self.next() == Some(b'-');
        let start = self.pos + usize::from(negative);
        let rest = &self.input[start..];
        let len = rest.iter().take_while(|b| b.is_ascii_digit()).count();
        let plain = match &rest[..len] {
            [] => false,
            [b'0'] => !negative,
            [b'0', ..] => false,
            digits => digits.len() <= 21,
        };
        if !plain || matches!(rest.get(len), Some(b'.' | b'e' | b'E')) {
            return false;
        }
        self.pos = start + len;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::is_canonical;
    use proptest::prelude::*;

    /// Compact documents without escapes (where the check has to decide), with members in any order
    /// (a key may come twice), now and then a space, and integers of every kind the canonical form
    /// keeps or rewrites.
    fn document() -> impl Strategy<Value = String> {
        let space = || prop_oneof![9 => Just(""), 1 => Just(" ")];
        let leaf = prop_oneof![
            Just("null".to_owned()),
            Just("true".to_owned()),
            "-?(0|[1-9][0-9]{0,22})",
            "\"[ab\u{e9}\u{E000}\u{FFFF}\u{1F600}]{0,3}\"",
        ];
        leaf.prop_recursive(5, 48, 4, move |inner| {
            let member = ("[ab\u{E000}\u{FFFF}\u{1F600}]{0,2}", space(), inner.clone())
                .prop_map(|(key, space, value)| format!("\"{key}\":{space}{value}"));
            prop_oneof![
                prop::collection::vec(inner, 0..4)
                    .prop_map(|items| format!("[{}]", items.join(","))),
                prop::collection::vec(member, 0..4)
                    .prop_map(|members| format!("{{{}}}", members.join(","))),
            ]
        })
    }

    proptest! {
        #[test]
        fn the_check_says_yes_exactly_when_the_canonical_form_is_the_input(text in document()) {
            let written = super::super::written(text.as_bytes());
            prop_assert_eq!(
                is_canonical(text.as_bytes()),
                written.as_deref() == Some(text.as_bytes()),
                "{}", text
            );
            // Either path, with or without whitespace around: the same bytes.
            for padded in [text.clone(), format!(" {text}\n")] {
                let canonical = super::super::canonical(padded.as_bytes());
                prop_assert_eq!(canonical.as_deref(), written.as_deref());
            }
        }
    }

    #[test]
    fn the_usual_compact_body_is_canonical_already() {
        for doc in [
            r#"{"amount":4200,"currency":"EUR","items":[{"qty":1,"sku":"A-1"}],"note":"é ✓"}"#,
            r#"[]"#,
            r#"{}"#,
            r#""text""#,
            r#"-12"#,
            r#"0"#,
            r#"[true,false,null,{"":1,"a":2}]"#,
            r#"{"a":1,"b":2,"😀":3}"#,
        ] {
            assert!(is_canonical(doc.as_bytes()), "{doc}");
            assert_eq!(
                crate::fingerprint::canonicalize(doc.as_bytes()).as_deref(),
                Some(doc.as_bytes())
            );
        }
    }

    #[test]
    fn whitespace_around_a_canonical_document_is_all_it_drops() {
        let doc = br#"{"a":[1,2],"b":"x"}"#;
        for around in [&b"\n"[..], b" \r\n", b"\t"] {
            let mut padded = around.to_vec();
            padded.extend_from_slice(doc);
            padded.extend_from_slice(around);
            let canonical = super::super::canonical(&padded).expect("json");
            assert!(matches!(canonical, std::borrow::Cow::Borrowed(_)));
            assert_eq!(&canonical[..], &doc[..]);
            assert_eq!(super::super::written(&padded).as_deref(), Some(&doc[..]));
        }
        assert_eq!(super::super::canonical(b" \n "), None);
    }

    #[test]
    fn anything_the_canonicaliser_would_change_or_refuse_is_left_to_it() {
        for doc in [
            r#"{"b":1,"a":2}"#, // out of order
            r#"{"a":1,"a":1}"#, // a key twice
            r#"{"a": 1}"#,      // whitespace
            r#" {}"#,           // around the document
            r#"{} "#,
            r#"{"a":"\u0041"}"#, // an escape
            r#"{"a":"\n"}"#,     // an escape the canonical form keeps: left to it
            r#"{"a":1.0}"#,      // not a plain integer
            r#"{"a":1e2}"#,
            r#"-0"#,
            r#"01"#,
            r#"1234567890123456789012"#, // 22 digits: exponent form
            r#"{"a":1"#,                 // unfinished
            r#"[1,]"#,
            r#"tru"#,
            "",
            "\"\u{1}\"", // a raw control character
        ] {
            assert!(!is_canonical(doc.as_bytes()), "{doc}");
        }
        // Keys in UTF-8 order but not in UTF-16 order.
        assert!(!is_canonical("{\"\u{FFFF}\":1,\"\u{1F600}\":2}".as_bytes()));
        assert!(is_canonical("{\"\u{1F600}\":1,\"\u{FFFF}\":2}".as_bytes()));
        // Invalid UTF-8 in a string.
        assert!(!is_canonical(b"\"\xff\""));
        // As deep as the canonicaliser goes, and one level deeper.
        let nested = |depth: usize| format!("{}{}", "[".repeat(depth), "]".repeat(depth));
        assert!(is_canonical(nested(super::MAX_DEPTH).as_bytes()));
        assert!(!is_canonical(nested(super::MAX_DEPTH + 1).as_bytes()));
    }
}
