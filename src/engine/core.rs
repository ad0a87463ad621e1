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
    ClaimOutcome, ClaimRequest, Fenced, Fingerprint, IdempotencyStore, LeaseToken, Presence,
    RecordInfo, RecordKey, StoreError, StoredResponse,
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
        settings.validate(store.operation_timeout(), store.counts_records())?;
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
            keeper: Keeper::new(),
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
    /// why not: the subject has its own bound in flight, or its share of the instance's places
    /// (`max_running`), or every place is taken.
    pub(crate) fn in_flight(&self, subject: &str) -> Result<InFlight, super::shares::Refused> {
        self.enter(self.state.shares.id(subject))
    }

    /// As [`in_flight`](Self::in_flight), for an anonymous caller that the application tells
    /// apart as `caller` (its shares only: its records stay in the anonymous scope).
    pub(crate) fn anonymous_in_flight(
        &self,
        caller: &str,
    ) -> Result<InFlight, super::shares::Refused> {
        self.enter(self.state.shares.caller_id(caller))
    }

    fn enter(&self, id: super::shares::SubjectId) -> Result<InFlight, super::shares::Refused> {
        self.state.shares.enter(
            id,
            self.settings.max_in_flight_per_subject,
            self.settings.max_running,
        )
    }

    /// The drain its work is counted in.
    pub(crate) fn drain(&self) -> &Drain {
        &self.state.drain
    }

    /// How long one renewal may take (see [`timing::renewal_bound`](super::timing::renewal_bound)).
    pub(crate) fn renewal_bound(&self) -> Duration {
        super::timing::renewal_bound(
            self.settings.in_progress_ttl,
            self.store.operation_timeout(),
        )
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
        let response_len = response.body.len();
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
        if let Ok(Fenced::Done) = done {
            self.recorded(&key.subject, response_len);
        }
        done
    }

    /// An answer of `bytes` was recorded for `subject`: it counts in the subject's share of bytes
    /// until its next count.
    pub(super) fn recorded(&self, subject: &str, bytes: usize) {
        if self.settings.max_bytes_per_subject.is_some() && bytes > 0 {
            let shares = &self.state.shares;
            shares.recorded(shares.id(subject), bytes);
        }
    }

    pub(super) async fn store_renew(
        &self,
        key: &RecordKey,
        lease: LeaseToken,
    ) -> Result<Fenced, StoreError> {
        let lifetime = self.settings.in_progress_lifetime();
        let renewed = timed("renew", self.store.renew(key, lease, lifetime)).await;
        match renewed {
            Ok(Fenced::Done) => self.state.local.renewed(&Scope::of(key), lease),
            Ok(Fenced::LeaseLost) => self.let_go(key, lease),
            Err(_) => {}
        }
        renewed
    }

    /// Renews `leases` in one call to `session` (the store's keeper session, or the store; see
    /// [`Keeper`](super::keeper::Keeper)), each answer kept current in this process's holds as
    /// [`store_renew`](Self::store_renew) does.
    pub(super) async fn store_renew_many(
        &self,
        session: &St,
        leases: &[(&RecordKey, LeaseToken)],
    ) -> Vec<Result<Fenced, StoreError>> {
        let lifetime = self.settings.in_progress_lifetime();
        // Timed as one operation, an error when any renewal failed.
        let renewed = timed("renew", async {
            let answers = session.renew_many(leases, lifetime).await;
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

/// An engine without its hold on its keeper: what the keeper's task keeps (see
/// [`Renewer::Weak`]).
pub(super) struct WeakEngine<St> {
    store: St,
    settings: Arc<Settings>,
    state: Arc<State>,
    keeper: std::sync::Weak<Keeper<Engine<St>>>,
}

impl<St: IdempotencyStore> Renewer for Engine<St> {
    type Session = St;
    type Weak = WeakEngine<St>;

    fn downgrade(&self) -> WeakEngine<St> {
        WeakEngine {
            store: self.store.clone(),
            settings: self.settings.clone(),
            state: self.state.clone(),
            keeper: Arc::downgrade(&self.keeper),
        }
    }

    fn upgrade(weak: &WeakEngine<St>) -> Option<Self> {
        Some(Engine {
            store: weak.store.clone(),
            settings: weak.settings.clone(),
            state: weak.state.clone(),
            keeper: weak.keeper.upgrade()?,
        })
    }

    fn keeper(&self) -> &Arc<Keeper<Self>> {
        &self.keeper
    }

    fn in_progress_ttl(&self) -> Duration {
        self.settings.in_progress_ttl
    }

    fn renewal_bound(&self) -> Duration {
        Engine::renewal_bound(self)
    }

    fn keeper_on_callers_runtime(&self) -> bool {
        self.settings.keeper_on_callers_runtime
    }

    fn open_session(&self) -> impl Future<Output = Result<St, StoreError>> + Send {
        timed("keeper_session", self.store.keeper_session())
    }

    fn without_session(&self) -> St {
        self.store.clone()
    }

    fn renew_many<'a>(
        &'a self,
        session: &'a St,
        leases: &'a [(&'a RecordKey, LeaseToken)],
    ) -> impl Future<Output = Vec<Result<Fenced, StoreError>>> + Send + 'a {
        self.store_renew_many(session, leases)
    }

    fn show_presences<'a>(
        &'a self,
        session: &'a St,
        live: &'a [Presence],
    ) -> impl Future<Output = Result<(), StoreError>> + Send + 'a {
        // Shown again every third of the TTL at least: lapsed after a whole TTL without it.
        let lapse = self.settings.in_progress_ttl;
        timed("show_presences", session.show_presences(live, lapse))
    }
}
