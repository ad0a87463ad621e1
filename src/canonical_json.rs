//! Canonical JSON: the byte form two equal JSON documents share.
//!
//! The canonical form follows RFC 8785 in spirit, with two deliberate differences that only ever make
//! *more* requests distinct, never fewer:
//!
//! - object members are sorted by their keys at every depth (compared as UTF-16 code units, as RFC 8785
//!   does), insignificant whitespace is dropped, and strings are written with the minimal escapes;
//! - numbers are normalised **exactly** as decimals (`1`, `1.0`, `10e-1` and `0.1e1` are one number), not
//!   through IEEE doubles, so `12345678901234567890123` and `12345678901234567890124` stay different;
//! - documents that are not I-JSON are refused (`None`): duplicate object keys, strings with unpaired
//!   surrogates, nesting deeper than [`MAX_DEPTH`], exponents too large to normalise, invalid UTF-8.
//!   The caller then fingerprints the raw bytes, which is always safe: a byte-level difference can only
//!   turn a retry into `422`, never replay another request's answer.
//!
//! The parser is recursive but bounded by [`MAX_DEPTH`], so no input can overflow the stack.

/// Deepest nesting of arrays and objects that is canonicalised; deeper documents are hashed as bytes.
pub const MAX_DEPTH: usize = 128;

/// Returns the canonical form of `input`, or `None` when `input` is not a JSON document this module
/// canonicalises (see the module docs).
pub fn canonicalize(input: &[u8]) -> Option<Vec<u8>> {
    let mut parser = Parser {
        input,
        pos: 0,
        out: Vec::with_capacity(input.len()),
        keys: Vec::new(),
        members: Vec::new(),
        scratch: Vec::new(),
    };
    parser.skip_ws();
    parser.value(0)?;
    parser.skip_ws();
    if parser.pos != input.len() {
        return None;
    }
    Some(parser.out)
}

/// One object member as written in `out`: its decoded key in `keys`, and its canonical bytes.
#[derive(Clone, Copy)]
struct Member {
    key_start: usize,
    key_end: usize,
    start: usize,
    end: usize,
}

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    out: Vec<u8>,
    /// Decoded member keys of the objects being parsed, used for sorting.
    keys: Vec<u8>,
    /// The members of the objects being parsed, innermost last: one allocation for the document.
    members: Vec<Member>,
    /// Where an object's members are copied while they are written back in order.
    scratch: Vec<u8>,
}

impl Parser<'_> {
    fn skip_ws(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.input.get(self.pos) {
            self.pos += 1;
        }
    }

    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn literal(&mut self, word: &[u8]) -> Option<()> {
        if self.input.get(self.pos..self.pos + word.len())? == word {
            self.pos += word.len();
            self.out.extend_from_slice(word);
            Some(())
        } else {
            None
        }
    }

    fn value(&mut self, depth: usize) -> Option<()> {
        match self.peek()? {
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'"' => self.string(false),
            b't' => self.literal(b"true"),
            b'f' => self.literal(b"false"),
            b'n' => self.literal(b"null"),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn array(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.pos += 1;
        self.out.push(b'[');
        self.skip_ws();
        if self.peek()? == b']' {
            self.pos += 1;
            self.out.push(b']');
            return Some(());
        }
        loop {
            self.skip_ws();
            self.value(depth)?;
            self.skip_ws();
            match self.peek()? {
                b',' => {
                    self.pos += 1;
                    self.out.push(b',');
                }
                b']' => {
                    self.pos += 1;
                    self.out.push(b']');
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    fn object(&mut self, depth: usize) -> Option<()> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.pos += 1;
        let object_start = self.out.len();
        let keys_start = self.keys.len();
        let members_start = self.members.len();
        self.out.push(b'{');
        self.skip_ws();
        if self.peek()? == b'}' {
            self.pos += 1;
            self.out.push(b'}');
            return Some(());
        }
        loop {
            self.skip_ws();
            if self.peek()? != b'"' {
                return None;
            }
            let start = self.out.len();
            let key_start = self.keys.len();
            self.string(true)?;
            let key_end = self.keys.len();
            self.skip_ws();
            if self.peek()? != b':' {
                return None;
            }
            self.pos += 1;
            self.out.push(b':');
            self.skip_ws();
            self.value(depth)?;
            self.members.push(Member {
                key_start,
                key_end,
                start,
                end: self.out.len(),
            });
            self.skip_ws();
            match self.peek()? {
                b',' => {
                    self.pos += 1;
                    self.out.push(b',');
                }
                b'}' => {
                    self.pos += 1;
                    break;
                }
                _ => return None,
            }
        }
        let keys = &self.keys;
        let members = &mut self.members[members_start..];
        let key = |m: &Member| &keys[m.key_start..m.key_end];
        let sorted = members
            .windows(2)
            .all(|w| utf16_cmp(key(&w[0]), key(&w[1])).is_lt());
        if !sorted {
            members.sort_unstable_by(|a, b| utf16_cmp(key(a), key(b)));
            if members.windows(2).any(|w| key(&w[0]) == key(&w[1])) {
                return None; // duplicate keys: not I-JSON
            }
            self.scratch.clear();
            self.scratch
                .extend_from_slice(&self.out[object_start + 1..]);
            self.out.truncate(object_start + 1);
            for (i, m) in members.iter().enumerate() {
                if i > 0 {
                    self.out.push(b',');
                }
                let from = m.start - object_start - 1;
                let to = m.end - object_start - 1;
                self.out.extend_from_slice(&self.scratch[from..to]);
            }
        }
        self.out.push(b'}');
        self.keys.truncate(keys_start);
        self.members.truncate(members_start);
        Some(())
    }

    /// Parses a string at `pos` and writes its canonical form. With `record_key`, the decoded
    /// UTF-8 is also appended to `keys`.
    fn string(&mut self, record_key: bool) -> Option<()> {
        self.pos += 1;
        self.out.push(b'"');
        loop {
            // Copy the longest run that needs no attention in one go.
            let run_start = self.pos;
            let rest = &self.input[run_start..];
            self.pos += rest
                .iter()
                .position(|&b| b == b'"' || b == b'\\' || b < 0x20)
                .unwrap_or(rest.len());
            let run = &self.input[run_start..self.pos];
            if !run.is_empty() {
                // Non-ASCII bytes must be valid UTF-8; check each run once.
                if !run.is_ascii() {
                    std::str::from_utf8(run).ok()?;
                }
                self.out.extend_from_slice(run);
                if record_key {
                    self.keys.extend_from_slice(run);
                }
            }
            match self.peek()? {
                b'"' => {
                    self.pos += 1;
                    self.out.push(b'"');
                    return Some(());
                }
                b'\\' => {
                    self.pos += 1;
                    let ch = self.escape()?;
                    self.push_char(ch, record_key);
                }
                _ => return None, // raw control character
            }
        }
    }

    /// Decodes the escape after a backslash.
    fn escape(&mut self) -> Option<char> {
        let b = self.peek()?;
        self.pos += 1;
        Some(match b {
            b'"' => '"',
            b'\\' => '\\',
            b'/' => '/',
            b'b' => '\u{8}',
            b'f' => '\u{c}',
            b'n' => '\n',
            b'r' => '\r',
            b't' => '\t',
            b'u' => {
                let hi = self.hex4()?;
                if (0xD800..0xDC00).contains(&hi) {
                    if self.input.get(self.pos..self.pos + 2)? != b"\\u" {
                        return None;
                    }
                    self.pos += 2;
                    let lo = self.hex4()?;
                    if !(0xDC00..0xE000).contains(&lo) {
                        return None;
                    }
                    char::from_u32(0x10000 + ((hi - 0xD800) << 10) + (lo - 0xDC00))?
                } else {
                    char::from_u32(hi)? // fails on a lone low surrogate
                }
            }
            _ => return None,
        })
    }

    fn hex4(&mut self) -> Option<u32> {
        let digits = self.input.get(self.pos..self.pos + 4)?;
        let mut v = 0u32;
        for &d in digits {
            v = v * 16 + (d as char).to_digit(16)?;
        }
        self.pos += 4;
        Some(v)
    }

    /// Writes one decoded character with the minimal escape RFC 8785 prescribes.
    fn push_char(&mut self, ch: char, record_key: bool) {
        let mut buf = [0u8; 4];
        let encoded = ch.encode_utf8(&mut buf).as_bytes();
        if record_key {
            self.keys.extend_from_slice(encoded);
        }
        match ch {
            '"' => self.out.extend_from_slice(b"\\\""),
            '\\' => self.out.extend_from_slice(b"\\\\"),
            '\u{8}' => self.out.extend_from_slice(b"\\b"),
            '\u{c}' => self.out.extend_from_slice(b"\\f"),
            '\n' => self.out.extend_from_slice(b"\\n"),
            '\r' => self.out.extend_from_slice(b"\\r"),
            '\t' => self.out.extend_from_slice(b"\\t"),
            c if (c as u32) < 0x20 => {
                const HEX: &[u8; 16] = b"0123456789abcdef";
                let c = c as usize;
                self.out
                    .extend_from_slice(&[b'\\', b'u', b'0', b'0', HEX[c >> 4], HEX[c & 15]]);
            }
            _ => self.out.extend_from_slice(encoded),
        }
    }

    /// Parses a JSON number and writes it in exact canonical decimal form.
    fn number(&mut self) -> Option<()> {
        let input = self.input;
        let negative = input[self.pos] == b'-';
        if negative {
            self.pos += 1;
        }
        let int_start = self.pos;
        match self.peek()? {
            b'0' => self.pos += 1,
            b'1'..=b'9' => self.skip_digits(),
            _ => return None,
        }
        let int = &input[int_start..self.pos];
        if !matches!(self.peek(), Some(b'.' | b'e' | b'E')) && int.len() <= 21 {
            // A plain integer is already in canonical form, but for the sign of zero.
            if int != b"0" && negative {
                self.out.push(b'-');
            }
            self.out.extend_from_slice(int);
            return Some(());
        }
        let mut frac: &[u8] = &[];
        if self.peek() == Some(b'.') {
            self.pos += 1;
            let start = self.pos;
            self.skip_digits();
            frac = &input[start..self.pos];
            if frac.is_empty() {
                return None;
            }
        }
        let mut exp: i64 = 0;
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            let exp_negative = match self.peek()? {
                b'-' => {
                    self.pos += 1;
                    true
                }
                b'+' => {
                    self.pos += 1;
                    false
                }
                _ => false,
            };
            let start = self.pos;
            self.skip_digits();
            let digits = &input[start..self.pos];
            if digits.is_empty() {
                return None;
            }
            for &d in digits {
                exp = exp.checked_mul(10)?.checked_add(i64::from(d - b'0'))?;
                if exp > 1_000_000_000_000 {
                    return None; // too large to normalise exactly; hash as bytes
                }
            }
            if exp_negative {
                exp = -exp;
            }
        }
        // value = 0.digits... : significant digits of int ++ frac, scaled by 10^(exp - frac.len()).
        let all = int.iter().chain(frac.iter());
        let leading_zeros = all.clone().take_while(|&&d| d == b'0').count();
        let total = int.len() + frac.len();
        if leading_zeros == total {
            self.out.push(b'0'); // every zero, including -0, is 0
            return Some(());
        }
        let digit_at = |i: usize| {
            if i < int.len() {
                int[i]
            } else {
                frac[i - int.len()]
            }
        };
        let mut end = total;
        while digit_at(end - 1) == b'0' {
            end -= 1;
        }
        let digits_len = end - leading_zeros;
        // The value is D * 10^scale, with D the digits from leading_zeros to end.
        let scale = exp - frac.len() as i64 + (total - end) as i64;
        if negative {
            self.out.push(b'-');
        }
        let out = &mut self.out;
        let digits = (leading_zeros..end).map(digit_at);
        if scale >= 0 && digits_len as i64 + scale <= 21 {
            out.extend(digits);
            out.extend(std::iter::repeat_n(b'0', scale as usize));
        } else if scale < 0 && digits_len as i64 + scale > 0 {
            let point = (digits_len as i64 + scale) as usize;
            for (i, d) in digits.enumerate() {
                if i == point {
                    out.push(b'.');
                }
                out.push(d);
            }
        } else {
            // Scientific: d[.ddd]e<exponent of the first digit>.
            for (i, d) in digits.enumerate() {
                if i == 1 {
                    out.push(b'.');
                }
                out.push(d);
            }
            out.push(b'e');
            let e = scale + digits_len as i64 - 1;
            out.extend_from_slice(e.to_string().as_bytes());
        }
        Some(())
    }

    fn skip_digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }
}

/// Orders two UTF-8 strings by their UTF-16 code units, as RFC 8785 sorts object keys.
fn utf16_cmp(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    if a.is_ascii() && b.is_ascii() {
        return a.cmp(b);
    }
    // Both were validated as UTF-8 while parsing.
    match (std::str::from_utf8(a), std::str::from_utf8(b)) {
        (Ok(a), Ok(b)) => a.encode_utf16().cmp(b.encode_utf16()),
        _ => a.cmp(b),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(s: &str) -> String {
        String::from_utf8(canonicalize(s.as_bytes()).expect("valid JSON")).expect("utf-8")
    }

    #[test]
    fn sorts_keys_at_every_depth_and_drops_whitespace() {
        assert_eq!(
            canon(r#" { "b" : [ {"z":1, "a":2} ], "a" : {"y": null, "x": true} } "#),
            r#"{"a":{"x":true,"y":null},"b":[{"a":2,"z":1}]}"#
        );
    }

    #[test]
    fn keeps_array_order() {
        assert_eq!(canon("[3, 1, 2]"), "[3,1,2]");
        assert_ne!(canon("[1,2]"), canon("[2,1]"));
    }

    #[test]
    fn numbers_are_exact_decimals() {
        for same in ["1", "1.0", "10e-1", "0.1e1", "1E0", "1.000"] {
            assert_eq!(canon(same), "1", "{same}");
        }
        assert_eq!(canon("100"), "100");
        assert_eq!(canon("1e2"), "100");
        assert_eq!(canon("-0.0"), "0");
        assert_eq!(canon("-0"), "0");
        assert_eq!(canon("12.50"), "12.5");
        assert_eq!(canon("0.001"), "1e-3");
        assert_eq!(canon("1e30"), "1e30");
        assert_eq!(canon("1.5e30"), "1.5e30");
        assert_eq!(canon("-2.25"), "-2.25");
        assert_ne!(
            canon("12345678901234567890123"),
            canon("12345678901234567890124")
        );
        assert_ne!(canon("0.1"), canon("0.10000000000000001"));
    }

    #[test]
    fn strings_use_minimal_escapes() {
        assert_eq!(canon(r#""\u0041\/\n\u001f\"""#), r#""A/\n\u001f\"""#);
        assert_eq!(canon(r#""\ud83d\ude00""#), "\"\u{1F600}\"");
        assert_eq!(canon("\"é\""), "\"é\"");
    }

    #[test]
    fn keys_sort_by_utf16_code_units() {
        // U+E000 sorts after U+1F600 in UTF-8 byte order but before it in UTF-16.
        assert_eq!(
            canon("{\"\u{E000}\":1,\"\u{1F600}\":2}"),
            "{\"\u{1F600}\":2,\"\u{E000}\":1}"
        );
    }

    #[test]
    fn escaped_and_raw_keys_are_the_same_key() {
        assert_eq!(canon(r#"{"\u0061":1}"#), canon(r#"{"a":1}"#));
        assert!(canonicalize(br#"{"a":1,"\u0061":2}"#).is_none());
    }

    #[test]
    fn refuses_what_is_not_i_json() {
        for bad in [
            "",
            "{",
            "[1,]",
            "{\"a\":1,}",
            "{\"a\":1,\"a\":1}",
            "01",
            "1.",
            "1e",
            "-",
            "\"\\ud800\"",
            "\"\\udc00\"",
            "\"a\tb\"",
            "tru",
            "1 2",
            "1e99999999999999999999",
            "\"\\x\"",
        ] {
            assert!(canonicalize(bad.as_bytes()).is_none(), "{bad:?}");
        }
        assert!(canonicalize(b"\"\xff\"").is_none());
    }

    #[test]
    fn deep_nesting_is_refused_without_overflowing() {
        let deep = "[".repeat(100_000) + &"]".repeat(100_000);
        assert!(canonicalize(deep.as_bytes()).is_none());
        let ok = "[".repeat(MAX_DEPTH) + &"]".repeat(MAX_DEPTH);
        assert!(canonicalize(ok.as_bytes()).is_some());
        let objects = "{\"a\":".repeat(100_000) + "1" + &"}".repeat(100_000);
        assert!(canonicalize(objects.as_bytes()).is_none());
    }
}
