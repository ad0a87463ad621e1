//! Run once outside HTTP: two consumers read one stream of order messages, delivered at least once
//! (every message two or three times, to either consumer, often to both at the same moment), and
//! each message charges once.
//!
//! ```text
//! cargo run --example consumer
//! ```
//! Prints `{"messages":N,"deliveries":M,"charges":N,"double_charges":0}`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum_idempotency::MemoryStore;
use axum_idempotency::once::{OnceError, RunOnce};
use axum_idempotency::store::RecordKey;
use serde_json::json;
use tokio::sync::mpsc;

const MESSAGES: u64 = 40;
const CONSUMERS: usize = 2;

/// One message of the stream: the order to charge.
#[derive(Clone, Copy)]
struct Order {
    id: u64,
    amount: u64,
}

/// The effect that must happen once per message: charges counted per order.
type Ledger = Arc<Mutex<HashMap<u64, u32>>>;

#[tokio::main]
async fn main() {
    let once = RunOnce::new(MemoryStore::new()).expect("valid settings");
    let ledger = Ledger::default();
    // The stream: each message delivered two or three times in a row (to whichever consumer takes
    // it, so often to both at once), and every fifth once more later (a late redelivery).
    let (stream, deliveries) = mpsc::unbounded_channel();
    let mut sent = 0;
    for id in 0..MESSAGES {
        let order = Order {
            id,
            amount: 100 + id,
        };
        for _ in 0..(2 + id % 2) {
            stream.send(order).expect("stream open");
            sent += 1;
        }
    }
    for id in (0..MESSAGES).step_by(5) {
        stream
            .send(Order {
                id,
                amount: 100 + id,
            })
            .expect("stream open");
        sent += 1;
    }
    drop(stream);
    let deliveries = Arc::new(tokio::sync::Mutex::new(deliveries));

    let mut consumers = tokio::task::JoinSet::new();
    for _ in 0..CONSUMERS {
        let (once, ledger, deliveries) = (once.clone(), ledger.clone(), deliveries.clone());
        consumers.spawn(async move {
            loop {
                let Some(order) = deliveries.lock().await.recv().await else {
                    return;
                };
                // Until the message is settled: in a real queue, a nack and a later redelivery.
                while let Err(e) = consume(&once, &ledger, &order).await {
                    match e {
                        OnceError::InProgress => tokio::time::sleep(Duration::from_millis(5)).await,
                        other => panic!("message {}: {other}", order.id),
                    }
                }
            }
        });
    }
    while let Some(done) = consumers.join_next().await {
        done.expect("consumer");
    }

    let ledger = ledger.lock().expect("ledger");
    let charges: u32 = ledger.values().sum();
    let double: u32 = ledger.values().map(|n| n.saturating_sub(1)).sum();
    let summary = json!({
        "messages": MESSAGES,
        "deliveries": sent,
        "charges": charges,
        "double_charges": double,
    });
    println!("{summary}");
}

/// Processes one delivery: the charge runs once per message id, whichever consumer gets it.
async fn consume(
    once: &RunOnce<MemoryStore>,
    ledger: &Ledger,
    order: &Order,
) -> Result<String, OnceError<std::convert::Infallible>> {
    let scope = RecordKey {
        key: order.id.to_string(),
        subject: "consumer".into(),
        endpoint: "queue orders".into(),
    };
    let (ledger, id) = (ledger.clone(), order.id);
    // The message's content is its fingerprint: a redelivery with another amount is refused.
    let input = json!({ "id": order.id, "amount": order.amount });
    once.run_json(scope, &input, move |ctx| async move {
        // A slow charge, so that duplicates arrive while it runs.
        tokio::time::sleep(Duration::from_millis(3)).await;
        *ledger.lock().expect("ledger").entry(id).or_default() += 1;
        // The receipt names the charge by the derived key, by which a provider would deduplicate.
        Ok(format!("charge {}", &ctx.derived_key()[..16]))
    })
    .await
}
