//! Each subject's share of what all subjects share at this instance: requests in flight, requests
//! running on after their clients left, duplicates waiting, and records in the store. One subject
//! past its share is refused (`429`), and the others are served.
//!
//! - **In flight**: a subject's guarded requests from admission to their end, attached to their
//!   clients or not, are counted; past its own bound (`max_in_flight_per_subject`) a new one is
//!   refused before its body is read. Any of them may run on after its client leaves, so the
//!   instance bounds them all together (`max_running` places), and shares those places: a subject
//!   that holds `h` of them takes one more only while `h` stay free after it. So the instance
//!   never holds more than `max_running`; `n` subjects that all want more hold about
//!   `max_running / (n + 1)` each (a lone subject, half); the fewer a subject holds, the nearer to
//!   full the instance it is let into, so the places freed as requests end go first to the
//!   subjects that hold the fewest, and the last free place to one that holds none and, in the
//!   last second, was not refused a place and did not hold more than one (or take or give back a
//!   place in a second of holding more, a mark kept for as long as it goes on doing so): a client
//!   that waits as `Retry-After` says is past that mark when it comes back, and one that sends its
//!   requests one after another never holds more than one; a flood is marked, however slow its
//!   requests. So no group of subjects takes every place from a subject that comes while they
//!   flood (though many subjects made up for the purpose are a group of their own: see
//!   SECURITY.md). A subject that holds
//!   none and finds no place is refused as the instance full (`503`), one that holds some as past
//!   its share (`429`). The places are the layer's: each layer built has its own.
//! - **Waiting**: a subject's duplicates waiting for an answer; past its share (or past the
//!   instance's bound) a duplicate gets `409` at once instead of waiting.
//! - **Records**: how many live records a subject has in the store is counted
//!   ([`IdempotencyStore::count_records`](crate::store::IdempotencyStore::count_records)) by one
//!   claim of the subject at a time at this instance; its other claims wait for that count rather
//!   than start their own, so a subject's claims cost the store one count at a time, however many
//!   come at once. After a count `c` under the share `m`, this instance lets `(m - c) / 4` new
//!   keys of the subject through (at least one), each counted as it goes, then counts again: on
//!   one instance the subject never passes its share, and with `n` instances, each letting
//!   `max((m - c) / 4, 1)` through before its next count, it passes it by at most
//!   `n * max((m - c) / 4, 1) - (m - c)` (about `(n / 4 - 1)` times what was left, and `n - 1`
//!   when little was), a bound of the deployment, not of time or load. A subject whose budget is
//!   spent within a tenth of a second of the count that set it has its next claims wait for the
//!   rest of that tenth, then count (at most ten counts a second of a subject at an instance,
//!   however near its share it is); a claim that finds no room in eight turns is refused as over
//!   its share. Once a count reaches the share, the subject is over it for a second: its claims
//!   look their records up first (an existing record, a replay, a `409`, a retake, is claimed as
//!   usual; a new key is refused), then it is counted again. A count that fails refuses the
//!   subject's new keys for a second (`503`; with `fail_open` they go on), and the subject alone.
//! - **Bytes**: the same count tells the bytes of the subject's recorded answers; this instance
//!   adds those it records meanwhile ([`Shares::recorded`]), and counts again once a quarter of
//!   what its share of bytes had left is recorded; a count at or past the share makes the subject
//!   over it, as its records would.
//!
//! Subjects are named by a keyed hash drawn once per process (as scopes are), so no client can
//! aim two subjects at one entry. The map forgets subjects with nothing in flight or waiting, no
//! count under way and no refusal or mark in force, once it holds many (its budget of records is
//! forgotten with it: the subject is counted again).

use std::collections::HashMap;
use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::store::SubjectUsage;
use crate::util::lock::lock;

const SHARDS: usize = 16;

/// Entries a shard keeps before it forgets its idle subjects.
const IDLE_KEPT: usize = 4096;

/// How long a subject found at its share of records stays refused new keys before it is counted
/// again; and how long one whose count failed is refused new keys.
const OVER_FOR: Duration = Duration::from_secs(1);

/// How long after a count of a subject's records its budget of new keys, once spent, has the next
/// ones wait rather than count again: at most ten counts a second of a subject at an instance,
/// however close to its share it is.
const COUNTS_APART: Duration = Duration::from_millis(100);

/// How long a subject refused a place in flight counts as holding one.
const REFUSED_LATELY: Duration = Duration::from_secs(1);

/// A subject, as this process names it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
pub(crate) struct SubjectId(u64);

#[derive(Default)]
struct Share {
    in_flight: usize,
    waiting: usize,
    /// New keys let through since the last count of the subject's records.
    since_count: u64,
    /// New keys to let through before the next count; none before the first count.
    until_count: u64,
    /// Whether a count has set `until_count` (none yet: count first).
    counted: bool,
    /// Bytes of answers this instance recorded for the subject since the last count began, and
    /// how many may be before it counts again (a quarter of the bytes its share had left).
    bytes_since: u64,
    bytes_until_count: u64,
    /// When that count was reported.
    counted_at: Option<Instant>,
    /// New keys let through whose claims have not been answered yet: a count may not see their
    /// records, so the next budget leaves room for them.
    pending: u64,
    /// While a claim counts the subject's records: dropped (which wakes the others) when it is
    /// done.
    counting: Option<tokio::sync::watch::Sender<()>>,
    /// Refused new keys until then: its records reached its share at the last count (`true`), or
    /// the count failed (`false`).
    refused_until: Option<(Instant, bool)>,
    /// When a request of the subject was last refused a place in flight.
    refused_place: Option<Instant>,
    /// When the subject last held more than one place, or took or gave back one within a second
    /// of that (see [`Share::keep_busy`]).
    busy_at: Option<Instant>,
}

/// Whether `at` is within the last [`REFUSED_LATELY`] before `now`.
fn lately(at: Option<Instant>, now: Instant) -> bool {
    at.is_some_and(|at| now.saturating_duration_since(at) < REFUSED_LATELY)
}

impl Share {
    /// Whether the subject was refused a place, or held more than one, within the last
    /// [`REFUSED_LATELY`]: one of a group that floods, not a subject that comes.
    fn busy_lately(&self, now: Instant) -> bool {
        lately(self.refused_place, now) || lately(self.busy_at, now)
    }

    /// Keeps the busy mark of a subject that holds more than one place, or that still had it: a
    /// subject stays marked from the moment it holds two until it has let a second pass without
    /// holding or giving back a place, however long its last requests take.
    fn keep_busy(&mut self, now: Instant) {
        if self.in_flight > 1 || lately(self.busy_at, now) {
            self.busy_at = Some(now);
        }
    }
}

impl Share {
    /// Whether the entry holds nothing the subject would miss if it were forgotten now: nothing
    /// in flight or waiting, no count under way, no refusal in force.
    fn idle(&self, now: Instant) -> bool {
        self.in_flight == 0
            && self.waiting == 0
            && self.pending == 0
            && self.counting.is_none()
            && self.refused_until.is_none_or(|(until, _)| until <= now)
            && !self.busy_lately(now)
    }
}

/// Why a request was not let in flight (see [`Shares::enter`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The subject has its own bound in flight.
    Own,
    /// The subject holds its share of the instance's places (as many as stay free).
    Share,
    /// The instance's places are taken (the subject holds none).
    Full,
}

/// What a claim of a subject does about its share of records.
#[derive(Debug)]
pub(crate) enum Records {
    /// Claim as usual: one of the subject's new keys here, pending until the guard is dropped
    /// (when the store has answered the claim).
    Within(NewKey),
    /// Count the subject's records first, and report it through the ticket
    /// ([`CountTicket::counted`]); then ask again.
    Count(CountTicket),
    /// Another claim of the subject counts its records now: wait for it (the receiver changes, or
    /// closes, when it is done), then ask again.
    Wait(tokio::sync::watch::Receiver<()>),
    /// The budget set by the last count is spent, and that count is too recent to count again:
    /// wait this long, then ask again.
    Later(Duration),
    /// Over its share: claim only a record that exists.
    Over,
    /// Its last count failed: its new keys are refused a moment.
    Unknown,
}

/// The one count of a subject's records under way at this instance. Dropped without a report
/// (its claim was cancelled), it lets the next claim count.
#[derive(Debug)]
pub(crate) struct CountTicket {
    shares: Arc<Shares>,
    id: SubjectId,
    max: u64,
    /// The subject's share of bytes, if any.
    max_bytes: Option<u64>,
    /// New keys pending when the count began: the count may not see their records, even those
    /// answered while it ran.
    pending: u64,
    /// Bytes recorded since the previous count when this one began: those recorded while it
    /// runs are kept (the count may not have seen them).
    bytes_before: u64,
    reported: bool,
}

impl CountTicket {
    /// The subject has `usage` in the store (`Err`: the count failed); whether it is over.
    pub(crate) fn counted(mut self, usage: Result<SubjectUsage, ()>) -> bool {
        self.reported = true;
        let now = Instant::now();
        let mut shard = self.shares.shard(self.id);
        let share = shard.entry(self.id).or_default();
        share.counting = None;
        share.since_count = 0;
        // Bytes recorded while the count ran stay counted here: it may not have seen them.
        share.bytes_since = share.bytes_since.saturating_sub(self.bytes_before);
        let bytes = usage.map(|usage| usage.bytes.saturating_add(share.bytes_since));
        let over_bytes = match (self.max_bytes, bytes) {
            (Some(max), Ok(bytes)) if bytes >= max => true,
            (Some(max), Ok(bytes)) => {
                share.bytes_until_count = ((max - bytes) / 4).max(1);
                false
            }
            _ => {
                share.bytes_until_count = u64::MAX;
                false
            }
        };
        // New keys let through whose records the count may not have seen count as records: those
        // pending when it began (none is let through while it runs).
        let unseen = self.pending.max(share.pending);
        match usage.map(|usage| usage.records.saturating_add(unseen)) {
            Ok(_) if over_bytes => {
                share.refused_until = Some((now + OVER_FOR, true));
                share.counted = false;
                true
            }
            Ok(count) if count >= self.max => {
                share.refused_until = Some((now + OVER_FOR, true));
                share.counted = false;
                true
            }
            Ok(count) => {
                share.until_count = ((self.max - count) / 4).max(1);
                share.counted = true;
                share.counted_at = Some(now);
                false
            }
            Err(()) => {
                share.refused_until = Some((now + OVER_FOR, false));
                share.counted = false;
                false
            }
        }
    }
}

/// A new key of a subject let through, pending until its claim is answered.
#[derive(Debug)]
pub(crate) struct NewKey {
    shares: Arc<Shares>,
    id: SubjectId,
}

impl Drop for NewKey {
    fn drop(&mut self) {
        let mut shard = self.shares.shard(self.id);
        if let Some(share) = shard.get_mut(&self.id) {
            share.pending = share.pending.saturating_sub(1);
        }
    }
}

impl Drop for CountTicket {
    fn drop(&mut self) {
        if !self.reported {
            let mut shard = self.shares.shard(self.id);
            if let Some(share) = shard.get_mut(&self.id) {
                share.counting = None;
            }
        }
    }
}

/// One shard of the subjects' entries, and how many it may hold before its idle ones are
/// forgotten: twice what a tidy left (at least [`IDLE_KEPT`]), so a shard of many subjects in use
/// is not scanned on every call.
#[derive(Default)]
struct Shard {
    entries: HashMap<SubjectId, Share, BuildHasherDefault<IdHasher>>,
    tidy_past: usize,
}

impl std::ops::Deref for Shard {
    type Target = HashMap<SubjectId, Share, BuildHasherDefault<IdHasher>>;
    fn deref(&self) -> &Self::Target {
        &self.entries
    }
}

impl std::ops::DerefMut for Shard {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.entries
    }
}

/// Every subject's share at this instance.
pub(crate) struct Shares {
    keys: RandomState,
    shards: [Mutex<Shard>; SHARDS],
    /// Duplicates waiting at this instance, all subjects together.
    waiting: AtomicUsize,
    /// Requests in flight, all subjects together.
    in_flight: AtomicUsize,
    /// [`COUNTS_APART`] (shorter in a test that must count often).
    counts_apart: Duration,
}

impl Default for Shares {
    fn default() -> Self {
        Shares {
            keys: RandomState::new(),
            shards: Default::default(),
            waiting: AtomicUsize::new(0),
            in_flight: AtomicUsize::new(0),
            counts_apart: COUNTS_APART,
        }
    }
}

impl std::fmt::Debug for Shares {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shares").finish_non_exhaustive()
    }
}

impl Shares {
    /// This process's name for `subject`.
    pub(crate) fn id(&self, subject: &str) -> SubjectId {
        self.named(0, subject)
    }

    /// This process's name for an anonymous caller that the application tells apart as `caller`:
    /// never the name of a subject, whatever either is.
    pub(crate) fn caller_id(&self, caller: &str) -> SubjectId {
        self.named(1, caller)
    }

    fn named(&self, domain: u8, name: &str) -> SubjectId {
        let mut hasher = self.keys.build_hasher();
        hasher.write_u8(domain);
        hasher.write(name.as_bytes());
        SubjectId(hasher.finish())
    }

    fn shard(&self, id: SubjectId) -> MutexGuard<'_, Shard> {
        lock(&self.shards[(id.0 >> 60) as usize % SHARDS])
    }

    /// The shard of `id`, with its idle entries forgotten once it holds many.
    fn tidied(&self, id: SubjectId) -> MutexGuard<'_, Shard> {
        let mut shard = self.shard(id);
        if shard.entries.len() > shard.tidy_past.max(IDLE_KEPT) {
            let now = Instant::now();
            shard.entries.retain(|_, share| !share.idle(now));
            shard.tidy_past = shard.entries.len().saturating_mul(2);
        }
        shard
    }

    /// Counts a request of `id` in flight until the guard is dropped, if its own bound (`own`) and
    /// its share of the instance's `places` let it in (see the module docs). However the subjects
    /// come, the instance never holds more than `places` in flight.
    pub(crate) fn enter(
        self: &Arc<Self>,
        id: SubjectId,
        own: usize,
        places: usize,
    ) -> Result<InFlight, Refused> {
        let mut shard = self.tidied(id);
        let share = shard.entry(id).or_default();
        // Its own bound is no place of the instance's: no mark.
        if share.in_flight >= own {
            return Err(Refused::Own);
        }
        // A subject holding `h` places takes one more while `h` stay free after it; one refused a
        // place, or holding more than one, a moment ago counts as holding one while others hold
        // places, so that the last place goes to a subject that comes, never to one of a group
        // that floods (a client that waits as `Retry-After` says comes back after the mark is
        // gone; one that sends its requests one after another never holds more than one).
        let now = Instant::now();
        let held = share.in_flight;
        let marked = held == 0 && share.busy_lately(now);
        let entered = self
            .in_flight
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |total| {
                let held = held.max(usize::from(marked && total > 0));
                (total.saturating_add(held + 1) <= places).then_some(total + 1)
            });
        if entered.is_err() {
            share.refused_place = Some(now);
            return Err(if held == 0 {
                Refused::Full
            } else {
                Refused::Share
            });
        }
        share.in_flight += 1;
        share.keep_busy(now);
        Ok(InFlight {
            shares: self.clone(),
            id,
        })
    }

    /// A place among the duplicates waiting, if `id` has fewer than `per_subject` waiting and the
    /// instance fewer than `total`.
    pub(crate) fn wait(
        self: &Arc<Self>,
        id: SubjectId,
        per_subject: usize,
        total: usize,
    ) -> Option<Waiting> {
        if self.waiting.fetch_add(1, Ordering::AcqRel) >= total {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        let mut shard = self.tidied(id);
        let share = shard.entry(id).or_default();
        if share.waiting >= per_subject {
            drop(shard);
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        share.waiting += 1;
        Some(Waiting {
            shares: self.clone(),
            id,
        })
    }

    /// Bytes of an answer recorded for `id` by this instance: they count against its share of
    /// bytes until the next count, which sees them in the store.
    pub(crate) fn recorded(&self, id: SubjectId, bytes: usize) {
        let mut shard = self.shard(id);
        if let Some(share) = shard.get_mut(&id) {
            share.bytes_since = share
                .bytes_since
                .saturating_add(u64::try_from(bytes).unwrap_or(u64::MAX));
        }
    }

    /// What a new key of `id` does about its share `max` of records, and `max_bytes` of bytes
    /// (see the module docs).
    pub(crate) fn records(
        self: &Arc<Self>,
        id: SubjectId,
        max: u64,
        max_bytes: Option<u64>,
    ) -> Records {
        let now = Instant::now();
        let mut shard = self.tidied(id);
        let share = shard.entry(id).or_default();
        if let Some(counting) = &share.counting {
            return Records::Wait(counting.subscribe());
        }
        match share.refused_until {
            Some((until, over)) if now < until => {
                return if over {
                    Records::Over
                } else {
                    Records::Unknown
                };
            }
            Some(_) => share.refused_until = None,
            None => {}
        }
        if share.counted
            && share.since_count < share.until_count
            && share.bytes_since < share.bytes_until_count
        {
            share.since_count += 1;
            share.pending += 1;
            return Records::Within(NewKey {
                shares: self.clone(),
                id,
            });
        }
        // The budget is spent, and the count that set it is recent: the subject's new keys come
        // faster than it may be counted; they wait for the next count.
        if share.counted
            && let Some(at) = share.counted_at
            && now.saturating_duration_since(at) < self.counts_apart
        {
            return Records::Later(self.counts_apart - now.saturating_duration_since(at));
        }
        share.counting = Some(tokio::sync::watch::Sender::new(()));
        Records::Count(CountTicket {
            shares: self.clone(),
            id,
            max,
            max_bytes,
            pending: share.pending,
            bytes_before: share.bytes_since,
            reported: false,
        })
    }

    fn leave(&self, id: SubjectId, waiting: bool) {
        let mut shard = self.shard(id);
        if let Some(share) = shard.get_mut(&id) {
            if waiting {
                share.waiting = share.waiting.saturating_sub(1);
            } else if share.in_flight > 0 {
                share.keep_busy(Instant::now());
                share.in_flight -= 1;
                self.in_flight.fetch_sub(1, Ordering::AcqRel);
            }
        }
    }
}

/// A request of a subject in flight, counted until dropped.
pub(crate) struct InFlight {
    shares: Arc<Shares>,
    id: SubjectId,
}

impl std::fmt::Debug for InFlight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InFlight").finish_non_exhaustive()
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.shares.leave(self.id, false);
    }
}

/// A duplicate of a subject waiting, counted until dropped.
pub(crate) struct Waiting {
    shares: Arc<Shares>,
    id: SubjectId,
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.shares.waiting.fetch_sub(1, Ordering::AcqRel);
        self.shares.leave(self.id, true);
    }
}

/// A map's hasher for [`SubjectId`]s, which are keyed hashes already.
#[derive(Default)]
struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(*byte);
        }
    }

    fn write_u64(&mut self, value: u64) {
        self.0 = value;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A count of `records` records and no bytes.
    fn held(records: u64) -> SubjectUsage {
        SubjectUsage { records, bytes: 0 }
    }

    /// The share of bytes: a count at or past it refuses new keys; below it, a quarter of what is
    /// left may be recorded here before the next count, which keeps what was recorded while it
    /// ran; another subject is not touched.
    #[tokio::test]
    async fn a_subject_past_its_share_of_bytes_is_refused_new_keys() {
        let shares = Arc::new(Shares {
            counts_apart: Duration::ZERO,
            ..Shares::default()
        });
        let (a, b) = (shares.id("a"), shares.id("b"));
        let share = Some(1000);
        let Records::Count(ticket) = shares.records(a, 100, share) else {
            panic!("counts first");
        };
        let usage = SubjectUsage {
            records: 1,
            bytes: 600,
        };
        assert!(!ticket.counted(Ok(usage)), "under its share of bytes");
        // 100 bytes may be recorded here before the next count.
        let Records::Within(first) = shares.records(a, 100, share) else {
            panic!("a new key within its share");
        };
        drop(first);
        shares.recorded(a, 99);
        let Records::Within(second) = shares.records(a, 100, share) else {
            panic!("99 bytes recorded: still within the budget");
        };
        drop(second);
        shares.recorded(a, 1);
        let Records::Count(ticket) = shares.records(a, 100, share) else {
            panic!("the budget of bytes spent: counted again");
        };
        // Recorded while the count runs: kept, whatever the count saw.
        shares.recorded(a, 300);
        let usage = SubjectUsage {
            records: 3,
            bytes: 700,
        };
        assert!(
            ticket.counted(Ok(usage)),
            "700 counted and 300 since: at its share"
        );
        assert!(matches!(shares.records(a, 100, share), Records::Over));
        assert!(matches!(shares.records(b, 100, share), Records::Count(_)));
        // No share of bytes: bytes count for nothing.
        let c = shares.id("c");
        let Records::Count(ticket) = shares.records(c, 100, None) else {
            panic!("counts first");
        };
        let usage = SubjectUsage {
            records: 0,
            bytes: u64::MAX,
        };
        assert!(!ticket.counted(Ok(usage)));
        assert!(matches!(shares.records(c, 100, None), Records::Within(_)));
    }

    #[test]
    fn in_flight_and_waiting_are_bounded_per_subject_and_given_back() {
        let shares = Arc::new(Shares::default());
        let (a, b) = (shares.id("a"), shares.id("b"));
        let enter = |id| shares.enter(id, 2, 1024);
        let first = enter(a).expect("first");
        let second = enter(a).expect("second");
        assert_eq!(
            enter(a).err(),
            Some(Refused::Own),
            "a third of a is refused"
        );
        let other = enter(b).expect("b has its own share");
        drop(first);
        let again = enter(a).expect("a place given back is taken again");
        drop((second, other, again));

        let w1 = shares.wait(a, 1, 2).expect("a waits");
        assert!(shares.wait(a, 1, 2).is_none(), "a's share of waiters");
        let w2 = shares.wait(b, 1, 2).expect("b waits");
        assert!(
            shares.wait(shares.id("c"), 1, 2).is_none(),
            "the instance's bound"
        );
        drop((w1, w2));
        assert!(shares.wait(shares.id("c"), 1, 2).is_some());
    }

    /// Sixteen subjects take what they can of the instance's places: a seventeenth is still let
    /// in, the sixteen are held to their shares, and as their requests end the seventeenth comes
    /// to hold about as many as each of them.
    #[test]
    fn no_group_of_subjects_takes_every_place() {
        let shares = Arc::new(Shares::default());
        let (places, own) = (1024, 256);
        let flooders: Vec<_> = (0..16).map(|n| shares.id(&format!("flood-{n}"))).collect();
        let mut held: Vec<Vec<InFlight>> = (0..16).map(|_| Vec::new()).collect();
        // They come in turn, each taking places as long as it is let in, until none is.
        let take_turns = |held: &mut Vec<Vec<InFlight>>| loop {
            let mut any = false;
            for (id, places_held) in flooders.iter().zip(held.iter_mut()) {
                if let Ok(place) = shares.enter(*id, own, places) {
                    places_held.push(place);
                    any = true;
                }
            }
            if !any {
                break;
            }
        };
        take_turns(&mut held);
        let total = |held: &Vec<Vec<InFlight>>| held.iter().map(Vec::len).sum::<usize>();
        // About a share each, and one left free.
        assert!(
            total(&held) + places / 18 <= places,
            "{} places taken",
            total(&held)
        );
        // The seventeenth is let in at once.
        let last = shares.id("the seventeenth");
        let mut newcomer = Vec::new();
        while let Ok(place) = shares.enter(last, own, places) {
            newcomer.push(place);
        }
        assert!(!newcomer.is_empty(), "the seventeenth let in");
        assert_eq!(
            shares.enter(flooders[0], own, places).err(),
            Some(Refused::Share),
            "a flooder, holding more than the seventeenth, is held to its share"
        );
        // Their requests end, one of each at a time, and everybody takes what it can again,
        // the sixteen first: the seventeenth, holding fewer, is let in nearer to full, and comes
        // to hold as many as the one of them that holds the fewest.
        for _ in 0..64 {
            for places_held in &mut held {
                places_held.pop();
            }
            take_turns(&mut held);
            while let Ok(place) = shares.enter(last, own, places) {
                newcomer.push(place);
            }
        }
        let fewest = held.iter().map(Vec::len).min().unwrap_or(0);
        assert!(
            newcomer.len() + 1 >= fewest && newcomer.len() >= places / 20,
            "the seventeenth holds {} places, the flooders {:?}",
            newcomer.len(),
            held.iter().map(Vec::len).collect::<Vec<_>>()
        );
        assert!(total(&held) + newcomer.len() <= places);
        drop((held, newcomer));
        assert!(shares.enter(flooders[0], own, places).is_ok());
        assert_eq!(
            shares.in_flight.load(Ordering::Acquire),
            0,
            "every place given back"
        );
    }

    /// Subjects that come one after another, each taking every place it is let in, never take
    /// the instance past its places, and each of them is let in.
    #[test]
    fn subjects_that_come_in_turn_never_pass_the_places() {
        let shares = Arc::new(Shares::default());
        let (places, own) = (256, 256);
        let mut held = Vec::new();
        for n in 0..64 {
            let id = shares.id(&format!("late-{n}"));
            let before = held.len();
            while let Ok(place) = shares.enter(id, own, places) {
                held.push(place);
            }
            let in_flight = shares.in_flight.load(Ordering::Acquire);
            assert!(in_flight <= places, "{in_flight} in flight after {n}");
            assert!(
                held.len() > before || in_flight == places,
                "late-{n} refused with places free"
            );
        }
        assert_eq!(
            shares.enter(shares.id("late-0"), own, places).err(),
            Some(Refused::Share),
            "the first, holding the most"
        );
        while shares.in_flight.load(Ordering::Acquire) == places {
            drop(held.pop());
        }
        assert!(
            shares.enter(shares.id("a newcomer"), own, places).is_ok(),
            "a place given back goes to a newcomer"
        );
    }

    /// The last place goes to a subject that comes, not to one refused a place a moment ago.
    #[test]
    fn the_last_place_goes_to_a_subject_that_comes() {
        let shares = Arc::new(Shares::default());
        let enter = |name: &str| shares.enter(shares.id(name), 8, 4);
        let a = [enter("a").expect("a"), enter("a").expect("a's second")];
        assert_eq!(enter("a").err(), Some(Refused::Share), "two stay free");
        let _b = enter("b").expect("b");
        let _c = enter("c").expect("c takes the last place");
        assert_eq!(enter("d").err(), Some(Refused::Full));
        let [first, _second] = a;
        drop(first);
        assert_eq!(
            enter("d").err(),
            Some(Refused::Full),
            "d, refused a moment ago, counts as holding one: refused as the instance full"
        );
        let e = enter("e").expect("e comes, and takes the place given back");
        // a held two a moment ago: with none left, it still yields the last place.
        drop(_second);
        assert_eq!(enter("a").err(), Some(Refused::Full), "a held two lately");
        let _f = enter("f").expect("f comes, and takes it");
        drop(e);
    }

    /// The mark holds a subject back only from others: on an instance where nobody holds a
    /// place it is let in, and its own bound leaves no mark.
    #[test]
    fn a_refused_subject_is_let_into_an_idle_instance() {
        let shares = Arc::new(Shares::default());
        let a = shares.id("a");
        let first = shares.enter(a, 1, 1).expect("a");
        assert_eq!(shares.enter(a, 1, 1).err(), Some(Refused::Own));
        drop(first);
        let again = shares.enter(a, 1, 1).expect("its own bound left no mark");
        assert_eq!(shares.enter(a, 2, 1).err(), Some(Refused::Share));
        drop(again);
        assert!(
            shares.enter(a, 2, 1).is_ok(),
            "refused a moment ago, but nobody else holds a place"
        );
    }

    #[tokio::test]
    async fn one_count_at_a_time_and_a_failed_count_refuses_the_subject_alone() {
        let shares = Arc::new(Shares::default());
        let (a, b) = (shares.id("a"), shares.id("b"));
        // No count yet: the first claim counts, the others wait for it.
        let Records::Count(ticket) = shares.records(a, 1000, None) else {
            panic!("the first claim counts");
        };
        let Records::Wait(mut waiting) = shares.records(a, 1000, None) else {
            panic!("the next waits for that count");
        };
        assert!(
            matches!(shares.records(b, 1000, None), Records::Count(_)),
            "b counts apart"
        );
        assert!(!ticket.counted(Ok(held(0))));
        assert!(
            waiting.changed().await.is_err(),
            "woken when the count is done"
        );
        // A quarter of what is left passes, then the subject is counted again.
        let mut through = Vec::new();
        while let Records::Within(key) = shares.records(a, 1000, None) {
            through.push(key);
        }
        assert_eq!(through.len(), 250);
        // Spent within a tenth of a second of its count: the next waits for the next count.
        let Records::Later(wait) = shares.records(a, 1000, None) else {
            panic!("waits");
        };
        assert!(wait <= COUNTS_APART);
        tokio::time::sleep(COUNTS_APART).await;
        let Records::Count(ticket) = shares.records(a, 1000, None) else {
            panic!("counted again");
        };
        // Those pending when the count began count as records, even when they are answered
        // while it runs (the count may not have seen them): 750 found, 250 pending.
        drop(through);
        assert!(
            ticket.counted(Ok(held(750))),
            "at its share with the pending ones"
        );
        assert!(matches!(shares.records(a, 1000, None), Records::Over));
        // A count that fails refuses the subject a while; another subject is not touched.
        let c = shares.id("c");
        let Records::Count(ticket) = shares.records(c, 1000, None) else {
            panic!("counts");
        };
        assert!(!ticket.counted(Err(())));
        assert!(matches!(shares.records(c, 1000, None), Records::Unknown));
        assert!(matches!(
            shares.records(shares.id("d"), 1000, None),
            Records::Count(_)
        ));
        // A ticket dropped unreported lets the next claim count.
        let e = shares.id("e");
        drop(shares.records(e, 10, None));
        assert!(matches!(shares.records(e, 10, None), Records::Count(_)));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(48))]

        /// The share of records under concurrent claims, completions, releases and failed
        /// counts, on one instance: the subject's records never pass its share, whatever the
        /// interleaving, and every claim is answered (let through, refused, or refused for a
        /// failed count), none waits for good.
        #[test]
        fn one_instance_never_lets_a_subject_past_its_share(
            max in 1u64..60,
            seed in proptest::prelude::any::<u64>(),
            tasks in 2usize..10,
        ) {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                // Counts as often as the claims ask for them, to try many interleavings.
                let shares = Arc::new(Shares {
                    counts_apart: Duration::ZERO,
                    ..Shares::default()
                });
                let live = Arc::new(std::sync::atomic::AtomicU64::new(0));
                let most = Arc::new(std::sync::atomic::AtomicU64::new(0));
                let mut running = tokio::task::JoinSet::new();
                for task in 0..tasks {
                    let (shares, live, most) = (shares.clone(), live.clone(), most.clone());
                    running.spawn(async move {
                        let id = shares.id("subject");
                        let mut rng = seed ^ (task as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                        let mut next = move || {
                            rng ^= rng << 13;
                            rng ^= rng >> 7;
                            rng ^= rng << 17;
                            rng
                        };
                        for _ in 0..40 {
                            match next() % 4 {
                                // A record expires, or is released.
                                0 => {
                                    let _ = live.fetch_update(
                                        Ordering::AcqRel,
                                        Ordering::Acquire,
                                        |n| n.checked_sub(1),
                                    );
                                }
                                // A claim of a new key.
                                _ => loop {
                                    match shares.records(id, max, None) {
                                        Records::Within(pending) => {
                                            // The store takes a moment to answer.
                                            if next() % 2 == 0 {
                                                tokio::task::yield_now().await;
                                            }
                                            let now = live.fetch_add(1, Ordering::AcqRel) + 1;
                                            most.fetch_max(now, Ordering::AcqRel);
                                            drop(pending);
                                            break;
                                        }
                                        Records::Count(ticket) => {
                                            tokio::task::yield_now().await;
                                            let count = if next() % 8 == 0 {
                                                Err(())
                                            } else {
                                                Ok(held(live.load(Ordering::Acquire)))
                                            };
                                            let _ = ticket.counted(count);
                                        }
                                        Records::Wait(mut counting) => {
                                            let _ = counting.changed().await;
                                        }
                                        Records::Later(wait) => tokio::time::sleep(wait).await,
                                        Records::Over | Records::Unknown => break,
                                    }
                                },
                            }
                            tokio::task::yield_now().await;
                        }
                    });
                }
                tokio::time::timeout(Duration::from_secs(20), async {
                    while let Some(done) = running.join_next().await {
                        done.expect("task");
                    }
                })
                .await
                .expect("every claim is answered");
                let most = most.load(Ordering::Acquire);
                assert!(most <= max, "{most} records past a share of {max}");
            });
        }
    }
}
