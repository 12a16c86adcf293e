//! Topic mapping: MQTT-style topics and filters ↔ NATS subjects.
//!
//! A topic's levels become a subject's tokens: `/` ↔ `.`, `+` ↔ `*`,
//! `#` ↔ `>`. NATS forbids what MQTT allows in a level, so each level is
//! escaped, and the mapping is invertible for every valid topic name:
//!
//! - an **empty level** (`a//b`, `/a`, `a/`) becomes the token `%`;
//! - the bytes of `.`, `*`, `>`, `%` (the escape character), space and every
//!   other ASCII whitespace or control character become `%XX` (two
//!   upper-case hex digits), so a literal `*` or `>` can never be read as a
//!   wildcard and no token is empty or split;
//! - a `$` that starts the first level becomes `%24`: NATS reserves the
//!   subjects that start with `$` for the server and its services (`$SYS`
//!   events, the `$JS` JetStream API, `$KV`, `$SRV`...), and a bus topic
//!   such as `$JS/API/STREAM/DELETE/orders` must not become a request to
//!   one of them. Such topics are valid on the bus, so they are carried
//!   (escaped, as any reserved character), not refused; and a subject
//!   under `$` that another NATS client publishes is no subject this
//!   mapping makes, so it maps to no topic;
//! - everything else, UTF-8 included, is kept as it is.
//!
//! A filter maps the same way, with `+` → `*` and `#` → `>`. As NATS's `>`
//! needs at least one token, `a/#` (which in MQTT also matches `a`) maps to
//! **two** subjects, `a.>` and `a`; a lone `#` is `>`.
//!
//! ```
//! use blazesub::bridge::mapping::{filter_to_subjects, subject_to_topic, topic_to_subject};
//!
//! assert_eq!(topic_to_subject("sensors/kitchen/temp"), "sensors.kitchen.temp");
//! assert_eq!(topic_to_subject("a//b.c"), "a.%.b%2Ec");
//! assert_eq!(subject_to_topic("a.%.b%2Ec").as_deref(), Some("a//b.c"));
//! assert_eq!(filter_to_subjects("a/+/#"), ["a.*.>", "a.*"]);
//! assert_eq!(topic_to_subject("$SYS/x"), "%24SYS.x");
//! assert_eq!(subject_to_topic("$SYS.x"), None);
//! ```

use std::fmt::Write as _;

/// The escape character; a token that is exactly this is an empty level.
const ESCAPE: char = '%';

/// Whether `c` may stand as itself inside a NATS subject token.
fn is_plain(c: char) -> bool {
    !(c == '.' || c == '*' || c == '>' || c == ESCAPE || c.is_whitespace() || c.is_control())
}

/// Pushes level number `index` of a topic or filter (a literal, not a
/// wildcard) as a subject token.
fn push_level(out: &mut String, index: usize, level: &str) {
    if level.is_empty() {
        out.push(ESCAPE);
        return;
    }
    let mut chars = level.chars();
    if index == 0 && level.starts_with('$') {
        // The server's namespace (see the module docs).
        out.push_str("%24");
        chars.next();
    }
    for c in chars {
        if is_plain(c) {
            out.push(c);
        } else {
            let mut utf8 = [0u8; 4];
            for byte in c.encode_utf8(&mut utf8).bytes() {
                let _ = write!(out, "%{byte:02X}");
            }
        }
    }
}

/// The NATS subject for a topic name (assumed valid: see
/// [`validate_topic`](crate::topic::validate_topic)).
pub fn topic_to_subject(topic: &str) -> String {
    let mut out = String::with_capacity(topic.len() + 8);
    for (i, level) in topic.split('/').enumerate() {
        if i > 0 {
            out.push('.');
        }
        push_level(&mut out, i, level);
    }
    out
}

/// The NATS subjects one filter (assumed valid: see
/// [`validate_filter`](crate::topic::validate_filter)) subscribes to:
/// one, or two for a filter ending in `/#` (see the module docs).
pub fn filter_to_subjects(filter: &str) -> Vec<String> {
    let mut out = String::with_capacity(filter.len() + 8);
    for (i, level) in filter.split('/').enumerate() {
        if i > 0 {
            out.push('.');
        }
        match level {
            "+" => out.push('*'),
            "#" => out.push('>'),
            level => push_level(&mut out, i, level),
        }
    }
    match out.strip_suffix(".>") {
        Some(parent) => {
            let parent = parent.to_owned();
            vec![out, parent]
        }
        None => vec![out],
    }
}

/// The topic name a subject stands for, or `None` if the subject is not one
/// this mapping makes (a wildcard token, an empty token, a bad escape,
/// escaped bytes that are not UTF-8, a `/` in a token, an escape of a
/// character the mapping keeps, lower-case hex, a leading `$` unescaped):
/// another NATS client published it. So the mapping is one-to-one: each topic has one subject,
/// and only that subject maps back to it.
///
/// ```
/// use blazesub::bridge::mapping::subject_to_topic;
///
/// assert_eq!(subject_to_topic("orders.eu.42").as_deref(), Some("orders/eu/42"));
/// // Not what `topic_to_subject` makes for any topic:
/// assert_eq!(subject_to_topic("orders.eu/42"), None);
/// assert_eq!(subject_to_topic("a.%41"), None);
/// assert_eq!(subject_to_topic("a.%2e"), None);
/// ```
pub fn subject_to_topic(subject: &str) -> Option<String> {
    let topic = decode_subject(subject)?;
    // Decoding is lenient (`/` inside a token, escapes of kept characters,
    // lower-case hex); what it accepted must be what the topic maps to.
    (topic_to_subject(&topic) == subject).then_some(topic)
}

fn decode_subject(subject: &str) -> Option<String> {
    let mut out = String::with_capacity(subject.len());
    for (i, token) in subject.split('.').enumerate() {
        if i > 0 {
            out.push('/');
        }
        if token == "%" {
            continue;
        }
        if token.is_empty() || token == "*" || token == ">" {
            return None;
        }
        decode_token(token, &mut out)?;
    }
    Some(out)
}

fn decode_token(token: &str, out: &mut String) -> Option<()> {
    if !token.contains(ESCAPE) {
        out.push_str(token);
        return Some(());
    }
    let mut bytes = Vec::with_capacity(token.len());
    let raw = token.as_bytes();
    let mut i = 0;
    while i < raw.len() {
        if raw[i] == b'%' {
            let hex = token.get(i + 1..i + 3)?;
            bytes.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            bytes.push(raw[i]);
            i += 1;
        }
    }
    out.push_str(std::str::from_utf8(&bytes).ok()?);
    Some(())
}

#[cfg(feature = "nats")]
/// Escapes a metadata key or value for a NATS header: `%XX` for every byte
/// outside visible ASCII, and for `%` and (in a name) `:`.
pub(crate) fn escape_header(text: &str, name: bool) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        let keep = c.is_ascii_graphic() && c != '%' && !(name && c == ':');
        if keep {
            out.push(c);
        } else {
            let mut utf8 = [0u8; 4];
            for byte in c.encode_utf8(&mut utf8).bytes() {
                let _ = write!(out, "%{byte:02X}");
            }
        }
    }
    out
}

#[cfg(feature = "nats")]
/// Undoes [`escape_header`]; text that is not an escape of ours (another
/// client's header) is kept as it is.
pub(crate) fn unescape_header(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    match decode_token(text, &mut out) {
        Some(()) => out,
        None => text.to_owned(),
    }
}

/// The topics matching both `a` and `b` (valid filters), as one filter, or
/// `None` if no topic matches both. MQTT filters are closed under this:
/// level by level, `+` yields to the other side, `#` takes the rest of the
/// other side, and a literal must equal a literal.
pub(crate) fn intersect(a: &str, b: &str) -> Option<String> {
    let mut left = a.split('/').peekable();
    let mut right = b.split('/').peekable();
    let mut levels: Vec<&str> = Vec::new();
    let mut first = true;
    loop {
        match (left.next(), right.next()) {
            (None, None) => break,
            // `x/#` also matches `x`: the other side ended at `x`.
            (Some("#"), None) | (None, Some("#")) => break,
            (None, Some(_)) | (Some(_), None) => return None,
            (Some("#"), Some(other)) => {
                if first && other.starts_with('$') {
                    return None;
                }
                levels.push(other);
                levels.extend(right.by_ref());
                break;
            }
            (Some(other), Some("#")) => {
                if first && other.starts_with('$') {
                    return None;
                }
                levels.push(other);
                levels.extend(left.by_ref());
                break;
            }
            (Some("+"), Some(other)) | (Some(other), Some("+")) => {
                if first && other.starts_with('$') {
                    return None;
                }
                levels.push(other);
            }
            (Some(x), Some(y)) => {
                if x != y {
                    return None;
                }
                levels.push(x);
            }
        }
        first = false;
    }
    Some(levels.join("/"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::topic::matches;

    #[test]
    fn levels_and_wildcards() {
        assert_eq!(topic_to_subject("a/b/c"), "a.b.c");
        assert_eq!(topic_to_subject("/"), "%.%");
        assert_eq!(topic_to_subject("a b*>"), "a%20b%2A%3E");
        assert_eq!(filter_to_subjects("#"), [">"]);
        assert_eq!(filter_to_subjects("+"), ["*"]);
        assert_eq!(filter_to_subjects("a/#"), ["a.>", "a"]);
        assert_eq!(filter_to_subjects("/#"), ["%.>", "%"]);
        assert_eq!(subject_to_topic("a.*"), None);
        assert_eq!(subject_to_topic("a..b"), None);
        assert_eq!(subject_to_topic("a.%4"), None);
        assert_eq!(subject_to_topic("a.%FF"), None);
        // `$` is escaped where NATS reserves it: first in the subject.
        assert_eq!(topic_to_subject("$SYS/$x"), "%24SYS.$x");
        assert_eq!(subject_to_topic("%24SYS.$x").as_deref(), Some("$SYS/$x"));
        assert_eq!(filter_to_subjects("$JS/+/#"), ["%24JS.*.>", "%24JS.*"]);
        assert_eq!(subject_to_topic("$JS.API.INFO"), None);
        assert_eq!(subject_to_topic("%24"), Some("$".into()));
    }

    #[test]
    fn intersections() {
        assert_eq!(intersect("a/#", "a/+").as_deref(), Some("a/+"));
        assert_eq!(intersect("#", "orders/#").as_deref(), Some("orders/#"));
        assert_eq!(intersect("a/+/c", "a/b/#").as_deref(), Some("a/b/c"));
        assert_eq!(intersect("a/#", "a").as_deref(), Some("a"));
        assert_eq!(intersect("a", "a/#").as_deref(), Some("a"));
        assert_eq!(intersect("a/b", "a/c"), None);
        assert_eq!(intersect("a/b", "a/b/c"), None);
        assert_eq!(intersect("#", "$SYS/x"), None);
        assert_eq!(intersect("+/x", "$SYS/#"), None);
        assert_eq!(intersect("#", "#").as_deref(), Some("#"));
        // Whatever matches the intersection matches both.
        for (a, b, topic) in [("a/#", "+/b", "a/b"), ("+/+", "a/#", "a/z")] {
            let both = intersect(a, b).unwrap();
            assert!(matches(&both, topic) && matches(a, topic) && matches(b, topic));
        }
    }
}
