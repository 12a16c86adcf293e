//! [`Config`]: every knob of a bus, with its default and the reason for it.
//!
//! `Config` implements `Default` and `serde::Deserialize` (missing fields take
//! their defaults), so a service can keep it in its own configuration file:
//!
//! ```
//! use blazesub::{Batch, Config, DeliveryMode, Overflow};
//! use std::time::Duration;
//!
//! let config: Config = serde_json::from_str(r#"{
//!     "delivery": "worker_pool",
//!     "workers": 4,
//!     "overflow": "drop",
//!     "close_timeout": "5s"
//! }"#).unwrap();
//! assert_eq!(config.delivery, DeliveryMode::WorkerPool);
//! assert_eq!(config.workers, 4);
//! assert_eq!(config.overflow, Overflow::Drop);
//! assert_eq!(config.batch, Batch::Chunked); // a default
//! assert_eq!(config.close_timeout, Duration::from_secs(5));
//! ```
//!
//! [`Bus::builder`](crate::Bus::builder) sets the same knobs in code.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::Error;

/// Where a subscriber's handler runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryMode {
    /// Units of work run as tasks spawned on the bus's tokio runtime, at most
    /// [`Config::max_inflight_tasks`] alive at once. Good for async handlers
    /// that await; needs a tokio runtime.
    TaskPerSubscriber,
    /// Units of work run on a fixed pool of [`Config::workers`] threads, each
    /// fed by a bounded queue of its own (together [`Config::queue_capacity`]).
    /// Safe for handlers that
    /// block, and needs no runtime. The default.
    #[default]
    WorkerPool,
    /// Every delivery runs on the publisher's thread before `publish` returns.
    /// The fastest for cheap handlers; a handler that blocks blocks the
    /// publisher. The threshold does not apply, and the overflow policy only
    /// to async handlers still pending after their first poll when
    /// `max_inflight_tasks` tasks are already alive (see
    /// [`Config::max_inflight_tasks`]).
    Inline,
}

/// How a publish that matches more than
/// [`max_concurrent_subscriptions`](Config::max_concurrent_subscriptions)
/// subscriptions is cut into units of work.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Batch {
    /// BlazeSub's policy, kept for parity and for the benches: one unit for all
    /// matched subscriptions, and below the threshold one *executor job* (a
    /// queued job or a spawned task) per subscription. It has BlazeSub's
    /// cliff: setting the threshold at or above the subscriber count makes a
    /// publish cost one job per subscriber.
    Single,
    /// About one chunk per worker (no chunk smaller than 32 subscriptions),
    /// claimed by the workers from a shared cursor; below the threshold every
    /// subscription is its own unit, but the units are claimed the same way
    /// instead of each costing a job. No setting of the threshold is a trap.
    /// The default.
    #[default]
    Chunked,
}

/// What happens when the worker pool's queue is full, or when
/// [`Config::max_inflight_tasks`] tasks are already alive.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overflow {
    /// The publisher waits until its route's worker has room, then queues
    /// the work. Nothing is lost, and a publisher that outruns its
    /// subscribers is slowed to their pace, while every delivery still runs
    /// on a worker. The default.
    ///
    /// In [`DeliveryMode::TaskPerSubscriber`] the room is the route's lane
    /// (`max_inflight_tasks / workers` publishes, queued or running): the
    /// publisher waits only while the lane's task runs elsewhere, and runs
    /// the lane's queued work itself when nobody runs it (its task may be
    /// waiting for the very thread the publisher is on) or when it has
    /// started nothing for a millisecond; in that last case, with no more
    /// than half the lane queued (the rest held by the stalled server), it
    /// runs its own publish's work instead.
    ///
    /// Where waiting could deadlock, the publisher runs the unit of work
    /// itself, as under [`Overflow::CallerRuns`]: on a pool worker or inside
    /// a handler (a handler that publishes), once the bus is closing, for a
    /// task the cap has no slot for, and when the pool worker it waits on
    /// has started nothing for a millisecond while a worker drives an async
    /// handler's future itself at the task cap (that future may wait for
    /// what only the publisher's thread can free: a timer of the runtime
    /// the publisher is a thread of). A waiting `publish` blocks its
    /// thread the way running a handler would; it cannot be cancelled.
    ///
    /// Why it is the default: a publisher that runs a route's handlers
    /// itself runs them beside the worker that is running the same
    /// route's earlier publishes, and handlers that share state then fight
    /// over it between two cores (`docs/design-notes.md`, "Where a
    /// subscription runs").
    #[default]
    Wait,
    /// The publisher runs the unit of work itself. Nothing is lost, and a
    /// publisher that outruns its subscribers is slowed to their pace.
    CallerRuns,
    /// The deliveries that could not be queued are dropped and counted in
    /// [`Stats::dropped`](crate::Stats::dropped).
    ///
    /// An ordered handler's delivery dropped here drops that message only:
    /// the subscription's earlier messages, still waiting for their own
    /// queued work, run when it comes, in order, and the dropped one is
    /// passed over. A dropped delivery whose message the subscription's
    /// runner has already taken in (catching up on what other deliveries
    /// left it) is not dropped at all: that runner runs it. The publisher
    /// never runs an ordered handler for a dropped delivery.
    Drop,
    /// Like `Drop`, and a `publish` that had to drop deliveries returns
    /// [`Error::Overloaded`]. It reports what was refused during the call; an
    /// async delivery a worker cancels later (at the task cap) is only
    /// counted.
    Error,
}

/// How a shared subscription group (`$share/{group}/{filter}`) picks the one
/// member that receives a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SharePolicy {
    /// Members in turn, one message each.
    RoundRobin,
    /// The member with the fewest deliveries queued or running (a stream
    /// member's unread messages; a handler member's deliveries picked and not
    /// yet finished); ties go round robin, so idle members share the work. A
    /// slow member gets fewer messages. The default: it is what a work pool
    /// wants.
    #[default]
    LeastLoaded,
    /// By a hash of the topic name: one topic always goes to the same member
    /// while the membership is unchanged, so per-topic order holds (for
    /// stream members, and handler members on an `Inline` bus).
    TopicHash,
}

/// The configuration of a [`Bus`](crate::Bus).
///
/// Build one with `Config::default()` and struct update syntax, deserialize it
/// with serde, or use [`Bus::builder`](crate::Bus::builder).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Where handlers run. Default [`DeliveryMode::WorkerPool`]: bounded, needs
    /// no runtime, and safe for handlers that block — the safe choice when a
    /// bus does not know its handlers, as in BlazeSub.
    pub delivery: DeliveryMode,
    /// Worker threads in `WorkerPool` mode, and the most units of one publish
    /// that run at once in `TaskPerSubscriber` mode. Default: the available
    /// parallelism, since more runners than cores only adds switching for
    /// CPU-bound handlers. Must be at least 1 and at most
    /// [`Config::MAX_WORKERS`].
    ///
    /// On Linux, a busy pool worker that finds itself on a CPU another busy
    /// worker runs on (the kernel can keep two there for a whole burst, at
    /// half speed each) moves to a CPU of its affinity mask that no busy
    /// worker runs on, if there is one: it narrows its mask to that CPU and
    /// sets the mask back at once. No thread is left pinned, and a mask the
    /// service gave its threads is kept.
    pub workers: usize,
    /// The threshold `T`: a publish matching at most `T` subscriptions gives each
    /// its own unit of work; above `T` it is batched (see [`Batch`]). Default 10,
    /// BlazeSub's default, so individual delivery is kept for small fan-outs
    /// where a slow handler should not hold up its neighbours.
    pub max_concurrent_subscriptions: usize,
    /// How a publish above the threshold is batched. Default
    /// [`Batch::Chunked`], which has no performance cliff.
    pub batch: Batch,
    /// What a full queue or task cap does. Default [`Overflow::Wait`]:
    /// nothing is lost and the publisher is slowed instead.
    pub overflow: Overflow,
    /// Capacity of the worker pool's queues, in jobs (a publish takes one or a
    /// few), shared out evenly: each worker has a queue of its own of
    /// `queue_capacity / workers` (at least 1), beside the publish it runs.
    /// Default 4,096: room for a burst of thousands of publishes before the
    /// overflow policy applies, for about 100 KiB when full (a queue's
    /// memory grows with what it holds). Must be at least 1 and at most
    /// [`Config::MAX_QUEUE_CAPACITY`].
    pub queue_capacity: usize,
    /// The most tasks a `TaskPerSubscriber` bus (or an async handler still
    /// running after its first poll) keeps alive at once. Default 1,024: enough
    /// to keep every core busy through bursts, while a burst of 10,000 publishes
    /// cannot queue gigabytes of tasks. In `TaskPerSubscriber` mode it also
    /// sizes the lanes a topic's publishes queue in: `max_inflight_tasks /
    /// workers` publishes each (at least 1), queued or running; a full lane
    /// meets the [`Overflow`] policy. Must be at least 1.
    ///
    /// An async handler's delivery still pending after its first poll when
    /// every slot is taken:
    /// - run by a `TaskPerSubscriber` task: that task finishes it;
    /// - an async ordered subscription's drain (one task at a time per
    ///   subscription) takes a slot if one is free and otherwise runs past
    ///   the cap rather than hold up or lose its messages: at most one such
    ///   task per async ordered subscription;
    /// - elsewhere the [`Overflow`] policy applies: `Drop` and `Error`
    ///   cancel it (counted); `Wait` and `CallerRuns` have its runner finish
    ///   it there, blocking the thread as a slow sync handler would (a
    ///   publisher on a multi-thread runtime's thread blocks through
    ///   `tokio::task::block_in_place`). Nothing waits for a slot: a
    ///   delivery that did could wait for the very task that awaits it (a
    ///   request's answer, a `close` from a handler). Two publishers cannot
    ///   block for it, and there it continues as a task past the cap: one
    ///   on a current-thread runtime (the future needs that very thread),
    ///   and a publish made inside an async handler's first poll (which
    ///   runs in the bus's runtime context, hiding what the thread is). Such
    ///   tasks count in `live_tasks` and may reach the cap again (twice
    ///   `max_inflight_tasks` in all); past that, the delivery is cancelled
    ///   and counted as dropped, so memory stays bounded.
    pub max_inflight_tasks: usize,
    /// How many messages a stream subscription's mailbox holds. When it is full
    /// the oldest message is dropped and counted, so `publish` never waits for a
    /// reader. Default 1,024. Must be at least 1 and at most
    /// [`StreamOptions::MAX_CAPACITY`](crate::StreamOptions::MAX_CAPACITY)
    /// (16,777,216; see there why).
    pub stream_capacity: usize,
    /// Slots in the cache of topic → matching subscriptions. A publish to a
    /// cached topic does not walk the subscription trie. Default 4,096 (about
    /// 32 KiB when empty); rounded up to a power of two; 0 turns the cache off.
    pub route_cache_capacity: usize,
    /// How long [`Bus::close`](crate::Bus::close) waits for accepted deliveries
    /// to finish. Default 30 s, long enough for any handler that is not stuck.
    /// In configuration files: `"30s"`, `"250ms"`, `"2m"`, `"1h"`, or a number
    /// of seconds.
    #[serde(with = "duration_text")]
    pub close_timeout: Duration,
    /// The most topics that keep a retained message
    /// ([`Bus::publish_retained`](crate::Bus::publish_retained)). Retaining a
    /// new topic beyond it evicts the topic retained least recently, counted
    /// in [`Stats::retained_evicted`](crate::Stats::retained_evicted).
    /// Default 100,000: a retained value for every setting, flag and sensor
    /// of a large service, for about 55 MiB at most (a retained topic of
    /// five levels with a small value takes about 550 bytes, its message
    /// included: `tests/retained.rs`, `memory_per_retained_topic`). Raise it
    /// for a fleet: a million topics take about 520 MiB. Must be at least 1.
    pub max_retained: usize,
    /// How long a retained message stays retained; `None` (the default) keeps
    /// it until it is replaced, cleared or evicted. An expired message is
    /// removed (and counted in
    /// [`Stats::retained_expired`](crate::Stats::retained_expired)) by the
    /// next retained operation (`Bus::retained_count` and `Bus::stats`
    /// among them), and never handed to a subscription. One too long for
    /// the clock to add (`Duration::MAX`) never expires.
    #[serde(with = "option_duration_text")]
    pub retained_expiry: Option<Duration>,
    /// How a shared subscription group picks its member. Default
    /// [`SharePolicy::LeastLoaded`].
    pub share_policy: SharePolicy,
}

/// The smallest chunk [`Batch::Chunked`] cuts: below it, handing a chunk to
/// another worker costs more than running it.
pub(crate) const MIN_CHUNK: usize = 32;

impl Default for Config {
    fn default() -> Self {
        Self {
            delivery: DeliveryMode::default(),
            workers: std::thread::available_parallelism().map_or(1, usize::from),
            max_concurrent_subscriptions: 10,
            batch: Batch::default(),
            overflow: Overflow::default(),
            queue_capacity: 4_096,
            max_inflight_tasks: 1_024,
            stream_capacity: 1_024,
            route_cache_capacity: 4_096,
            close_timeout: Duration::from_secs(30),
            max_retained: 100_000,
            retained_expiry: None,
            share_policy: SharePolicy::default(),
        }
    }
}

impl Config {
    /// The most `workers`: threads (`WorkerPool`) or lanes
    /// (`TaskPerSubscriber`), made when the bus is built.
    pub const MAX_WORKERS: usize = 4_096;

    /// The most `queue_capacity`: a bound on the memory full queues take.
    pub const MAX_QUEUE_CAPACITY: usize = 1 << 24;

    /// Checks every field, naming the first that is invalid.
    ///
    /// ```
    /// use blazesub::{Config, Error};
    ///
    /// let config = Config { workers: 0, ..Config::default() };
    /// let err = config.validate().unwrap_err();
    /// assert!(matches!(err, Error::InvalidConfig { field: "workers", .. }));
    /// ```
    pub fn validate(&self) -> Result<(), Error> {
        let at_least_one = [
            ("workers", self.workers),
            ("queue_capacity", self.queue_capacity),
            ("max_inflight_tasks", self.max_inflight_tasks),
            ("stream_capacity", self.stream_capacity),
            ("max_retained", self.max_retained),
        ];
        for (field, value) in at_least_one {
            if value == 0 {
                return Err(Error::InvalidConfig {
                    field,
                    value: value.to_string(),
                    reason: "must be at least 1",
                });
            }
        }
        if self.workers > Self::MAX_WORKERS {
            return Err(Error::InvalidConfig {
                field: "workers",
                value: self.workers.to_string(),
                reason: "must be at most 4,096 (Config::MAX_WORKERS)",
            });
        }
        if self.queue_capacity > Self::MAX_QUEUE_CAPACITY {
            return Err(Error::InvalidConfig {
                field: "queue_capacity",
                value: self.queue_capacity.to_string(),
                reason: "must be at most 16,777,216 jobs (Config::MAX_QUEUE_CAPACITY)",
            });
        }
        if self.stream_capacity > crate::StreamOptions::MAX_CAPACITY {
            return Err(Error::InvalidConfig {
                field: "stream_capacity",
                value: self.stream_capacity.to_string(),
                reason: "must be at most 16,777,216 messages (StreamOptions::MAX_CAPACITY)",
            });
        }
        if self.route_cache_capacity > 1 << 24 {
            return Err(Error::InvalidConfig {
                field: "route_cache_capacity",
                value: self.route_cache_capacity.to_string(),
                reason: "must be at most 16,777,216 slots",
            });
        }
        if self.retained_expiry == Some(Duration::ZERO) {
            return Err(Error::InvalidConfig {
                field: "retained_expiry",
                value: "0s".into(),
                reason: "must be longer than zero (leave it out to keep retained messages)",
            });
        }
        Ok(())
    }
}

/// Serde for an optional duration: `null` (or absent) for none, else as
/// [`duration_text`].
mod option_duration_text {
    use std::time::Duration;

    use serde::{Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => super::duration_text::serialize(d, s),
            None => s.serialize_none(),
        }
    }

    #[derive(Deserialize)]
    struct Text(#[serde(with = "super::duration_text")] Duration);

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> Result<Option<Duration>, D::Error> {
        Ok(Option::<Text>::deserialize(d)?.map(|Text(d)| d))
    }
}

/// Serde for durations written the way people write them in config files.
mod duration_text {
    use std::time::Duration;

    use serde::de::{self, Visitor};
    use serde::{Deserializer, Serializer};

    /// Writes the coarsest unit that loses nothing.
    pub(super) fn serialize<S: Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
        let nanos = d.as_nanos();
        let text = if nanos % 1_000_000_000 == 0 {
            format!("{}s", d.as_secs())
        } else if nanos % 1_000_000 == 0 {
            format!("{}ms", d.as_millis())
        } else if nanos % 1_000 == 0 {
            format!("{}us", d.as_micros())
        } else {
            format!("{nanos}ns")
        };
        s.serialize_str(&text)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
        d.deserialize_any(DurationVisitor)
    }

    struct DurationVisitor;

    impl Visitor<'_> for DurationVisitor {
        type Value = Duration;

        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a duration such as \"30s\", \"250ms\", \"2m\", or a number of seconds")
        }

        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Duration, E> {
            Ok(Duration::from_secs(v))
        }

        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Duration, E> {
            u64::try_from(v)
                .map(Duration::from_secs)
                .map_err(|_| E::custom(format!("a duration cannot be negative: {v}")))
        }

        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Duration, E> {
            Duration::try_from_secs_f64(v)
                .map_err(|_| E::custom(format!("not a valid number of seconds: {v}")))
        }

        fn visit_str<E: de::Error>(self, v: &str) -> Result<Duration, E> {
            super::parse_duration(v).ok_or_else(|| {
                E::custom(format!(
                    "not a duration: {v:?} (write it like \"30s\", \"250ms\", \"2m\" or \"1h\")"
                ))
            })
        }
    }
}

/// Parses `"250ms"`, `"30s"`, `"2m"`, `"1h"`, `"1.5s"`, `"10us"`, `"5ns"`,
/// exactly (in whole nanoseconds, a finer fraction rounded to the nearest):
/// so every duration the serializer writes, `Duration::MAX` included, reads
/// back as itself.
fn parse_duration(text: &str) -> Option<Duration> {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    let text = text.trim();
    let split = text.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (number, unit) = text.split_at(split);
    let unit: u128 = match unit.trim() {
        "ns" => 1,
        "us" | "µs" => 1_000,
        "ms" => 1_000_000,
        "s" => NANOS_PER_SEC,
        "m" => 60 * NANOS_PER_SEC,
        "h" => 3_600 * NANOS_PER_SEC,
        _ => return None,
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
        return None;
    }
    let whole: u128 = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let mut nanos = whole.checked_mul(unit)?;
    if !fraction.is_empty() {
        // 20 digits are far below a nanosecond in every unit, and keep the
        // product within a u128.
        let digits = &fraction[..fraction.len().min(20)];
        let scale = 10u128.pow(digits.len() as u32);
        // Rounded to the nearest nanosecond, as a number of seconds is.
        let fraction = (digits.parse::<u128>().ok()? * unit + scale / 2) / scale;
        nanos = nanos.checked_add(fraction)?;
    }
    let seconds = u64::try_from(nanos / NANOS_PER_SEC).ok()?;
    Some(Duration::new(seconds, (nanos % NANOS_PER_SEC) as u32))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fraction_finer_than_a_nanosecond_rounds_to_the_nearest() {
        assert_eq!(
            parse_duration("1.9999999999s"),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            parse_duration("123.456789us"),
            Some(Duration::from_nanos(123_457))
        );
        assert_eq!(
            parse_duration("1.0000000004s"),
            Some(Duration::from_secs(1))
        );
        // As the same number of seconds written as a JSON number.
        assert_eq!(
            parse_duration("1.0000000005s"),
            Duration::try_from_secs_f64(1.000_000_000_5).ok()
        );
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(parse_duration("30s"), Some(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Some(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_duration("s"), None);
        assert_eq!(parse_duration("10"), None);
        assert_eq!(parse_duration("10 weeks"), None);
        assert_eq!(parse_duration("1500us"), Some(Duration::from_micros(1500)));
        assert_eq!(parse_duration("7ns"), Some(Duration::from_nanos(7)));
    }

    #[test]
    fn durations_round_trip_exactly() {
        for d in [
            Duration::from_secs(30),
            Duration::from_millis(1500),
            Duration::from_micros(1500),
            Duration::from_nanos(1_000_000_007),
        ] {
            let config = Config {
                close_timeout: d,
                ..Config::default()
            };
            let json = serde_json::to_string(&config).unwrap();
            let back: Config = serde_json::from_str(&json).unwrap();
            assert_eq!(back.close_timeout, d, "{json}");
        }
    }

    #[test]
    fn defaults_are_valid() {
        Config::default().validate().unwrap();
    }
}
