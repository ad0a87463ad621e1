//! Lower-case hexadecimal, for digests in logs, Redis key names and derived keys.

const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Appends `bytes` to `out` in lower-case hex.
pub(crate) fn push(out: &mut String, bytes: &[u8]) {
    out.reserve(bytes.len() * 2);
    for b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 15)]));
    }
}

/// `bytes` in lower-case hex.
pub(crate) fn encode(bytes: &[u8]) -> String {
    let mut out = String::new();
    push(&mut out, bytes);
    out
}

/// The two hex digits of `b`, for writers that escape one byte at a time.
pub(crate) fn digits(b: u8) -> [u8; 2] {
    [DIGITS[usize::from(b >> 4)], DIGITS[usize::from(b & 15)]]
}

/// Writes `bytes` in lower-case hex to a formatter.
pub(crate) fn write(f: &mut impl std::fmt::Write, bytes: &[u8]) -> std::fmt::Result {
    for b in bytes {
        let [hi, lo] = digits(*b);
        f.write_char(char::from(hi))?;
        f.write_char(char::from(lo))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn hex_is_lower_case_two_digits_a_byte() {
        assert_eq!(super::encode(&[0x00, 0x0f, 0xa5, 0xff]), "000fa5ff");
        let mut s = String::from("p:");
        super::push(&mut s, &[0xab]);
        assert_eq!(s, "p:ab");
        let mut w = String::new();
        super::write(&mut w, &[1, 2]).expect("write");
        assert_eq!(w, "0102");
    }
}
