//! Statements together (SPEC 26), as every store that sends them together must keep it: requests
//! that race each get their own answer.

use std::time::Duration;

use axum_idempotency::conformance::app::claim_request;
use axum_idempotency::store::{ClaimOutcome, ClaimRequest, Finished, IdempotencyStore, LeaseToken};

/// Rounds of claims that race on real connections: every key claimed by three requests at once
/// (two with its body, one with another), then the winners' completions (each with an answer of
/// its own, headers and all) and releases at once, then every key claimed again. Each request
/// gets its own answer: one grant per key, `409` for the same body, `422` for another, each key's
/// own recorded answer, a released key granted again. For the stores that send statements
/// together (SPEC 26).
pub(crate) async fn racing_requests_each_get_their_own_answer<S>(store: S)
where
    S: IdempotencyStore + Clone + Send + Sync + 'static,
{
    use axum::http::{HeaderName, HeaderValue};
    use axum_idempotency::store::{Fenced, StoredResponse};
    use std::collections::HashMap;
    use std::sync::Arc;

    for round in 0..8 {
        let key = |k: usize| format!("r{round}-k{k}");
        let mut claims = Vec::new();
        for k in 0..24 {
            for copy in 0..3 {
                let (store, key) = (store.clone(), key(k));
                let body = if copy == 2 {
                    format!("other {k}")
                } else {
                    format!("body {k}")
                };
                claims.push(tokio::spawn(async move {
                    let request = claim_request(&key, body.as_bytes());
                    let outcome = store.claim(&request).await.expect("claim");
                    (k, request, outcome)
                }));
            }
        }
        let mut winners: HashMap<usize, ClaimRequest> = HashMap::new();
        let mut answers = Vec::new();
        for claim in claims {
            let (k, request, outcome) = claim.await.expect("claim task");
            if let ClaimOutcome::Claimed { lease, .. } = outcome {
                assert_eq!(lease, request.lease, "a grant under the claim's own lease");
                let earlier = winners.insert(k, request.clone());
                assert!(earlier.is_none(), "key {k} granted twice in round {round}");
            }
            answers.push((k, request, outcome));
        }
        assert_eq!(winners.len(), 24, "every key granted once");
        for (k, request, outcome) in &answers {
            let winner = &winners[k];
            match outcome {
                ClaimOutcome::Claimed { .. } => assert_eq!(request.lease, winner.lease),
                ClaimOutcome::InProgress => {
                    assert_eq!(
                        request.fingerprint, winner.fingerprint,
                        "409 for the same body"
                    )
                }
                ClaimOutcome::KeyReuse => {
                    assert_ne!(request.fingerprint, winner.fingerprint, "422 for another")
                }
                other => panic!("key {k}: {other:?} while it was held"),
            }
        }
        // Completions (each its own answer) and releases, all at once.
        let finishes: Vec<_> = winners
            .iter()
            .map(|(k, request)| {
                let (store, request, k) = (store.clone(), request.clone(), *k);
                tokio::spawn(async move {
                    if k % 4 == 3 {
                        return store.release(&request.key, request.lease).await;
                    }
                    let headers = (0..k % 3)
                        .map(|h| {
                            (
                                HeaderName::from_static("x-part"),
                                HeaderValue::from_str(&format!("{k}.{h}")).expect("value"),
                            )
                        })
                        .collect();
                    let response = StoredResponse::new(
                        if k % 4 == 2 {
                            Finished::Failed
                        } else {
                            Finished::Completed
                        },
                        200 + k as u16,
                        headers,
                        (k % 5 != 4).then(|| format!("answer {k}").into()),
                    );
                    store
                        .complete(
                            &request.key,
                            request.lease,
                            &request.fingerprint,
                            Arc::new(response),
                            Duration::from_secs(3600),
                        )
                        .await
                })
            })
            .collect();
        for finish in finishes {
            assert_eq!(finish.await.expect("task").expect("finish"), Fenced::Done);
        }
        // Every key again, at once: its own answer, or a new grant once released.
        let again: Vec<_> = winners
            .iter()
            .map(|(k, winner)| {
                let (store, k) = (store.clone(), *k);
                let request = ClaimRequest {
                    lease: LeaseToken::generate(),
                    ..winner.clone()
                };
                tokio::spawn(async move { (k, store.claim(&request).await) })
            })
            .collect();
        for task in again {
            let (k, outcome) = task.await.expect("task");
            match outcome.expect("claim again") {
                ClaimOutcome::Claimed { .. } => {
                    assert_eq!(k % 4, 3, "key {k} granted again")
                }
                ClaimOutcome::Finished(response) => {
                    assert_ne!(k % 4, 3, "a released key {k} replayed");
                    assert_eq!(response.status, 200 + k as u16, "key {k}'s own status");
                    let parts: Vec<String> = response
                        .headers
                        .iter()
                        .filter(|(name, _)| name.as_str() == "x-part")
                        .map(|(_, value)| value.to_str().expect("ascii").to_owned())
                        .collect();
                    let expected: Vec<String> = (0..k % 3).map(|h| format!("{k}.{h}")).collect();
                    assert_eq!(parts, expected, "key {k}'s own headers");
                    if k % 5 == 4 {
                        assert!(response.body_omitted, "key {k}: its body left out");
                    } else {
                        assert_eq!(response.body, format!("answer {k}").as_bytes());
                    }
                }
                other => panic!("key {k} answered {other:?} after its finish"),
            }
        }
    }
}
