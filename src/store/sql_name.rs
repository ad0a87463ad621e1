//! The table names the SQL stores accept: lower-case identifiers (`[a-z_][a-z0-9_]*`, at most 40
//! characters), so that every name fits the database's limits once suffixed for its indexes and
//! needs no escaping beyond the quotes every statement puts around it.

/// Whether `name` is one identifier of that form.
pub(crate) fn is_identifier(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 40
        && name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
}

/// Whether `table` is an identifier, optionally qualified by another (`schema.table`,
/// `database.table`).
#[cfg(any(feature = "postgres", feature = "mysql"))]
pub(crate) fn is_qualified_table(table: &str) -> bool {
    let mut parts = table.split('.');
    let (first, second, rest) = (parts.next(), parts.next(), parts.next());
    rest.is_none() && first.is_some_and(is_identifier) && second.is_none_or(is_identifier)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(any(feature = "postgres", feature = "mysql"))]
    fn tables_are_one_or_two_identifiers() {
        for good in ["idempotency", "_t1", "billing.idempotency", &"a".repeat(40)] {
            assert!(is_qualified_table(good), "{good}");
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
            assert!(!is_qualified_table(bad), "{bad}");
        }
    }
}
