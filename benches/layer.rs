//! The layer's own cost per request, without HTTP or sockets: the same Axum router with and without
//! the layer (memory store), driven in-process with `oneshot`, 1 KiB JSON bodies.
//!
//! `cargo bench --bench layer`

#[path = "support/in_process.rs"]
mod in_process;
mod support;

use in_process::{call, request};
use std::sync::atomic::{AtomicU64, Ordering};
use support::{created, json_1k};

use axum::Router;
use axum::routing::post;
use axum_idempotency::{IdempotencyLayer, MemoryStore};
use criterion::{Criterion, criterion_group, criterion_main};

fn bench(c: &mut Criterion) {
    // One thread drives everything, as a server's worker does: the handler task the layer spawns
    // runs on the same thread, with no cross-thread wake-up.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let body = json_1k();
    let bare = Router::new().route("/checkout", post(created));
    let guarded = Router::new()
        .route("/checkout", post(created))
        .route_layer(IdempotencyLayer::new(MemoryStore::new()).expect("valid settings"));
    let n = AtomicU64::new(0);
    let mut group = c.benchmark_group("layer_per_request");
    group.bench_function("bare_route", |b| {
        b.iter(|| runtime.block_on(call(&bare, request("k", &body))))
    });
    group.bench_function("layer_fresh_key", |b| {
        b.iter(|| {
            let key = format!("fresh-{}", n.fetch_add(1, Ordering::Relaxed));
            runtime.block_on(call(&guarded, request(&key, &body)))
        })
    });
    runtime.block_on(call(&guarded, request("replayed", &body)));
    group.bench_function("layer_replay", |b| {
        b.iter(|| runtime.block_on(call(&guarded, request("replayed", &body))))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
