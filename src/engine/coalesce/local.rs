//! What this process knows of the claims it is making and holding, so that a duplicate arriving at
//! the same instance is answered without a round trip to the store.
//!
//! - While a claim of a scope is on its way to the store, other claims of that scope in this
//!   process wait for its answer (one round trip, bounded by the store's timeout) instead of each
//!   sending their own, and answer from it: the record is then in progress (`409`), finished (the
//!   replay), or has another fingerprint (`422`). When its answer does not settle theirs (it failed,
//!   or it was a `422` for a body they do not share), they ask the store themselves.
//! - While this process holds a scope's lease (from its claim to its completion or release, and no
//!   longer than the in-progress TTL after its last renewal), a claim of that scope here is answered
//!   `409`, or `422` for another body, at once.
//!
//! Nothing here ever answers "claimed": only the store grants a claim, so a handler cannot run twice
//! because of this; at worst a duplicate gets `409` where the store would have answered sooner.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::store::Fingerprint;
use crate::store::StoreError;
use crate::store::{ClaimOutcome, LeaseToken};
use crate::util::lock::lock;

use super::scope::{ByScope, Scope};

const SHARDS: usize = 16;

/// The answer a claim in flight got, as its followers need it.
#[derive(Clone)]
pub(super) enum Settled {
    /// Not yet.
    Pending,
    /// The store answered.
    Answered(ClaimOutcome),
    /// The store failed; its error, for the followers to answer with (`503`) rather than each
    /// waiting for a failing store again, and whether the record was unreadable (then a follower
    /// must not fail open either: the record says the operation happened).
    Failed(Arc<str>, bool),
}

enum Local {
    InFlight {
        fingerprint: Fingerprint,
        number: u64,
        /// Made when the first follower arrives: a claim that none follows costs no channel.
        answer: Option<watch::Sender<Settled>>,
    },
    Held {
        fingerprint: Fingerprint,
        lease: LeaseToken,
        ttl: Duration,
        until: Instant,
        /// Made when the first waiter arrives; dropped with the hold, which wakes the waiters.
        released: Option<watch::Sender<()>>,
    },
}

#[derive(Default)]
struct Shard {
    scopes: HashMap<Scope, Local, ByScope>,
    next: u64,
}

/// Claims entered in a shard between two sweeps of its holds past their TTL (holds that were never
/// let go, say by a lease dropped outside a runtime), so the map stays bounded without a purge.
const SWEEP_EVERY: u64 = 1024;

#[derive(Default)]
pub(crate) struct LocalClaims {
    shards: [Mutex<Shard>; SHARDS],
}

/// What a claim does, given what this process knows of its scope.
pub(super) enum Entry {
    /// Answer this, without the store.
    Answer(ClaimOutcome),
    /// Wait for the claim in flight, then [`LocalClaims::follow`] its answer.
    Follow(Fingerprint, watch::Receiver<Settled>),
    /// Ask the store, then [`Leader::settle`].
    Lead(Leader),
}

/// The claim in flight of a scope; dropped without [`Leader::settle`] (cancelled), its followers
/// ask the store themselves.
pub(super) struct Leader {
    claims: Arc<LocalClaims>,
    scope: Scope,
    number: u64,
    settled: bool,
}

impl LocalClaims {
    fn shard(&self, scope: &Scope) -> MutexGuard<'_, Shard> {
        lock(&self.shards[scope.shard(SHARDS)])
    }

    /// What a claim of `scope` with `fingerprint` does.
    pub(super) fn enter(
        self: &Arc<Self>,
        scope: Scope,
        fingerprint: Fingerprint,
        lease: LeaseToken,
    ) -> Entry {
        let now = Instant::now();
        let mut shard = self.shard(&scope);
        match shard.scopes.get_mut(&scope) {
            // Held by this very lease: the same claim made twice; the store answers it.
            Some(Local::Held {
                fingerprint: held,
                until,
                lease: holder,
                ..
            }) if *until > now && *holder != lease => {
                return Entry::Answer(if *held == fingerprint {
                    ClaimOutcome::InProgress
                } else {
                    ClaimOutcome::KeyReuse
                });
            }
            Some(Local::InFlight {
                fingerprint: leader,
                answer,
                ..
            }) => {
                let receiver = match answer {
                    Some(sender) => sender.subscribe(),
                    None => {
                        let (sender, receiver) = watch::channel(Settled::Pending);
                        *answer = Some(sender);
                        receiver
                    }
                };
                return Entry::Follow(*leader, receiver);
            }
            // A hold past its TTL without renewal: let the store say what the record is now.
            Some(Local::Held { .. }) | None => {}
        }
        shard.next += 1;
        if shard.next.is_multiple_of(SWEEP_EVERY) {
            shard
                .scopes
                .retain(|_, local| !matches!(local, Local::Held { until, .. } if *until <= now));
        }
        let number = shard.next;
        shard.scopes.insert(
            scope,
            Local::InFlight {
                fingerprint,
                number,
                answer: None,
            },
        );
        Entry::Lead(Leader {
            claims: self.clone(),
            scope,
            number,
            settled: false,
        })
    }

    /// The answer of a follower with `fingerprint` to the claim in flight of `leader`'s
    /// fingerprint; `Ok(None)` when it must ask the store itself (the leader was cancelled, or its
    /// answer does not settle this one).
    /// A follower waits at most `patience`: an answer later than that is not trusted by its leader
    /// either (see [`Leader::settle`]), so past it the follower asks the store itself.
    pub(super) async fn follow(
        leader: Fingerprint,
        fingerprint: Fingerprint,
        mut answer: watch::Receiver<Settled>,
        patience: Duration,
    ) -> Result<Option<ClaimOutcome>, StoreError> {
        let waited = tokio::time::timeout(
            patience,
            answer.wait_for(|s| !matches!(s, Settled::Pending)),
        )
        .await;
        let settled = match waited {
            Ok(Ok(settled)) => settled.clone(),
            Ok(Err(_)) | Err(_) => return Ok(None),
        };
        let same = leader == fingerprint;
        Ok(match settled {
            // The record is there and cannot be read. Stores say so only for the body they were
            // asked with (another one gets `422` without the record being opened), so only the
            // followers with the leader's body share the error; they must not fail open either:
            // the record says the operation happened.
            Settled::Failed(error, true) if same => {
                return Err(StoreError::unreadable_record(format!(
                    "the claim in flight for this key met an unreadable record: {error}"
                )));
            }
            // Any other failure may be the leader's alone (a timeout whose claim committed late):
            // answering the followers with it would let a layer that fails open run each of them
            // unguarded. They ask the store themselves.
            Settled::Failed(_, false) => None,
            // The leader's claim was granted: the record is in progress with its fingerprint.
            Settled::Answered(ClaimOutcome::Claimed { .. }) => Some(if same {
                ClaimOutcome::InProgress
            } else {
                ClaimOutcome::KeyReuse
            }),
            // In progress: with the leader's fingerprint as a rule, but not always (a store may
            // answer it for a record it could not retake, whatever its fingerprint), so only the
            // same body is settled.
            Settled::Answered(ClaimOutcome::InProgress) if same => Some(ClaimOutcome::InProgress),
            // Finished, with the leader's fingerprint.
            Settled::Answered(ClaimOutcome::Finished(response)) => Some(if same {
                ClaimOutcome::Finished(response)
            } else {
                ClaimOutcome::KeyReuse
            }),
            // The record's fingerprint is not the leader's: the same body gets the same answer;
            // another one may be the record's own.
            Settled::Answered(ClaimOutcome::KeyReuse) if same => Some(ClaimOutcome::KeyReuse),
            _ => None,
        })
    }

    /// This process no longer holds `scope` by `lease` (completed, released, or lost).
    pub(crate) fn let_go(&self, scope: &Scope, lease: LeaseToken) {
        let mut shard = self.shard(scope);
        if matches!(shard.scopes.get(scope), Some(Local::Held { lease: held, .. }) if *held == lease)
        {
            shard.scopes.remove(scope);
        }
    }

    /// `lease` was renewed: the hold lasts another TTL.
    pub(crate) fn renewed(&self, scope: &Scope, lease: LeaseToken) {
        let mut shard = self.shard(scope);
        if let Some(Local::Held {
            lease: held,
            ttl,
            until,
            ..
        }) = shard.scopes.get_mut(scope)
            && *held == lease
        {
            *until = Instant::now() + *ttl;
        }
    }

    /// A receiver that wakes (its sender dropped) when this process lets go of `scope`, if it
    /// holds it now; `None` when it does not (a waiter then asks the store).
    pub(crate) fn watch(&self, scope: &Scope) -> Option<watch::Receiver<()>> {
        let now = Instant::now();
        let mut shard = self.shard(scope);
        match shard.scopes.get_mut(scope) {
            Some(Local::Held {
                until, released, ..
            }) if *until > now => Some(match released {
                Some(sender) => sender.subscribe(),
                None => {
                    let (sender, receiver) = watch::channel(());
                    *released = Some(sender);
                    receiver
                }
            }),
            _ => None,
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.shards.iter().map(|s| lock(s).scopes.len()).sum()
    }
}

impl Leader {
    /// The store answered `outcome` (`None`: it failed): tell the followers, and hold the scope if
    /// the claim was granted.
    pub(super) fn settle(
        mut self,
        fingerprint: Fingerprint,
        ttl: Duration,
        outcome: Result<&ClaimOutcome, &StoreError>,
    ) {
        self.settled = true;
        let mut shard = self.claims.shard(&self.scope);
        let ours = matches!(
            shard.scopes.get(&self.scope),
            Some(Local::InFlight { number, .. }) if *number == self.number
        );
        if !ours {
            return;
        }
        let held = match outcome {
            Ok(ClaimOutcome::Claimed { lease, .. }) => Some(Local::Held {
                fingerprint,
                lease: *lease,
                ttl,
                until: Instant::now() + ttl,
                released: None,
            }),
            _ => None,
        };
        let was = match held {
            Some(held) => shard.scopes.insert(self.scope, held),
            None => shard.scopes.remove(&self.scope),
        };
        drop(shard);
        if let Some(Local::InFlight {
            answer: Some(answer),
            ..
        }) = was
        {
            answer.send_replace(match outcome {
                Ok(outcome) => Settled::Answered(outcome.clone()),
                Err(error) => {
                    Settled::Failed(error.to_string().into(), error.is_unreadable_record())
                }
            });
        }
    }
}

impl Drop for Leader {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        // Cancelled before the store answered: forget the claim in flight; its channel, if any,
        // goes with it, and the followers see it closed and ask the store themselves.
        let mut shard = self.claims.shard(&self.scope);
        let was = if matches!(
            shard.scopes.get(&self.scope),
            Some(Local::InFlight { number, .. }) if *number == self.number
        ) {
            shard.scopes.remove(&self.scope)
        } else {
            None
        };
        drop(shard);
        drop(was);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fp(b: u8) -> Fingerprint {
        Fingerprint::of(None, &[b])
    }

    const TTL: Duration = Duration::from_secs(60);

    #[tokio::test]
    async fn followers_answer_from_the_leader() {
        let claims = Arc::new(LocalClaims::default());
        let Entry::Lead(leader) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("the first claim leads");
        };
        let Entry::Follow(leader_fp, same) =
            claims.enter(Scope::numbered(1), fp(1), LeaseToken(99))
        else {
            panic!("the second follows");
        };
        let Entry::Follow(_, other) = claims.enter(Scope::numbered(1), fp(2), LeaseToken(99))
        else {
            panic!("the third follows");
        };
        let same = tokio::spawn(LocalClaims::follow(leader_fp, fp(1), same, TTL));
        let other = tokio::spawn(LocalClaims::follow(leader_fp, fp(2), other, TTL));
        let lease = LeaseToken(7);
        leader.settle(
            fp(1),
            TTL,
            Ok(&ClaimOutcome::Claimed {
                lease,
                generation: None,
            }),
        );
        assert_eq!(
            same.await.expect("task").expect("settled"),
            Some(ClaimOutcome::InProgress)
        );
        assert_eq!(
            other.await.expect("task").expect("settled"),
            Some(ClaimOutcome::KeyReuse)
        );
        // Held now: answered at once.
        assert!(matches!(
            claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)),
            Entry::Answer(ClaimOutcome::InProgress)
        ));
        claims.renewed(&Scope::numbered(1), lease);
        assert!(matches!(
            claims.shard(&Scope::numbered(1)).scopes.get(&Scope::numbered(1)),
            Some(Local::Held { until, .. }) if *until > Instant::now() + TTL - Duration::from_secs(1)
        ));
        claims.let_go(&Scope::numbered(1), LeaseToken(8));
        assert_eq!(claims.len(), 1, "another lease lets nothing go");
        claims.let_go(&Scope::numbered(1), lease);
        assert_eq!(claims.len(), 0);
    }

    #[tokio::test]
    async fn a_failed_or_cancelled_leader_sends_followers_to_the_store() {
        let claims = Arc::new(LocalClaims::default());
        let Entry::Lead(leader) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("leads");
        };
        let Entry::Follow(l, rx) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("follows");
        };
        leader.settle(fp(1), TTL, Err(&StoreError::msg("down")));
        // A plain failure may be the leader's alone: the followers ask the store themselves.
        assert!(matches!(
            LocalClaims::follow(l, fp(1), rx, TTL).await,
            Ok(None)
        ));
        assert_eq!(claims.len(), 0);

        // A record that could not be read stays unreadable for the followers: they must not
        // fail open and run the operation again.
        let Entry::Lead(leader) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("leads");
        };
        let Entry::Follow(l, rx) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("follows");
        };
        let Entry::Follow(_, other) = claims.enter(Scope::numbered(1), fp(2), LeaseToken(99))
        else {
            panic!("follows");
        };
        leader.settle(fp(1), TTL, Err(&StoreError::unreadable_record("sealed")));
        let failed = LocalClaims::follow(l, fp(1), rx, TTL).await;
        assert!(failed.is_err_and(|e| e.is_unreadable_record()));
        // Another body would get `422` from the store, which does not open the record for it.
        assert!(matches!(
            LocalClaims::follow(l, fp(2), other, TTL).await,
            Ok(None)
        ));
        assert_eq!(claims.len(), 0);

        let Entry::Lead(leader) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("leads");
        };
        let Entry::Follow(l, rx) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("follows");
        };
        drop(leader);
        assert!(matches!(
            LocalClaims::follow(l, fp(1), rx, TTL).await,
            Ok(None)
        ));
        assert_eq!(claims.len(), 0);

        // A mismatch settles only the followers with the leader's body.
        let Entry::Lead(leader) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("leads");
        };
        let Entry::Follow(l, same) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("follows");
        };
        let Entry::Follow(_, other) = claims.enter(Scope::numbered(1), fp(2), LeaseToken(99))
        else {
            panic!("follows");
        };
        leader.settle(fp(1), TTL, Ok(&ClaimOutcome::KeyReuse));
        assert!(matches!(
            LocalClaims::follow(l, fp(1), same, TTL).await,
            Ok(Some(ClaimOutcome::KeyReuse))
        ));
        assert!(matches!(
            LocalClaims::follow(l, fp(2), other, TTL).await,
            Ok(None)
        ));

        // "In progress" settles only the followers with the leader's body: a store may answer it
        // for a record with another fingerprint (one it could not retake).
        let Entry::Lead(leader) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("leads");
        };
        let Entry::Follow(l, same) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("follows");
        };
        let Entry::Follow(_, other) = claims.enter(Scope::numbered(1), fp(2), LeaseToken(99))
        else {
            panic!("follows");
        };
        leader.settle(fp(1), TTL, Ok(&ClaimOutcome::InProgress));
        assert!(matches!(
            LocalClaims::follow(l, fp(1), same, TTL).await,
            Ok(Some(ClaimOutcome::InProgress))
        ));
        assert!(matches!(
            LocalClaims::follow(l, fp(2), other, TTL).await,
            Ok(None)
        ));
    }

    #[tokio::test]
    async fn a_hold_lasts_a_ttl_without_renewal() {
        let claims = Arc::new(LocalClaims::default());
        let ttl = Duration::from_millis(50);
        let Entry::Lead(leader) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("leads");
        };
        let claimed = ClaimOutcome::Claimed {
            lease: LeaseToken(1),
            generation: None,
        };
        leader.settle(fp(1), ttl, Ok(&claimed));
        assert!(matches!(
            claims.enter(Scope::numbered(1), fp(2), LeaseToken(99)),
            Entry::Answer(ClaimOutcome::KeyReuse)
        ));
        tokio::time::sleep(Duration::from_millis(60)).await;
        // Claims of other scopes in its shard sweep it out within `SWEEP_EVERY` of them.
        for n in 1..=SWEEP_EVERY {
            drop(claims.enter(Scope::numbered(1 + 16 * n), fp(1), LeaseToken(99)));
        }
        assert_eq!(claims.len(), 0);
        assert!(matches!(
            claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)),
            Entry::Lead(_)
        ));
    }

    #[tokio::test(start_paused = true)]
    async fn a_follower_waits_no_longer_than_its_patience() {
        let claims = Arc::new(LocalClaims::default());
        let Entry::Lead(leader) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("leads");
        };
        let Entry::Follow(l, rx) = claims.enter(Scope::numbered(1), fp(1), LeaseToken(99)) else {
            panic!("follows");
        };
        let started = tokio::time::Instant::now();
        let patience = Duration::from_secs(9);
        assert!(matches!(
            LocalClaims::follow(l, fp(1), rx, patience).await,
            Ok(None)
        ));
        assert_eq!(started.elapsed(), patience, "then it asks the store itself");
        drop(leader);
    }
}
