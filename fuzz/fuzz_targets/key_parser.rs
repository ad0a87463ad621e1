#![no_main]
//! The key parser never panics, and what it accepts is a valid key: 1 to 255 characters from 0x20 to
//! 0x7E with no leading or trailing space, parsed again to itself.

use axum_idempotency::layer::key;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(k) = key::parse(data) {
        assert!(!k.is_empty() && k.len() <= 255);
        assert!(k.bytes().all(|b| (0x20..=0x7E).contains(&b)));
        assert!(!k.starts_with(' ') && !k.ends_with(' '));
        if !k.starts_with('"') {
            assert_eq!(key::parse(k.as_bytes()).as_deref(), Ok(k.as_str()));
        }
    }
});
