//! Property tests: the canonical form against a reference written here, the fingerprint's
//! sensitivity to any change at any depth, the key grammar, and defined answers on hostile input
//! (random bytes, mutated JSON) without panics.
//!
//! Documents are random trees, written out in many ways (members shuffled, whitespace between tokens,
//! characters raw or escaped in every allowed form, numbers in several notations) by a writer driven
//! by a seed; each writing must canonicalise to the reference canonical form of the tree, which this
//! file computes on its own, without the crate.

use axum_idempotency::Fingerprint;
use axum_idempotency::fingerprint::canonicalize;
use axum_idempotency::layer::key;
use proptest::prelude::*;

/// A JSON value. Object keys are unique (they come from a map); members keep an arbitrary order.
#[derive(Debug, Clone, PartialEq)]
enum Json {
    Null,
    Bool(bool),
    Num(Num),
    Str(String),
    Arr(Vec<Json>),
    Obj(Vec<(String, Json)>),
}

/// The exact decimal `(-1)^negative * digits * 10^scale`; `digits` has no leading or trailing zero,
/// and is empty for zero.
#[derive(Debug, Clone, PartialEq)]
struct Num {
    negative: bool,
    digits: String,
    scale: i64,
}

fn num() -> impl Strategy<Value = Num> {
    prop_oneof![
        any::<bool>().prop_map(|negative| Num {
            negative,
            digits: String::new(),
            scale: 0,
        }),
        (any::<bool>(), "[1-9]([0-9]{0,24}[1-9])?", -30i64..30).prop_map(
            |(negative, digits, scale)| Num {
                negative,
                digits,
                scale,
            }
        ),
    ]
}

/// Strings mixing what is written raw and what must be escaped: quotes, backslashes, control
/// characters, `/`, DEL, U+2028, and characters beyond the BMP (surrogate pairs when escaped).
fn string() -> impl Strategy<Value = String> {
    r#"[a-z/"\\\x00-\x1F\x7F\u{e9}\u{2028}\u{E000}\u{FFFF}\u{10000}\u{1F600}]{0,8}"#
}

/// Keys from a small alphabet, so that objects hold keys that are prefixes of each other and keys
/// whose UTF-8 and UTF-16 orders differ (U+E000 and U+FFFF sort after U+1F600 in UTF-8 only).
fn key_string() -> impl Strategy<Value = String> {
    r#"[aB\x00\n"\\\u{e9}\u{E000}\u{FFFF}\u{10000}\u{1F600}]{0,4}"#
}

fn json() -> impl Strategy<Value = Json> {
    let leaf = prop_oneof![
        Just(Json::Null),
        any::<bool>().prop_map(Json::Bool),
        num().prop_map(Json::Num),
        string().prop_map(Json::Str),
    ];
    leaf.prop_recursive(6, 64, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..5).prop_map(Json::Arr),
            prop::collection::btree_map(key_string(), inner, 0..5)
                .prop_map(|members| Json::Obj(members.into_iter().collect())),
        ]
    })
}

/// A `json()` value nested up to 10 levels deeper: each level an array or an object holding the
/// level below among other values, so that every property is checked at every depth.
fn document() -> impl Strategy<Value = Json> {
    let level = (
        any::<bool>(),
        prop::collection::btree_map(key_string(), json(), 0..3),
        any::<usize>(),
    );
    (json(), prop::collection::vec(level, 0..10)).prop_map(|(mut value, levels)| {
        for (object, siblings, at) in levels {
            let mut members: Vec<_> = siblings.into_iter().collect();
            let at = at % (members.len() + 1);
            value = if object {
                let key = fresh_key(&members, "");
                members.insert(at, (key, value));
                Json::Obj(members)
            } else {
                let mut items: Vec<_> = members.into_iter().map(|(_, v)| v).collect();
                items.insert(at, value);
                Json::Arr(items)
            };
        }
        value
    })
}

// ---------------------------------------------------------------------------------------------
// The reference canonical form.

/// Keys sorted by UTF-16 code units, no whitespace, minimal string escapes, exact numbers.
fn reference(value: &Json) -> String {
    let mut out = String::new();
    write_reference(value, &mut out);
    out
}

fn write_reference(value: &Json, out: &mut String) {
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Num(n) => out.push_str(&reference_number(n)),
        Json::Str(s) => reference_string(s, out),
        Json::Arr(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_reference(item, out);
            }
            out.push(']');
        }
        Json::Obj(members) => {
            let mut members: Vec<_> = members.iter().collect();
            members.sort_by(|(a, _), (b, _)| a.encode_utf16().cmp(b.encode_utf16()));
            out.push('{');
            for (i, (k, v)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                reference_string(k, out);
                out.push(':');
                write_reference(v, out);
            }
            out.push('}');
        }
    }
}

/// `"` and `\` escaped, the short escapes of JSON for the control characters that have one,
/// `\u00xx` (lower-case hex) for the others, every other character as itself.
fn reference_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Zero is `0`. Otherwise the digits, with as many zeros after them as the scale says when that
/// makes at most 21 digits, or with a decimal point inside them when the scale puts one there, or
/// else `d.ddde<exponent of the first digit>`; a minus sign before negative numbers.
fn reference_number(n: &Num) -> String {
    if n.digits.is_empty() {
        return "0".into();
    }
    let digits = &n.digits;
    let len = digits.len() as i64;
    let body = if n.scale >= 0 && len + n.scale <= 21 {
        format!("{digits}{}", "0".repeat(n.scale as usize))
    } else if n.scale < 0 && len + n.scale > 0 {
        let (int, frac) = digits.split_at((len + n.scale) as usize);
        format!("{int}.{frac}")
    } else {
        let (first, rest) = digits.split_at(1);
        let point = if rest.is_empty() { "" } else { "." };
        format!("{first}{point}{rest}e{}", n.scale + len - 1)
    };
    if n.negative { format!("-{body}") } else { body }
}

// ---------------------------------------------------------------------------------------------
// Writing a tree in one of its many equivalent forms.

/// The writer's choices: xorshift64* from a seed.
struct Choices(u64);

impl Choices {
    fn new(seed: u64) -> Self {
        Choices(seed | 1)
    }

    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as usize % n
    }

    fn coin(&mut self) -> bool {
        self.below(2) == 0
    }
}

/// `value` written in a form chosen by `seed`: members in any order, whitespace anywhere between
/// tokens, characters raw or escaped, numbers in any notation. Seed 0 writes the reference form.
fn write(value: &Json, seed: u64) -> String {
    let mut out = String::new();
    if seed == 0 {
        write_reference(value, &mut out);
        return out;
    }
    let mut choices = Choices::new(seed);
    ws(&mut choices, &mut out);
    write_value(value, &mut choices, &mut out);
    ws(&mut choices, &mut out);
    out
}

fn ws(choices: &mut Choices, out: &mut String) {
    for _ in 0..choices.below(4).saturating_sub(1) {
        out.push([' ', '\t', '\n', '\r'][choices.below(4)]);
    }
}

fn write_value(value: &Json, choices: &mut Choices, out: &mut String) {
    match value {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Num(n) => write_number(n, choices, out),
        Json::Str(s) => write_string(s, choices, out),
        Json::Arr(items) => {
            out.push('[');
            ws(choices, out);
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    ws(choices, out);
                }
                write_value(item, choices, out);
                ws(choices, out);
            }
            out.push(']');
        }
        Json::Obj(members) => {
            let mut members: Vec<_> = members.iter().collect();
            for i in (1..members.len()).rev() {
                members.swap(i, choices.below(i + 1));
            }
            out.push('{');
            ws(choices, out);
            for (i, (k, v)) in members.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                    ws(choices, out);
                }
                write_string(k, choices, out);
                ws(choices, out);
                out.push(':');
                ws(choices, out);
                write_value(v, choices, out);
                ws(choices, out);
            }
            out.push('}');
        }
    }
}

/// Each character raw when JSON allows it, as its short escape when it has one (`\/` included), or
/// as `\u` escapes in either case of hex (a surrogate pair beyond the BMP).
fn write_string(s: &str, choices: &mut Choices, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        let short = match c {
            '"' => Some("\\\""),
            '\\' => Some("\\\\"),
            '/' => Some("\\/"),
            '\u{8}' => Some("\\b"),
            '\u{c}' => Some("\\f"),
            '\n' => Some("\\n"),
            '\r' => Some("\\r"),
            '\t' => Some("\\t"),
            _ => None,
        };
        let raw_allowed = !matches!(c, '"' | '\\') && c as u32 >= 0x20;
        match (choices.below(3), short) {
            (0, _) if raw_allowed => out.push(c),
            (1, Some(escape)) => out.push_str(escape),
            _ => {
                let upper = choices.coin();
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    if upper {
                        out.push_str(&format!("\\u{unit:04X}"));
                    } else {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
            }
        }
    }
    out.push('"');
}

/// One of: the reference form; positional notation (`1200`, `0.0012`, `12.500`); or a mantissa with
/// the decimal point anywhere, trailing zeros, and an exponent in any of its spellings
/// (`0.12E+4`, `120e1`, `1.200e003`). Zero also as `-0`, `0.000`, `-0e5`.
fn write_number(n: &Num, choices: &mut Choices, out: &mut String) {
    if n.digits.is_empty() {
        let zeros = ["0", "-0", "0.0", "-0.000", "0e5", "-0E-3", "0.0e+0"];
        out.push_str(zeros[choices.below(zeros.len())]);
        return;
    }
    if n.negative {
        out.push('-');
    }
    let len = n.digits.len() as i64;
    match choices.below(3) {
        0 => out.push_str(reference_number(n).trim_start_matches('-')),
        1 => {
            // Positional: digits * 10^scale, with zeros added on either side of the point.
            if n.scale >= 0 {
                out.push_str(&n.digits);
                out.push_str(&"0".repeat(n.scale as usize));
                if choices.coin() {
                    out.push('.');
                    out.push_str(&"0".repeat(1 + choices.below(3)));
                }
            } else {
                let point = len + n.scale;
                if point > 0 {
                    let (int, frac) = n.digits.split_at(point as usize);
                    out.push_str(&format!("{int}.{frac}"));
                } else {
                    out.push_str(&format!("0.{}{}", "0".repeat(-point as usize), n.digits));
                }
                out.push_str(&"0".repeat(choices.below(3)));
            }
        }
        _ => {
            // Mantissa: the digits and `zeros` more, point after `point` of them; the value is
            // mantissa * 10^exponent.
            let zeros = choices.below(3);
            let mantissa = format!("{}{}", n.digits, "0".repeat(zeros));
            let point = choices.below(mantissa.len() + 1);
            let exponent = n.scale - zeros as i64 + (mantissa.len() - point) as i64;
            let (int, frac) = mantissa.split_at(point);
            out.push_str(if int.is_empty() { "0" } else { int });
            if !frac.is_empty() {
                out.push('.');
                out.push_str(frac);
            }
            out.push(if choices.coin() { 'e' } else { 'E' });
            match (exponent < 0, choices.coin()) {
                (true, _) => out.push('-'),
                (false, true) => out.push('+'),
                (false, false) => {}
            }
            out.push_str(&"0".repeat(choices.below(3)));
            out.push_str(&exponent.unsigned_abs().to_string());
        }
    }
}

/// Every value in the tree, the root first.
fn subtrees(value: &Json) -> Vec<&Json> {
    let mut all = vec![value];
    let mut i = 0;
    while i < all.len() {
        match all[i] {
            Json::Arr(items) => all.extend(items),
            Json::Obj(members) => all.extend(members.iter().map(|(_, v)| v)),
            _ => {}
        }
        i += 1;
    }
    all
}

// ---------------------------------------------------------------------------------------------
// Changes.

/// How many values the tree holds, the root included.
fn count(value: &Json) -> usize {
    subtrees(value).len()
}

/// The `n`-th value of the tree in pre-order.
fn nth_mut<'a>(value: &'a mut Json, n: &mut usize) -> Option<&'a mut Json> {
    if *n == 0 {
        return Some(value);
    }
    *n -= 1;
    match value {
        Json::Arr(items) => items.iter_mut().find_map(|item| nth_mut(item, n)),
        Json::Obj(members) => members.iter_mut().find_map(|(_, v)| nth_mut(v, n)),
        _ => None,
    }
}

/// `base`, or `base` with characters appended, so that it is none of the keys of `members`.
fn fresh_key(members: &[(String, Json)], base: &str) -> String {
    let mut key = base.to_owned();
    if members.iter().all(|(k, _)| *k != key) {
        return key;
    }
    for c in ['\u{0}', 'a', '\u{FFFF}', '\u{10000}'].into_iter().cycle() {
        key.push(c);
        if members.iter().all(|(k, _)| *k != key) {
            break;
        }
    }
    key
}

/// Changes `value` in one of the ways that apply to it (chosen by `choice`) and names the change:
/// a leaf's value, its type (object to array, number to string, ...), an array's elements or an
/// object's members added or removed, an object's key renamed.
fn change(value: &mut Json, choice: usize) -> &'static str {
    let kinds: &[&str] = match value {
        Json::Null => &["retype"],
        Json::Bool(_) | Json::Num(_) | Json::Str(_) => &["retype", "leaf"],
        Json::Arr(items) if items.is_empty() => &["retype", "insert"],
        Json::Arr(_) => &["retype", "insert", "remove"],
        Json::Obj(members) if members.is_empty() => &["retype", "insert"],
        Json::Obj(_) => &["retype", "insert", "remove", "rename"],
    };
    let kind = kinds[choice % kinds.len()];
    let choice = choice / kinds.len();
    match (kind, &mut *value) {
        ("leaf", Json::Bool(b)) => *b = !*b,
        ("leaf", Json::Num(n)) => match (n.digits.is_empty(), choice % 3) {
            (true, _) => n.digits = "1".into(),
            (false, 0) => n.negative = !n.negative,
            (false, 1) => n.scale += 1,
            (false, _) => n.digits.push('7'),
        },
        ("leaf", Json::Str(s)) => match (s.pop(), choice % 2) {
            (Some(_), 0) => {}
            (Some(c), _) => s.push(if c == 'a' { 'b' } else { 'a' }),
            (None, _) => s.push('\u{0}'),
        },
        ("insert", Json::Arr(items)) => {
            let at = choice % (items.len() + 1);
            // A copy of a neighbour: `[1]` becomes `[1,1]`.
            let new = items
                .get(at)
                .or(items.last())
                .cloned()
                .unwrap_or(Json::Null);
            items.insert(at, new);
        }
        ("remove", Json::Arr(items)) => {
            items.remove(choice % items.len());
        }
        ("insert", Json::Obj(members)) => {
            let at = choice % (members.len() + 1);
            let (base, new) = members
                .get(at)
                .or(members.last())
                .cloned()
                .unwrap_or((String::new(), Json::Null));
            let key = fresh_key(members, &base);
            members.insert(at, (key, new));
        }
        ("remove", Json::Obj(members)) => {
            members.remove(choice % members.len());
        }
        ("rename", Json::Obj(members)) => {
            let at = choice % members.len();
            let key = fresh_key(members, &members[at].0);
            members[at].0 = key;
        }
        ("retype", _) => *value = retyped(value, choice),
        _ => unreachable!("{kind} does not apply to {value:?}"),
    }
    kind
}

/// `value` as a value of another type, holding what it can of the original: an object's values as
/// an array, an array's elements as an object's members, a value's canonical text as a string, a
/// value wrapped in an array or an object.
fn retyped(value: &Json, choice: usize) -> Json {
    let text = reference(value);
    let same_type = |a: &Json, b: &Json| std::mem::discriminant(a) == std::mem::discriminant(b);
    let candidates = [
        Json::Null,
        Json::Bool(text.len().is_multiple_of(2)),
        Json::Num(Num {
            negative: false,
            digits: text.len().to_string().trim_end_matches('0').to_owned(),
            scale: 0,
        }),
        Json::Str(text),
        match value {
            Json::Obj(members) => Json::Arr(members.iter().map(|(_, v)| v.clone()).collect()),
            other => Json::Arr(vec![other.clone()]),
        },
        match value {
            Json::Arr(items) => Json::Obj(
                items
                    .iter()
                    .enumerate()
                    .map(|(i, v)| (i.to_string(), v.clone()))
                    .collect(),
            ),
            other => Json::Obj(vec![(String::new(), other.clone())]),
        },
    ];
    let others: Vec<_> = candidates
        .into_iter()
        .filter(|c| !same_type(c, value))
        .collect();
    others[choice % others.len()].clone()
}

fn fp(s: &str) -> Fingerprint {
    Fingerprint::of(None, s.as_bytes())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(512)
    ))]

    #[test]
    fn every_writing_canonicalises_to_the_reference_form(
        value in document(),
        seeds in prop::array::uniform4(any::<u64>()),
    ) {
        for (depth_first, sub) in subtrees(&value).into_iter().enumerate() {
            let expected = reference(sub);
            // The whole document in every writing; each value inside it in one of them.
            let seeds = if depth_first == 0 { &seeds[..] } else { &seeds[depth_first % 4..][..1] };
            for &seed in seeds.iter().chain([&0]) {
                let text = write(sub, seed);
                let canonical = canonicalize(text.as_bytes());
                prop_assert_eq!(
                    canonical.as_deref(),
                    Some(expected.as_bytes()),
                    "{} should be {}",
                    text,
                    expected
                );
            }
        }
        prop_assert_eq!(fp(&write(&value, seeds[0])), fp(&write(&value, seeds[1])));
    }

    #[test]
    fn any_change_at_any_depth_changes_the_fingerprint(
        value in document(),
        at in any::<usize>(),
        choice in any::<usize>(),
        seeds in prop::array::uniform2(any::<u64>()),
    ) {
        let mut changed = value.clone();
        let mut n = at % count(&value);
        let node = nth_mut(&mut changed, &mut n).expect("in the tree");
        let kind = change(node, choice);
        let (before, after) = (reference(&value), reference(&changed));
        prop_assert_ne!(&before, &after, "{} is no change", kind);
        prop_assert_eq!(canonicalize(write(&changed, seeds[1]).as_bytes()), Some(after.into_bytes()));
        prop_assert_ne!(
            fp(&write(&value, seeds[0])),
            fp(&write(&changed, seeds[1])),
            "{} of value {} in {}",
            kind,
            at % count(&value),
            before
        );
    }

    #[test]
    fn canonical_form_is_a_fixed_point(value in document(), seed in any::<u64>()) {
        let once = canonicalize(write(&value, seed).as_bytes()).expect("valid");
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
    fn mutated_json_gets_a_defined_answer(
        value in document(),
        seed in any::<u64>(),
        at in any::<usize>(),
        byte in any::<u8>(),
    ) {
        let mut bytes = write(&value, seed).into_bytes();
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

// ---------------------------------------------------------------------------------------------
// Fingerprint selection: fields named by JSON pointers are left out, and nothing else is.

/// The JSON pointer to the `n`-th value of the tree in pre-order (the root is `""`).
fn pointer_to(value: &Json, n: usize) -> Option<String> {
    fn walk(value: &Json, n: &mut usize, path: &mut Vec<String>) -> bool {
        if *n == 0 {
            return true;
        }
        *n -= 1;
        let children: Vec<(String, &Json)> = match value {
            Json::Arr(items) => items
                .iter()
                .enumerate()
                .map(|(i, v)| (i.to_string(), v))
                .collect(),
            Json::Obj(members) => members.iter().map(|(k, v)| (k.clone(), v)).collect(),
            _ => Vec::new(),
        };
        for (token, child) in children {
            path.push(token);
            if walk(child, n, path) {
                return true;
            }
            path.pop();
        }
        false
    }
    let mut path = Vec::new();
    let mut n = n;
    walk(value, &mut n, &mut path).then(|| {
        path.iter()
            .map(|t| format!("/{}", t.replace('~', "~0").replace('/', "~1")))
            .collect()
    })
}

/// Whether one of two pointers is the other or lies under it.
fn overlap(a: &str, b: &str) -> bool {
    let under = |x: &str, y: &str| x == y || x.starts_with(&format!("{y}/"));
    under(a, b) || under(b, a)
}

/// Sends `body` with key `k` through a layer that ignores `ignored`; the handler counts its runs.
fn through_layer(ignored: &str, bodies: &[String]) -> Vec<(u16, bool)> {
    use axum::{Router, body::Body, routing::post};
    use axum_idempotency::{IdempotencyLayer, MemoryStore};
    use tower::ServiceExt;
    let layer = IdempotencyLayer::builder(MemoryStore::new())
        .allow_anonymous(true)
        .fingerprint_ignore([ignored])
        .build()
        .expect("valid pointer");
    let router = Router::new()
        .route(
            "/pay",
            post(|| async { (axum::http::StatusCode::CREATED, "charged") }),
        )
        .route_layer(layer);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let mut answers = Vec::new();
        for body in bodies {
            let request = axum::http::Request::post("/pay")
                .header("idempotency-key", "k")
                .header("content-type", "application/json")
                .body(Body::from(body.clone()))
                .expect("request");
            let response = router.clone().oneshot(request).await.expect("infallible");
            let replayed = response.headers().contains_key("idempotent-replayed");
            answers.push((response.status().as_u16(), replayed));
        }
        answers
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(
        std::env::var("PROPTEST_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(256)
    ))]

    /// Changing or removing an ignored field replays; changing anything outside it is `422`.
    #[test]
    fn ignored_fields_never_count_and_every_other_change_does(
        value in document(),
        at in any::<usize>(),
        other in any::<usize>(),
        choice in any::<usize>(),
        seeds in prop::array::uniform3(any::<u64>()),
    ) {
        let nodes = count(&value);
        prop_assume!(nodes >= 2);
        let i = 1 + at % (nodes - 1);
        let ignored = pointer_to(&value, i).expect("node");

        let mut changed = value.clone();
        *nth_mut(&mut changed, &mut i.clone()).expect("node") = Json::Str("\u{1}changed".into());
        let mut bodies = vec![write(&value, seeds[0]), write(&changed, seeds[1])];

        // A node outside the ignored field, changed in any way that applies to it.
        let outside = (0..nodes)
            .map(|k| (other + k) % nodes)
            .find(|&j| pointer_to(&value, j).is_some_and(|p| !overlap(&p, &ignored)));
        if let Some(j) = outside {
            let mut different = value.clone();
            change(nth_mut(&mut different, &mut j.clone()).expect("node"), choice);
            bodies.push(write(&different, seeds[2]));
        }
        let answers = through_layer(&ignored, &bodies);
        prop_assert_eq!(answers[0], (201, false), "the first request runs");
        prop_assert_eq!(answers[1], (201, true), "ignoring {}: {} replays {}", ignored, bodies[1], bodies[0]);
        if outside.is_some() {
            prop_assert_eq!(answers[2].0, 422, "ignoring {}: {} is another request than {}", ignored, bodies[2], bodies[0]);
        }
    }
}
