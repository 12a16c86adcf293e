//! Exports: local publishes matching the export filters go out.
//!
//! Each export filter is a *tap*: a hidden stream subscription on the bus
//! (not interest, not counted as a subscription), whose bounded mailbox
//! drops its oldest message when the export task falls behind; so a local
//! publisher never waits for the network, and what the tap drops is
//! counted. One task reads every tap, encodes, and sends. A topic matched
//! by several export filters goes out once, through the first of them, its
//! *owning* tap (so the messages of one topic keep their order through one
//! tap). Messages that came in through a bridge are never sent out again.
//!
//! While the connection is down, messages wait in an outgoing buffer of
//! `outgoing_buffer` messages (the oldest dropped and counted beyond that),
//! sent in order once the connection is back.
//!
//! # Counting losses once
//! Overlapping export filters (`a/#` and `#`) put one message in several
//! taps, and each tap drops from its own mailbox independently. Only the
//! *owning* tap (the first export filter matching the topic) ever sends a
//! message, so the message is lost exactly when its owning tap drops it:
//! each tap's `lost()` counts only the messages it owns (the mailbox asks
//! [`owner`] about each message it drops, in the push that drops it: a
//! publish that drops nothing never asks), and a copy another tap owns, or
//! an imported message (never sent), is no loss wherever it goes. So every accepted export ends up counted once, in
//! `sent` or `dropped`.
//!
//! # Closing
//! On stop, each tap is closed (a publish from then on is refused by it,
//! and counted as lost if the tap owns it), and what it still holds is
//! taken: sent if the connection is up (for up to 2 s: a client whose
//! queue stays full must not hold the close), else counted as dropped; then the
//! taps' final `lost()` growth is added. A publish that passed the tap's
//! closed check an instant before the close but lands after the last read
//! is the one loss this cannot see.

use std::collections::VecDeque;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::Arc;
use std::task::Poll;
use std::time::Duration;

use futures_core::Stream;
use tokio::sync::Notify;

use super::codec::{encode_caught, Codec};
use super::stats::Counters;
use super::transport::{Outgoing, SendError, Transport};

/// How long a closing exporter goes on sending what it holds.
const CLOSING_FLUSH: Duration = Duration::from_secs(2);
use crate::handles::Receiver;
use crate::message::Message;
use crate::registry::mailbox::Owns;
use crate::topic::matches;

pub(crate) struct Exporter<T> {
    pub(crate) taps: Vec<Receiver<T>>,
    pub(crate) exports: Arc<[Arc<str>]>,
    pub(crate) codec: Arc<dyn Codec<T>>,
    pub(crate) transport: Arc<dyn Transport>,
    pub(crate) stats: Arc<Counters>,
    pub(crate) outgoing_buffer: usize,
    /// Woken when the connection comes back.
    pub(crate) wake: Arc<Notify>,
    pub(crate) stop: Arc<Notify>,
}

impl<T: Send + Sync + 'static> Exporter<T> {
    pub(crate) async fn run(mut self) {
        let mut outbox: VecDeque<Outgoing> = VecDeque::new();
        // Set when the stop is seen: what is sent from then on is sent
        // before it (`CLOSING_FLUSH` in all).
        let mut closing: Option<tokio::time::Instant> = None;
        let mut lost_seen = vec![0u64; self.taps.len()];
        let mut next_tap = 0;
        loop {
            let next = {
                let taps = &mut self.taps;
                let start = next_tap;
                let wait_for_message = poll_fn(|cx| {
                    let n = taps.len();
                    let mut ended = 0;
                    for k in 0..n {
                        let i = (start + k) % n;
                        match Pin::new(&mut taps[i]).poll_next(cx) {
                            Poll::Ready(Some(message)) => return Poll::Ready(Some((i, message))),
                            Poll::Ready(None) => ended += 1,
                            Poll::Pending => {}
                        }
                    }
                    if n > 0 && ended == n {
                        Poll::Ready(None)
                    } else {
                        Poll::Pending
                    }
                });
                let retry = async {
                    if outbox.is_empty() {
                        std::future::pending::<()>().await;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                };
                tokio::select! {
                    biased;
                    () = self.stop.notified() => break,
                    () = self.wake.notified() => Next::Flush,
                    () = retry => Next::Flush,
                    message = wait_for_message => match message {
                        Some((i, message)) => Next::Message(i, message),
                        None => break,
                    },
                }
            };
            let stopped = match next {
                Next::Flush => !self.flush(&mut outbox, &mut closing).await,
                Next::Message(i, message) => {
                    next_tap = (i + 1) % self.taps.len();
                    self.count_lost(i, &mut lost_seen);
                    match self.outgoing(i, &message) {
                        Some(outgoing) => {
                            self.push(&mut outbox, outgoing);
                            !self.flush(&mut outbox, &mut closing).await
                        }
                        None => false,
                    }
                }
            };
            if stopped {
                break;
            }
        }
        // Closing: what the taps hold was accepted; send it (for at most
        // `CLOSING_FLUSH`: a client whose queue stays full, its link
        // stalled, must not hold the close) or count it.
        let deadline = closing.unwrap_or_else(|| tokio::time::Instant::now() + CLOSING_FLUSH);
        let mut sending = true;
        for i in 0..self.taps.len() {
            self.taps[i].close_tap();
            while let Ok(message) = self.taps[i].try_recv() {
                if let Some(outgoing) = self.outgoing(i, &message) {
                    self.push(&mut outbox, outgoing);
                    if sending && self.transport.connected() {
                        sending = self.flush_until(deadline, &mut outbox).await;
                    }
                }
            }
            self.count_lost(i, &mut lost_seen);
        }
        if sending && self.transport.connected() {
            self.flush_until(deadline, &mut outbox).await;
        }
        Counters::add(&self.stats.dropped, outbox.len() as u64);
    }

    /// [`Self::flush`] until `deadline`; false once it has passed.
    async fn flush_until(
        &self,
        deadline: tokio::time::Instant,
        outbox: &mut VecDeque<Outgoing>,
    ) -> bool {
        tokio::time::timeout_at(deadline, self.flush(outbox, &mut Some(deadline)))
            .await
            .is_ok()
    }

    /// Adds tap `i`'s losses since the last look to `dropped`.
    fn count_lost(&self, i: usize, lost_seen: &mut [u64]) {
        let lost = self.taps[i].lost();
        if lost > lost_seen[i] {
            Counters::add(&self.stats.dropped, lost - lost_seen[i]);
            lost_seen[i] = lost;
        }
    }

    /// The message to send for a tap's delivery, if this tap owns it.
    fn outgoing(&self, tap: usize, message: &Message<T>) -> Option<Outgoing> {
        if !owns(&self.exports, tap, message) {
            return None;
        }
        let topic = message.topic();
        match encode_caught(&*self.codec, message.data()) {
            Ok(payload) => Some(Outgoing {
                topic: Arc::from(topic),
                payload,
                metadata: message.metadata().cloned(),
            }),
            Err(error) => {
                Counters::add(&self.stats.dropped, 1);
                tracing::warn!(%topic, %error, "bridge: a value that does not encode; not sent");
                None
            }
        }
    }

    fn push(&self, outbox: &mut VecDeque<Outgoing>, outgoing: Outgoing) {
        if outbox.len() >= self.outgoing_buffer {
            outbox.pop_front();
            Counters::add(&self.stats.dropped, 1);
        }
        outbox.push_back(outgoing);
    }

    /// Sends the buffered messages in order while the connection is up;
    /// false if `stop` came meanwhile (the client's queue may stay full,
    /// its link stalled: that must not keep the bridge from closing).
    /// Cancel-safe: a message leaves the outbox once the transport has it.
    async fn flush(
        &self,
        outbox: &mut VecDeque<Outgoing>,
        closing: &mut Option<tokio::time::Instant>,
    ) -> bool {
        let mut stopping = false;
        while let Some(outgoing) = outbox.front() {
            if stopping || !self.transport.connected() {
                return !stopping;
            }
            let sent = {
                let publish = self.transport.publish(outgoing);
                tokio::pin!(publish);
                // The publish first: `stop` is looked at (and its waiter
                // registered) only while the publish waits. Stopping, the
                // hand-off under way may still finish until `closing` (a
                // client may take a message just as its waiting send is
                // dropped, flume's, and the bridge would not know it went);
                // the rest of the closing shares that deadline.
                tokio::select! {
                    biased;
                    sent = &mut publish => sent,
                    () = self.stop.notified() => {
                        stopping = true;
                        let deadline = *closing
                            .get_or_insert_with(|| tokio::time::Instant::now() + CLOSING_FLUSH);
                        match tokio::time::timeout_at(deadline, &mut publish).await {
                            Ok(sent) => sent,
                            Err(_) => return false,
                        }
                    }
                }
            };
            match sent {
                Ok(()) => {
                    if !self.transport.counts_sent() {
                        Counters::add(&self.stats.sent, 1);
                    }
                    outbox.pop_front();
                }
                Err(SendError::Disconnected) => return !stopping,
                Err(SendError::Refused(reason)) => {
                    Counters::add(&self.stats.dropped, 1);
                    tracing::warn!(topic = %outgoing.topic, %reason, "bridge: the engine would refuse this message; dropped");
                    outbox.pop_front();
                }
            }
        }
        !stopping
    }
}

/// Whether tap number `tap` (of the export filters `exports`, in order) is
/// the one that sends `message`: no earlier export filter matches its
/// topic, and it did not come in through a bridge. Called for the tap's
/// messages only, which match its own filter.
fn owns<T>(exports: &[Arc<str>], tap: usize, message: &Message<T>) -> bool {
    !message.is_imported() && !exports[..tap].iter().any(|e| matches(e, message.topic()))
}

/// [`owns`] for tap number `tap`, as its mailbox asks it about each message
/// it drops: its losses then count only what it would have sent.
pub(crate) fn owner<T: 'static>(exports: Arc<[Arc<str>]>, tap: usize) -> Owns<T> {
    Box::new(move |message| owns(&exports, tap, message))
}

enum Next<T> {
    Flush,
    Message(usize, Arc<Message<T>>),
}
