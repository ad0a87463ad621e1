//! Instructions per request, for valgrind's callgrind, which counts them the same on every run
//! whatever else the machine does: the same router as `benches/layer.rs` (in-process, `oneshot`,
//! 1 KiB JSON body), bare or behind the layer with the memory store, fresh keys or replays.
//!
//! ```sh
//! cargo bench --bench instructions --no-run     # prints the binary's path
//! valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.%p <binary> <bare|fresh|replay> <requests>
//! ```
//!
//! With `LOAD_BODY=small` the body is the 150-byte order of the load harness instead.
//!
//! The harness runs `requests` requests after 200 warm-up ones, between two calls of
//! `measured_start` and `measured_end`, so `callgrind_annotate` can attribute the cost, and
//! instructions per request are (total at N2 − total at N1) / (N2 − N1), which cancels start-up.
//! Without arguments (as `cargo bench` runs it) it runs each mode for 1 000 requests and exits.

#[path = "support/in_process.rs"]
mod in_process;
mod support;

use in_process::{call, request};
use support::{body_from_env, created};

use axum::Router;
use axum::routing::post;
use axum_idempotency::{IdempotencyLayer, MemoryStore};

#[inline(never)]
fn measured_start() {
    std::hint::black_box(());
}

#[inline(never)]
fn measured_end() {
    std::hint::black_box(());
}

fn run(mode: &str, requests: usize) {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let body = body_from_env();
    let router = match mode {
        "bare" => Router::new().route("/checkout", post(created)),
        "fresh" | "replay" => Router::new()
            .route("/checkout", post(created))
            .route_layer(IdempotencyLayer::new(MemoryStore::new()).expect("valid settings")),
        other => panic!("unknown mode {other}: bare, fresh or replay"),
    };
    let key = |i: usize| match mode {
        "fresh" => format!("fresh-{i}"),
        _ => "replayed".to_owned(),
    };
    runtime.block_on(async {
        for i in 0..200 {
            call(&router, request(&key(1_000_000 + i), &body)).await;
        }
        // Keys are made before the measured part, so that it counts only the requests.
        let keys: Vec<String> = (0..requests).map(key).collect();
        measured_start();
        for k in &keys {
            call(&router, request(k, &body)).await;
        }
        measured_end();
    });
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.as_slice() {
        [mode, n] if !mode.starts_with('-') => run(mode, n.parse().expect("a request count")),
        _ => {
            for mode in ["bare", "fresh", "replay"] {
                run(mode, 1_000);
            }
        }
    }
}
