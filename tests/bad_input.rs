//! Bad input: every class of malformed topic name, topic filter and
//! configuration value, and every call made where it cannot work, with the
//! exact error each gets — variant, fields (the [`TopicRule`] for topics) and
//! display text — through the validators, `publish`, `subscribe`,
//! `subscribe_stream` and `subscribe_async`, `Config::validate`,
//! `Bus::new` and the builder. None panics.
//!
//! The table in `docs/reliability.md` ("Bad input") is generated from the
//! same cases: `the_page_shows_exactly_these_cases` fails, printing the
//! table to paste, when the page and the cases disagree.
//! `tests/topics.rs` and `tests/config.rs` check these rules one by one;
//! this file is the complete inventory.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use blazesub::topic::{matches, validate_filter, validate_topic, TopicError, TopicKind, TopicRule};
use blazesub::{Bus, Config, DeliveryMode, Error, Message, StreamOptions, StreamOverflow};

/// One malformed (or legal but surprising) topic name or filter.
struct TopicCase {
    class: &'static str,
    /// How the input is shown in the table.
    shown: String,
    input: String,
    kind: TopicKind,
    /// The rule broken, or `None` if the input is legal.
    rule: Option<TopicRule>,
}

fn case(class: &'static str, input: &str, kind: TopicKind, rule: Option<TopicRule>) -> TopicCase {
    TopicCase {
        class,
        shown: format!("`{input:?}`"),
        input: input.to_string(),
        kind,
        rule,
    }
}

fn long(
    class: &'static str,
    piece: &str,
    times: usize,
    kind: TopicKind,
    rule: Option<TopicRule>,
) -> TopicCase {
    TopicCase {
        class,
        shown: format!("`{piece:?}` × {times}"),
        input: piece.repeat(times),
        kind,
        rule,
    }
}

fn topic_cases() -> Vec<TopicCase> {
    use TopicKind::{Filter, Name};
    use TopicRule::*;
    vec![
        case("empty filter", "", Filter, Some(Empty)),
        case(
            "shared: empty share name",
            "$share//orders/#",
            Filter,
            Some(ShareNameEmpty),
        ),
        case(
            "shared: wildcard in the share name",
            "$share/bill+ing/orders",
            Filter,
            Some(ShareNameWildcard { wildcard: '+' }),
        ),
        case(
            "shared: no filter",
            "$share/billing",
            Filter,
            Some(ShareFilterMissing),
        ),
        case(
            "shared: empty filter",
            "$share/billing/",
            Filter,
            Some(ShareFilterMissing),
        ),
        case(
            "shared: invalid filter (levels count in the whole input)",
            "$share/billing/orders/#/eu",
            Filter,
            Some(HashNotLast { level: 4 }),
        ),
        case("shared: valid", "$share/billing/orders/+/eu", Filter, None),
        case(
            "`+` inside a level",
            "sport+",
            Filter,
            Some(WildcardNotWholeLevel {
                level: 1,
                wildcard: '+',
            }),
        ),
        case(
            "`+` inside a deeper level",
            "a/b+c/d",
            Filter,
            Some(WildcardNotWholeLevel {
                level: 2,
                wildcard: '+',
            }),
        ),
        case(
            "`+` next to a multi-byte character",
            "a/é+",
            Filter,
            Some(WildcardNotWholeLevel {
                level: 2,
                wildcard: '+',
            }),
        ),
        case(
            "`#` inside a level",
            "sport/tennis#",
            Filter,
            Some(WildcardNotWholeLevel {
                level: 2,
                wildcard: '#',
            }),
        ),
        case(
            "`##`",
            "##",
            Filter,
            Some(WildcardNotWholeLevel {
                level: 1,
                wildcard: '#',
            }),
        ),
        case(
            "`+#` (first wildcard named)",
            "+#",
            Filter,
            Some(WildcardNotWholeLevel {
                level: 1,
                wildcard: '+',
            }),
        ),
        case(
            "`#` not last",
            "sport/#/ranking",
            Filter,
            Some(HashNotLast { level: 2 }),
        ),
        case(
            "`#` first, not last",
            "#/a",
            Filter,
            Some(HashNotLast { level: 1 }),
        ),
        case(
            "`#` then `/`",
            "a/#/",
            Filter,
            Some(HashNotLast { level: 2 }),
        ),
        case("NUL in a filter", "a/\0/b", Filter, Some(Nul { offset: 2 })),
        case(
            "NUL after a bad wildcard (NUL wins)",
            "a+/\0",
            Filter,
            Some(Nul { offset: 3 }),
        ),
        long(
            "over-long filter (65,536 bytes)",
            "x",
            65_536,
            Filter,
            Some(TooLong { len: 65_536 }),
        ),
        long(
            "over-long in bytes, not characters",
            "é",
            32_768,
            Filter,
            Some(TooLong { len: 65_536 }),
        ),
        case("empty topic name", "", Name, Some(Empty)),
        case(
            "`+` in a topic name",
            "a/+",
            Name,
            Some(WildcardInName {
                offset: 2,
                wildcard: '+',
            }),
        ),
        case(
            "`#` in a topic name",
            "a/#",
            Name,
            Some(WildcardInName {
                offset: 2,
                wildcard: '#',
            }),
        ),
        case(
            "`+` inside a level of a name",
            "sport+",
            Name,
            Some(WildcardInName {
                offset: 5,
                wildcard: '+',
            }),
        ),
        case(
            "`#` after a multi-byte character",
            "é#",
            Name,
            Some(WildcardInName {
                offset: 2,
                wildcard: '#',
            }),
        ),
        case("NUL in a topic name", "a\0b", Name, Some(Nul { offset: 1 })),
        case(
            "wildcard before NUL (first one named)",
            "+\0",
            Name,
            Some(WildcardInName {
                offset: 0,
                wildcard: '+',
            }),
        ),
        case(
            "NUL before wildcard (first one named)",
            "\0+",
            Name,
            Some(Nul { offset: 0 }),
        ),
        long(
            "over-long topic name (65,536 bytes)",
            "x",
            65_536,
            Name,
            Some(TooLong { len: 65_536 }),
        ),
        // Legal, listed so the table shows where the lines are.
        case("`$` topic (legal)", "$SYS/uptime", Name, None),
        case("empty levels (legal)", "a//b", Name, None),
        case("`/` alone: two empty levels (legal)", "/", Name, None),
        case("trailing `/` (legal)", "a/", Name, None),
        long(
            "longest topic name: 65,535 bytes (legal)",
            "x",
            65_535,
            Name,
            None,
        ),
        case("wildcards as whole levels (legal)", "+/a/#", Filter, None),
        case("`$` filter (legal)", "$SYS/#", Filter, None),
        long("32,768 levels of `+` (legal)", "+/", 32_767, Filter, None).with_suffix("+"),
    ]
}

impl TopicCase {
    fn with_suffix(mut self, suffix: &str) -> Self {
        self.input.push_str(suffix);
        self.shown = format!("{} + `{suffix:?}`", self.shown);
        self
    }

    /// The exact text of the error.
    fn expected_text(&self) -> Option<String> {
        let rule = self.rule.as_ref()?;
        let quoted: String = match self.input.char_indices().nth(96) {
            Some((cut, _)) => format!("{}…", &self.input[..cut]),
            None => self.input.clone(),
        };
        Some(format!("invalid {} {quoted:?}: {rule}", self.kind))
    }
}

fn inline_bus() -> Bus<u32> {
    Bus::builder()
        .delivery(DeliveryMode::Inline)
        .runtime(RUNTIME.handle().clone())
        .build()
        .unwrap()
}

static RUNTIME: std::sync::LazyLock<tokio::runtime::Runtime> = std::sync::LazyLock::new(|| {
    tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap()
});

#[track_caller]
fn assert_topic_error<T: std::fmt::Debug>(what: &str, got: Result<T, Error>, case: &TopicCase) {
    match (got, &case.rule) {
        (Ok(_), None) => {}
        (Err(Error::Topic(e)), Some(rule)) => {
            assert_eq!(e.rule(), rule, "{what}: {}", case.class);
            assert_eq!(e.kind(), case.kind, "{what}: {}", case.class);
            assert_eq!(
                Some(e.to_string()),
                case.expected_text(),
                "{what}: {}",
                case.class
            );
            // `Error`'s own text is the topic error's.
            assert_eq!(Error::Topic(e.clone()).to_string(), e.to_string());
        }
        (got, want) => panic!("{what}: {}: got {got:?}, expected {want:?}", case.class),
    }
}

/// Every topic case gives its exact rule and text in the validator and
/// through every call that takes it.
#[test]
fn every_malformed_topic_and_filter_gets_its_exact_error() {
    let bus = inline_bus();
    for case in topic_cases() {
        let validated: Result<(), TopicError> = match case.kind {
            TopicKind::Name => validate_topic(&case.input),
            TopicKind::Filter => validate_filter(&case.input),
        };
        assert_topic_error("validate", validated.map_err(Error::Topic), &case);
        match case.kind {
            TopicKind::Name => {
                assert_topic_error("publish", bus.publish(&case.input, 1), &case);
                assert_topic_error(
                    "publish_with",
                    bus.publish_with(&case.input, 1, Default::default()),
                    &case,
                );
                // `matches` answers false for an invalid name, true for `#`
                // on a legal one that does not start with `$`.
                let expected = case.rule.is_none() && !case.input.starts_with('$');
                assert_eq!(matches("#", &case.input), expected, "{}", case.class);
            }
            TopicKind::Filter => {
                assert_topic_error(
                    "subscribe",
                    bus.subscribe(&case.input, |_: &Message<u32>| {}),
                    &case,
                );
                assert_topic_error("subscribe_stream", bus.subscribe_stream(&case.input), &case);
                assert_topic_error(
                    "subscribe_stream_with_capacity",
                    bus.subscribe_stream_with_capacity(&case.input, 8),
                    &case,
                );
                assert_topic_error(
                    "subscribe_async",
                    bus.subscribe_async(&case.input, |_: Arc<Message<u32>>| async {}),
                    &case,
                );
                assert!(
                    !matches(&case.input, "a") || case.rule.is_none(),
                    "{}",
                    case.class
                );
            }
        }
        assert_eq!(
            bus.subscriptions_count(),
            0,
            "{}: a refused subscription stayed",
            case.class
        );
    }
    // Only the legal names were published (twice each).
    let legal_names = topic_cases()
        .iter()
        .filter(|c| c.kind == TopicKind::Name && c.rule.is_none())
        .count() as u64;
    assert_eq!(bus.stats().published, 2 * legal_names);
}

/// `$` topics are legal and reachable, but not by a filter whose first
/// level is a wildcard.
#[test]
fn dollar_topics_are_legal_but_skip_first_level_wildcards() {
    let bus = inline_bus();
    let rows = [
        ("#", "$SYS/uptime", false),
        ("+/uptime", "$SYS/uptime", false),
        ("+/+", "$/x", false),
        ("+", "$", false),
        ("$SYS/#", "$SYS/uptime", true),
        ("$SYS/+", "$SYS/uptime", true),
        ("$SYS/uptime", "$SYS/uptime", true),
        ("a/$/#", "a/$/b", true),
        ("a/+/#", "a/$x/b", true),
    ];
    for (filter, topic, delivered) in rows {
        let hits = Arc::new(AtomicUsize::new(0));
        let h = Arc::clone(&hits);
        let sub = bus
            .subscribe(filter, move |_: &Message<u32>| {
                h.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
        assert_eq!(
            bus.publish(topic, 0).unwrap(),
            usize::from(delivered),
            "{filter} / {topic}"
        );
        assert_eq!(
            hits.load(Ordering::SeqCst),
            usize::from(delivered),
            "{filter} / {topic}"
        );
        assert_eq!(matches(filter, topic), delivered, "{filter} / {topic}");
        drop(sub);
    }
}

// ---------------------------------------------------------------------------
// Configuration and misuse
// ---------------------------------------------------------------------------

/// One bad configuration value or impossible call, and its exact error.
struct MisuseCase {
    class: &'static str,
    shown: &'static str,
    /// Runs the call; returns its error.
    run: fn() -> Error,
    check: fn(&Error) -> bool,
    text: &'static str,
}

fn build(change: fn(&mut Config)) -> Error {
    let mut config = Config::default();
    change(&mut config);
    let validated = config.validate().expect_err("validate accepted it");
    let built = Bus::<u32>::new(config.clone()).expect_err("Bus::new accepted it");
    let from_builder = Bus::<u32>::builder()
        .config(config)
        .build()
        .expect_err("the builder accepted it");
    assert_eq!(validated.to_string(), built.to_string());
    assert_eq!(validated.to_string(), from_builder.to_string());
    built
}

fn closed_bus() -> Bus<u32> {
    let bus = inline_bus();
    RUNTIME.block_on(bus.close()).unwrap();
    bus
}

fn misuse_cases() -> Vec<MisuseCase> {
    vec![
        MisuseCase {
            class: "zero workers",
            shown: "`workers: 0`",
            run: || build(|c| c.workers = 0),
            check: |e| matches!(e, Error::InvalidConfig { field: "workers", value, reason: "must be at least 1" } if value == "0"),
            text: "invalid configuration: `workers` = 0 must be at least 1",
        },
        MisuseCase {
            class: "zero queue capacity",
            shown: "`queue_capacity: 0`",
            run: || build(|c| c.queue_capacity = 0),
            check: |e| matches!(e, Error::InvalidConfig { field: "queue_capacity", value, .. } if value == "0"),
            text: "invalid configuration: `queue_capacity` = 0 must be at least 1",
        },
        MisuseCase {
            class: "zero task cap",
            shown: "`max_inflight_tasks: 0`",
            run: || build(|c| c.max_inflight_tasks = 0),
            check: |e| matches!(e, Error::InvalidConfig { field: "max_inflight_tasks", value, .. } if value == "0"),
            text: "invalid configuration: `max_inflight_tasks` = 0 must be at least 1",
        },
        MisuseCase {
            class: "zero stream capacity",
            shown: "`stream_capacity: 0`",
            run: || build(|c| c.stream_capacity = 0),
            check: |e| matches!(e, Error::InvalidConfig { field: "stream_capacity", value, .. } if value == "0"),
            text: "invalid configuration: `stream_capacity` = 0 must be at least 1",
        },
        MisuseCase {
            class: "stream capacity too large",
            shown: "`stream_capacity: 16_777_217`",
            run: || build(|c| c.stream_capacity = (1 << 24) + 1),
            check: |e| matches!(e, Error::InvalidConfig { field: "stream_capacity", value, reason: "must be at most 16,777,216 messages (StreamOptions::MAX_CAPACITY)" } if value == "16777217"),
            text: "invalid configuration: `stream_capacity` = 16777217 must be at most 16,777,216 messages (StreamOptions::MAX_CAPACITY)",
        },
        MisuseCase {
            class: "route cache too large",
            shown: "`route_cache_capacity: 16_777_217`",
            run: || build(|c| c.route_cache_capacity = (1 << 24) + 1),
            check: |e| matches!(e, Error::InvalidConfig { field: "route_cache_capacity", value, reason: "must be at most 16,777,216 slots" } if value == "16777217"),
            text: "invalid configuration: `route_cache_capacity` = 16777217 must be at most 16,777,216 slots",
        },
        MisuseCase {
            class: "zero-capacity stream",
            shown: "`subscribe_stream_with_capacity(\"a\", 0)`",
            run: || inline_bus().subscribe_stream_with_capacity("a", 0).unwrap_err(),
            check: |e| matches!(e, Error::InvalidArgument { name: "capacity", value, reason: "must be at least 1" } if value == "0"),
            text: "invalid argument: `capacity` = 0 must be at least 1",
        },
        MisuseCase {
            class: "zero-capacity stream, with options",
            shown: "`subscribe_stream_with(\"a\", StreamOptions::new(0))`",
            run: || inline_bus().subscribe_stream_with("a", StreamOptions::new(0)).unwrap_err(),
            check: |e| matches!(e, Error::InvalidArgument { name: "capacity", value, reason: "must be at least 1" } if value == "0"),
            text: "invalid argument: `capacity` = 0 must be at least 1",
        },
        MisuseCase {
            class: "stream capacity over `StreamOptions::MAX_CAPACITY`",
            shown: "`subscribe_stream_with_capacity(\"a\", 16_777_217)`",
            run: || {
                inline_bus()
                    .subscribe_stream_with_capacity("a", StreamOptions::MAX_CAPACITY + 1)
                    .unwrap_err()
            },
            check: |e| matches!(e, Error::InvalidArgument { name: "capacity", value, reason: "must be at most 16,777,216 messages (StreamOptions::MAX_CAPACITY)" } if value == "16777217"),
            text: "invalid argument: `capacity` = 16777217 must be at most 16,777,216 messages (StreamOptions::MAX_CAPACITY)",
        },
        MisuseCase {
            class: "\"unbounded\" stream (it panicked: capacity overflow)",
            shown: "`subscribe_stream_with(\"a\", StreamOptions::new(usize::MAX).overflow(Backpressure))`",
            run: || {
                inline_bus()
                    .subscribe_stream_with(
                        "a",
                        StreamOptions::new(usize::MAX).overflow(StreamOverflow::Backpressure),
                    )
                    .unwrap_err()
            },
            check: |e| matches!(e, Error::InvalidArgument { name: "capacity", value, .. } if *value == usize::MAX.to_string()),
            text: "invalid argument: `capacity` = 18446744073709551615 must be at most 16,777,216 messages (StreamOptions::MAX_CAPACITY)",
        },
        MisuseCase {
            class: "oversized shared stream member",
            shown: "`subscribe_stream_with_capacity(\"$share/g/a\", 1 << 30)`",
            run: || {
                inline_bus()
                    .subscribe_stream_with_capacity("$share/g/a", 1 << 30)
                    .unwrap_err()
            },
            check: |e| matches!(e, Error::InvalidArgument { name: "capacity", value, .. } if value == "1073741824"),
            text: "invalid argument: `capacity` = 1073741824 must be at most 16,777,216 messages (StreamOptions::MAX_CAPACITY)",
        },
        MisuseCase {
            class: "`TaskPerSubscriber` without a runtime",
            shown: "`builder().delivery(TaskPerSubscriber).build()` outside tokio",
            run: || {
                Bus::<u32>::builder()
                    .delivery(DeliveryMode::TaskPerSubscriber)
                    .build()
                    .unwrap_err()
            },
            check: |e| matches!(e, Error::NoRuntime { what: "DeliveryMode::TaskPerSubscriber" }),
            text: "DeliveryMode::TaskPerSubscriber needs a tokio runtime: build the bus inside one, or give it one with BusBuilder::runtime",
        },
        MisuseCase {
            class: "async subscription without a runtime",
            shown: "`subscribe_async` on a bus built outside tokio",
            run: || {
                Bus::<u32>::builder()
                    .delivery(DeliveryMode::WorkerPool)
                    .build()
                    .unwrap()
                    .subscribe_async("a", |_: Arc<Message<u32>>| async {})
                    .unwrap_err()
            },
            check: |e| matches!(e, Error::NoRuntime { what: "an async handler subscription" }),
            text: "an async handler subscription needs a tokio runtime: build the bus inside one, or give it one with BusBuilder::runtime",
        },
        MisuseCase {
            class: "publish after `close`",
            shown: "`publish(\"a\", 1)`",
            run: || closed_bus().publish("a", 1).unwrap_err(),
            check: |e| matches!(e, Error::Closed),
            text: "the bus is closed: it accepts no more publishes or subscriptions",
        },
        MisuseCase {
            class: "publish of an invalid topic after `close` (closed wins)",
            shown: "`publish(\"a/#\", 1)`",
            run: || closed_bus().publish("a/#", 1).unwrap_err(),
            check: |e| matches!(e, Error::Closed),
            text: "the bus is closed: it accepts no more publishes or subscriptions",
        },
        MisuseCase {
            class: "subscribe after `close`",
            shown: "`subscribe(\"a\", …)`",
            run: || closed_bus().subscribe("a", |_: &Message<u32>| {}).unwrap_err(),
            check: |e| matches!(e, Error::Closed),
            text: "the bus is closed: it accepts no more publishes or subscriptions",
        },
        MisuseCase {
            class: "stream subscription after `close`",
            shown: "`subscribe_stream(\"a\")`",
            run: || closed_bus().subscribe_stream("a").unwrap_err(),
            check: |e| matches!(e, Error::Closed),
            text: "the bus is closed: it accepts no more publishes or subscriptions",
        },
        MisuseCase {
            class: "invalid filter after `close` (the filter is checked first)",
            shown: "`subscribe(\"a+\", …)`",
            run: || closed_bus().subscribe("a+", |_: &Message<u32>| {}).unwrap_err(),
            check: |e| matches!(e, Error::Topic(t) if t.rule() == &TopicRule::WildcardNotWholeLevel { level: 1, wildcard: '+' }),
            text: "invalid topic filter \"a+\": the wildcard `+` must occupy a whole level, but level 1 holds other characters too",
        },
    ]
}

/// Configuration values serde itself refuses (before `validate`): the text
/// is serde_json's.
fn serde_cases() -> Vec<(&'static str, &'static str, String)> {
    let cases = [
        ("negative workers", r#"{"workers": -1}"#),
        ("unknown delivery mode", r#"{"delivery": "WorkerPool"}"#),
        ("unparseable duration", r#"{"close_timeout": "soon"}"#),
        ("unknown field", r#"{"worker": 4}"#),
    ];
    cases
        .into_iter()
        .map(|(class, json)| {
            let err = serde_json::from_str::<Config>(json).expect_err(json);
            (class, json, err.to_string())
        })
        .collect()
}

#[test]
fn every_bad_configuration_and_misuse_gets_its_exact_error() {
    for case in misuse_cases() {
        let err = (case.run)();
        assert!((case.check)(&err), "{}: got {err:?}", case.class);
        assert_eq!(err.to_string(), case.text, "{}", case.class);
    }
}

#[test]
fn serde_refuses_malformed_configuration_without_panicking() {
    let texts: Vec<String> = serde_cases().into_iter().map(|(_, _, t)| t).collect();
    assert!(
        texts[0].contains("invalid value: integer `-1`"),
        "{}",
        texts[0]
    );
    assert!(
        texts[1].contains("unknown variant `WorkerPool`"),
        "{}",
        texts[1]
    );
    assert!(
        texts[2].contains("not a duration: \"soon\""),
        "{}",
        texts[2]
    );
    assert!(texts[3].contains("unknown field `worker`"), "{}", texts[3]);
}

// ---------------------------------------------------------------------------
// The page's table
// ---------------------------------------------------------------------------

/// Writes a run of more than 12 of one character `c` as `c⟨×n⟩` in a table
/// cell, so the 96-character quotes of over-long inputs stay readable; the
/// page says so.
fn compact(text: &str) -> String {
    let mut out = String::new();
    let chars: Vec<char> = text.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let run = chars[i..].iter().take_while(|&&d| d == c).count();
        if run > 12 {
            out.push_str(&format!("{c}⟨×{run}⟩"));
        } else {
            out.extend(std::iter::repeat_n(c, run));
        }
        i += run;
    }
    out
}

fn cell(text: &str) -> String {
    compact(text).replace('|', "\\|")
}

/// An exact error text as a code span that may hold single backticks.
fn code(text: &str) -> String {
    format!("`` {} ``", cell(text))
}

/// The table of `docs/reliability.md`, from the cases above.
fn table() -> String {
    let mut out = String::new();
    out.push_str("| Class | Input | Through | Error (variant) | Exact text |\n");
    out.push_str("| --- | --- | --- | --- | --- |\n");
    for c in topic_cases() {
        let through = match c.kind {
            TopicKind::Name => "`validate_topic`, `publish`, `publish_with`",
            TopicKind::Filter => "`validate_filter`, `subscribe`, `subscribe_stream[_with_capacity]`, `subscribe_async`",
        };
        let (variant, text) = match &c.rule {
            Some(rule) => (
                format!("`Error::Topic`: `{rule:?}`"),
                code(&c.expected_text().unwrap()),
            ),
            None => ("accepted".to_string(), "—".to_string()),
        };
        out.push_str(&format!(
            "| {} | {} | {through} | {variant} | {text} |\n",
            c.class,
            cell(&c.shown)
        ));
    }
    for c in misuse_cases() {
        let err = (c.run)();
        let variant = match &err {
            Error::InvalidConfig { field, value, .. } => {
                format!("`InvalidConfig {{ field: {field:?}, value: {value:?}, .. }}`")
            }
            Error::InvalidArgument { name, value, .. } => {
                format!("`InvalidArgument {{ name: {name:?}, value: {value:?}, .. }}`")
            }
            Error::NoRuntime { what } => format!("`NoRuntime {{ what: {what:?} }}`"),
            Error::Closed => "`Closed`".to_string(),
            Error::Topic(t) => format!("`Error::Topic`: `{:?}`", t.rule()),
            other => format!("`{other:?}`"),
        };
        let through = if c.shown.starts_with("`workers")
            || c.shown.starts_with("`queue")
            || c.shown.starts_with("`max_")
            || c.shown.starts_with("`stream_capacity")
            || c.shown.starts_with("`route")
        {
            "`Config::validate`, `Bus::new`, `BusBuilder::build`"
        } else {
            "the call shown"
        };
        out.push_str(&format!(
            "| {} | {} | {through} | {variant} | {} |\n",
            c.class,
            cell(c.shown),
            code(&err.to_string())
        ));
    }
    for (class, json, text) in serde_cases() {
        out.push_str(&format!(
            "| {class} | `{json}` | `serde_json::from_str::<Config>` | serde error | {} |\n",
            code(&text)
        ));
    }
    out
}

const START: &str = "<!-- bad-input-table:start (generated by tests/bad_input.rs) -->";
const END: &str = "<!-- bad-input-table:end -->";

/// The page shows exactly these cases. On a mismatch this prints the table
/// to paste between the markers.
#[test]
fn the_page_shows_exactly_these_cases() {
    let generated = table();
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/reliability.md"))
        .unwrap_or_default();
    let shown = page
        .split_once(START)
        .and_then(|(_, rest)| rest.split_once(END))
        .map(|(table, _)| table.trim().to_string());
    if shown.as_deref() != Some(generated.trim()) {
        println!("{START}\n{generated}{END}");
        panic!(
            "the bad-input table in docs/reliability.md is out of date: paste the table printed \
             above (cargo test --test bad_input the_page -- --nocapture)"
        );
    }
}
