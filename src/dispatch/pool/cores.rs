//! Which CPU each busy pool worker runs on: apart from the others, where
//! the kernel left two of them on one.
//!
//! Two topics busy at two homes keep two pool workers busy, beside the
//! runtime threads that publish: more runnable threads than a small
//! machine has cores. The kernel sometimes keeps both workers on one CPU
//! for a whole burst while the other CPU runs only the publishers, which
//! mostly wait for queue room; the two topics' fan-outs then share one
//! core and run at half speed (issue 12: a repetition 1.3-1.7x slower than
//! its process's others, with both workers on one CPU for 97-100% of it).
//! The kernel parts them at last, sometimes only after the burst.
//!
//! # Contract
//! - Each CPU has at most one *occupant*: the busy worker (running work of
//!   its own, `Shared::runs_own`) that last claimed it. A worker that is
//!   not busy occupies nothing, whatever the table still says.
//! - A worker looks where it runs when it starts a batch (publishes queued
//!   behind one another: the pool is under load), one `getcpu` a batch. On
//!   a CPU nobody busy occupies it claims the CPU. On one another busy
//!   worker occupies, it claims a CPU of its own affinity mask that nobody
//!   busy occupies, if there is one, and moves there: it narrows its mask
//!   to that CPU (the kernel moves it at once) and puts the mask it had
//!   back right away. So one stack is undone by one move of one worker (the
//!   occupant stays), the service's affinity is kept, and the kernel stays
//!   free to move the worker again; a worker the kernel stacks again moves
//!   again at its next batch.
//! - Nothing is timed and nothing is pinned. With no CPU free (more busy
//!   workers than CPUs) nobody moves. A pool of one worker, or a mask of
//!   one CPU when the pool starts, never looks. A failed system call turns
//!   it off for that worker.
//! - Linux only (elsewhere a worker never looks), and never under loom.

use crate::sync::{AtomicUsize, Ordering};

/// Per CPU id: one more than the index of the worker that last claimed it,
/// or zero.
pub(super) struct Cores {
    occupants: Box<[AtomicUsize]>,
}

/// A worker's own record: the CPU it claimed last; `None` once a system
/// call failed.
pub(super) struct Seat {
    at: Option<usize>,
    enabled: bool,
}

impl Seat {
    pub(super) fn new() -> Self {
        Self {
            at: None,
            enabled: cfg!(all(target_os = "linux", not(loom))),
        }
    }

    /// The CPU this worker claimed last.
    #[cfg(all(test, target_os = "linux", not(loom)))]
    pub(super) fn at(&self) -> Option<usize> {
        self.at
    }
}

impl Cores {
    /// A table for the CPUs this thread may run on now (its workers
    /// inherit the mask); empty where the platform says nothing, and for
    /// one worker or one CPU, where nobody can stack on anybody or move.
    pub(super) fn new(workers: usize) -> Self {
        let cpus = os::allowed()
            .filter(|allowed| workers > 1 && allowed.len() > 1)
            .map_or(0, |allowed| {
                allowed.iter().max().map_or(0, |&highest| highest + 1)
            });
        Self {
            occupants: (0..cpus).map(|_| AtomicUsize::new(0)).collect(),
        }
    }

    /// Worker `me` starts a batch: it claims the CPU it is on, or moves to
    /// a free one if a busy worker (`busy(index)`) occupies it.
    pub(super) fn look(&self, me: usize, seat: &mut Seat, busy: impl Fn(usize) -> bool) {
        if !seat.enabled {
            return;
        }
        if self.occupants.is_empty() {
            // Not even the `getcpu` a look costs.
            seat.enabled = false;
            return;
        }
        let Some(cpu) = os::current() else {
            seat.enabled = false;
            return;
        };
        let Some(slot) = self.occupants.get(cpu) else {
            return;
        };
        let mine = me + 1;
        let occupant = slot.load(Ordering::Relaxed);
        if occupant == mine {
            seat.at = Some(cpu);
            return;
        }
        if occupant == 0 || !busy(occupant - 1) {
            // Free, or held by a worker that is idle now. A racing claim
            // by another worker that just landed here is settled at the
            // next batch of whichever of the two lost.
            self.release(me, seat);
            slot.store(mine, Ordering::Relaxed);
            seat.at = Some(cpu);
            return;
        }
        // Stacked on a busy worker's CPU: move, once, if a CPU is free.
        let Some(mask) = os::allowed() else {
            seat.enabled = false;
            return;
        };
        let free = mask.iter().copied().find(|&other| {
            other != cpu
                && self.occupants.get(other).is_some_and(|slot| {
                    let held = slot.load(Ordering::Relaxed);
                    let free = held == 0 || held == mine || !busy(held - 1);
                    free && slot
                        .compare_exchange(held, mine, Ordering::Relaxed, Ordering::Relaxed)
                        .is_ok()
                })
        });
        let Some(target) = free else {
            return;
        };
        if seat.at != Some(target) {
            self.release(me, seat);
        }
        seat.at = Some(target);
        if os::move_to(target, &mask).is_err() {
            seat.enabled = false;
            self.release(me, seat);
            return;
        }
        tracing::trace!(
            worker = me,
            from = cpu,
            to = target,
            "pool worker moved off a busy worker's CPU"
        );
    }

    /// Gives up the CPU `seat` claimed, if it still holds it.
    fn release(&self, me: usize, seat: &mut Seat) {
        if let Some(slot) = seat.at.take().and_then(|at| self.occupants.get(at)) {
            let _ = slot.compare_exchange(me + 1, 0, Ordering::Relaxed, Ordering::Relaxed);
        }
    }
}

#[cfg(all(target_os = "linux", not(loom)))]
mod os {
    use rustix::thread::{sched_getaffinity, sched_getcpu, sched_setaffinity, CpuSet};

    /// The CPUs the calling thread may run on.
    pub(super) fn allowed() -> Option<Vec<usize>> {
        let set = sched_getaffinity(None).ok()?;
        Some(
            (0..CpuSet::MAX_CPU)
                .filter(|&cpu| set.is_set(cpu))
                .collect(),
        )
    }

    /// The CPU the calling thread runs on.
    pub(super) fn current() -> Option<usize> {
        Some(sched_getcpu())
    }

    /// Moves the calling thread to `cpu`, then gives it back `mask`.
    pub(super) fn move_to(cpu: usize, mask: &[usize]) -> std::io::Result<()> {
        let mut only = CpuSet::new();
        only.set(cpu);
        sched_setaffinity(None, &only)?;
        let mut back = CpuSet::new();
        for &allowed in mask {
            back.set(allowed);
        }
        sched_setaffinity(None, &back)?;
        Ok(())
    }
}

#[cfg(not(all(target_os = "linux", not(loom))))]
mod os {
    pub(super) fn allowed() -> Option<Vec<usize>> {
        None
    }

    pub(super) fn current() -> Option<usize> {
        None
    }

    pub(super) fn move_to(_cpu: usize, _mask: &[usize]) -> std::io::Result<()> {
        Ok(())
    }
}

#[cfg(all(test, target_os = "linux", not(loom)))]
mod tests {
    use super::*;

    /// A worker on a CPU a busy worker occupies moves to a free one, and
    /// keeps the mask it had.
    #[test]
    fn a_worker_stacked_on_a_busy_workers_cpu_moves_to_a_free_one() {
        let Some(allowed) = os::allowed() else {
            return;
        };
        if allowed.len() < 2 {
            return;
        }
        std::thread::spawn(move || {
            let cores = Cores::new(2);
            let here = allowed[0];
            // Put this thread on `here` (the kernel moves it at once). A
            // sandbox that refuses affinity calls leaves nothing to test:
            // the worker turns the move off there (`look`'s error path).
            if let Err(refused) = os::move_to(here, &[here]) {
                eprintln!("affinity refused here ({refused}): nothing to test");
                return;
            }
            assert_eq!(os::current(), Some(here));
            // Worker 0, busy, occupies `here`.
            let mut busy_seat = Seat::new();
            cores.look(0, &mut busy_seat, |_| true);
            assert_eq!(busy_seat.at(), Some(here));
            // Back to the whole mask, still on `here`: worker 1 starts a
            // batch there.
            let mut back = rustix::thread::CpuSet::new();
            allowed.iter().for_each(|&cpu| back.set(cpu));
            rustix::thread::sched_setaffinity(None, &back).unwrap();
            let mut seat = Seat::new();
            cores.look(1, &mut seat, |worker| worker == 0);
            let moved = seat.at().expect("claimed a CPU");
            assert_ne!(moved, here, "moved off the busy worker's CPU");
            assert_eq!(os::current(), Some(moved));
            assert_eq!(os::allowed().unwrap(), allowed, "the mask is kept");
            // With worker 0 idle, a worker on its CPU stays and claims it.
            os::move_to(here, &allowed).unwrap();
            if os::current() == Some(here) {
                let mut third = Seat::new();
                cores.look(2, &mut third, |_| false);
                assert_eq!(third.at(), Some(here), "an idle occupant is no one");
            }
        })
        .join()
        .unwrap();
    }

    /// A pool of one worker never looks (nor pays the `getcpu`).
    #[test]
    fn a_single_worker_never_looks() {
        let cores = Cores::new(1);
        let mut seat = Seat::new();
        cores.look(0, &mut seat, |_| true);
        assert_eq!(seat.at(), None);
        assert!(!seat.enabled, "turned off for good");
    }

    /// With no CPU free, a stacked worker stays where it is.
    #[test]
    fn nobody_moves_when_every_cpu_is_occupied_by_a_busy_worker() {
        let Some(allowed) = os::allowed().filter(|allowed| allowed.len() > 1) else {
            return;
        };
        std::thread::spawn(move || {
            let cores = Cores::new(2);
            for (worker, &cpu) in allowed.iter().enumerate() {
                cores.occupants[cpu].store(worker + 1, Ordering::Relaxed);
            }
            let mut seat = Seat::new();
            cores.look(allowed.len(), &mut seat, |_| true);
            assert_eq!(seat.at(), None, "claimed nothing, so moved nowhere");
            for (worker, &cpu) in allowed.iter().enumerate() {
                assert_eq!(cores.occupants[cpu].load(Ordering::Relaxed), worker + 1);
            }
        })
        .join()
        .unwrap();
    }
}
