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

/// The bytes of `hex` (digits in either case); `None` for an odd length or a character that is
/// not a hex digit.
#[cfg_attr(not(feature = "sqlite"), allow(dead_code))]
pub(crate) fn decode(hex: &str) -> Option<Vec<u8>> {
    let digit = |c: u8| char::from(c).to_digit(16).map(|d| d as u8);
    let bytes = hex.as_bytes();
    if !bytes.len().is_multiple_of(2) {
        return None;
    }
    bytes
        .chunks_exact(2)
        .map(|pair| Some(digit(pair[0])? << 4 | digit(pair[1])?))
        .collect()
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
    fn decoding_reads_what_encoding_wrote() {
        let bytes = [0x00, 0x0f, 0xa5, 0xff, 0x42];
        assert_eq!(super::decode(&super::encode(&bytes)), Some(bytes.to_vec()));
        assert_eq!(super::decode("A5ff"), Some(vec![0xa5, 0xff]));
        assert_eq!(super::decode(""), Some(vec![]));
        assert_eq!(super::decode("abc"), None, "odd length");
        assert_eq!(super::decode("zz"), None, "not hex");
        assert_eq!(super::decode("+1"), None, "a sign is not a digit");
    }

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
