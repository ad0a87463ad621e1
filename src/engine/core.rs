//! [`Engine`]: one store, its validated settings, and the state this process keeps about its
//! claims; and the store's operations as the engine makes them (timed, this process's holds kept
//! current). Nothing else in the crate calls the store.

use std::sync::Arc;
use std::time::Duration;

use super::coalesce::{self, LocalClaims, Scope};
use super::drain::Drain;
use super::keeper::{Keeper, Renewer};
use super::settings::{ConfigError, Settings};
use super::shares::{InFlight, Shares};
use super::waiters::Waiters;
use crate::store::{
    ClaimOutcome, ClaimRequest, Fenced, Fingerprint, IdempotencyStore, LeaseToken, RecordInfo,
    RecordKey, StoreError, StoredResponse,
};
use crate::util::metrics::timed;

/// One store, its settings, and the state this process keeps about its claims; clones share all
/// three.
pub(crate) struct Engine<St> {
    store: St,
    settings: Arc<Settings>,
    pub(super) state: Arc<State>,
    /// The task that renews every lease this engine holds.
    pub(super) keeper: Arc<Keeper<Engine<St>>>,
}

impl<St: Clone> Clone for Engine<St> {
    fn clone(&self) -> Self {
        Engine {
            store: self.store.clone(),
            settings: self.settings.clone(),
            state: self.state.clone(),
            keeper: self.keeper.clone(),
        }
    }
}

impl<St: std::fmt::Debug> std::fmt::Debug for Engine<St> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("store", &self.store)
            .field("settings", &self.settings)
            .field("drain", &self.state.drain)
            .finish()
    }
}

/// What the engine keeps while it runs: shared by every clone of a layer or `RunOnce`, never part
/// of the settings.
pub(super) struct State {
    /// Counts the work run on tasks of their own, and the requests admitted.
    pub(super) drain: Drain,
    /// This process's own claims and leases, answering duplicates that reach it.
    pub(super) local: Arc<LocalClaims>,
    /// The duplicates waiting now, by scope.
    pub(super) waiters: Waiters,
    /// Each subject's share of requests in flight, waiters and records.
    pub(super) shares: Arc<Shares>,
}

impl<St: IdempotencyStore> Engine<St> {
    /// An engine over `store`, once `settings` are valid (against the store's operation timeout
    /// too). Its background work is counted in `drain`.
    pub(crate) fn new(store: St, settings: Settings, drain: Drain) -> Result<Self, ConfigError> {
        settings.validate(store.operation_timeout())?;
        #[cfg(feature = "metrics")]
        crate::util::metrics::describe();
        Ok(Engine {
            store,
            settings: Arc::new(settings),
            state: Arc::new(State {
                drain,
                local: Arc::default(),
                waiters: Waiters::default(),
                shares: Arc::default(),
            }),
            keeper: Arc::default(),
        })
    }

    /// The store.
    pub(crate) fn store(&self) -> &St {
        &self.store
    }

    /// The settings.
    pub(crate) fn settings(&self) -> &Settings {
        &self.settings
    }

    /// A request of `subject` in flight at this instance, counted until the guard is dropped; or
    /// `None` when the subject has its share in flight already.
    pub(crate) fn in_flight(&self, subject: &str) -> Option<InFlight> {
        let shares = &self.state.shares;
        shares.enter(shares.id(subject), self.settings.max_in_flight_per_subject)
    }

    /// The drain its work is counted in.
    pub(crate) fn drain(&self) -> &Drain {
        &self.state.drain
    }

    /// How long one renewal may take: a sixth of the TTL, or the store's own operation timeout
    /// when that is longer (a healthy but slow store must not have every renewal cut short), at
    /// most half the TTL.
    pub(crate) fn renewal_bound(&self) -> Duration {
        let ttl = self.settings.in_progress_ttl;
        self.store
            .operation_timeout()
            .map_or(ttl / 6, |t| t.max(ttl / 6))
            .min(ttl / 2)
    }

    // The store's operations as the engine makes them: timed (feature `metrics`), and this
    // process's holds kept current. Nothing but these calls the store.

    pub(super) async fn store_claim(
        &self,
        request: &ClaimRequest,
    ) -> Result<ClaimOutcome, StoreError> {
        coalesce::claim(&self.state.local, request, |request| {
            timed("claim", self.store.claim(request))
        })
        .await
    }

    pub(super) async fn store_complete(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
        fingerprint: &Fingerprint,
        response: Arc<StoredResponse>,
    ) -> Result<Fenced, StoreError> {
        let done = timed(
            "complete",
            self.store
                .complete(key, lease, fingerprint, response, self.settings.retention),
        )
        .await;
        // Finished, or lost: either way not held here any more. After an error the completion is
        // tried again, and the record is still in progress as far as anyone knows.
        if done.is_ok() {
            self.let_go(key, lease);
        }
        done
    }

    pub(super) async fn store_renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Fenced, StoreError> {
        let lifetime = self.settings.in_progress_ttl + self.settings.retention;
        let renewed = timed("renew", self.store.renew(key, lease, lifetime)).await;
        match renewed {
            Ok(Fenced::Done) => self.state.local.renewed(&Scope::of(key), lease),
            Ok(Fenced::LeaseLost) => self.let_go(key, lease),
            Err(_) => {}
        }
        renewed
    }

    /// Renews `leases` in one call to the store (see [`Keeper`](super::keeper::Keeper)), each
    /// answer kept current in this process's holds as [`store_renew`](Self::store_renew) does.
    pub(super) async fn store_renew_many(
        &self,
        leases: &[(&RecordKey, LeaseToken)],
    ) -> Vec<Result<Fenced, StoreError>> {
        let lifetime = self.settings.in_progress_ttl + self.settings.retention;
        // Timed as one operation, an error when any renewal failed.
        let renewed = timed("renew", async {
            let answers = self.store.renew_many(leases, lifetime).await;
            if answers.iter().all(Result::is_ok) {
                Ok(answers)
            } else {
                Err(answers)
            }
        })
        .await
        .unwrap_or_else(|answers| answers);
        for ((key, lease), answer) in leases.iter().zip(&renewed) {
            match answer {
                Ok(Fenced::Done) => self.state.local.renewed(&Scope::of(key), *lease),
                Ok(Fenced::LeaseLost) => self.let_go(key, *lease),
                Err(_) => {}
            }
        }
        renewed
    }

    pub(super) async fn store_release(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Fenced, StoreError> {
        // Not held here from now on, whatever the store answers: if the release failed, the store
        // still says "in progress", which is what this process would have said.
        self.let_go(key, lease);
        timed("release", self.store.release(key, lease)).await
    }

    pub(super) async fn store_lookup(
        &self,
        key: &RecordKey,
    ) -> Result<Option<RecordInfo>, StoreError> {
        timed("lookup", self.store.lookup(key)).await
    }

    /// This process no longer holds `key` by `lease` (finished, released or lost).
    pub(super) fn let_go(&self, key: &RecordKey, lease: LeaseToken) {
        self.state.local.let_go(&Scope::of(key), lease);
    }
}

impl<St: IdempotencyStore> Renewer for Engine<St> {
    fn in_progress_ttl(&self) -> Duration {
        self.settings.in_progress_ttl
    }

    fn renewal_bound(&self) -> Duration {
        Engine::renewal_bound(self)
    }

    fn renew_many<'a>(
        &'a self,
        leases: &'a [(&'a RecordKey, LeaseToken)],
    ) -> impl Future<Output = Vec<Result<Fenced, StoreError>>> + Send + 'a {
        self.store_renew_many(leases)
    }
}
