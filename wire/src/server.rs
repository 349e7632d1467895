//! The responder's side: [`Server`] admits the requests of one peer.
//!
//! It parses requests, refuses malformed ones ([`ErrorCode::BAD_REQUEST`]), answers
//! [`ErrorCode::BUSY`] at once beyond the per-peer concurrency limit instead of queueing, tracks
//! which requests are being served, turns a `Cancel` into an event so the caller stops
//! sending, and queues the closing `End` or `Error` of each request. Finding the bytes and
//! writing [`Data`] frames is the caller's: [`ServeRequest::resolve`] turns a request into the
//! byte range to send, and [`DataChunks`] cuts a buffer into `Data` messages without copying.
//!
//! A node-wide limit (across peers) is the caller's too: when it is reached, answer with
//! [`Server::fail`] and [`ErrorCode::BUSY`].

use std::collections::{BTreeMap, VecDeque};

use bytes::Bytes;

use crate::client::{Resource, UnexpectedMessage};
use crate::message::{
    check_file_name, ByteRange, Data, End, ErrorCode, ErrorMessage, Limits, Message, Priority,
    RequestId, MAX_DATA_LEN,
};

/// Settings of a [`Server`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServerConfig {
    /// Requests of this peer served at once; more are answered `busy`. At least 1.
    pub max_concurrent: u32,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self { max_concurrent: 8 }
    }
}

/// A request admitted for serving.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServeRequest {
    /// The request id (echo it in every answer).
    pub id: RequestId,
    /// What is asked for.
    pub resource: Resource,
    /// For an expert, the range asked for (`None`: all of it). Always `None` for a manifest,
    /// always `Some` for a file.
    pub range: Option<ByteRange>,
    /// How urgent (map it to the stream's priority).
    pub priority: Priority,
}

impl ServeRequest {
    /// The bytes to send for a resource of `resource_len` bytes, or the `OUT_OF_RANGE` error to
    /// answer with (pass it to [`Server::fail`]).
    pub fn resolve(&self, resource_len: u64) -> Result<ByteRange, (ErrorCode, String)> {
        match self.range {
            None => Ok(ByteRange {
                offset: 0,
                len: resource_len,
            }),
            Some(r) => match r.end() {
                Some(end) if end <= resource_len => Ok(r),
                _ => Err((
                    ErrorCode::OUT_OF_RANGE,
                    format!(
                        "range {}+{} outside {} of {resource_len} bytes",
                        r.offset, r.len, self.resource
                    ),
                )),
            },
        }
    }
}

/// What the caller must act on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ServerEvent {
    /// Serve this request, then call [`Server::complete`] or [`Server::fail`].
    Serve(ServeRequest),
    /// The peer cancelled a request being served: stop sending its data (its slot is already
    /// free; do not call `complete` or `fail`).
    Cancelled(RequestId),
}

/// Counters of a [`Server`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServerStats {
    /// Requests admitted.
    pub admitted: u64,
    /// Requests answered `busy`.
    pub busy: u64,
    /// Requests refused as malformed.
    pub bad: u64,
    /// Requests cancelled by the peer while served.
    pub cancelled: u64,
}

/// The requests of one peer being served. See the module docs.
#[derive(Debug)]
pub struct Server {
    config: ServerConfig,
    active: BTreeMap<RequestId, Resource>,
    transmits: VecDeque<Message>,
    events: VecDeque<ServerEvent>,
    stats: ServerStats,
}

impl Server {
    /// No requests yet. A `max_concurrent` of 0 is taken as 1.
    pub fn new(mut config: ServerConfig) -> Self {
        config.max_concurrent = config.max_concurrent.max(1);
        Self {
            config,
            active: BTreeMap::new(),
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stats: ServerStats::default(),
        }
    }

    /// The limits to announce in this node's [`crate::Hello`] to this peer.
    pub fn limits(&self) -> Limits {
        Limits {
            max_concurrent_requests: self.config.max_concurrent,
        }
    }

    /// Requests being served.
    pub fn active(&self) -> usize {
        self.active.len()
    }

    /// Whether `id` is being served (false once cancelled: stop sending).
    pub fn is_active(&self, id: RequestId) -> bool {
        self.active.contains_key(&id)
    }

    /// Counters.
    pub fn stats(&self) -> ServerStats {
        self.stats
    }

    /// Feeds a message the peer sent on a request path: `Get`, `GetManifest`, `GetFile` or
    /// `Cancel`. A `GetFile` whose name is a path rather than a file name (`..`, `/`, ...) is
    /// answered `bad request` without being admitted.
    /// Any other message is an `Err` (close the connection with
    /// [`ErrorCode::PROTOCOL_VIOLATION`]).
    pub fn handle_message(&mut self, msg: Message) -> Result<(), UnexpectedMessage> {
        let (id, resource, range, priority) = match msg {
            Message::Get(g) => (
                g.request_id,
                Resource::Expert {
                    model: g.model,
                    expert: g.expert,
                },
                g.range,
                g.priority,
            ),
            Message::GetManifest(g) => (
                g.request_id,
                Resource::Manifest { model: g.model },
                None,
                Priority::Now,
            ),
            Message::GetFile(g) => {
                let range = g.range();
                if let Err(why) = check_file_name(&g.name) {
                    // Refused before it is admitted, whatever the caller's file policy.
                    if !self.active.contains_key(&g.request_id) {
                        self.stats.bad += 1;
                        self.answer_error(g.request_id, ErrorCode::BAD_REQUEST, why);
                        return Ok(());
                    }
                }
                (
                    g.request_id,
                    Resource::File {
                        model: g.model,
                        name: g.name,
                    },
                    Some(range),
                    Priority::Now,
                )
            }
            Message::Cancel(c) => {
                if self.active.remove(&c.request_id).is_some() {
                    self.stats.cancelled += 1;
                    self.events.push_back(ServerEvent::Cancelled(c.request_id));
                }
                return Ok(());
            }
            other => return Err(UnexpectedMessage(other.name())),
        };
        if self.active.contains_key(&id) {
            self.stats.bad += 1;
            self.answer_error(
                id,
                ErrorCode::BAD_REQUEST,
                format!("request id {id} in use"),
            );
            return Ok(());
        }
        if let Some(r) = range {
            // Decoded messages were validated already; a hand-built one may not be.
            if r.len == 0 || r.end().is_none() {
                self.stats.bad += 1;
                self.answer_error(
                    id,
                    ErrorCode::BAD_REQUEST,
                    format!("invalid range {}+{}", r.offset, r.len),
                );
                return Ok(());
            }
        }
        if self.active.len() >= self.config.max_concurrent as usize {
            self.stats.busy += 1;
            self.answer_error(
                id,
                ErrorCode::BUSY,
                format!(
                    "serving {} requests of this peer, the limit",
                    self.active.len()
                ),
            );
            return Ok(());
        }
        self.stats.admitted += 1;
        self.active.insert(id, resource.clone());
        self.events.push_back(ServerEvent::Serve(ServeRequest {
            id,
            resource,
            range,
            priority,
        }));
        Ok(())
    }

    fn answer_error(&mut self, id: RequestId, code: ErrorCode, message: String) {
        self.transmits
            .push_back(Message::Error(ErrorMessage::new(Some(id), code, message)));
    }

    /// Every `Data` of `id` was sent: queues its `End` and frees its slot. Returns false (and
    /// queues nothing) if `id` is not active, e.g. cancelled meanwhile.
    pub fn complete(&mut self, id: RequestId) -> bool {
        if self.active.remove(&id).is_none() {
            return false;
        }
        self.transmits
            .push_back(Message::End(End { request_id: id }));
        true
    }

    /// Answers `id` with an error and frees its slot. Returns false (and queues nothing) if
    /// `id` is not active.
    pub fn fail(&mut self, id: RequestId, code: ErrorCode, message: impl Into<String>) -> bool {
        if self.active.remove(&id).is_none() {
            return false;
        }
        self.transmits
            .push_back(Message::Error(ErrorMessage::new(Some(id), code, message)));
        true
    }

    /// The next message to send (`Error` or `End`; route it by [`Message::request_id`]).
    pub fn poll_transmit(&mut self) -> Option<Message> {
        self.transmits.pop_front()
    }

    /// The next request to serve or cancellation.
    pub fn poll_event(&mut self) -> Option<ServerEvent> {
        self.events.pop_front()
    }
}

/// Cuts the bytes of a range into `Data` messages of at most `chunk` bytes, in order, sharing
/// `bytes`' buffer.
#[derive(Debug, Clone)]
pub struct DataChunks {
    id: RequestId,
    offset: u64,
    rest: Bytes,
    chunk: usize,
}

impl DataChunks {
    /// `bytes` are the resource's bytes starting at resource offset `offset`; `chunk` is
    /// clamped to `1..=MAX_DATA_LEN`.
    pub fn new(id: RequestId, offset: u64, bytes: Bytes, chunk: usize) -> Self {
        Self {
            id,
            offset,
            rest: bytes,
            chunk: chunk.clamp(1, MAX_DATA_LEN),
        }
    }
}

impl Iterator for DataChunks {
    type Item = Message;

    fn next(&mut self) -> Option<Message> {
        if self.rest.is_empty() {
            return None;
        }
        let n = self.chunk.min(self.rest.len());
        let bytes = self.rest.split_to(n);
        let offset = self.offset;
        self.offset += n as u64;
        Some(Message::Data(Data {
            request_id: self.id,
            offset,
            bytes,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::GetFile;
    use stormo_ids::Hash;

    fn get_file(id: u64, name: &str) -> Message {
        Message::GetFile(GetFile {
            request_id: RequestId(id),
            model: Hash([1; 32]),
            name: name.into(),
            offset: 0,
            len: 10,
        })
    }

    #[test]
    fn file_names_that_are_paths_are_refused_unadmitted() {
        let mut s = Server::new(ServerConfig::default());
        for (i, name) in ["..", "../config.json", "/etc/passwd", "a/b", "a\\b", ""]
            .into_iter()
            .enumerate()
        {
            s.handle_message(get_file(i as u64, name)).unwrap();
            assert_eq!(s.poll_event(), None, "{name:?} admitted");
            match s.poll_transmit() {
                Some(Message::Error(e)) => {
                    assert_eq!(e.request_id, Some(RequestId(i as u64)));
                    assert_eq!(e.code, ErrorCode::BAD_REQUEST, "{name:?}");
                }
                other => panic!("{name:?}: {other:?}"),
            }
        }
        assert_eq!(s.active(), 0);
        assert_eq!(s.stats().bad, 6);
        // A plain name is admitted with its range.
        s.handle_message(get_file(9, "config.json")).unwrap();
        let Some(ServerEvent::Serve(req)) = s.poll_event() else {
            panic!("not admitted")
        };
        assert_eq!(
            req.resource,
            Resource::File {
                model: Hash([1; 32]),
                name: "config.json".into()
            }
        );
        assert_eq!(req.range, Some(ByteRange { offset: 0, len: 10 }));
        assert_eq!(req.resolve(5).unwrap_err().0, ErrorCode::OUT_OF_RANGE);
        assert_eq!(req.resolve(10).unwrap(), ByteRange { offset: 0, len: 10 });
    }
}
