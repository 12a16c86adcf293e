//! [`Closing`]: the moment `close` is called, for the futures that must end
//! then rather than once the bus has drained.
//!
//! # Contract
//! - [`Closing::start`] is called once `close` is called (again is
//!   harmless). From then on [`Closing::started`] is true, and every
//!   [`Closing::wait`] future is ready: those waiting are woken, and one
//!   made later is ready at its first poll.
//! - Its users end a wait that can never succeed on a closing bus: a
//!   request (no reply can come, `reply` is refused) and a `publish_async`
//!   waiting for room (its publish would be refused; a handler waiting so
//!   would keep `close` from draining). Neither holds anything `close`
//!   waits for once it returns.

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

pub(crate) struct Closing {
    started: AtomicBool,
    notify: Notify,
}

impl Closing {
    pub(crate) fn new() -> Self {
        Self {
            started: AtomicBool::new(false),
            notify: Notify::new(),
        }
    }

    /// `close` was called: wakes every wait.
    pub(crate) fn start(&self) {
        self.started.store(true, Ordering::SeqCst);
        self.notify.notify_waiters();
    }

    /// Whether `close` was called.
    pub(crate) fn started(&self) -> bool {
        self.started.load(Ordering::SeqCst)
    }

    /// Ready once `close` is called. Cancel-safe (it holds nothing).
    pub(crate) async fn wait(&self) {
        let notified = self.notify.notified();
        let mut notified = std::pin::pin!(notified);
        // Registered before the flag is read: a `start` in between wakes
        // it, one before is seen in the flag.
        notified.as_mut().enable();
        if self.started() {
            return;
        }
        notified.await;
    }
}
