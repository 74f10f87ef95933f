//! The statements of a claim in a transaction (transaction mode, joined calls, batches,
//! groups) that every backend writes alike, and what runs them. The claim statement itself,
//! a transaction's begin and its verified commit are each backend's own (`Backend`).

use super::bind::Keys;
use super::bind::statements;
use super::{Backend, Claimant, Found, sql_runs};

/// The words in which the backends' claim statements differ.
pub(super) struct Words<'a> {
    /// The `key` column (MySQL quotes the word).
    pub(super) key: &'a str,
    /// The current instant, as the markers' times are written.
    pub(super) now: &'a str,
    /// Whether a marker's lease is over (released or run out), as a condition.
    pub(super) lease_over: &'a str,
    /// The same as an integer, 0 or 1.
    pub(super) lease_over_int: &'a str,
    /// The `result` column as text.
    pub(super) result: &'a str,
    /// The `:json` bind as the `result` column stores it.
    pub(super) json: &'a str,
    /// Whether the `:fingerprint` bind may take the marker over: either has none, or they
    /// are the same payload's.
    pub(super) same_payload: &'a str,
    /// A batch's markers, `:scope` and `:keys`, as a condition, where the backend binds its
    /// keys as one list (`None`: it writes its batches itself).
    pub(super) batch: Option<&'a str>,
}

impl ClaimText {
    /// The statements alike on every backend but for `words`; a backend that binds a list adds
    /// its `claim_batch`.
    pub(super) fn of(words: Words<'_>) -> ClaimText {
        let Words {
            key,
            now,
            lease_over,
            lease_over_int,
            result,
            json,
            same_payload,
            batch,
        } = words;
        let marker = format!("scope = :scope AND {key} = :key");
        let batch = |statement: &dyn Fn(&str) -> String| batch.map(|b| statement(b).into());
        ClaimText {
            marker: format!(
                "SELECT state, {lease_over_int}, fingerprint, {result}, error FROM {{t}} \
                 WHERE {marker}"
            )
            .into(),
            take_over: format!(
                "UPDATE {{t}} SET state = 'completed', completed_at = {now}, \
                 locked_until = NULL, token = :nonce, attempts = attempts + 1, result = NULL, \
                 fingerprint = COALESCE(fingerprint, :fingerprint) \
                 WHERE {marker} AND state = 'in_progress' AND {lease_over} AND {same_payload}"
            )
            .into(),
            record: format!("UPDATE {{t}} SET result = {json} WHERE {marker}").into(),
            claim_batch: None,
            batch_markers: batch(&|b| {
                format!("SELECT key, state, {lease_over_int}, error FROM {{t}} WHERE {b}")
            }),
            take_over_batch: batch(&|b| {
                format!(
                    "UPDATE {{t}} SET state = 'completed', completed_at = {now}, \
                     locked_until = NULL, token = :nonce, attempts = attempts + 1, result = NULL \
                     WHERE {b} AND state = 'in_progress' AND {lease_over} RETURNING key"
                )
            }),
            // A job of a batch that failed alone: the marker the claim inserted goes, a lease
            // it took over is free again (its attempt counted, its old holder still fenced
            // out).
            unclaim_inserted: batch(&|b| format!("DELETE FROM {{t}} WHERE {b} AND token = :nonce")),
            unclaim_taken: batch(&|b| {
                format!(
                    "UPDATE {{t}} SET state = 'in_progress', completed_at = NULL, \
                     locked_until = NULL, result = NULL WHERE {b} AND token = :nonce"
                )
            }),
        }
    }
}

statements! {
    /// The statements of a claim in a transaction.
    pub(crate) struct ClaimSql, ClaimText {
        /// A marker's state on the database's clock: `(state, lease over (0 or 1),
        /// fingerprint, result, error)`.
        marker(scope: &str, key: &str);
        /// A free lease becomes this transaction's completed marker holding the claim's nonce
        /// (its old holder's token no longer matches, so it can neither complete nor renew);
        /// another payload never takes over.
        take_over(scope: &str, key: &str, fingerprint: Option<&[u8]>, nonce: i64);
        /// Stores the handler's value (JSON) with the marker.
        record(scope: &str, key: &str, json: &str);
    } optional {
        // A batch's statements, where the backend binds its keys as one list (PostgreSQL's
        // array, SQLite's JSON); MySQL writes them into one message of its own instead.
        /// Inserts the markers of `keys` (sorted: overlapping batches lock rows in one order);
        /// answers the keys inserted.
        claim_batch(scope: &str, keys: Keys<'_>, nonce: i64);
        /// `(key, state, lease over, error)` of each marker of `keys` that exists.
        batch_markers(scope: &str, keys: Keys<'_>);
        /// Takes the free leases among `keys` over; answers the keys taken.
        take_over_batch(scope: &str, keys: Keys<'_>, nonce: i64);
        /// Deletes the markers of `keys` this claim inserted (a job that failed alone).
        unclaim_inserted(scope: &str, keys: Keys<'_>, nonce: i64);
        /// Frees again the leases of `keys` this claim took over (a job that failed alone): its
        /// attempt counted, its old holder still fenced out.
        unclaim_taken(scope: &str, keys: Keys<'_>, nonce: i64);
    }
}

/// A backend without the statement named here writes its own `Backend` method instead.
fn missing(statement: &str) -> ! {
    unreachable!("a backend without `{statement}` overrides the method that runs it")
}

sql_runs! {
    /// Reads a marker: its state on the database's clock, fingerprint and stored value;
    /// `None` if it is gone. Also read outside a transaction (a lease's claim).
    marker(conn: &mut DB::Connection, scope: &str, key: &str) -> Option<Found> =
        claim.marker(scope, key).fetch_optional => |row| row.map(Found::of_row);
    /// Stores the handler's value (JSON) with the marker, in the claim's transaction.
    record(conn: &mut DB::Connection, scope: &str, key: &str, json: &str) -> () =
        claim.record(scope, key, json).execute => drop;
}

impl<DB: Backend> ClaimSql<DB> {
    /// `Backend::take_over` where the backend bounds no lock wait in the statement.
    pub(super) async fn take_over_plain(
        &self,
        conn: &mut DB::Connection,
        c: Claimant<'_>,
    ) -> Result<bool, sqlx::Error> {
        let take = self.take_over(c.scope, c.key, c.fingerprint, c.nonce);
        Ok(take.execute(conn).await? == 1)
    }

    /// `Backend::claim_batch`: one statement for the whole batch.
    pub(super) async fn batch_claim(
        &self,
        conn: &mut DB::Connection,
        c: Claimant<'_>,
        keys: &[&str],
    ) -> Result<Vec<String>, sqlx::Error> {
        let claim = self.claim_batch(c.scope, Keys(keys), c.nonce);
        let claim = claim.unwrap_or_else(|| missing("claim_batch"));
        let rows: Vec<(String,)> = claim.fetch_all(conn).await?;
        Ok(rows.into_iter().map(|(key,)| key).collect())
    }

    /// `Backend::take_over_batch`: one statement for the whole batch.
    pub(super) async fn batch_take_over(
        &self,
        conn: &mut DB::Connection,
        c: Claimant<'_>,
        keys: &[&str],
    ) -> Result<Vec<String>, sqlx::Error> {
        let take = self.take_over_batch(c.scope, Keys(keys), c.nonce);
        let take = take.unwrap_or_else(|| missing("take_over_batch"));
        let rows: Vec<(String,)> = take.fetch_all(conn).await?;
        Ok(rows.into_iter().map(|(key,)| key).collect())
    }

    /// `Backend::batch_markers`: one statement for the whole batch.
    pub(super) async fn read_batch(
        &self,
        conn: &mut DB::Connection,
        scope: &str,
        keys: &[&str],
    ) -> Result<Vec<(String, Found)>, sqlx::Error> {
        let read = self.batch_markers(scope, Keys(keys));
        let read = read.unwrap_or_else(|| missing("batch_markers"));
        let rows: Vec<(String, String, i64, Option<String>)> = read.fetch_all(conn).await?;
        Ok(rows
            .into_iter()
            .map(|(key, state, over, error)| (key, Found::of_status(&state, over, error)))
            .collect())
    }

    /// `Backend::unclaim`: a statement for the inserted markers, one for the leases taken.
    pub(super) async fn batch_unclaim(
        &self,
        conn: &mut DB::Connection,
        c: Claimant<'_>,
        inserted: &[&str],
        taken: &[&str],
    ) -> Result<(), sqlx::Error> {
        if !inserted.is_empty() {
            let gone = self.unclaim_inserted(c.scope, Keys(inserted), c.nonce);
            let gone = gone.unwrap_or_else(|| missing("unclaim_inserted"));
            gone.execute(&mut *conn).await?;
        }
        if !taken.is_empty() {
            let freed = self.unclaim_taken(c.scope, Keys(taken), c.nonce);
            let freed = freed.unwrap_or_else(|| missing("unclaim_taken"));
            freed.execute(conn).await?;
        }
        Ok(())
    }
}
