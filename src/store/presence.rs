//! [`Presence`]: how a store tells that the holder of a lease still lives (SPEC 24).

use std::num::NonZeroU32;

use super::record::{LeaseToken, unique_u64};

/// The presence of a lease keeper: the high 32 bits of the lease tokens it issues, by which a
/// store tells that the holder of a lease still lives without asking the clock of its renewals.
///
/// A renewal that cannot reach the store (another program holds its write lock, a migration
/// rewrites the table) makes a live holder look dead by the clock alone. So the lease keeper of
/// each process also *shows* its presences, through something the store's server or the
/// machine's kernel keeps for as long as the keeper's process lives, whatever delays the table:
/// advisory locks held by an open transaction on PostgreSQL, named locks (`GET_LOCK`) on MySQL, a
/// locked file beside the database on SQLite
/// ([`IdempotencyStore::show_presences`](super::IdempotencyStore::show_presences)). A lease token
/// carries its presence in its high 32 bits ([`Presence::of`]), and a claim retakes a stale record
/// only when its holder's presence is not shown: a holder that lives is never retaken, whatever
/// delayed its renewals; one that died is retaken after the in-progress TTL (on the stores that
/// mark a silent holder first, a TTL after the first claim that found it silent). A holder
/// whose presence the store cannot see (a store without presences, a keeper that could not show
/// it, a token not issued by a keeper) is judged by the TTL alone.
///
/// A keeper draws a presence every in-progress TTL, and stops showing each once no lease of it is
/// left: a record that a live process let go of without settling it (its release failed for good)
/// becomes retakeable by the TTL once its presence is no longer shown, rather than stay in
/// progress for as long as the process lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Presence(NonZeroU32);

impl Presence {
    /// The presence `lease` was issued under; `None` for a token whose high 32 bits are zero
    /// (no keeper issues those).
    pub fn of(lease: LeaseToken) -> Option<Presence> {
        NonZeroU32::new(((lease.0 as u64) >> 32) as u32).map(Presence)
    }

    /// Its 32 bits, as a store names its lock or file.
    pub fn get(self) -> u32 {
        self.0.get()
    }

    /// Its 32 bits as a signed 32-bit integer (the same bits), as PostgreSQL's advisory locks take
    /// them: `(lease_token >> 32)::int4` of a token of this presence.
    pub fn as_i32(self) -> i32 {
        self.0.get() as i32
    }

    /// A fresh presence, unpredictable and unique with overwhelming probability.
    pub(crate) fn generate() -> Self {
        loop {
            let bits = (unique_u64() >> 32) as u32;
            if let Some(bits) = NonZeroU32::new(bits) {
                return Presence(bits);
            }
        }
    }

    /// The lease token of this presence numbered `low`: its 32 bits, then `low`'s. Never 0 (the
    /// token of a released record), since the presence is not. A keeper numbers the tokens of a
    /// presence one after the other from a random start, so none comes twice within it.
    pub(crate) fn lease(self, low: u32) -> LeaseToken {
        LeaseToken(((u64::from(self.0.get()) << 32) | u64::from(low)) as i64)
    }

    /// A random start for numbering this presence's tokens.
    pub(crate) fn first_number() -> u32 {
        unique_u64() as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_carries_its_presence_in_its_high_bits() {
        for _ in 0..1000 {
            let presence = Presence::generate();
            let lease = presence.lease(Presence::first_number());
            assert_ne!(lease.0, 0);
            assert_eq!(Presence::of(lease), Some(presence));
            // As PostgreSQL reads it: an arithmetic shift of the signed token, then int4.
            assert_eq!((lease.0 >> 32) as i32, presence.as_i32());
            // As MySQL reads it: the unsigned token shifted.
            assert_eq!(((lease.0 as u64) >> 32) as u32, presence.get());
        }
        assert_eq!(Presence::of(LeaseToken(0)), None);
        assert_eq!(Presence::of(LeaseToken(0x7fff_ffff)), None);
        assert_eq!(
            Presence::of(LeaseToken(-1)).map(Presence::get),
            Some(u32::MAX)
        );
    }
}
