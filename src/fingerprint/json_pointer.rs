//! JSON pointers (RFC 6901) naming fields left out of a fingerprint, and the pass that leaves them
//! out of a canonical document.

use std::fmt;

/// A parsed JSON pointer: its reference tokens, unescaped (`~1` is `/`, `~0` is `~`).
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct Pointer(Vec<String>);

impl fmt::Debug for Pointer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for token in &self.0 {
            write!(f, "/{}", token.replace('~', "~0").replace('/', "~1"))?;
        }
        Ok(())
    }
}

impl Pointer {
    /// Its reference tokens, unescaped.
    pub(crate) fn tokens(&self) -> &[String] {
        &self.0
    }

    /// Parses `/a/b~1c`; refuses the empty pointer (the whole document) and bad escapes.
    pub(crate) fn parse(text: &str) -> Result<Pointer, String> {
        let Some(rest) = text.strip_prefix('/') else {
            return Err(format!(
                "{text:?} is not a JSON pointer to a field: it must start with '/'"
            ));
        };
        let mut tokens = Vec::new();
        for raw in rest.split('/') {
            let mut token = String::with_capacity(raw.len());
            let mut chars = raw.chars();
            while let Some(c) = chars.next() {
                match c {
                    '~' => match chars.next() {
                        Some('0') => token.push('~'),
                        Some('1') => token.push('/'),
                        _ => {
                            return Err(format!(
                                "{text:?} is not a JSON pointer: '~' must be followed by 0 or 1"
                            ));
                        }
                    },
                    c => token.push(c),
                }
            }
            tokens.push(token);
        }
        Ok(Pointer(tokens))
    }
}

/// `doc` (canonical JSON, as [`canonicalize`](crate::canonicalize) writes it) without the members
/// and array elements that `pointers` name. `None` if `doc` is not compact JSON (it always is when
/// it comes from the canonicaliser); the caller then keeps the whole document.
pub(crate) fn without(doc: &[u8], pointers: &[Pointer]) -> Option<Vec<u8>> {
    let active: Vec<&[String]> = pointers.iter().map(|p| &p.0[..]).collect();
    let mut out = Vec::with_capacity(doc.len());
    let mut pos = 0;
    value(doc, &mut pos, &active, &mut out)?;
    (pos == doc.len()).then_some(out)
}

/// Copies the value at `pos`, leaving out what `active` (the pointers' remaining tokens, none
/// empty) names inside it.
fn value(doc: &[u8], pos: &mut usize, active: &[&[String]], out: &mut Vec<u8>) -> Option<()> {
    let start = *pos;
    let open = *doc.get(start)?;
    if active.is_empty() || (open != b'{' && open != b'[') {
        skip(doc, pos)?;
        out.extend_from_slice(&doc[start..*pos]);
        return Some(());
    }
    let close = if open == b'{' { b'}' } else { b']' };
    out.push(open);
    *pos += 1;
    if *doc.get(*pos)? == close {
        *pos += 1;
        out.push(close);
        return Some(());
    }
    let mut written = 0;
    let mut index = 0usize;
    loop {
        let member = *pos;
        let child: Vec<&[String]> = if open == b'{' {
            skip_string(doc, pos)?;
            let key = &doc[member..*pos];
            if *doc.get(*pos)? != b':' {
                return None;
            }
            *pos += 1;
            active
                .iter()
                .filter(|p| names_key(&p[0], key))
                .map(|p| &p[1..])
                .collect()
        } else {
            let token = index.to_string();
            index += 1;
            active
                .iter()
                .filter(|p| p[0] == token)
                .map(|p| &p[1..])
                .collect()
        };
        if child.iter().any(|rest| rest.is_empty()) {
            skip(doc, pos)?;
        } else {
            if written > 0 {
                out.push(b',');
            }
            written += 1;
            out.extend_from_slice(&doc[member..*pos]);
            value(doc, pos, &child, out)?;
        }
        match *doc.get(*pos)? {
            b',' => *pos += 1,
            c if c == close => {
                *pos += 1;
                out.push(close);
                return Some(());
            }
            _ => return None,
        }
    }
}

/// Whether the JSON string `key` (quotes and escapes included) is `token`.
fn names_key(token: &str, key: &[u8]) -> bool {
    let inner = &key[1..key.len() - 1];
    if !inner.contains(&b'\\') {
        return inner == token.as_bytes();
    }
    serde_json::from_slice::<String>(key).is_ok_and(|k| k == token)
}

/// Moves `pos` past the string that starts there.
fn skip_string(doc: &[u8], pos: &mut usize) -> Option<()> {
    if *doc.get(*pos)? != b'"' {
        return None;
    }
    let mut i = *pos + 1;
    loop {
        match *doc.get(i)? {
            b'"' => {
                *pos = i + 1;
                return Some(());
            }
            b'\\' => i += 2,
            _ => i += 1,
        }
    }
}

/// Moves `pos` past the value that starts there.
fn skip(doc: &[u8], pos: &mut usize) -> Option<()> {
    match *doc.get(*pos)? {
        b'"' => skip_string(doc, pos),
        b'{' | b'[' => {
            let mut depth = 0usize;
            loop {
                match *doc.get(*pos)? {
                    b'"' => {
                        skip_string(doc, pos)?;
                        continue;
                    }
                    b'{' | b'[' => depth += 1,
                    b'}' | b']' => {
                        depth -= 1;
                        if depth == 0 {
                            *pos += 1;
                            return Some(());
                        }
                    }
                    _ => {}
                }
                *pos += 1;
            }
        }
        _ => {
            while let Some(c) = doc.get(*pos) {
                if matches!(c, b',' | b']' | b'}') {
                    break;
                }
                *pos += 1;
            }
            Some(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strip(doc: &str, pointers: &[&str]) -> String {
        let pointers: Vec<Pointer> = pointers
            .iter()
            .map(|p| Pointer::parse(p).expect("pointer"))
            .collect();
        let canonical = crate::fingerprint::canonicalize(doc.as_bytes()).expect("json");
        String::from_utf8(without(&canonical, &pointers).expect("compact")).expect("utf-8")
    }

    #[test]
    fn leaves_out_named_members_at_any_depth() {
        let doc = r#"{"amount":5,"client_timestamp":"t","metadata":{"request_id":"r","note":"n"}}"#;
        assert_eq!(
            strip(doc, &["/client_timestamp", "/metadata/request_id"]),
            r#"{"amount":5,"metadata":{"note":"n"}}"#
        );
        assert_eq!(
            strip(doc, &["/metadata"]),
            r#"{"amount":5,"client_timestamp":"t"}"#
        );
        assert_eq!(
            strip(doc, &["/absent", "/amount/x"]),
            crate::fingerprint::canonicalize(doc.as_bytes())
                .map(|c| String::from_utf8(c).expect("utf-8"))
                .expect("json")
        );
        assert_eq!(strip(r#"{"a":1}"#, &["/a"]), "{}");
    }

    #[test]
    fn array_elements_and_escaped_keys() {
        assert_eq!(
            strip(
                r#"{"items":[{"ts":1,"sku":"x"},{"ts":2,"sku":"y"}]}"#,
                &["/items/1/ts"]
            ),
            r#"{"items":[{"sku":"x","ts":1},{"sku":"y"}]}"#
        );
        assert_eq!(strip(r#"[1,2,3]"#, &["/0", "/2"]), "[2]");
        assert_eq!(
            strip(r#"{"a/b":1,"c~d":2,"e":3}"#, &["/a~1b", "/c~0d"]),
            r#"{"e":3}"#
        );
        assert_eq!(strip(r#"{"\n":1,"e":"x\"y"}"#, &["/\n"]), r#"{"e":"x\"y"}"#);
    }

    #[test]
    fn pointers_are_checked() {
        assert!(Pointer::parse("").is_err());
        assert!(Pointer::parse("a").is_err());
        assert!(Pointer::parse("/a~2").is_err());
        assert!(Pointer::parse("/a~").is_err());
        assert_eq!(
            format!("{:?}", Pointer::parse("/a~1b/~0").expect("ok")),
            "/a~1b/~0"
        );
    }
}
