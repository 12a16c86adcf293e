//! Property tests (proptest): the library against models written here.
//!
//! - `matches` against a naive reference matcher (MQTT's rule stated level by
//!   level) over generated filters and topics with empty levels, `$` topics
//!   and multi-byte characters;
//! - validation against a reference validator: on any string, the exact
//!   [`TopicRule`] (or acceptance), and never a panic — in the validators, in
//!   `matches`, and in `publish` / `subscribe` / `subscribe_stream` /
//!   `subscribe_async`, which return the validator's error;
//! - random sequences of subscribe / unsubscribe / publish against a
//!   sequential model of who must receive what: exact after every step on an
//!   `Inline` bus (return values, every handler's and stream's deliveries,
//!   subscription count, trie size), and on a `WorkerPool` bus checked after
//!   `close` (exactly once for subscriptions alive at the end, at most once
//!   and never outside their lifetime for the others).
//!
//! Case counts are modest so the file runs in seconds in a debug build;
//! `PROPTEST_CASES` does not change them (they are set here), but the
//! generators can be explored further by raising them locally.

mod common;

use std::collections::{BTreeSet, HashSet};
use std::sync::{Arc, LazyLock, Mutex};

use blazesub::topic::{
    matches, validate_filter, validate_topic, TopicError, TopicKind, TopicRule, MAX_TOPIC_LEN,
};
use blazesub::{Batch, Bus, DeliveryMode, Error, Message, Receiver, Subscription, TryRecvError};
use proptest::prelude::*;
use proptest::sample::select;
use proptest::test_runner::Config as ProptestConfig;

// ---------------------------------------------------------------------------
// References
// ---------------------------------------------------------------------------

/// MQTT section 4.7 restated independently of `src/topic.rs`: which rule, if
/// any, `s` breaks as a topic name (`filter == false`) or filter.
fn reference_rule(s: &str, filter: bool) -> Option<TopicRule> {
    if s.is_empty() {
        return Some(TopicRule::Empty);
    }
    if s.len() > MAX_TOPIC_LEN {
        return Some(TopicRule::TooLong { len: s.len() });
    }
    if !filter {
        // A name reports its first offending character, NUL or wildcard.
        return s
            .char_indices()
            .find(|&(_, c)| c == '+' || c == '#' || c == '\0')
            .map(|(offset, c)| match c {
                '\0' => TopicRule::Nul { offset },
                wildcard => TopicRule::WildcardInName { offset, wildcard },
            });
    }
    // A filter reports a NUL anywhere before any wildcard rule.
    if let Some(offset) = s.find('\0') {
        return Some(TopicRule::Nul { offset });
    }
    let levels: Vec<&str> = s.split('/').collect();
    for (index, level) in levels.iter().enumerate() {
        let number = index + 1;
        let is_last = number == levels.len();
        if *level == "+" || (*level == "#" && is_last) {
            continue;
        }
        if *level == "#" {
            return Some(TopicRule::HashNotLast { level: number });
        }
        if let Some(wildcard) = level.chars().find(|&c| c == '+' || c == '#') {
            return Some(TopicRule::WildcardNotWholeLevel {
                level: number,
                wildcard,
            });
        }
    }
    None
}

/// The naive matcher: split both into levels; without a trailing `#` the
/// level counts are equal and each filter level is `+` or equal to the topic
/// level; with one, the topic has at least the levels before the `#` and
/// those agree the same way. First-level wildcards skip `$` topics.
fn reference_matches(filter: &str, topic: &str) -> bool {
    if reference_rule(filter, true).is_some() || reference_rule(topic, false).is_some() {
        return false;
    }
    let f: Vec<&str> = filter.split('/').collect();
    let t: Vec<&str> = topic.split('/').collect();
    if topic.starts_with('$') && (f[0] == "+" || f[0] == "#") {
        return false;
    }
    let level_agrees = |(fl, tl): (&&str, &&str)| *fl == "+" || fl == tl;
    if f.last() == Some(&"#") {
        let fixed = &f[..f.len() - 1];
        t.len() >= fixed.len() && fixed.iter().zip(&t).all(level_agrees)
    } else {
        f.len() == t.len() && f.iter().zip(&t).all(level_agrees)
    }
}

/// The trie nodes a set of filters needs: one per distinct level path (every
/// prefix of a filter ending at a `/`, and the filter itself).
fn reference_trie_nodes<'a>(filters: impl Iterator<Item = &'a str>) -> usize {
    let mut paths = HashSet::new();
    for filter in filters {
        for (i, _) in filter.match_indices('/') {
            paths.insert(&filter[..i]);
        }
        paths.insert(filter);
    }
    paths.len()
}

// ---------------------------------------------------------------------------
// Generators
// ---------------------------------------------------------------------------

/// Levels a topic name is made of: empty ones, `$` ones, multi-byte and
/// combining characters, spaces, case variants; plus small random ones.
const NAME_LEVELS: &[&str] = &[
    "", "a", "b", "ab", "A", "$", "$SYS", "$a", "é", "e\u{301}", "日本", "🌡", " ", "a b",
];

fn name_level() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => select(NAME_LEVELS).prop_map(String::from),
        1 => "[ab$é日 ]{0,3}",
    ]
}

fn topic_name() -> impl Strategy<Value = String> {
    prop::collection::vec(name_level(), 1..=5)
        .prop_map(|levels| levels.join("/"))
        .prop_filter("topic names are not empty", |t| !t.is_empty())
}

fn filter_level() -> impl Strategy<Value = String> {
    prop_oneof![3 => name_level(), 1 => Just("+".to_string())]
}

/// Any valid filter, often ending in `#`.
fn any_filter() -> impl Strategy<Value = String> {
    (prop::collection::vec(filter_level(), 0..=5), any::<bool>())
        .prop_map(|(mut levels, hash)| {
            if hash || levels.is_empty() {
                levels.push("#".to_string());
            }
            levels.join("/")
        })
        .prop_filter("filters are not empty", |f| !f.is_empty())
}

/// A filter made from `topic` (so matches are common): some levels become
/// `+`, it may be cut short and end in `#`, one level may be changed.
fn filter_near(topic: String) -> impl Strategy<Value = String> {
    let levels = topic.split('/').count();
    (
        prop::collection::vec(any::<bool>(), levels),
        prop::option::of(0..=levels),
        prop::option::of((0..levels, name_level())),
    )
        .prop_map(move |(plus, cut, change)| {
            let mut out: Vec<String> = topic.split('/').map(String::from).collect();
            if let Some((at, level)) = change {
                out[at] = level;
            }
            for (level, plus) in out.iter_mut().zip(plus) {
                if plus {
                    *level = "+".to_string();
                }
            }
            if let Some(cut) = cut {
                out.truncate(cut);
                out.push("#".to_string());
            }
            out.join("/")
        })
        .prop_filter("filters are not empty", |f| !f.is_empty())
}

fn filter_for_some_topic() -> impl Strategy<Value = (String, String)> {
    prop_oneof![
        topic_name().prop_flat_map(|t| (filter_near(t.clone()), Just(t))),
        (any_filter(), topic_name()),
    ]
}

/// Strings heavy in the characters the rules are about, plus any character.
fn odd_string() -> impl Strategy<Value = String> {
    let c = prop_oneof![
        3 => Just('/'),
        2 => Just('+'),
        2 => Just('#'),
        1 => Just('\0'),
        1 => Just('$'),
        2 => Just('a'),
        1 => Just('é'),
        2 => any::<char>(),
    ];
    prop::collection::vec(c, 0..24).prop_map(|chars| chars.into_iter().collect())
}

/// Strings around the 65,535-byte limit, built from one repeated piece (so
/// they are deep filters when the piece is `a/` or `+/`), sometimes with an
/// odd character spliced in.
fn long_string() -> impl Strategy<Value = String> {
    (
        MAX_TOPIC_LEN - 6..MAX_TOPIC_LEN + 6,
        select(&["a", "é", "a/", "+/", "/"][..]),
        prop::option::of((
            any::<prop::sample::Index>(),
            select(&['+', '#', '\0', 'é'][..]),
        )),
    )
        .prop_map(|(bytes, piece, splice)| {
            let mut s = piece.repeat(bytes / piece.len() + 1);
            let mut cut = bytes.min(s.len());
            while !s.is_char_boundary(cut) {
                cut -= 1;
            }
            s.truncate(cut);
            if let Some((at, c)) = splice {
                let mut at = at.index(s.len() + 1);
                while !s.is_char_boundary(at) {
                    at -= 1;
                }
                s.insert(at, c);
            }
            s
        })
}

// ---------------------------------------------------------------------------
// Matching and validation
// ---------------------------------------------------------------------------

fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        // Nothing is written into the source tree: a failure prints its
        // minimal input, which is what a regression test should be made of.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

/// Checks one string through the validators against the reference.
fn check_validation(s: &str) -> Result<(), TestCaseError> {
    for (filter, result) in [(false, validate_topic(s)), (true, validate_filter(s))] {
        let kind = if filter {
            TopicKind::Filter
        } else {
            TopicKind::Name
        };
        match (result, reference_rule(s, filter)) {
            (Ok(()), None) => {}
            (Err(e), Some(rule)) => {
                prop_assert_eq!(e.rule(), &rule, "{:?} as a {}", s, kind);
                prop_assert_eq!(e.kind(), kind);
                // The input is quoted (shortened past 96 characters).
                let quoted = e.input().trim_end_matches('…');
                prop_assert!(s.starts_with(quoted), "quoted {:?}", e.input());
                let text = e.to_string();
                let prefix = format!("invalid {kind} ");
                prop_assert!(text.starts_with(&prefix), "{}", text);
                prop_assert!(text.ends_with(&rule.to_string()), "{}", text);
            }
            (got, want) => {
                prop_assert!(
                    false,
                    "{:?} as a {}: got {:?}, reference {:?}",
                    s,
                    kind,
                    got,
                    want
                )
            }
        }
    }
    Ok(())
}

proptest! {
    #![proptest_config(config(2_000))]

    /// `matches` agrees with the reference on valid filters and topics, and
    /// a filter made from a topic without changing a level always matches.
    #[test]
    fn matches_agrees_with_the_reference((filter, topic) in filter_for_some_topic()) {
        prop_assert_eq!(validate_filter(&filter), Ok(()), "generated filter {:?}", filter);
        prop_assert_eq!(validate_topic(&topic), Ok(()), "generated topic {:?}", topic);
        prop_assert_eq!(
            matches(&filter, &topic),
            reference_matches(&filter, &topic),
            "filter {:?} topic {:?}", filter, topic
        );
    }

    /// The trivial cases the reference is built on: a topic matches itself,
    /// `#` matches it unless it starts with `$`, and `topic/#` matches it.
    #[test]
    fn a_topic_matches_itself_and_hash(topic in topic_name()) {
        prop_assert!(matches(&topic, &topic), "{:?}", topic);
        prop_assert_eq!(matches("#", &topic), !topic.starts_with('$'), "{:?}", topic);
        let below = format!("{topic}/#");
        prop_assert!(matches(&below, &topic), "{:?} / {:?}", below, topic);
    }
}

proptest! {
    #![proptest_config(config(600))]

    /// Validation on odd strings gives the reference's exact rule; `matches`
    /// on any pair (valid or not) agrees with the reference and never panics.
    #[test]
    fn validation_and_matching_on_odd_strings(a in odd_string(), b in odd_string()) {
        check_validation(&a)?;
        check_validation(&b)?;
        prop_assert_eq!(matches(&a, &b), reference_matches(&a, &b), "{:?} / {:?}", a, b);
        prop_assert_eq!(matches(&b, &a), reference_matches(&b, &a), "{:?} / {:?}", b, a);
    }

    /// The same through a bus: `publish`, `subscribe`, `subscribe_stream`
    /// and `subscribe_async` return the validator's error (never panic, never
    /// accept an invalid input); valid ones work, and a subscription made
    /// from one string receives a publish to another iff the reference says
    /// it matches.
    #[test]
    fn the_bus_agrees_with_the_validators(a in odd_string(), b in odd_string()) {
        check_bus(&a, &b)?;
    }
}

proptest! {
    #![proptest_config(config(12))]

    /// Strings around the length limit (deep filters among them).
    #[test]
    fn long_strings_are_judged_exactly(s in long_string()) {
        check_validation(&s)?;
        check_bus(&s, &s)?;
        check_bus(&s, "a")?;
    }
}

/// A runtime for `subscribe_async`, shared by the test threads.
static RUNTIME: LazyLock<tokio::runtime::Runtime> = LazyLock::new(|| common::runtime(1));

thread_local! {
    /// One bus per test thread, shared by its cases (tests run in parallel,
    /// and each checks the bus is empty after every case).
    static INLINE: Bus<u32> = Bus::builder()
        .delivery(DeliveryMode::Inline)
        .runtime(RUNTIME.handle().clone())
        .build()
        .unwrap();
}

fn expect_topic_error<T: std::fmt::Debug>(
    what: &str,
    got: Result<T, Error>,
    want: &Result<(), TopicError>,
) -> Result<Option<T>, TestCaseError> {
    match (got, want) {
        (Ok(value), Ok(())) => Ok(Some(value)),
        (Err(Error::Topic(e)), Err(expected)) => {
            prop_assert_eq!(&e, expected, "{}", what);
            Ok(None)
        }
        (got, want) => Err(TestCaseError::fail(format!(
            "{what}: got {got:?}, the validator says {want:?}"
        ))),
    }
}

fn check_bus(filter: &str, topic: &str) -> Result<(), TestCaseError> {
    INLINE.with(|bus| check_bus_on(bus, filter, topic))
}

fn check_bus_on(bus: &Bus<u32>, filter: &str, topic: &str) -> Result<(), TestCaseError> {
    let short: String = filter.chars().take(24).collect();
    let seen = Arc::new(Mutex::new(0u32));
    let mine = Arc::clone(&seen);
    let sub = expect_topic_error(
        &format!("subscribe({short:?}..)"),
        bus.subscribe(filter, move |_: &Message<u32>| *mine.lock().unwrap() += 1),
        &validate_filter(filter),
    )?;
    let rx = expect_topic_error(
        &format!("subscribe_stream({short:?}..)"),
        bus.subscribe_stream(filter),
        &validate_filter(filter),
    )?;
    let async_sub = expect_topic_error(
        &format!("subscribe_async({short:?}..)"),
        bus.subscribe_async(filter, |_: Arc<Message<u32>>| async {}),
        &validate_filter(filter),
    )?;
    let published = expect_topic_error(
        &format!(
            "publish({:?}..)",
            topic.chars().take(24).collect::<String>()
        ),
        bus.publish(topic, 7),
        &validate_topic(topic),
    )?;
    let reaches = reference_matches(filter, topic);
    if let Some(matched) = published {
        // Our three subscriptions, if they exist and match.
        let ours = if sub.is_some() && reaches { 3 } else { 0 };
        prop_assert_eq!(matched, ours, "{:?} / {:?}", short, topic);
    }
    if let Some(mut rx) = rx {
        let got = rx.try_recv();
        if published.is_some() && reaches {
            prop_assert_eq!(got.map(|m| *m.data()), Ok(7));
        } else {
            prop_assert_eq!(got.map(|m| *m.data()), Err(TryRecvError::Empty));
        }
    }
    prop_assert_eq!(
        *seen.lock().unwrap(),
        u32::from(published.is_some() && reaches && sub.is_some())
    );
    drop((sub, async_sub));
    prop_assert_eq!(bus.subscriptions_count(), 0);
    prop_assert_eq!(
        bus.footprint().trie_nodes,
        0,
        "the trie was left with nodes"
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// Random operation sequences against a sequential model
// ---------------------------------------------------------------------------

#[derive(Clone, Debug)]
enum Op {
    /// Subscribe to `filters[filter % len]`, as a stream or a handler.
    Subscribe { filter: usize, stream: bool },
    /// Unsubscribe the `which % live`-th live subscription, by
    /// `unsubscribe()` or by dropping it.
    Unsubscribe { which: usize, explicit: bool },
    /// Publish to `topics[topic % len]`.
    Publish { topic: usize },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (any::<usize>(), prop::bool::weighted(0.25))
            .prop_map(|(filter, stream)| Op::Subscribe { filter, stream }),
        2 => (any::<usize>(), any::<bool>())
            .prop_map(|(which, explicit)| Op::Unsubscribe { which, explicit }),
        4 => any::<usize>().prop_map(|topic| Op::Publish { topic }),
    ]
}

#[derive(Debug)]
struct Scenario {
    topics: Vec<String>,
    filters: Vec<String>,
    ops: Vec<Op>,
}

fn scenario(max_ops: usize) -> impl Strategy<Value = Scenario> {
    prop::collection::vec(topic_name(), 1..5).prop_flat_map(move |topics| {
        let near = select(topics.clone()).prop_flat_map(filter_near);
        let filter = prop_oneof![3 => near, 1 => any_filter()];
        (
            Just(topics),
            prop::collection::vec(filter, 1..8),
            prop::collection::vec(op(), 1..max_ops),
        )
            .prop_map(|(topics, filters, ops)| Scenario {
                topics,
                filters,
                ops,
            })
    })
}

enum Handle {
    Handler(Subscription, Arc<Mutex<Vec<u32>>>),
    Stream(Receiver<u32>),
}

/// One subscription of the model: its filter, handle, and the messages the
/// model says it must get.
struct Live {
    filter: String,
    handle: Handle,
    expected: Vec<u32>,
}

/// What a handler subscription received and was owed, once it is gone.
struct Gone {
    filter: String,
    /// Read at the end: a call that began before the unsubscribe may still
    /// be running when it returns (and record its message after).
    received: Arc<Mutex<Vec<u32>>>,
    owed: Vec<u32>,
}

impl Gone {
    fn received(&self) -> Vec<u32> {
        self.received.lock().unwrap().clone()
    }
}

/// What a scenario left behind.
struct Outcome {
    /// Subscriptions still alive.
    live: Vec<Live>,
    /// Handler subscriptions removed on the way.
    gone: Vec<Gone>,
    /// Deliveries the model owed in all (handlers and streams).
    owed: u64,
    /// Stream messages taken (each owed, each counted as delivered).
    stream_taken: u64,
}

/// Runs `scenario` on `bus`. With `exact` (an `Inline` bus) every handler's
/// deliveries are compared with the model after every publish; otherwise
/// they are returned for checking after `close`. Stream pushes happen on the
/// publisher in every mode, so streams are checked exactly either way.
fn run(bus: &Bus<u32>, scenario: &Scenario, exact: bool) -> Result<Outcome, TestCaseError> {
    let mut live: Vec<Live> = Vec::new();
    let mut gone: Vec<Gone> = Vec::new();
    let mut next_message = 0u32;
    let mut owed_total = 0u64;
    let mut stream_taken = 0u64;
    for (step, op) in scenario.ops.iter().enumerate() {
        match *op {
            Op::Subscribe { filter, stream } => {
                let filter = scenario.filters[filter % scenario.filters.len()].clone();
                let handle = if stream {
                    Handle::Stream(bus.subscribe_stream(&filter).unwrap())
                } else {
                    let received = Arc::new(Mutex::new(Vec::new()));
                    let mine = Arc::clone(&received);
                    let sub = bus
                        .subscribe(&filter, move |m: &Message<u32>| {
                            mine.lock().unwrap().push(*m.data())
                        })
                        .unwrap();
                    Handle::Handler(sub, received)
                };
                live.push(Live {
                    filter,
                    handle,
                    expected: Vec::new(),
                });
            }
            Op::Unsubscribe { which, explicit } => {
                if live.is_empty() {
                    continue;
                }
                let entry = live.remove(which % live.len());
                match entry.handle {
                    Handle::Handler(sub, received) => {
                        if explicit {
                            sub.unsubscribe();
                        } else {
                            drop(sub);
                        }
                        gone.push(Gone {
                            filter: entry.filter,
                            received,
                            owed: entry.expected,
                        });
                    }
                    Handle::Stream(rx) => drop(rx),
                }
            }
            Op::Publish { topic } => {
                let topic = &scenario.topics[topic % scenario.topics.len()];
                let id = next_message;
                next_message += 1;
                let mut reached = 0;
                for entry in &mut live {
                    if reference_matches(&entry.filter, topic) {
                        entry.expected.push(id);
                        reached += 1;
                    }
                }
                owed_total += reached as u64;
                prop_assert_eq!(
                    bus.publish(topic, id).unwrap(),
                    reached,
                    "step {}: publish({:?}) with live filters {:?}",
                    step,
                    topic,
                    live.iter().map(|l| &l.filter).collect::<Vec<_>>()
                );
                for entry in &mut live {
                    match &mut entry.handle {
                        Handle::Handler(_, received) if exact => {
                            prop_assert_eq!(
                                &*received.lock().unwrap(),
                                &entry.expected,
                                "step {}: handler on {:?} after publish({:?})",
                                step,
                                entry.filter,
                                topic
                            );
                        }
                        Handle::Handler(..) => {}
                        Handle::Stream(rx) => {
                            let got = rx.try_recv().map(|m| *m.data());
                            if entry.expected.last() == Some(&id) {
                                prop_assert_eq!(
                                    got,
                                    Ok(id),
                                    "step {}: stream {:?}",
                                    step,
                                    entry.filter
                                );
                                stream_taken += 1;
                            } else {
                                prop_assert_eq!(
                                    got,
                                    Err(TryRecvError::Empty),
                                    "step {}: stream {:?} got a message it was not owed",
                                    step,
                                    entry.filter
                                );
                            }
                            prop_assert_eq!(
                                rx.try_recv().map(|m| *m.data()),
                                Err(TryRecvError::Empty),
                                "step {}: stream {:?} got more than owed",
                                step,
                                entry.filter
                            );
                        }
                    }
                }
            }
        }
        prop_assert_eq!(
            bus.subscriptions_count(),
            live.len() as u64,
            "step {}",
            step
        );
        prop_assert_eq!(
            bus.footprint().trie_nodes,
            reference_trie_nodes(live.iter().map(|l| l.filter.as_str())),
            "step {}: trie nodes for live filters {:?}",
            step,
            live.iter().map(|l| &l.filter).collect::<Vec<_>>()
        );
    }
    Ok(Outcome {
        live,
        gone,
        owed: owed_total,
        stream_taken,
    })
}

fn block_on_close(bus: &Bus<u32>) {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
        .block_on(bus.close())
        .expect("close");
}

proptest! {
    #![proptest_config(config(192))]

    /// Inline: after every step, exactly what the model says.
    #[test]
    fn inline_bus_follows_the_model(
        scenario in scenario(60),
        cache in select(&[0usize, 1, 2, 4_096][..]),
    ) {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::Inline)
            .route_cache_capacity(cache)
            .build()
            .unwrap();
        let Outcome { live, gone, owed, .. } = run(&bus, &scenario, true)?;
        for g in &gone {
            prop_assert_eq!(&g.received(), &g.owed, "unsubscribed handler on {:?}", g.filter);
        }
        let stats = bus.stats();
        prop_assert_eq!(stats.delivered, owed, "stats().delivered");
        prop_assert_eq!((stats.dropped, stats.handler_panics, stats.inflight), (0, 0, 0));
        drop(live);
        prop_assert_eq!(bus.subscriptions_count(), 0);
        prop_assert_eq!(bus.footprint().trie_nodes, 0, "nodes left after every unsubscribe");
        for topic in &scenario.topics {
            prop_assert_eq!(bus.publish(topic, u32::MAX).unwrap(), 0);
        }
    }
}

proptest! {
    #![proptest_config(config(48))]

    /// A worker pool (1–3 workers, any threshold and batch policy, a queue
    /// of 1 or 4,096 so the publisher sometimes runs the work): after
    /// `close`, every subscription alive at the end got exactly what the
    /// model owed it; one unsubscribed earlier got a subset of it (queued
    /// deliveries may be cancelled by the unsubscribe), none twice; every
    /// count adds up.
    #[test]
    fn worker_pool_bus_follows_the_model_after_close(
        scenario in scenario(60),
        workers in 1usize..=3,
        threshold in 0usize..=4,
        batch in select(&[Batch::Single, Batch::Chunked][..]),
        queue in select(&[1usize, 4_096][..]),
        cache in select(&[0usize, 2, 4_096][..]),
    ) {
        let bus = Bus::<u32>::builder()
            .delivery(DeliveryMode::WorkerPool)
            .workers(workers)
            .max_concurrent_subscriptions(threshold)
            .batch(batch)
            .queue_capacity(queue)
            .route_cache_capacity(cache)
            .build()
            .unwrap();
        let Outcome { live, gone, stream_taken, .. } = run(&bus, &scenario, false)?;
        block_on_close(&bus);
        prop_assert_eq!(bus.inflight_messages(), 0);
        let mut delivered = 0u64;
        for g in &gone {
            let calls = g.received();
            let received: BTreeSet<u32> = calls.iter().copied().collect();
            prop_assert_eq!(received.len(), calls.len(), "a duplicate on {:?}", g.filter);
            let owed: BTreeSet<u32> = g.owed.iter().copied().collect();
            prop_assert!(received.is_subset(&owed),
                "unsubscribed handler on {:?} got {:?}, owed only {:?}", g.filter, received, owed);
            delivered += calls.len() as u64;
        }
        for l in &live {
            match &l.handle {
                Handle::Handler(_, received) => {
                    let mut got = received.lock().unwrap().clone();
                    got.sort_unstable();
                    prop_assert_eq!(&got, &l.expected, "handler on {:?} alive at close", l.filter);
                    delivered += got.len() as u64;
                }
                Handle::Stream(_) => {}
            }
        }
        let stats = bus.stats();
        prop_assert_eq!((stats.dropped, stats.handler_panics), (0, 0));
        // Every handler call that ran and every stream message taken.
        prop_assert_eq!(stats.delivered, delivered + stream_taken);
        drop(live);
        prop_assert_eq!(bus.footprint().trie_nodes, 0);
    }
}
