//! Recovery points (SPEC 28): a store keeps an operation's steps with its record, fenced by the
//! lease, through retakes and releases of the same operation and not into another; a run that
//! takes a dead holder's record over resumes after the steps it recorded.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::suite::{claim_past_silence, claim_request, stored};
use crate::once::{OnceError, RunOnce};
use crate::store::{
    ClaimOutcome, Deleted, Fenced, IdempotencyStore, LeaseToken, RecordKey, RecordedStep,
};
use crate::{Fingerprint, StepError};

fn step(name: &str, result: &str) -> RecordedStep {
    RecordedStep {
        name: name.into(),
        result: result.as_bytes().to_vec(),
    }
}

fn lease_of(outcome: ClaimOutcome) -> LeaseToken {
    match outcome {
        ClaimOutcome::Claimed { lease, .. } => lease,
        other => panic!("expected a claim, got {other:?}"),
    }
}

/// Steps are recorded and read by the lease that holds the record in progress only; a step sent
/// twice counts once; a retake of the same operation (its holder dead) and the retry of a released
/// run find them; a late step of the holder presumed dead changes nothing; another request that
/// takes a released record, and a key claimed again after its retention, start with none.
pub async fn steps_are_kept_by_the_operation_and_fenced_by_the_lease<S: IdempotencyStore>(
    store: S,
) {
    let ttl = Duration::from_millis(200);
    let first = claim_request("s", ttl);
    let l1 = lease_of(store.claim(&first).await.expect("claim"));
    let key = &first.key;
    assert_eq!(store.steps(key, l1).await.expect("steps"), Some(vec![]));
    let (a, b) = (step("reserve", r#"{"id":7}"#), step("charge", r#""ch_1""#));
    for s in [&a, &b, &a] {
        let done = store.record_step(key, l1, s).await.expect("record");
        assert_eq!(done, Fenced::Done, "{}", s.name);
    }
    assert_eq!(
        store.steps(key, l1).await.expect("steps"),
        Some(vec![a.clone(), b.clone()]),
        "in order, a step sent twice once"
    );
    // A lease that does not hold the record reads and writes nothing.
    let stranger = LeaseToken::generate();
    assert_eq!(store.steps(key, stranger).await.expect("steps"), None);
    let late = store.record_step(key, stranger, &step("x", "1")).await;
    assert_eq!(late.expect("record"), Fenced::LeaseLost);

    // The holder dies; a retake of the same operation finds its steps.
    tokio::time::sleep(ttl + Duration::from_millis(100)).await;
    let retaker = first.from_another_request();
    let l2 = lease_of(claim_past_silence(&store, &retaker, ttl).await);
    assert_eq!(
        store.steps(key, l2).await.expect("steps"),
        Some(vec![a.clone(), b.clone()])
    );
    // The dead holder wakes up: its step is fenced off, and it reads nothing.
    let late = store.record_step(key, l1, &step("receipt", "1")).await;
    assert_eq!(late.expect("record"), Fenced::LeaseLost, "a late step");
    assert_eq!(store.steps(key, l1).await.expect("steps"), None);
    let c = step("receipt", r#"true"#);
    assert_eq!(
        store.record_step(key, l2, &c).await.expect("record"),
        Fenced::Done
    );

    // Released, retried with the same request: the same operation, its steps.
    assert!(store.release(key, l2).await.expect("release").is_done());
    assert_eq!(store.steps(key, l2).await.expect("steps"), None);
    let retry = first.from_another_request();
    let l3 = lease_of(store.claim(&retry).await.expect("claim"));
    let all = vec![a.clone(), b.clone(), c.clone()];
    assert_eq!(store.steps(key, l3).await.expect("steps"), Some(all));

    // Released, taken by another request: another operation, no steps.
    assert!(store.release(key, l3).await.expect("release").is_done());
    let mut other = first.from_another_request();
    other.fingerprint = Fingerprint::of(None, b"{\"other\":true}");
    let l4 = lease_of(store.claim(&other).await.expect("claim"));
    assert_eq!(store.steps(key, l4).await.expect("steps"), Some(vec![]));
    let d = step("reserve", r#"{"id":8}"#);
    assert_eq!(
        store.record_step(key, l4, &d).await.expect("record"),
        Fenced::Done
    );
    assert_eq!(
        store.steps(key, l4).await.expect("steps"),
        Some(vec![d.clone()])
    );

    // Finished: its steps are no one's to write any more.
    let done = store
        .complete(
            key,
            l4,
            &other.fingerprint,
            stored("done"),
            Duration::from_millis(300),
        )
        .await
        .expect("complete");
    assert!(done.is_done());
    assert_eq!(store.steps(key, l4).await.expect("steps"), None);
    let late = store.record_step(key, l4, &step("y", "1")).await;
    assert_eq!(late.expect("record"), Fenced::LeaseLost);

    // Past its retention the key is new: no steps.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let again = other.from_another_request();
    let l5 = lease_of(store.claim(&again).await.expect("claim"));
    assert_eq!(store.steps(key, l5).await.expect("steps"), Some(vec![]));
}

/// A run that takes over the record of a holder that died after two of its three steps returns
/// their recorded results without running them, and runs only the third; its output is recorded
/// once, and a later call replays it. A step whose work fails is not recorded, and runs again.
pub async fn a_retake_resumes_after_the_recorded_steps<S: IdempotencyStore>(store: S) {
    let ttl = Duration::from_secs(1);
    let once = RunOnce::builder(store.clone())
        .in_progress_ttl(ttl)
        .build()
        .expect("run once");
    // The dead run: it claimed, reserved and charged, then its process died.
    let dead = claim_request("resume", ttl);
    let lease = lease_of(store.claim(&dead).await.expect("claim"));
    for s in [step("reserve", "41"), step("charge", r#""ch_9""#)] {
        let done = store.record_step(&dead.key, lease, &s).await.expect("step");
        assert_eq!(done, Fenced::Done);
    }
    let runs: [Arc<AtomicUsize>; 3] = Default::default();
    let deadline = Instant::now() + ttl * 10;
    let output = loop {
        let runs = runs.clone();
        let out = once
            .run(dead.key.clone(), dead.fingerprint, move |ctx| async move {
                assert!(ctx.is_retake(), "the dead run's record is taken over");
                let r = runs.clone();
                let reserved: u64 = ctx
                    .step("reserve", || async move {
                        r[0].fetch_add(1, Ordering::SeqCst);
                        Ok::<_, String>(1)
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                let r = runs.clone();
                let charge: String = ctx
                    .step("charge", || async move {
                        r[1].fetch_add(1, Ordering::SeqCst);
                        Ok::<_, String>("ch_new".to_owned())
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                // The receipt's first try fails: not recorded, and tried again at once.
                let r = runs.clone();
                let failed = ctx
                    .step("receipt", || async move {
                        r[2].fetch_add(1, Ordering::SeqCst);
                        Err::<bool, _>("mail server down".to_owned())
                    })
                    .await;
                assert!(matches!(failed, Err(StepError::Failed(_))), "{failed:?}");
                let r = runs.clone();
                let sent: bool = ctx
                    .step("receipt", || async move {
                        r[2].fetch_add(1, Ordering::SeqCst);
                        Ok::<_, String>(true)
                    })
                    .await
                    .map_err(|e| e.to_string())?;
                Ok::<_, String>(format!("{reserved}/{charge}/{sent}"))
            })
            .await;
        match out {
            Err(OnceError::InProgress) if Instant::now() < deadline => {
                tokio::time::sleep(ttl / 4).await;
            }
            Ok(output) => break output,
            Err(e) => panic!("the retake runs: {e:?}"),
        }
    };
    assert_eq!(
        output, "41/ch_9/true",
        "the recorded results, then the rest"
    );
    let counts: Vec<usize> = runs.iter().map(|r| r.load(Ordering::SeqCst)).collect();
    assert_eq!(counts, [0, 0, 2], "only what was left ran");
    // Recorded once: a later call replays it and runs nothing.
    let replay = once
        .run(dead.key.clone(), dead.fingerprint, |_ctx| async move {
            Ok::<String, String>("ran again".into())
        })
        .await
        .expect("replay");
    assert_eq!(replay, "41/ch_9/true");
}

/// The most an operation may record, whole: [`MAX_STEPS`](crate::MAX_STEPS) steps of names
/// [`MAX_STEP_NAME`](crate::MAX_STEP_NAME) bytes long and results of
/// [`MAX_STEP_RESULT`](crate::MAX_STEP_RESULT) bytes (any bytes: the engine's JSON is one case of
/// them), read back as written, in order.
pub async fn the_largest_steps_are_kept_whole<S: IdempotencyStore>(store: S) {
    let request = claim_request("large-steps", Duration::from_secs(60));
    let lease = lease_of(store.claim(&request).await.expect("claim"));
    let steps: Vec<RecordedStep> = (0..crate::MAX_STEPS)
        .map(|i| {
            let mut name = format!("{i:02}-");
            name.push_str(&"ü".repeat((crate::MAX_STEP_NAME - name.len()) / 2));
            while name.len() < crate::MAX_STEP_NAME {
                name.push('n');
            }
            let result = (0..crate::MAX_STEP_RESULT)
                .map(|j| (i * 31 + j) as u8)
                .collect();
            RecordedStep { name, result }
        })
        .collect();
    for s in &steps {
        assert_eq!(s.name.len(), crate::MAX_STEP_NAME);
        let done = store.record_step(&request.key, lease, s).await;
        assert_eq!(done.expect("record a large step"), Fenced::Done);
    }
    let read = store.steps(&request.key, lease).await.expect("steps");
    let read = read.expect("held");
    assert_eq!(read.len(), steps.len());
    assert!(read == steps, "every step read back as written");
}

/// What inspection shows of `key`'s steps, and whether `lookup` finds its record live.
async fn inspected<S: IdempotencyStore>(store: &S, key: &RecordKey) -> (Vec<RecordedStep>, bool) {
    let steps = store.recorded_steps(key).await.expect("recorded steps");
    let live = store.lookup(key).await.expect("lookup").is_some();
    (steps, live)
}

/// Inspection shows an operation's steps, in the order they were recorded, while its record is in
/// progress and once it has finished (a finished record keeps the steps of the run that finished
/// it), and only where [`lookup`](IdempotencyStore::lookup) finds a live record: none for a key
/// never claimed (another key, another subject), a released record (whose retry by the same
/// request shows them again), a record another request took (another operation), a deleted
/// record, or one past its retention.
pub async fn inspection_shows_the_recorded_steps<S: IdempotencyStore>(store: S) {
    let ttl = Duration::from_secs(30);
    let first = claim_request("inspected-steps", ttl);
    let key = &first.key;
    let lease = lease_of(store.claim(&first).await.expect("claim"));
    assert_eq!(
        inspected(&store, key).await,
        (vec![], true),
        "none recorded yet"
    );
    let (a, b) = (step("reserve", r#"{"id":7}"#), step("charge", r#""ch_1""#));
    for s in [&a, &b] {
        let done = store.record_step(key, lease, s).await.expect("record");
        assert_eq!(done, Fenced::Done, "{}", s.name);
    }
    let both = vec![a.clone(), b.clone()];
    assert_eq!(
        inspected(&store, key).await,
        (both.clone(), true),
        "in progress: in the order recorded"
    );
    // Inspection reads: the holder still holds the record, and its steps.
    assert_eq!(
        store.steps(key, lease).await.expect("steps"),
        Some(both.clone())
    );

    // Another key, and the same key of another subject, show none of them.
    let stranger = claim_request("inspected-steps-stranger", ttl).key;
    assert_eq!(
        inspected(&store, &stranger).await,
        (vec![], false),
        "another key"
    );
    let mut elsewhere = key.clone();
    elsewhere.subject = "mallory".into();
    assert_eq!(
        inspected(&store, &elsewhere).await,
        (vec![], false),
        "another subject"
    );

    // Finished: the record keeps the steps of the run that finished it, until its retention.
    let retention = Duration::from_millis(1500);
    let done = store
        .complete(key, lease, &first.fingerprint, stored("done"), retention)
        .await
        .expect("complete");
    assert!(done.is_done());
    assert_eq!(
        inspected(&store, key).await,
        (both.clone(), true),
        "finished: the steps of its run"
    );

    // Released: no live record, and no steps shown; the same request's retry finds its
    // operation's steps again.
    let other = claim_request("inspected-steps-released", ttl);
    let k = &other.key;
    let l1 = lease_of(store.claim(&other).await.expect("claim"));
    let c = step("reserve", "1");
    assert_eq!(
        store.record_step(k, l1, &c).await.expect("record"),
        Fenced::Done
    );
    assert_eq!(inspected(&store, k).await, (vec![c.clone()], true));
    assert!(store.release(k, l1).await.expect("release").is_done());
    assert_eq!(inspected(&store, k).await, (vec![], false), "released");
    let l2 = lease_of(
        store
            .claim(&other.from_another_request())
            .await
            .expect("claim"),
    );
    assert_eq!(
        inspected(&store, k).await,
        (vec![c.clone()], true),
        "the same operation again, its steps"
    );

    // Released again and taken by another request: another operation, which has none.
    assert!(store.release(k, l2).await.expect("release").is_done());
    let mut another = other.from_another_request();
    another.fingerprint = Fingerprint::of(None, b"{\"other\":true}");
    let l3 = lease_of(store.claim(&another).await.expect("claim"));
    assert_eq!(
        inspected(&store, k).await,
        (vec![], true),
        "another request's operation has none of the released run's steps"
    );
    let d = step("refund", r#""re_1""#);
    assert_eq!(
        store.record_step(k, l3, &d).await.expect("record"),
        Fenced::Done
    );
    let done = store
        .complete(k, l3, &another.fingerprint, stored("other"), ttl)
        .await
        .expect("complete");
    assert!(done.is_done());
    assert_eq!(inspected(&store, k).await, (vec![d], true), "finished");

    // Deleted: no steps shown.
    assert_eq!(store.delete(k).await.expect("delete"), Deleted::Deleted);
    assert_eq!(inspected(&store, k).await, (vec![], false), "deleted");

    // Past its retention: no steps shown.
    tokio::time::sleep(retention + Duration::from_millis(300)).await;
    assert_eq!(
        inspected(&store, key).await,
        (vec![], false),
        "past its retention"
    );
}
