//! How a backend writes its statements. A statement set (one per concern: claims, leases, the
//! outbox...) is declared once, generically, with each statement's binds by name and type
//! ([`statements!`]); each backend writes each statement's text, `{t}` standing for the table
//! and `:name` for a bind. Filling a text for a table turns the names into the backend's own
//! placeholders and records the order in which the binds go ([`Template`]): the order is
//! written once, where the text is, for every backend alike, and a unit test per backend
//! checks that every name in a text is one of its statement's binds. The texts are filled
//! once per `Store`, so every call reuses the same strings and hits
//! sqlx's prepared-statement cache.

use std::borrow::Cow;
use std::sync::Arc;

use sqlx::{SqlSafeStr as _, SqlStr};

use super::wake::Wake;
use crate::error::{Error, Refusal};

/// The longest table name a store accepts: the names derived from it (the index
/// `{table}_completed_at`) must fit PostgreSQL's 63-byte identifiers, which it would otherwise
/// cut silently, merging the index names of tables with a long common prefix.
pub const MAX_TABLE_LEN: usize = 47;

/// A marker table's name, checked to be a plain identifier: the only way a name reaches SQL.
/// It also says how the statements filled with it are sent: prepared once per connection and
/// kept (sqlx's statement cache), or unnamed, prepared again at each execution, which is what
/// survives a pooler in transaction mode (see [`Table::unnamed`]).
///
/// It also carries the commits of the store's outbox messages that its relays wait on
/// ([`Wake`]), shared by the store's clones: a statement's check (`Check`) names the table,
/// and so reaches them after the commit it checked.
#[derive(Debug, Clone)]
pub struct Table {
    name: String,
    unnamed: bool,
    /// Outbox messages go to the write-ahead log as logical decoding messages, not to the
    /// outbox table (PostgreSQL, `Store::outbox_through_wal`).
    wal: bool,
    wake: Arc<Wake>,
}

impl PartialEq for Table {
    fn eq(&self, other: &Table) -> bool {
        self.name == other.name && self.unnamed == other.unnamed && self.wal == other.wal
    }
}

impl Eq for Table {}

impl Table {
    /// A letter or `_`, then letters, digits or `_`, at most [`MAX_TABLE_LEN`] characters;
    /// anything else is [`Refusal::Table`].
    pub(crate) fn new(name: &str) -> Result<Table, Error> {
        let mut chars = name.chars();
        let plain = matches!(chars.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
            && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
            && name.len() <= MAX_TABLE_LEN;
        if !plain {
            return Err(Error::Refused(Refusal::Table {
                name: name.to_owned(),
            }));
        }
        Ok(Table {
            name: name.to_owned(),
            unnamed: false,
            wal: false,
            wake: Wake::new(),
        })
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.name
    }

    /// The same table, its statements sent as unnamed prepared statements. A pooler in
    /// transaction mode (PgBouncer before 1.21, or without `max_prepared_statements`) hands
    /// each transaction (and each statement outside one) whichever server connection is free:
    /// a statement prepared under a name on one is missing on the next, and two clients'
    /// names collide on a server connection they share. The unnamed statement lives only
    /// until the next one on the same server connection, within the same message sequence.
    ///
    /// The table it returns has commits of its own ([`Table::wake`]): a store's relays are
    /// woken by the commits of the store they were given, not of the one it was made from.
    pub(crate) fn unnamed(mut self, unnamed: bool) -> Self {
        self.unnamed = unnamed;
        self.wake = Wake::new();
        self
    }

    /// The commits of the store's outbox messages, which its relays wait on.
    pub(crate) fn wake(&self) -> &Arc<Wake> {
        &self.wake
    }

    /// The same table, its outbox messages written to the WAL ([`Table::wal`]).
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn through_wal(mut self, wal: bool) -> Self {
        self.wal = wal;
        self
    }

    /// Whether outbox messages go to the write-ahead log rather than the outbox table.
    #[cfg_attr(not(feature = "postgres"), allow(dead_code))]
    pub(crate) fn is_through_wal(&self) -> bool {
        self.wal
    }

    /// Whether the statements are sent unnamed ([`Table::unnamed`]).
    pub(crate) fn is_unnamed(&self) -> bool {
        self.unnamed
    }

    /// `template` with `{t}` replaced by this name, which [`Table::new`] checked to be a plain
    /// identifier: formatting it into SQL is then safe.
    pub(crate) fn fill(&self, template: &str) -> SqlStr {
        sqlx::AssertSqlSafe(template.replace("{t}", self.as_str())).into_sql_str()
    }
}

/// A statement's text as a backend writes it: `{t}` for the table, `:name` for a bind.
pub(crate) type Text = Cow<'static, str>;

/// How a backend writes its placeholders.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placeholders {
    /// PostgreSQL's `$1`, `$2`: each bind once, used as often as the text likes.
    Dollar,
    /// SQLite's `?1`, `?2`, the same way.
    Numbered,
    /// MySQL's `?`: one bind per mark, in order (a name used twice is bound twice).
    Question,
}

/// One statement filled for one table: its text with the backend's placeholders, and which of
/// the statement's binds goes to each placeholder, in order.
#[derive(Debug, Clone)]
pub(crate) struct Template {
    pub(super) sql: SqlStr,
    pub(super) order: Box<[u8]>,
    /// Kept prepared on the connection (sqlx's default), or sent unnamed ([`Table::unnamed`]).
    pub(super) persistent: bool,
}

impl Template {
    /// `text` for `table`: `{t}` filled, each `:name` replaced by the backend's placeholder
    /// for the bind of that name among `binds`.
    ///
    /// # Panics
    ///
    /// On a name that is not one of `binds`: a mistake in idem's own texts, which every
    /// backend's unit test fills (`every_text_names_only_its_binds`).
    pub(crate) fn new(table: &Table, text: &str, binds: &[&str], style: Placeholders) -> Template {
        let mut sql = String::with_capacity(text.len());
        let mut order = Vec::new();
        let mut rest = 0;
        for (at, name) in named_binds(text) {
            let Some(index) = binds.iter().position(|b| *b == name) else {
                panic!("the bind `:{name}` is not one of the statement's ({binds:?}): {text}");
            };
            let index = u8::try_from(index).expect("a statement has few binds");
            sql.push_str(&text[rest..at]);
            rest = at + 1 + name.len();
            let number = match style {
                Placeholders::Question => {
                    order.push(index);
                    sql.push('?');
                    continue;
                }
                _ => match order.iter().position(|i| *i == index) {
                    Some(seen) => seen + 1,
                    None => {
                        order.push(index);
                        order.len()
                    }
                },
            };
            sql.push(if style == Placeholders::Dollar {
                '$'
            } else {
                '?'
            });
            sql.push_str(&number.to_string());
        }
        sql.push_str(&text[rest..]);
        Template {
            sql: table.fill(&sql),
            order: order.into(),
            persistent: !table.is_unnamed(),
        }
    }
}

/// The named binds of `text`, as (the byte offset of their `:`, name), outside quoted text,
/// quoted identifiers and comments. A `:` next to another (PostgreSQL's `::type` cast) is no
/// bind.
pub(crate) fn named_binds(text: &str) -> Vec<(usize, &str)> {
    let bytes = text.as_bytes();
    let mut found = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            quote @ (b'\'' | b'"' | b'`') => {
                i += 1;
                while i < bytes.len() && bytes[i] != quote {
                    i += 1;
                }
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                while i + 1 < bytes.len() && !(bytes[i] == b'*' && bytes[i + 1] == b'/') {
                    i += 1;
                }
            }
            b':' if bytes.get(i + 1) == Some(&b':') => i += 1,
            b':' if bytes
                .get(i + 1)
                .is_some_and(|c| c.is_ascii_lowercase() || *c == b'_') =>
            {
                let len = bytes[i + 1..]
                    .iter()
                    .take_while(|c| c.is_ascii_alphanumeric() || **c == b'_')
                    .count();
                found.push((i, &text[i + 1..i + 1 + len]));
                i += len;
            }
            _ => {}
        }
        i += 1;
    }
    found
}

/// Checks that every statement of a backend's `texts` names only its own binds. A bind its
/// text does not name is not sent (SQLite's dead space needs no table name).
#[cfg(test)]
pub(crate) fn check_texts<T: AsRef<str>>(texts: &[(&str, T, &[&str])]) {
    for (name, text, binds) in texts {
        let text = text.as_ref();
        for (_, n) in named_binds(text) {
            assert!(
                binds.contains(&n),
                "statement `{name}` names `:{n}`, which is not one of its binds {binds:?}: {text}"
            );
        }
    }
}

/// Checks a whole backend: every shared text names only its binds, its own statement sets do
/// (`own`, from `Own::texts` of [`own!`](crate::backend::own)), and filling them all for a
/// table panics on no name that is not a bind.
#[cfg(test)]
pub(crate) fn check_backend<DB: super::Backend>(own: &[Vec<(&str, String, &[&str])>]) {
    let t = DB::texts();
    check_texts(&t.claim.each());
    check_texts(&t.lease.each());
    check_texts(&t.steps.each());
    check_texts(&t.outbox.each());
    check_texts(&t.offsets.each());
    check_texts(&t.ops.each());
    check_texts(&t.health.each());
    for texts in own {
        check_texts(texts);
    }
    super::Sql::<DB>::new(&Table::new("jobs").unwrap());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_plain_identifiers_are_table_names() {
        for ok in ["idem_processed", "_t", "Jobs2", &"a".repeat(MAX_TABLE_LEN)] {
            assert!(Table::new(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "2jobs",
            "jobs; DROP TABLE users",
            "public.jobs",
            "\"jobs\"",
            "jobs-x",
            "jöbs",
            &"a".repeat(MAX_TABLE_LEN + 1),
        ] {
            assert!(Table::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn names_are_found_outside_quotes_comments_and_casts() {
        let text = "SELECT :a, ':b', :c::text, \"x:d\", `:e` /* :f */ FROM t WHERE x = :a_1";
        let names: Vec<&str> = named_binds(text).into_iter().map(|(_, n)| n).collect();
        assert_eq!(names, ["a", "c", "a_1"]);
        // SQLite's times: the colons are inside quotes.
        assert!(named_binds("strftime('%Y-%m-%dT%H:%M:%fZ', 'now')").is_empty());
    }

    #[test]
    fn each_backend_gets_its_placeholders_and_the_order_of_its_binds() {
        let table = Table::new("jobs").unwrap();
        let text = "UPDATE {t} SET v = :value WHERE k = :key AND (:key IS NULL OR s = :scope)";
        let binds = ["scope", "key", "value"];
        let pg = Template::new(&table, text, &binds, Placeholders::Dollar);
        assert_eq!(
            pg.sql.as_str(),
            "UPDATE jobs SET v = $1 WHERE k = $2 AND ($2 IS NULL OR s = $3)"
        );
        assert_eq!(&*pg.order, [2, 1, 0]);
        let lite = Template::new(&table, text, &binds, Placeholders::Numbered);
        assert_eq!(
            lite.sql.as_str(),
            "UPDATE jobs SET v = ?1 WHERE k = ?2 AND (?2 IS NULL OR s = ?3)"
        );
        let my = Template::new(&table, text, &binds, Placeholders::Question);
        assert_eq!(
            my.sql.as_str(),
            "UPDATE jobs SET v = ? WHERE k = ? AND (? IS NULL OR s = ?)"
        );
        assert_eq!(&*my.order, [2, 1, 1, 0]);
    }

    #[test]
    #[should_panic(expected = "not one of the statement's")]
    fn a_name_that_is_no_bind_is_a_mistake() {
        let table = Table::new("jobs").unwrap();
        Template::new(&table, "SELECT :nope", &["scope"], Placeholders::Dollar);
    }
}
