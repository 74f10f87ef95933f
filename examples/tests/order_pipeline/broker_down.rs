//! The broker gone for a while, without stopping the shared RabbitMQ: the relay reaches it
//! through a TCP proxy of the test's, which is cut (its connections closed, new ones refused)
//! and then restored. Messages committed meanwhile wait in the outbox, failing and retried,
//! none parked or lost; once the broker is back, all are published and consumed once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use idem::outbox::OutboxState;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Mutex;
use tokio::task::JoinHandle;

use crate::Pipeline;
use crate::order_pipeline::{Reconnecting, Telling, relay, run_consumer};
use crate::support::within;

/// A TCP proxy to RabbitMQ that can be cut and restored.
struct Proxy {
    port: u16,
    up: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<JoinHandle<()>>>>,
    accept: JoinHandle<()>,
}

impl Proxy {
    async fn start(target: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let up = Arc::new(AtomicBool::new(true));
        let links: Arc<Mutex<Vec<JoinHandle<()>>>> = Arc::default();
        let (up2, links2) = (up.clone(), links.clone());
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !up2.load(Ordering::SeqCst) {
                    // Down: the connection is closed at once, as by a broker that is gone.
                    drop(client);
                    continue;
                }
                let target = target.clone();
                links2.lock().await.push(tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(target).await {
                        drop(tokio::io::copy_bidirectional(&mut client, &mut server).await);
                    }
                }));
            }
        });
        Proxy {
            port,
            up,
            links,
            accept,
        }
    }

    /// Closes every open connection and refuses new ones.
    async fn cut(&self) {
        self.up.store(false, Ordering::SeqCst);
        for link in self.links.lock().await.drain(..) {
            link.abort();
        }
    }

    fn restore(&self) {
        self.up.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// The `host:port` of `amqp://user:pass@host:port/vhost`, and the URL with `127.0.0.1:port`
/// instead.
fn through(url: &str, port: u16) -> (String, String) {
    let (head, rest) = url.split_once('@').expect("a user in the AMQP URL");
    let (target, vhost) = rest.split_once('/').unwrap_or((rest, ""));
    (
        target.to_owned(),
        format!("{head}@127.0.0.1:{port}/{vhost}"),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn broker_down_for_a_while_messages_wait_and_all_go_out_once_it_is_back() {
    let p = Pipeline::create("broker_down").await;
    let url = crate::order_pipeline::amqp_url();
    let proxy = Proxy::start(through(&url, 0).0).await;
    let proxied = through(&url, proxy.port).1;
    let publisher = Telling {
        inner: Reconnecting::new(&proxied),
        pause: false,
        on_line: Arc::new(|_: &str| {}),
    };
    let relay = relay(&p.store, publisher, 10);
    let (stop_relay, relay_stopped) = tokio::sync::oneshot::channel::<()>();
    let (stop_consumer, consumer_stopped) = tokio::sync::oneshot::channel::<()>();
    let consuming = p.amqp.create_channel().await.unwrap();
    let pipeline = async {
        let relaying = relay.run(Duration::from_millis(20), async {
            drop(relay_stopped.await);
        });
        let consumer = run_consumer(
            &p.store,
            &consuming,
            &p.names,
            async {
                drop(consumer_stopped.await);
            },
            |_| {},
        );
        let (relayed, consumed) = tokio::join!(relaying, consumer);
        relayed.unwrap();
        consumed.unwrap();
    };
    let test = async {
        for n in 1..=10 {
            p.place(&format!("order-{n}")).await;
        }
        p.until(30, "the first ten sent", |c| c.sent == 10).await;

        proxy.cut().await;
        for n in 11..=40 {
            p.place(&format!("order-{n}")).await;
        }
        // Each of the thirty tried and failed at least twice: the relay keeps at it.
        within(30, "the relay's failed attempts", async {
            loop {
                let waiting = p.store.list_outbox(true, true, 100).await.unwrap();
                if waiting.len() == 30 && waiting.iter().all(|m| m.attempts >= 2) {
                    assert!(waiting.iter().all(|m| m.state == OutboxState::Pending));
                    assert!(waiting.iter().all(|m| m.last_error.is_some()));
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        let c = p.counts().await;
        assert_eq!(
            (c.messages, c.sent, c.emails),
            (40, 10, 10),
            "nothing went out"
        );

        proxy.restore();
        p.until(60, "all forty consumed", |c| c.sent == 40 && c.emails == 40)
            .await;
        stop_relay.send(()).expect("the relay runs");
        stop_consumer.send(()).expect("the consumer runs");
    };
    within(120, "the broker-down test", async {
        tokio::join!(pipeline, test)
    })
    .await;
    let c = p.counts().await;
    assert_eq!(
        (c.orders, c.messages, c.sent, c.emails, c.distinct_emails),
        (40, 40, 40, 40, 40)
    );
    assert!(
        p.store
            .list_outbox(true, true, 10)
            .await
            .unwrap()
            .is_empty()
    );
    consuming.close(200, "done".into()).await.unwrap();
    p.drop().await;
}
