//! `--outbox`'s JetStream rows: the relay's rows of PostgreSQL again through idem's
//! `JetStream` publisher, on a stream of this process's own.
//!
//! The stream is made as a user would make it: file storage and the default duplicate window,
//! which drops a second publish of one `Nats-Msg-Id`. A count alone would therefore hide a
//! message published twice, and a purge's count only says how many distinct ids arrived: each
//! run reads the stream's messages back and compares their ids with the ones it published,
//! then purges the stream, whose purge must take exactly those.

use std::collections::HashSet;
use std::time::Duration;

use async_nats::header::NATS_MESSAGE_ID;
use async_nats::jetstream::{self, consumer, stream};
use futures_util::StreamExt as _;
use idem::outbox::JetStream;

use crate::Res;

/// The server of the tests, unless `IDEM_NATS_URL` says otherwise.
const DEFAULT_URL: &str = "nats://127.0.0.1:4222";

/// How long reading a run's messages back may take before the bench gives up on it.
const PATIENCE: Duration = Duration::from_secs(30);

/// This run's stream and the publisher the relay rows publish through.
pub(super) struct Js {
    context: jetstream::Context,
    stream: stream::Stream,
    name: String,
    /// The stream's one subject: every message's destination.
    pub(super) subject: String,
    pub(super) publisher: JetStream,
}

impl Js {
    /// Connects and makes the stream `idem-bench-outbox-{suffix}`, dropping one an earlier run
    /// with the same suffix left.
    pub(super) async fn connect(suffix: &str) -> Res<Js> {
        let url = std::env::var("IDEM_NATS_URL")
            .ok()
            .filter(|u| !u.is_empty())
            .unwrap_or_else(|| DEFAULT_URL.to_owned());
        let client = async_nats::connect(&url)
            .await
            .map_err(|e| format!("cannot reach NATS at {url} (IDEM_NATS_URL): {e}"))?;
        let context = jetstream::new(client);
        let name = format!("idem-bench-outbox-{suffix}");
        let subject = format!("idem.bench.outbox.{suffix}");
        let _ = context.delete_stream(&name).await;
        let stream = context
            .create_stream(stream::Config {
                name: name.clone(),
                subjects: vec![subject.clone()],
                ..Default::default()
            })
            .await
            .map_err(|e| format!("cannot create the JetStream stream {name}: {e}"))?;
        Ok(Js {
            publisher: JetStream::new(context.clone()),
            context,
            stream,
            name,
            subject,
        })
    }

    /// Checks that the stream holds exactly the messages `ids`, each once, then empties it.
    pub(super) async fn check_and_purge(&self, ids: Vec<String>) -> Res<()> {
        let expected: HashSet<String> = ids.into_iter().collect();
        let held = self.stream.get_info().await?.state.messages;
        if held as usize != expected.len() {
            return Err(format!(
                "{held} messages in the stream after publishing {}",
                expected.len()
            )
            .into());
        }
        // An ordered consumer: ephemeral, no acks, the stream's messages from its first.
        let consumer = self
            .stream
            .create_consumer(consumer::pull::OrderedConfig::default())
            .await?;
        let mut messages = consumer.messages().await?.take(expected.len());
        let mut seen = HashSet::with_capacity(expected.len());
        while let Some(message) = tokio::time::timeout(PATIENCE, messages.next())
            .await
            .map_err(|_| format!("{} of {held} messages read back", seen.len()))?
        {
            let message = message?;
            let id = message
                .headers
                .as_ref()
                .and_then(|h| h.get(NATS_MESSAGE_ID))
                .map(|v| v.as_str().to_owned())
                .ok_or("a message without a Nats-Msg-Id")?;
            if !expected.contains(&id) {
                return Err(format!("message {id} in the stream was not published").into());
            }
            if !seen.insert(id.clone()) {
                return Err(format!("message {id} twice in the stream").into());
            }
        }
        if seen.len() != expected.len() {
            return Err(format!("{} of {held} messages read back", seen.len()).into());
        }
        let purged = self.stream.purge().await?.purged;
        if purged != held {
            return Err(format!("{purged} messages purged of {held}").into());
        }
        Ok(())
    }

    /// Deletes the stream. Best effort: a stream left behind carries this run's suffix.
    /// Empties the stream, whatever it holds.
    pub(super) async fn purge(&self) -> Res<()> {
        self.stream.purge().await?;
        Ok(())
    }

    pub(super) async fn delete(self) {
        let _ = self.context.delete_stream(&self.name).await;
    }
}
