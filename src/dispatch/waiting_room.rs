//! Async deliveries waiting for a task slot.
//!
//! An async handler's future still pending after its first poll continues
//! as a task holding one of the bus's `max_inflight_tasks` slots
//! (`permit.rs`). When none is free it waits here, in publish order, and
//! the next slot given back starts it. The room holds at most
//! `max_inflight_tasks` futures; what is done when it is full is the
//! overflow policy's (`pending.rs`), and only a publisher that can neither
//! wait nor block (a thread of a current-thread runtime) puts a future in
//! past that.
//!
//! # The hand-off
//! A slot given back and a future put in can race: the future's owner found
//! no slot, and the task giving one back found no future. Each side
//! publishes its change and then issues a `SeqCst` fence before it looks at
//! the other's (`TaskGauge::give_back`, then [`WaitingRoom::has_waiting`];
//! [`WaitingRoom::push`], then [`WaitingRoom::hand_out`]). The two fences
//! are ordered one way or the other, so at least one side sees both the
//! free slot and the waiting future and starts it; the loom model
//! `loom_a_freed_slot_starts_a_waiting_delivery` checks this.
//!
//! No future is dropped or started under the room's lock: `hand_out` takes
//! one out, lets go of the lock, then starts it.

use std::collections::VecDeque;

use super::permit::TaskGauge;
use crate::sync::{fence, AtomicBool, AtomicUsize, Mutex, MutexGuard, Ordering};

/// A bounded first-in, first-out queue of work waiting for a task slot.
pub(crate) struct WaitingRoom<F> {
    queue: Mutex<VecDeque<F>>,
    /// The queue's length, read without the lock by every slot given back.
    waiting: AtomicUsize,
    capacity: usize,
    /// Set the first time something was put in past the capacity.
    overfilled: AtomicBool,
}

impl<F> WaitingRoom<F> {
    pub(crate) fn new(capacity: usize) -> Self {
        Self {
            queue: Mutex::new(VecDeque::new()),
            waiting: AtomicUsize::new(0),
            capacity,
            overfilled: AtomicBool::new(false),
        }
    }

    /// Puts `item` at the back if the room has space, or in any case when
    /// `past_capacity` is set; hands it back otherwise. The caller then
    /// calls [`Self::hand_out`], in case every slot was given back since it
    /// looked.
    pub(crate) fn push(&self, item: F, past_capacity: bool) -> Result<(), F> {
        {
            let mut queue = self.lock();
            if queue.len() >= self.capacity && !past_capacity {
                return Err(item);
            }
            queue.push_back(item);
            self.waiting.store(queue.len(), Ordering::Relaxed);
        }
        // Pairs with the fence in `TaskGauge::give_back` (module docs).
        fence(Ordering::SeqCst);
        Ok(())
    }

    /// Whether this is the first call: the caller is about to put
    /// something in past the capacity, and warns once per bus.
    pub(crate) fn first_overfill(&self) -> bool {
        !self.overfilled.swap(true, Ordering::Relaxed)
    }

    /// Whether anything waits. Read after `TaskGauge::give_back`'s fence.
    pub(crate) fn has_waiting(&self) -> bool {
        self.waiting.load(Ordering::Relaxed) > 0
    }

    /// Starts waiting items, oldest first, one per slot it can take from
    /// `slots`, until either runs out. `start` owns the slot it is given
    /// (it must give it back when its task ends).
    pub(crate) fn hand_out(&self, slots: &TaskGauge, mut start: impl FnMut(F)) {
        while self.has_waiting() && slots.try_take() {
            match self.take_one() {
                Some(item) => start(item),
                // Another thread took it. Giving the slot back fences, so
                // the loop's next look sees a future pushed meanwhile by
                // someone who found that slot taken.
                None => slots.give_back(),
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, VecDeque<F>> {
        // Only the queue's own operations run under it: none panics.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Takes the oldest waiting item, for a task that already holds a slot
    /// and is about to give it back.
    pub(crate) fn take_one(&self) -> Option<F> {
        if !self.has_waiting() {
            return None;
        }
        let mut queue = self.lock();
        let next = queue.pop_front();
        self.waiting.store(queue.len(), Ordering::Relaxed);
        next
    }

    /// Takes out everything still waiting (the bus is going away).
    pub(crate) fn take_all(&self) -> VecDeque<F> {
        let mut queue = self.lock();
        self.waiting.store(0, Ordering::Relaxed);
        std::mem::take(&mut *queue)
    }
}
