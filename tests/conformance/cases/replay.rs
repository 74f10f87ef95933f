//! `replay`: the first delivery's `Ok` value is stored with the marker, and later deliveries
//! get it back as `Outcome::Replayed` without running; in transaction and lease mode.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use idem::Outcome;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::conformance::cases::until_all_queued;
use crate::conformance::ctx::Ctx;
use crate::conformance::handlers::{Hold, TestError};
use crate::conformance::replay_handlers::*;
use crate::conformance::util::within;
use crate::conformance::{Support, TestDb};

/// Which mode a case runs a handler in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Mode {
    Transaction,
    Lease,
}

/// One delivery to `mint` (or `mint_leased`), through the attribute.
pub(crate) async fn mint_in<S: Support>(
    ctx: &Ctx<S>,
    mode: Mode,
    order: &Order,
    ran: &AtomicUsize,
    hold: Option<&Hold>,
) -> Result<Outcome<Minted>, TestError> {
    match mode {
        Mode::Transaction => mint(&ctx.store, order, ran, hold).await,
        Mode::Lease => mint_leased(&ctx.store, order, &ctx.pool, ran, hold).await,
    }
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
    let tagged = if crate::conformance::util::backend::<S::Db>() == "mysql" {
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

/// Whether the backend keeps the `result` text as written: SQLite (`TEXT`), PostgreSQL
/// (`json`, not `jsonb`) and MariaDB (its `JSON` is `LONGTEXT` with a validity check). MySQL's
/// `JSON` stores a parsed document and prints it its own way (spaces, key order), so there the
/// stored JSON is compared as a JSON value.
async fn keeps_json_text<S: Support>(ctx: &Ctx<S>) -> bool {
    match crate::conformance::util::backend::<S::Db>() {
        "sqlite" | "postgres" => true,
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

pub(crate) fn applied_value<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>) -> T {
    match result {
        Ok(Outcome::Applied(v)) => v,
        other => panic!("expected Applied, got {other:?}"),
    }
}

pub(crate) fn replayed_value<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>) -> T {
    match result {
        Ok(Outcome::Replayed(v)) => v,
        other => panic!("expected Replayed, got {other:?}"),
    }
}

pub(crate) fn is_duplicate<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>) {
    match result {
        Ok(Outcome::Duplicate) => {}
        other => panic!("expected Duplicate, got {other:?}"),
    }
}

pub(crate) fn is_serialize_error<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>) {
    match result {
        Err(TestError::Idem(idem::Error::Serialize(_))) => {}
        other => panic!("expected Error::Serialize, got {other:?}"),
    }
}

/// How a case reaches the runtime.
#[derive(Clone, Copy, Debug)]
enum Via {
    Attribute,
    Hand,
}

/// The first delivery applies; the second to the tenth get its value back, equal field for
/// field and in its JSON, although every body would have minted another token; the body ran
/// once, the effect is there once, the marker holds the value's JSON and the payload's
/// 32-byte fingerprint.
async fn replay_returns_the_first_value<S: Support>(mode: Mode, via: Via, tag: &str, id: i64) {
    let ctx = Ctx::<S>::new(tag, 2).await;
    let order = Order::new(&format!("job-{tag}"), id, id * 10, &ctx.effects);
    let ran = AtomicUsize::new(0);
    let deliver = || async {
        match via {
            Via::Attribute => mint_in(&ctx, mode, &order, &ran, None).await,
            Via::Hand => {
                by_hand(
                    &ctx,
                    mode,
                    &order,
                    REPLAY_AND_FINGERPRINT,
                    &ran,
                    None,
                    minted,
                )
                .await
            }
        }
    };
    let first = applied_value(deliver().await);
    assert_eq!(
        first.token.len(),
        32,
        "a token from the database: {first:?}"
    );
    assert_eq!((first.id, first.amount), (id, id * 10));
    let first_json = serde_json::to_string(&first).expect("serialises");
    for delivery in 2..=10 {
        let again = replayed_value(deliver().await);
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

pub(crate) async fn replay_returns_the_first_value_byte_for_byte<S: Support>() {
    replay_returns_the_first_value::<S>(Mode::Transaction, Via::Attribute, "replaytx", 61).await;
}

pub(crate) async fn lease_replay_returns_the_first_value_byte_for_byte<S: Support>() {
    replay_returns_the_first_value::<S>(Mode::Lease, Via::Attribute, "replaylease", 62).await;
}

pub(crate) async fn replay_by_hand_returns_the_first_value_in_transaction_mode<S: Support>() {
    replay_returns_the_first_value::<S>(Mode::Transaction, Via::Hand, "replayhandtx", 51).await;
}

pub(crate) async fn replay_by_hand_returns_the_first_value_in_lease_mode<S: Support>() {
    replay_returns_the_first_value::<S>(Mode::Lease, Via::Hand, "replayhandlease", 52).await;
}

const RACERS: usize = 16;

/// Sixteen deliveries of one key with `replay`, shown to overlap like `races.rs` shows it
/// (the first body parks until the other fifteen are queued behind the key): one `Applied`,
/// fifteen `Replayed` with exactly its value, the body once.
pub(crate) async fn concurrent_replay_deliveries_apply_once_and_replay_its_value<S: Support>() {
    let ctx = Ctx::<S>::new("replayrace", RACERS as u32 + 2).await;
    let order = Order::new("job-replay-race", 63, 630, &ctx.effects);
    let ran = Arc::new(AtomicUsize::new(0));
    let hold = Arc::new(Hold::default());
    let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
    let tasks: Vec<_> = (0..RACERS)
        .map(|_| {
            let (store, order) = (ctx.store.clone(), order.clone());
            let (ran, hold, barrier) = (ran.clone(), hold.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                mint(&store, &order, &ran, Some(&hold)).await
            })
        })
        .collect();
    within(120, "a first delivery parking in its body", hold.entered()).await;
    until_all_queued(&ctx, RACERS).await;
    hold.release();
    let (mut applied, mut replayed) = (Vec::new(), Vec::new());
    for t in tasks {
        match within(120, "a concurrent delivery", t)
            .await
            .expect("no panic")
        {
            Ok(Outcome::Applied(v)) => applied.push(v),
            Ok(Outcome::Replayed(v)) => replayed.push(v),
            other => panic!("expected Applied or Replayed, got {other:?}"),
        }
    }
    assert_eq!((applied.len(), replayed.len()), (1, RACERS - 1));
    let first_json = serde_json::to_string(&applied[0]).expect("serialises");
    for v in &replayed {
        assert_eq!(v, &applied[0]);
        assert_eq!(serde_json::to_string(v).expect("serialises"), first_json);
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1, "bodies run");
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!(ctx.markers().await, 1);
    assert_stored_json(&ctx, &order.key, &applied[0]).await;
    ctx.cleanup().await;
}

/// Lease mode does not queue: sixteen deliveries at once, the first body parks, and the other
/// fifteen answer `InProgress` while it is parked (their answers arrive before it is released,
/// so they overlapped it); once it completes, fifteen concurrent redeliveries all get
/// `Replayed` with exactly its value.
pub(crate) async fn lease_concurrent_deliveries_with_replay_apply_once<S: Support>() {
    let ctx = Ctx::<S>::new("leasereplayrace", RACERS as u32 + 2).await;
    let order = Order::new("job-lease-replay-race", 64, 640, &ctx.effects);
    let ran = Arc::new(AtomicUsize::new(0));
    let hold = Arc::new(Hold::default());
    let (answers, mut answer) = tokio::sync::mpsc::unbounded_channel();
    let spawn = |barrier: Arc<tokio::sync::Barrier>| {
        let (store, pool, order) = (ctx.store.clone(), ctx.pool.clone(), order.clone());
        let (ran, hold, answers) = (ran.clone(), hold.clone(), answers.clone());
        tokio::spawn(async move {
            barrier.wait().await;
            let result = mint_leased(&store, &order, &pool, &ran, Some(&hold)).await;
            answers.send(result).expect("the case listens");
        })
    };
    let barrier = Arc::new(tokio::sync::Barrier::new(RACERS));
    let tasks: Vec<_> = (0..RACERS).map(|_| spawn(barrier.clone())).collect();
    within(120, "a first delivery parking in its body", hold.entered()).await;
    for _ in 1..RACERS {
        match within(120, "a delivery behind the lease", answer.recv()).await {
            Some(Err(TestError::Idem(idem::Error::InProgress { scope, key }))) => {
                assert_eq!((scope.as_str(), key.as_str()), (SCOPE, order.key.as_str()));
            }
            other => panic!("expected InProgress while the lease is held, got {other:?}"),
        }
    }
    assert_eq!(
        ran.load(Ordering::SeqCst),
        1,
        "bodies run while the lease is held"
    );
    hold.release();
    let first = match within(120, "the holder", answer.recv()).await {
        Some(Ok(Outcome::Applied(v))) => v,
        other => panic!("expected the holder's Applied, got {other:?}"),
    };
    for t in tasks {
        within(120, "a delivery task", t).await.expect("no panic");
    }
    // The redeliveries, all at once.
    let barrier = Arc::new(tokio::sync::Barrier::new(RACERS - 1));
    let tasks: Vec<_> = (1..RACERS).map(|_| spawn(barrier.clone())).collect();
    let first_json = serde_json::to_string(&first).expect("serialises");
    for _ in 1..RACERS {
        let again = replayed_value(
            within(120, "a redelivery", answer.recv())
                .await
                .expect("every task answers"),
        );
        assert_eq!(again, first);
        assert_eq!(
            serde_json::to_string(&again).expect("serialises"),
            first_json
        );
    }
    for t in tasks {
        within(120, "a redelivery task", t).await.expect("no panic");
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1, "bodies run");
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!((ctx.markers().await, completed(&ctx).await), (1, 1));
    assert_stored_json(&ctx, &order.key, &first).await;
    ctx.cleanup().await;
}

/// `None` is stored as JSON `null`, which is a value: later deliveries get `Replayed(None)`,
/// not `Duplicate` (which would mean nothing was stored).
async fn stored_null_is_replayed<S: Support>(mode: Mode, tag: &str, id: i64) {
    let ctx = Ctx::<S>::new(tag, 2).await;
    let order = Order::new(&format!("job-{tag}"), id, 1, &ctx.effects);
    let ran = AtomicUsize::new(0);
    let deliver = || async {
        match mode {
            Mode::Transaction => nothing(&ctx.store, &order, &ran).await,
            Mode::Lease => nothing_leased(&ctx.store, &order, &ctx.pool, &ran).await,
        }
    };
    assert_eq!(applied_value(deliver().await), None);
    assert_eq!(replayed_value(deliver().await), None);
    assert_eq!(replayed_value(deliver().await), None);
    assert_eq!(ran.load(Ordering::SeqCst), 1, "bodies run");
    assert_eq!(
        stored_result(&ctx, &order.key).await.as_deref(),
        Some("null")
    );
    assert_eq!(ctx.effects_total().await, 1);
    ctx.cleanup().await;
}

pub(crate) async fn stored_json_null_is_replayed_not_duplicate<S: Support>() {
    stored_null_is_replayed::<S>(Mode::Transaction, "replaynull", 65).await;
}

pub(crate) async fn lease_stored_json_null_is_replayed_not_duplicate<S: Support>() {
    stored_null_is_replayed::<S>(Mode::Lease, "leasereplaynull", 66).await;
}

/// A value that cannot be serialised (a map with tuple keys; a type whose `Serialize` fails)
/// is `Error::Serialize`: no completed marker, no stored value, and in transaction mode no
/// effect (lease mode's effect is outside, done before the value exists). The next delivery
/// of a value that serialises applies, and is replayed.
async fn unserialisable_value_commits_nothing<S: Support>(tag: &str, id: i64) {
    let ctx = Ctx::<S>::new(tag, 2).await;
    let order = Order::new(&format!("job-{tag}"), id, 7, &ctx.effects);
    let ran = AtomicUsize::new(0);
    let map = |entries| tuple_map(&ctx.store, &order, &ran, entries);
    is_serialize_error(map(3).await);
    is_serialize_error(refusing(&ctx.store, &order, &ran).await);
    assert_eq!(ran.load(Ordering::SeqCst), 2, "bodies run");
    assert_eq!(completed(&ctx).await, 0, "a completed marker");
    assert_eq!(ctx.markers().await, 0);
    assert_eq!(ctx.effects_total().await, 0, "an effect was committed");
    assert!(applied_value(map(0).await).is_empty());
    assert!(replayed_value(map(0).await).is_empty());
    assert!(
        replayed_value(map(5).await).is_empty(),
        "replayed, not recomputed"
    );
    assert_eq!(ran.load(Ordering::SeqCst), 3, "bodies run");
    assert_eq!((ctx.markers().await, completed(&ctx).await), (1, 1));
    assert_eq!(stored_result(&ctx, &order.key).await.as_deref(), Some("{}"));
    ctx.cleanup().await;
}

pub(crate) async fn unserialisable_value_commits_nothing_and_next_delivery_applies<S: Support>() {
    unserialisable_value_commits_nothing::<S>("replayser", 67).await;
}

fn is_value_not_stored<T: std::fmt::Debug>(result: Result<Outcome<T>, TestError>, key: &str) {
    match result {
        Err(TestError::Idem(idem::Error::ValueNotStored { key: k, reason, .. })) => {
            assert_eq!(k, key);
            assert!(!reason.is_empty());
        }
        other => panic!("expected Error::ValueNotStored, got {other:?}"),
    }
}

/// Lease mode: the outside call happened before the value turned out not to be storable (a
/// map with non-string keys, a value over `MAX_REPLAY_LEN`). The marker completes without a
/// value and the caller is told (`ValueNotStored`); every later delivery is a duplicate, so
/// the outside call is never repeated.
pub(crate) async fn lease_unstorable_value_completes_without_it<S: Support>() {
    let ctx = Ctx::<S>::new("leasereplayser", 2).await;
    let ran = AtomicUsize::new(0);
    let order = Order::new("job-leasereplayser", 68, 7, &ctx.effects);
    let map = |entries| tuple_map_leased(&ctx.store, &order, &ctx.pool, &ran, entries);
    is_value_not_stored(map(3).await, &order.key);
    for _ in 0..3 {
        is_duplicate(map(0).await);
    }
    let big = Order::new("job-leasereplaybig", 73, 7, &ctx.effects);
    let huge = || huge_leased(&ctx.store, &big, &ctx.pool, &ran);
    is_value_not_stored(huge().await, &big.key);
    is_duplicate(huge().await);
    assert_eq!(ran.load(Ordering::SeqCst), 2, "outside calls");
    assert_eq!(ctx.effects_total().await, 2);
    assert_eq!((ctx.markers().await, completed(&ctx).await), (2, 2));
    assert_eq!(stored_result(&ctx, &order.key).await, None);
    assert_eq!(stored_result(&ctx, &big.key).await, None);
    ctx.cleanup().await;
}

/// A marker committed by the handler before `replay` (and `fingerprint`) were added, same
/// scope and key: the handler with them answers `Duplicate` without error and without
/// running, for the same payload and for another (a marker without a fingerprint matches
/// any payload).
async fn marker_from_before_replay<S: Support>(mode: Mode, tag: &str, id: i64) {
    let ctx = Ctx::<S>::new(tag, 2).await;
    let order = Order::new(&format!("job-{tag}"), id, 9, &ctx.effects);
    let ran = AtomicUsize::new(0);
    let old = match mode {
        Mode::Transaction => mint_plain(&ctx.store, &order, &ran).await,
        Mode::Lease => mint_leased_plain(&ctx.store, &order, &ctx.pool, &ran).await,
    };
    applied_value(old);
    assert_eq!(stored_result(&ctx, &order.key).await, None);
    is_duplicate(mint_in(&ctx, mode, &order, &ran, None).await);
    is_duplicate(mint_in(&ctx, mode, &order.with_amount(10), &ran, None).await);
    assert_eq!(ran.load(Ordering::SeqCst), 1, "bodies run");
    assert_eq!(ctx.effects_total().await, 1);
    assert_eq!((ctx.markers().await, completed(&ctx).await), (1, 1));
    ctx.cleanup().await;
}

pub(crate) async fn marker_from_before_replay_is_a_plain_duplicate<S: Support>() {
    marker_from_before_replay::<S>(Mode::Transaction, "replayold", 69).await;
}

pub(crate) async fn lease_marker_from_before_replay_is_a_plain_duplicate<S: Support>() {
    marker_from_before_replay::<S>(Mode::Lease, "leasereplayold", 70).await;
}

/// A stored value that no longer reads as the handler's type (the return type changed
/// between deploys) is a plain duplicate: the job was applied, nothing runs, and the delivery
/// is acked rather than nacked forever.
async fn stale_stored_value<S: Support>(mode: Mode, tag: &str, id: i64) {
    let ctx = Ctx::<S>::new(tag, 2).await;
    let order = Order::new(&format!("job-{tag}"), id, 11, &ctx.effects);
    let ran = AtomicUsize::new(0);
    let first = applied_value(mint_in(&ctx, mode, &order, &ran, None).await);
    for _ in 0..2 {
        let again = match mode {
            Mode::Transaction => mint_as_number(&ctx.store, &order, &ran).await,
            Mode::Lease => mint_as_number_leased(&ctx.store, &order, &ctx.pool, &ran).await,
        };
        is_duplicate(again);
    }
    assert_eq!(ran.load(Ordering::SeqCst), 1, "bodies run");
    // The value is still there for the type that stored it.
    assert_eq!(
        replayed_value(mint_in(&ctx, mode, &order, &ran, None).await),
        first
    );
    assert_eq!(ctx.effects_total().await, 1);
    assert_stored_json(&ctx, &order.key, &first).await;
    ctx.cleanup().await;
}

pub(crate) async fn stored_value_of_another_type_is_a_duplicate<S: Support>() {
    stale_stored_value::<S>(Mode::Transaction, "replaystale", 71).await;
}

pub(crate) async fn lease_stored_value_of_another_type_is_a_duplicate<S: Support>() {
    stale_stored_value::<S>(Mode::Lease, "leasereplaystale", 72).await;
}

/// Text with characters JSON escapes and some it does not, all but NUL.
const EVERY_CHARACTER: &str = "bell \u{7} esc \u{1b} del \u{7f} bom \u{feff} line-sep \u{2028} \
                               quote \" backslash \\ slash / crab 🦀 nbsp \u{a0} cr \r lf \n";

/// `replay` of `text`: the first delivery applies, the next gets `text` back, and the
/// result column holds its JSON. Where a backend cannot store a value, the contract can only
/// hold as `Error::Serialize` with nothing completed and the key free again, not as a
/// database error that every redelivery of the job would meet again.
async fn replayed_text<S: Support>(mode: Mode, tag: &str, id: i64, text: &str) {
    let ctx = Ctx::<S>::new(tag, 2).await;
    let mut order = Order::new(&format!("job-{tag}"), id, 13, &ctx.effects);
    order.payload.memo = text.to_owned();
    let ran = AtomicUsize::new(0);
    let deliver = || async {
        match mode {
            Mode::Transaction => echo(&ctx.store, &order, &ran).await,
            Mode::Lease => echo_leased(&ctx.store, &order, &ctx.pool, &ran).await,
        }
    };
    match deliver().await {
        Ok(Outcome::Applied(echoed)) => {
            assert_eq!(echoed, text);
            assert_eq!(replayed_value(deliver().await), text);
            assert_stored_json(&ctx, &order.key, &text).await;
            assert_eq!(ran.load(Ordering::SeqCst), 1, "bodies run");
        }
        Err(TestError::Idem(idem::Error::Serialize(_))) => {
            assert_eq!(completed(&ctx).await, 0);
            // Not held: the next delivery runs (and is refused the same way).
            is_serialize_error(deliver().await);
            assert_eq!(ran.load(Ordering::SeqCst), 2, "bodies run");
        }
        other => {
            panic!("expected Applied (or Error::Serialize with nothing committed), got {other:?}")
        }
    }
    ctx.cleanup().await;
}

pub(crate) async fn replayed_text_keeps_every_character<S: Support>() {
    replayed_text::<S>(Mode::Transaction, "replaytext", 73, EVERY_CHARACTER).await;
}

pub(crate) async fn lease_replayed_text_keeps_every_character<S: Support>() {
    replayed_text::<S>(Mode::Lease, "leasereplaytext", 74, EVERY_CHARACTER).await;
}

/// A NUL character is valid in a Rust string and in JSON (`\u0000`); PostgreSQL's `jsonb`
/// would refuse it, which is why the column is `json`.
const WITH_NUL: &str = "before \u{0} after";

pub(crate) async fn replayed_text_with_a_nul_character_is_stored_or_refused<S: Support>() {
    replayed_text::<S>(Mode::Transaction, "replaynul", 75, WITH_NUL).await;
}

pub(crate) async fn lease_replayed_text_with_a_nul_character_is_stored_or_refused<S: Support>() {
    replayed_text::<S>(Mode::Lease, "leasereplaynul", 76, WITH_NUL).await;
}
