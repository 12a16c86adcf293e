//! Topic name and topic filter validation and matching, as MQTT 3.1.1 / 5.0
//! section 4.7 defines them: every non-normative example of the section, the
//! edge cases around it, and the same vectors checked through a real bus.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use blazesub::topic::{
    matches, validate_filter, validate_topic, TopicError, TopicKind, TopicRule, MAX_TOPIC_LEN,
};
use blazesub::{Bus, DeliveryMode, Error, Message};

// ---------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------

fn inline_bus() -> Bus<u32> {
    Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .build()
        .expect("an Inline bus builds outside a runtime")
}

/// Subscribes `filter` on a fresh Inline bus (a handler and a stream), publishes
/// to `topic`, and says whether the subscription received the message. Checks
/// that handler, stream and `publish`'s return value agree.
fn bus_delivers(filter: &str, topic: &str) -> bool {
    let bus = inline_bus();
    let hits = Arc::new(AtomicUsize::new(0));
    let seen_topic = Arc::new(std::sync::Mutex::new(None::<String>));
    let sub = {
        let hits = Arc::clone(&hits);
        let seen_topic = Arc::clone(&seen_topic);
        bus.subscribe(filter, move |m: &Message<u32>| {
            assert_eq!(*m.data(), 7);
            *seen_topic.lock().unwrap() = Some(m.topic().to_owned());
            hits.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap_or_else(|e| panic!("subscribe({filter:?}) failed: {e}"))
    };
    let mut stream = bus
        .subscribe_stream(filter)
        .unwrap_or_else(|e| panic!("subscribe_stream({filter:?}) failed: {e}"));
    let matched = bus
        .publish(topic, 7)
        .unwrap_or_else(|e| panic!("publish({topic:?}) failed: {e}"));
    // Inline mode: the handler has run before publish returned.
    let handler_hits = hits.load(Ordering::SeqCst);
    assert!(
        handler_hits <= 1,
        "{filter:?} / {topic:?}: handler ran {handler_hits} times for one publish"
    );
    let streamed = match stream.try_recv() {
        Ok(m) => {
            assert_eq!(m.topic(), topic);
            assert_eq!(*m.data(), 7);
            assert!(stream.try_recv().is_err(), "a second message was streamed");
            true
        }
        Err(_) => false,
    };
    assert_eq!(
        handler_hits == 1,
        streamed,
        "{filter:?} / {topic:?}: handler and stream subscriptions disagree"
    );
    assert_eq!(
        matched,
        2 * handler_hits,
        "{filter:?} / {topic:?}: publish returned {matched} matched subscriptions"
    );
    if handler_hits == 1 {
        assert_eq!(seen_topic.lock().unwrap().as_deref(), Some(topic));
    }
    drop(sub);
    handler_hits == 1
}

/// Checks `matches(filter, topic) == expected`, that both inputs are valid,
/// and that a real Inline bus delivers iff `matches` says so.
#[track_caller]
fn check(filter: &str, topic: &str, expected: bool) {
    assert_eq!(
        validate_filter(filter),
        Ok(()),
        "filter {filter:?} should be valid"
    );
    assert_eq!(
        validate_topic(topic),
        Ok(()),
        "topic {topic:?} should be valid"
    );
    assert_eq!(
        matches(filter, topic),
        expected,
        "matches({filter:?}, {topic:?})"
    );
    assert_eq!(
        bus_delivers(filter, topic),
        expected,
        "bus delivery for filter {filter:?} and topic {topic:?}"
    );
}

#[track_caller]
fn filter_ok(filter: &str) {
    assert_eq!(
        validate_filter(filter),
        Ok(()),
        "filter {filter:?} should be valid"
    );
    let bus = inline_bus();
    let sub = bus.subscribe(filter, |_: &Message<u32>| {});
    assert!(sub.is_ok(), "bus.subscribe({filter:?}) failed: {sub:?}");
}

#[track_caller]
fn filter_err(filter: &str, rule: TopicRule) -> TopicError {
    let err = validate_filter(filter).expect_err(filter);
    assert_eq!(err.rule(), &rule, "rule for filter {filter:?}");
    assert_eq!(err.kind(), TopicKind::Filter);
    // The bus rejects it the same way, for handler and stream subscriptions.
    let bus = inline_bus();
    match bus.subscribe(filter, |_: &Message<u32>| {}) {
        Err(Error::Topic(e)) => assert_eq!(e, err),
        other => panic!("bus.subscribe({filter:?}) returned {other:?}"),
    }
    match bus.subscribe_stream(filter) {
        Err(Error::Topic(e)) => assert_eq!(e, err),
        Err(other) => panic!("bus.subscribe_stream({filter:?}) returned {other:?}"),
        Ok(_) => panic!("bus.subscribe_stream({filter:?}) accepted an invalid filter"),
    }
    assert_eq!(bus.subscriptions_count(), 0);
    // `matches` is a predicate: an invalid filter matches nothing.
    assert!(!matches(filter, "a"));
    err
}

#[track_caller]
fn topic_ok(topic: &str) {
    assert_eq!(
        validate_topic(topic),
        Ok(()),
        "topic {topic:?} should be valid"
    );
    let bus = inline_bus();
    assert_eq!(bus.publish(topic, 1).expect("publish a valid topic"), 0);
}

#[track_caller]
fn topic_err(topic: &str, rule: TopicRule) -> TopicError {
    let err = validate_topic(topic).expect_err(topic);
    assert_eq!(err.rule(), &rule, "rule for topic {topic:?}");
    assert_eq!(err.kind(), TopicKind::Name);
    let bus = inline_bus();
    let hits = Arc::new(AtomicUsize::new(0));
    let h = Arc::clone(&hits);
    let _sub = bus
        .subscribe("#", move |_: &Message<u32>| {
            h.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
    match bus.publish(topic, 1) {
        Err(Error::Topic(e)) => assert_eq!(e, err),
        other => panic!("bus.publish({topic:?}) returned {other:?}"),
    }
    assert_eq!(
        hits.load(Ordering::SeqCst),
        0,
        "an invalid publish delivered"
    );
    assert_eq!(bus.stats().published, 0);
    assert!(!matches("#", topic));
    err
}

// ---------------------------------------------------------------------------
// MQTT section 4.7.1.2: the multi-level wildcard `#`
// ---------------------------------------------------------------------------

#[test]
fn spec_hash_player1_matches_player1_itself() {
    check("sport/tennis/player1/#", "sport/tennis/player1", true);
}

#[test]
fn spec_hash_player1_matches_ranking() {
    check(
        "sport/tennis/player1/#",
        "sport/tennis/player1/ranking",
        true,
    );
}

#[test]
fn spec_hash_player1_matches_score_wimbledon() {
    check(
        "sport/tennis/player1/#",
        "sport/tennis/player1/score/wimbledon",
        true,
    );
}

#[test]
fn hash_player1_does_not_match_siblings_or_parents() {
    check("sport/tennis/player1/#", "sport/tennis/player2", false);
    check("sport/tennis/player1/#", "sport/tennis", false);
    check("sport/tennis/player1/#", "sport/tennis/player10", false);
}

#[test]
fn spec_sport_hash_matches_sport() {
    check("sport/#", "sport", true);
}

#[test]
fn spec_hash_alone_is_valid_and_matches_everything_not_dollar() {
    filter_ok("#");
    check("#", "sport", true);
    check("#", "sport/tennis/player1", true);
    check("#", "/", true);
    check("#", "/finance", true);
    check("#", "a//b", true);
}

#[test]
fn spec_sport_tennis_hash_is_valid() {
    filter_ok("sport/tennis/#");
    check("sport/tennis/#", "sport/tennis", true);
    check("sport/tennis/#", "sport/tennis/player1", true);
    check("sport/tennis/#", "sport", false);
    check("sport/tennis/#", "sport/tennisx", false);
}

#[test]
fn spec_sport_tennis_hash_without_separator_is_invalid() {
    filter_err(
        "sport/tennis#",
        TopicRule::WildcardNotWholeLevel {
            level: 2,
            wildcard: '#',
        },
    );
}

#[test]
fn spec_hash_not_last_is_invalid() {
    filter_err(
        "sport/tennis/#/ranking",
        TopicRule::HashNotLast { level: 3 },
    );
}

// ---------------------------------------------------------------------------
// MQTT section 4.7.1.3: the single-level wildcard `+`
// ---------------------------------------------------------------------------

#[test]
fn spec_plus_matches_one_level() {
    check("sport/tennis/+", "sport/tennis/player1", true);
    check("sport/tennis/+", "sport/tennis/player2", true);
}

#[test]
fn spec_plus_does_not_match_two_levels() {
    check("sport/tennis/+", "sport/tennis/player1/ranking", false);
}

#[test]
fn spec_sport_plus_does_not_match_sport() {
    check("sport/+", "sport", false);
}

#[test]
fn spec_sport_plus_matches_sport_slash() {
    check("sport/+", "sport/", true);
}

#[test]
fn spec_plus_alone_is_valid() {
    filter_ok("+");
    check("+", "sport", true);
    check("+", "sport/tennis", false);
}

#[test]
fn spec_plus_tennis_hash_is_valid() {
    filter_ok("+/tennis/#");
    check("+/tennis/#", "sport/tennis", true);
    check("+/tennis/#", "sport/tennis/player1/ranking", true);
    check("+/tennis/#", "sport/golf/player1", false);
    check("+/tennis/#", "tennis", false);
}

#[test]
fn spec_sport_plus_without_separator_is_invalid() {
    filter_err(
        "sport+",
        TopicRule::WildcardNotWholeLevel {
            level: 1,
            wildcard: '+',
        },
    );
}

#[test]
fn spec_plus_in_the_middle_is_valid() {
    filter_ok("sport/+/player1");
    check("sport/+/player1", "sport/tennis/player1", true);
    check("sport/+/player1", "sport/golf/player1", true);
    check("sport/+/player1", "sport//player1", true);
    check("sport/+/player1", "sport/tennis/player2", false);
    check("sport/+/player1", "sport/player1", false);
}

#[test]
fn spec_slash_finance_matches_plus_plus() {
    check("+/+", "/finance", true);
}

#[test]
fn spec_slash_finance_matches_slash_plus() {
    check("/+", "/finance", true);
}

#[test]
fn spec_slash_finance_does_not_match_plus() {
    check("+", "/finance", false);
}

// ---------------------------------------------------------------------------
// MQTT section 4.7.2: topics beginning with `$`
// ---------------------------------------------------------------------------

#[test]
fn spec_hash_does_not_match_dollar_topics() {
    check("#", "$SYS/monitor/Clients", false);
    check("#", "$SYS", false);
    check("#", "$SYS/", false);
    check("#", "$", false);
    check("#", "$share/x", false);
}

#[test]
fn spec_plus_monitor_clients_does_not_match_sys() {
    check("+/monitor/Clients", "$SYS/monitor/Clients", false);
    // ...while it does match an ordinary first level.
    check("+/monitor/Clients", "broker/monitor/Clients", true);
}

#[test]
fn spec_sys_hash_matches_sys_topics() {
    check("$SYS/#", "$SYS/monitor/Clients", true);
    check("$SYS/#", "$SYS/", true);
    check("$SYS/#", "$SYS", true);
    check("$SYS/#", "SYS/monitor/Clients", false);
}

#[test]
fn spec_sys_monitor_plus_matches_clients() {
    check("$SYS/monitor/+", "$SYS/monitor/Clients", true);
    check("$SYS/monitor/+", "$SYS/monitor", false);
}

#[test]
fn spec_subscribe_both_hash_and_sys_hash_to_see_everything() {
    let bus = inline_bus();
    let hits = Arc::new(AtomicUsize::new(0));
    let mut subs = Vec::new();
    for filter in ["#", "$SYS/#"] {
        let h = Arc::clone(&hits);
        subs.push(
            bus.subscribe(filter, move |_: &Message<u32>| {
                h.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap(),
        );
    }
    assert_eq!(bus.publish("$SYS/monitor/Clients", 1).unwrap(), 1);
    assert_eq!(bus.publish("sport/tennis", 1).unwrap(), 1);
    assert_eq!(hits.load(Ordering::SeqCst), 2);
}

#[test]
fn first_level_wildcards_skip_any_dollar_topic_but_deeper_ones_do_not() {
    check("+", "$", false);
    check("+/#", "$SYS", false);
    check("+/+", "$SYS/x", false);
    check("+/x", "$/x", false);
    check("$", "$", true);
    // A `$` deeper than the first level is an ordinary character.
    check("a/+", "a/$x", true);
    check("a/#", "a/$SYS/x", true);
    check("+/$SYS", "a/$SYS", true);
}

// ---------------------------------------------------------------------------
// MQTT section 4.7.3: topic semantics and usage
// ---------------------------------------------------------------------------

#[test]
fn spec_topics_are_case_sensitive() {
    check("ACCOUNTS", "Accounts", false);
    check("Accounts", "ACCOUNTS", false);
    check("Accounts", "Accounts", true);
    check("accounts/+", "Accounts/payable", false);
    check("Accounts/#", "Accounts/payable", true);
}

#[test]
fn spec_spaces_are_allowed() {
    topic_ok("Accounts payable");
    filter_ok("Accounts payable");
    check("Accounts payable", "Accounts payable", true);
    check("Accounts payable", "Accountspayable", false);
    check("+", " ", true);
    check(" /+", " / ", true);
    check("a b/+/c d", "a b/x y/c d", true);
}

#[test]
fn spec_leading_slash_is_a_distinct_topic() {
    check("/finance", "finance", false);
    check("finance", "/finance", false);
    check("/finance", "/finance", true);
}

// ---------------------------------------------------------------------------
// Empty levels
// ---------------------------------------------------------------------------

#[test]
fn empty_levels_are_legal_in_names_and_filters() {
    for s in ["a//b", "/a", "a/", "/", "//", "///a///", "a//"] {
        topic_ok(s);
        filter_ok(s);
        check(s, s, true);
    }
}

#[test]
fn empty_levels_are_distinct_levels() {
    check("a/b", "a//b", false);
    check("a//b", "a/b", false);
    check("a/+/b", "a//b", true);
    check("+/+/+", "a//b", true);
    check("a/", "a", false);
    check("a", "a/", false);
    check("/", "//", false);
    check("a/+", "a/", true);
    check("a/#", "a/", true);
    check("a/#", "a//", true);
}

#[test]
fn slash_alone_is_two_empty_levels() {
    check("/", "/", true);
    check("+/+", "/", true);
    check("/+", "/", true);
    check("+/", "/", true);
    check("/#", "/", true);
    check("+", "/", false);
    check("+/+/+", "/", false);
}

// ---------------------------------------------------------------------------
// Unicode
// ---------------------------------------------------------------------------

#[test]
fn unicode_levels_match_byte_exactly() {
    check(
        "capteurs/+/température",
        "capteurs/cuisine/température",
        true,
    );
    check("日本/+", "日本/東京", true);
    check("日本/#", "日本/東京/渋谷", true);
    check("🌡/+/🔥", "🌡/x/🔥", true);
    check("+/東京", "日本/東京", true);
    // No normalisation: precomposed é is not e + combining acute accent.
    check("caf\u{e9}", "cafe\u{301}", false);
    check("ÉTÉ", "été", false);
}

#[test]
fn multibyte_characters_next_to_wildcards_are_not_whole_levels() {
    filter_err(
        "é+",
        TopicRule::WildcardNotWholeLevel {
            level: 1,
            wildcard: '+',
        },
    );
    filter_err(
        "a/+é",
        TopicRule::WildcardNotWholeLevel {
            level: 2,
            wildcard: '+',
        },
    );
    filter_err(
        "日本/東京#",
        TopicRule::WildcardNotWholeLevel {
            level: 2,
            wildcard: '#',
        },
    );
    topic_err(
        "é+",
        TopicRule::WildcardInName {
            offset: 2,
            wildcard: '+',
        },
    );
    topic_err(
        "日本/#",
        TopicRule::WildcardInName {
            offset: 7,
            wildcard: '#',
        },
    );
}

// ---------------------------------------------------------------------------
// NUL, empty, length
// ---------------------------------------------------------------------------

#[test]
fn nul_is_rejected_with_its_byte_offset() {
    topic_err("\0", TopicRule::Nul { offset: 0 });
    topic_err("a\0b", TopicRule::Nul { offset: 1 });
    topic_err("é/\0", TopicRule::Nul { offset: 3 });
    filter_err("\0", TopicRule::Nul { offset: 0 });
    filter_err("a/\0", TopicRule::Nul { offset: 2 });
    filter_err("+/#\0", TopicRule::Nul { offset: 3 });
    filter_err("日\0/#", TopicRule::Nul { offset: 3 });
}

#[test]
fn empty_is_rejected() {
    let e = topic_err("", TopicRule::Empty);
    assert_eq!(e.input(), "");
    let e = filter_err("", TopicRule::Empty);
    assert_eq!(e.input(), "");
}

#[test]
fn length_limit_is_65535_bytes() {
    assert_eq!(MAX_TOPIC_LEN, 65_535);
    let exactly = "x".repeat(65_535);
    topic_ok(&exactly);
    filter_ok(&exactly);
    check(&exactly, &exactly, true);
    check("#", &exactly, true);

    let over = "x".repeat(65_536);
    topic_err(&over, TopicRule::TooLong { len: 65_536 });
    filter_err(&over, TopicRule::TooLong { len: 65_536 });
}

#[test]
fn length_limit_counts_bytes_not_characters() {
    // 32,767 two-byte characters + 1 = 65,535 bytes.
    let exactly = format!("{}a", "é".repeat(32_767));
    assert_eq!(exactly.len(), 65_535);
    topic_ok(&exactly);
    filter_ok(&exactly);
    // 32,768 characters, 65,536 bytes.
    let over = "é".repeat(32_768);
    topic_err(&over, TopicRule::TooLong { len: 65_536 });
    filter_err(&over, TopicRule::TooLong { len: 65_536 });
}

#[test]
fn longest_filter_of_wildcards_is_valid_and_matches() {
    // 32,768 `+` levels: 65,535 bytes, a legal filter.
    let filter = format!("{}+", "+/".repeat(32_767));
    assert_eq!(filter.len(), 65_535);
    let topic = format!("{}a", "a/".repeat(32_767));
    assert_eq!(topic.len(), 65_535);
    assert_eq!(validate_filter(&filter), Ok(()));
    assert_eq!(validate_topic(&topic), Ok(()));
    assert!(matches(&filter, &topic));
    let shorter = format!("{}a", "a/".repeat(32_766));
    assert!(!matches(&filter, &shorter));
    let deep_hash = format!("{}#", "a/".repeat(32_767));
    assert!(matches(&deep_hash, &topic));
    assert!(matches(&deep_hash, &topic[..topic.len() - 2]));
}

#[test]
fn deep_filters_work_through_the_bus() {
    // 1,000 levels: well inside the limits, and deep enough to catch a
    // matcher that stops early.
    let filter = format!("{}+", "+/".repeat(999));
    let topic = format!("{}a", "a/".repeat(999));
    check(&filter, &topic, true);
    check(&filter, &format!("{topic}/a"), false);
    check(&format!("{}#", "a/".repeat(999)), &topic, true);
}

/// Runs `f` on a thread with an 8 MiB stack, the usual size of a process's
/// main thread, so the verdict does not depend on the test harness's 2 MiB.
fn on_big_stack(f: impl FnOnce() + Send + 'static) {
    std::thread::Builder::new()
        .stack_size(8 << 20)
        .spawn(f)
        .unwrap()
        .join()
        .unwrap();
}

#[test]
fn longest_filter_of_wildcards_through_the_bus() {
    on_big_stack(|| {
        let filter = format!("{}+", "+/".repeat(32_767));
        let topic = format!("{}a", "a/".repeat(32_767));
        check(&filter, &topic, true);
        let deep_hash = format!("{}#", "a/".repeat(32_767));
        check(&deep_hash, &topic, true);
    });
}

// ---------------------------------------------------------------------------
// Wildcards in names and partial-level wildcards
// ---------------------------------------------------------------------------

#[test]
fn wildcards_in_topic_names_are_rejected() {
    let cases: &[(&str, usize, char)] = &[
        ("+", 0, '+'),
        ("#", 0, '#'),
        ("a/+", 2, '+'),
        ("a/#", 2, '#'),
        ("sport/tennis#", 12, '#'),
        ("sport+", 5, '+'),
        ("a/b/c+d", 5, '+'),
        ("+/#", 0, '+'),
        ("#/+", 0, '#'),
    ];
    for &(topic, offset, wildcard) in cases {
        topic_err(topic, TopicRule::WildcardInName { offset, wildcard });
    }
}

#[test]
fn partial_level_wildcards_are_rejected_with_their_level() {
    let cases: &[(&str, usize, char)] = &[
        ("sport+", 1, '+'),
        ("+sport", 1, '+'),
        ("++", 1, '+'),
        ("##", 1, '#'),
        ("sport/tennis#", 2, '#'),
        ("a/#b", 2, '#'),
        ("a/b+/c", 2, '+'),
        ("a/+#", 2, '+'),
        ("a/#+", 2, '#'),
        ("a/b/c/d+", 4, '+'),
        ("a/+/b#", 3, '#'),
        ("a//+x", 3, '+'),
        ("/x#", 2, '#'),
        ("a/b/c#/d", 3, '#'),
    ];
    for &(filter, level, wildcard) in cases {
        filter_err(filter, TopicRule::WildcardNotWholeLevel { level, wildcard });
    }
}

#[test]
fn hash_not_last_is_rejected_with_its_level() {
    let cases: &[(&str, usize)] = &[
        ("#/", 1),
        ("#/a", 1),
        ("#/#", 1),
        ("/#/", 2),
        ("a/#/b", 2),
        ("a/#/#", 2),
        ("sport/tennis/#/ranking", 3),
        ("+/+/+/#/+", 4),
    ];
    for &(filter, level) in cases {
        filter_err(filter, TopicRule::HashNotLast { level });
    }
}

#[test]
fn valid_filters_are_accepted() {
    for f in [
        "#",
        "+",
        "+/+",
        "+/#",
        "/#",
        "/+",
        "+/",
        "sport/tennis/#",
        "+/tennis/#",
        "sport/+/player1",
        "$SYS/#",
        "$SYS/monitor/+",
        "$",
        "a/+/+/#",
        "日本/+/#",
    ] {
        filter_ok(f);
    }
}

#[test]
fn valid_topic_names_are_accepted() {
    for t in [
        "a",
        "sport/tennis/player1",
        "$SYS/monitor/Clients",
        "$",
        "Accounts payable",
        "/",
        "a//b",
        "日本/東京",
        "-_.,;:!?*&%@$^()[]{}<>=~`'\"|\\",
    ] {
        topic_ok(t);
    }
}

// ---------------------------------------------------------------------------
// Error values: Display, input(), kind()
// ---------------------------------------------------------------------------

#[test]
fn filter_error_display_names_input_and_rule() {
    let err = validate_filter("sport/tennis#").unwrap_err();
    assert_eq!(err.kind(), TopicKind::Filter);
    assert_eq!(err.input(), "sport/tennis#");
    let text = err.to_string();
    assert!(text.contains("topic filter"), "{text}");
    assert!(text.contains("\"sport/tennis#\""), "{text}");
    assert!(text.contains("whole level"), "{text}");
    assert!(text.contains("level 2"), "{text}");

    let err = validate_filter("sport/tennis/#/ranking").unwrap_err();
    let text = err.to_string();
    assert!(text.contains("\"sport/tennis/#/ranking\""), "{text}");
    assert!(text.contains("last level"), "{text}");
    assert!(text.contains("level 3"), "{text}");
}

#[test]
fn name_error_display_names_input_and_rule() {
    let err = validate_topic("a/+").unwrap_err();
    assert_eq!(err.kind(), TopicKind::Name);
    assert_eq!(err.input(), "a/+");
    let text = err.to_string();
    assert!(text.contains("topic name"), "{text}");
    assert!(text.contains("\"a/+\""), "{text}");
    assert!(text.contains("wildcard `+`"), "{text}");
    assert!(text.contains("byte 2"), "{text}");

    let err = validate_topic("a\0b").unwrap_err();
    let text = err.to_string();
    assert!(text.contains("NUL"), "{text}");
    assert!(text.contains("byte 1"), "{text}");

    let err = validate_topic("").unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");

    let err = validate_topic(&"x".repeat(70_000)).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("70000"), "{text}");
    assert!(text.contains("65535"), "{text}");
}

#[test]
fn bus_error_display_is_the_topic_error() {
    let bus = inline_bus();
    let err = bus.publish("sport/+", 1).unwrap_err();
    let direct = validate_topic("sport/+").unwrap_err();
    assert_eq!(err.to_string(), direct.to_string());
    let err = bus.subscribe("sport+", |_: &Message<u32>| {}).unwrap_err();
    let direct = validate_filter("sport+").unwrap_err();
    assert_eq!(err.to_string(), direct.to_string());
    // The source chain is reachable through std::error::Error.
    let _: &dyn std::error::Error = &err;
}

#[test]
fn input_quotes_short_inputs_exactly_and_shortens_long_ones() {
    assert_eq!(validate_topic("a/#").unwrap_err().input(), "a/#");
    assert_eq!(validate_filter("a+/b").unwrap_err().input(), "a+/b");
    assert_eq!(validate_filter("a/\0").unwrap_err().input(), "a/\0");

    let long = format!("{}#", "x".repeat(100_000));
    let err = validate_topic(&long).unwrap_err();
    assert!(err.input().starts_with("xxxx"));
    assert!(err.input().ends_with('…'));
    assert!(err.input().len() < 1_000, "the quote is not shortened");
    assert!(
        err.to_string().len() < 2_000,
        "the message is not shortened"
    );

    // Shortening never cuts a multi-byte character in two.
    let long = format!("{}+", "日".repeat(50_000));
    let err = validate_filter(&long).unwrap_err();
    assert!(err.input().starts_with("日日"));
    assert!(err.input().ends_with('…'));
}

#[test]
fn kind_says_name_or_filter() {
    assert_eq!(validate_topic("").unwrap_err().kind(), TopicKind::Name);
    assert_eq!(validate_filter("").unwrap_err().kind(), TopicKind::Filter);
    assert_eq!(TopicKind::Name.to_string(), "topic name");
    assert_eq!(TopicKind::Filter.to_string(), "topic filter");
}

// ---------------------------------------------------------------------------
// The whole table through one bus holding every filter at once
// ---------------------------------------------------------------------------

const FILTERS: &[&str] = &[
    "sport/tennis/player1/#",
    "sport/#",
    "#",
    "sport/tennis/#",
    "sport/tennis/+",
    "sport/+",
    "+",
    "+/tennis/#",
    "sport/+/player1",
    "+/+",
    "/+",
    "/finance",
    "finance",
    "+/monitor/Clients",
    "$SYS/#",
    "$SYS/monitor/+",
    "ACCOUNTS",
    "Accounts",
    "Accounts payable",
    "a//b",
    "a/+/b",
    "/",
    "+/#",
    "/#",
    "日本/+",
    "$",
];

const TOPICS: &[&str] = &[
    "sport",
    "sport/",
    "sport/tennis",
    "sport/tennis/player1",
    "sport/tennis/player2",
    "sport/tennis/player1/ranking",
    "sport/tennis/player1/score/wimbledon",
    "/finance",
    "finance",
    "$SYS",
    "$SYS/monitor/Clients",
    "broker/monitor/Clients",
    "ACCOUNTS",
    "Accounts",
    "Accounts payable",
    "a//b",
    "a/x/b",
    "/",
    "//",
    "日本/東京",
    "$",
    "a",
];

/// Every filter subscribed at once on one bus, every topic published twice
/// (the second time through the route cache): each filter's handler runs iff
/// `matches` says so, and `publish` returns the number of matching filters.
fn table_through_one_bus(bus: Bus<u32>) {
    let counters: Vec<Arc<AtomicUsize>> = FILTERS
        .iter()
        .map(|_| Arc::new(AtomicUsize::new(0)))
        .collect();
    let _subs: Vec<_> = FILTERS
        .iter()
        .zip(&counters)
        .map(|(filter, counter)| {
            let counter = Arc::clone(counter);
            bus.subscribe(filter, move |_: &Message<u32>| {
                counter.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap()
        })
        .collect();
    for round in 0..2 {
        for topic in TOPICS {
            let before: Vec<usize> = counters.iter().map(|c| c.load(Ordering::SeqCst)).collect();
            let matched = bus.publish(topic, 1).unwrap();
            let mut expected = 0;
            for (i, filter) in FILTERS.iter().enumerate() {
                let want = matches(filter, topic);
                expected += usize::from(want);
                let got = counters[i].load(Ordering::SeqCst) - before[i];
                assert_eq!(
                    got,
                    usize::from(want),
                    "round {round}: filter {filter:?}, topic {topic:?}"
                );
            }
            assert_eq!(matched, expected, "round {round}: publish({topic:?})");
        }
    }
}

#[test]
fn table_through_one_bus_with_route_cache() {
    table_through_one_bus(inline_bus());
}

#[test]
fn table_through_one_bus_without_route_cache() {
    let bus = Bus::<u32>::builder()
        .delivery(DeliveryMode::Inline)
        .route_cache_capacity(0)
        .build()
        .unwrap();
    table_through_one_bus(bus);
}

#[test]
fn table_spot_checks() {
    // A few table answers pinned down, so the table test cannot pass on a
    // `matches` that is wrong the same way as the bus.
    assert!(matches("+/+", "/"));
    assert!(matches("+/#", "sport"));
    assert!(!matches("+/#", "$SYS"));
    assert!(!matches("$", "$SYS"));
    assert!(matches("$", "$"));
    assert!(!matches("#", "$"));
    assert!(matches("/#", "/finance"));
    assert!(!matches("/#", "finance"));
}

// ---------------------------------------------------------------------------
// Never panics
// ---------------------------------------------------------------------------

#[test]
fn odd_strings_never_panic_and_bus_agrees_with_validators() {
    let mut odd: Vec<String> = [
        "+",
        "#",
        "/#/",
        "++",
        "#/",
        "/+",
        "+/",
        "//",
        "/",
        "\u{0}",
        "\u{0}/#",
        "#\u{0}",
        "+\u{0}",
        "é+",
        "+é",
        "é#",
        "#é",
        "é/+/é",
        "日/#",
        "#/日",
        "🌡+",
        "+🌡/#",
        "\u{301}+",
        "$",
        "$+",
        "$#",
        "$/#",
        "#$",
        " ",
        " + ",
        "+ ",
        "\t",
        "\n/#",
        "\u{feff}",
        "\u{ffff}/+",
        "a/\u{0}/+",
        "////#",
        "#////",
        "+/+/+/+/",
        "\\",
        "\\+",
        "%2B",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    odd.push("a/".repeat(50_000)); // 100,000 bytes
    odd.push("+/".repeat(50_000));
    odd.push(format!("{}#", "a/".repeat(50_000)));
    odd.push("#".repeat(100_000));
    odd.push("+".repeat(100_000));
    odd.push("/".repeat(100_000));
    odd.push("\u{0}".repeat(100_000));
    odd.push("é".repeat(50_000));
    odd.push(format!("{}/+", "é".repeat(20_000))); // 40,002 bytes: valid
    odd.push(format!("{}/#", "日".repeat(20_000))); // 60,002 bytes: valid

    let bus = inline_bus();
    for s in &odd {
        let short: String = s.chars().take(20).collect();
        let as_filter = validate_filter(s);
        let as_topic = validate_topic(s);
        if let Err(e) = &as_filter {
            assert_eq!(e.kind(), TopicKind::Filter);
            assert!(!e.to_string().is_empty());
        }
        if let Err(e) = &as_topic {
            assert_eq!(e.kind(), TopicKind::Name);
            assert!(!e.to_string().is_empty());
        }
        // `matches` answers false whenever an input is invalid.
        for other in ["a", "#", "a/b", "$SYS/x", s.as_str()] {
            let m = matches(s, other);
            if as_filter.is_err() || validate_topic(other).is_err() {
                assert!(!m, "matches({short:?}.., {other:?}) on invalid input");
            }
            let m = matches(other, s);
            if as_topic.is_err() || validate_filter(other).is_err() {
                assert!(!m, "matches({other:?}, {short:?}..) on invalid input");
            }
        }
        // The bus gives the same verdicts as the validators, never a panic.
        match (bus.subscribe(s, |_: &Message<u32>| {}), &as_filter) {
            (Ok(sub), Ok(())) => drop(sub),
            (Err(Error::Topic(e)), Err(expected)) => assert_eq!(&e, expected),
            (got, want) => panic!("subscribe({short:?}..) = {got:?}, validator says {want:?}"),
        }
        match (bus.subscribe_stream(s), &as_filter) {
            (Ok(rx), Ok(())) => drop(rx),
            (Err(Error::Topic(e)), Err(expected)) => assert_eq!(&e, expected),
            (Err(e), want) => panic!("subscribe_stream({short:?}..) = {e:?}, validator {want:?}"),
            (Ok(_), Err(e)) => panic!("subscribe_stream({short:?}..) accepted it, but {e}"),
        }
        match (bus.publish(s, 1), &as_topic) {
            (Ok(_), Ok(())) => {}
            (Err(Error::Topic(e)), Err(expected)) => assert_eq!(&e, expected),
            (got, want) => panic!("publish({short:?}..) = {got:?}, validator says {want:?}"),
        }
    }
    assert_eq!(bus.subscriptions_count(), 0);
}

#[test]
fn odd_strings_used_as_both_filter_and_topic_on_a_live_bus() {
    // Valid filters with odd shapes, all subscribed at once, then every valid
    // odd topic published: still no panic, and delivery agrees with `matches`.
    let filters = [
        "+", "#", "/#", "+/", "//", "/", "$", "é/+/é", "+/+/+/+/", " /+", "\\",
    ];
    let topics = [
        "/", "//", "$", " ", "é/x/é", "a/b/c/d/", "\\", "日/a", "////",
    ];
    let bus = inline_bus();
    let counters: Vec<Arc<AtomicUsize>> = filters
        .iter()
        .map(|_| Arc::new(AtomicUsize::new(0)))
        .collect();
    let _subs: Vec<_> = filters
        .iter()
        .zip(&counters)
        .map(|(f, c)| {
            let c = Arc::clone(c);
            bus.subscribe(f, move |_: &Message<u32>| {
                c.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap()
        })
        .collect();
    for topic in topics {
        let before: Vec<usize> = counters.iter().map(|c| c.load(Ordering::SeqCst)).collect();
        bus.publish(topic, 0).unwrap();
        for (i, f) in filters.iter().enumerate() {
            let got = counters[i].load(Ordering::SeqCst) - before[i];
            assert_eq!(got, usize::from(matches(f, topic)), "{f:?} / {topic:?}");
        }
    }
}
