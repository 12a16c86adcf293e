//! The NATS transport, on the `async-nats` client.
//!
//! - Subjects come from `mapping.rs`; metadata travels as NATS headers
//!   (escaped, see `mapping::escape_header`), and the sending node's id as
//!   the header [`ORIGIN_HEADER`], so a node drops its own messages even if
//!   the server ignored `no_echo` (which is set too).
//! - Reconnects: the client reconnects by itself, after a jittered
//!   exponential delay (`backoff.rs`), forever; it
//!   restores every subscription it holds, and the bridge holds exactly the
//!   subscriptions of its table. Connection events are counted and wake the
//!   export task, which then sends what it buffered while disconnected.
//! - Slow consumers (the client's buffer for a subscription full) are
//!   counted; each is a dropped message.
//! - A message whose subject or size the server would refuse (and close the
//!   connection for) is refused here instead, and counted as dropped. The
//!   size is the payload and its headers (origin and metadata) together,
//!   as the server counts it against its `max_payload`; NATS puts no limit
//!   of its own on one header.

use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event, HeaderMap, HeaderName, HeaderValue};
use tokio::sync::Notify;
use tokio::task::JoinHandle;

use super::backoff::Backoff;
use super::mapping::{
    escape_header, filter_to_subjects, subject_to_topic, topic_to_subject, unescape_header,
};
use super::stats::Counters;
use super::transport::{BoxFuture, Deliver, Incoming, Outgoing, SendError, Transport, Upstream};
use crate::message::Metadata;

/// The header that carries the sending node's id.
pub(crate) const ORIGIN_HEADER: &str = "Blazesub-Origin";

/// The longest subject the bridge sends or subscribes to: nats-server's
/// default `max_control_line` is 4 KiB, and a longer protocol line makes it
/// close the connection.
const MAX_SUBJECT: usize = 3_900;

pub(crate) struct Nats {
    client: Client,
    origin: String,
}

pub(crate) struct Settings {
    pub(crate) url: String,
    pub(crate) name: String,
    pub(crate) origin: String,
    pub(crate) backoff: Backoff,
    pub(crate) subscription_capacity: usize,
}

impl Nats {
    /// Connects (in the background: a server that is not up yet is retried
    /// with the backoff, and the bridge works once it is).
    pub(crate) async fn connect(
        settings: Settings,
        stats: Arc<Counters>,
        wake: Arc<Notify>,
    ) -> Result<Self, String> {
        let events = Arc::clone(&stats);
        let backoff = settings.backoff;
        let options = ConnectOptions::new()
            .name(settings.name)
            .no_echo()
            .retry_on_initial_connect()
            .max_reconnects(None)
            .subscription_capacity(settings.subscription_capacity)
            .reconnect_delay_callback(move |attempt| backoff.delay(attempt))
            .event_callback(move |event| {
                on_event(&events, &wake, event);
                async {}
            });
        let servers = settings
            .url
            .split(',')
            .map(|url| async_nats::ServerAddr::from_str(url.trim()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        let client = options.connect(servers).await.map_err(|e| e.to_string())?;
        Ok(Self {
            client,
            origin: settings.origin,
        })
    }
}

fn on_event(stats: &Counters, wake: &Notify, event: Event) {
    match event {
        Event::Connected => {
            Counters::add(&stats.connects, 1);
            tracing::info!("bridge connected to NATS");
            wake.notify_one();
        }
        Event::Disconnected => tracing::warn!("bridge disconnected from NATS; reconnecting"),
        Event::SlowConsumer(sid) => {
            Counters::add(&stats.slow_consumers, 1);
            Counters::add(&stats.dropped, 1);
            tracing::warn!(sid, "NATS slow consumer: the bridge dropped a message");
        }
        Event::ServerError(error) => tracing::warn!(%error, "NATS server error"),
        Event::ClientError(error) => tracing::warn!(%error, "NATS client error"),
        other => tracing::debug!(event = %other, "NATS event"),
    }
}

struct NatsUpstream(Vec<JoinHandle<()>>);

impl Upstream for NatsUpstream {}

impl Drop for NatsUpstream {
    fn drop(&mut self) {
        // Dropping the task drops its subscriber, which unsubscribes.
        for task in &self.0 {
            task.abort();
        }
    }
}

impl Transport for Nats {
    fn publish<'a>(&'a self, message: &'a Outgoing) -> BoxFuture<'a, Result<(), SendError>> {
        Box::pin(async move {
            let subject = topic_to_subject(&message.topic);
            if subject.len() > MAX_SUBJECT {
                return Err(SendError::Refused(format!(
                    "its subject is {} bytes, over the {MAX_SUBJECT} a NATS server accepts",
                    subject.len()
                )));
            }
            let headers = headers(&self.origin, message.metadata.as_ref());
            // The server holds the whole HPUB body, headers and payload, to
            // `max_payload`, and closes the connection over it.
            let max = self.client.server_info().max_payload;
            let size = encoded_len(&headers) + message.payload.len();
            if max > 0 && size > max {
                return Err(SendError::Refused(format!(
                    "its payload of {} bytes with its headers is {size} bytes, over the server's max_payload of {max}",
                    message.payload.len()
                )));
            }
            self.client
                .publish_with_headers(subject, headers, message.payload.clone())
                .await
                .map_err(|_| SendError::Disconnected)
        })
    }

    fn subscribe<'a>(
        &'a self,
        filter: &'a str,
        deliver: Deliver,
    ) -> BoxFuture<'a, Result<Box<dyn Upstream>, String>> {
        Box::pin(async move {
            let mut tasks = NatsUpstream(Vec::new());
            for subject in filter_to_subjects(filter) {
                if subject.len() > MAX_SUBJECT {
                    return Err(format!(
                        "its subject is {} bytes, over the {MAX_SUBJECT} a NATS server accepts",
                        subject.len()
                    ));
                }
                let mut subscriber = self
                    .client
                    .subscribe(subject)
                    .await
                    .map_err(|e| e.to_string())?;
                let deliver = Arc::clone(&deliver);
                tasks.0.push(tokio::spawn(async move {
                    loop {
                        let next = std::future::poll_fn(|cx| {
                            futures_core::Stream::poll_next(Pin::new(&mut subscriber), cx)
                        })
                        .await;
                        match next {
                            Some(message) => deliver(incoming(message)),
                            None => break,
                        }
                    }
                }));
            }
            Ok(Box::new(tasks) as Box<dyn Upstream>)
        })
    }

    fn connected(&self) -> bool {
        self.client.connection_state() == async_nats::connection::State::Connected
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            if self.connected() {
                let _ = tokio::time::timeout(Duration::from_secs(2), self.client.flush()).await;
            }
            let _ = tokio::time::timeout(Duration::from_secs(2), self.client.drain()).await;
        })
    }
}

fn headers(origin: &str, metadata: Option<&Metadata>) -> HeaderMap {
    let mut headers = HeaderMap::new();
    headers.insert(ORIGIN_HEADER, origin);
    for (key, value) in metadata.into_iter().flat_map(Metadata::iter) {
        let name = if key.eq_ignore_ascii_case(ORIGIN_HEADER) {
            // As it is, it would stand for (and replace) the origin: its
            // first character escaped, which `unescape_header` undoes. (It
            // is ASCII, as the header's name is.)
            format!(
                "%{:02X}{}",
                key.as_bytes()[0],
                escape_header(&key[1..], true)
            )
        } else {
            escape_header(key, true)
        };
        let value = escape_header(value, false);
        if let (Ok(name), Ok(value)) = (HeaderName::from_str(&name), HeaderValue::from_str(&value))
        {
            headers.insert(name, value);
        }
    }
    headers
}

/// The size of `headers` on the wire, as async-nats writes them: a version
/// line, one `name: value` line per value, and an empty line.
fn encoded_len(headers: &HeaderMap) -> usize {
    const VERSION_LINE: usize = "NATS/1.0\r\n".len();
    const END: usize = "\r\n".len();
    let lines: usize = headers
        .iter()
        .map(|(name, values)| {
            let name: &str = name.as_ref();
            values
                .iter()
                .map(|value| name.len() + ": ".len() + value.as_str().len() + END)
                .sum::<usize>()
        })
        .sum();
    VERSION_LINE + lines + END
}

fn incoming(message: async_nats::Message) -> Incoming {
    let raw_subject = message.subject.to_string();
    let mut origin = None;
    let mut metadata = None;
    if let Some(headers) = &message.headers {
        for (name, values) in headers.iter() {
            let name: &str = name.as_ref();
            let Some(value) = values.last() else { continue };
            if name.eq_ignore_ascii_case(ORIGIN_HEADER) {
                origin = Some(value.as_str().to_owned());
            } else {
                metadata
                    .get_or_insert_with(Metadata::new)
                    .insert(unescape_header(name), unescape_header(value.as_str()));
            }
        }
    }
    Incoming {
        topic: subject_to_topic(&raw_subject),
        raw_subject,
        payload: message.payload,
        metadata,
        origin,
    }
}
