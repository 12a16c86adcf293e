//! How far apart the machine's two CPUs are right now: the round trip of
//! one cache line between two threads.
//!
//! On the virtual machines these benches run on, the host sometimes runs
//! both virtual CPUs on one physical core's two hyperthreads and sometimes
//! on two cores, and switches without the guest's knowing. A line's round
//! trip reads about 32 ns in the first state and about 66 ns in the
//! second. Two threads that each keep a core busy get about 1.4× one
//! thread's work done in the first state and 2× in the second: two
//! `Inline` publishers read 277–282 M deliveries/s against one
//! publisher's 203 whenever the round trip read 31–32 ns, and 1.95–2.0×
//! it at 66 ns, in the same processes (`docs/design-notes.md` §13,
//! twenty-eighth session). The fan-out bench's two-publisher pass prints
//! it before each round of repetitions, so a reader can tell the host's
//! state from the bus's.

use std::hint::spin_loop;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// Round trips timed per measurement: about 3-7 ms.
const ROUND_TRIPS: u64 = 100_000;

/// Mean nanoseconds for one cache line to go to another thread and back.
pub fn line_round_trip_ns() -> f64 {
    let line = Arc::new(AtomicU64::new(0));
    let echo = {
        let line = Arc::clone(&line);
        std::thread::spawn(move || loop {
            let value = line.load(Ordering::Acquire);
            if value == u64::MAX {
                return;
            }
            if value % 2 == 1 {
                line.store(value + 1, Ordering::Release);
            }
        })
    };
    let start = Instant::now();
    for round in 0..ROUND_TRIPS {
        line.store(2 * round + 1, Ordering::Release);
        while line.load(Ordering::Acquire) != 2 * round + 2 {
            spin_loop();
        }
    }
    let nanos = start.elapsed().as_nanos() as f64 / ROUND_TRIPS as f64;
    line.store(u64::MAX, Ordering::Release);
    echo.join().expect("echo thread");
    nanos
}
