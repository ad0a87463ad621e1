//! The layer on the Redis store over a Redis Cluster (`REDIS_CLUSTER_URLS`, comma-separated;
//! default the three local masters `.ci/run` starts on ports 7000 to 7002): the shared behavioural
//! suite, races included; records spread over more than one master; scripts flushed from every
//! master are sent again; an unreachable or stalled cluster, and one that answers only after the
//! store was made. Every test uses a key prefix of its own.
#![cfg(feature = "redis")]

use crate::common;
use axum_idempotency::store_suite;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum_idempotency::IdempotencyLayer;
use axum_idempotency::conformance::app::claim_request;
use axum_idempotency::store::{
    ClaimOutcome, ClaimRequest, Fenced, Finished, IdempotencyStore, LeaseToken, RedisStore,
    StoredResponse,
};
use common::proxy::{Mode, Proxy};
use common::{app, post, send};
use redis::aio::MultiplexedConnection;
use redis::cluster::ClusterClient;

fn cluster_urls() -> Vec<String> {
    common::servers::cluster_urls()
}

fn client() -> ClusterClient {
    ClusterClient::new(cluster_urls()).expect("REDIS_CLUSTER_URLS")
}

/// A key prefix no other test uses (and no hash tag: records spread over the slots).
fn prefix() -> String {
    static N: AtomicUsize = AtomicUsize::new(0);
    format!(
        "idem_test:cluster:{}:{}:{}:",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos(),
        N.fetch_add(1, Ordering::SeqCst)
    )
}

pub(crate) async fn store() -> RedisStore {
    RedisStore::cluster(client())
        .expect("store")
        .with_prefix(&prefix())
        .with_timeout(common::SUITE_STORE_TIMEOUT)
}

// Redis expires records itself: purge_expired has nothing left to delete.
store_suite!(store(), purged = 0);

#[tokio::test]
async fn a_finished_records_steps_count_in_its_subjects_bytes() {
    crate::redis_store::a_finished_records_steps_count_in_its_subjects_bytes(
        store().await,
        Some(false),
    )
    .await;
}

/// A server with one address that refuses a script's keys of two slots (`CROSSSLOT`, as a proxy in
/// front of a cluster answers; here a master of the cluster, reached as one server): the store runs
/// the claim's and the completion's scripts on the record alone, and they are granted and done; its
/// probe answers that this address does not hold every key.
#[tokio::test]
async fn one_address_refusing_keys_of_two_slots_gets_scripts_of_one_key() {
    let url = cluster_urls()[0].clone();
    let store = RedisStore::new(redis::Client::open(url).expect("url"))
        .expect("store")
        .with_prefix(&prefix())
        .with_timeout(Duration::from_secs(2));
    let answer = Arc::new(StoredResponse::new(
        Finished::Completed,
        201,
        Vec::new(),
        Some(b"paid".to_vec().into()),
    ));
    // Before any claim, the probe finds that this address does not hold every key (the master
    // answers its two keys `CROSSSLOT`).
    crate::redis_store::probed_together(&store, false).await;
    // One server's connection follows no `MOVED`: only a record in this master's slots can be
    // claimed through it, and about a third of them are.
    for n in 0..200 {
        let request = claim_request(&format!("k{n}"), b"{}");
        let Ok(outcome) = store.claim(&request).await else {
            continue;
        };
        let ClaimOutcome::Claimed { lease, .. } = outcome else {
            panic!("a fresh key is claimed: {outcome:?}");
        };
        let done = store
            .complete(
                &request.key,
                lease,
                &request.fingerprint,
                answer.clone(),
                request.retention,
            )
            .await
            .expect("complete");
        assert_eq!(done, Fenced::Done);
        let again = ClaimRequest {
            lease: LeaseToken::generate(),
            ..request.clone()
        };
        let ClaimOutcome::Finished(stored) = store.claim(&again).await.expect("claim") else {
            panic!("replayed");
        };
        assert_eq!(&stored.body[..], b"paid");
        return;
    }
    panic!("no claim was granted through one master's address");
}

/// A connection to one node on its own (not through the cluster client): `KEYS`, `INFO` and
/// `SCRIPT FLUSH` then concern that node only.
async fn node(address: &str) -> MultiplexedConnection {
    redis::Client::open(format!("redis://{address}"))
        .expect("node address")
        .get_multiplexed_async_connection()
        .await
        .expect("connect to a cluster node")
}

/// The addresses (`host:port`) of the masters that serve slots, from `CLUSTER NODES` as the first
/// node that answers sees it.
async fn masters() -> Vec<String> {
    for url in cluster_urls() {
        let Ok(client) = redis::Client::open(url.as_str()) else {
            continue;
        };
        let Ok(mut connection) = client.get_multiplexed_async_connection().await else {
            continue;
        };
        let nodes: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut connection)
            .await
            .expect("CLUSTER NODES");
        // <id> <ip:port@cport[,hostname]> <flags> <master> <ping> <pong> <epoch> <link> <slot>...
        let masters: Vec<String> = nodes
            .lines()
            .filter_map(|line| {
                let fields: Vec<&str> = line.split_whitespace().collect();
                let flags = *fields.get(2)?;
                let serves_slots = fields.len() > 8;
                (flags.split(',').any(|f| f == "master") && !flags.contains("fail") && serves_slots)
                    .then(|| fields[1].split('@').next().unwrap_or_default().to_owned())
            })
            .collect();
        assert!(!masters.is_empty(), "no master in CLUSTER NODES: {nodes}");
        return masters;
    }
    panic!(
        "no node of REDIS_CLUSTER_URLS answers: {:?}",
        cluster_urls()
    );
}

/// This prefix's record keys on one master (not the subjects' listing indexes, under
/// `<prefix>subject:`, nor their accounts of bytes, under `<prefix>bytes:`).
async fn records_on(master: &str, prefix: &str) -> Vec<String> {
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut node(master).await)
        .await
        .expect("KEYS");
    let (index, account) = (format!("{prefix}subject:"), format!("{prefix}bytes:"));
    keys.into_iter()
        .filter(|k| !k.starts_with(&index) && !k.starts_with(&account))
        .collect()
}

/// How many of this prefix's records each master holds, asking each master for its own keys.
async fn keys_per_master(prefix: &str) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for master in masters().await {
        let records = records_on(&master, prefix).await.len();
        counts.insert(master, records);
    }
    counts
}

/// How many entries each listing index under `prefix` holds, asking each master for its own.
async fn index_sizes(prefix: &str) -> Vec<i64> {
    let mut sizes = Vec::new();
    for master in masters().await {
        let on_master = crate::redis_store::index_sizes_on(&mut node(&master).await, prefix).await;
        sizes.extend(on_master);
    }
    sizes
}

#[tokio::test]
async fn the_index_of_a_subject_never_listed_stays_bounded_by_its_live_records() {
    let prefix = prefix();
    let store = RedisStore::cluster(client())
        .expect("store")
        .with_prefix(&prefix)
        .with_timeout(common::SUITE_STORE_TIMEOUT);
    crate::redis_store::churn_a_subject_never_listed(&store).await;
    crate::redis_store::assert_swept_and_live_records_listed(&store, index_sizes(&prefix).await)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn records_spread_over_more_than_one_master() {
    let prefix = prefix();
    let store = RedisStore::cluster(client())
        .expect("store")
        .with_prefix(&prefix);
    let (router, counters) = app(IdempotencyLayer::new(store).expect("valid settings"));
    // Different keys, subjects and routes: 48 records, each under a digest of its own scope.
    const RECORDS: usize = 48;
    for i in 0..RECORDS {
        let path = if i % 2 == 0 { "/pay" } else { "/other" };
        let answer = send(
            &router,
            post(path)
                .key(&format!("spread-{i}"))
                .user(&format!("user-{}", i % 5))
                .json("{}"),
        )
        .await;
        assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    }
    assert_eq!(counters.started(), RECORDS);
    let counts = keys_per_master(&prefix).await;
    assert_eq!(
        counts.values().sum::<usize>(),
        RECORDS,
        "every record is on exactly one master: {counts:?}"
    );
    let holding = counts.values().filter(|n| **n > 0).count();
    assert!(
        holding > 1,
        "the records all landed on one master: {counts:?}"
    );
    // Each record is one key, so its slot (hence its master) is the key's own.
    let mut any = node(counts.keys().next().expect("a master")).await;
    let mut slots = std::collections::BTreeSet::new();
    for master in counts.keys() {
        for key in records_on(master, &prefix).await {
            let slot: u16 = redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(&key)
                .query_async(&mut any)
                .await
                .expect("CLUSTER KEYSLOT");
            slots.insert(slot);
        }
    }
    assert!(slots.len() > 1, "one slot for every record: {slots:?}");
}

/// Calls of `EVAL` a node has answered so far (`INFO commandstats`).
async fn eval_calls(master: &str) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("commandstats")
        .query_async(&mut node(master).await)
        .await
        .expect("INFO commandstats");
    info.lines()
        .find_map(|line| line.strip_prefix("cmdstat_eval:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|calls| calls.parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scripts_flushed_from_every_master_are_sent_again() {
    let prefix = prefix();
    let store = RedisStore::cluster(client())
        .expect("store")
        .with_prefix(&prefix);
    let (router, counters) = app(IdempotencyLayer::new(store).expect("valid settings"));
    // The scripts are cached on the nodes by a first use.
    let answer = send(
        &router,
        post("/pay").key("warm-up").user("alice").json("{}"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");

    // As after a failover to a replica that never saw the scripts, or a restart: no master has
    // them any more.
    let masters = masters().await;
    let mut evals_before = BTreeMap::new();
    for master in &masters {
        evals_before.insert(master.clone(), eval_calls(master).await);
        let _: () = redis::cmd("SCRIPT")
            .arg("FLUSH")
            .query_async(&mut node(master).await)
            .await
            .expect("SCRIPT FLUSH");
    }

    // Enough keys that every master owns some: each first run and its replay go through claim,
    // complete and claim again, by SHA1, which the masters no longer know.
    const KEYS: usize = 60;
    for i in 0..KEYS {
        let request = || {
            post("/pay")
                .key(&format!("flushed-{i}"))
                .user("alice")
                .json("{}")
        };
        let first = send(&router, request()).await;
        assert_eq!(first.status, StatusCode::CREATED, "{first:?}");
        let again = send(&router, request()).await;
        assert_eq!(again.status, StatusCode::CREATED, "{again:?}");
        assert!(again.replayed(), "{again:?}");
        assert_eq!(again.body, first.body);
    }
    assert_eq!(counters.started(), KEYS + 1);

    // Every master owns records of this test, and was sent the scripts whole (`EVAL`) after the
    // flush: the store met NOSCRIPT on each and recovered on the node that owns the key.
    let counts = keys_per_master(&prefix).await;
    for master in &masters {
        assert!(counts[master] > 0, "no record on {master}: {counts:?}");
        let (before, after) = (evals_before[master], eval_calls(master).await);
        assert!(
            after > before,
            "{master} was never sent a script whole after the flush ({before} EVAL calls, then {after})"
        );
    }
}

#[tokio::test]
async fn unreachable_cluster_is_503_and_runs_nothing() {
    // Nothing listens on port 1.
    let client = ClusterClient::new(vec!["redis://127.0.0.1:1"]).expect("url");
    let store = RedisStore::cluster(client)
        .expect("a lazy store")
        .with_timeout(Duration::from_secs(1));
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let started = Instant::now();
    let answer = send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.problem(), "idempotency_store_unavailable");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "the timeout bounds the claim: {:?}",
        started.elapsed()
    );
    assert_eq!(counters.started(), 0);
    assert_eq!(store.purge_expired().await.expect("nothing to purge"), 0);
}

/// A proxy in front of the first master, in `mode`.
async fn proxy_to_first_master(mode: Mode) -> Proxy {
    let first = masters().await.remove(0);
    let upstream = tokio::net::lookup_host(first.as_str())
        .await
        .expect("resolve")
        .next()
        .expect("an address");
    let proxy = Proxy::start(upstream).await;
    proxy.set(mode);
    proxy
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_cluster_is_503_within_the_timeout() {
    // The only initial node accepts connections and never answers: the cluster client would wait
    // for its connection timeout (1 s by default) and retry; the store's timeout cuts that short.
    let proxy = proxy_to_first_master(Mode::Stall).await;
    let client = ClusterClient::new(vec![format!("redis://{}", proxy.addr)]).expect("url");
    let store = RedisStore::cluster(client)
        .expect("a lazy store")
        .with_prefix(&prefix())
        .with_timeout(Duration::from_millis(200));
    let (router, counters) = app(IdempotencyLayer::new(store).expect("valid settings"));
    for _ in 0..3 {
        let started = Instant::now();
        let answer = send(&router, post("/pay").key("k").user("alice").json("{}")).await;
        let took = started.elapsed();
        assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
        assert!(
            took < Duration::from_millis(800),
            "answered after {took:?}, not within the 200 ms timeout"
        );
    }
    assert_eq!(counters.started(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_unreachable_at_start_is_used_once_it_answers() {
    // The store's only initial node is a proxy in front of the first master, refusing at first.
    let proxy = proxy_to_first_master(Mode::Cut).await;
    let client = ClusterClient::new(vec![format!("redis://{}", proxy.addr)]).expect("url");
    let store = RedisStore::cluster(client)
        .expect("a lazy store")
        .with_prefix(&prefix())
        .with_timeout(Duration::from_secs(1));
    let (router, counters) = app(IdempotencyLayer::new(store).expect("valid settings"));
    let request = || post("/pay").key("late").user("alice").json("{}");
    let answer = send(&router, request()).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE, "{answer:?}");
    assert_eq!(counters.started(), 0);

    // The cluster answers now: the store connects, learns the slots, and serves.
    proxy.set(Mode::Pass);
    let deadline = Instant::now() + Duration::from_secs(15);
    let answer = loop {
        let answer = send(&router, request()).await;
        if answer.status != StatusCode::SERVICE_UNAVAILABLE || Instant::now() > deadline {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(answer.status, StatusCode::CREATED, "{answer:?}");
    assert!(
        send(&router, request()).await.replayed(),
        "the record is kept"
    );
    assert_eq!(counters.started(), 1);
}

#[test]
fn a_cluster_store_outside_a_runtime_is_refused() {
    let error = RedisStore::cluster(client()).expect_err("no runtime to drive the connection");
    assert!(error.to_string().contains("Tokio runtime"), "{error}");
}
