//! Closing a bus wakes stream readers and waiting lossless publishers
//! after it lets go of its locks: a waker may run user code (here, one
//! drops a `Subscription`, which unsubscribes and takes the bus's locks).
//! Each `close` runs under a time limit, so a deadlock fails instead of
//! hanging. (Found by the thirtieth session's review of streams: the
//! wakers ran under the trie's writer lock and the shared groups' lock.)

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use blazesub::{Bus, DeliveryMode, Error, StreamOptions, StreamOverflow, Subscription};

/// `close` on a bus with nothing in flight ends the streams at once.
const CLOSE_LIMIT: Duration = Duration::from_secs(10);

fn inline_bus() -> Bus<u32> {
    Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .unwrap()
}

fn options(capacity: usize, overflow: StreamOverflow) -> StreamOptions {
    StreamOptions::new(capacity).overflow(overflow)
}

/// A waker whose `wake` does what a user's waker may do: drop something it
/// owns, here a `Subscription` (which unsubscribes from the bus). The crate
/// promises that "no user code (a payload's Drop, a waker) runs while the
/// bus holds a lock" (DESIGN.md §6, crate docs "Unsubscribing").
struct DropsASubscriptionOnWake {
    held: Mutex<Option<Subscription>>,
    woken: AtomicBool,
}

impl DropsASubscriptionOnWake {
    fn new(held: Subscription) -> Arc<Self> {
        Arc::new(Self {
            held: Mutex::new(Some(held)),
            woken: AtomicBool::new(false),
        })
    }
}

impl Wake for DropsASubscriptionOnWake {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        let held = self.held.lock().unwrap().take();
        drop(held);
        self.woken.store(true, Ordering::SeqCst);
    }
}

/// Runs `bus.close()` on a thread of its own and waits for it at most
/// `LIMIT`: `Err` if it did not return (it deadlocked).
fn close_on_a_thread(bus: &Bus<u32>) -> Result<Result<(), Error>, &'static str> {
    let bus = bus.clone();
    let (done, finished) = mpsc::channel();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let _ = done.send(runtime.block_on(bus.close()));
    });
    finished
        .recv_timeout(CLOSE_LIMIT)
        .map_err(|_| "Bus::close did not return: deadlocked")
}

// ---------------------------------------------------------------------------
// Closing the bus used to run readers' and publishers' wakers under the bus's
//    own locks.
// ---------------------------------------------------------------------------

/// `Bus::close` ends every stream through `Trie::close_streams`, which calls
/// `Mailbox::close` (and so wakes the parked reader) while it holds the
/// trie's writer lock. A reader's waker that unsubscribes something (drops
/// a `Subscription` it owns) then needs that same lock: the close deadlocks.
#[test]
fn close_wakes_a_parked_stream_reader_without_holding_a_bus_lock() {
    let bus = inline_bus();
    let mut rx = bus.subscribe_stream("t").unwrap();
    let other = bus.subscribe("u", |_| {}).unwrap();
    let wake = DropsASubscriptionOnWake::new(other);
    let waker = Waker::from(Arc::clone(&wake));
    {
        let mut recv = Box::pin(rx.recv());
        let polled = recv.as_mut().poll(&mut Context::from_waker(&waker));
        assert!(polled.is_pending(), "nothing was published yet");
    }
    let closed = close_on_a_thread(&bus);
    if !matches!(closed, Ok(Ok(()))) {
        // The lock stays held: dropping the receiver would block on it.
        std::mem::forget(rx);
        std::mem::forget(bus);
        panic!("the reader's waker ran while the bus held its trie lock: {closed:?}");
    }
    assert!(wake.woken.load(Ordering::SeqCst), "the reader was woken");
}

/// Control (passes): the same waker, woken by a publish instead of by
/// `close`, unsubscribes without trouble, so the deadlock above is the lock
/// `close` holds, not the waker.
#[test]
fn control_a_publish_wakes_the_same_waker_without_deadlock() {
    let bus = inline_bus();
    let mut rx = bus.subscribe_stream("t").unwrap();
    let other = bus.subscribe("u", |_| {}).unwrap();
    let wake = DropsASubscriptionOnWake::new(other);
    let waker = Waker::from(Arc::clone(&wake));
    {
        let mut recv = Box::pin(rx.recv());
        let polled = recv.as_mut().poll(&mut Context::from_waker(&waker));
        assert!(polled.is_pending(), "nothing was published yet");
    }
    bus.publish("t", 1).unwrap();
    assert!(wake.woken.load(Ordering::SeqCst), "the reader was woken");
    assert_eq!(bus.subscribers("u"), 0, "the waker unsubscribed");
    assert!(matches!(close_on_a_thread(&bus), Ok(Ok(()))));
}

/// The same for a publisher waiting in `publish_async` for room in a full
/// lossless mailbox: closing the bus closes the mailbox's room, which wakes
/// the waiting publisher's waker, still under the trie's writer lock.
#[test]
fn close_wakes_a_waiting_lossless_publisher_without_holding_a_bus_lock() {
    let bus = inline_bus();
    let _full = bus
        .subscribe_stream_with("t", options(1, StreamOverflow::Backpressure))
        .unwrap();
    bus.publish("t", 1).unwrap();
    let other = bus.subscribe("u", |_| {}).unwrap();
    let wake = DropsASubscriptionOnWake::new(other);
    let waker = Waker::from(Arc::clone(&wake));
    let publisher = bus.clone();
    let mut waiting: Pin<Box<dyn Future<Output = Result<usize, Error>> + Send>> =
        Box::pin(async move { publisher.publish_async("t", 2).await });
    assert!(
        waiting
            .as_mut()
            .poll(&mut Context::from_waker(&waker))
            .is_pending(),
        "the mailbox is full: publish_async waits"
    );
    let closed = close_on_a_thread(&bus);
    if !matches!(closed, Ok(Ok(()))) {
        // The lock stays held: dropping the receiver would block on it.
        std::mem::forget(_full);
        std::mem::forget(waiting);
        std::mem::forget(bus);
        panic!("the waiting publisher's waker ran while the bus held its trie lock: {closed:?}");
    }
    assert!(wake.woken.load(Ordering::SeqCst), "the publisher was woken");
    let outcome = waiting
        .as_mut()
        .poll(&mut Context::from_waker(Waker::noop()));
    assert!(
        matches!(outcome, Poll::Ready(Err(Error::Closed))),
        "{outcome:?}"
    );
}

/// The same for a shared group's stream member: `SharedGroups::close_streams`
/// closes the member mailboxes (waking their readers) while it holds the
/// groups' lock; a waker that drops a shared subscription needs that lock.
#[test]
fn close_wakes_a_shared_stream_member_without_holding_a_bus_lock() {
    let bus = inline_bus();
    let mut member = bus.subscribe_stream("$share/g/t").unwrap();
    let other = bus.subscribe("$share/h/u", |_| {}).unwrap();
    let wake = DropsASubscriptionOnWake::new(other);
    let waker = Waker::from(Arc::clone(&wake));
    {
        let mut recv = Box::pin(member.recv());
        let polled = recv.as_mut().poll(&mut Context::from_waker(&waker));
        assert!(polled.is_pending(), "nothing was published yet");
    }
    let closed = close_on_a_thread(&bus);
    if !matches!(closed, Ok(Ok(()))) {
        // The lock stays held: dropping the member would block on it.
        std::mem::forget(member);
        std::mem::forget(bus);
        panic!("the shared member's waker ran while the bus held its groups lock: {closed:?}");
    }
    assert!(wake.woken.load(Ordering::SeqCst), "the member was woken");
}

// ---------------------------------------------------------------------------
// 2. The overflow policy is not applied to a retained snapshot.
// ---------------------------------------------------------------------------
