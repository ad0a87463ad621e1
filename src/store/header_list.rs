//! Recorded headers as bytes, for the stores that keep a response as one blob (Redis) and for the
//! sealed envelope of [`EncryptedStore`](super::EncryptedStore): a count, then each name and value,
//! every part prefixed by its length (32-bit big-endian).

use http::{HeaderName, HeaderValue};

/// Appends `headers` to `out`; `None` (with `out` partly written) when a count or a length does
/// not fit in 32 bits.
pub(crate) fn write(headers: &[(HeaderName, HeaderValue)], out: &mut Vec<u8>) -> Option<()> {
    out.extend_from_slice(&u32::try_from(headers.len()).ok()?.to_be_bytes());
    for (name, value) in headers {
        for part in [name.as_str().as_bytes(), value.as_bytes()] {
            out.extend_from_slice(&u32::try_from(part.len()).ok()?.to_be_bytes());
            out.extend_from_slice(part);
        }
    }
    Some(())
}

/// The inverse of [`write`], from the start of `rest`, which is left at what follows; `None` when
/// the lengths do not add up. Invalid or denied headers are dropped, as from any store the layer
/// does not own.
pub(crate) fn read(rest: &mut &[u8]) -> Option<Vec<(HeaderName, HeaderValue)>> {
    let mut take = |n: usize| -> Option<&[u8]> {
        let (head, tail) = rest.split_at_checked(n)?;
        *rest = tail;
        Some(head)
    };
    let count = u32::from_be_bytes(take(4)?.try_into().ok()?);
    let mut headers = Vec::new();
    for _ in 0..count {
        let len = u32::from_be_bytes(take(4)?.try_into().ok()?) as usize;
        let name = take(len)?;
        let len = u32::from_be_bytes(take(4)?.try_into().ok()?) as usize;
        let value = take(len)?;
        if let (Ok(name), Ok(value)) =
            (HeaderName::from_bytes(name), HeaderValue::from_bytes(value))
        {
            headers.push((name, value));
        }
    }
    Some(headers)
}
