//! The statements on the table, written per call with their values as literals (see `sql.rs`), and
//! batched: several statements, one round trip.

use std::time::Duration;

use super::sql::{
    NOW, RELEASED, binary, epoch_micros, hex, hex_or_null, micros, now_plus, quote_ident,
};
use crate::store::{ClaimRequest, LeaseToken, StoredResponse};

/// The server, as a mark names it (see [`Statements::mark`]): its host, port and server id (a
/// replica's are its own), as bytes (compared with the column, a text would meet the table's
/// collation, which may differ from the variables').
const SERVER: &str = "CAST(CONCAT(@@hostname, ':', @@port, ':', @@server_id) AS BINARY)";

/// Whether the record's mark was made by this server since it last started: named by it, and made
/// a second at least after its start. The start is in whole seconds of the Unix epoch:
/// `UUID_SHORT()` is `(server_id & 255) << 56 | started << 24` plus a counter of its calls, on
/// MySQL and MariaDB alike, and costs a function call, where the `Uptime` status is a table read
/// (in `information_schema` on MariaDB, `performance_schema` on MySQL). The counter's carry into
/// the start (one second per 2^24 calls) only makes the server look younger: a mark made just
/// before a carry may count for nothing, and the record is marked again. The mark's time is read
/// as seconds before now, so that no time zone enters.
fn marked_here() -> String {
    format!(
        "(suspected_on <=> {SERVER} AND UNIX_TIMESTAMP() \
           - TIMESTAMPDIFF(SECOND, suspected_at, {NOW}) >= ((UUID_SHORT() >> 24) & 4294967295) + 1)"
    )
}

/// A record with no mark that counts: none, one older than its last renewal, or one made by
/// another server, or by this one before it last started.
fn unmarked() -> String {
    format!(
        "(suspected_at IS NULL OR suspected_at < updated_at OR NOT {})",
        marked_here()
    )
}

/// The longer of the claimer's in-progress TTL (`ttl`, µs) and the holder's, as an interval.
fn holder_ttl(ttl: i64) -> String {
    format!("INTERVAL GREATEST({ttl}, in_progress_ttl_us) MICROSECOND")
}

/// A record not renewed for the longer of the claimer's TTL (`ttl`, µs) and its holder's.
fn silent(ttl: i64) -> String {
    format!("updated_at <= {NOW} - {}", holder_ttl(ttl))
}

/// Rows removed per statement by `purge_expired`, so no single statement holds locks for long.
pub(super) const PURGE_BATCH: u64 = 10_000;

/// A statement that runs at READ COMMITTED whatever the session's level, so that it takes no gap
/// lock (the next transaction only, which for an autocommitted statement is that statement).
const READ_COMMITTED: &str = "SET TRANSACTION ISOLATION LEVEL READ COMMITTED";

/// A record inspection shows: not past its expiry, not released.
const LIVE: &str =
    "expires_at > UTC_TIMESTAMP(6) AND NOT (status = 'in_progress' AND lease_token = 0)";

/// One completion of [`Statements::complete_many`]: its record's scope, its lease, the response
/// and its headers, encoded, and the record's retention.
pub(super) struct Completing<'a> {
    pub(super) scope: &'a [u8; 32],
    pub(super) lease: LeaseToken,
    pub(super) response: &'a StoredResponse,
    pub(super) headers: &'a [u8],
    pub(super) retention: Duration,
}

/// Statements sent together, in one round trip.
#[derive(Debug, Default)]
pub(super) struct Batch {
    pub(super) sql: String,
    /// How many statements (each answers once).
    pub(super) statements: usize,
}

impl Batch {
    pub(super) fn push(mut self, statement: &str) -> Self {
        if !self.sql.is_empty() {
            self.sql.push_str(";\n");
        }
        self.sql.push_str(statement);
        self.statements += 1;
        self
    }
}

/// The statements of one store on its table.
#[derive(Debug)]
pub(super) struct Statements {
    /// The table's name as configured, for messages.
    pub(super) table: String,
    /// The table's own name, without its database.
    pub(super) name: String,
    /// The database named with it, if any.
    pub(super) database: Option<String>,
    /// The table as written in SQL: every part quoted.
    pub(super) quoted: String,
    /// Whether the table has its `body_bytes` column (`migrations/mysql/0002`), as far as this
    /// store knows: until a count finds it missing (a table not migrated since), counts read it.
    pub(super) body_bytes: std::sync::atomic::AtomicBool,
    /// Whether a subject's count may name the steps' column (`migrations/mysql/0004`): until a
    /// count finds it missing.
    pub(super) counts_steps: std::sync::atomic::AtomicBool,
}

impl Statements {
    /// The statements on `table` (`database.table` or `table`, validated).
    pub(super) fn new(table: &str) -> Self {
        let (database, name) = match table.split_once('.') {
            Some((database, name)) => (Some(database.to_owned()), name.to_owned()),
            None => (None, table.to_owned()),
        };
        let quoted = match &database {
            Some(database) => format!("{}.{}", quote_ident(database), quote_ident(&name)),
            None => quote_ident(&name),
        };
        Statements {
            body_bytes: std::sync::atomic::AtomicBool::new(true),
            counts_steps: std::sync::atomic::AtomicBool::new(true),
            table: table.to_owned(),
            name,
            database,
            quoted,
        }
    }

    /// The claim, in one round trip whatever it finds:
    ///
    /// 1. insert the record, or leave the row that is there as it is (`ON DUPLICATE KEY UPDATE`
    ///    a column to itself: no error, no change; a concurrent insert of the key is waited for);
    /// 2. take the row by compare-and-swap if it is there to take: past its expiry, released, or
    ///    in progress with this fingerprint, not renewed for the longer of the two TTLs, and its
    ///    lease's presence not shown by a live keeper (its named lock free, see `presence.rs`),
    ///    and marked silent a TTL ago at least by this server process, with no renewal since
    ///    (see [`Statements::mark`]): a restart or a failover ends every named lock and stops
    ///    renewals while it lasts, and keepers need a moment to show their presences again, so
    ///    the time the server was down does not count against a live holder. The row
    ///    is locked and its newest committed version read, so of concurrent takers exactly
    ///    one matches: the others then find it renewed. The creation time and the generation are
    ///    assigned first, from the row as it was (whether the server assigns in order or all at
    ///    once, `SIMULTANEOUS_ASSIGNMENT`), and kept by the retake of the same operation;
    /// 3. read the row as it is now: each statement autocommits, so this read sees every commit
    ///    before it, the winner's of a race included, whatever the isolation level.
    ///
    /// The caller holds the record when its lease is the row's. Columns of the read: status,
    /// lease_token, same_fp, response_status, response_headers, response_body (for the same
    /// fingerprint only), expires_in_us, generation.
    pub(super) fn claim(
        &self,
        request: &ClaimRequest,
        scope: &[u8; 32],
        subject_digest: &[u8; 32],
    ) -> Batch {
        let t = &self.quoted;
        let key = &request.key;
        let scope = hex(scope);
        let fingerprint = hex(request.fingerprint.as_bytes());
        let generation = hex(&request.generation.0);
        let lease = request.lease.0;
        let ttl = micros(request.in_progress_ttl);
        let expires = now_plus(request.in_progress_ttl + request.retention);
        let insert = format!(
            "INSERT INTO {t} (scope, idempotency_key, subject, subject_digest, endpoint, \
               fingerprint, status, lease_token, generation, in_progress_ttl_us, created_at, \
               updated_at, expires_at, suspected_at, suspected_on) \
             VALUES ({scope}, {}, {}, {}, {}, {fingerprint}, 'in_progress', {lease}, \
               {generation}, {ttl}, {NOW}, {NOW}, {expires}, NULL, NULL) \
             ON DUPLICATE KEY UPDATE scope = scope",
            hex(key.key.as_bytes()),
            hex(key.subject.as_bytes()),
            hex(subject_digest),
            hex(key.endpoint.as_bytes()),
        );
        let take = format!(
            "UPDATE {t} SET \
               created_at = IF(status = 'in_progress' AND expires_at > {NOW} \
                               AND lease_token <> {RELEASED}, created_at, {NOW}), \
               generation = IF(status = 'in_progress' AND expires_at > {NOW} \
                               AND fingerprint = {fingerprint}, generation, {generation}), \
               fingerprint = {fingerprint}, status = 'in_progress', lease_token = {lease}, \
               response_status = NULL, response_headers = NULL, response_body = NULL, \
               updated_at = {NOW}, expires_at = {expires}, in_progress_ttl_us = {ttl}, \
               suspected_at = NULL, suspected_on = NULL \
             WHERE scope = {scope} AND (expires_at <= {NOW} OR (lease_token <> {lease} \
               AND status = 'in_progress' AND (lease_token = {RELEASED} \
                 OR (fingerprint = {fingerprint} AND {silent} \
                     AND suspected_at >= updated_at \
                     AND suspected_at <= {NOW} - {holder_ttl} \
                     AND {marked_here} \
                     AND IS_FREE_LOCK({presence}) = 1))))",
            presence = super::presence::lock_name_sql("lease_token"),
            silent = silent(ttl),
            holder_ttl = holder_ttl(ttl),
            marked_here = marked_here(),
        );
        Batch::default()
            .push(READ_COMMITTED)
            .push(&insert)
            .push(READ_COMMITTED)
            .push(&take)
            .push(&self.claim_read(request, &scope))
    }

    /// The claims of `claims` (distinct scopes: request, scope, subject digest) in one round trip
    /// (SPEC 26): one insert of the records not there (a record that is there is never locked nor
    /// waited for: its absence is read as last committed, and only rows absent then are written),
    /// then one read of every claim's record as the claim's own read reads it (see
    /// [`Statements::claim_read`]), with the claim's place (`i`, from 0) and whether it must go
    /// alone (`alone`): the record is there to take (past its expiry, released, or silent: the
    /// single claim takes it, or marks it, by compare-and-swap). Rows are inserted in scope order,
    /// so that two batches never wait on each other in a cycle. Without `with_insert`, the read
    /// alone.
    pub(super) fn claim_many(
        &self,
        claims: &[(&ClaimRequest, &[u8; 32], &[u8; 32])],
        with_insert: bool,
    ) -> Batch {
        let t = &self.quoted;
        // Every value of a row in the insert's rows; the read's only what it compares.
        let mut rows = String::new();
        let mut keys = String::new();
        for (i, (request, scope, subject_digest)) in claims.iter().enumerate() {
            let key = &request.key;
            if i > 0 {
                rows.push_str(" UNION ALL ");
                keys.push_str(" UNION ALL ");
            }
            let (scope, fingerprint) = (binary(*scope), binary(request.fingerprint.as_bytes()));
            let (lease, ttl) = (request.lease.0, micros(request.in_progress_ttl));
            rows.push_str(&format!(
                "SELECT {scope} AS s, {} AS k, {} AS sub, {} AS sd, {} AS ep, {fingerprint} AS f, \
                   {lease} AS l, {} AS g, {ttl} AS ttl, {} AS e",
                binary(key.key.as_bytes()),
                binary(key.subject.as_bytes()),
                binary(*subject_digest),
                binary(key.endpoint.as_bytes()),
                binary(&request.generation.0),
                now_plus(request.in_progress_ttl + request.retention),
            ));
            keys.push_str(&format!(
                "SELECT {i} AS i, {scope} AS s, {fingerprint} AS f, {lease} AS l, {ttl} AS ttl"
            ));
        }
        let insert = format!(
            "INSERT INTO {t} (scope, idempotency_key, subject, subject_digest, endpoint, \
               fingerprint, status, lease_token, generation, in_progress_ttl_us, created_at, \
               updated_at, expires_at, suspected_at, suspected_on) \
             SELECT r.s, r.k, r.sub, r.sd, r.ep, r.f, 'in_progress', r.l, r.g, r.ttl, {NOW}, \
               {NOW}, r.e, NULL, NULL \
             FROM ({rows}) AS r \
             WHERE NOT EXISTS (SELECT 1 FROM {t} AS there WHERE there.scope = r.s) \
             ORDER BY r.s \
             ON DUPLICATE KEY UPDATE scope = scope"
        );
        let read = format!(
            "SELECT r.i, rec.status, rec.lease_token, rec.fingerprint = r.f AS same_fp, \
               rec.response_status, rec.response_headers, \
               IF(rec.fingerprint = r.f, rec.response_body, NULL) AS response_body, \
               TIMESTAMPDIFF(MICROSECOND, {NOW}, rec.expires_at) AS expires_in_us, \
               rec.generation, \
               COALESCE(rec.expires_at <= {NOW} OR (rec.status = 'in_progress' \
                 AND rec.lease_token <> r.l AND (rec.lease_token = {RELEASED} \
                   OR (rec.fingerprint = r.f \
                     AND rec.updated_at <= {NOW} \
                       - INTERVAL GREATEST(r.ttl, rec.in_progress_ttl_us) MICROSECOND))), 1) \
                 AS alone \
             FROM ({keys}) AS r STRAIGHT_JOIN {t} AS rec ON rec.scope = r.s"
        );
        if !with_insert {
            return Batch::default().push(&read);
        }
        Batch::default()
            .push(READ_COMMITTED)
            .push(&insert)
            .push(&read)
    }

    /// The claim's read of the record, as last committed (a plain read waits on no row lock).
    /// `scope` is the scope's literal.
    pub(super) fn claim_read(&self, request: &ClaimRequest, scope: &str) -> String {
        let t = &self.quoted;
        let fingerprint = hex(request.fingerprint.as_bytes());
        format!(
            "SELECT status, lease_token, fingerprint = {fingerprint} AS same_fp, \
               response_status, response_headers, \
               IF(fingerprint = {fingerprint}, response_body, NULL) AS response_body, \
               TIMESTAMPDIFF(MICROSECOND, {NOW}, expires_at) AS expires_in_us, generation, \
               COALESCE(status = 'in_progress' AND lease_token <> {RELEASED} \
                 AND lease_token <> {lease} AND fingerprint = {fingerprint} \
                 AND expires_at > {NOW} AND {silent} \
                 AND {unmarked} \
                 AND IS_FREE_LOCK({presence}) = 1, 0) AS unmarked \
             FROM {t} WHERE scope = {scope}",
            lease = request.lease.0,
            silent = silent(micros(request.in_progress_ttl)),
            presence = super::presence::lock_name_sql("lease_token"),
            unmarked = unmarked(),
        )
    }

    /// The mark of a record held by `lease` whose holder the claim found silent, its named lock
    /// free (see `migrations/mysql/0003`): a record is taken only by a claim a TTL after its
    /// mark, if no renewal came in between, on the server that made it since it last started
    /// ([`marked_here`]), so that the holder gets a whole TTL from a time this server took
    /// writes (a restart, a failover, a proxy restarted, end its named lock and stop its
    /// renewals; a mark made before a failover does not count after it, even if renewals after
    /// it were lost with the old primary). A holder whose lock is held is not marked: a mark
    /// made while it was known alive would let a failover just after it count the time before
    /// it against the holder. Sent only when the claim's read found it unmarked.
    pub(super) fn mark(&self, scope: &[u8; 32], lease: i64, in_progress_ttl: Duration) -> Batch {
        let t = &self.quoted;
        let mark = format!(
            "UPDATE {t} SET suspected_at = {NOW}, suspected_on = {SERVER} \
             WHERE scope = {} AND lease_token = {lease} AND lease_token <> {RELEASED} \
               AND status = 'in_progress' AND expires_at > {NOW} AND {} AND {} \
               AND IS_FREE_LOCK({}) = 1",
            hex(scope),
            silent(micros(in_progress_ttl)),
            unmarked(),
            super::presence::lock_name_sql("lease_token"),
        );
        Batch::default().push(READ_COMMITTED).push(&mark)
    }

    /// The completion, fenced by the lease, then whether the lease has finished the record (also
    /// when an earlier attempt of this lease finished it and its answer was lost). `headers` are
    /// the response's, encoded.
    pub(super) fn complete(
        &self,
        scope: &[u8; 32],
        lease: LeaseToken,
        response: &StoredResponse,
        headers: &[u8],
        retention: Duration,
    ) -> Batch {
        let t = &self.quoted;
        let body = (!response.body_omitted).then_some(&response.body[..]);
        let update = format!(
            "UPDATE {t} SET status = '{}', response_status = {}, response_headers = {}, \
               response_body = {}, updated_at = {NOW}, expires_at = {} \
             WHERE {}",
            response.outcome.as_str(),
            response.status,
            hex(headers),
            hex_or_null(body),
            now_plus(retention),
            held(scope, lease),
        );
        Batch::default()
            .push(&update)
            .push(&self.finished_by(scope, lease))
    }

    /// The completions of `completions` (distinct scopes) in one round trip (SPEC 26): one update
    /// of one table, each row fenced by its own lease, then which of them their lease has
    /// finished (`i`, from 0, and `done`), as [`Statements::finished_by`] reads it for one.
    pub(super) fn complete_many(&self, completions: &[Completing<'_>]) -> Batch {
        let t = &self.quoted;
        // Each column's value for each record, by its scope.
        let mut status = String::from("CASE scope");
        let mut response_status = status.clone();
        let mut response_headers = status.clone();
        let mut response_body = status.clone();
        let mut expires_at = status.clone();
        let mut lease = status.clone();
        let mut scopes = String::new();
        let mut fences = String::new();
        for (i, c) in completions.iter().enumerate() {
            let scope = binary(c.scope);
            if i > 0 {
                scopes.push_str(", ");
                fences.push_str(" UNION ALL ");
            }
            let body = (!c.response.body_omitted).then_some(&c.response.body[..]);
            let when = |column: &mut String, value: &str| {
                column.push_str(&format!(" WHEN {scope} THEN {value}"));
            };
            when(&mut status, &format!("'{}'", c.response.outcome.as_str()));
            when(&mut response_status, &c.response.status.to_string());
            when(&mut response_headers, &binary(c.headers));
            when(
                &mut response_body,
                &body.map_or_else(|| "NULL".to_owned(), binary),
            );
            when(&mut expires_at, &now_plus(c.retention));
            when(&mut lease, &c.lease.0.to_string());
            scopes.push_str(&scope);
            fences.push_str(&format!(
                "SELECT {i} AS i, {scope} AS s, {} AS l",
                c.lease.0
            ));
        }
        // One table, its rows found by their keys (a scan at READ COMMITTED reads a row another
        // transaction holds locked as last committed, and skips it unless it matches). A row of
        // the batch another transaction holds (a record retaken from a lease that lost it, whose
        // new holder's transaction is committing) is waited for, at most a second (the least
        // MySQL takes; the batch's bound puts the session's own value back after it): the batch
        // then fails, and each of its rows goes alone.
        let update = format!(
            "UPDATE {t} SET status = {status} END, response_status = {response_status} END, \
               response_headers = {response_headers} END, response_body = {response_body} END, \
               updated_at = {NOW}, expires_at = {expires_at} END \
             WHERE scope IN ({scopes}) AND lease_token = {lease} END \
               AND lease_token <> {RELEASED} AND status = 'in_progress'"
        );
        let read = format!(
            "SELECT r.i, rec.lease_token = r.l AND rec.status <> 'in_progress' AS done \
             FROM ({fences}) AS r STRAIGHT_JOIN {t} AS rec ON rec.scope = r.s"
        );
        Batch::default()
            .push(READ_COMMITTED)
            .push("SET SESSION innodb_lock_wait_timeout = 1")
            .push(&update)
            .push(&read)
    }

    /// One row, `1` when `lease` finished the record, `0` when not; none without a record.
    pub(super) fn finished_by(&self, scope: &[u8; 32], lease: LeaseToken) -> String {
        format!(
            "SELECT lease_token = {} AND status <> 'in_progress' FROM {} WHERE scope = {}",
            lease.0,
            self.quoted,
            hex(scope)
        )
    }

    /// The heartbeat: restarts the in-progress clock and pushes the expiry.
    pub(super) fn renew(&self, scope: &[u8; 32], lease: LeaseToken, lifetime: Duration) -> Batch {
        Batch::default().push(&format!(
            "UPDATE {} SET updated_at = {NOW}, suspected_at = NULL, expires_at = {} WHERE {}",
            self.quoted,
            now_plus(lifetime),
            held(scope, lease)
        ))
    }

    /// Not deleted: left in progress under no lease (`RELEASED`) and stale at once (renewed at the
    /// earliest time a `DATETIME` holds), so the next claim takes it.
    pub(super) fn release(&self, scope: &[u8; 32], lease: LeaseToken) -> Batch {
        Batch::default().push(&format!(
            "UPDATE {} SET lease_token = {RELEASED}, updated_at = '1000-01-01 00:00:00' WHERE {}",
            self.quoted,
            held(scope, lease)
        ))
    }

    /// A step appended while the lease holds the record in progress; steps of another
    /// generation are the record's earlier operation's, and go. (MySQL assigns left to right:
    /// `steps` reads the generation of the steps before they are renamed.)
    pub(super) fn record_step(&self, scope: &[u8; 32], lease: LeaseToken, step: &[u8]) -> Batch {
        let step = hex(step);
        Batch::default().push(&format!(
            "UPDATE {} SET steps = IF(steps_generation <=> generation, \
               CONCAT(COALESCE(steps, X''), {step}), {step}), steps_generation = generation \
             WHERE {}",
            self.quoted,
            held(scope, lease)
        ))
    }

    /// One row while the lease holds the record in progress: its steps (NULL when none are its
    /// operation's).
    pub(super) fn steps(&self, scope: &[u8; 32], lease: LeaseToken) -> Batch {
        Batch::default().push(&format!(
            "SELECT IF(steps_generation <=> generation, steps, NULL) FROM {} WHERE {}",
            self.quoted,
            held(scope, lease)
        ))
    }

    /// One row while the record is live, as [`Self::lookup`] finds it: the steps of its
    /// operation (NULL when none are). A plain read: it waits on no lock.
    pub(super) fn recorded_steps(&self, scope: &[u8; 32]) -> Batch {
        Batch::default().push(&format!(
            "SELECT IF(steps_generation <=> generation, steps, NULL) FROM {} \
             WHERE scope = {} AND {LIVE}",
            self.quoted,
            hex(scope)
        ))
    }

    /// One batch of expired records deleted, through the expiry index.
    pub(super) fn purge(&self) -> Batch {
        Batch::default().push(READ_COMMITTED).push(&format!(
            "DELETE FROM {} WHERE expires_at <= {NOW} LIMIT {PURGE_BATCH}",
            self.quoted
        ))
    }

    /// Columns: status, response_status, created_us, expires_us.
    pub(super) fn lookup(&self, scope: &[u8; 32]) -> Batch {
        Batch::default().push(&format!(
            "SELECT status, response_status, {}, {} FROM {} WHERE scope = {} AND {LIVE}",
            epoch_micros("created_at"),
            epoch_micros("expires_at"),
            self.quoted,
            hex(scope)
        ))
    }

    /// Only a finished, live record is deleted: the row is locked and its newest version checked,
    /// so one taken back in progress meanwhile is left alone. Then whether a record is held in
    /// progress (one row, its count).
    ///
    /// The record's answer goes, and the row stays a minute (at most to its expiry) as a released
    /// record under `token` in place of a fingerprint, which every claim takes as a new operation
    /// and inspection does not show: the same batch sent again (its answer was lost after it
    /// committed, and the store resends it on another connection) finds its token and answers as
    /// the first did (the third statement).
    pub(super) fn delete(&self, scope: &[u8; 32], token: &[u8; 32]) -> Batch {
        let (t, scope, token) = (&self.quoted, hex(scope), hex(token));
        Batch::default()
            .push(READ_COMMITTED)
            .push(&format!(
                "UPDATE {t} SET status = 'in_progress', lease_token = {RELEASED}, \
                   fingerprint = {token}, response_status = NULL, response_headers = NULL, \
                   response_body = NULL, updated_at = '1000-01-01 00:00:00', \
                   expires_at = LEAST(expires_at, {NOW} + INTERVAL 1 MINUTE) \
                 WHERE scope = {scope} AND status <> 'in_progress' AND expires_at > {NOW}"
            ))
            .push(&format!(
                "SELECT COUNT(*) FROM {t} WHERE scope = {scope} AND status = 'in_progress' \
                 AND lease_token <> {RELEASED} AND expires_at > {NOW}"
            ))
            .push(&format!(
                "SELECT COUNT(*) FROM {t} WHERE scope = {scope} AND lease_token = {RELEASED} \
                 AND fingerprint = {token}"
            ))
    }

    /// A subject's live records (released ones included), counted up to `limit` on the subject
    /// index.
    /// `column`: read the bytes from `body_bytes` (a table migrated to it), not from the bodies.
    /// `steps`: add the bytes of every step the row keeps, whatever its generation (a table
    /// migrated to `0004`).
    pub(super) fn count(
        &self,
        subject_digest: &[u8; 32],
        limit: u64,
        column: bool,
        steps: bool,
    ) -> Batch {
        let body = if column {
            "body_bytes"
        } else {
            "COALESCE(LENGTH(response_body), 0)"
        };
        let bytes = if steps {
            format!("{body} + COALESCE(LENGTH(steps), 0)")
        } else {
            body.to_owned()
        };
        Batch::default().push(&format!(
            "SELECT COUNT(*), CAST(COALESCE(SUM(bytes), 0) AS SIGNED) FROM (SELECT \
               {bytes} AS bytes FROM {} WHERE subject_digest = {} \
               AND expires_at > {NOW} LIMIT {limit}) live",
            self.quoted,
            hex(subject_digest)
        ))
    }

    /// A page of a subject's records after `after` (microseconds since the epoch, scope), in the
    /// subject index's order. Columns: scope, idempotency_key, endpoint, status, response_status,
    /// created_us, expires_us.
    pub(super) fn list(
        &self,
        subject_digest: &[u8; 32],
        after: Option<(i64, &[u8; 32])>,
        limit: usize,
    ) -> Batch {
        // The range a `DATETIME` holds (the years 1000 to 9999): only a forged cursor lies
        // outside, and clamped it lists what it would have.
        const FIRST_US: i64 = -30_610_224_000_000_000;
        const LAST_US: i64 = 253_402_300_799_999_999;
        let after = match after {
            None => String::new(),
            Some((created_us, scope)) => {
                let at = format!(
                    "TIMESTAMPADD(MICROSECOND, {}, '1970-01-01 00:00:00')",
                    created_us.clamp(FIRST_US, LAST_US)
                );
                format!(
                    " AND (created_at > {at} OR (created_at = {at} AND scope > {}))",
                    hex(scope)
                )
            }
        };
        Batch::default().push(&format!(
            "SELECT scope, idempotency_key, endpoint, status, response_status, {}, {} FROM {} \
             WHERE subject_digest = {} AND {LIVE}{after} ORDER BY created_at, scope LIMIT {limit}",
            epoch_micros("created_at"),
            epoch_micros("expires_at"),
            self.quoted,
            hex(subject_digest)
        ))
    }

    /// A query that fails when the table lacks a column this version reads or writes.
    pub(super) fn check_shape(&self) -> String {
        format!(
            "SELECT scope, idempotency_key, subject, subject_digest, endpoint, fingerprint, \
               status, lease_token, generation, in_progress_ttl_us, response_status, \
               response_headers, response_body, created_at, updated_at, expires_at \
             FROM {} LIMIT 0",
            self.quoted
        )
    }
}

/// The condition of a write fenced by the lease: the record is in progress under `lease`, which is
/// a claim's (never the released mark).
fn held(scope: &[u8; 32], lease: LeaseToken) -> String {
    format!(
        "scope = {} AND lease_token = {} AND lease_token <> {RELEASED} AND status = 'in_progress'",
        hex(scope),
        lease.0
    )
}
