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
//! - **Imports are lost only where they are counted.** async-nats hands
//!   each subscription's messages to a channel of its own and, when that
//!   channel is full, drops the message and reports it through an event
//!   channel of 128 that it fills with `try_send`: a burst loses most such
//!   reports (a current-thread runtime, whose connection task reads a
//!   burst in a few large polls, counted 128 of 133,441 drops). So the
//!   client's channel is made too large to fill ([`CLIENT_CHANNEL`]; tokio
//!   allocates its channels as they fill, not up front), and a reader per
//!   subscription does nothing but move every message it holds, without
//!   decoding it, into the bridge's own bounded queue for the local filter
//!   (`import.rs`), where what does not fit is dropped and counted exactly,
//!   as a slow consumer. The reader runs outside tokio's cooperative budget
//!   and moves up to [`MOVES_PER_POLL`] messages each time it runs, then
//!   lets the worker's other tasks have a turn and runs again, so the
//!   channel holds about what the connection task read since the reader
//!   last ran. That is bounded by the client's reads, not by how far local
//!   delivery lags: the reader is woken by the first message and runs once
//!   the connection task's poll ends, and a poll reads at most 128 times
//!   its 64 KiB buffer. It can still be much: a burst of 400,000 small
//!   messages to a node on two workers had up to 259,536 in the channel at
//!   once, which the old channel of 65,536 would have dropped, most
//!   uncounted. (The client's
//!   slow-consumer events are still counted, should one ever come.)
//! - **At close** each reader drains its subscription: the client sends
//!   the server an UNSUB, keeps handing the reader what it reads for the
//!   subscription until its next poll, then forgets it and ends the
//!   channel; the reader hands on everything until that end, which the
//!   closing bridge counts as dropped. What the server sent after that
//!   (it had not read the UNSUB yet) is the at-most-once gap, counted
//!   nowhere: the client drops a message for a subscription it no longer
//!   has, and async-nats offers no wait for the server's answer to the
//!   PING it sends after the UNSUB, which would close the gap. (Drain, not
//!   `unsubscribe`, which ends the channel at once: closing a node during a
//!   400,000-message stream left 0–109,418 uncounted in six runs, against
//!   22,576–198,284 in five.) An upstream subscription dropped while the
//!   bridge runs (its local filter lost its last subscriber) drops what its
//!   channel holds uncounted: it would have reached no subscriber.
//! - A message whose subject or size the server would refuse (and close the
//!   connection for) is refused here instead, and counted as dropped. The
//!   size is the payload and its headers (origin and metadata) together,
//!   as the server counts it against its `max_payload`; NATS puts no limit
//!   of its own on one header.

use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use async_nats::{Client, ConnectOptions, Event, HeaderMap, HeaderName, HeaderValue, Subscriber};
use futures_core::Stream;
use tokio::sync::{oneshot, Notify};
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::backoff::Backoff;
use super::mapping::{
    escape_header, filter_to_subjects, subject_to_topic, topic_to_subject, unescape_header,
};
use super::stats::Counters;
use super::transport::{
    Arrival, BoxFuture, Deliver, Incoming, Outgoing, SendError, Transport, Upstream,
};
use crate::message::Metadata;

/// The header that carries the sending node's id.
pub(crate) const ORIGIN_HEADER: &str = "Blazesub-Origin";

/// The longest subject the bridge sends or subscribes to: nats-server's
/// default `max_control_line` is 4 KiB, and a longer protocol line makes it
/// close the connection.
const MAX_SUBJECT: usize = 3_900;

/// The capacity of the client's channel for each subscription: more than
/// memory holds, so the client never drops a message there (see the module
/// docs). Well under tokio's limit for a bounded channel (`usize::MAX >>
/// 3`), which `tokio::sync::mpsc::channel` asserts.
const CLIENT_CHANNEL: usize = 1 << 28;

/// How long a reader waits, at close, for the client to end its
/// subscription: the client reads no command while it reconnects.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

pub(crate) struct Nats {
    client: Client,
    origin: String,
}

pub(crate) struct Settings {
    pub(crate) url: String,
    pub(crate) name: String,
    pub(crate) origin: String,
    pub(crate) backoff: Backoff,
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
            .subscription_capacity(CLIENT_CHANNEL)
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
        // Not expected (the channel is sized never to fill); counted if it
        // comes, though a burst of them would lose some (see module docs).
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

/// One upstream subscription: a reader per subject (two for a filter
/// ending in `/#`).
struct NatsUpstream(Vec<Reader>);

struct Reader {
    task: JoinHandle<()>,
    /// Sent when the bridge closes: the reader drains and hands on
    /// what the client holds. Dropped unsent, the reader is aborted.
    close: oneshot::Sender<()>,
}

impl Upstream for NatsUpstream {
    fn close(mut self: Box<Self>) -> BoxFuture<'static, ()> {
        // Taken, so the drop below aborts nothing.
        let readers = std::mem::take(&mut self.0);
        let tasks: Vec<JoinHandle<()>> = readers
            .into_iter()
            .map(|reader| {
                // Err: the reader has ended (its subscription ended).
                let _ = reader.close.send(());
                reader.task
            })
            .collect();
        Box::pin(async move {
            for task in tasks {
                // Err only if the runtime is shutting down.
                let _ = task.await;
            }
        })
    }
}

impl Drop for NatsUpstream {
    fn drop(&mut self) {
        // Dropping the task drops its subscriber, which unsubscribes; what
        // its channel holds would reach no local subscriber.
        for reader in &self.0 {
            reader.task.abort();
        }
    }
}

/// Moves every message the client hands `subscriber` to `deliver` until
/// the bridge closes or the client ends the subscription.
async fn read(mut subscriber: Subscriber, deliver: Deliver, mut close: oneshot::Receiver<()>) {
    // Outside tokio's budget (128 polls a turn, then `Pending`), or the
    // reader would move 128 messages a turn while the connection task adds
    // tens of thousands, and the channel would grow with the burst; its own
    // limit per poll (`MOVES_PER_POLL`) is what keeps a turn short.
    let closing = tokio::task::coop::unconstrained(std::future::poll_fn(|cx| {
        match Pin::new(&mut close).poll(cx) {
            Poll::Ready(Ok(())) => return Poll::Ready(true),
            // Dropped unsent: the task is being aborted.
            Poll::Ready(Err(_)) => return Poll::Ready(false),
            Poll::Pending => {}
        }
        match hand_on_ready(&mut subscriber, &deliver, cx, MOVES_PER_POLL) {
            Poll::Ready(()) => Poll::Ready(false),
            Poll::Pending => Poll::Pending,
        }
    }))
    .await;
    if !closing {
        return;
    }
    // The client ends the channel when it forgets the subscription (see the
    // module docs), and reading ends once it is empty. An error means the
    // client has stopped, and its end of the channel is gone with it:
    // reading ends the same way.
    let deadline = Instant::now() + CLOSE_WAIT;
    if let Ok(Err(error)) = tokio::time::timeout_at(deadline, subscriber.drain()).await {
        tracing::debug!(%error, "bridge: NATS drain at close");
    }
    let rest = tokio::task::coop::unconstrained(std::future::poll_fn(|cx| {
        hand_on_ready(&mut subscriber, &deliver, cx, MOVES_PER_POLL)
    }));
    if tokio::time::timeout_at(deadline, rest).await.is_err() {
        // The client did not end the channel within `CLOSE_WAIT`: it takes
        // no command while it reconnects, and reads nothing from the server
        // then either. Hand on what the channel holds now; dropping the
        // subscriber closes it and unsubscribes.
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let _ = hand_on_ready(&mut subscriber, &deliver, &mut cx, usize::MAX);
        tracing::warn!("bridge: NATS client unresponsive at close; unsubscribing without it");
    }
}

/// The most messages a reader moves in one poll before it lets the
/// worker's other tasks run: moving one costs about a quarter of a
/// microsecond, so our part of a turn ends within a millisecond or two.
/// Emptying the channel in one poll, as the reader did first, ran for up
/// to 114 ms in a burst of 400,000 messages while the connection task on
/// the other worker kept adding to it. (A task beside it still sees gaps
/// of that order in such a burst: async-nats's connection task reads it in
/// large polls of its own.)
const MOVES_PER_POLL: usize = 4_096;

/// Hands what `subscriber` holds now to `deliver`, up to `limit` messages;
/// `Ready` once the subscription has ended and nothing is left. Past
/// `limit` it wakes its task again and returns `Pending`, so the task runs
/// again after the worker's other tasks had their turn.
fn hand_on_ready<S>(
    subscriber: &mut S,
    deliver: &Deliver,
    cx: &mut Context<'_>,
    limit: usize,
) -> Poll<()>
where
    S: Stream<Item = async_nats::Message> + Unpin,
{
    for _ in 0..limit {
        match Pin::new(&mut *subscriber).poll_next(cx) {
            Poll::Ready(Some(message)) => deliver(Arrival::Nats(message)),
            Poll::Ready(None) => return Poll::Ready(()),
            Poll::Pending => return Poll::Pending,
        }
    }
    cx.waker().wake_by_ref();
    Poll::Pending
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
            let mut upstream = NatsUpstream(Vec::new());
            for subject in filter_to_subjects(filter) {
                if subject.len() > MAX_SUBJECT {
                    return Err(format!(
                        "its subject is {} bytes, over the {MAX_SUBJECT} a NATS server accepts",
                        subject.len()
                    ));
                }
                let subscriber = self
                    .client
                    .subscribe(subject)
                    .await
                    .map_err(|e| e.to_string())?;
                let (close, closing) = oneshot::channel();
                let task = tokio::spawn(read(subscriber, Arc::clone(&deliver), closing));
                upstream.0.push(Reader { task, close });
            }
            Ok(Box::new(upstream) as Box<dyn Upstream>)
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

/// A message as the client gave it, decoded (in the import's delivery
/// task, not the reader: see [`Arrival`]).
pub(crate) fn incoming(message: async_nats::Message) -> Incoming {
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

#[cfg(test)]
mod tests {
    use std::pin::Pin;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Context, Poll, Wake, Waker};

    use futures_core::Stream;

    use super::{hand_on_ready, Arrival, Deliver, MOVES_PER_POLL};

    /// A subscription the connection task keeps feeding: `left` messages
    /// ready, then nothing for now.
    struct Flood {
        left: usize,
    }

    impl Stream for Flood {
        type Item = async_nats::Message;

        fn poll_next(mut self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            if self.left == 0 {
                return Poll::Pending;
            }
            self.left -= 1;
            Poll::Ready(Some(async_nats::Message {
                subject: "s".into(),
                reply: None,
                payload: Default::default(),
                headers: None,
                status: None,
                description: None,
                length: 0,
            }))
        }
    }

    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn a_reader_moves_a_bounded_number_per_poll_and_runs_again() {
        let moved = Arc::new(AtomicUsize::new(0));
        let deliver: Deliver = {
            let moved = Arc::clone(&moved);
            Arc::new(move |arrival| {
                assert!(matches!(arrival, Arrival::Nats(_)));
                moved.fetch_add(1, Ordering::SeqCst);
            })
        };
        let wakes = Arc::new(Wakes(AtomicUsize::new(0)));
        let waker = Waker::from(Arc::clone(&wakes));
        let mut cx = Context::from_waker(&waker);
        let mut flood = Flood { left: 100_000 };

        let first = hand_on_ready(&mut flood, &deliver, &mut cx, MOVES_PER_POLL);
        assert!(first.is_pending());
        assert_eq!(
            moved.load(Ordering::SeqCst),
            MOVES_PER_POLL,
            "one poll moved the whole flood"
        );
        assert_eq!(
            wakes.0.load(Ordering::SeqCst),
            1,
            "a reader that stopped early must run again"
        );

        // Polled again until the flood is moved: nothing lost on the way.
        let mut polls = 1;
        while flood.left > 0 {
            let _ = hand_on_ready(&mut flood, &deliver, &mut cx, MOVES_PER_POLL);
            polls += 1;
        }
        assert_eq!(moved.load(Ordering::SeqCst), 100_000);
        assert_eq!(polls, 100_000usize.div_ceil(MOVES_PER_POLL));
        // Drained and waiting for more: no wake of its own.
        let wakes_before = wakes.0.load(Ordering::SeqCst);
        assert!(hand_on_ready(&mut flood, &deliver, &mut cx, MOVES_PER_POLL).is_pending());
        assert_eq!(wakes.0.load(Ordering::SeqCst), wakes_before);
    }
}
