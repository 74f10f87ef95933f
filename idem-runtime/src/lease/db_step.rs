//! A database step: the step's writes and its record in one transaction, committed (verified)
//! only while the lease's token is the marker's.

use super::{Lease, Step};
use crate::backend::{Backend, Check};
use crate::claim::nested::Body;
use crate::error::Error;
use crate::options::ClaimOptions;
use crate::store::Store;

/// Runs `run` on a transaction of `store`'s, records the step in it, and commits both.
pub(super) async fn run<DB, T, E, F>(
    store: &Store<DB>,
    lease: &Lease,
    step: &Step,
    body: Body,
    run: F,
) -> Result<T, E>
where
    DB: Backend,
    T: serde::Serialize,
    E: From<Error>,
    F: AsyncFnOnce(&mut sqlx::Transaction<'_, DB>) -> Result<T, E>,
{
    let (pool, sql) = (store.pool(), store.sql());
    let options = ClaimOptions::new();
    let mut tx = DB::begin(pool, sql, &options).await.map_err(Error::from)?;
    let value = match body.run(run(&mut tx)).await {
        Ok(value) => value,
        Err(e) => {
            // The error that led here is what the caller needs; a failed rollback ends with
            // the connection anyway.
            drop(DB::rollback(tx, &options).await);
            return Err(e);
        }
    };
    let json = match lease.step_json(step, &value) {
        Ok(json) => json,
        Err(e) => {
            drop(DB::rollback(tx, &options).await);
            return Err(E::from(e));
        }
    };
    let position = i64::from(step.position());
    let recorded = sql.step_record(&mut tx, lease.holder(), step.name(), position, &json);
    match recorded.await {
        Ok(true) => {}
        Ok(false) => {
            drop(DB::rollback(tx, &options).await);
            return Err(E::from(super::lost(lease.ticket_request())));
        }
        Err(e) => {
            // The body swallowed a failed statement (PostgreSQL aborts the transaction): a
            // rollback, not a database failure.
            let failed = match DB::is_aborted(&e) {
                true => lease.rolled_back(),
                false => Error::from(e),
            };
            drop(DB::rollback(tx, &options).await);
            return Err(E::from(failed));
        }
    }
    match DB::commit(tx, Check::Session, &options).await {
        Ok(true) => Ok(value),
        Ok(false) => Err(E::from(lease.rolled_back())),
        Err(e) => Err(E::from(Error::from(e))),
    }
}
