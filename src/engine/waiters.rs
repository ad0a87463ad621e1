//! How many duplicates wait on each key at this instance, so that waiters per key are bounded.

use std::collections::HashMap;
use std::sync::Mutex;

use super::coalesce::{ByScope, Scope};
use crate::util::lock::lock;

const SHARDS: usize = 16;

/// How many duplicates wait on each key at this instance.
#[derive(Default)]
pub(super) struct Waiters {
    shards: [Mutex<HashMap<Scope, usize, ByScope>>; SHARDS],
}

impl std::fmt::Debug for Waiters {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Waiters").finish_non_exhaustive()
    }
}

/// A waiter's place; given back when dropped.
pub(super) struct Place<'a> {
    waiters: &'a Waiters,
    scope: Scope,
}

impl Waiters {
    fn shard(&self, scope: &Scope) -> &Mutex<HashMap<Scope, usize, ByScope>> {
        &self.shards[scope.shard(SHARDS)]
    }

    /// A place among the waiters of `scope`, if fewer than `max` wait on it now.
    pub(super) fn enter(&self, scope: Scope, max: usize) -> Option<Place<'_>> {
        let mut shard = lock(self.shard(&scope));
        let count = shard.entry(scope).or_insert(0);
        if *count >= max {
            return None;
        }
        *count += 1;
        Some(Place {
            waiters: self,
            scope,
        })
    }

    #[cfg(test)]
    fn waiting(&self) -> usize {
        self.shards
            .iter()
            .map(|s| lock(s).values().sum::<usize>())
            .sum()
    }
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        let mut shard = lock(self.waiters.shard(&self.scope));
        if let Some(count) = shard.get_mut(&self.scope) {
            *count -= 1;
            if *count == 0 {
                shard.remove(&self.scope);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn places_are_bounded_and_given_back() {
        let waiters = Waiters::default();
        let a = waiters.enter(Scope::numbered(1), 2).expect("first");
        let b = waiters.enter(Scope::numbered(1), 2).expect("second");
        assert!(
            waiters.enter(Scope::numbered(1), 2).is_none(),
            "a third is refused"
        );
        let other = waiters
            .enter(Scope::numbered(2), 2)
            .expect("another key has its own count");
        drop(a);
        let c = waiters
            .enter(Scope::numbered(1), 2)
            .expect("a place given back is taken again");
        drop((b, c, other));
        assert_eq!(waiters.waiting(), 0);
    }
}
