#![no_main]
//! The canonicaliser never panics or overflows its stack, and its output is a fixed point: the
//! canonical form of a canonical form is itself.

use axum_idempotency::Fingerprint;
use axum_idempotency::fingerprint::canonicalize;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(canonical) = canonicalize(data) {
        assert_eq!(
            canonicalize(&canonical).as_deref(),
            Some(canonical.as_slice())
        );
        assert_eq!(
            Fingerprint::of(None, data),
            Fingerprint::of(None, &canonical)
        );
    }
});
