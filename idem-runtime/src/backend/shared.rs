//! Statement runners that read the same on several backends but for the concrete types, which
//! sqlx's generic API cannot name without a wall of bounds: each macro expands inside one
//! backend's `impl Dialect`.

/// `forget`, `inspect`, the in-progress lists and `purge_batch`: the same binds everywhere.
macro_rules! pool_statements {
    () => {
        async fn forget<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            scope: &'p str,
            key: &'p str,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(st.forget.clone())
                .bind(scope)
                .bind(key)
                .execute(pool)
                .await?;
            Ok(done.rows_affected() > 0)
        }

        async fn inspect<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            scope: &'p str,
            key: &'p str,
        ) -> Result<Option<MarkerRow>, sqlx::Error> {
            sqlx::query_as(st.inspect.clone())
                .bind(scope)
                .bind(key)
                .fetch_optional(pool)
                .await
        }

        async fn in_progress<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            scope: &'p str,
            limit: i64,
        ) -> Result<Vec<MarkerRow>, sqlx::Error> {
            sqlx::query_as(st.in_progress.clone())
                .bind(scope)
                .bind(limit)
                .fetch_all(pool)
                .await
        }

        async fn in_progress_all<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            limit: i64,
        ) -> Result<Vec<MarkerRow>, sqlx::Error> {
            sqlx::query_as(st.in_progress_all.clone())
                .bind(limit)
                .fetch_all(pool)
                .await
        }

        async fn purge_batch<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            age_ms: i64,
            limit: i64,
        ) -> Result<u64, sqlx::Error> {
            let done = sqlx::query(st.purge.clone())
                .bind(age_ms)
                .bind(limit)
                .execute(pool)
                .await?;
            Ok(done.rows_affected())
        }

        async fn marker<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            scope: &'t str,
            key: &'t str,
        ) -> Result<Option<Found>, sqlx::Error> {
            let row: Option<(String, i64, Option<Vec<u8>>, Option<String>)> =
                sqlx::query_as(st.marker.clone())
                    .bind(scope)
                    .bind(key)
                    .fetch_optional(&mut *conn)
                    .await?;
            Ok(row.map(Found::of_row))
        }
    };
}
pub(super) use pool_statements;

/// The claim of the backends with `INSERT ... ON CONFLICT DO NOTHING` and numbered binds: one
/// row inserted means this delivery holds the key. `take_over` binds scope, key, fingerprint;
/// `record` scope, key, value.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
macro_rules! claim_on_conflict {
    () => {
        async fn try_claim<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            claimant: Claimant<'t>,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(st.claim.clone())
                .bind(claimant.scope)
                .bind(claimant.key)
                .bind(claimant.fingerprint)
                .execute(&mut *conn)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn take_over<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            claimant: Claimant<'t>,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(st.take_over.clone())
                .bind(claimant.scope)
                .bind(claimant.key)
                .bind(claimant.fingerprint)
                .execute(&mut *conn)
                .await?;
            Ok(done.rows_affected() == 1)
        }

        async fn record<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            scope: &'t str,
            key: &'t str,
            json: &'t str,
        ) -> Result<(), sqlx::Error> {
            sqlx::query(st.record.clone())
                .bind(scope)
                .bind(key)
                .bind(json)
                .execute(&mut *conn)
                .await?;
            Ok(())
        }
    };
}
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(super) use claim_on_conflict;

/// Batch statements of the backends that receive the keys as one bind (`$keys` turns the
/// sorted keys into it): claim, read back and take over, each one statement.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
macro_rules! batch_one_bind {
    (|$keys:ident| $bind:expr) => {
        async fn try_claim_batch<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            claimant: Claimant<'t>,
            $keys: &'t [&'t str],
        ) -> Result<Vec<String>, sqlx::Error> {
            sqlx::query_scalar(st.claim_batch.clone())
                .bind(claimant.scope)
                .bind($bind)
                .fetch_all(&mut *conn)
                .await
        }

        async fn batch_markers<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            scope: &'t str,
            $keys: &'t [&'t str],
        ) -> Result<Vec<(String, Hold)>, sqlx::Error> {
            let rows: Vec<(String, String, i64)> = sqlx::query_as(st.batch_markers.clone())
                .bind(scope)
                .bind($bind)
                .fetch_all(&mut *conn)
                .await?;
            Ok(rows
                .into_iter()
                .map(|(key, state, over)| (key, Hold::of(&state, over != 0)))
                .collect())
        }

        async fn take_over_batch<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            claimant: Claimant<'t>,
            $keys: &'t [&'t str],
        ) -> Result<Vec<String>, sqlx::Error> {
            sqlx::query_scalar(st.take_over_batch.clone())
                .bind(claimant.scope)
                .bind($bind)
                .fetch_all(&mut *conn)
                .await
        }
    };
}
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(super) use batch_one_bind;

/// Lease statements of the backends with `INSERT ... ON CONFLICT DO UPDATE ... WHERE ...
/// RETURNING` and numbered binds. The claim inserts a fresh marker or takes a free one over in
/// one statement; no row back means the marker is completed or held, which the `marker`
/// statement tells apart. Scope, key and token are `$1` to `$3` of every update, the lease
/// `$4` of `renew`, the stored value `$4` of `complete`.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
macro_rules! lease_on_conflict {
    () => {
        async fn lease_claim<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            claimant: Claimant<'p>,
            lease_ms: i64,
        ) -> Result<LeaseState, sqlx::Error> {
            let taken: Option<(i64, i64)> = sqlx::query_as(st.lease_claim.clone())
                .bind(claimant.scope)
                .bind(claimant.key)
                .bind(lease_ms)
                .bind(claimant.fingerprint)
                .fetch_optional(pool)
                .await?;
            if let Some((token, attempts)) = taken {
                return Ok(LeaseState::Taken { token, attempts });
            }
            let mut conn = pool.acquire().await?;
            let found = Self::marker(&mut conn, st, claimant.scope, claimant.key).await?;
            Ok(found.map_or(LeaseState::Missing, LeaseState::Found))
        }

        async fn lease_update<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            op: LeaseOp,
            scope: &'p str,
            key: &'p str,
            token: i64,
            lease_ms: i64,
            result: Option<&'p str>,
        ) -> Result<bool, sqlx::Error> {
            let statement = match op {
                LeaseOp::Complete => &st.lease_complete,
                LeaseOp::Release => &st.lease_release,
                LeaseOp::Renew => &st.lease_renew,
            };
            let query = sqlx::query(statement.clone())
                .bind(scope)
                .bind(key)
                .bind(token);
            let query = match op {
                LeaseOp::Renew => query.bind(lease_ms),
                LeaseOp::Complete => query.bind(result),
                LeaseOp::Release => query,
            };
            Ok(query.execute(pool).await?.rows_affected() == 1)
        }
    };
}
#[cfg(any(feature = "postgres", feature = "sqlite"))]
pub(super) use lease_on_conflict;

/// The outbox's write as one statement a message (id, destination, payload, scope, key, seq):
/// SQLite's statements cost no round trip, and MySQL has no array to bind.
#[cfg(any(feature = "mysql", feature = "sqlite"))]
macro_rules! outbox_write_each {
    () => {
        async fn outbox_write<'t>(
            conn: &'t mut Self::Connection,
            st: &'t Statements,
            outbox: &'t Pending,
        ) -> Result<(), sqlx::Error> {
            for (key, m) in outbox.rows() {
                sqlx::query(st.outbox.write.clone())
                    .bind(m.id.as_str())
                    .bind(m.destination.as_str())
                    .bind(m.payload.as_slice())
                    .bind(outbox.scope())
                    .bind(key)
                    .bind(i64::from(m.seq))
                    .execute(&mut *conn)
                    .await?;
            }
            Ok(())
        }
    };
}
#[cfg(any(feature = "mysql", feature = "sqlite"))]
pub(super) use outbox_write_each;

/// The outbox's statements that bind alike on every backend (sent: id; failed: error, retry
/// ms, park, id; purge: age ms, limit).
macro_rules! outbox_numbered {
    () => {
        async fn outbox_sent<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            id: &'p str,
        ) -> Result<(), sqlx::Error> {
            sqlx::query(st.outbox.sent.clone())
                .bind(id)
                .execute(pool)
                .await?;
            Ok(())
        }

        async fn outbox_failed<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            id: &'p str,
            error: &'p str,
            retry_ms: i64,
            park: bool,
        ) -> Result<(), sqlx::Error> {
            sqlx::query(st.outbox.failed.clone())
                .bind(error)
                .bind(retry_ms)
                .bind(park)
                .bind(id)
                .execute(pool)
                .await?;
            Ok(())
        }

        async fn outbox_purge<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            age_ms: i64,
            limit: i64,
        ) -> Result<u64, sqlx::Error> {
            let done = sqlx::query(st.outbox.purge.clone())
                .bind(age_ms)
                .bind(limit)
                .execute(pool)
                .await?;
            Ok(done.rows_affected())
        }

        async fn outbox_list<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            parked: bool,
            pending: bool,
            limit: i64,
        ) -> Result<Vec<super::OutboxRow>, sqlx::Error> {
            sqlx::query_as(st.outbox.list.clone())
                .bind(parked)
                .bind(pending)
                .bind(limit)
                .fetch_all(pool)
                .await
        }

        async fn outbox_find<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            id: &'p str,
        ) -> Result<Option<super::OutboxRow>, sqlx::Error> {
            sqlx::query_as(st.outbox.find.clone())
                .bind(id)
                .fetch_optional(pool)
                .await
        }

        async fn outbox_requeue<'p>(
            pool: &'p Pool<Self>,
            st: &'p Statements,
            id: &'p str,
        ) -> Result<bool, sqlx::Error> {
            let done = sqlx::query(st.outbox.requeue.clone())
                .bind(id)
                .execute(pool)
                .await?;
            Ok(done.rows_affected() == 1)
        }
    };
}
pub(super) use outbox_numbered;

/// A taken message as the relay gets it.
pub(super) fn message(
    id: String,
    destination: String,
    payload: Vec<u8>,
    seq: impl TryInto<u32>,
    attempts: impl TryInto<u32>,
) -> crate::Message {
    crate::Message {
        id,
        destination,
        payload,
        seq: seq.try_into().unwrap_or(u32::MAX),
        attempts: attempts.try_into().unwrap_or(u32::MAX),
    }
}
