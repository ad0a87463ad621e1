//! The table names the SQL stores accept: lower-case identifiers (`[a-z_][a-z0-9_]*`, at most 40
//! characters), so that every name fits the database's limits once suffixed for its indexes and
//! needs no escaping beyond the quotes every statement puts around it; and the one error a name
//! that is not of that form gives, whichever the store.

use std::fmt;

/// An invalid table name given to an SQL store's `with_table`
/// ([`PostgresStore`](crate::store::PostgresStore), [`MySqlStore`](crate::store::MySqlStore),
/// [`SqliteStore`](crate::store::SqliteStore)); its message says the form the store accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidTableName {
    table: String,
    form: &'static str,
}

impl InvalidTableName {
    /// The name that was refused.
    pub fn table(&self) -> &str {
        &self.table
    }
}

impl fmt::Display for InvalidTableName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} is not a valid table name: use [a-z_][a-z0-9_]* (at most 40 characters){}",
            self.table, self.form
        )
    }
}

impl std::error::Error for InvalidTableName {}

/// Whether `name` is one identifier of that form.
fn is_identifier(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 40
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// `table` when it is an identifier, optionally qualified by another (`schema.table` on
/// PostgreSQL, `database.table` on MySQL: `qualifier` names which).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn qualified_table<'a>(
    table: &'a str,
    qualifier: &'static str,
) -> Result<&'a str, InvalidTableName> {
    let mut parts = table.split('.');
    let (first, second, rest) = (parts.next(), parts.next(), parts.next());
    if rest.is_none() && first.is_some_and(is_identifier) && second.is_none_or(is_identifier) {
        Ok(table)
    } else {
        Err(InvalidTableName {
            table: table.to_owned(),
            form: qualifier,
        })
    }
}

/// `table` when it is one identifier not starting with `sqlite_` (SQLite keeps those names for
/// itself).
#[cfg(feature = "sqlite")]
pub(crate) fn plain_table(table: &str) -> Result<&str, InvalidTableName> {
    if is_identifier(table) && !table.starts_with("sqlite_") {
        Ok(table)
    } else {
        Err(InvalidTableName {
            table: table.to_owned(),
            form: ", not starting with sqlite_",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    fn tables_are_one_or_two_identifiers() {
        for good in ["idempotency", "_t1", "billing.idempotency", &"a".repeat(40)] {
            assert!(qualified_table(good, "").is_ok(), "{good}");
        }
        for bad in [
            "",
            "Idem",
            "1t",
            "a.b.c",
            "a.",
            ".a",
            "a-b",
            "a\"b",
            &"a".repeat(41),
        ] {
            let refused = qualified_table(bad, ", optionally as schema.table").expect_err(bad);
            assert_eq!(refused.table(), bad);
            assert!(refused.to_string().contains("schema.table"), "{refused}");
        }
    }

    #[test]
    #[cfg(feature = "sqlite")]
    fn sqlite_tables_are_one_identifier_not_sqlites_own() {
        assert!(plain_table("idempotency").is_ok());
        for bad in ["billing.idempotency", "sqlite_records", "Idem", ""] {
            let refused = plain_table(bad).expect_err(bad);
            assert!(refused.to_string().contains("sqlite_"), "{refused}");
        }
    }
}
