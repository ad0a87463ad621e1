//! The batcher against a store whose statements fail, stall and lose their requesters at random:
//! every request gets exactly its own answer, or leaves, and every answer a statement gave goes to
//! its requester or to `orphaned`, never both, never lost, never another's.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use proptest::prelude::*;

use super::{Batcher, Fate, Forced, IN_FLIGHT, MAX_ROWS, Rows};
use crate::util::lock::lock;

/// One request: its number (its identity), the scope its row names, and what befalls it.
#[derive(Debug, Clone)]
struct Request {
    id: u64,
    scope: [u8; 32],
    /// Its row's statement fails when sent alone.
    fails_alone: bool,
    /// Any batch holding its row fails (as a row's error fails its whole statement).
    fails_batch: bool,
    /// A batch holding its row answers it "alone" (as a claim that met a row inserted since the
    /// statement's snapshot).
    alone_in_batch: bool,
    /// The request leaves after this long, if set.
    leaves_after: Option<Duration>,
    /// How long after the start it is sent.
    starts_after: Duration,
}

/// What the fake database saw.
#[derive(Default)]
struct Seen {
    /// Every answer a statement produced: the request it was produced for.
    produced: Vec<u64>,
    /// Answers handed to `orphaned`.
    orphaned: Vec<u64>,
    /// Rows per `many` call.
    batches: Vec<usize>,
    /// A `many` call with two rows of one scope, or more than `MAX_ROWS`.
    bad_batches: usize,
    /// Statements in flight at once (alone and batched), and the most seen.
    in_flight: usize,
    most_in_flight: usize,
}

#[derive(Clone)]
struct Fake {
    seen: Arc<Mutex<Seen>>,
    /// Delay of each statement, from a counter (a varying, repeatable stall).
    delays: Arc<AtomicU64>,
}

impl Fake {
    fn new() -> Self {
        Fake {
            seen: Arc::default(),
            delays: Arc::default(),
        }
    }

    async fn stall(&self) {
        let n = self.delays.fetch_add(1, Ordering::Relaxed);
        {
            let mut seen = lock(&self.seen);
            seen.in_flight += 1;
            seen.most_in_flight = seen.most_in_flight.max(seen.in_flight);
        }
        // Counted out however the statement ends (its request may drop it mid-way).
        let _landed = Landed(self);
        tokio::time::sleep(Duration::from_micros(200 + (n * 7919) % 1500)).await;
    }
}

struct Landed<'a>(&'a Fake);

impl Drop for Landed<'_> {
    fn drop(&mut self) {
        lock(&self.0.seen).in_flight -= 1;
    }
}

/// A row's answer: the request it was produced for, or an error naming it.
type Answer = Result<u64, u64>;

struct Kind;

impl Rows for Kind {
    type Store = Fake;
    type Item = Request;
    type Answer = Answer;

    fn scope(item: &Request) -> &[u8; 32] {
        &item.scope
    }

    async fn one(store: &Fake, item: &Request) -> Answer {
        store.stall().await;
        lock(&store.seen).produced.push(item.id);
        if item.fails_alone {
            Err(item.id)
        } else {
            Ok(item.id)
        }
    }

    async fn many(store: &Fake, items: &[&Request]) -> Option<Vec<Option<Answer>>> {
        {
            let mut seen = lock(&store.seen);
            seen.batches.push(items.len());
            let scopes: HashSet<[u8; 32]> = items.iter().map(|item| item.scope).collect();
            if scopes.len() != items.len() || items.len() > MAX_ROWS {
                seen.bad_batches += 1;
            }
        }
        store.stall().await;
        if items.iter().any(|item| item.fails_batch) {
            return None;
        }
        let mut seen = lock(&store.seen);
        seen.produced.extend(
            items
                .iter()
                .filter(|item| !item.alone_in_batch)
                .map(|item| item.id),
        );
        Some(
            items
                .iter()
                .map(|item| (!item.alone_in_batch).then_some(Ok(item.id)))
                .collect(),
        )
    }

    async fn orphaned(store: Fake, item: Request, answer: Answer) {
        assert_eq!(
            answer.unwrap_or_else(|id| id),
            item.id,
            "an orphaned answer is its own row's"
        );
        lock(&store.seen).orphaned.push(item.id);
    }
}

/// Runs `requests` through one batcher at once, on two worker threads, and checks every property.
fn check(requests: Vec<Request>, forced: Option<Forced>) -> Result<(), TestCaseError> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .expect("runtime");
    runtime.block_on(async move {
        let fake = Fake::new();
        let batcher = Arc::new(Batcher::<Kind>::new(forced));
        let mut tasks = Vec::new();
        for request in requests.iter().cloned() {
            let (fake, batcher) = (fake.clone(), batcher.clone());
            tasks.push(tokio::spawn(async move {
                tokio::time::sleep(request.starts_after).await;
                let leave = request.leaves_after.unwrap_or(Duration::from_secs(3600));
                let sent = batcher.send(
                    &fake,
                    Kind::one(&fake, &request),
                    || request.clone(),
                    Duration::from_secs(30),
                );
                tokio::select! {
                    answer = sent => Some(answer),
                    () = tokio::time::sleep(leave) => None,
                }
            }));
        }
        let mut delivered: HashMap<u64, Answer> = HashMap::new();
        for (request, task) in requests.iter().zip(tasks) {
            match task.await.expect("request task") {
                Some(answer) => {
                    let Fate::Answer(answer) = answer else {
                        return Err(TestCaseError::fail(format!(
                            "request {} got no answer within its bound: {answer:?}",
                            request.id
                        )));
                    };
                    let own = answer.unwrap_or_else(|id| id);
                    prop_assert_eq!(own, request.id, "a request got another's answer");
                    prop_assert!(
                        answer.is_ok() || request.fails_alone,
                        "an error came only from the row's own statement"
                    );
                    delivered.insert(request.id, answer);
                }
                None => prop_assert!(request.leaves_after.is_some(), "only leavers leave"),
            }
        }
        // Orphans are handed over by tasks of their own: let them land, and the runner end.
        for _ in 0..200 {
            if batcher.queued() == 0 && lock(&batcher.state).in_flight == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        let seen = lock(&fake.seen);
        prop_assert_eq!(
            seen.bad_batches,
            0,
            "a batch held a scope twice or too many rows"
        );
        prop_assert!(lock(&batcher.state).in_flight == 0, "the batcher went idle");
        prop_assert_eq!(batcher.queued(), 0);
        // Bounded: each place in flight sends one statement, or its batch's rows one by one.
        prop_assert!(seen.most_in_flight <= MAX_ROWS * IN_FLIGHT);
        let mut produced = seen.produced.clone();
        produced.sort_unstable();
        let before = produced.len();
        produced.dedup();
        prop_assert_eq!(before, produced.len(), "a row was answered twice");
        let orphaned: HashSet<u64> = seen.orphaned.iter().copied().collect();
        prop_assert_eq!(
            orphaned.len(),
            seen.orphaned.len(),
            "an orphan handed over twice"
        );
        for id in &produced {
            let to_requester = delivered.contains_key(id);
            prop_assert!(
                to_requester != orphaned.contains(id),
                "request {}'s answer went to its requester {} and to orphaned {}",
                id,
                to_requester,
                orphaned.contains(id)
            );
        }
        for id in delivered.keys() {
            prop_assert!(
                produced.binary_search(id).is_ok(),
                "an answer never produced"
            );
        }
        if let Some(forced) = forced {
            prop_assert!(
                seen.batches
                    .iter()
                    .all(|rows| *rows <= forced.rows.max(MAX_ROWS))
            );
        }
        Ok(())
    })
}

fn requests() -> impl Strategy<Value = Vec<Request>> {
    prop::collection::vec(
        (
            0u8..12,
            prop::bool::weighted(0.1),
            prop::bool::weighted(0.08),
            prop::bool::weighted(0.1),
            prop::option::weighted(0.25, 0u64..4000),
            0u64..6000,
        ),
        1..160,
    )
    .prop_map(|specs| {
        specs
            .into_iter()
            .enumerate()
            .map(
                |(id, (scope, fails_alone, fails_batch, alone_in_batch, leaves, starts))| Request {
                    id: id as u64,
                    scope: [scope; 32],
                    fails_alone,
                    fails_batch,
                    alone_in_batch,
                    leaves_after: leaves.map(Duration::from_micros),
                    starts_after: Duration::from_micros(starts),
                },
            )
            .collect()
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn every_request_gets_its_own_answer_or_leaves(requests in requests()) {
        check(requests, None)?;
    }

    #[test]
    fn every_request_gets_its_own_answer_with_batches_forced(requests in requests()) {
        check(requests, Some(Forced { rows: 8, hold: Duration::from_millis(2) }))?;
    }
}

/// Alone, a request goes through today's statement in its own future: no batch statement, no
/// task, no wait.
#[tokio::test]
async fn alone_sends_at_once_through_the_single_statement() {
    let fake = Fake::new();
    let batcher = Arc::new(Batcher::<Kind>::new(None));
    for id in 0..20 {
        let request = Request {
            id,
            scope: [id as u8; 32],
            fails_alone: false,
            fails_batch: false,
            alone_in_batch: false,
            leaves_after: None,
            starts_after: Duration::ZERO,
        };
        let answer = batcher
            .send(
                &fake,
                Kind::one(&fake, &request),
                || request.clone(),
                Duration::from_secs(5),
            )
            .await;
        assert_eq!(answer, Fate::Answer(Ok(id)));
    }
    let seen = lock(&fake.seen);
    assert!(
        seen.batches.is_empty(),
        "no batch statement: {:?}",
        seen.batches
    );
    assert_eq!(seen.produced.len(), 20);
}

/// What arrives while a statement is in flight goes in the next one, together: 40 requests at
/// once make one statement alone and then batches, far fewer statements than requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_queues_goes_together() {
    let fake = Fake::new();
    let batcher = Arc::new(Batcher::<Kind>::new(None));
    let tasks: Vec<_> = (0..40u64)
        .map(|id| {
            let (fake, batcher) = (fake.clone(), batcher.clone());
            tokio::spawn(async move {
                let request = Request {
                    id,
                    scope: [id as u8; 32],
                    fails_alone: false,
                    fails_batch: false,
                    alone_in_batch: false,
                    leaves_after: None,
                    starts_after: Duration::ZERO,
                };
                batcher
                    .send(
                        &fake,
                        Kind::one(&fake, &request),
                        || request.clone(),
                        Duration::from_secs(5),
                    )
                    .await
            })
        })
        .collect();
    for (id, task) in tasks.into_iter().enumerate() {
        assert_eq!(task.await.expect("task"), Fate::Answer(Ok(id as u64)));
    }
    let seen = lock(&fake.seen);
    let statements = seen.batches.len() + (40 - seen.batches.iter().sum::<usize>());
    assert!(
        !seen.batches.is_empty() && statements < 20,
        "40 requests at once took {statements} statements ({:?})",
        seen.batches
    );
}

/// A request whose wait runs out while it is queued gives up with no answer, and its row is
/// never sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_leaves_the_queue_is_never_sent() {
    let fake = Fake::new();
    let batcher = Arc::new(Batcher::<Kind>::new(None));
    let slow = |id: u64| Request {
        id,
        scope: [id as u8; 32],
        fails_alone: false,
        fails_batch: false,
        alone_in_batch: false,
        leaves_after: None,
        starts_after: Duration::ZERO,
    };
    // Requests alone hold every place in flight for 50 ms.
    let first: Vec<_> = (0..IN_FLIGHT as u64)
        .map(|id| {
            let (fake, batcher) = (fake.clone(), batcher.clone());
            tokio::spawn(async move {
                let request = slow(100 + id);
                batcher
                    .send(
                        &fake,
                        async {
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            Ok(100 + id)
                        },
                        || request.clone(),
                        Duration::from_secs(5),
                    )
                    .await
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(5)).await;
    let request = slow(1);
    let answer = batcher
        .send(
            &fake,
            Kind::one(&fake, &request),
            || request.clone(),
            Duration::from_millis(10),
        )
        .await;
    assert_eq!(answer, Fate::NotSent, "queued past its bound: never sent");
    for (id, first) in first.into_iter().enumerate() {
        assert_eq!(
            first.await.expect("task"),
            Fate::Answer(Ok(100 + id as u64))
        );
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let seen = lock(&fake.seen);
    assert!(
        seen.produced.is_empty(),
        "the row that left was sent: {:?}",
        seen.produced
    );
    assert!(lock(&batcher.state).in_flight == 0);
}

/// A runtime shut down while requests are in flight and queued (their tasks dropped, a runner
/// spawned as it shuts down never running) gives every place back: the batcher, shared with
/// another runtime, still sends.
#[test]
fn a_runtime_shut_down_mid_flight_leaves_the_batcher_usable() {
    let fake = Fake::new();
    let batcher = Arc::new(Batcher::<Kind>::new(None));
    let request = |id: u64| Request {
        id,
        scope: [id as u8; 32],
        fails_alone: false,
        fails_batch: false,
        alone_in_batch: false,
        leaves_after: None,
        starts_after: Duration::ZERO,
    };
    let first = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .expect("runtime");
    first.block_on(async {
        for id in 0..(IN_FLIGHT as u64 + 3) {
            let (fake, batcher) = (fake.clone(), batcher.clone());
            drop(tokio::spawn(async move {
                let request = request(id);
                batcher
                    .send(
                        &fake,
                        async {
                            tokio::time::sleep(Duration::from_secs(3600)).await;
                            Ok(id)
                        },
                        || request.clone(),
                        Duration::from_secs(3600),
                    )
                    .await
            }));
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(lock(&batcher.state).in_flight, IN_FLIGHT);
    });
    drop(first);
    assert_eq!(lock(&batcher.state).in_flight, 0, "every place given back");
    let second = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime");
    let answer = second.block_on(async {
        let request = request(50);
        batcher
            .send(
                &fake,
                Kind::one(&fake, &request),
                || request.clone(),
                Duration::from_secs(5),
            )
            .await
    });
    assert_eq!(answer, Fate::Answer(Ok(50)));
}
