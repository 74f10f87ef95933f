//! What the schema should hold, read from the store's own DDL (so that a table or an index
//! another version adds is checked without a list kept beside it), and the statement that
//! makes each missing piece.

/// One table or index the DDL creates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Expected {
    /// The table it is or belongs to.
    pub(super) table: String,
    /// The index's name; `None` for the table itself.
    pub(super) index: Option<String>,
    /// The statement that creates it on its own.
    pub(super) statement: String,
    /// A table's columns (none for an index).
    pub(super) columns: Vec<String>,
}

/// The words that begin a line of a `CREATE TABLE` that is not a column.
const NOT_COLUMNS: [&str; 7] = [
    "PRIMARY",
    "KEY",
    "UNIQUE",
    "CHECK",
    "CONSTRAINT",
    "INDEX",
    ")",
];

/// The column a line of a `CREATE TABLE` defines, if it defines one.
fn column(line: &str) -> Option<String> {
    let word = line.split_whitespace().next()?;
    if NOT_COLUMNS.iter().any(|k| word.starts_with(k)) {
        return None;
    }
    Some(word.trim_matches('`').to_owned())
}

/// The tables and indexes `ddl` creates: `CREATE TABLE IF NOT EXISTS t`, `CREATE [UNIQUE]
/// INDEX IF NOT EXISTS i ON t`, and MySQL's `[UNIQUE] KEY i (...)` lines inside a table,
/// which `migrate` cannot add to a table that exists: their statement is an `ALTER TABLE`.
pub(super) fn expected(ddl: &[String]) -> Vec<Expected> {
    let mut out = Vec::new();
    for statement in ddl {
        let words: Vec<&str> = statement.split_whitespace().collect();
        match words.as_slice() {
            ["CREATE", "TABLE", "IF", "NOT", "EXISTS", table, ..] => {
                let table = table.trim_end_matches('(').to_owned();
                out.push(Expected {
                    table: table.clone(),
                    index: None,
                    statement: statement.clone(),
                    columns: statement.lines().skip(1).filter_map(column).collect(),
                });
                for line in statement.lines().map(str::trim) {
                    let line = line.trim_end_matches(',');
                    let (unique, rest) = match line.strip_prefix("UNIQUE ") {
                        Some(rest) => ("UNIQUE ", rest),
                        None => ("", line),
                    };
                    if let Some(rest) = rest.strip_prefix("KEY ")
                        && let Some((name, columns)) = rest.split_once(' ')
                    {
                        out.push(Expected {
                            table: table.clone(),
                            index: Some(name.to_owned()),
                            statement: format!(
                                "ALTER TABLE {table} ADD {unique}KEY {name} {columns}"
                            ),
                            columns: Vec::new(),
                        });
                    }
                }
            }
            ["CREATE", "INDEX" | "UNIQUE", ..] => {
                let at = |w: &str| words.iter().position(|x| *x == w);
                if let (Some(exists), Some(on)) = (at("EXISTS"), at("ON")) {
                    out.push(Expected {
                        table: words[on + 1].to_owned(),
                        index: Some(words[exists + 1].to_owned()),
                        statement: statement.split_whitespace().collect::<Vec<_>>().join(" "),
                        columns: Vec::new(),
                    });
                }
            }
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_and_indexes_are_read_from_the_ddl() {
        let ddl = [
            "CREATE TABLE IF NOT EXISTS m (\n scope text,\n PRIMARY KEY (scope)\n)".to_owned(),
            "CREATE INDEX IF NOT EXISTS m_completed_at ON m (completed_at) WHERE x".to_owned(),
            "CREATE TABLE IF NOT EXISTS m_outbox (\n id VARBINARY(255) NOT NULL,\n \
             PRIMARY KEY (id),\n KEY idem_outbox_due (sent_at, parked),\n \
             UNIQUE KEY u (id)\n) ENGINE = InnoDB"
                .to_owned(),
        ];
        let found: Vec<(String, Option<String>)> = expected(&ddl)
            .into_iter()
            .map(|e| (e.table, e.index))
            .collect();
        let name = |s: &str| Some(s.to_owned());
        assert_eq!(
            found,
            [
                ("m".to_owned(), None),
                ("m".to_owned(), name("m_completed_at")),
                ("m_outbox".to_owned(), None),
                ("m_outbox".to_owned(), name("idem_outbox_due")),
                ("m_outbox".to_owned(), name("u")),
            ]
        );
        let columns = |i: usize| expected(&ddl)[i].columns.clone();
        assert_eq!(columns(0), ["scope"]);
        assert_eq!(columns(2), ["id"]);
        assert!(columns(1).is_empty());
        let alter = &expected(&ddl)[3].statement;
        assert_eq!(
            alter,
            "ALTER TABLE m_outbox ADD KEY idem_outbox_due (sent_at, parked)"
        );
    }
}
