//! A sequential model of each stream overflow policy, checked by proptest:
//! random sequences of publishes and reads against one stream, in every
//! delivery mode; every result (`publish`'s, `try_recv_lagged`'s), every
//! count (`lost`, `Stats`) and the order of what is read must be exactly
//! what the model says.

use std::collections::VecDeque;

use blazesub::{Bus, DeliveryMode, Error, StreamOptions, StreamOverflow, TryRecvLaggedError};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Publish,
    Read,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![3 => Just(Op::Publish), 2 => Just(Op::Read)],
        1..80,
    )
}

fn policies() -> impl Strategy<Value = StreamOverflow> {
    prop_oneof![
        Just(StreamOverflow::DropOldest),
        Just(StreamOverflow::DropNewest),
        Just(StreamOverflow::Backpressure),
        Just(StreamOverflow::Disconnect),
    ]
}

fn modes() -> impl Strategy<Value = DeliveryMode> {
    prop_oneof![
        Just(DeliveryMode::Inline),
        Just(DeliveryMode::WorkerPool),
        Just(DeliveryMode::TaskPerSubscriber),
    ]
}

/// What the stream should do, step by step.
struct Model {
    policy: StreamOverflow,
    capacity: usize,
    queue: VecDeque<u32>,
    lost: u64,
    reported: u64,
    disconnected: bool,
    published: u64,
    delivered: u64,
}

impl Model {
    /// What `publish` returns: `Ok(matched)`, or `Err(())` for `Error::Full`.
    fn publish(&mut self, value: u32) -> Result<usize, ()> {
        if self.disconnected {
            self.published += 1;
            return Ok(0);
        }
        let full = self.queue.len() == self.capacity;
        match (self.policy, full) {
            (_, false) => self.queue.push_back(value),
            (StreamOverflow::DropOldest, true) => {
                self.queue.pop_front();
                self.queue.push_back(value);
                self.lost += 1;
            }
            (StreamOverflow::DropNewest, true) => self.lost += 1,
            (StreamOverflow::Disconnect, true) => {
                self.lost += 1;
                self.disconnected = true;
            }
            (StreamOverflow::Backpressure, true) => return Err(()),
        }
        self.published += 1;
        Ok(1)
    }

    fn read(&mut self) -> Result<u32, TryRecvLaggedError> {
        if self.lost > self.reported {
            let lag = self.lost - self.reported;
            self.reported = self.lost;
            return Err(TryRecvLaggedError::Lagged(lag));
        }
        match self.queue.pop_front() {
            Some(value) => {
                self.delivered += 1;
                Ok(value)
            }
            None if self.disconnected => Err(TryRecvLaggedError::Disconnected),
            None => Err(TryRecvLaggedError::Empty),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn each_overflow_policy_follows_the_model(
        policy in policies(),
        mode in modes(),
        capacity in 1usize..5,
        ops in ops(),
    ) {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let bus = Bus::<u32>::builder()
            .delivery(mode)
            .workers(1)
            .runtime(rt.handle().clone())
            .build()
            .unwrap();
        let mut rx = bus
            .subscribe_stream_with("m", StreamOptions::new(capacity).overflow(policy))
            .unwrap();
        let mut model = Model {
            policy,
            capacity,
            queue: VecDeque::new(),
            lost: 0,
            reported: 0,
            disconnected: false,
            published: 0,
            delivered: 0,
        };
        let mut next = 0u32;
        for (step, op) in ops.iter().enumerate() {
            match op {
                Op::Publish => {
                    let got = bus.publish("m", next);
                    let expected = model.publish(next);
                    match (&got, expected) {
                        (Ok(matched), Ok(want)) => prop_assert_eq!(*matched, want, "step {}", step),
                        (Err(Error::Full { capacity: c, .. }), Err(())) => {
                            prop_assert_eq!(*c, capacity)
                        }
                        _ => prop_assert!(false, "step {}: publish gave {:?}, model {:?}", step, got, expected),
                    }
                    next += 1;
                }
                Op::Read => {
                    let got = rx.try_recv_lagged().map(|m| *m.data());
                    let expected = model.read();
                    prop_assert_eq!(got, expected, "step {} ({:?}, capacity {})", step, policy, capacity);
                }
            }
            prop_assert_eq!(rx.lost(), model.lost, "step {}", step);
        }
        let stats = bus.stats();
        prop_assert_eq!(stats.published, model.published);
        prop_assert_eq!(stats.delivered, model.delivered);
        prop_assert_eq!(stats.dropped, model.lost);
        prop_assert_eq!(stats.disconnects, u64::from(model.disconnected));
    }
}
