//! Fingerprint throughput: canonical JSON + SHA-256 against the baseline of parsing the same JSON
//! (serde_json, into a `Value`, and the stricter validate-only `IgnoredAny`) plus SHA-256 of the raw
//! bytes. The canonical fingerprint is also measured on the same orders with every object's members
//! written in reverse order (so every object must be sorted), and on deeply nested unsorted objects.
//!
//! `cargo bench --bench fingerprint`

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use sha2::{Digest, Sha256};
use std::hint::black_box;

use axum_idempotency::Fingerprint;
use axum_idempotency::fingerprint::canonicalize;

/// A JSON order document of about `size` bytes: nested objects, arrays of objects, strings with
/// escapes, integers and decimals. serde_json writes object members sorted by key.
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

/// Writes `value` compactly with every object's members in reverse key order.
fn write_reversed(value: &serde_json::Value, out: &mut Vec<u8>) {
    match value {
        serde_json::Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_reversed(item, out);
            }
            out.push(b']');
        }
        serde_json::Value::Object(members) => {
            out.push(b'{');
            for (i, (key, member)) in members.iter().rev().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                serde_json::to_writer(&mut *out, key).expect("serialise");
                out.push(b':');
                write_reversed(member, out);
            }
            out.push(b'}');
        }
        leaf => serde_json::to_writer(out, leaf).expect("serialise"),
    }
}

/// The order document of about `size` bytes with every object's members out of order.
fn unsorted_order_json(size: usize) -> Vec<u8> {
    let doc: serde_json::Value = serde_json::from_slice(&order_json(size)).expect("json");
    let mut out = Vec::new();
    write_reversed(&doc, &mut out);
    out
}

/// `depth` nested objects, each with its members out of order, around a string of `payload` bytes.
fn deep_unsorted_json(depth: usize, payload: usize) -> Vec<u8> {
    let mut doc = "{\"z\":0,\"a\":".repeat(depth).into_bytes();
    doc.push(b'"');
    doc.extend(std::iter::repeat_n(b'x', payload));
    doc.push(b'"');
    doc.extend(std::iter::repeat_n(b'}', depth));
    doc
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
    for (label, size) in [("1KiB", 1 << 10), ("64KiB", 64 << 10)] {
        let doc = unsorted_order_json(size);
        assert_ne!(
            canonicalize(&doc).as_deref(),
            Some(&doc[..]),
            "not sorted already"
        );
        group.throughput(Throughput::Bytes(doc.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("canonical_fingerprint_unsorted", label),
            &doc,
            |b, doc| b.iter(|| black_box(Fingerprint::of(None, black_box(doc)))),
        );
    }
    let deep = deep_unsorted_json(100, 10 << 10);
    assert!(canonicalize(&deep).is_some(), "within MAX_DEPTH");
    group.throughput(Throughput::Bytes(deep.len() as u64));
    group.bench_with_input(
        BenchmarkId::new("canonical_fingerprint_deep_unsorted", "depth100_10KiB"),
        &deep,
        |b, doc| b.iter(|| black_box(Fingerprint::of(None, black_box(doc)))),
    );
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
