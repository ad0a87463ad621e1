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
//!   surrogates, nesting deeper than 128, exponents too large to normalise, invalid UTF-8.
//!   The caller then fingerprints the raw bytes, which is always safe: a byte-level difference can only
//!   turn a retry into `422`, never replay another request's answer.
//!
//! The parser is recursive but bounded by a depth of 128, so no input can overflow the stack. Every
//! output byte is written at most four times whatever the nesting (see [`Parser`]), not once more for
//! each out-of-order object around it: beyond sorting each object's members, the work is linear in
//! the input.

mod already;

use std::borrow::Cow;
use std::ops::Range;

/// Deepest nesting of arrays and objects that is canonicalised; deeper documents are hashed as bytes.
pub(crate) const MAX_DEPTH: usize = 128;

/// Out-of-order objects up to this many canonical bytes, with nothing reordered inside, are put in
/// order in place at once: for small objects that is cheaper than recording them.
const SMALL: usize = 1024;

/// Returns the canonical form of `input`, or `None` when `input` is not a JSON document this
/// function canonicalises. The canonical form follows RFC 8785 in spirit, with differences that
/// only ever make *more* requests distinct, never fewer:
///
/// - object members are sorted by their keys at every depth (compared as UTF-16 code units, as
///   RFC 8785 does), insignificant whitespace is dropped, and strings are written with the minimal
///   escapes;
/// - numbers are normalised **exactly** as decimals (`1`, `1.0`, `10e-1` and `0.1e1` are one
///   number), not through IEEE doubles, so `12345678901234567890123` and
///   `12345678901234567890124` stay different;
/// - documents that are not I-JSON give `None`: duplicate object keys, strings with unpaired
///   surrogates, nesting deeper than 128, exponents too large to normalise, invalid
///   UTF-8. The layer then fingerprints the raw bytes, which is always safe: a byte-level
///   difference can only turn a retry into `422`, never replay another request's answer.
///
/// ```
/// use axum_idempotency::fingerprint::canonicalize;
///
/// let a = canonicalize(br#"{ "b": [1.0, {"y": 2, "x": 1}], "a": "\u0041" }"#);
/// let b = canonicalize(br#"{"a":"A","b":[1,{"x":1,"y":2}]}"#);
/// assert_eq!(a, b);
/// assert_eq!(a.as_deref(), Some(&br#"{"a":"A","b":[1,{"x":1,"y":2}]}"#[..]));
/// assert_eq!(canonicalize(br#"{"a":1,"a":2}"#), None); // duplicate keys: not I-JSON
/// ```
pub fn canonicalize(input: &[u8]) -> Option<Vec<u8>> {
    canonical(input).map(Cow::into_owned)
}

/// The canonical form of `input`, as [`canonicalize`] gives it, borrowed when `input` is in
/// canonical form already but for whitespace around the document (the usual compact body, maybe
/// with a newline at its end): then nothing is copied.
pub(crate) fn canonical(input: &[u8]) -> Option<Cow<'_, [u8]>> {
    let is_ws = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let start = input.iter().position(|b| !is_ws(b)).unwrap_or(input.len());
    let end = input
        .iter()
        .rposition(|b| !is_ws(b))
        .map_or(start, |last| last + 1);
    let document = &input[start..end];
    if already::is_canonical(document) {
        return Some(Cow::Borrowed(document));
    }
    written(input).map(Cow::Owned)
}

/// The canonical form of `input`, written out.
fn written(input: &[u8]) -> Option<Vec<u8>> {
    let mut parser = Parser {
        input,
        pos: 0,
        out: Vec::with_capacity(input.len()),
        keys: Vec::new(),
        members: Vec::new(),
        reordered: Vec::new(),
        sorted_members: Vec::new(),
        unsorted: 0,
        scratch: Vec::new(),
    };
    parser.skip_ws();
    parser.value(0)?;
    parser.skip_ws();
    if parser.pos != input.len() {
        return None;
    }
    Some(parser.assemble())
}

/// The bytes that end a run of a string's plain bytes: the closing quote, an escape, and the
/// control characters a string may not hold raw. One load a byte instead of three comparisons.
static STRING_STOPS: [bool; 256] = {
    let mut stops = [false; 256];
    let mut b = 0;
    while b < 0x20 {
        stops[b] = true;
        b += 1;
    }
    stops[b'"' as usize] = true;
    stops[b'\\' as usize] = true;
    stops
};

/// One object member as written in `out`: its decoded key in `keys`, and its canonical bytes.
#[derive(Clone, Copy)]
struct Member {
    key_start: usize,
    key_end: usize,
    start: usize,
    end: usize,
}

/// An object whose members came out of key order, left as it came in `out[start..end]` (braces
/// included). Its canonical form lists the members `sorted_members[members]` in this order. The
/// recorded objects nested in it come just before it in `reordered`, from `nested_start`.
struct Reordered {
    start: usize,
    end: usize,
    members: Range<usize>,
    nested_start: usize,
}

/// One pass writes every value's canonical bytes to `out` in document order. An object whose
/// members are out of order is either put in order in place at once, when it is [`SMALL`] and has
/// nothing reordered inside (two copies of its bytes; such objects never hold one another, so no
/// byte is copied this way twice), or only recorded in `reordered`. If any object is recorded,
/// [`Parser::assemble`] then writes the document once more with every recorded object's members in
/// order (one more copy of every byte). No byte is copied again for each object around it.
struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
    out: Vec<u8>,
    /// Decoded member keys of the objects being parsed, used for sorting.
    keys: Vec<u8>,
    /// The members of the objects being parsed, innermost last: one allocation for the document.
    members: Vec<Member>,
    /// The objects whose members are out of order, each after the ones nested in it, so in the
    /// order of their ends.
    reordered: Vec<Reordered>,
    /// The members of the `reordered` objects (their bytes in `out`), each object's in key order.
    sorted_members: Vec<Range<usize>>,
    /// How many objects came out of key order so far, reordered in place or not.
    unsorted: usize,
    /// Where a small object's members are copied while they are written back in order.
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
        let nested_start = self.reordered.len();
        let unsorted_before = self.unsorted;
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
        self.out.push(b'}');
        let keys = &self.keys;
        let key = |m: &Member| &keys[m.key_start..m.key_end];
        let sorted = self.members[members_start..]
            .windows(2)
            .all(|w| utf16_cmp(key(&w[0]), key(&w[1])).is_lt());
        if !sorted {
            self.reorder(object_start, members_start, nested_start, unsorted_before)?;
        }
        self.keys.truncate(keys_start);
        self.members.truncate(members_start);
        Some(())
    }

    /// Puts in key order the members of the object just written at `object_start`, or returns
    /// `None` when two have the same key (not I-JSON).
    ///
    /// A small object with nothing reordered inside is rewritten in place at once. Any other object
    /// is only recorded, for [`Parser::assemble`] to write its members in order in its final pass.
    #[inline(never)]
    fn reorder(
        &mut self,
        object_start: usize,
        members_start: usize,
        nested_start: usize,
        unsorted_before: usize,
    ) -> Option<()> {
        let keys = &self.keys;
        let key = |m: &Member| &keys[m.key_start..m.key_end];
        let members = &mut self.members[members_start..];
        members.sort_unstable_by(|a, b| utf16_cmp(key(a), key(b)));
        if members.windows(2).any(|w| key(&w[0]) == key(&w[1])) {
            return None; // duplicate keys: not I-JSON
        }
        self.unsorted += 1;
        let nothing_inside = self.unsorted == unsorted_before + 1;
        if nothing_inside && self.out.len() - object_start <= SMALL {
            let content = object_start + 1..self.out.len() - 1;
            self.scratch.clear();
            self.scratch.extend_from_slice(&self.out[content.clone()]);
            count_moved(content.len());
            self.out.truncate(content.start);
            for (i, m) in members.iter().enumerate() {
                if i > 0 {
                    self.out.push(b',');
                }
                let member = m.start - content.start..m.end - content.start;
                count_moved(member.len());
                self.out.extend_from_slice(&self.scratch[member]);
            }
            self.out.push(b'}');
        } else {
            if self.reordered.is_empty() {
                // Room for what a document of ordinary objects records, without regrowing.
                self.reordered.reserve(self.input.len() / 128);
                self.sorted_members.reserve(self.input.len() / 32);
            }
            let members_start = self.sorted_members.len();
            self.sorted_members
                .extend(members.iter().map(|m| m.start..m.end));
            self.reordered.push(Reordered {
                start: object_start,
                end: self.out.len(),
                members: members_start..self.sorted_members.len(),
                nested_start,
            });
        }
        Some(())
    }

    /// The canonical form: `out` with the members of every recorded object in key order. It has the
    /// length of `out` (the same bytes, in another order), and is written from its end, the order
    /// in which `reordered` lists objects; each byte of `out` is copied once.
    fn assemble(self) -> Vec<u8> {
        if self.reordered.is_empty() {
            return self.out; // every object is in order already
        }
        let mut doc = vec![0; self.out.len()];
        let mut cursor = doc.len();
        self.write_back(
            &mut doc,
            &mut cursor,
            0..self.out.len(),
            0..self.reordered.len(),
        );
        debug_assert_eq!(cursor, 0);
        doc
    }

    /// Writes `out[bytes]`, with the recorded objects `reordered[nested]` in it put in order, to the
    /// bytes of `doc` that end at `cursor`, and moves `cursor` to their start. It recurses once per
    /// recorded object nested in another, so no deeper than 128.
    fn write_back(
        &self,
        doc: &mut [u8],
        cursor: &mut usize,
        bytes: Range<usize>,
        nested: Range<usize>,
    ) {
        let mut end = bytes.end;
        // The outermost recorded objects in `bytes`, last first: each one comes after the objects
        // nested in it in `reordered`.
        let mut i = nested.end;
        while i > nested.start {
            let object = &self.reordered[i - 1];
            put_back(doc, cursor, &self.out[object.end - 1..end]); // `}` and what follows
            let inner = &self.reordered[object.nested_start..i - 1];
            let members = &self.sorted_members[object.members.clone()];
            for (n, member) in members.iter().enumerate().rev() {
                if inner.is_empty() {
                    put_back(doc, cursor, &self.out[member.clone()]);
                } else {
                    // The objects nested in this member: those that end inside it.
                    let from = inner.partition_point(|o| o.end <= member.start);
                    let to = from + inner[from..].partition_point(|o| o.end <= member.end);
                    let base = object.nested_start;
                    self.write_back(doc, cursor, member.clone(), base + from..base + to);
                }
                *cursor -= 1;
                doc[*cursor] = if n > 0 { b',' } else { b'{' };
                count_moved(1);
            }
            end = object.start;
            i = object.nested_start;
        }
        put_back(doc, cursor, &self.out[bytes.start..end]);
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
                .position(|&b| STRING_STOPS[usize::from(b)])
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
                let [hi, lo] = crate::util::hex::digits(c as u8);
                self.out
                    .extend_from_slice(&[b'\\', b'u', b'0', b'0', hi, lo]);
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

/// Writes `bytes` to `doc` just before `cursor`, and moves `cursor` to their start.
fn put_back(doc: &mut [u8], cursor: &mut usize, bytes: &[u8]) {
    doc[*cursor - bytes.len()..*cursor].copy_from_slice(bytes);
    *cursor -= bytes.len();
    count_moved(bytes.len());
}

#[cfg(test)]
thread_local! {
    static MOVED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

fn count_moved(_n: usize) {
    #[cfg(test)]
    MOVED.with(|m| m.set(m.get() + _n));
}

/// Orders two UTF-8 strings by their UTF-16 code units, as RFC 8785 sorts object keys.
///
/// UTF-8's byte order is the order of code points, and so is UTF-16's but for one pair of ranges:
/// a character above U+FFFF (a surrogate pair, from U+D800) comes before U+E000..=U+FFFF in
/// UTF-16, after it in UTF-8. So the bytes decide, unless the first characters that differ are one
/// of each (UTF-8 lead bytes 0xF0..=0xF4 against 0xEE or 0xEF).
fn utf16_cmp(a: &[u8], b: &[u8]) -> std::cmp::Ordering {
    let Some(i) = a.iter().zip(b).position(|(x, y)| x != y) else {
        return a.len().cmp(&b.len()); // one is a prefix of the other
    };
    // The lead byte of the character holding byte `i`: the bytes before `i` are the same in both,
    // so that character starts at the same place in both.
    let mut start = i;
    while start > 0 && a[start] & 0xC0 == 0x80 {
        start -= 1;
    }
    let supplementary = |lead: u8| lead >= 0xF0;
    let high_bmp = |lead: u8| lead == 0xEE || lead == 0xEF;
    let (x, y) = (a[start], b[start]);
    if supplementary(x) && high_bmp(y) {
        std::cmp::Ordering::Less
    } else if high_bmp(x) && supplementary(y) {
        std::cmp::Ordering::Greater
    } else {
        a[i].cmp(&b[i])
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

    /// Characters from every range the order treats apart: ASCII, two- and three-byte ones below
    /// U+E000, U+E000..=U+FFFF, and above U+FFFF.
    fn key_char() -> impl proptest::strategy::Strategy<Value = char> {
        proptest::prop_oneof![
            proptest::char::range('a', 'c'),
            proptest::char::range('\u{7F}', '\u{81}'),
            proptest::char::range('\u{D7FE}', '\u{D7FF}'),
            proptest::char::range('\u{E000}', '\u{E001}'),
            proptest::char::range('\u{FFFE}', '\u{FFFF}'),
            proptest::char::range('\u{10000}', '\u{10001}'),
            proptest::char::range('\u{1F600}', '\u{1F601}'),
        ]
    }

    proptest::proptest! {
        /// The byte-wise comparison orders keys as their UTF-16 code units do.
        #[test]
        fn utf16_order_matches_the_code_units(
            a in proptest::collection::vec(key_char(), 0..5),
            b in proptest::collection::vec(key_char(), 0..5),
        ) {
            let (a, b): (String, String) = (a.into_iter().collect(), b.into_iter().collect());
            proptest::prop_assert_eq!(
                utf16_cmp(a.as_bytes(), b.as_bytes()),
                a.encode_utf16().cmp(b.encode_utf16())
            );
        }
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

    /// Canonicalises `input` and returns the bytes it copied again after writing them once.
    fn moved(input: &[u8]) -> usize {
        MOVED.with(|m| m.set(0));
        assert!(canonicalize(input).is_some());
        MOVED.with(|m| m.get())
    }

    #[test]
    fn work_is_linear_in_the_input_whatever_the_nesting() {
        // 100 nested objects, each with its members out of order, around about 10 KB: every object
        // must be reordered, but no byte may be copied again for each object around it.
        let large = format!("\"{}\"", "x".repeat(10_000));
        let small = format!("[{}]", vec![r#"{"b":[1,2],"a":"xyz"}"#; 500].join(","));
        for payload in [large, small] {
            let doc = "{\"z\":0,\"a\":".repeat(100) + &payload + &"}".repeat(100);
            let moved = moved(doc.as_bytes());
            assert!(
                moved <= 3 * doc.len(),
                "{moved} bytes moved for {}",
                doc.len()
            );
        }
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
