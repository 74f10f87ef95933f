//! The job with a payload, the values `replay` stores, and the handlers of the replay and
//! fingerprint cases (`cases/replay.rs`, `cases/fingerprint.rs`).
//!
//! Every body counts its runs, inserts one effect row and asks the database for a random
//! token, so that a body that ran again would return another value: a replayed value equal
//! to the first one was read back, not recomputed.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::{ClaimOptions, Claimed, Fingerprint, LeaseOptions, Outcome, Store};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sqlx::{Pool, Transaction};

use super::db::{Bind, TestDb};
use super::handlers::{Hold, TestError};

/// The scope of every handler here: a marker written by one handler is found by the others.
pub(crate) const SCOPE: &str = "replay";

/// What the fingerprint covers: the job's content, not its key.
#[derive(Clone, Debug, Serialize)]
pub(crate) struct Payload {
    pub(crate) id: i64,
    pub(crate) amount: i64,
    pub(crate) memo: String,
    /// A map, so that two equal payloads may iterate in different orders.
    pub(crate) tags: HashMap<String, i64>,
}

/// A job whose key is separate from its payload, like an id reused by a careless client.
#[derive(Clone, Debug)]
pub(crate) struct Order {
    pub(crate) key: String,
    pub(crate) payload: Payload,
    pub(crate) effects: String,
}

impl Order {
    pub(crate) fn new(key: &str, id: i64, amount: i64, effects: &str) -> Order {
        let tags = [
            ("b".to_owned(), 2),
            ("a".to_owned(), 1),
            ("c".to_owned(), 3),
        ]
        .into();
        Order {
            key: key.to_owned(),
            payload: Payload {
                id,
                amount,
                memo: format!("order {id}"),
                tags,
            },
            effects: effects.to_owned(),
        }
    }

    /// The same job with another amount: another payload under the same key.
    pub(crate) fn with_amount(&self, amount: i64) -> Order {
        let mut other = self.clone();
        other.payload.amount = amount;
        other
    }
}

/// What a minting body returns: the payload's numbers, a token the database generated in the
/// body, and values whose JSON is easy to get wrong (a `u64` past `i64::MAX`, a float, text
/// outside ASCII with escapes).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub(crate) struct Minted {
    pub(crate) token: String,
    pub(crate) id: i64,
    pub(crate) amount: i64,
    pub(crate) big: u64,
    pub(crate) ratio: f64,
    pub(crate) text: String,
    pub(crate) parts: Vec<Option<i32>>,
}

pub(crate) fn minted(order: &Order, token: String) -> Minted {
    Minted {
        token,
        id: order.payload.id,
        amount: order.payload.amount,
        big: u64::MAX - 1,
        ratio: 0.1 + 0.2,
        text: "Zürich \"quoted\" \\ tab\t 東京 🦀".to_owned(),
        parts: vec![Some(-1), None, Some(i32::MAX)],
    }
}

/// SQL that differs between the backends and only these cases need.
pub(crate) struct Dialect {
    /// A query answering a random 32-character hex token, computed by the database.
    pub(crate) token: &'static str,
    /// The marker's `result` column as text.
    pub(crate) result_text: &'static str,
    /// The marker's `fingerprint` column as lower-case hex.
    pub(crate) fingerprint_hex: &'static str,
}

pub(crate) fn dialect<DB: idem::Backend>() -> Dialect {
    match crate::conformance::util::backend::<DB>() {
        "postgres" => Dialect {
            token: "SELECT md5(random()::text)",
            result_text: "result::text",
            fingerprint_hex: "encode(fingerprint, 'hex')",
        },
        "mysql" => Dialect {
            token: "SELECT MD5(RAND())",
            result_text: "CAST(result AS CHAR)",
            fingerprint_hex: "LOWER(HEX(fingerprint))",
        },
        "sqlite" => Dialect {
            token: "SELECT lower(hex(randomblob(16)))",
            result_text: "result",
            fingerprint_hex: "lower(hex(fingerprint))",
        },
        other => panic!("no dialect for the backend {other}"),
    }
}

async fn token<DB: TestDb>(conn: &mut DB::Connection) -> Result<String, sqlx::Error> {
    let sql = dialect::<DB>().token;
    let mut rows = DB::fetch_strings(conn, sql).await?;
    assert_eq!(rows.len(), 1, "{sql}");
    Ok(rows.remove(0))
}

fn effect_sql(order: &Order, origin: &str) -> (String, [Bind; 3]) {
    let sql = format!(
        "INSERT INTO {} (id, amount, origin) VALUES ($1, $2, $3)",
        order.effects
    );
    let binds = [
        Bind::I64(order.payload.id),
        Bind::I64(order.payload.amount),
        Bind::Str(origin.to_owned()),
    ];
    (sql, binds)
}

/// A transaction-mode body: counts the run, inserts the effect, parks the first body on
/// `hold`, and answers the database's random token.
pub(crate) async fn tx_body<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    order: &Order,
    ran: &AtomicUsize,
    hold: Option<&Hold>,
) -> Result<String, TestError> {
    ran.fetch_add(1, Ordering::SeqCst);
    let (sql, binds) = effect_sql(order, "tx");
    DB::execute(&mut **tx, &sql, &binds).await?;
    let token = token::<DB>(&mut **tx).await?;
    if let Some(hold) = hold {
        hold.park_first().await;
    }
    Ok(token)
}

/// A lease-mode body: the same, outside any transaction (the effect row stands for the
/// outside system's, and commits at once).
pub(crate) async fn lease_body<DB: TestDb>(
    pool: &Pool<DB>,
    order: &Order,
    ran: &AtomicUsize,
    hold: Option<&Hold>,
) -> Result<String, TestError> {
    ran.fetch_add(1, Ordering::SeqCst);
    let mut conn = pool.acquire().await?;
    let (sql, binds) = effect_sql(order, "lease");
    DB::execute(&mut conn, &sql, &binds).await?;
    let token = token::<DB>(&mut conn).await?;
    drop(conn);
    if let Some(hold) = hold {
        hold.park_first().await;
    }
    Ok(token)
}

/// What a hand-written handler asks of the runtime.
#[derive(Clone, Copy, Debug)]
pub(crate) struct How {
    pub(crate) replay: bool,
    pub(crate) fingerprint: bool,
}

pub(crate) const REPLAY_AND_FINGERPRINT: How = How {
    replay: true,
    fingerprint: true,
};

/// The lease of the lease-mode handlers: long enough that no case sees it expire.
pub(crate) const LEASE: Duration = Duration::from_secs(30);

fn stored<T: DeserializeOwned>(recorded: &idem::Recorded) -> Result<Outcome<T>, TestError> {
    Ok(match recorded.decode::<T>()? {
        Some(value) => Outcome::Replayed(value),
        None => Outcome::Duplicate,
    })
}

fn fingerprint_of(order: &Order, how: How) -> Result<Option<Fingerprint>, TestError> {
    Ok(if how.fingerprint {
        Some(Fingerprint::of(&order.payload)?)
    } else {
        None
    })
}

/// Transaction mode by hand: `Store::claim_with`, the body on the guard's transaction,
/// `Guard::finish_replay` (or `finish`). The body's token becomes the value through `make`.
pub(crate) async fn tx_by_hand<DB: TestDb, T: Serialize + DeserializeOwned>(
    store: &Store<DB>,
    order: &Order,
    how: How,
    ran: &AtomicUsize,
    hold: Option<&Hold>,
    make: fn(&Order, String) -> T,
) -> Result<Outcome<T>, TestError> {
    let key = idem::Key::new(order.key.as_str()).map_err(idem::Error::from)?;
    let print = fingerprint_of(order, how)?;
    let mut options = if how.replay {
        ClaimOptions::new().replay()
    } else {
        ClaimOptions::new()
    };
    if let Some(print) = print {
        options = options.fingerprint(print);
    }
    match store.claim_with(SCOPE, &key, options).await? {
        Claimed::Fresh(mut guard) => {
            let result = tx_body(guard.tx(), order, ran, hold)
                .await
                .map(|token| make(order, token));
            if how.replay {
                guard.finish_replay(result).await
            } else {
                guard.finish(result).await
            }
        }
        Claimed::Replayed(recorded) => {
            assert!(how.replay, "a claim without replay answered Replayed");
            stored(&recorded)
        }
        Claimed::Duplicate => Ok(Outcome::Duplicate),
        Claimed::Failed(f) => Ok(Outcome::Failed(f)),
    }
}

/// Lease mode by hand: `Store::lease`, the body outside any transaction, then
/// `Lease::finish_replay` (the completing statement stores the value) or `Lease::finish`.
pub(crate) async fn lease_by_hand<DB: TestDb, T: Serialize + DeserializeOwned>(
    store: &Store<DB>,
    order: &Order,
    how: How,
    ran: &AtomicUsize,
    hold: Option<&Hold>,
    make: fn(&Order, String) -> T,
) -> Result<Outcome<T>, TestError> {
    let key = idem::Key::new(order.key.as_str()).map_err(idem::Error::from)?;
    let print = fingerprint_of(order, how)?;
    let mut options = if how.replay {
        LeaseOptions::new(LEASE).replay()
    } else {
        LeaseOptions::new(LEASE)
    };
    if let Some(print) = print {
        options = options.fingerprint(print);
    }
    match store.lease(SCOPE, &key, options).await? {
        Claimed::Fresh(lease) => {
            let result = lease_body(store.pool(), order, ran, hold)
                .await
                .map(|token| make(order, token));
            if how.replay {
                lease.finish_replay(result).await
            } else {
                lease.finish(result).await
            }
        }
        Claimed::Replayed(recorded) => {
            assert!(how.replay, "a lease without replay answered Replayed");
            stored(&recorded)
        }
        Claimed::Duplicate => Ok(Outcome::Duplicate),
        Claimed::Failed(f) => Ok(Outcome::Failed(f)),
    }
}

// The handlers through the attribute. Transaction mode first, then the same in lease mode,
// where the body gets the lease and a pool of its own for the effect.

/// `replay` and `fingerprint`: the handler the main cases deliver to.
#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn mint<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    order: &Order,
    ran: &AtomicUsize,
    hold: Option<&Hold>,
) -> Result<Minted, TestError> {
    let token = tx_body(tx, order, ran, hold).await?;
    Ok(minted(order, token))
}

/// Neither: the handler as it was before `replay` and `fingerprint` were added.
#[idem::idempotent(key = "order.key", scope = "replay")]
pub(crate) async fn mint_plain<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    order: &Order,
    ran: &AtomicUsize,
) -> Result<Minted, TestError> {
    let token = tx_body(tx, order, ran, None).await?;
    Ok(minted(order, token))
}

/// `fingerprint` only.
#[idem::idempotent(key = "order.key", scope = "replay", fingerprint = "order.payload")]
pub(crate) async fn mint_checked<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    order: &Order,
    ran: &AtomicUsize,
) -> Result<Minted, TestError> {
    let token = tx_body(tx, order, ran, None).await?;
    Ok(minted(order, token))
}

/// Returns a map with `entries` tuple keys: JSON has no such keys, so any entry makes the
/// value fail to serialise (the empty map serialises as `{}`).
#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn tuple_map<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    order: &Order,
    ran: &AtomicUsize,
    entries: i32,
) -> Result<HashMap<(i32, i32), i32>, TestError> {
    tx_body(tx, order, ran, None).await?;
    Ok((0..entries).map(|i| ((i, i + 1), i * 2)).collect())
}

/// A value whose `Serialize` fails.
#[derive(Debug, PartialEq, Deserialize)]
pub(crate) struct Refuses;

impl Serialize for Refuses {
    fn serialize<S: serde::Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        Err(serde::ser::Error::custom("Refuses never serialises"))
    }
}

#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn refusing<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    order: &Order,
    ran: &AtomicUsize,
) -> Result<Refuses, TestError> {
    tx_body(tx, order, ran, None).await?;
    Ok(Refuses)
}

/// The same scope after a deploy changed the handler's return type: a stored `Minted` does
/// not read back as `i64`.
#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn mint_as_number<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    order: &Order,
    ran: &AtomicUsize,
) -> Result<i64, TestError> {
    tx_body(tx, order, ran, None).await?;
    Ok(order.payload.amount)
}

/// Returns `None`: a stored JSON `null`, which is a value, not the absence of one.
#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn nothing<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    order: &Order,
    ran: &AtomicUsize,
) -> Result<Option<i64>, TestError> {
    tx_body(tx, order, ran, None).await?;
    Ok(None)
}

/// Returns `text` (the payload's memo).
#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn echo<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    order: &Order,
    ran: &AtomicUsize,
) -> Result<String, TestError> {
    tx_body(tx, order, ran, None).await?;
    Ok(order.payload.memo.clone())
}

#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    lease = "30s",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn mint_leased<DB: TestDb>(
    lease: &idem::Lease,
    order: &Order,
    pool: &Pool<DB>,
    ran: &AtomicUsize,
    hold: Option<&Hold>,
) -> Result<Minted, TestError> {
    assert_eq!(lease.key(), order.key);
    let token = lease_body(pool, order, ran, hold).await?;
    Ok(minted(order, token))
}

#[idem::idempotent(key = "order.key", scope = "replay", lease = "30s")]
pub(crate) async fn mint_leased_plain<DB: TestDb>(
    lease: &idem::Lease,
    order: &Order,
    pool: &Pool<DB>,
    ran: &AtomicUsize,
) -> Result<Minted, TestError> {
    assert_eq!(lease.key(), order.key);
    let token = lease_body(pool, order, ran, None).await?;
    Ok(minted(order, token))
}

#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    lease = "30s",
    fingerprint = "order.payload"
)]
pub(crate) async fn mint_leased_checked<DB: TestDb>(
    lease: &idem::Lease,
    order: &Order,
    pool: &Pool<DB>,
    ran: &AtomicUsize,
) -> Result<Minted, TestError> {
    assert_eq!(lease.key(), order.key);
    let token = lease_body(pool, order, ran, None).await?;
    Ok(minted(order, token))
}

#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    lease = "30s",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn tuple_map_leased<DB: TestDb>(
    lease: &idem::Lease,
    order: &Order,
    pool: &Pool<DB>,
    ran: &AtomicUsize,
    entries: i32,
) -> Result<HashMap<(i32, i32), i32>, TestError> {
    assert_eq!(lease.key(), order.key);
    lease_body(pool, order, ran, None).await?;
    Ok((0..entries).map(|i| ((i, i + 1), i * 2)).collect())
}

#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    lease = "30s",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn refusing_leased<DB: TestDb>(
    lease: &idem::Lease,
    order: &Order,
    pool: &Pool<DB>,
    ran: &AtomicUsize,
) -> Result<Refuses, TestError> {
    assert_eq!(lease.key(), order.key);
    lease_body(pool, order, ran, None).await?;
    Ok(Refuses)
}

/// Calls the outside system, then returns a value over `MAX_REPLAY_LEN`.
#[idem::idempotent(key = "order.key", scope = "replay", lease = "30s", replay)]
pub(crate) async fn huge_leased<DB: TestDb>(
    lease: &idem::Lease,
    order: &Order,
    pool: &Pool<DB>,
    ran: &AtomicUsize,
) -> Result<String, TestError> {
    assert_eq!(lease.key(), order.key);
    lease_body(pool, order, ran, None).await?;
    Ok("x".repeat(idem::MAX_REPLAY_LEN + 1))
}

/// Calls the outside system, then fails: the key is released, its marker stays `in_progress`.
#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    lease = "30s",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn failing_leased<DB: TestDb>(
    lease: &idem::Lease,
    order: &Order,
    pool: &Pool<DB>,
    ran: &AtomicUsize,
) -> Result<Minted, TestError> {
    assert_eq!(lease.key(), order.key);
    lease_body(pool, order, ran, None).await?;
    Err(TestError::Refused)
}

#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    lease = "30s",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn mint_as_number_leased<DB: TestDb>(
    lease: &idem::Lease,
    order: &Order,
    pool: &Pool<DB>,
    ran: &AtomicUsize,
) -> Result<i64, TestError> {
    assert_eq!(lease.key(), order.key);
    lease_body(pool, order, ran, None).await?;
    Ok(order.payload.amount)
}

#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    lease = "30s",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn nothing_leased<DB: TestDb>(
    lease: &idem::Lease,
    order: &Order,
    pool: &Pool<DB>,
    ran: &AtomicUsize,
) -> Result<Option<i64>, TestError> {
    assert_eq!(lease.key(), order.key);
    lease_body(pool, order, ran, None).await?;
    Ok(None)
}

#[idem::idempotent(
    key = "order.key",
    scope = "replay",
    lease = "30s",
    replay,
    fingerprint = "order.payload"
)]
pub(crate) async fn echo_leased<DB: TestDb>(
    lease: &idem::Lease,
    order: &Order,
    pool: &Pool<DB>,
    ran: &AtomicUsize,
) -> Result<String, TestError> {
    assert_eq!(lease.key(), order.key);
    lease_body(pool, order, ran, None).await?;
    Ok(order.payload.memo.clone())
}
