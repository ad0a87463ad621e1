//! HMAC-SHA-256 (RFC 2104), for derived keys under a deployment secret and keyed fingerprints
//! under encryption: a few lines over `sha2` rather than another dependency.

use sha2::{Digest, Sha256};
use zeroize::Zeroize;

/// HMAC-SHA-256 (RFC 2104) of the concatenated `parts` under `key`.
pub(crate) fn hmac_sha256(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    let mut block = [0u8; 64];
    if key.len() > block.len() {
        block[..32].copy_from_slice(&Sha256::digest(key));
    } else {
        block[..key.len()].copy_from_slice(key);
    }
    // The padded key and its two masks are key material: wiped before returning (best effort:
    // the hash states they leave behind are not).
    let mut inner_pad = block.map(|b| b ^ 0x36);
    let mut outer_pad = block.map(|b| b ^ 0x5c);
    block.zeroize();
    let mut inner = Sha256::new();
    inner.update(inner_pad.as_slice());
    inner_pad.zeroize();
    for part in parts {
        inner.update(part);
    }
    let mut outer = Sha256::new();
    outer.update(outer_pad.as_slice());
    outer_pad.zeroize();
    outer.update(inner.finalize());
    outer.finalize().into()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc_4231() {
        // Test case 2 of RFC 4231.
        let mac = hmac_sha256(b"Jefe", &[b"what do ya ", b"want for nothing?"]);
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
        // A key longer than the block is hashed first (test case 6).
        let long = [0xaa_u8; 131];
        let mac = hmac_sha256(
            &long,
            &[b"Test Using Larger Than Block-Size Key - Hash Key First"],
        );
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
        );
    }
}
