//! The SQL every statement shares: the released lease, the default table, the lock and idle
//! bounds each statement sets for itself, and quoting.

/// The lease token of a released record: no claim holds it (`LeaseToken::generate` never gives 0).
pub(super) const RELEASED: i64 = 0;

/// The table `PostgresStore::new` uses.
pub(super) const DEFAULT_TABLE: &str = "idempotency_records";

/// The condition that makes a statement apply its lock timeout (see [`lock_bound_cte`]) before it
/// touches a row.
pub(super) const LOCK_BOUND: &str = "(SELECT bound FROM lock_bound) IS NOT NULL";

/// A common table expression that sets `lock_timeout` for the statement's own (implicit)
/// transaction from the text parameter `$n` (`"4000ms"`), evaluated before the statement waits on
/// any row lock (the statement's condition refers to it through [`LOCK_BOUND`]). Every statement on
/// a record carries it, so that no wait on a row lock (a handler's transaction whose connection
/// died between its completion and its commit, say) outlives the client's timeout: the server gives
/// up first and answers, and the connection is kept or goes back to the pool instead of being held
/// until the server finishes. A `statement_timeout` cannot be set this way (it is armed when the statement
/// starts); the statements are single-row index lookups, and lock waits are what can last.
pub(super) fn lock_bound_cte(n: u8) -> String {
    format!(
        "WITH lock_bound AS MATERIALIZED (SELECT set_config('lock_timeout', ${n}, true) AS bound)"
    )
}

/// [`lock_bound_cte`], which also bounds how long the statement's transaction may then stay idle,
/// from the text parameter `$idle`: for the completion written in a handler's transaction, after
/// which the record's row is held by that transaction until its commit.
pub(super) fn lock_and_idle_bound_cte(n: u8, idle: u8) -> String {
    format!(
        "WITH lock_bound AS MATERIALIZED (SELECT set_config('lock_timeout', ${n}, true) AS bound, \
           set_config('idle_in_transaction_session_timeout', ${idle}, true) AS idle)"
    )
}

/// `ident` as a quoted SQL identifier (a `"` inside doubled).
pub(super) fn quote_ident(ident: &str) -> String {
    format!("\"{}\"", ident.replace('"', "\"\""))
}
