//! Fingerprint throughput: canonical JSON + SHA-256 against the baseline of parsing the same JSON
//! (serde_json, into a `Value`, and the stricter validate-only `IgnoredAny`) plus SHA-256 of the raw
//! bytes.
//!
//! `cargo bench --bench fingerprint`

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use sha2::{Digest, Sha256};
use std::hint::black_box;

use axum_idempotency::Fingerprint;

/// A JSON order document of about `size` bytes: nested objects with unsorted keys, arrays of
/// objects, strings with escapes, integers and decimals.
fn order_json(size: usize) -> Vec<u8> {
    let mut items = Vec::new();
    let mut i = 0;
    loop {
        items.push(serde_json::json!({
            "sku": format!("SKU-{i:06}"),
            "qty": i % 7 + 1,
            "price": {"currency": "EUR", "amount": 1999 + i, "tax": 0.21},
            "name": format!("Item \"{i}\" \u{e9}t\u{e9}\n"),
            "attributes": {"z": true, "colour": "blue", "a": null, "sizes": [38, 40, 42]},
        }));
        i += 1;
        let doc = serde_json::json!({
            "order_id": "ord_7f3a9c",
            "customer": {"id": 42, "email": "alice@example.com", "address": {"zip": "75001", "city": "Paris"}},
            "items": items,
            "total": 123456,
        });
        let bytes = serde_json::to_vec_pretty(&doc).expect("serialise");
        if bytes.len() >= size {
            return bytes;
        }
    }
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("fingerprint");
    for (label, size) in [("1KiB", 1 << 10), ("64KiB", 64 << 10), ("1MiB", 1 << 20)] {
        let doc = order_json(size);
        group.throughput(Throughput::Bytes(doc.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("baseline_parse_plus_sha256", label),
            &doc,
            |b, doc| {
                b.iter(|| {
                    let value: serde_json::Value =
                        serde_json::from_slice(black_box(doc)).expect("json");
                    black_box(value);
                    black_box(Sha256::digest(doc))
                })
            },
        );
        group.bench_with_input(
            BenchmarkId::new("baseline_validate_plus_sha256", label),
            &doc,
            |b, doc| {
                b.iter(|| {
                    let parsed: serde::de::IgnoredAny =
                        serde_json::from_slice(black_box(doc)).expect("json");
                    black_box(parsed);
                    black_box(Sha256::digest(doc))
                })
            },
        );
        group.bench_with_input(BenchmarkId::new("sha256_only", label), &doc, |b, doc| {
            b.iter(|| black_box(Sha256::digest(black_box(doc))))
        });
        group.bench_with_input(
            BenchmarkId::new("canonical_fingerprint", label),
            &doc,
            |b, doc| b.iter(|| black_box(Fingerprint::of(None, black_box(doc)))),
        );
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
