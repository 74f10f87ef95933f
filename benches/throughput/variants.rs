//! The job and its variants, written once per backend: the effect alone (`plain`), the claim
//! by hand (`handwritten`), the same handler under `#[idem::idempotent]` (`macro`, and
//! `duplicate` re-delivering its keys). Kept apart from the timing loop so that what runs
//! inside the timed window can be read in one place.

use idem::Store;
use sqlx::{MySql, Pool, Postgres, Sqlite, Transaction};
use std::sync::OnceLock;
use std::sync::atomic::AtomicU64;

use crate::config::config;
use crate::setup::exec;
use crate::{ACCOUNTS, Res, SCOPE};

/// The seed's job: add `credits` to `account`; `id` is its stable key.
pub(crate) struct TopUp {
    pub(crate) id: String,
    pub(crate) account: i64,
    pub(crate) credits: i64,
}

/// The three variants on a backend whose claim is `INSERT ... ON CONFLICT DO NOTHING`, written
/// as a user would by hand. Every variant begins with the statement idem uses there (`BEGIN`;
/// `BEGIN IMMEDIATE` on SQLite), so the only difference between them is the marker.
macro_rules! on_conflict_variants {
    ($db:ty, begin: $begin:literal, update: $update:literal, claim: $claim:literal,
     claimed: $claimed:path, commit: $commit:path) => {
        use super::*;

        /// The effect, on this run's accounts table. Made once and borrowed for the rest of the
        /// run, as the literal was before the names had a suffix: sqlx still gets a `&'static
        /// str`, so no variant pays for a copy of the statement per job.
        pub(crate) fn update() -> &'static str {
            static SQL: OnceLock<String> = OnceLock::new();
            SQL.get_or_init(|| format!($update, accounts = config().accounts))
        }

        fn claim() -> &'static str {
            static SQL: OnceLock<String> = OnceLock::new();
            SQL.get_or_init(|| format!($claim, hand = config().hand))
        }

        pub(crate) async fn plain(pool: &Pool<$db>, job: &TopUp) -> Result<bool, sqlx::Error> {
            let mut tx = pool.begin_with($begin).await?;
            sqlx::query(update())
                .bind(job.credits)
                .bind(job.account)
                .execute(&mut *tx)
                .await?;
            tx.commit().await?;
            Ok(true)
        }

        pub(crate) async fn handwritten(
            pool: &Pool<$db>,
            job: &TopUp,
        ) -> Result<bool, sqlx::Error> {
            let mut tx = pool.begin_with($begin).await?;
            if !$claimed(&mut tx, claim(), job).await? {
                tx.rollback().await?;
                return Ok(false);
            }
            sqlx::query(update())
                .bind(job.credits)
                .bind(job.account)
                .execute(&mut *tx)
                .await?;
            $commit(tx).await?;
            Ok(true)
        }

        #[idem::idempotent(key = "job.id", scope = "bench.top_up")]
        pub(crate) async fn top_up(
            tx: &mut Transaction<'_, $db>,
            job: &TopUp,
        ) -> Result<(), sqlx::Error> {
            sqlx::query(update())
                .bind(job.credits)
                .bind(job.account)
                .execute(&mut **tx)
                .await?;
            Ok(())
        }
    };
}

pub(crate) mod pg {
    on_conflict_variants!(
        Postgres,
        begin: "BEGIN",
        update: "UPDATE {accounts} SET credits = credits + $1 WHERE id = $2",
        // The claim statement idem uses, on the hand-written marker table.
        claim: "INSERT INTO {hand} (scope, key, completed_at) \
                VALUES ($1, $2, now()) ON CONFLICT DO NOTHING",
        claimed: claimed,
        commit: commit
    );

    /// The hand-written claim's statement: its `INSERT`, or with `IDEM_BENCH_HAND_CLAIM=idem`
    /// the statement idem's claim runs (which also reads the marker a duplicate meets; a fresh
    /// claim answers no row), to show that statement's share of the gap.
    async fn claimed(
        tx: &mut Transaction<'static, Postgres>,
        claim: &'static str,
        job: &TopUp,
    ) -> Result<bool, sqlx::Error> {
        if !config().hand_claim_idem {
            let done = sqlx::query(claim)
                .bind(SCOPE)
                .bind(job.id.as_str())
                .execute(&mut **tx)
                .await?;
            return Ok(done.rows_affected() == 1);
        }
        static SQL: OnceLock<String> = OnceLock::new();
        let sql = SQL.get_or_init(|| {
            let hand = &config().hand;
            format!(
                "WITH ins AS (INSERT INTO {hand} (scope, key, fingerprint, token, completed_at) \
                 VALUES ($1, $2, $3, $4, now()) ON CONFLICT DO NOTHING RETURNING 1) \
                 SELECT m.state, \
                 (m.locked_until IS NULL OR m.locked_until <= statement_timestamp())::int::int8, \
                 m.fingerprint, CASE WHEN $5 THEN m.result::text END \
                 FROM (SELECT 1 WHERE CASE WHEN EXISTS (SELECT 1 FROM ins) THEN false \
                 ELSE true END) AS one LEFT JOIN {hand} AS m ON m.scope = $1 AND m.key = $2"
            )
        });
        let met = sqlx::query(sql.as_str())
            .bind(SCOPE)
            .bind(job.id.as_str())
            .bind(None::<&[u8]>)
            .bind(1_i64)
            .bind(false)
            .fetch_optional(&mut **tx)
            .await?;
        Ok(met.is_none())
    }

    /// The hand-written claim's commit: `COMMIT`, or with `IDEM_BENCH_HAND_COMMIT=verified`
    /// the message idem's verified commit sends (and the `ROLLBACK` dropping `tx` queues).
    async fn commit(mut tx: Transaction<'static, Postgres>) -> Result<(), sqlx::Error> {
        if !config().hand_commit_verified {
            return tx.commit().await;
        }
        sqlx::raw_sql("SAVEPOINT idem_commit; COMMIT AND CHAIN")
            .execute(&mut *tx)
            .await?;
        Ok(())
    }
}

pub(crate) mod lite {
    on_conflict_variants!(
        Sqlite,
        begin: "BEGIN IMMEDIATE",
        update: "UPDATE {accounts} SET credits = credits + ?1 WHERE id = ?2",
        claim: "INSERT INTO {hand} (scope, key, completed_at) \
                VALUES (?1, ?2, strftime('%Y-%m-%dT%H:%M:%fZ', 'now')) ON CONFLICT DO NOTHING",
        claimed: claimed,
        commit: Transaction::commit
    );

    async fn claimed(
        tx: &mut Transaction<'static, Sqlite>,
        claim: &'static str,
        job: &TopUp,
    ) -> Result<bool, sqlx::Error> {
        let done = sqlx::query(claim)
            .bind(SCOPE)
            .bind(job.id.as_str())
            .execute(&mut **tx)
            .await?;
        Ok(done.rows_affected() == 1)
    }
}

pub(crate) mod my {
    use super::*;

    /// As [`super::pg::update`]: made once, borrowed by every job.
    pub(crate) fn update() -> &'static str {
        static SQL: OnceLock<String> = OnceLock::new();
        SQL.get_or_init(|| {
            let accounts = &config().accounts;
            format!("UPDATE {accounts} SET credits = credits + ? WHERE id = ?")
        })
    }

    // MySQL has no ON CONFLICT DO NOTHING: a plain INSERT whose duplicate-key error is the
    // duplicate signal, as idem does it (a plain INSERT; `INSERT IGNORE` would hide every error).
    fn claim() -> &'static str {
        static SQL: OnceLock<String> = OnceLock::new();
        SQL.get_or_init(|| {
            let hand = &config().hand;
            format!(
                "INSERT INTO {hand} (scope, `key`, completed_at) \
                 VALUES (?, ?, CURRENT_TIMESTAMP(6))"
            )
        })
    }

    pub(crate) async fn plain(pool: &Pool<MySql>, job: &TopUp) -> Result<bool, sqlx::Error> {
        let mut tx = pool.begin().await?;
        sqlx::query(update())
            .bind(job.credits)
            .bind(job.account)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    pub(crate) async fn handwritten(pool: &Pool<MySql>, job: &TopUp) -> Result<bool, sqlx::Error> {
        let mut tx = pool.begin().await?;
        let claimed = sqlx::query(claim())
            .bind(SCOPE)
            .bind(job.id.as_str())
            .execute(&mut *tx)
            .await;
        match claimed {
            Ok(_) => {}
            Err(e)
                if e.as_database_error()
                    .is_some_and(|d| d.is_unique_violation()) =>
            {
                tx.rollback().await?;
                return Ok(false);
            }
            Err(e) => return Err(e),
        }
        sqlx::query(update())
            .bind(job.credits)
            .bind(job.account)
            .execute(&mut *tx)
            .await?;
        commit(tx, job).await?;
        Ok(true)
    }

    /// The hand-written claim's commit: `COMMIT`, or with `IDEM_BENCH_HAND_COMMIT=verified`
    /// the message idem's verified commit sends here (its probe of the marker, then `COMMIT`,
    /// in one text query), leaving sqlx to queue the `ROLLBACK` that the release's ping
    /// flushes, as idem's commit does: what that costs a job, measured beside the plain one.
    async fn commit(mut tx: Transaction<'static, MySql>, job: &TopUp) -> Result<(), sqlx::Error> {
        if !config().hand_commit_verified {
            return tx.commit().await;
        }
        // A digit table, as idem writes its literals: a formatter call per byte would cost
        // the hand-written job client time that idem's commit does not spend.
        let hex = |s: &str| {
            const DIGITS: &[u8; 16] = b"0123456789abcdef";
            let mut out = String::with_capacity(2 * s.len());
            for b in s.bytes() {
                out.push(char::from(DIGITS[usize::from(b >> 4)]));
                out.push(char::from(DIGITS[usize::from(b & 15)]));
            }
            out
        };
        let message = format!(
            "/*M! SET STATEMENT innodb_lock_wait_timeout = 1 FOR */ UPDATE {hand} \
             SET token = token WHERE scope = X'{scope}' AND `key` = X'{key}' \
             AND token IS NULL; COMMIT",
            hand = config().hand,
            scope = hex(SCOPE),
            key = hex(&job.id),
        );
        let done = sqlx::raw_sql(sqlx::AssertSqlSafe(message))
            .execute(&mut *tx)
            .await?;
        assert_eq!(
            done.rows_affected(),
            1,
            "the probe finds the claim's marker"
        );
        Ok(())
    }

    #[idem::idempotent(key = "job.id", scope = "bench.top_up")]
    pub(crate) async fn top_up(
        tx: &mut Transaction<'_, MySql>,
        job: &TopUp,
    ) -> Result<(), sqlx::Error> {
        sqlx::query(update())
            .bind(job.credits)
            .bind(job.account)
            .execute(&mut **tx)
            .await?;
        Ok(())
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Variant {
    Plain,
    Handwritten,
    Macro,
    Duplicate,
    Pgbench,
}

pub(crate) const VARIANTS: [Variant; 4] = [
    Variant::Plain,
    Variant::Handwritten,
    Variant::Macro,
    Variant::Duplicate,
];

impl Variant {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Variant::Plain => "plain",
            Variant::Handwritten => "handwritten",
            Variant::Macro => "macro",
            Variant::Duplicate => "duplicate",
            Variant::Pgbench => "pgbench",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    Postgres,
    Sqlite,
    MySql,
}

pub(crate) const KINDS: [Kind; 3] = [Kind::Postgres, Kind::Sqlite, Kind::MySql];

impl Kind {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Kind::Postgres => "PostgreSQL",
            Kind::Sqlite => "SQLite (WAL)",
            Kind::MySql => "MariaDB",
        }
    }
}

/// The macro's store; its pool (sized to the worker count) serves every variant.
pub(crate) enum Conn {
    Pg(Store<Postgres>),
    Lite(Store<Sqlite>),
    My(Store<MySql>),
}

impl Conn {
    /// Runs one job; `Ok(true)` if its effect was applied.
    pub(crate) async fn job(&self, variant: Variant, job: &TopUp) -> Result<bool, sqlx::Error> {
        match (self, variant) {
            (Conn::Pg(s), Variant::Plain) => pg::plain(s.pool(), job).await,
            (Conn::Pg(s), Variant::Handwritten) => pg::handwritten(s.pool(), job).await,
            (Conn::Pg(s), _) => Ok(pg::top_up(s, job).await?.is_applied()),
            (Conn::Lite(s), Variant::Plain) => lite::plain(s.pool(), job).await,
            (Conn::Lite(s), Variant::Handwritten) => lite::handwritten(s.pool(), job).await,
            (Conn::Lite(s), _) => Ok(lite::top_up(s, job).await?.is_applied()),
            (Conn::My(s), Variant::Plain) => my::plain(s.pool(), job).await,
            (Conn::My(s), Variant::Handwritten) => my::handwritten(s.pool(), job).await,
            (Conn::My(s), _) => Ok(my::top_up(s, job).await?.is_applied()),
        }
    }

    /// Between worker counts, never during a timed run: the PostgreSQL here runs with
    /// autovacuum off, so the bench vacuums its own tables where autovacuum would have.
    pub(crate) async fn maintain(&self) -> Res<()> {
        if let Conn::Pg(s) = self {
            let c = config();
            exec(
                s.pool(),
                &format!(
                    "VACUUM ANALYZE {}, {}, {}, {}",
                    c.accounts, c.markers, c.hand, c.pgbench
                ),
            )
            .await?;
        }
        Ok(())
    }

    pub(crate) async fn close(&self) {
        match self {
            Conn::Pg(s) => s.pool().close().await,
            Conn::Lite(s) => s.pool().close().await,
            Conn::My(s) => s.pool().close().await,
        }
    }
}

/// Key counters of one database: keys are never reused within a marker table, except by
/// `duplicate`, which re-delivers keys `macro` has applied.
#[derive(Default)]
pub(crate) struct Keys {
    /// The hand-written claim's keys, every one applied (its marker written).
    pub(crate) hand: AtomicU64,
    /// `plain`'s keys, which write no marker.
    pub(crate) plain: AtomicU64,
    pub(crate) applied: AtomicU64,
    pub(crate) dup: AtomicU64,
    /// Effects committed to the accounts table, checked against its sum at the end.
    pub(crate) effects: AtomicU64,
}

/// splitmix64's finaliser: a bijection on u64, so distinct counters give distinct keys.
pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A job id shaped like a UUID or an md5: 32 hex digits spread over the whole key space.
pub(crate) fn job_id(salt: u64, n: u64) -> String {
    format!("{:016x}{:016x}", mix(n ^ salt), mix(!n))
}

pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn account(&mut self) -> i64 {
        self.0 = self.0.wrapping_add(1);
        (mix(self.0) % ACCOUNTS) as i64 + 1
    }
}
