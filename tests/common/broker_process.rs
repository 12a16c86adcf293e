//! Starting a broker process for a test: retried a few times (a port chosen
//! free can be taken by another test's server before ours binds it), and
//! waited for until it serves, exits, or runs out of time.

#![allow(dead_code)] // each broker uses a different part

use std::process::Child;
use std::time::{Duration, Instant};

/// How long a broker may take to come up.
const START_LIMIT: Duration = Duration::from_secs(10);

/// `attempt`'s result, tried up to three times; panics with `what` and the
/// last error if none succeeded.
pub fn with_retries<R>(what: &str, mut attempt: impl FnMut() -> Result<R, String>) -> R {
    let mut last = String::new();
    for _ in 0..3 {
        match attempt() {
            Ok(made) => return made,
            Err(error) => last = error,
        }
    }
    panic!("{what}: {last}")
}

/// Waits until `up` says the just-spawned `child` (`name` on `port`)
/// serves. An error if it exited first (most likely one of its ports was
/// taken meanwhile) or did not come up in time; the child is then gone,
/// killed by its pid and reaped.
pub fn wait_until_up(
    name: &str,
    port: u16,
    child: &mut Option<Child>,
    mut up: impl FnMut() -> bool,
) -> Result<(), String> {
    let deadline = Instant::now() + START_LIMIT;
    while !up() {
        if let Some(status) = child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
            *child = None;
            return Err(format!("{name} on {port} exited: {status}"));
        }
        if Instant::now() > deadline {
            kill(child);
            return Err(format!("{name} did not come up on {port}"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Kills the process (by pid), if any, and waits for it.
pub fn kill(child: &mut Option<Child>) {
    if let Some(mut child) = child.take() {
        let _ = child.kill();
        let _ = child.wait();
    }
}
