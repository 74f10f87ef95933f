//! The WAL relay as a process of its own, for the tests that kill it: `idem-wal-relay
//! STORE_URL TABLE AMQP_URL` relays the outbox of the store of TABLE (sent through the WAL)
//! to RabbitMQ until it is killed, and writes `relaying` to stderr once its setup is done.

use idem::Store;
use idem::outbox::{RabbitMq, WalRelay};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [url, table, amqp] = &args[..] else {
        eprintln!("usage: idem-wal-relay STORE_URL TABLE AMQP_URL");
        std::process::exit(2);
    };
    let pool = sqlx::PgPool::connect(url)
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {url}: {e}"));
    let store = Store::new(pool)
        .with_table(table)
        .expect("a table name")
        .outbox_through_wal();
    let connection = lapin::Connection::connect(amqp, lapin::ConnectionProperties::default())
        .await
        .unwrap_or_else(|e| panic!("cannot connect to {amqp}: {e}"));
    let channel = connection.create_channel().await.expect("a channel");
    let relay = WalRelay::new(store, url, RabbitMq::new(channel))
        .expect("the relay")
        .batch(50)
        .standby(std::time::Duration::from_millis(50));
    relay.setup().await.unwrap_or_else(|e| panic!("{e}"));
    eprintln!("relaying");
    if let Err(e) = relay.run(std::future::pending()).await {
        eprintln!("the relay ended: {e}");
        std::process::exit(1);
    }
}
