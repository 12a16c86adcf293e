//! [`Refused`]: the log positions of a sync ordered subscription whose
//! deliveries were refused (a full queue under `Overflow::Drop` or
//! `Overflow::Error`, a runtime that dropped the job), ahead of its cursor.
//!
//! # Contract
//! - **Noted only where no runner has read:** a refused delivery notes its
//!   position with its log's appends held, and only if no runner's read of
//!   the log has reached it; every read, under the same lock, learns
//!   whether anything is noted ([`Refused::any`]). So a runner never calls
//!   a message whose refusal it did not see, and a refusal never notes a
//!   message a runner has read (that runner runs it). The runner passes
//!   noted positions while refusals may note later ones: the lock here
//!   keeps the two apart.
//! - **A noted position was counted dropped when it was noted.** The runner
//!   that reaches it passes it without a call and without counting it
//!   again, also when the log pushed it out first ([`Refused::passed`]).
//! - **Bounded by the log:** noted positions the log has pushed out and no
//!   runner has read are forgotten as a count on the next note (the next
//!   read starts past them, and must not count them twice), so what is
//!   held is at most the log's capacity of positions plus those of the
//!   read a runner is working through. The count and the positions are
//!   changed only with the log's appends held, or (passing positions of a
//!   read) below where the runner read, which no note touches.

use std::collections::VecDeque;

use crate::sync::{AtomicBool, Mutex, MutexGuard, Ordering};

/// The refused positions ahead of an ordered subscription's cursor.
pub(crate) struct Refused {
    /// Whether anything is noted: read by each runner's catch-up once, so a
    /// subscription that never had a refusal pays one load for it.
    any: AtomicBool,
    noted: Mutex<Noted>,
}

#[derive(Default)]
struct Noted {
    /// In increasing order, each at or above the cursor when noted.
    positions: VecDeque<u64>,
    /// Noted positions the log pushed out before the cursor reached them,
    /// forgotten but still to be passed.
    pushed_out: u64,
}

impl Refused {
    pub(crate) fn new() -> Self {
        Self {
            any: AtomicBool::new(false),
            noted: Mutex::new(Noted::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Noted> {
        self.noted.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether a runner has anything to look for.
    #[inline]
    pub(crate) fn any(&self) -> bool {
        self.any.load(Ordering::Relaxed)
    }

    /// Notes `position` (refused, counted), with the log's appends held.
    /// Noted positions the log no longer keeps (below `oldest_kept`) that
    /// no runner has read (at or above `read_to`) are forgotten as a count:
    /// the next read starts past them and takes the count
    /// ([`Refused::passed`]). Those a runner has read stay for it to pass.
    pub(crate) fn note(&self, position: u64, oldest_kept: u64, read_to: u64) {
        let mut noted = self.lock();
        // Two publishers' refusals may be noted out of order.
        let at = noted.positions.partition_point(|&p| p < position);
        if noted.positions.get(at) != Some(&position) {
            noted.positions.insert(at, position);
        }
        let from = noted.positions.partition_point(|&p| p < read_to);
        let to = noted.positions.partition_point(|&p| p < oldest_kept);
        if from < to {
            noted.positions.drain(from..to);
            noted.pushed_out += (to - from) as u64;
        }
        self.any.store(true, Ordering::Relaxed);
    }

    /// The runner reached `position` in the log: true if it was refused
    /// (pass it without a call; it is counted).
    pub(crate) fn take(&self, position: u64) -> bool {
        let mut noted = self.lock();
        // None below it: the runner passes every position in order.
        while noted.positions.front().is_some_and(|&p| p < position) {
            noted.positions.pop_front();
        }
        let refused = noted.positions.front() == Some(&position);
        if refused {
            noted.positions.pop_front();
        }
        self.settle(&noted);
        refused
    }

    /// A runner's read of the log starts at `start` (with the log's appends
    /// held), past its cursor if the log pushed positions out: how many of
    /// those were refused, and so counted already.
    pub(crate) fn passed(&self, start: u64) -> u64 {
        let mut noted = self.lock();
        let mut counted = std::mem::take(&mut noted.pushed_out);
        while noted.positions.front().is_some_and(|&p| p < start) {
            noted.positions.pop_front();
            counted += 1;
        }
        self.settle(&noted);
        counted
    }

    fn settle(&self, noted: &Noted) {
        if noted.positions.is_empty() && noted.pushed_out == 0 {
            self.any.store(false, Ordering::Relaxed);
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::Refused;

    /// Positions noted out of order are passed in order; those the log
    /// pushed out and no runner read are forgotten as a count that the
    /// next read takes; those a runner read stay for it.
    #[test]
    fn noted_positions_are_passed_in_order_and_bounded_by_the_log() {
        let refused = Refused::new();
        assert!(!refused.any());
        refused.note(5, 0, 0);
        refused.note(3, 0, 0);
        refused.note(3, 0, 0);
        assert!(refused.any());
        assert!(!refused.take(2));
        assert!(refused.take(3));
        // The log now keeps 8 and above; a runner read up to 6: 5 stays
        // for it, as a position.
        refused.note(9, 8, 6);
        assert!(refused.take(5));
        // Nothing read past 6: 9 is forgotten once the log drops it.
        refused.note(12, 10, 6);
        assert_eq!(refused.passed(10), 1);
        assert!(refused.any());
        assert!(refused.take(12));
        assert!(!refused.any());
        refused.note(14, 0, 0);
        assert_eq!(refused.passed(20), 1);
        assert!(!refused.any());
    }
}
