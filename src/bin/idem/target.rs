//! The database URL: which backend its scheme names, and how to show it without its password.

use crate::Failure;

/// The backend a URL's scheme names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scheme {
    Postgres,
    MySql,
    Sqlite,
}

/// A database URL, checked for a known scheme, with its password hidden for messages.
#[derive(Debug)]
pub(crate) struct DatabaseUrl {
    pub(crate) scheme: Scheme,
    /// What sqlx parses: `mariadb://` spelled `mysql://`, sqlx knowing only the latter.
    pub(crate) url: String,
    /// The URL as messages show it.
    pub(crate) shown: String,
}

impl DatabaseUrl {
    pub(crate) fn parse(url: Option<String>) -> Result<DatabaseUrl, Failure> {
        let Some(url) = url else {
            return Err(Failure::input(
                "no database given: pass --database-url URL or set DATABASE_URL \
                 (postgres://USER@HOST/DB, mysql://USER@HOST/DB or sqlite:PATH)",
            ));
        };
        let shown = redact(&url);
        let (scheme, url) = if let Some(rest) = url.strip_prefix("mariadb://") {
            (Scheme::MySql, format!("mysql://{rest}"))
        } else if url.starts_with("mysql://") {
            (Scheme::MySql, url)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            (Scheme::Postgres, url)
        } else if url.starts_with("sqlite:") {
            (Scheme::Sqlite, url)
        } else {
            let scheme = url.split(':').next().unwrap_or_default();
            return Err(Failure::input(format!(
                "unknown database URL scheme `{scheme}` in {shown}: use postgres://, \
                 mysql:// (or mariadb://) or sqlite:"
            )));
        };
        Ok(DatabaseUrl { scheme, url, shown })
    }
}

/// `url` with the password of its user info and of a `password=` parameter replaced by `***`.
pub(crate) fn redact(url: &str) -> String {
    let mut out = url.to_owned();
    if let Some(start) = out.find("://").map(|i| i + 3) {
        let end = out[start..]
            .find(['/', '?'])
            .map_or(out.len(), |i| start + i);
        // The last `@` of the authority ends the user info: a password may hold an `@`.
        if let Some(at) = out[start..end].rfind('@').map(|i| start + i)
            && let Some(colon) = out[start..at].find(':').map(|i| start + i)
        {
            out.replace_range(colon + 1..at, "***");
        }
    }
    if let Some(query) = out.find('?') {
        let (head, params) = out.split_at(query + 1);
        let params: Vec<String> = params
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((name, _)) if name.eq_ignore_ascii_case("password") => format!("{name}=***"),
                _ => p.to_owned(),
            })
            .collect();
        out = format!("{head}{}", params.join("&"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_are_hidden() {
        assert_eq!(
            redact("postgres://app:s3cr@t@db:5432/jobs"),
            "postgres://app:***@db:5432/jobs"
        );
        assert_eq!(
            redact("mysql://root@127.0.0.1/test"),
            "mysql://root@127.0.0.1/test"
        );
        assert_eq!(
            redact("postgres://db/jobs?user=app&password=x&sslmode=require"),
            "postgres://db/jobs?user=app&password=***&sslmode=require"
        );
        assert_eq!(redact("sqlite:jobs.db"), "sqlite:jobs.db");
    }

    #[test]
    fn the_scheme_names_the_backend() {
        let scheme = |u: &str| DatabaseUrl::parse(Some(u.to_owned())).map(|d| d.scheme);
        assert_eq!(scheme("postgres://h/d").unwrap(), Scheme::Postgres);
        assert_eq!(scheme("postgresql://h/d").unwrap(), Scheme::Postgres);
        assert_eq!(scheme("mysql://h/d").unwrap(), Scheme::MySql);
        let maria = DatabaseUrl::parse(Some("mariadb://u:p@h/d".to_owned())).unwrap();
        assert_eq!(
            (maria.scheme, maria.url.as_str()),
            (Scheme::MySql, "mysql://u:p@h/d")
        );
        assert_eq!(maria.shown, "mariadb://u:***@h/d");
        assert_eq!(scheme("sqlite:jobs.db").unwrap(), Scheme::Sqlite);
        let err = scheme("redis://u:pw@h").unwrap_err();
        assert_eq!(err.code, 2);
        assert!(
            err.message.contains("`redis`") && !err.message.contains("pw"),
            "{}",
            err.message
        );
        assert_eq!(DatabaseUrl::parse(None).unwrap_err().code, 2);
    }
}
