//! The layer on the Redis store, against a real Redis (`REDIS_URL`, default
//! `redis://127.0.0.1:6379`): the shared behavioural suite, races included, and an unreachable
//! server. Every test uses a key prefix of its own.
#![cfg(feature = "redis")]

use crate::common;
use axum_idempotency::{cache_suite, store_suite};

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::http::StatusCode;
use axum_idempotency::conformance::app::claim_request;
use axum_idempotency::store::ListRequest;
use axum_idempotency::store::{
    ClaimOutcome, ClaimRequest, Fenced, Finished, Generation, IdempotencyStore, LeaseToken,
    RecordKey, RedisStore, StoredResponse,
};
use axum_idempotency::{Fingerprint, IdempotencyLayer};
use common::{app, post, send};
use redis::aio::MultiplexedConnection;

fn redis_url() -> String {
    common::servers::redis_url()
}

pub(crate) async fn store() -> RedisStore {
    store_and_prefix().0
}

/// A store with a key prefix of its own, and that prefix.
fn store_and_prefix() -> (RedisStore, String) {
    static N: AtomicUsize = AtomicUsize::new(0);
    let client = redis::Client::open(redis_url()).expect("REDIS_URL");
    let prefix = format!(
        "idem_test:{}:{}:{}:",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_nanos(),
        N.fetch_add(1, Ordering::SeqCst)
    );
    let store = RedisStore::new(client)
        .expect("store")
        .with_prefix(&prefix)
        .with_timeout(common::SUITE_STORE_TIMEOUT);
    (store, prefix)
}

// Redis expires records itself: purge_expired has nothing left to delete.
store_suite!(store(), purged = 0);
cache_suite!(store(), purged = 0);

/// A finished record's steps count in its subject's bytes with its answer (the account of bytes
/// the completion writes), on one server and on a cluster.
pub(crate) async fn a_finished_records_steps_count_in_its_subjects_bytes(
    store: RedisStore,
    together: Option<bool>,
) {
    let request = claim_request("counted-steps", b"");
    let ClaimOutcome::Claimed { lease, .. } = store.claim(&request).await.expect("claim") else {
        panic!("a fresh key is claimed");
    };
    // The completion then counts in its own script (one server), or its caller does (cluster).
    if let Some(together) = together {
        probed_together(&store, together).await;
    }
    let subject = &request.key.subject;
    for i in 0..3 {
        let step = axum_idempotency::store::RecordedStep {
            name: format!("step {i}"),
            result: vec![b'7'; 10_000],
        };
        let done = store.record_step(&request.key, lease, &step).await;
        assert!(done.expect("recorded").is_done());
    }
    let answer = Arc::new(StoredResponse::new(
        Finished::Completed,
        201,
        Vec::new(),
        None,
    ));
    let done = store
        .complete(
            &request.key,
            lease,
            &request.fingerprint,
            answer,
            request.retention,
        )
        .await;
    assert!(done.expect("completed").is_done());
    let usage = store.count_records(subject, 10).await.expect("count");
    let usage = usage.expect("the store counts");
    assert_eq!(usage.records, 1);
    assert!(
        usage.bytes >= 30_000,
        "three steps of 10 000 bytes: {usage:?}"
    );
}

#[tokio::test]
async fn a_finished_records_steps_count_in_its_subjects_bytes_on_one_server() {
    a_finished_records_steps_count_in_its_subjects_bytes(store().await, Some(true)).await;
}

#[tokio::test]
async fn unreachable_redis_is_503_and_runs_nothing() {
    // Nothing listens on port 1.
    let client = redis::Client::open("redis://127.0.0.1:1").expect("url");
    let store = RedisStore::new(client)
        .expect("a lazy store")
        .with_timeout(Duration::from_secs(2));
    let (router, counters) = app(IdempotencyLayer::new(store.clone()).expect("valid settings"));
    let answer = send(&router, post("/pay").key("k").user("alice").json("{}")).await;
    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.problem(), "idempotency_store_unavailable");
    assert_eq!(counters.started(), 0);
    assert_eq!(store.purge_expired().await.expect("nothing to purge"), 0);
}

#[tokio::test]
async fn records_expire_with_retention() {
    let store = store().await;
    let layer = IdempotencyLayer::builder(store)
        .retention(Duration::from_millis(300))
        .build()
        .expect("layer");
    let (router, counters) = app(layer);
    send(&router, post("/pay").key("k").user("alice")).await;
    assert!(
        send(&router, post("/pay").key("k").user("alice"))
            .await
            .replayed()
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !send(&router, post("/pay").key("k").user("alice"))
            .await
            .replayed()
    );
    assert_eq!(counters.started(), 2);
}

#[tokio::test]
async fn a_retake_sent_twice_is_told_a_retake_both_times() {
    let store = store().await;
    let claim = |lease: LeaseToken| ClaimRequest {
        key: RecordKey {
            key: "resent".into(),
            subject: "alice".into(),
            endpoint: "POST /pay".into(),
        },
        fingerprint: Fingerprint::of(None, b"{}"),
        lease,
        generation: Generation::generate(),
        in_progress_ttl: Duration::from_millis(100),
        retention: Duration::from_secs(60),
    };
    let holder = claim(LeaseToken::generate());
    let first = store.claim(&holder).await.expect("claim");
    assert!(
        matches!(first, ClaimOutcome::Claimed { .. }) && !first.is_retake(&holder),
        "{first:?}"
    );
    // The holder stops renewing; past its TTL another request retakes, and that claim is sent
    // again (as the cluster client resends a command whose connection dropped before the answer).
    tokio::time::sleep(Duration::from_millis(250)).await;
    // The first claim to find the holder silent marks its record; it is taken a TTL later.
    let noticer = store.claim(&claim(LeaseToken::generate())).await;
    assert!(
        matches!(noticer, Ok(ClaimOutcome::InProgress)),
        "{noticer:?}"
    );
    tokio::time::sleep(Duration::from_millis(250)).await;
    let retaker = claim(LeaseToken::generate());
    for attempt in ["first", "resent"] {
        let outcome = store.claim(&retaker).await.expect("claim");
        assert!(outcome.is_retake(&retaker), "{attempt}: {outcome:?}");
    }
    // Released, the record is the same operation again (the same request takes it): a retake,
    // sent twice or not.
    let released = store.release(&retaker.key, retaker.lease).await;
    assert!(matches!(released, Ok(Fenced::Done)), "{released:?}");
    let again = claim(LeaseToken::generate());
    for attempt in ["first", "resent"] {
        let outcome = store.claim(&again).await.expect("claim");
        assert!(outcome.is_retake(&again), "{attempt}: {outcome:?}");
    }
}

/// Claims `count` records of `subject` (keys `k0`, `k1`...), one after the other: listed in that
/// order.
async fn claim_records(store: &RedisStore, subject: &str, count: usize) -> Vec<RecordKey> {
    let mut keys = Vec::new();
    for n in 0..count {
        let key = RecordKey {
            key: format!("k{n}"),
            subject: subject.into(),
            endpoint: "POST /pay".into(),
        };
        let request = ClaimRequest::new(
            key.clone(),
            Fingerprint::of(None, b"{}"),
            Duration::from_secs(30),
            Duration::from_secs(3600),
        );
        let outcome = store.claim(&request).await.expect("claim");
        assert!(
            matches!(outcome, ClaimOutcome::Claimed { .. }),
            "{outcome:?}"
        );
        keys.push(key);
        // Creation times a millisecond apart at least: the listing's order is the claims'.
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    keys
}

/// Deletes the records of `keys` behind the store's back (as an operator's `DEL`, or an eviction),
/// leaving their entries in the listing index.
async fn delete_by_hand(prefix: &str, keys: &[RecordKey]) {
    let mut connection = connection().await;
    for key in keys {
        let deleted: i64 = redis::cmd("DEL")
            .arg(format!("{prefix}{}", digest_hex(key)))
            .query_async(&mut connection)
            .await
            .expect("DEL");
        assert_eq!(deleted, 1, "{key:?}");
    }
}

#[tokio::test]
async fn a_listing_skips_records_gone_from_under_their_index() {
    let (store, prefix) = store_and_prefix();
    let keys = claim_records(&store, "alice", 5).await;
    delete_by_hand(&prefix, &keys[1..3]).await;

    // The page still fills, from the entries after the records that are gone.
    let page = store
        .list("alice", ListRequest::first(3))
        .await
        .expect("list");
    let listed: Vec<&str> = page.records.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(listed, ["k0", "k3", "k4"], "{page:?}");
    let next = page.next.expect("a full page has a next one");
    let rest = store
        .list(
            "alice",
            ListRequest {
                after: Some(next),
                limit: 3,
            },
        )
        .await
        .expect("list");
    assert!(rest.records.is_empty() && rest.next.is_none(), "{rest:?}");

    // The entries of the records that are gone were dropped from the index on the way.
    let again = store
        .list("alice", ListRequest::first(100))
        .await
        .expect("list");
    assert_eq!(again.records.len(), 3, "{again:?}");
    assert_eq!(index_sizes(&prefix).await, [3], "one index, for alice");
}

/// On one server, the claim's script files the record in its subject's index and the completion's
/// script counts the answer's bytes, each best effort: with both keys made unwritable (a string
/// where the index and the account should be), a claim still claims, its completion is done and
/// replayed, and neither key is touched.
#[tokio::test]
async fn an_index_or_account_that_cannot_be_written_fails_no_claim_nor_completion() {
    let (store, prefix) = store_and_prefix();
    let answer = |body: &'static [u8]| {
        Arc::new(StoredResponse::new(
            Finished::Completed,
            201,
            Vec::new(),
            Some(body.to_vec().into()),
        ))
    };
    let request = |key: &str| claim_request(key, b"{}");
    let claim_and_complete = async |key: &str| {
        let request = request(key);
        let ClaimOutcome::Claimed { lease, .. } = store.claim(&request).await.expect("claim")
        else {
            panic!("claimed");
        };
        store
            .complete(
                &request.key,
                lease,
                &request.fingerprint,
                answer(b"paid"),
                request.retention,
            )
            .await
            .expect("complete")
    };
    assert_eq!(claim_and_complete("first").await, Fenced::Done);
    // The first claim started the probe of the server; from its answer on, the scripts take the
    // index and the account as their second key.
    probed_together(&store, true).await;
    let mut connection = connection().await;
    let mut made: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}subject:*"))
        .query_async(&mut connection)
        .await
        .expect("KEYS");
    let accounts: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}bytes:*"))
        .query_async(&mut connection)
        .await
        .expect("KEYS");
    assert_eq!(
        (made.len(), accounts.len()),
        (1, 1),
        "{made:?} {accounts:?}"
    );
    made.extend(accounts);
    for key in &made {
        let _: () = redis::cmd("SET")
            .arg(key)
            .arg("not a sorted set nor a hash")
            .query_async(&mut connection)
            .await
            .expect("SET");
    }
    assert_eq!(claim_and_complete("second").await, Fenced::Done);
    let ClaimOutcome::Finished(stored) = store.claim(&request("second")).await.expect("claim")
    else {
        panic!("the second answer is replayed");
    };
    assert_eq!(&stored.body[..], b"paid");
    for key in &made {
        let kind: String = redis::cmd("TYPE")
            .arg(key)
            .query_async(&mut connection)
            .await
            .expect("TYPE");
        assert_eq!(kind, "string", "{key} untouched");
    }
    assert_eq!(
        store.keys_together_now(),
        Some(true),
        "the scripts still take two keys: their filing and count failed inside them"
    );
}

/// Waits (at most 5 s) until `store`'s probe answers whether its scripts take two keys, and checks
/// that answer.
pub(crate) async fn probed_together(store: &RedisStore, together: bool) {
    for _ in 0..250 {
        if let Some(probed) = store.keys_together_now() {
            assert_eq!(probed, together, "the probe's answer");
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the probe never answered");
}

/// A server that refuses a script's second key with an error of its own (here an ACL that allows
/// the records' keys, not the subjects' indexes and accounts: `NOPERM`): the claim
/// and, on a store of its own, the completion run again on the record alone, are granted and
/// done, and the store takes one key from then on.
#[tokio::test]
async fn a_server_refusing_a_scripts_second_key_gets_it_run_on_one_key() {
    let (_, prefix) = store_and_prefix();
    let user = format!("zz_idem_{}_{}", std::process::id(), prefix.len());
    let mut admin = connection().await;
    let _: () = redis::cmd("ACL")
        .arg("SETUSER")
        .arg(&user)
        .arg("reset")
        .arg("on")
        .arg("nopass")
        .arg(format!("~{prefix}[0-9a-f][0-9a-f]*"))
        .arg("+@all")
        .arg("-@admin")
        .arg("-@dangerous")
        .query_async(&mut admin)
        .await
        .expect("ACL SETUSER");
    let limited = || {
        let info: redis::ConnectionInfo = redis_url().as_str().parse().expect("REDIS_URL");
        let settings = info
            .redis_settings()
            .clone()
            .set_username(user.clone())
            .set_password("");
        let info = info.set_redis_settings(settings);
        // As if a probe had found one server: its scripts take the second key (which the ACL
        // refuses) from the first claim on.
        RedisStore::new(redis::Client::open(info).expect("client"))
            .expect("store")
            .with_prefix(&prefix)
            .with_timeout(Duration::from_secs(2))
            .assume_keys_together()
    };
    let claimer = limited();
    let request = claim_request("k", b"{}");
    assert_eq!(claimer.keys_together_now(), Some(true));
    let ClaimOutcome::Claimed { lease, .. } = claimer.claim(&request).await.expect("claim") else {
        panic!("claimed, on the record alone");
    };
    assert_eq!(
        claimer.keys_together_now(),
        Some(false),
        "one key from then on"
    );
    // A store of its own, whose first script on two keys is the completion.
    let completer = limited();
    assert_eq!(completer.keys_together_now(), Some(true));
    let answer = Arc::new(StoredResponse::new(
        Finished::Completed,
        201,
        Vec::new(),
        Some(b"paid".to_vec().into()),
    ));
    let done = completer
        .complete(
            &request.key,
            lease,
            &request.fingerprint,
            answer,
            request.retention,
        )
        .await
        .expect("complete");
    assert_eq!(done, Fenced::Done);
    assert_eq!(completer.keys_together_now(), Some(false));
    let again = ClaimRequest {
        lease: LeaseToken::generate(),
        ..request.clone()
    };
    let ClaimOutcome::Finished(stored) = completer.claim(&again).await.expect("claim") else {
        panic!("replayed");
    };
    assert_eq!(&stored.body[..], b"paid");
    let _: i64 = redis::cmd("ACL")
        .arg("DELUSER")
        .arg(&user)
        .query_async(&mut admin)
        .await
        .expect("ACL DELUSER");
}

/// A connection of its own to the Redis server, for what tests do behind the store's back.
async fn connection() -> MultiplexedConnection {
    redis::Client::open(redis_url())
        .expect("REDIS_URL")
        .get_multiplexed_async_connection()
        .await
        .expect("connect")
}

/// A record key's digest in lower-case hex: its Redis key after the prefix, and its index entry.
fn digest_hex(key: &RecordKey) -> String {
    key.digest().iter().map(|b| format!("{b:02x}")).collect()
}

/// The listing indexes under `prefix` that `connection`'s server holds (sorted sets: not a key a
/// probe of the server may be writing under the same name's shape).
async fn indexes_on(connection: &mut MultiplexedConnection, prefix: &str) -> Vec<String> {
    let names: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}subject:*"))
        .query_async(&mut *connection)
        .await
        .expect("KEYS");
    let mut indexes = Vec::new();
    for name in names {
        let kind: String = redis::cmd("TYPE")
            .arg(&name)
            .query_async(&mut *connection)
            .await
            .expect("TYPE");
        if kind == "zset" {
            indexes.push(name);
        }
    }
    indexes
}

/// How many entries each listing index under `prefix` holds.
async fn index_sizes(prefix: &str) -> Vec<i64> {
    index_sizes_on(&mut connection().await, prefix).await
}

/// How many entries each listing index under `prefix` on `connection`'s server holds.
pub(crate) async fn index_sizes_on(
    connection: &mut MultiplexedConnection,
    prefix: &str,
) -> Vec<i64> {
    let mut sizes = Vec::new();
    for index in indexes_on(connection, prefix).await {
        let entries: i64 = redis::cmd("ZCARD")
            .arg(&index)
            .query_async(connection)
            .await
            .expect("ZCARD");
        sizes.push(entries);
    }
    sizes
}

/// Ten records of the anonymous subject that stay, then 800 that expire 30 ms after their claim,
/// in rounds of 16: a busy endpoint whose records nobody lists. Returns 200 ms after the last claim,
/// time for the last sweeps, which run on tasks of their own.
pub(crate) async fn churn_a_subject_never_listed(store: &RedisStore) {
    let claim = |key: String, life: Duration| async move {
        let request = ClaimRequest::new(
            RecordKey {
                key,
                subject: String::new(),
                endpoint: "POST /pay".into(),
            },
            Fingerprint::of(None, b"{}"),
            life,
            Duration::from_millis(1),
        );
        let outcome = store.claim(&request).await.expect("claim");
        assert!(
            matches!(outcome, ClaimOutcome::Claimed { .. }),
            "{outcome:?}"
        );
    };
    for n in 0..10 {
        claim(format!("stays-{n}"), Duration::from_secs(600)).await;
    }
    for round in 0..50 {
        for n in 0..16 {
            claim(format!("goes-{round}-{n}"), Duration::from_millis(30)).await;
        }
        tokio::time::sleep(Duration::from_millis(40)).await;
    }
    // The last sweeps run on tasks of their own.
    tokio::time::sleep(Duration::from_millis(200)).await;
}

/// After [`churn_a_subject_never_listed`]: its index (of `sizes`, the only one) holds far fewer
/// than the 810 entries filed, and every record that stays is still listed.
pub(crate) async fn assert_swept_and_live_records_listed(store: &RedisStore, sizes: Vec<i64>) {
    assert_eq!(sizes.len(), 1, "{sizes:?}");
    // Unswept, the index would hold all 810 entries; swept, about as many of records that are
    // gone as of live ones (a simulation of these rounds never passes 40).
    assert!(sizes[0] <= 150, "{sizes:?}");
    // The sweeps removed no entry of a live record.
    let page = store.list("", ListRequest::first(100)).await.expect("list");
    let mut listed: Vec<&str> = page.records.iter().map(|r| r.key.as_str()).collect();
    listed.sort_unstable();
    let stays: Vec<String> = (0..10).map(|n| format!("stays-{n}")).collect();
    assert_eq!(listed, stays, "{page:?}");
}

#[tokio::test]
async fn the_index_of_a_subject_never_listed_stays_bounded_by_its_live_records() {
    let (store, prefix) = store_and_prefix();
    churn_a_subject_never_listed(&store).await;
    assert_swept_and_live_records_listed(&store, index_sizes(&prefix).await).await;
}

#[tokio::test]
async fn a_listing_that_makes_an_index_anew_gives_it_its_records_life() {
    let (store, prefix) = store_and_prefix();
    let keys = claim_records(&store, "alice", 1).await;
    // The index expired, and then an entry of the key from before its record's creation was
    // filed again (a listing's refile racing the expiry): an index without an expiry, whose one
    // entry the next listing moves to the record's creation time.
    let mut connection = connection().await;
    let indexes = indexes_on(&mut connection, &prefix).await;
    assert_eq!(indexes.len(), 1, "{indexes:?}");
    let digest = digest_hex(&keys[0]);
    let _: () = redis::pipe()
        .cmd("DEL")
        .arg(&indexes[0])
        .ignore()
        .cmd("ZADD")
        .arg(&indexes[0])
        .arg(1)
        .arg(&digest)
        .ignore()
        .query_async(&mut connection)
        .await
        .expect("DEL, ZADD");

    let moved = store
        .list("alice", ListRequest::first(10))
        .await
        .expect("list");
    assert!(moved.records.is_empty(), "moved, not listed yet: {moved:?}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    let pttl: i64 = redis::cmd("PTTL")
        .arg(&indexes[0])
        .query_async(&mut connection)
        .await
        .expect("PTTL");
    assert!(
        pttl > 1_000,
        "the index lives as long as its record: {pttl}"
    );
    let listed = store
        .list("alice", ListRequest::first(10))
        .await
        .expect("list");
    let listed: Vec<&str> = listed.records.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(listed, ["k0"]);
}

#[tokio::test]
async fn a_listing_reads_a_bounded_number_of_entries_and_continues() {
    let (store, prefix) = store_and_prefix();
    // Twelve records gone, then one live: a page of one reads at most ten entries.
    let keys = claim_records(&store, "alice", 13).await;
    delete_by_hand(&prefix, &keys[..12]).await;

    let page = store
        .list("alice", ListRequest::first(1))
        .await
        .expect("list");
    assert!(page.records.is_empty(), "{page:?}");
    let next = page.next.expect("a cursor to continue from");
    let page = store
        .list(
            "alice",
            ListRequest {
                after: Some(next),
                limit: 1,
            },
        )
        .await
        .expect("list");
    let listed: Vec<&str> = page.records.iter().map(|r| r.key.as_str()).collect();
    assert_eq!(listed, ["k12"], "{page:?}");
}

/// A store built `without_scope_fields` keeps no key, subject or endpoint in clear in Redis, files
/// nothing for listing, and still looks records up and deletes them.
#[tokio::test]
async fn without_scope_fields_nothing_is_in_clear_and_nothing_is_listed() {
    let (store, prefix) = store_and_prefix();
    let store = store.without_scope_fields();
    // It keeps no subjects, so it cannot bound a subject's records.
    let refused = IdempotencyLayer::new(store.clone()).expect_err("a records share it can't count");
    assert_eq!(refused.setting(), "max_records_per_subject");
    let layer = IdempotencyLayer::builder(store.clone())
        .max_records_per_subject(None)
        .build()
        .expect("valid settings");
    let (router, _) = app(layer);
    let answer = send(
        &router,
        post("/pay")
            .key("secret-key-1")
            .user("alice@example.com")
            .json("{}"),
    )
    .await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let mut connection = connection().await;
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg(format!("{prefix}*"))
        .query_async(&mut connection)
        .await
        .expect("keys");
    assert_eq!(keys.len(), 1, "one record, no index: {keys:?}");
    let fields: Vec<Vec<u8>> = redis::cmd("HVALS")
        .arg(&keys[0])
        .query_async(&mut connection)
        .await
        .expect("hvals");
    for value in &fields {
        let text = String::from_utf8_lossy(value);
        assert!(
            !text.contains("secret-key-1") && !text.contains("alice") && !text.contains("/pay"),
            "{text:?}"
        );
    }
    let key = RecordKey {
        key: "secret-key-1".into(),
        subject: "alice@example.com".into(),
        endpoint: "POST /pay".into(),
    };
    let info = store.lookup(&key).await.expect("lookup").expect("found");
    assert_eq!(info.status, Some(201));
    let page = store
        .list("alice@example.com", ListRequest::first(10))
        .await
        .expect("list");
    assert!(page.records.is_empty(), "{page:?}");
    assert_eq!(
        store.delete(&key).await.expect("delete"),
        axum_idempotency::store::Deleted::Deleted
    );
}

/// A restart does not count against a live holder (see `common::restart`), on a Redis of this
/// test's own that keeps its records across it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_of_the_server_does_not_count_against_a_holder() {
    let server = common::servers::PersistentRedis::start();
    let client = redis::Client::open(server.url.clone()).expect("url");
    let store = RedisStore::new(client)
        .expect("store")
        .with_timeout(Duration::from_secs(2));
    common::restart::a_restart_does_not_count_against_a_holder(
        &store,
        Duration::from_secs(3),
        move || server.restart(),
    )
    .await;
}
