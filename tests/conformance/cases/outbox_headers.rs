//! Message headers: what a body gives a message (content type, `traceparent`, its own headers)
//! is written with it and reaches the publisher exactly; bad headers are refused before
//! anything is written; and `migrate` gives an outbox made by schema version 3 its `headers`
//! column, its old messages still published, with none.
//!
//! The broker is a table of the same database, written by a `Publisher` of the test's own that
//! records each message's id and headers; the brokers' own publishers carry them to RabbitMQ,
//! JetStream and Kafka in `examples/tests/outbox.rs` and `tests/kafka.rs`.

use idem::outbox::{Message, PublishError, Publisher, Relay};
use idem::{Outbox, Store};
use sqlx::{Pool, Transaction};

use crate::conformance::ctx::Ctx;
use crate::conformance::db::Bind;
use crate::conformance::handlers::*;
use crate::conformance::util::{backend, unique_name};
use crate::conformance::{Support, TestDb};

use super::outbox::outbox_table;
use super::upgrade::version_2;

const SCOPE: &str = "orders.headers";
const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
/// A value with what JSON escapes and a character beyond ASCII.
const ODD_VALUE: &str = "a \"quoted\"\tvalue, caf\u{e9}";

/// The effect, and four messages: JSON and bytes sent plainly, then one of each put together
/// with headers of their own.
#[idem::idempotent(key = "job.key", scope = "orders.headers")]
async fn ship_with_headers<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    outbox: &mut Outbox,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "ship").await?;
    outbox.send("shipping", &job.id)?;
    outbox.send_bytes("shipping", b"raw".to_vec())?;
    outbox
        .message("shipping")
        .json(&(job.id, "built"))
        .key("customer-9")
        .header("tenant", "acme")
        .header("X-Note", ODD_VALUE)
        .traceparent(TRACEPARENT)
        .send()?;
    outbox
        .message("invoices")
        .content_type("application/pdf")
        .bytes(b"%PDF-1.7".to_vec())
        .header("empty", "")
        .send()?;
    Ok(job.amount)
}

/// What `ship_with_headers` gives its `n`-th message, as the recording publisher writes it.
fn expected(key: &str) -> Vec<String> {
    let id = |n: u32| {
        idem::job_id(SCOPE, &(key, n))
            .expect("a valid id")
            .into_string()
    };
    let note = serde_json::to_string(ODD_VALUE).expect("a string");
    let mut all = vec![
        format!("{} [[\"content-type\",\"application/json\"]]", id(0)),
        format!(
            "{} [[\"content-type\",\"application/octet-stream\"]]",
            id(1)
        ),
        format!(
            "{} [[\"content-type\",\"application/json\"],[\"traceparent\",\"{TRACEPARENT}\"],\
             [\"tenant\",\"acme\"],[\"X-Note\",{note}]]",
            id(2)
        ),
        format!(
            "{} [[\"content-type\",\"application/pdf\"],[\"empty\",\"\"]]",
            id(3)
        ),
    ];
    all.sort();
    all
}

/// Records each message it gets as `<id> <its headers as JSON pairs>` in the table
/// `received (body)`, one autocommit insert per message.
struct Recording<DB: TestDb> {
    pool: Pool<DB>,
    table: String,
}

impl<DB: TestDb> Publisher for Recording<DB> {
    async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
        let pairs: Vec<(&str, &str)> = message.headers.all().collect();
        let body = format!("{} {}", message.id, serde_json::to_string(&pairs)?);
        let mut conn = self.pool.acquire().await?;
        let sql = format!("INSERT INTO {} (body) VALUES ($1)", self.table);
        DB::execute(&mut conn, &sql, &[Bind::Str(body)]).await?;
        Ok(())
    }
}

async fn recording<S: Support>(ctx: &mut Ctx<S>) -> (String, Recording<S::Db>) {
    let table = ctx.create_table("r", "(body VARCHAR(1000) NOT NULL)").await;
    let publisher = Recording {
        pool: ctx.pool.clone(),
        table: table.clone(),
    };
    (table, publisher)
}

/// What the recording publisher received, sorted.
async fn received<S: Support>(ctx: &Ctx<S>, table: &str) -> Vec<String> {
    let sql = format!("SELECT body FROM {table}");
    let mut conn = ctx.pool.acquire().await.expect("a connection");
    let mut all = S::Db::fetch_strings(&mut conn, &sql)
        .await
        .unwrap_or_else(|e| panic!("{sql}: {e}"));
    all.sort();
    all
}

/// Every message's headers are written with it and reach the publisher as the body gave them:
/// the default content types, a content type and a `traceparent` of its own, its own headers in
/// their order, values with quotes, tabs and non-ASCII characters. Operators see them too.
pub(crate) async fn outbox_headers_reach_the_publisher_as_they_were_sent<S: Support>() {
    let mut ctx = Ctx::<S>::new("headers", 2).await;
    let (table, publisher) = recording(&mut ctx).await;
    let job = ctx.job("order-1", 1, 10);
    applied(ship_with_headers(&ctx.store, &job).await);
    let outbox = outbox_table(&ctx);
    let with = format!("SELECT COUNT(*) FROM {outbox} WHERE headers IS NOT NULL");
    assert_eq!(ctx.scalar(&with).await, 4);

    let entries = ctx.store.list_outbox(true, true, 10).await.expect("a list");
    let built = entries
        .iter()
        .find(|e| e.ordering_key == "customer-9")
        .expect("the message with an ordering key of its own");
    assert_eq!(built.headers.traceparent(), Some(TRACEPARENT));
    assert_eq!(built.headers.get("x-note"), Some(ODD_VALUE));

    let relay = Relay::new(ctx.store.clone(), publisher);
    assert_eq!(relay.relay_once().await.expect("a round").sent, 4);
    assert_eq!(received(&ctx, &table).await, expected(&job.key));
    ctx.cleanup().await;
}

/// One bad thing in a message's headers.
#[derive(Debug, Clone, Copy)]
enum Bad {
    Name,
    Value,
    Reserved,
    Traceparent,
    ContentType,
    Size,
    Twice,
}

/// The effect, a good message, then one with `bad` headers.
#[idem::idempotent(key = "job.key", scope = "orders.headers")]
async fn ship_bad_headers<DB: TestDb>(
    tx: &mut Transaction<'_, DB>,
    job: &Job,
    outbox: &mut Outbox,
    bad: Bad,
) -> Result<i64, TestError> {
    insert_effect(tx, job, "ship").await?;
    outbox
        .message("shipping")
        .json(&1)
        .header("ok", "1")
        .send()?;
    let message = outbox.message("shipping").json(&2);
    let message = match bad {
        Bad::Name => message.header("no spaces", "v"),
        Bad::Value => message.header("x", "two\r\nlines"),
        Bad::Reserved => message.header("Nats-Msg-Id", "forged"),
        Bad::Traceparent => message.traceparent("00-abc-def-01"),
        Bad::ContentType => message.content_type("json"),
        Bad::Size => message.header("x", "v".repeat(idem::outbox::MAX_HEADERS_SIZE)),
        Bad::Twice => message.header("x", "1").header("X", "2"),
    };
    message.send()?;
    Ok(job.amount)
}

/// Bad headers fail the body at `send` with a message that says what to fix, and nothing of
/// the job is written: no message (not even the good one before), no effect, no marker.
pub(crate) async fn outbox_refuses_bad_headers_before_any_io<S: Support>() {
    let ctx = Ctx::<S>::new("headersbad", 2).await;
    let cases = [
        (Bad::Name, "letters, digits"),
        (Bad::Value, "control character"),
        (Bad::Reserved, "JetStream"),
        (Bad::Traceparent, "W3C"),
        (Bad::ContentType, "type/subtype"),
        (Bad::Size, "more than the 16384"),
        (Bad::Twice, "set twice"),
    ];
    for (id, (bad, says)) in (1..).zip(cases) {
        let job = ctx.job(&format!("order-{id}"), id, 1);
        match ship_bad_headers(&ctx.store, &job, bad).await {
            Err(TestError::Idem(idem::Error::Refused(idem::Refusal::Message { reason }))) => {
                assert!(reason.contains(says), "{bad:?}: {reason}");
            }
            other => panic!("{bad:?}: expected Refusal::Message, got {other:?}"),
        }
    }
    let outbox = outbox_table(&ctx);
    let count = format!("SELECT COUNT(*) FROM {outbox}");
    assert_eq!(ctx.scalar(&count).await, 0);
    assert_eq!((ctx.markers().await, ctx.effects_total().await), (0, 0));
    ctx.cleanup().await;
}

/// An outbox made by schema version 3 (version 2 and the published upgrade to 3), with an
/// unsent message: `migrate` gives it the `headers` column (the old message has none), new
/// messages are written with theirs, and the relay publishes both, the old one without
/// headers.
pub(crate) async fn migrate_gives_an_old_outbox_its_headers<S: Support>() {
    let mut ctx = Ctx::<S>::new("headersold", 2).await;
    let (table, publisher) = recording(&mut ctx).await;
    let old = unique_name("m", "headersold");
    version_2(&mut ctx, &old, "before-migrate").await;
    for stmt in super::upgrade::statements(S::UPGRADE_V2_TO_V3) {
        ctx.exec(&stmt.replace("idem_processed", &old)).await;
    }
    let (payload, key) = match backend::<S::Db>() {
        "postgres" => ("'\\x7b7d'::bytea", "key"),
        "mysql" => ("X'7b7d'", "`key`"),
        _ => ("X'7b7d'", "key"),
    };
    let at = S::TWO_HOURS_AGO;
    ctx.exec(&format!(
        "INSERT INTO {old}_outbox (id, destination, payload, scope, {key}, seq, created_at, \
         next_attempt_at, ordering_key) VALUES ('old-message', 'shipping', {payload}, \
         'apply', 'before-migrate', 0, {at}, {at}, 'customer-0')"
    ))
    .await;
    let store = Store::new(ctx.pool.clone())
        .with_table(&old)
        .expect("a generated table name");
    store.migrate().await.expect("migrate a version 3 schema");
    store.migrate().await.expect("migrate it again");
    let without = format!("SELECT COUNT(*) FROM {old}_outbox WHERE headers IS NULL");
    assert_eq!(ctx.scalar(&without).await, 1);

    let job = ctx.job("order-1", 1, 10);
    applied(ship_with_headers(&store, &job).await);
    let with = format!("SELECT COUNT(*) FROM {old}_outbox WHERE headers IS NOT NULL");
    assert_eq!(ctx.scalar(&with).await, 4);
    let relay = Relay::new(store, publisher);
    assert_eq!(relay.relay_once().await.expect("a round").sent, 5);
    let mut want = expected(&job.key);
    want.push("old-message []".to_owned());
    want.sort();
    assert_eq!(received(&ctx, &table).await, want);
    ctx.cleanup().await;
}
