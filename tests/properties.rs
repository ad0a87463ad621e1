//! Property tests: the fingerprint's invariants, the key grammar, and defined answers on hostile
//! input (random bytes, mutated JSON) without panics.

use std::collections::BTreeMap;

use axum_idempotency::{Fingerprint, canonicalize, key};
use proptest::prelude::*;

/// A JSON value with unique object keys (kept in a BTreeMap) and exact numbers.
#[derive(Debug, Clone)]
enum Json {
    Null,
    Bool(bool),
    Int(i64),
    /// A decimal `units * 10^-scale`.
    Dec(i64, u8),
    Str(String),
    Arr(Vec<Json>),
    Obj(BTreeMap<String, Json>),
}

fn json() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        any::<i64>().prop_map(Json::Int),
        (any::<i32>(), 1u8..6).prop_map(|(u, s)| Json::Dec(i64::from(u), s)),
        "[a-z\"\\\\\u{e9}\u{1F600}\n\t ]{0,8}".prop_map(Json::Str),
    ];
    leaf.prop_recursive(4, 48, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Json::Arr),
            prop::collection::btree_map("[a-zA-Z_\u{e9}\u{1F600}]{0,6}", inner, 0..5)
                .prop_map(Json::Obj),
        ]
    })
}

/// Writes a JSON string; `escape_all` writes every non-ASCII character as `\u` escapes.
fn write_str(s: &str, escape_all: bool, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str(if escape_all { "\\u000a" } else { "\\n" }),
            '\t' => out.push_str("\\t"),
            c if escape_all && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for u in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{u:04X}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Writes `value`: plainly, or (`twisted`) with object members in reverse order, whitespace between
/// every token, every non-ASCII character escaped, and numbers in other notations.
fn write(value: &Json, twisted: bool, out: &mut String) {
    let ws = if twisted { " \n\t " } else { "" };
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Int(n) if twisted => out.push_str(&format!("{n}0e-1")),
        Json::Int(n) => out.push_str(&n.to_string()),
        Json::Dec(units, scale) => {
            let digits = units.unsigned_abs().to_string();
            let sign = if *units < 0 { "-" } else { "" };
            if twisted {
                // units * 10^-scale written as 0.<digits>e<len - scale>
                let exp = digits.len() as i64 - i64::from(*scale);
                out.push_str(&format!("{sign}0.{digits}E{exp:+}"));
            } else {
                out.push_str(&format!("{sign}{digits}e-{scale}"));
            }
        }
        Json::Str(s) => write_str(s, twisted, out),
        Json::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(ws);
                    out.push(',');
                }
                out.push_str(ws);
                write(item, twisted, out);
            }
            out.push_str(ws);
            out.push(']');
        }
        Json::Obj(members) => {
            out.push('{');
            let mut entries: Vec<_> = members.iter().collect();
            if twisted {
                entries.reverse();
            }
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(ws);
                write_str(k, twisted, out);
                out.push_str(ws);
                out.push(':');
                out.push_str(ws);
                write(v, twisted, out);
            }
            out.push_str(ws);
            out.push('}');
        }
    }
}

fn text(value: &Json, twisted: bool) -> String {
    let mut out = String::new();
    write(value, twisted, &mut out);
    out
}

/// Changes the `n`-th leaf (in document order, modulo the number of leaves) to another value.
fn mutate(value: &mut Json, n: &mut usize) -> bool {
    match value {
        Json::Arr(items) => items.iter_mut().any(|i| mutate(i, n)),
        Json::Obj(members) => members.values_mut().any(|v| mutate(v, n)),
        leaf => {
            if *n > 0 {
                *n -= 1;
                return false;
            }
            *leaf = match leaf {
                Json::Null => Json::Int(0),
                Json::Bool(b) => Json::Bool(!*b),
                Json::Int(i) => Json::Int(i.wrapping_add(1)),
                Json::Dec(u, s) => Json::Dec(*u + 1, *s),
                Json::Str(s) => Json::Str(format!("{s}x")),
                _ => unreachable!("leaves only"),
            };
            true
        }
    }
}

fn leaves(value: &Json) -> usize {
    match value {
        Json::Arr(items) => items.iter().map(leaves).sum(),
        Json::Obj(members) => members.values().map(leaves).sum(),
        _ => 1,
    }
}

fn fp(s: &str) -> Fingerprint {
    Fingerprint::of(None, s.as_bytes())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)
    ))]

    #[test]
    fn order_whitespace_escapes_and_notation_do_not_change_the_fingerprint(value in json()) {
        let plain = text(&value, false);
        let twisted = text(&value, true);
        prop_assert!(canonicalize(plain.as_bytes()).is_some(), "{plain}");
        prop_assert_eq!(fp(&plain), fp(&twisted), "{} vs {}", plain, twisted);
    }

    #[test]
    fn any_change_at_any_depth_changes_the_fingerprint(value in json(), pick in any::<usize>()) {
        // A document of empty containers has no leaf to change: give it one.
        let value = if leaves(&value) == 0 { Json::Arr(vec![value, Json::Null]) } else { value };
        let mut changed = value.clone();
        let mut n = pick % leaves(&value);
        prop_assert!(mutate(&mut changed, &mut n));
        prop_assert_ne!(fp(&text(&value, false)), fp(&text(&changed, true)));
    }

    #[test]
    fn canonical_form_is_a_fixed_point(value in json()) {
        let once = canonicalize(text(&value, true).as_bytes()).expect("valid");
        let twice = canonicalize(&once).expect("canonical output is JSON");
        prop_assert_eq!(once, twice);
    }

    #[test]
    fn random_bytes_get_a_defined_answer(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        // Never panics; JSON or not, the fingerprint is deterministic.
        let _ = canonicalize(&bytes);
        prop_assert_eq!(Fingerprint::of(None, &bytes), Fingerprint::of(None, &bytes));
    }

    #[test]
    fn mutated_json_gets_a_defined_answer(value in json(), at in any::<usize>(), byte in any::<u8>()) {
        let mut bytes = text(&value, true).into_bytes();
        let i = at % bytes.len();
        bytes[i] = byte;
        if let Some(canonical) = canonicalize(&bytes) {
            // Whatever it accepted, its canonical form is stable.
            prop_assert_eq!(canonicalize(&canonical), Some(canonical));
        }
    }

    #[test]
    fn valid_keys_are_accepted_as_trimmed(core in "[!-~]([ -~]{0,253}[!-~])?", pad in "[ \t]{0,3}") {
        // A bare key that starts with a double quote must be a whole quoted string (below).
        if !core.starts_with('"') {
            let raw = format!("{pad}{core}{pad}");
            prop_assert_eq!(key::parse(raw.as_bytes()), Ok(core.clone()));
        }
        // The quoted form is the same key.
        let quoted = format!("\"{}\"", core.replace('\\', "\\\\").replace('"', "\\\""));
        prop_assert_eq!(key::parse(quoted.as_bytes()), Ok(core));
    }

    #[test]
    fn keys_with_a_bad_byte_are_refused(
        before in "[!-~]{1,10}",
        bad in prop_oneof![0u8..0x20, 0x7Fu8..=0xFF],
        after in "[!-~]{1,10}",
    ) {
        let mut raw = before.into_bytes();
        raw.push(bad);
        raw.extend_from_slice(after.as_bytes());
        prop_assert!(key::parse(&raw).is_err());
    }

    #[test]
    fn keys_over_255_are_refused(core in "[!#-~][!-~]{255,399}") {
        prop_assert_eq!(key::parse(core.as_bytes()), Err(key::KeyError::TooLong));
    }
}

#[test]
fn huge_numbers_and_duplicate_keys_have_defined_answers() {
    let huge = format!("{{\"amount\":1{}}}", "0".repeat(5_000));
    assert!(canonicalize(huge.as_bytes()).is_some());
    assert_ne!(
        fp(&huge),
        fp(&format!("{{\"amount\":1{}1}}", "0".repeat(4_999)))
    );
    assert_eq!(fp("{\"a\":1e400}"), fp("{\"a\":10e399}"));
    // Duplicate keys are not I-JSON: hashed as bytes, so they never equal a cleaned-up document.
    assert!(canonicalize(b"{\"a\":1,\"a\":2}").is_none());
    assert_ne!(fp("{\"a\":1,\"a\":2}"), fp("{\"a\":2}"));
}
