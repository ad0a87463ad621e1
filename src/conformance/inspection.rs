//! The inspection operations ([`IdempotencyStore::lookup`], [`IdempotencyStore::delete`],
//! [`IdempotencyStore::list`]) as every store must answer them: every state, paging, subjects kept
//! apart, and a delete racing claims that never lets an operation run twice.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use tokio::task::JoinSet;

use crate::store::{
    ClaimOutcome, ClaimRequest, Fenced, Fingerprint, Finished, IdempotencyStore, LeaseToken,
    RecordKey, StoredResponse,
};
use crate::store::{Deleted, ListRequest, RecordState};

fn key(key: &str, subject: &str, endpoint: &str) -> RecordKey {
    RecordKey {
        key: key.into(),
        subject: subject.into(),
        endpoint: endpoint.into(),
    }
}

fn claim(key: RecordKey, ttl: Duration, retention: Duration) -> ClaimRequest {
    ClaimRequest::new(
        key,
        Fingerprint::of(None, b"{\"amount\":1}"),
        ttl,
        retention,
    )
}

fn answer(outcome: Finished, status: u16) -> Arc<StoredResponse> {
    Arc::new(StoredResponse {
        outcome,
        status,
        headers: Vec::new(),
        body: Bytes::from_static(b"{}"),
        body_omitted: false,
        expires_in: None,
    })
}

/// Completes `request`'s record held by `lease` with `response`, for its retention; the lease must
/// hold it.
async fn finish<S: IdempotencyStore>(
    store: &S,
    request: &ClaimRequest,
    lease: LeaseToken,
    response: Arc<StoredResponse>,
) {
    let done = store
        .complete(
            &request.key,
            lease,
            &request.fingerprint,
            response,
            request.retention,
        )
        .await
        .expect("complete");
    assert_eq!(done, Fenced::Done);
}

async fn claimed<S: IdempotencyStore>(store: &S, request: &ClaimRequest) -> LeaseToken {
    match store.claim(request).await.expect("claim") {
        ClaimOutcome::Claimed { lease, .. } => lease,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// Within a second of `expected` (stores keep times to the millisecond or the microsecond, and
/// the store's clock is not this process's).
fn near(actual: SystemTime, expected: SystemTime) -> bool {
    let gap = match actual.duration_since(expected) {
        Ok(d) => d,
        Err(e) => e.duration(),
    };
    gap < Duration::from_secs(2)
}

/// `lookup` shows every state (in progress, completed, failed) with its status and times, and no
/// record for one released, deleted, or never claimed; `delete` removes finished records only.
pub async fn inspection_shows_every_state<S: IdempotencyStore>(store: S) {
    let ttl = Duration::from_secs(30);
    let retention = Duration::from_secs(3600);
    let started = SystemTime::now();
    let k = key("inspect-1", "alice", "POST /pay");
    assert_eq!(
        store.lookup(&k).await.expect("lookup"),
        None,
        "never claimed"
    );
    assert_eq!(store.delete(&k).await.expect("delete"), Deleted::NotFound);

    let request = claim(k.clone(), ttl, retention);
    let lease = claimed(&store, &request).await;
    let info = store
        .lookup(&k)
        .await
        .expect("lookup")
        .expect("in progress");
    assert_eq!(info.state, RecordState::InProgress);
    assert_eq!(info.status, None);
    assert!(near(info.created_at, started), "{info:?}");
    assert!(info.expires_at > SystemTime::now(), "{info:?}");
    assert_eq!(
        store.delete(&k).await.expect("delete"),
        Deleted::InProgress,
        "a record in progress is never deleted"
    );
    assert_eq!(
        store
            .claim(&claim(k.clone(), ttl, retention))
            .await
            .expect("claim"),
        ClaimOutcome::InProgress,
        "and it is still held"
    );

    finish(&store, &request, lease, answer(Finished::Completed, 201)).await;
    let info = store.lookup(&k).await.expect("lookup").expect("completed");
    assert_eq!(info.state, RecordState::Finished(Finished::Completed));
    assert_eq!(info.status, Some(201));
    assert!(near(info.created_at, started), "{info:?}");
    assert!(
        near(info.expires_at, SystemTime::now() + retention),
        "expires a retention after its completion: {info:?}"
    );

    assert_eq!(store.delete(&k).await.expect("delete"), Deleted::Deleted);
    assert_eq!(store.lookup(&k).await.expect("lookup"), None, "deleted");
    assert_eq!(store.delete(&k).await.expect("delete"), Deleted::NotFound);
    // After a delete the key is new: even another body runs.
    let mut again = claim(k.clone(), ttl, retention);
    again.fingerprint = Fingerprint::of(None, b"{\"amount\":2}");
    let lease = claimed(&store, &again).await;

    // A definitive failure.
    finish(&store, &again, lease, answer(Finished::Failed, 402)).await;
    let info = store.lookup(&k).await.expect("lookup").expect("failed");
    assert_eq!(
        (info.state, info.status),
        (RecordState::Finished(Finished::Failed), Some(402))
    );
    assert_eq!(store.delete(&k).await.expect("delete"), Deleted::Deleted);

    // Released: the next claim runs, so there is nothing to show, and nothing to delete.
    let released = claim(k.clone(), ttl, retention);
    let lease = claimed(&store, &released).await;
    let done = store.release(&k, lease).await.expect("release");
    assert_eq!(done, Fenced::Done);
    assert_eq!(store.lookup(&k).await.expect("lookup"), None, "released");
    assert_eq!(store.delete(&k).await.expect("delete"), Deleted::NotFound);
    let lease = claimed(&store, &released).await;
    let done = store.release(&k, lease).await.expect("release");
    assert_eq!(done, Fenced::Done);

    // Another subject's or route's record of the same key is another record.
    assert_eq!(
        store
            .lookup(&key("inspect-1", "bob", "POST /pay"))
            .await
            .expect("lookup"),
        None
    );
    assert_eq!(
        store
            .lookup(&key("inspect-1", "alice", "POST /refund"))
            .await
            .expect("lookup"),
        None
    );
}

/// A record past its retention is gone to inspection, before any purge.
pub async fn inspection_forgets_expired_records<S: IdempotencyStore>(store: S) {
    let k = key("inspect-expired", "alice", "POST /pay");
    let retention = Duration::from_millis(200);
    let request = claim(k.clone(), Duration::from_secs(30), retention);
    let lease = claimed(&store, &request).await;
    finish(&store, &request, lease, answer(Finished::Completed, 201)).await;
    assert!(store.lookup(&k).await.expect("lookup").is_some());
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(store.lookup(&k).await.expect("lookup"), None);
    assert_eq!(store.delete(&k).await.expect("delete"), Deleted::NotFound);
    let page = store
        .list("alice", ListRequest::first(10))
        .await
        .expect("list");
    assert!(page.records.is_empty(), "{page:?}");
}

/// `list` pages through one subject's live records on every endpoint, oldest first, each once,
/// and never shows another subject's; a subject of any bytes is listed exactly.
pub async fn listing_pages_through_one_subjects_records<S: IdempotencyStore>(store: S) {
    let ttl = Duration::from_secs(30);
    let retention = Duration::from_secs(3600);
    let subjects = ["alice", "bob", "ali", "alice\u{0}", "alice\u{fffd}", ""];
    let mut mine = HashSet::new();
    for n in 0..7 {
        let endpoint = if n % 2 == 0 {
            "POST /pay"
        } else {
            "POST /refund"
        };
        let request = claim(key(&format!("k{n}"), "alice", endpoint), ttl, retention);
        let lease = claimed(&store, &request).await;
        if n % 3 != 0 {
            finish(
                &store,
                &request,
                lease,
                answer(Finished::Completed, 200 + n),
            )
            .await;
        }
        mine.insert((format!("k{n}"), endpoint.to_owned()));
    }
    for other in &subjects[1..] {
        let request = claim(key("k0", other, "POST /pay"), ttl, retention);
        claimed(&store, &request).await;
    }
    // A released record of alice's is not listed.
    let released = claim(key("k-released", "alice", "POST /pay"), ttl, retention);
    let lease = claimed(&store, &released).await;
    let done = store.release(&released.key, lease).await.expect("release");
    assert_eq!(done, Fenced::Done);

    let mut seen = Vec::new();
    let mut request = ListRequest::first(3);
    let mut pages = 0;
    loop {
        let page = store.list("alice", request).await.expect("list");
        pages += 1;
        assert!(page.records.len() <= 3, "{page:?}");
        for record in &page.records {
            if !record.key.is_empty() {
                let n: u16 = record.key[1..].parse().expect("one of ours");
                assert_eq!(
                    record.info.status,
                    (!n.is_multiple_of(3)).then_some(200 + n),
                    "{record:?}"
                );
            }
            seen.push(record.clone());
        }
        match page.next {
            Some(next) => {
                request = ListRequest {
                    after: Some(next),
                    limit: 3,
                }
            }
            None => break,
        }
        assert!(pages < 10, "the listing does not end");
    }
    if seen.iter().all(|r| r.key.is_empty()) && !seen.is_empty() {
        // A store that keeps no key in clear (an `EncryptedStore`) lists each record by its
        // state, status and times: the statuses are alice's, each once.
        let mut statuses: Vec<_> = seen.iter().map(|r| r.info.status).collect();
        statuses.sort_unstable();
        let mut expected: Vec<_> = (0..7u16)
            .map(|n| (!n.is_multiple_of(3)).then_some(200 + n))
            .collect();
        expected.sort_unstable();
        assert_eq!(statuses, expected, "every record of alice's once, no other");
    } else if !seen.is_empty() {
        let listed: HashSet<_> = seen
            .iter()
            .map(|r| (r.key.clone(), r.endpoint.clone()))
            .collect();
        assert_eq!(listed, mine, "every record of alice's once, no other");
    }
    // (A store that keeps no subject lists nothing.)
    assert!(seen.is_empty() || seen.len() == mine.len(), "none twice");
    assert!(
        seen.windows(2).all(|w| w[0].cursor < w[1].cursor),
        "in cursor order"
    );
    for other in &subjects[1..] {
        let page = store
            .list(other, ListRequest::first(100))
            .await
            .expect("list");
        if seen.is_empty() {
            assert!(page.records.is_empty(), "{other:?}: {page:?}");
            continue;
        }
        assert_eq!(page.records.len(), 1, "{other:?}: {page:?}");
        assert!(["k0", ""].contains(&page.records[0].key.as_str()));
        assert_eq!(page.records[0].info.state, RecordState::InProgress);
    }
    let nobody = store
        .list("nobody", ListRequest::first(100))
        .await
        .expect("list");
    assert!(nobody.records.is_empty() && nobody.next.is_none());
}

/// A delete racing many claims of the same request, round after round: while the record is in
/// progress nothing is deleted and nothing else is granted; once it is finished, the delete makes
/// the key new and exactly one of the racing claims (none, if they all came before the delete)
/// gets it. Never two grants of one record.
pub async fn delete_racing_claims_never_grants_twice<S: IdempotencyStore>(store: S) {
    let ttl = Duration::from_secs(30);
    let retention = Duration::from_secs(3600);
    for round in 0..20 {
        let k = key(&format!("race-{round}"), "alice", "POST /pay");
        let first = claim(k.clone(), ttl, retention);
        let lease = claimed(&store, &first).await;

        // In progress: deletes and claims race; nothing is deleted, nothing granted.
        let mut racing = JoinSet::new();
        for n in 0..8 {
            let (store, k) = (store.clone(), k.clone());
            racing.spawn(async move {
                if n % 4 == 0 {
                    let deleted = store.delete(&k).await.expect("delete");
                    assert_eq!(deleted, Deleted::InProgress);
                } else {
                    let outcome = store.claim(&claim(k, ttl, retention)).await.expect("claim");
                    assert_eq!(outcome, ClaimOutcome::InProgress);
                }
            });
        }
        while let Some(done) = racing.join_next().await {
            done.expect("task");
        }
        finish(&store, &first, lease, answer(Finished::Completed, 201)).await;

        // Finished: one delete races eight claims.
        let mut racing = JoinSet::new();
        {
            let (store, k) = (store.clone(), k.clone());
            racing.spawn(async move { (Some(store.delete(&k).await.expect("delete")), None) });
        }
        for _ in 0..8 {
            let (store, k) = (store.clone(), k.clone());
            racing.spawn(async move {
                let outcome = store.claim(&claim(k, ttl, retention)).await.expect("claim");
                (None, Some(outcome))
            });
        }
        let (mut deleted, mut granted) = (None, 0);
        while let Some(done) = racing.join_next().await {
            match done.expect("task") {
                (Some(d), _) => deleted = Some(d),
                (_, Some(ClaimOutcome::Claimed { .. })) => granted += 1,
                (_, Some(ClaimOutcome::Finished(r))) => assert_eq!(r.status, 201),
                (_, Some(ClaimOutcome::InProgress)) => {}
                other => panic!("round {round}: {other:?}"),
            }
        }
        assert_eq!(deleted, Some(Deleted::Deleted), "round {round}");
        assert!(
            granted <= 1,
            "round {round}: {granted} grants of one record"
        );
        let state = store.lookup(&k).await.expect("lookup").map(|i| i.state);
        assert_eq!(
            state,
            (granted == 1).then_some(RecordState::InProgress),
            "round {round}"
        );
    }
}

/// Through the layer: a delete racing duplicates of a finished request, round after round. The
/// handler runs at most once more after the delete (the key is new), never twice, and every later
/// duplicate gets that run's answer.
pub async fn delete_racing_requests_runs_the_handler_at_most_once_more<S: IdempotencyStore>(
    store: S,
) {
    use super::app::{app, post, send};
    use axum::http::StatusCode;

    let layer = crate::IdempotencyLayer::new(store.clone()).expect("valid settings");
    let (router, counters) = app(layer);
    for round in 0..10 {
        let key = format!("delete-race-{round}");
        let req = || post("/pay").key(&key).user("alice").json("{\"amount\":1}");
        let started = counters.started();
        assert_eq!(send(&router, req()).await.status, StatusCode::CREATED);
        let mut racing = JoinSet::new();
        for _ in 0..8 {
            let (router, request) = (router.clone(), req());
            racing.spawn(async move { send(&router, request).await.status });
        }
        let scope = self::key(&key, "alice", "POST /pay");
        let deleted = store.delete(&scope).await.expect("delete");
        assert_eq!(deleted, Deleted::Deleted, "round {round}");
        while let Some(status) = racing.join_next().await {
            let status = status.expect("task");
            assert!(
                status == StatusCode::CREATED || status == StatusCode::CONFLICT,
                "round {round}: {status}"
            );
        }
        let runs = counters.started() - started;
        assert!((1..=2).contains(&runs), "round {round}: {runs} runs");
        // The next request runs only if none of the racers came after the delete; then the key
        // is settled, and every later one is a replay of that run.
        let next = super::app::until_not_in_progress(&router, req, 200).await;
        assert_eq!(next.status, StatusCode::CREATED, "round {round}");
        let total = counters.started() - started;
        assert!(
            total == runs || (runs == 1 && total == 2 && !next.replayed()),
            "round {round}: {runs} runs in the race, {total} in all"
        );
        let settled = send(&router, req()).await;
        assert!(settled.replayed(), "round {round}");
        assert_eq!(
            counters.started() - started,
            total,
            "round {round}: no run after"
        );
    }
}
