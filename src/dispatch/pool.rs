//! `DeliveryMode::WorkerPool`: runners are jobs on a bounded queue served by a
//! fixed set of threads.
//!
//! The queue is a `crossbeam-channel` array channel of `queue_capacity`
//! tickets; a ticket is one runner of one publish (an `Arc` of its job), so a
//! burst costs no allocation per queued runner. When the queue is full the
//! overflow policy applies: `CallerRuns` runs the runner on the publisher's
//! thread, `Drop` and `Error` count its deliveries as dropped.
//!
//! Workers stop when they reach a `Stop` ticket. Tickets are taken in order,
//! so everything queued before the stop still runs; `close` and dropping the
//! bus both stop the pool this way.

use std::sync::Arc;

use super::pending::{self, Place};
use super::{caller_runs, refused, Env, Fanout, Runner};
use crate::config::Overflow;
use crate::error::Error;
use crate::registry::entry::BoxFuture;
use crate::stats::Tally;
use crate::sync::channel::{self, Receiver, Sender, TrySendError};
use crate::sync::{thread, AtomicBool, AtomicUsize, Ordering};
use crossbeam_utils::CachePadded;

pub(crate) enum Ticket<T> {
    Run(Arc<Fanout<T>>),
    /// An ordered handler's drain (see `ordered.rs`).
    Drain(Box<dyn FnOnce() + Send>),
    Stop,
}

pub(crate) struct Pool<T> {
    queue: Sender<Ticket<T>>,
    /// Workers waiting for a ticket (or about to).
    idle: Arc<CachePadded<AtomicUsize>>,
    workers: usize,
    stopped: AtomicBool,
    /// Queues `n` stop tickets from a thread of its own, for when the queue
    /// is full and the caller may be a worker that must not wait.
    send_stops_later: Box<dyn Fn(usize) + Send + Sync>,
}

impl<T: Send + Sync + 'static> Pool<T> {
    pub(crate) fn start(workers: usize, capacity: usize, env: &Arc<Env>) -> Result<Self, Error> {
        let (queue, tickets) = channel::bounded(capacity);
        let stop_queue = queue.clone();
        let mut pool = Self {
            queue,
            idle: Arc::new(CachePadded::new(AtomicUsize::new(0))),
            workers: 0,
            stopped: AtomicBool::new(false),
            send_stops_later: Box::new(move |n| {
                let queue = stop_queue.clone();
                let spawned = thread::Builder::new()
                    .name("blazesub-pool-stop".into())
                    .spawn(move || {
                        for _ in 0..n {
                            let _ = queue.send(Ticket::Stop);
                        }
                    });
                if let Err(err) = spawned {
                    tracing::error!(%err, "could not stop the worker pool; its threads stay parked");
                }
            }),
        };
        for index in 0..workers {
            let tickets = tickets.clone();
            let queue = pool.queue.clone();
            let idle = Arc::clone(&pool.idle);
            let env = Arc::clone(env);
            thread::Builder::new()
                .name(format!("blazesub-worker-{index}"))
                .spawn(move || work(&tickets, &queue, &idle, &env))
                // Dropping `pool` stops the workers already started.
                .map_err(Error::Spawn)?;
            pool.workers += 1;
        }
        Ok(pool)
    }

    /// Queues the job's runners; see the module docs for a full queue.
    pub(crate) fn dispatch(&self, job: Arc<Fanout<T>>, env: &Arc<Env>) -> usize {
        let mut started = false;
        let mut dropped = 0;
        for _ in 0..job.plan().runners {
            match self.queue.try_send(Ticket::Run(Arc::clone(&job))) {
                Ok(()) => started = true,
                Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => match env.overflow {
                    Overflow::CallerRuns => {
                        let mut runner = PoolRunner {
                            queue: &self.queue,
                            idle: &self.idle,
                            job: &job,
                            env,
                            place: Place::Publisher,
                        };
                        caller_runs(&job, &mut runner, env);
                    }
                    Overflow::Drop | Overflow::Error => dropped += refused(&job, started, env),
                },
            }
        }
        dropped
    }
}

/// The ticket a refused `try_send` hands back.
pub(crate) fn refused_ticket<T>(error: TrySendError<Ticket<T>>) -> Ticket<T> {
    match error {
        TrySendError::Full(ticket) | TrySendError::Disconnected(ticket) => ticket,
    }
}

impl<T> Pool<T> {
    /// Where ordered handlers' drains are queued.
    pub(crate) fn sender(&self) -> Sender<Ticket<T>> {
        self.queue.clone()
    }

    /// Lets the workers finish what is queued, then stop. Idempotent.
    pub(crate) fn shut_down(&self) {
        if self.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        let unsent = (0..self.workers)
            .filter(|_| self.queue.try_send(Ticket::Stop).is_err())
            .count();
        if unsent > 0 {
            (self.send_stops_later)(unsent);
        }
    }
}

impl<T> Drop for Pool<T> {
    fn drop(&mut self) {
        self.shut_down();
    }
}

fn work<T: Send + Sync + 'static>(
    tickets: &Receiver<Ticket<T>>,
    queue: &Sender<Ticket<T>>,
    idle: &AtomicUsize,
    env: &Arc<Env>,
) {
    loop {
        // Idle means "found the queue empty", not "between two tickets".
        let ticket = match tickets.try_recv() {
            Ok(ticket) => Ok(ticket),
            Err(_) => {
                idle.fetch_add(1, Ordering::Relaxed);
                let ticket = tickets.recv();
                idle.fetch_sub(1, Ordering::Relaxed);
                ticket
            }
        };
        let job = match ticket {
            Ok(Ticket::Run(job)) => job,
            Ok(Ticket::Drain(drain)) => {
                drain();
                continue;
            }
            Ok(Ticket::Stop) | Err(_) => return,
        };
        let mut runner = PoolRunner {
            queue,
            idle,
            job: &job,
            env,
            place: Place::Worker,
        };
        let mut tally = Tally::default();
        job.run(env, &mut runner, &mut tally);
        env.counters.add(&tally);
    }
}

/// A runner on a worker thread, or on a publisher the queue had no room for.
struct PoolRunner<'a, T> {
    queue: &'a Sender<Ticket<T>>,
    idle: &'a AtomicUsize,
    job: &'a Arc<Fanout<T>>,
    env: &'a Arc<Env>,
    place: Place,
}

impl<T: Send + Sync + 'static> Runner<T> for PoolRunner<'_, T> {
    fn has_idle_capacity(&self) -> bool {
        // A worker counts as idle from finding the queue empty until its
        // `recv` returns, which on a busy machine can be long after a ticket
        // was queued for it: only idle workers beyond the queued tickets
        // are free.
        let idle = self.idle.load(Ordering::Relaxed);
        idle > 0 && idle > self.queue.len()
    }

    fn offer_helper(&mut self, _job: &Fanout<T>) -> bool {
        self.queue
            .try_send(Ticket::Run(Arc::clone(self.job)))
            .is_ok()
    }

    fn pending(&mut self, delivery: BoxFuture, tally: &mut Tally) {
        pending::settle(delivery, self.env, self.place, tally);
    }
}
