//! `WeakBus`: a detached handler that acts on its own bus through a
//! `WeakBus` lets the bus go with the service's last `Bus`, in every mode,
//! closed first or not; a handler that drops the last `Bus` (upgraded from
//! its `WeakBus`) does so safely on whatever thread runs it. Every step that
//! could hang runs under a time limit and fails instead.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use blazesub::{Bus, DeliveryMode, Message, TryRecvError};
use common::{runtime, wait_until, within, Gate, MODES};

const LIMIT: Duration = Duration::from_secs(5);

/// Counts its drops: the handler closure that owns it has been released.
struct DropFlag(Arc<AtomicUsize>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

fn bus_on(mode: DeliveryMode, rt: &tokio::runtime::Runtime) -> Bus<u32> {
    Bus::<u32>::builder()
        .delivery(mode)
        .workers(2)
        .runtime(rt.handle().clone())
        .build()
        .unwrap()
}

/// A detached responder owning a `WeakBus` (and a drop flag): it answers
/// while the bus lives; when the last outside `Bus` goes (after `close`,
/// or without it), the bus goes too, its streams end and the responder's
/// closure is dropped.
#[test]
fn a_detached_handler_owning_a_weak_bus_lets_the_bus_go() {
    within(Duration::from_secs(60), "the test", || {
        let mut failed = Vec::new();
        for close_first in [false, true] {
            for mode in MODES {
                let rt = runtime(2);
                let bus = bus_on(mode, &rt);
                let dropped = Arc::new(AtomicUsize::new(0));
                let flag = DropFlag(Arc::clone(&dropped));
                let weak = bus.downgrade();
                bus.subscribe("svc", move |m: &Message<u32>| {
                    let _keep = &flag;
                    if let Some(bus) = weak.upgrade() {
                        let _ = bus.publish("svc/out", *m.data() + 1);
                    }
                })
                .unwrap()
                .detach();
                let mut out = bus.subscribe_stream("svc/out").unwrap();
                bus.publish("svc", 41).unwrap();
                let answered = wait_until(LIMIT, || bus.inflight_messages() == 0)
                    && matches!(out.try_recv().map(|m| *m.data()), Ok(42));
                let weak = bus.downgrade();
                if close_first {
                    rt.block_on(bus.close()).unwrap();
                }
                drop(bus); // the last `Bus` outside the bus
                let released = wait_until(LIMIT, || dropped.load(Ordering::SeqCst) == 1);
                let ended = wait_until(LIMIT, || {
                    matches!(out.try_recv(), Err(TryRecvError::Closed))
                });
                let gone = weak.upgrade().is_none();
                if !(answered && released && ended && gone) {
                    failed.push(format!(
                        "{mode:?}, closed first: {close_first}: answered {answered}, closure released {released}, stream ended {ended}, bus gone {gone}"
                    ));
                }
            }
        }
        assert!(failed.is_empty(), "{failed:#?}");
    });
}

/// The last `Bus` dropped inside a handler: the handler holds one upgraded
/// from its `WeakBus` while the service drops its own, so the handler's is
/// the last (in `Inline` mode the publishing thread's is). The bus goes on
/// the thread that drops it (a pool worker, a runtime's thread, or the
/// publisher) without hanging or panicking, and a stream subscribed to it
/// ends.
#[test]
fn the_last_bus_dropped_inside_a_handler_goes_on_that_thread() {
    within(Duration::from_secs(60), "the test", || {
        let mut failed = Vec::new();
        for mode in MODES {
            let rt = runtime(2);
            let bus = bus_on(mode, &rt);
            let inside = Arc::new(Gate::new());
            let go_on = Arc::new(Gate::new());
            let returned = Arc::new(AtomicUsize::new(0));
            let weak = bus.downgrade();
            {
                let (inside, go_on, returned) = (
                    Arc::clone(&inside),
                    Arc::clone(&go_on),
                    Arc::clone(&returned),
                );
                bus.subscribe("last", move |_m: &Message<u32>| {
                    let bus = weak.upgrade();
                    inside.open();
                    go_on.wait();
                    // The last handle, but in `Inline` mode, where the
                    // publish running this call holds one.
                    drop(bus);
                    returned.fetch_add(1, Ordering::SeqCst);
                })
                .unwrap()
                .detach();
            }
            let mut rx = bus.subscribe_stream("other").unwrap();
            let publisher = {
                let weak = bus.downgrade();
                std::thread::spawn(move || {
                    // Its `Bus` goes when the publish returns: before the
                    // handler's, but in `Inline` mode.
                    let bus = weak.upgrade().expect("alive");
                    let _ = bus.publish("last", 1);
                })
            };
            inside.wait();
            drop(bus);
            go_on.open();
            publisher.join().unwrap();
            let ran = wait_until(LIMIT, || returned.load(Ordering::SeqCst) == 1);
            let ended = wait_until(LIMIT, || matches!(rx.try_recv(), Err(TryRecvError::Closed)));
            if !(ran && ended) {
                failed.push(format!(
                    "{mode:?}: handler returned {ran}, stream ended {ended}"
                ));
            }
        }
        assert!(failed.is_empty(), "{failed:#?}");
    });
}
