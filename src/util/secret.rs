//! Secret bytes held by the layer (the deployment secret of derived keys): wiped when the last
//! holder drops them, and never printed.

use std::fmt;

use zeroize::Zeroize;

/// Bytes of key material, overwritten with zeros when dropped.
pub(crate) struct Secret(Box<[u8]>);

impl Secret {
    /// A copy of `bytes`; the caller wipes its own copy if it must.
    pub(crate) fn new(bytes: &[u8]) -> Self {
        Secret(bytes.into())
    }

    /// The bytes.
    pub(crate) fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Secret {
    fn drop(&mut self) {
        self.0.zeroize();
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_never_printed() {
        let secret = Secret::new(b"production-secret-0001");
        assert_eq!(secret.bytes(), b"production-secret-0001");
        assert_eq!(format!("{secret:?}"), "Secret(22 bytes)");
    }
}
