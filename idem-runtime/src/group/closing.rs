//! The close of a generation: the savepoint a kept call left open released (or rolled back,
//! and the call told), then the verified commit, and the answer sent to every call of it.

use std::sync::Arc;

use sqlx::Transaction;
use tokio::sync::watch;

use super::lane::{Ended, Pending, Shared, Undone};
use crate::backend::{Backend, Check, Claimant, Partition, Savepoint};
use crate::options::ClaimOptions;

/// A generation taken out of its lane, to be committed.
pub(super) struct Closing<DB: Backend> {
    pub(super) tx: Transaction<'static, DB>,
    pub(super) ended: watch::Sender<Option<Ended>>,
    pub(super) kept: Option<KeptBy>,
    pub(super) wrote: bool,
    pub(super) pending: Option<Pending>,
}

/// A kept call's identity: its scope, key and nonce, and, for an offset claim, the partition
/// (topic, partition) whose watermark holds its nonce (the scope is its consumer group).
#[derive(Debug)]
pub(super) struct KeptBy {
    pub(super) scope: String,
    pub(super) key: String,
    pub(super) nonce: i64,
    pub(super) partition: Option<(String, i32)>,
}

impl<DB: Backend> Closing<DB> {
    /// Commits the generation (verified, as every claim's commit is) and tells its calls.
    pub(super) async fn commit(self, shared: Arc<Shared<DB>>) {
        let Closing {
            mut tx,
            ended,
            mut kept,
            wrote,
            pending,
        } = self;
        if let Some(pending) = pending {
            match settle(&mut tx, pending).await {
                Ok(before) => kept = before.unwrap_or(kept),
                Err(failed) => {
                    ended.send_replace(Some(failed));
                    return;
                }
            }
        }
        let options = ClaimOptions::new();
        let end = match kept {
            // No call kept anything: the transaction only held claims that were given back.
            None => {
                drop(DB::rollback(tx, &options).await);
                Ended::Committed
            }
            Some(kept) => {
                let table = DB::table(shared.store.sql());
                let check = match &kept.partition {
                    None => Check::Marker(
                        table,
                        Claimant {
                            scope: &kept.scope,
                            key: &kept.key,
                            fingerprint: None,
                            nonce: kept.nonce,
                            wait: None,
                        },
                    ),
                    Some((topic, partition)) => {
                        let at = Partition {
                            group: &kept.scope,
                            topic,
                            partition: *partition,
                        };
                        Check::Offsets(table, at, kept.nonce)
                    }
                };
                match DB::commit(tx, check, &options).await {
                    Ok(true) => {
                        if wrote {
                            table.wake().committed();
                        }
                        Ended::Committed
                    }
                    Ok(false) => Ended::Failed {
                        may_be_kept: false,
                        reason: "the database rolled the group's transaction back".into(),
                    },
                    // The server's own error: not committed. Anything else (a lost
                    // connection) may have come after the commit landed.
                    Err(e) => Ended::Failed {
                        may_be_kept: e.as_database_error().is_none(),
                        reason: format!("its commit failed: {e}").into(),
                    },
                }
            }
        };
        ended.send_replace(Some(end));
    }
}

/// Releases the savepoint a kept call left open in a closing generation; one that cannot be
/// released is rolled back, the call told why, and `Some` of the kept call before it answered
/// for the commit to check. `Err`: the generation failed.
async fn settle<DB: Backend>(
    tx: &mut Transaction<'static, DB>,
    pending: Pending,
) -> Result<Option<Option<KeptBy>>, Ended> {
    let Err(e) = DB::savepoint(tx, Savepoint::ReleaseAt(pending.slot)).await else {
        return Ok(None);
    };
    match DB::savepoint(tx, Savepoint::RollBackAt(pending.slot)).await {
        Ok(()) => {
            let why = match DB::is_aborted(&e) {
                true => Undone::Aborted,
                false => Undone::Lost(format!("its savepoint could not be released: {e}").into()),
            };
            let _ = pending.undo.set(why);
            Ok(Some(pending.before))
        }
        Err(lost) => Err(Ended::Failed {
            may_be_kept: false,
            reason: format!("a kept call's savepoint could not be released: {lost}").into(),
        }),
    }
}
