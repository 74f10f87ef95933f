//! A round published in waves: every key's first message, then every key's second, and so on,
//! so that a key's next message goes out only after the broker confirmed the one before; a key
//! whose message failed is dropped from the round, and its later messages wait for it.

use std::collections::HashMap;

use super::{PublishError, Publisher};
use crate::outgoing::Message;

/// The messages of a round grouped by ordering key, each key's in the order they were taken
/// (the order they were written).
pub(super) struct Keys {
    /// Per key, the positions of its messages in the round.
    groups: Vec<Vec<usize>>,
    /// Per message, its key's group.
    of: Vec<usize>,
}

impl Keys {
    pub(super) fn of(messages: &[Message]) -> Keys {
        let mut index: HashMap<&str, usize> = HashMap::new();
        let mut groups: Vec<Vec<usize>> = Vec::new();
        let mut of = Vec::with_capacity(messages.len());
        for (at, message) in messages.iter().enumerate() {
            let group = *index
                .entry(message.ordering_key.as_str())
                .or_insert_with(|| {
                    groups.push(Vec::new());
                    groups.len() - 1
                });
            groups[group].push(at);
            of.push(group);
        }
        Keys { groups, of }
    }
}

/// What became of one message of a round.
pub(super) enum Answer {
    /// The broker confirmed it.
    Published,
    /// The broker refused it, or could not be reached.
    Failed(PublishError),
    /// Not tried: an earlier message of its key failed in this round.
    Waiting,
    /// Not tried, or not answered, before the round's time was up.
    Left,
}

/// A round's messages and the answers its waves got so far: what is there when its time is
/// up is what gets marked.
pub(super) struct Round {
    /// The messages not yet handed to the publisher.
    unsent: Vec<Option<Message>>,
    /// The positions of the messages handed to the publisher, in the order handed.
    order: Vec<usize>,
    /// The publisher's answers, in that order (as many as it gave so far).
    answers: Vec<Result<(), PublishError>>,
}

impl Round {
    pub(super) fn new(messages: Vec<Message>) -> Round {
        Round {
            unsent: messages.into_iter().map(Some).collect(),
            order: Vec::new(),
            answers: Vec::new(),
        }
    }

    /// Publishes wave after wave, each wave pipelined ([`Publisher::publish_all`]): one
    /// message of each key still in the round. Ends when no key has a message left, or when
    /// the publisher gave fewer answers than it was given messages.
    pub(super) async fn publish<P: Publisher>(&mut self, publisher: &P, keys: &Keys) {
        let mut live = vec![true; keys.groups.len()];
        for depth in 0.. {
            let wave: Vec<usize> = keys
                .groups
                .iter()
                .zip(&live)
                .filter(|(_, live)| **live)
                .filter_map(|(group, _)| group.get(depth).copied())
                .collect();
            if wave.is_empty() {
                return;
            }
            let batch: Vec<Message> = wave
                .iter()
                .map(|&at| self.unsent[at].take().expect("a message is in one wave"))
                .collect();
            let start = self.answers.len();
            self.order.extend_from_slice(&wave);
            publisher.publish_all(&batch, &mut self.answers).await;
            // Answers beyond the wave's messages answer nothing.
            self.answers.truncate(start + batch.len());
            if self.answers.len() < start + batch.len() {
                return;
            }
            for (at, answer) in wave.iter().zip(&self.answers[start..]) {
                if answer.is_err() {
                    live[keys.of[*at]] = false;
                }
            }
        }
    }

    /// Each message's position in the round and what became of it.
    pub(super) fn answers(self, keys: &Keys) -> Vec<(usize, Answer)> {
        let mut got: Vec<Option<Answer>> = self.unsent.iter().map(|_| None).collect();
        let mut failed = vec![false; keys.groups.len()];
        for (&at, answer) in self.order.iter().zip(self.answers) {
            got[at] = Some(match answer {
                Ok(()) => Answer::Published,
                Err(e) => {
                    failed[keys.of[at]] = true;
                    Answer::Failed(e)
                }
            });
        }
        got.into_iter()
            .enumerate()
            .map(|(at, answer)| {
                let not_tried = || match failed[keys.of[at]] {
                    true => Answer::Waiting,
                    false => Answer::Left,
                };
                (at, answer.unwrap_or_else(not_tried))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    /// Records what it was given, wave by wave; refuses the messages whose payload is `fail`.
    #[derive(Default)]
    struct Recording {
        waves: Mutex<Vec<Vec<String>>>,
    }

    impl Publisher for Recording {
        async fn publish<'a>(&'a self, message: &'a Message) -> Result<(), PublishError> {
            match message.payload.as_slice() {
                b"fail" => Err("refused".into()),
                _ => Ok(()),
            }
        }

        async fn publish_all<'a>(
            &'a self,
            messages: &'a [Message],
            done: &'a mut Vec<Result<(), PublishError>>,
        ) {
            let ids = messages.iter().map(|m| m.id.clone()).collect();
            self.waves.lock().unwrap().push(ids);
            for message in messages {
                done.push(self.publish(message).await);
            }
        }
    }

    fn message(id: &str, key: &str, payload: &str) -> Message {
        Message {
            id: id.to_owned(),
            destination: "q".to_owned(),
            payload: payload.as_bytes().to_vec(),
            seq: 0,
            attempts: 0,
            ordering_key: key.to_owned(),
            headers: crate::outgoing::Headers::default(),
        }
    }

    #[tokio::test]
    async fn a_key_goes_one_message_a_wave_and_stops_at_its_failure() {
        let messages = vec![
            message("a1", "a", "ok"),
            message("b1", "b", "fail"),
            message("a2", "a", "ok"),
            message("b2", "b", "ok"),
            message("c1", "c", "ok"),
            message("a3", "a", "ok"),
        ];
        let keys = Keys::of(&messages);
        let mut round = Round::new(messages);
        let publisher = Recording::default();
        round.publish(&publisher, &keys).await;
        assert_eq!(
            *publisher.waves.lock().unwrap(),
            [vec!["a1", "b1", "c1"], vec!["a2"], vec!["a3"]]
        );
        let answers: Vec<(usize, &str)> = round
            .answers(&keys)
            .into_iter()
            .map(|(at, answer)| {
                let what = match answer {
                    Answer::Published => "published",
                    Answer::Failed(_) => "failed",
                    Answer::Waiting => "waiting",
                    Answer::Left => "left",
                };
                (at, what)
            })
            .collect();
        assert_eq!(
            answers,
            [
                (0, "published"),
                (1, "failed"),
                (2, "published"),
                (3, "waiting"),
                (4, "published"),
                (5, "published"),
            ]
        );
    }

    #[tokio::test]
    async fn what_was_not_answered_is_left() {
        let messages = vec![message("a1", "a", "ok"), message("a2", "a", "ok")];
        let keys = Keys::of(&messages);
        // The round's time is up before it starts: nothing was handed over.
        let round = Round::new(messages);
        let left = round.answers(&keys);
        assert!(left.iter().all(|(_, a)| matches!(a, Answer::Left)));
    }
}
