use std::time::Duration;

use bytes::Bytes;
use http::HeaderValue;

use super::*;
use crate::store::{Finished, ListRequest, MemoryStore, RecordState};

fn key(k: &str) -> RecordKey {
    RecordKey {
        key: k.into(),
        subject: "alice".into(),
        endpoint: "POST /pay".into(),
    }
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::of_material(body.as_bytes())
}

fn response() -> Arc<StoredResponse> {
    Arc::new(StoredResponse::new(
        Finished::Completed,
        201,
        vec![(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        Some(Bytes::from_static(b"{\"card\":\"4242\"}")),
    ))
}

fn store() -> EncryptedStore<MemoryStore> {
    EncryptedStore::new(
        MemoryStore::new(),
        EncryptionKeys::single(1, [1; 32]),
        [2; 32],
    )
}

fn request(k: &str, body: &str, ttl: Duration) -> ClaimRequest {
    ClaimRequest::new(key(k), fp(body), ttl, Duration::from_secs(60))
}

async fn claimed(store: &impl IdempotencyStore, request: &ClaimRequest) -> LeaseToken {
    match store.claim(request).await.expect("claim") {
        ClaimOutcome::Claimed { lease, .. } => lease,
        other => panic!("not claimed: {other:?}"),
    }
}

async fn finished(store: &impl IdempotencyStore, request: &ClaimRequest) -> Arc<StoredResponse> {
    match store.claim(request).await.expect("claim") {
        ClaimOutcome::Finished(stored) => stored,
        other => panic!("not finished: {other:?}"),
    }
}

const MINUTE: Duration = Duration::from_secs(60);

#[tokio::test]
async fn the_inner_store_holds_hashes_of_the_scope_and_a_sealed_response() {
    let s = store();
    let first = request("k1", "a", MINUTE);
    let lease = claimed(&s, &first).await;
    let done = s
        .complete(&first.key, lease, &first.fingerprint, response(), MINUTE)
        .await
        .expect("complete");
    assert_eq!(done, Fenced::Done);
    // Replayed, opened, through the wrapper; another body is a reuse.
    let replayed = finished(&s, &request("k1", "a", MINUTE)).await;
    assert_eq!(replayed.body, response().body);
    assert_eq!(replayed.headers, response().headers);
    assert_eq!(
        s.claim(&request("k1", "b", MINUTE)).await.expect("claim"),
        ClaimOutcome::KeyReuse
    );
    // The inner store has nothing under the scope in clear, nor for the subject in clear.
    let inner = s.inner();
    assert_eq!(inner.lookup(&first.key).await.expect("lookup"), None);
    let page = inner
        .list("alice", ListRequest::first(10))
        .await
        .expect("list");
    assert!(page.records.is_empty());
    // What it holds is keyed: not the plain fingerprint (an inner claim with it is a reuse), and
    // no clear header or body.
    let hidden = s.hidden(&request("k1", "a", MINUTE));
    assert_ne!(hidden.fingerprint, first.fingerprint);
    for part in [&hidden.key.key, &hidden.key.subject, &hidden.key.endpoint] {
        assert_eq!(part.len(), 64);
    }
    let plain = ClaimRequest {
        key: hidden.key.clone(),
        ..request("k1", "a", MINUTE)
    };
    assert_eq!(
        inner.claim(&plain).await.expect("claim"),
        ClaimOutcome::KeyReuse
    );
    let sealed = finished(inner, &hidden).await;
    assert!(sealed.headers.is_empty());
    assert!(!sealed.body.windows(4).any(|w| w == b"4242"));
    // Another secret finds nothing: the hashes are keyed.
    let other = EncryptedStore::new(inner.clone(), EncryptionKeys::single(1, [1; 32]), [3; 32]);
    claimed(&other, &request("k1", "a", MINUTE)).await;
}

#[tokio::test]
async fn inspection_goes_by_the_scope_in_clear_and_shows_no_key() {
    let s = store();
    let first = request("k1", "a", MINUTE);
    let lease = claimed(&s, &first).await;
    let info = s.lookup(&first.key).await.expect("lookup").expect("found");
    assert_eq!(info.state, RecordState::InProgress);
    assert_eq!(
        s.count_records("alice", 10)
            .await
            .expect("count")
            .map(|u| u.records),
        Some(1)
    );
    assert_eq!(
        s.count_records("bob", 10)
            .await
            .expect("count")
            .map(|u| u.records),
        Some(0)
    );
    assert_eq!(
        s.delete(&first.key).await.expect("delete"),
        Deleted::InProgress
    );
    let done = s
        .complete(&first.key, lease, &first.fingerprint, response(), MINUTE)
        .await;
    assert_eq!(done.expect("complete"), Fenced::Done);
    let page = s.list("alice", ListRequest::first(10)).await.expect("list");
    assert_eq!(page.records.len(), 1);
    let listed = &page.records[0];
    assert_eq!((listed.key.as_str(), listed.endpoint.as_str()), ("", ""));
    assert_eq!(listed.info.status, Some(201));
    assert_eq!(
        s.delete(&first.key).await.expect("delete"),
        Deleted::Deleted
    );
    assert_eq!(s.lookup(&first.key).await.expect("lookup"), None);
    claimed(&s, &request("k1", "b", MINUTE)).await;
}

/// A record as an earlier version wrote it: scope and fingerprint in clear, the response sealed
/// in format 1.
async fn written_in_clear(inner: &MemoryStore, request: &ClaimRequest) {
    let lease = claimed(inner, request).await;
    let keys = EncryptionKeys::single(1, [1; 32]);
    let sealed = envelope::seal(&keys, &request.key, None, &response()).expect("seal");
    let done = inner
        .complete(
            &request.key,
            lease,
            &request.fingerprint,
            Arc::new(sealed),
            MINUTE,
        )
        .await;
    assert_eq!(done.expect("complete"), Fenced::Done);
}

#[tokio::test]
async fn records_in_clear_answer_while_they_are_looked_for() {
    let inner = MemoryStore::new();
    written_in_clear(&inner, &request("old", "a", MINUTE)).await;
    let keys = || EncryptionKeys::single(1, [1; 32]);
    let looking = EncryptedStore::new(inner.clone(), keys(), [2; 32]).with_records_in_clear();
    let replayed = finished(&looking, &request("old", "a", MINUTE)).await;
    assert_eq!(replayed.body, response().body);
    assert_eq!(
        looking
            .claim(&request("old", "b", MINUTE))
            .await
            .expect("claim"),
        ClaimOutcome::KeyReuse
    );
    assert!(looking.lookup(&key("old")).await.expect("lookup").is_some());
    // Answered in clear, the claim left no hidden record behind: the answer stays the same.
    let replayed = finished(&looking, &request("old", "a", MINUTE)).await;
    assert_eq!(replayed.status, 201);
    // A record in clear that is running answers 409.
    let running = request("running", "a", MINUTE);
    claimed(&inner, &running).await;
    assert_eq!(
        looking
            .claim(&request("running", "a", MINUTE))
            .await
            .expect("claim"),
        ClaimOutcome::InProgress
    );
    // Without looking there, the record in clear is not found (the key runs anew).
    let not_looking = EncryptedStore::new(inner.clone(), keys(), [2; 32]);
    claimed(&not_looking, &request("old", "a", MINUTE)).await;
}

#[tokio::test]
async fn a_record_in_clear_whose_holder_died_is_retaken_once_under_its_hidden_record() {
    let inner = MemoryStore::new();
    let ttl = Duration::from_millis(30);
    let died = request("died", "a", ttl);
    claimed(&inner, &died).await;
    tokio::time::sleep(ttl * 3).await;
    let s = EncryptedStore::new(inner.clone(), EncryptionKeys::single(1, [1; 32]), [2; 32])
        .with_records_in_clear();
    let retry = request("died", "a", ttl);
    let outcome = s.claim(&retry).await.expect("claim");
    assert!(outcome.is_retake(&retry), "{outcome:?}");
    let ClaimOutcome::Claimed { lease, .. } = outcome else {
        panic!("not claimed: {outcome:?}");
    };
    // Running now under the hidden record: a duplicate waits, whatever it finds in clear.
    assert_eq!(
        s.claim(&request("died", "a", MINUTE)).await.expect("claim"),
        ClaimOutcome::InProgress
    );
    let done = s
        .complete(&retry.key, lease, &retry.fingerprint, response(), MINUTE)
        .await;
    assert_eq!(done.expect("complete"), Fenced::Done);
    finished(&s, &request("died", "a", MINUTE)).await;
}

#[tokio::test]
async fn format_1_opens_only_in_clear() {
    // A format-1 envelope under a hidden record was not written by any version: refused.
    let s = store();
    let first = request("k", "a", MINUTE);
    let hidden = s.hidden(&first);
    let lease = claimed(s.inner(), &hidden).await;
    let sealed = envelope::seal(&s.keys, &first.key, None, &response()).expect("seal");
    let done = s
        .inner()
        .complete(
            &hidden.key,
            lease,
            &hidden.fingerprint,
            Arc::new(sealed),
            MINUTE,
        )
        .await;
    assert_eq!(done.expect("complete"), Fenced::Done);
    let error = s.claim(&first).await.expect_err("refused");
    assert!(error.is_unreadable_record(), "{error}");
}

#[test]
fn keys_and_secret_are_never_printed() {
    let keys = EncryptionKeys::new([(7, [0xAB; 32]), (3, [0xCD; 32])]).expect("keys");
    let printed = format!(
        "{:?}",
        EncryptedStore::new(MemoryStore::new(), keys, [0xEF; 32])
    );
    assert!(printed.contains("ids: [7, 3]"), "{printed}");
    for material in ["171", "ab", "AB", "205", "cd", "CD", "239", "ef", "EF"] {
        assert!(!printed.contains(material), "{printed}");
    }
}

/// The operation keeps its generation (its derived key at the provider) through the move from
/// clear to hidden: a record an earlier version released, and a record in clear retaken and then
/// released again, both run as retakes with the generation the earlier run had.
#[tokio::test]
async fn the_generation_of_a_record_in_clear_is_kept_under_its_hidden_record() {
    let inner = MemoryStore::new();
    let s = EncryptedStore::new(inner.clone(), EncryptionKeys::single(1, [1; 32]), [2; 32])
        .with_records_in_clear();
    // Released by an earlier version (a retryable failure after it called the provider).
    let earlier = request("released", "a", MINUTE);
    let lease = claimed(&inner, &earlier).await;
    let done = inner.release(&earlier.key, lease).await;
    assert_eq!(done.expect("release"), Fenced::Done);
    let retry = request("released", "a", MINUTE);
    let outcome = s.claim(&retry).await.expect("claim");
    assert!(outcome.is_retake(&retry), "{outcome:?}");
    assert_eq!(
        outcome,
        ClaimOutcome::Claimed {
            lease: retry.lease,
            generation: Some(earlier.generation),
        }
    );
    // That run released too: the next retry still runs the same operation.
    let done = s.release(&retry.key, retry.lease).await;
    assert_eq!(done.expect("release"), Fenced::Done);
    let again = request("released", "a", MINUTE);
    let outcome = s.claim(&again).await.expect("claim");
    assert_eq!(
        outcome,
        ClaimOutcome::Claimed {
            lease: again.lease,
            generation: Some(earlier.generation),
        }
    );
    // A new key is not a retake, and leaves nothing held in clear.
    let fresh = request("fresh", "a", MINUTE);
    let outcome = s.claim(&fresh).await.expect("claim");
    assert!(!outcome.is_retake(&fresh), "{outcome:?}");
    assert_eq!(inner.lookup(&fresh.key).await.expect("lookup"), None);
}
