//! A message as the write-ahead log carries it: the payload of one logical decoding message
//! (`pg_logical_emit_message`), written in the job's transaction by a store that sends its
//! outbox through the WAL, read back by the WAL relay.
//!
//! The frame holds what an outbox row holds, so that a message parked by the WAL relay becomes
//! that row: a version byte, then the id, the destination, the scope, the job's key, the
//! ordering key and the headers (JSON, empty for none), each as a big-endian `u32` length and
//! its bytes, the message's position as a `u32`, then the payload, the rest of the frame.
//! Lengths rather than a text format: the payload is bytes, and nothing needs escaping.

use super::{Headers, Message};

/// The frame's first byte. A relay refuses a frame of another version with an error naming
/// it, rather than guessing at its fields.
const VERSION: u8 = 1;

/// A message read back from its frame, with the columns of its outbox row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Framed {
    pub(crate) message: Message,
    pub(crate) scope: String,
    pub(crate) key: String,
}

/// `message`, of the job `key` in `scope`, as one frame.
pub(crate) fn encode(scope: &str, key: &str, message: &Message) -> Vec<u8> {
    let headers = message.headers.to_json().unwrap_or_default();
    let fields = [
        message.id.as_str(),
        message.destination.as_str(),
        scope,
        key,
        message.ordering_key.as_str(),
        headers.as_str(),
    ];
    let size = 1 + 4 * 7 + fields.iter().map(|f| f.len()).sum::<usize>() + message.payload.len();
    let mut frame = Vec::with_capacity(size);
    frame.push(VERSION);
    for field in fields {
        // Every field is bounded far below 4 GiB (a message's payload by `MAX_PAYLOAD`, the
        // others by their own limits), so its length fits.
        frame.extend_from_slice(&(field.len() as u32).to_be_bytes());
        frame.extend_from_slice(field.as_bytes());
    }
    frame.extend_from_slice(&message.seq.to_be_bytes());
    frame.extend_from_slice(&message.payload);
    frame
}

/// The message `frame` holds; why not, when it is not one this version wrote.
pub(crate) fn decode(frame: &[u8]) -> Result<Framed, String> {
    let (&version, mut rest) = frame.split_first().ok_or("an empty frame")?;
    if version != VERSION {
        return Err(format!(
            "a frame of version {version}, where this relay reads version {VERSION}: run the \
             relay of the idem that wrote it"
        ));
    }
    let mut reader = Reader {
        rest,
        whole: frame.len(),
    };
    let id = reader.text()?;
    let destination = reader.text()?;
    let scope = reader.text()?;
    let key = reader.text()?;
    let ordering_key = reader.text()?;
    let headers = reader.text()?;
    let seq = reader.u32()?;
    rest = reader.rest;
    let payload = rest.to_vec();
    let headers = match headers.is_empty() {
        true => Headers::default(),
        false => Headers::from_json(Some(&headers)).map_err(|e| format!("its headers: {e}"))?,
    };
    Ok(Framed {
        message: Message {
            id,
            destination,
            payload,
            seq,
            attempts: 0,
            ordering_key,
            headers,
        },
        scope,
        key,
    })
}

/// The fields of a frame, read in their order.
struct Reader<'a> {
    rest: &'a [u8],
    /// The frame's length, for the error of one cut short.
    whole: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if self.rest.len() < n {
            return Err(format!("a frame cut short ({} bytes)", self.whole));
        }
        let (field, after) = self.rest.split_at(n);
        self.rest = after;
        Ok(field)
    }

    fn u32(&mut self) -> Result<u32, String> {
        Ok(u32::from_be_bytes(
            self.take(4)?.try_into().expect("four bytes"),
        ))
    }

    fn text(&mut self) -> Result<String, String> {
        let len = self.u32()? as usize;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| "a field that is not UTF-8".to_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: &[u8], headers: Headers) -> Message {
        Message {
            id: "job:orders:k:0".to_owned(),
            destination: "emails".to_owned(),
            payload: payload.to_vec(),
            seq: 7,
            attempts: 0,
            ordering_key: "customer-1".to_owned(),
            headers,
        }
    }

    #[test]
    fn a_frame_reads_back_as_the_message_it_was() {
        for (payload, headers) in [
            (&b"{\"to\":\"a@b\"}"[..], Headers::json()),
            (&b""[..], Headers::default()),
            (&[0u8, 255, 0, 1][..], Headers::default()),
        ] {
            let sent = message(payload, headers);
            let frame = encode("orders", "k\u{e9}", &sent);
            let read = decode(&frame).expect("a frame of this version");
            assert_eq!(read.message, sent);
            assert_eq!(
                (read.scope.as_str(), read.key.as_str()),
                ("orders", "k\u{e9}")
            );
        }
    }

    #[test]
    fn a_cut_or_foreign_frame_is_refused_with_what_it_is() {
        let frame = encode("s", "k", &message(b"payload", Headers::json()));
        for cut in 0..frame.len() - b"payload".len() {
            assert!(decode(&frame[..cut]).is_err(), "cut at {cut}");
        }
        let mut foreign = frame.clone();
        foreign[0] = 9;
        let error = decode(&foreign).unwrap_err();
        assert!(error.contains("version 9"), "{error}");
    }
}
