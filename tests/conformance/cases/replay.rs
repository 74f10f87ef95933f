//! `replay`: the first delivery's `Ok` value is stored with the marker, and later deliveries
//! get it back as `Outcome::Replayed` without running; in transaction and lease mode.

use std::sync::atomic::{AtomicUsize, Ordering};

use idem::Outcome;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::{Hold, TestError};
use crate::conformance::replay_handlers::*;
use crate::conformance::{Support, TestDb};

/// Which mode a case runs a handler in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Transaction,
    Lease,
}

/// One delivery through the hand-written handler of `mode`.
pub(crate) async fn by_hand<S: Support, T: Serialize + DeserializeOwned>(
    ctx: &Ctx<S>,
    mode: Mode,
    order: &Order,
    how: How,
    ran: &AtomicUsize,
    hold: Option<&Hold>,
    make: fn(&Order, String) -> T,
) -> Result<Outcome<T>, TestError> {
    match mode {
        Mode::Transaction => tx_by_hand(&ctx.store, order, how, ran, hold, make).await,
        Mode::Lease => lease_by_hand(&ctx.store, order, how, ran, hold, make).await,
    }
}

/// The marker's `result` column as text (`None` for SQL NULL), read with SQL.
pub(crate) async fn stored_result<S: Support>(ctx: &Ctx<S>, key: &str) -> Option<String> {
    let text = dialect::<S::Db>().result_text;
    // A prefix tells SQL NULL from a stored JSON `null` in a column of strings.
    let tagged = if <S::Db as idem::Backend>::BACKEND == "mysql" {
        format!("CONCAT('JSON', {text})")
    } else {
        format!("'JSON' || {text}")
    };
    let sql = format!(
        "SELECT CASE WHEN result IS NULL THEN 'NULL' ELSE {tagged} END FROM {} WHERE {} = '{key}'",
        ctx.store.table(),
        S::KEY_TEXT
    );
    let mut conn = ctx.pool.acquire().await.expect("a connection");
    let rows = S::Db::fetch_strings(&mut conn, &sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    assert_eq!(rows.len(), 1, "one marker for {key:?}: {rows:?}");
    match rows[0].split_at(4) {
        ("NULL", "") => None,
        ("JSON", json) => Some(json.to_owned()),
        _ => panic!("unexpected {:?}", rows[0]),
    }
}

/// The marker's `fingerprint` as hex, and its length in bytes as the database counts it.
pub(crate) async fn stored_fingerprint<S: Support>(ctx: &Ctx<S>, key: &str) -> (String, i64) {
    let d = dialect::<S::Db>();
    let table = ctx.store.table();
    let hex = format!(
        "SELECT {} FROM {table} WHERE {} = '{key}'",
        d.fingerprint_hex,
        S::KEY_TEXT
    );
    let mut conn = ctx.pool.acquire().await.expect("a connection");
    let rows = S::Db::fetch_strings(&mut conn, &hex)
        .await
        .unwrap_or_else(|e| panic!("{hex}: {e}"));
    assert_eq!(rows.len(), 1, "{hex}");
    let len = ctx
        .scalar(&format!(
            "SELECT CAST(LENGTH(fingerprint) AS {}) FROM {table} WHERE {} = '{key}'",
            S::BIGINT,
            S::KEY_TEXT
        ))
        .await;
    (rows[0].clone(), len)
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether the backend keeps the `result` text as written: SQLite (`TEXT`) and MariaDB (its
/// `JSON` is `LONGTEXT` with a validity check). PostgreSQL's `jsonb` and MySQL's `JSON` store
/// a parsed document and print it their own way (spaces, key order), so there the stored
/// JSON is compared as a JSON value.
async fn keeps_json_text<S: Support>(ctx: &Ctx<S>) -> bool {
    match <S::Db as idem::Backend>::BACKEND {
        "sqlite" => true,
        "mysql" => {
            ctx.scalar("SELECT CAST(VERSION() LIKE '%MariaDB%' AS SIGNED)")
                .await
                == 1
        }
        _ => false,
    }
}

/// The `result` column holds `value`'s JSON: the same text where the backend keeps text, the
/// same JSON value everywhere.
pub(crate) async fn assert_stored_json<S: Support, T: Serialize>(
    ctx: &Ctx<S>,
    key: &str,
    value: &T,
) {
    let written = serde_json::to_string(value).expect("the value serialises");
    let stored = stored_result(ctx, key)
        .await
        .unwrap_or_else(|| panic!("no value stored with the marker of {key:?}"));
    let parsed: serde_json::Value =
        serde_json::from_str(&stored).unwrap_or_else(|e| panic!("stored {stored:?}: {e}"));
    assert_eq!(
        parsed,
        serde_json::to_value(value).expect("the value serialises"),
        "stored {stored:?}, written {written:?}"
    );
    if keeps_json_text(ctx).await {
        assert_eq!(stored, written, "the result column");
    }
}

/// Completed markers (lease mode also leaves `in_progress` ones).
pub(crate) async fn completed<S: Support>(ctx: &Ctx<S>) -> i64 {
    ctx.scalar(&format!(
        "SELECT COUNT(*) FROM {} WHERE state = 'completed'",
        ctx.store.table()
    ))
    .await
}

fn applied_value<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>) -> T {
    match result {
        Ok(Outcome::Applied(v)) => v,
        other => panic!("expected Applied, got {other:?}"),
    }
}

fn replayed_value<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>) -> T {
    match result {
        Ok(Outcome::Replayed(v)) => v,
        other => panic!("expected Replayed, got {other:?}"),
    }
}

/// The first delivery applies; the second to the tenth get its value back, equal field for
/// field and in its JSON, although every body would have minted another token; the body ran
/// once, the effect is there once, the marker holds the value's JSON and the payload's
/// 32-byte fingerprint.
async fn replay_returns_the_first_value<S: Support>(mode: Mode, tag: &str, id: i64) {
    let ctx = Ctx::<S>::new(tag, 2).await;
    let order = Order::new(&format!("job-{tag}"), id, id * 10, &ctx.effects);
    let ran = AtomicUsize::new(0);
    let how = REPLAY_AND_FINGERPRINT;
    let first = by_hand(&ctx, mode, &order, how, &ran, None, minted).await;
    let first = applied_value(first);
    assert_eq!(first.token.len(), 32, "a token from the database: {first:?}");
    assert_eq!((first.id, first.amount), (id, id * 10));
    let first_json = serde_json::to_string(&first).expect("serialises");
    for delivery in 2..=10 {
        let again = by_hand(&ctx, mode, &order, how, &ran, None, minted).await;
        let again = replayed_value(again);
        assert_eq!(again, first, "delivery {delivery}");
        assert_eq!(
            serde_json::to_string(&again).expect("serialises"),
            first_json,
            "delivery {delivery}"
        );
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1, "bodies run");
    assert_eq!(ctx.effects(id).await, 1);
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!((ctx.markers().await, completed(&ctx).await), (1, 1));
    assert_stored_json(&ctx, &order.key, &first).await;
    let print = idem::Fingerprint::of(&order.payload).expect("the payload serialises");
    let (stored, len) = stored_fingerprint(&ctx, &order.key).await;
    assert_eq!(len, 32, "fingerprint length");
    assert_eq!(stored, hex(print.as_bytes()));
    ctx.cleanup().await;
}

pub(crate) async fn replay_by_hand_returns_the_first_value_in_transaction_mode<S: Support>() {
    replay_returns_the_first_value::<S>(Mode::Transaction, "replayhandtx", 51).await;
}

pub(crate) async fn replay_by_hand_returns_the_first_value_in_lease_mode<S: Support>() {
    replay_returns_the_first_value::<S>(Mode::Lease, "replayhandlease", 52).await;
}
