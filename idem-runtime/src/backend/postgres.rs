use sqlx::{AssertSqlSafe, Pool, Postgres, SqlSafeStr as _, SqlStr, Transaction};

use super::sealed::Dialect;
use super::{
    Backend, Check, Claimant, Found, Hold, LeaseOp, LeaseState, Listen, MarkerRow, Statements,
    Table, Templates,
};
use crate::outgoing::Pending;
use crate::{ClaimOptions, Message};

/// `in_failed_sql_transaction`: a statement after one that failed.
const IN_FAILED_TRANSACTION: &str = "25P02";
/// `lock_not_available`: `lock_timeout` ran out.
const LOCK_NOT_AVAILABLE: &str = "55P03";

impl Backend for Postgres {}

// `key` and `scope` are not reserved words in PostgreSQL. The partial index serves purges of
// completed markers by age without touching in-flight ones.
const DDL: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS {t} (
        scope text NOT NULL,
        key text NOT NULL,
        state text NOT NULL DEFAULT 'completed' CHECK (state IN ('in_progress', 'completed')),
        fingerprint bytea,
        result json,
        locked_until timestamptz,
        token bigint,
        attempts integer NOT NULL DEFAULT 1,
        created_at timestamptz NOT NULL DEFAULT now(),
        completed_at timestamptz,
        PRIMARY KEY (scope, key)
    )",
    "CREATE INDEX IF NOT EXISTS {t}_completed_at ON {t} (completed_at) WHERE state = 'completed'",
    // Schema version 2: the outbox, written in the claim's transaction, read by the relay.
    "CREATE TABLE IF NOT EXISTS {t}_outbox (
        id text PRIMARY KEY,
        destination text NOT NULL,
        payload bytea NOT NULL,
        scope text NOT NULL,
        key text NOT NULL,
        seq integer NOT NULL,
        created_at timestamptz NOT NULL DEFAULT now(),
        attempts integer NOT NULL DEFAULT 0,
        next_attempt_at timestamptz NOT NULL DEFAULT now(),
        last_error text,
        parked boolean NOT NULL DEFAULT false,
        sent_at timestamptz
    )",
    "CREATE INDEX IF NOT EXISTS {t}_outbox_due ON {t}_outbox (next_attempt_at) \
     WHERE sent_at IS NULL AND NOT parked",
    "CREATE INDEX IF NOT EXISTS {t}_outbox_sent_at ON {t}_outbox (sent_at) \
     WHERE sent_at IS NOT NULL",
];

/// The outbox's statements: write (ids, destinations, payloads, scope, keys, seqs: all of a
/// claim's messages in one statement, the arrays in the messages' order); due (limit,
/// lease ms): takes the due messages, oldest first, skipping those another relay holds, and
/// holds them for the lease; sent (id); failed (error, retry ms, park, id); purge (age ms,
/// limit).
const OUTBOX: [&str; 5] = [
    // The notification goes out with the commit, and only with it; PostgreSQL sends one
    // for all of a transaction's identical ones.
    // A data-modifying `WITH` runs to completion whatever its reader takes, so `LIMIT 1`
    // only spares the calls of `pg_notify` after the first.
    "WITH written AS (INSERT INTO {t}_outbox (id, destination, payload, scope, key, seq) \
     SELECT m.id, m.destination, m.payload, $4, m.key, m.seq \
     FROM unnest($1::text[], $2::text[], $3::bytea[], $5::text[], $6::int8[]) \
     AS m (id, destination, payload, key, seq) \
     ON CONFLICT DO NOTHING RETURNING 1) \
     SELECT pg_notify('{t}_outbox', '') FROM written LIMIT 1",
    "UPDATE {t}_outbox SET next_attempt_at = now() + $2 * interval '1 millisecond' \
     WHERE id IN (SELECT id FROM {t}_outbox WHERE sent_at IS NULL AND NOT parked \
     AND next_attempt_at <= now() ORDER BY created_at, seq LIMIT $1 FOR UPDATE SKIP LOCKED) \
     RETURNING id, destination, payload, seq, attempts, \
     (EXTRACT(EPOCH FROM created_at) * 1000000)::int8",
    "UPDATE {t}_outbox SET sent_at = now() WHERE id = $1",
    "UPDATE {t}_outbox SET attempts = attempts + 1, last_error = $1, \
     next_attempt_at = now() + $2 * interval '1 millisecond', parked = $3 WHERE id = $4",
    "DELETE FROM {t}_outbox WHERE ctid = ANY (ARRAY(SELECT ctid FROM {t}_outbox \
     WHERE sent_at < now() - $1 * interval '1 millisecond' LIMIT $2))",
];

/// The outbox's operator statements: list (parked, pending, limit), find (id), requeue (id).
const OUTBOX_COLUMNS: &str = "id, destination, scope, key, seq::int8, attempts::int8, \
    last_error, (CASE WHEN parked THEN 1 ELSE 0 END)::int8, \
    (CASE WHEN sent_at IS NULL THEN 0 ELSE 1 END)::int8, \
    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
    (EXTRACT(EPOCH FROM (now() - created_at)) * 1000)::int8, \
    (EXTRACT(EPOCH FROM (next_attempt_at - now())) * 1000)::int8";

/// The columns of `Store::inspect`: times as ISO-8601 UTC text, and the lease's time left on the
/// database's clock.
const MARKER_COLUMNS: &str = "scope, key, state, attempts::bigint, token, \
    to_char(created_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
    to_char(completed_at AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
    to_char(locked_until AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS.US\"Z\"'), \
    (EXTRACT(EPOCH FROM (locked_until - now())) * 1000)::bigint";

/// Whether a lease is over, on the clock of the statement (not of the transaction, which may be
/// a caller's, begun long before).
const LEASE_OVER: &str = "(locked_until IS NULL OR locked_until <= statement_timestamp())";

impl Dialect for Postgres {
    const BACKEND: &'static str = "postgres";

    fn statements(table: &Table) -> Statements {
        let inspect = format!("SELECT {MARKER_COLUMNS} FROM {{t}} WHERE scope = $1 AND key = $2");
        let in_progress = format!(
            "SELECT {MARKER_COLUMNS} FROM {{t}} WHERE scope = $1 AND state = 'in_progress' ORDER BY locked_until NULLS FIRST LIMIT $2"
        );
        let in_progress_all = format!(
            "SELECT {MARKER_COLUMNS} FROM {{t}} WHERE state = 'in_progress' ORDER BY locked_until NULLS FIRST, scope LIMIT $1"
        );
        let marker = format!(
            "SELECT state, {LEASE_OVER}::int::int8, fingerprint, result::text FROM {{t}} \
             WHERE scope = $1 AND key = $2"
        );
        // A free lease becomes this transaction's completed marker; its old holder's token no
        // longer matches, so it can neither complete nor renew. Another payload never takes
        // over.
        let take_over = format!(
            "UPDATE {{t}} SET state = 'completed', completed_at = now(), locked_until = NULL, \
             token = COALESCE(token, 0) + 1, attempts = attempts + 1, result = NULL, \
             fingerprint = COALESCE(fingerprint, $3) \
             WHERE scope = $1 AND key = $2 AND state = 'in_progress' AND {LEASE_OVER} \
             AND (fingerprint IS NULL OR $3::bytea IS NULL OR fingerprint = $3)"
        );
        let batch_markers = format!(
            "SELECT key, state, {LEASE_OVER}::int::int8 FROM {{t}} \
             WHERE scope = $1 AND key = ANY($2::text[])"
        );
        let take_over_batch = format!(
            "UPDATE {{t}} SET state = 'completed', completed_at = now(), locked_until = NULL, \
             token = COALESCE(token, 0) + 1, attempts = attempts + 1, result = NULL \
             WHERE scope = $1 AND key = ANY($2::text[]) AND state = 'in_progress' \
             AND {LEASE_OVER} RETURNING key"
        );
        // The claim and, when it inserts nothing, the marker it met, in one statement: the
        // `LEFT JOIN` reads with the statement's snapshot, which never holds this insert's
        // own row (a fresh claim reads no marker) but does hold one committed before the
        // statement began. A marker committed while the insert waited for it is not in that
        // snapshot: the claim then reads it with a statement of its own.
        let claim_or_read = "WITH ins AS (INSERT INTO {t} (scope, key, fingerprint, completed_at) \
             VALUES ($1, $2, $3, now()) ON CONFLICT DO NOTHING RETURNING 1) \
             SELECT (SELECT count(*) FROM ins), m.state, \
             (m.locked_until IS NULL OR m.locked_until <= statement_timestamp())::int::int8, \
             m.fingerprint, CASE WHEN $4 THEN m.result::text END \
             FROM (SELECT 1) AS one LEFT JOIN {t} AS m ON m.scope = $1 AND m.key = $2";
        Templates {
            begin: "BEGIN",
            claim: "INSERT INTO {t} (scope, key, fingerprint, completed_at) \
                        VALUES ($1, $2, $3, now()) ON CONFLICT DO NOTHING",
            claim_or_read,
            marker: &marker,
            take_over: &take_over,
            batch_markers: &batch_markers,
            take_over_batch: &take_over_batch,
            // One statement for the whole batch: the keys travel as one array, so no bind
            // limit applies, and `ORDER BY k` makes every batch take its row locks in the
            // same order, so that two overlapping batches queue instead of deadlocking.
            claim_batch: "INSERT INTO {t} (scope, key, completed_at) \
                              SELECT $1, k, now() FROM unnest($2::text[]) AS u(k) ORDER BY k \
                              ON CONFLICT DO NOTHING RETURNING key",
            record: "UPDATE {t} SET result = $3::json WHERE scope = $1 AND key = $2",
            forget: "DELETE FROM {t} WHERE scope = $1 AND key = $2",
            inspect: &inspect,
            in_progress: &in_progress,
            in_progress_all: &in_progress_all,
            // Selecting the batch by ctid makes each batch a TID scan; an `IN (SELECT
            // scope, key ...)` ran as a hash join over the whole table, every batch.
            purge: "DELETE FROM {t} WHERE ctid = ANY (ARRAY(SELECT ctid FROM {t} \
                        WHERE state = 'completed' \
                        AND completed_at < now() - $1 * interval '1 millisecond' LIMIT $2))",
            // Fresh or expired: one statement. Concurrent takers of an expired lease
            // queue on the row; each re-checks the WHERE against the winner's version,
            // so exactly one gets a row back. `now()` is the server's clock. A delivery
            // with another payload's fingerprint never takes over.
            lease_claim: "INSERT INTO {t} AS m (scope, key, state, locked_until, token, \
                              attempts, completed_at, fingerprint) \
                              VALUES ($1, $2, 'in_progress', \
                              now() + $3 * interval '1 millisecond', 1, 1, NULL, $4) \
                              ON CONFLICT (scope, key) DO UPDATE \
                              SET locked_until = EXCLUDED.locked_until, \
                              token = m.token + 1, attempts = m.attempts + 1, \
                              fingerprint = COALESCE(m.fingerprint, EXCLUDED.fingerprint) \
                              WHERE m.state = 'in_progress' \
                              AND (m.locked_until IS NULL OR m.locked_until <= now()) \
                              AND (m.fingerprint IS NULL OR EXCLUDED.fingerprint IS NULL \
                              OR m.fingerprint = EXCLUDED.fingerprint) \
                              RETURNING token, attempts::bigint",
            lease_takeover: "",
            lease_state: "",
            lease_complete: "UPDATE {t} SET state = 'completed', completed_at = now(), \
                                 locked_until = NULL, result = $4::json \
                                 WHERE scope = $1 AND key = $2 \
                                 AND token = $3 AND state = 'in_progress'",
            lease_release: "UPDATE {t} SET locked_until = NULL WHERE scope = $1 \
                                AND key = $2 AND token = $3 AND state = 'in_progress'",
            lease_renew: "UPDATE {t} SET locked_until = now() + $4 * interval '1 millisecond' \
                              WHERE scope = $1 AND key = $2 AND token = $3 \
                              AND state = 'in_progress'",
            outbox: OUTBOX,
            outbox_ops: [
                &format!(
                    "SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE sent_at IS NULL \
                     AND ((parked AND $1) OR (NOT parked AND $2)) \
                     ORDER BY parked DESC, created_at, seq LIMIT $3"
                ),
                &format!("SELECT {OUTBOX_COLUMNS} FROM {{t}}_outbox WHERE id = $1"),
                "UPDATE {t}_outbox SET parked = false, attempts = 0, next_attempt_at = now() \
                 WHERE id = $1 AND parked AND sent_at IS NULL",
            ],
            ddl: DDL,
        }
        .fill(table)
    }

    fn begin_sql(st: &Statements, options: &ClaimOptions) -> SqlStr {
        if options.is_default() {
            return st.begin.clone();
        }
        // One simple-query message: `SET LOCAL` lasts until the end of this transaction, so
        // nothing leaks to the pooled connection's next user.
        let mut begin = String::from("BEGIN");
        if let Some(level) = options.isolation {
            begin.push_str(" ISOLATION LEVEL ");
            begin.push_str(level.sql());
        }
        if let Some(wait) = options.wait {
            begin.push_str(&format!(
                "; SET LOCAL lock_timeout = {}",
                super::millis(wait)
            ));
        }
        AssertSqlSafe(begin).into_sql_str()
    }

    async fn commit<'a>(
        mut tx: Transaction<'a, Self>,
        _: Check<'a>,
        _: &'a ClaimOptions,
    ) -> Result<bool, sqlx::Error> {
        // PostgreSQL answers `COMMIT` of an aborted transaction with a silent `ROLLBACK`, and
        // sqlx reports that as success. Any other statement fails in an aborted transaction,
        // so `SELECT 1` first tells the two apart, in the same message (one round trip): if it
        // fails, the rest of the message is skipped. The trailing `BEGIN` leaves sqlx's
        // bookkeeping (which still counts this transaction as open) something to roll back:
        // dropping `tx` queues that `ROLLBACK`, and the pool sends it with the ping it makes
        // when the connection comes back, so it costs no round trip of its own.
        match sqlx::raw_sql("SELECT 1; COMMIT; BEGIN")
            .execute(&mut *tx)
            .await
        {
            Ok(_) => Ok(true),
            Err(e) if database_code(&e).as_deref() == Some(IN_FAILED_TRANSACTION) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn is_lock_timeout(err: &sqlx::Error) -> bool {
        database_code(err).as_deref() == Some(LOCK_NOT_AVAILABLE)
    }

    async fn claim_or_read<'t>(
        conn: &'t mut Self::Connection,
        st: &'t Statements,
        c: Claimant<'t>,
        replay: bool,
    ) -> Result<(bool, Option<Found>), sqlx::Error> {
        type Row = (
            i64,
            Option<String>,
            Option<i64>,
            Option<Vec<u8>>,
            Option<String>,
        );
        let (inserted, state, over, fingerprint, result): Row =
            sqlx::query_as(st.claim_or_read.clone())
                .bind(c.scope)
                .bind(c.key)
                .bind(c.fingerprint)
                .bind(replay)
                .fetch_one(&mut *conn)
                .await?;
        if inserted == 1 {
            return Ok((true, None));
        }
        let found =
            state.map(|state| Found::of_row((state, over.unwrap_or(1), fingerprint, result)));
        Ok((false, found))
    }

    super::shared::claim_on_conflict!();
    super::shared::outbox_numbered!();

    /// One statement for all of the claim's messages: one round trip whatever their number.
    async fn outbox_write<'t>(
        conn: &'t mut Self::Connection,
        st: &'t Statements,
        outbox: &'t Pending,
    ) -> Result<(), sqlx::Error> {
        let (mut ids, mut destinations, mut payloads, mut keys, mut seqs) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (key, m) in outbox.rows() {
            ids.push(m.id.as_str());
            destinations.push(m.destination.as_str());
            payloads.push(m.payload.as_slice());
            keys.push(key);
            seqs.push(i64::from(m.seq));
        }
        sqlx::query(st.outbox.write.clone())
            .bind(ids)
            .bind(destinations)
            .bind(payloads)
            .bind(outbox.scope())
            .bind(keys)
            .bind(seqs)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    async fn outbox_listen<'p>(
        pool: &'p Pool<Self>,
        st: &'p Statements,
    ) -> Result<Option<Listen>, sqlx::Error> {
        // A connection of its own, outside the application's pool: a listener holds its
        // connection for as long as it lives, and a pool of one would have none left.
        let own = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect_with((*pool.connect_options()).clone())
            .await?;
        let mut listener = sqlx::postgres::PgListener::connect_with(&own).await?;
        listener
            .listen(&format!("{}_outbox", st.table.as_str()))
            .await?;
        Ok(Some(Listen::Postgres(listener)))
    }

    async fn outbox_take<'p>(
        pool: &'p Pool<Self>,
        st: &'p Statements,
        limit: i64,
        lease_ms: i64,
    ) -> Result<Vec<Message>, sqlx::Error> {
        type Row = (String, String, Vec<u8>, i32, i32, i64);
        let mut rows: Vec<Row> = sqlx::query_as(st.outbox.due.clone())
            .bind(limit)
            .bind(lease_ms)
            .fetch_all(pool)
            .await?;
        // `RETURNING` keeps no order: oldest first, and a job's messages in their order.
        rows.sort_by_key(|r| (r.5, r.3));
        Ok(rows
            .into_iter()
            .map(|(id, destination, payload, seq, attempts, _)| {
                super::shared::message(id, destination, payload, seq, attempts)
            })
            .collect())
    }

    super::shared::batch_one_bind!(|keys| keys);
    super::shared::lease_on_conflict!();

    fn is_transient(err: &sqlx::Error) -> bool {
        // serialization_failure (REPEATABLE READ / SERIALIZABLE) and deadlock_detected.
        matches!(database_code(err).as_deref(), Some("40001" | "40P01"))
    }

    async fn migrate<'p>(pool: &'p Pool<Self>, st: &'p Statements) -> Result<(), sqlx::Error> {
        // Concurrent `CREATE TABLE IF NOT EXISTS` can still fail on the catalog's unique
        // index; a transaction-scoped advisory lock makes the workers take turns.
        let mut tx = pool.begin().await?;
        // `IF NOT EXISTS` answers an existing table with a NOTICE, which sqlx logs at INFO:
        // every worker's start-up would say "relation already exists, skipping".
        sqlx::query("SET LOCAL client_min_messages = warning")
            .execute(&mut *tx)
            .await?;
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.migrate.' || $1))")
            .bind(st.table.as_str())
            .execute(&mut *tx)
            .await?;
        for stmt in &st.ddl {
            sqlx::query(stmt.clone()).execute(&mut *tx).await?;
        }
        tx.commit().await
    }

    super::shared::pool_statements!();
}

fn database_code(err: &sqlx::Error) -> Option<String> {
    err.as_database_error()
        .and_then(|e| e.code())
        .map(|c| c.into_owned())
}
