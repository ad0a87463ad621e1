//! The Lua scripts the store runs, each on one key (its `KEYS[1]`), so that on a cluster each runs
//! whole on the master owning that key's slot. On one server, the claim and the completion take a
//! second key (a cluster would refuse it, as another slot): the claim files the record in its
//! subject's listing index and the completion counts the answer's bytes in its subject's account,
//! each in the same round trip, where on a cluster the store sends `INDEX` and `ACCOUNT` apart.
//! What the scripts share is written once: `file.lua` (filing in an index) and `count.lua`
//! (counting bytes), each a Lua function put before the scripts that call it.

use redis::Script;

/// Claim, atomically: insert; or answer mismatch, finished (with the response), in progress; or
/// retake a record whose claim (or last renewal) is older than the in-progress TTL, once a claim
/// marked it so (`sus`) a TTL before and no renewal came since (the first claim only marks it:
/// see `claim.lua`) by this very server process in its current role (its run id and replication
/// id: not a replica promoted since, nor the server before a restart). A record in
/// progress under this very lease is this claim's own, sent twice (a resend after a lost reply):
/// claimed again, or retaken again if the first one retook it (the field `rt` says so). A released
/// record (lease `0`) is claimed at once: by the same request with its generation, by another with
/// the new one. Times are the server's `TIME`. A claimed or retaken
/// answer carries the record's generation (a retake keeps it; a record written before generations
/// has none).
/// A record made by the claim (new, or a released one taken as a new run) gets its creation time
/// (`ct`, kept by retakes) and its scope in clear (`k`, `sub`, `ep`), for inspection. A claimed or
/// retaken answer carries, third, the record's creation time, by which the record is filed in the
/// subject's index (see [`RedisStore`]): here when KEYS[2] names the index (one server), by the
/// caller otherwise.
/// KEYS[1] record, KEYS[2] (optional) the subject's index; ARGV fingerprint, new lease,
/// in-progress TTL (ms), TTL + retention (ms), generation of a new record, key, subject, endpoint,
/// and with KEYS[2] the record's digest (hex), its entry.
const CLAIM: &str = concat!(include_str!("file.lua"), include_str!("claim.lua"));

/// Complete, if the lease still holds an in-progress record; a record this lease already finished
/// counts as done: `{1, steps}` (`{0, 0}`: not done), `steps` the bytes of the steps the record
/// keeps (when it was written now). With KEYS[2] (one server), the answer's bytes and its steps'
/// are counted in that account of its subject when it is written (see `ACCOUNT`), and `{2, ..}`
/// says that count failed (the answer is recorded all the same). KEYS[1] record, KEYS[2]
/// (optional) the subject's account;
/// ARGV lease, status, response, retention (ms), and with KEYS[2] the bytes and the granule (ms).
const COMPLETE: &str = concat!(include_str!("count.lua"), include_str!("complete.lua"));

/// Renew (the heartbeat), if the lease still holds an in-progress record. KEYS[1]; ARGV lease,
/// lifetime (ms).
const RENEW: &str = include_str!("renew.lua");

/// Release, if the lease still holds an in-progress record: not deleted but left under lease `0`
/// (no claim's token), which the next claim takes at once, keeping the record's generation for the
/// same request (the retry of a released run is the same operation to a provider). KEYS[1]; ARGV
/// lease.
const RELEASE: &str = include_str!("release.lua");

/// Append a step (its bytes, see `step_list`) to the record, if the lease still holds it in
/// progress: `1` (`0`: not held). Steps count only under the generation they were recorded in
/// (`sg`): a record that got a generation of its own has none. KEYS[1]; ARGV lease, the step.
const STEP: &str = include_str!("step.lua");

/// The steps of the record the lease holds in progress: `h` then its steps' bytes (none when they
/// are another generation's); the empty string when the lease does not hold it. KEYS[1]; ARGV
/// lease.
const STEPS: &str = include_str!("steps.lua");

/// The steps of a live record (as `INSPECT` finds it live), whatever its state: its steps' bytes
/// (none when they are another generation's); the empty string without a live record. KEYS[1]
/// record.
const RECORDED_STEPS: &str = include_str!("recorded_steps.lua");

/// A live record as inspection shows it, or nil (absent, expired or released): state, creation
/// time (ms, `0` for a record written before creation times were kept), time to live (ms), the
/// server's time (ms), the stored status (`-1` while in progress), key, subject and endpoint.
/// KEYS[1] record.
const INSPECT: &str = include_str!("inspect.lua");

/// Delete a finished record: `{2, creation time}`; a live record in progress is left alone, `{1}`;
/// absent or released, `{0}`. KEYS[1] record.
const DELETE: &str = include_str!("delete.lua");

/// File a record in its subject's index at its creation time (an entry only ever moves later), and
/// keep the index at least as long as the record's lifetime. KEYS[1] the subject's index; ARGV
/// creation time (ms), record digest (hex), lifetime (ms).
const INDEX: &str = concat!(include_str!("file.lua"), include_str!("index.lua"));

/// Remove a record from its subject's index if its entry is still the one seen (same creation
/// time): an entry a new claim of the key just re-filed stays. KEYS[1] the subject's index; ARGV
/// record digest (hex), creation time (ms) as seen.
const UNINDEX: &str = include_str!("unindex.lua");

/// Add the bytes of an answer just recorded to its subject's account: a hash of bytes by the
/// granule in which they expire (the record's retention from now, rounded up), kept as long as
/// its last granule. KEYS[1] the subject's account; ARGV bytes, retention (ms), granule (ms).
const ACCOUNT: &str = concat!(include_str!("count.lua"), include_str!("account.lua"));

/// The bytes in a subject's account that have not expired, dropping the granules that have.
/// KEYS[1] the subject's account; ARGV granule (ms).
const USAGE: &str = include_str!("usage.lua");

/// The probe of a server with one address: writes a short-lived value under its second key, which
/// a plain read by that key alone then looks for (see `RedisStore::keys_together`). KEYS[1] and
/// KEYS[2] two probe keys; ARGV the value, its lifetime (ms).
const PROBE: &str = include_str!("probe.lua");

/// A Lua script: its source, for `EVAL`, and its SHA1, for `EVALSHA`.
pub(super) struct Lua {
    pub(super) code: &'static str,
    pub(super) sha1: String,
}

impl Lua {
    fn new(code: &'static str) -> Self {
        Lua {
            code,
            sha1: Script::new(code).get_hash().to_owned(),
        }
    }
}

pub(super) struct Scripts {
    pub(super) claim: Lua,
    pub(super) complete: Lua,
    pub(super) renew: Lua,
    pub(super) release: Lua,
    pub(super) step: Lua,
    pub(super) steps: Lua,
    pub(super) recorded_steps: Lua,
    pub(super) inspect: Lua,
    pub(super) delete: Lua,
    pub(super) index: Lua,
    pub(super) unindex: Lua,
    pub(super) account: Lua,
    pub(super) usage: Lua,
    pub(super) probe: Lua,
}

impl Scripts {
    pub(super) fn new() -> Self {
        Scripts {
            claim: Lua::new(CLAIM),
            complete: Lua::new(COMPLETE),
            renew: Lua::new(RENEW),
            release: Lua::new(RELEASE),
            step: Lua::new(STEP),
            steps: Lua::new(STEPS),
            recorded_steps: Lua::new(RECORDED_STEPS),
            inspect: Lua::new(INSPECT),
            delete: Lua::new(DELETE),
            index: Lua::new(INDEX),
            unindex: Lua::new(UNINDEX),
            account: Lua::new(ACCOUNT),
            usage: Lua::new(USAGE),
            probe: Lua::new(PROBE),
        }
    }
}
