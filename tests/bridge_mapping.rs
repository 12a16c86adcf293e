//! The bridge's topic mapping (feature `nats`): every valid topic name maps
//! to a valid NATS subject and back to itself, and filters match in NATS
//! what they match in MQTT.
#![cfg(feature = "nats")]

use blazesub::bridge::mapping::{filter_to_subjects, subject_to_topic, topic_to_subject};
use blazesub::topic::{matches, validate_filter, validate_topic};
use proptest::prelude::*;

/// A level drawn to hit NATS's reserved characters, the escape character,
/// empty levels and non-ASCII text.
fn level() -> impl Strategy<Value = String> {
    prop::collection::vec(
        prop_oneof![
            Just('.'),
            Just(' '),
            Just('*'),
            Just('>'),
            Just('%'),
            Just('\t'),
            Just('\u{7f}'),
            Just('$'),
            Just('é'),
            Just('🦀'),
            prop::char::range('a', 'e'),
            any::<char>().prop_filter("no NUL, + or #", |c| !matches!(c, '\0' | '+' | '#' | '/')),
        ],
        0..6,
    )
    .prop_map(|chars| chars.into_iter().collect())
}

fn topic() -> impl Strategy<Value = String> {
    prop::collection::vec(level(), 1..6).prop_map(|levels| levels.join("/"))
}

/// NATS's own rule for a subject to publish to: non-empty tokens, no
/// whitespace, no wildcard tokens.
fn is_publishable_subject(subject: &str) -> bool {
    !subject.chars().any(char::is_whitespace)
        && subject
            .split('.')
            .all(|t| !t.is_empty() && t != "*" && t != ">" && !t.contains(['*', '>']))
}

/// NATS subject matching (`*` one token, `>` one or more at the end).
fn nats_matches(pattern: &str, subject: &str) -> bool {
    let mut p = pattern.split('.');
    let mut s = subject.split('.');
    loop {
        match (p.next(), s.next()) {
            (Some(">"), Some(_)) => return true,
            (Some("*"), Some(_)) => {}
            (Some(a), Some(b)) if a == b => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2_000))]

    #[test]
    fn every_topic_round_trips(topic in topic()) {
        prop_assume!(validate_topic(&topic).is_ok());
        let subject = topic_to_subject(&topic);
        prop_assert!(is_publishable_subject(&subject), "{subject:?}");
        prop_assert_eq!(subject_to_topic(&subject), Some(topic));
    }

    #[test]
    fn filters_match_in_nats_what_they_match_in_mqtt(
        topic in topic(),
        mask in prop::collection::vec(0u8..4, 1..6),
    ) {
        prop_assume!(validate_topic(&topic).is_ok());
        // A filter made from the topic: some levels `+`, maybe a `#` tail.
        let levels: Vec<&str> = topic.split('/').collect();
        let mut filter: Vec<String> = Vec::new();
        for (i, level) in levels.iter().enumerate() {
            match mask.get(i).copied().unwrap_or(0) {
                1 => filter.push("+".into()),
                2 => { filter.push("#".into()); break; }
                _ => filter.push((*level).to_owned()),
            }
        }
        let filter = filter.join("/");
        prop_assume!(validate_filter(&filter).is_ok());
        let subject = topic_to_subject(&topic);
        let in_nats = filter_to_subjects(&filter).iter().any(|p| nats_matches(p, &subject));
        // NATS wildcards also match `$` topics, which MQTT's first-level
        // wildcards do not; the bridge checks MQTT's rule on arrival.
        if !topic.starts_with('$') {
            prop_assert_eq!(in_nats, matches(&filter, &topic), "{} vs {}", filter, topic);
        } else if matches(&filter, &topic) {
            prop_assert!(in_nats);
        }
    }
}
