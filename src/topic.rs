//! Topic names and topic filters, as MQTT 3.1.1 and 5.0 section 4.7 define them.
//!
//! # The rules
//!
//! A **topic name** (what you publish to) is non-empty UTF-8 of at most
//! [`MAX_TOPIC_LEN`] bytes, contains no NUL character and neither wildcard
//! (`+`, `#`). It is split into *levels* by `/`; empty levels are legal, so
//! `a//b`, `/a` and `a/` are three distinct, valid topics, and `/` alone is a
//! topic of two empty levels. Matching is case-sensitive and byte-exact.
//!
//! A **topic filter** (what you subscribe to) follows the same rules, except
//! that:
//! - `+` may fill one whole level and matches exactly one level, whatever it
//!   holds (including an empty one): `sport/+` matches `sport/` but not `sport`;
//! - `#` may fill only the last level and matches any number of levels,
//!   *including none*: `sport/#` matches `sport`, `sport/tennis` and
//!   `sport/tennis/player1`;
//! - a filter whose first level is a wildcard does not match topic names that
//!   begin with `$` (so `#` does not see `$SYS/broker/load`, but `$SYS/#` does).
//!
//! Invalid input is reported as a [`TopicError`] that names the input and the
//! rule it broke. These functions never panic, whatever the input.
//!
//! # Examples
//!
//! ```
//! use blazesub::topic::{matches, validate_filter, validate_topic};
//!
//! assert!(validate_topic("sensors/kitchen/temp").is_ok());
//! assert!(validate_topic("sensors/+/temp").is_err()); // wildcards are for filters
//! assert!(validate_filter("sensors/+/temp").is_ok());
//! assert!(validate_filter("sensors/temp#").is_err()); // `#` must be a whole level
//!
//! assert!(matches("sensors/+/temp", "sensors/kitchen/temp"));
//! assert!(matches("sensors/#", "sensors"));
//! assert!(!matches("#", "$SYS/uptime"));
//! ```

use std::fmt;

/// The longest topic name or filter, in bytes: MQTT's UTF-8 string limit.
pub const MAX_TOPIC_LEN: usize = 65_535;

/// How much of a rejected input an error message quotes.
const QUOTED_CHARS: usize = 96;

/// Whether an input was checked as a topic name or as a topic filter.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TopicKind {
    /// A topic name, as given to `publish`.
    Name,
    /// A topic filter, as given to `subscribe`.
    Filter,
}

impl fmt::Display for TopicKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TopicKind::Name => "topic name",
            TopicKind::Filter => "topic filter",
        })
    }
}

/// The rule of MQTT section 4.7 that an input broke.
///
/// Positions are byte offsets into the input; levels are numbered from 1.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TopicRule {
    /// Topic names and filters must be at least one character long.
    Empty,
    /// Longer than [`MAX_TOPIC_LEN`] bytes.
    TooLong {
        /// The input's length in bytes.
        len: usize,
    },
    /// Contains the NUL character U+0000.
    Nul {
        /// Byte offset of the first NUL.
        offset: usize,
    },
    /// A topic name contains `+` or `#`; wildcards belong only in filters.
    WildcardInName {
        /// Byte offset of the first wildcard.
        offset: usize,
        /// The wildcard found.
        wildcard: char,
    },
    /// A wildcard shares its level with other characters (`sport+`, `a/b#`).
    WildcardNotWholeLevel {
        /// The offending level, counted from 1.
        level: usize,
        /// The wildcard found.
        wildcard: char,
    },
    /// `#` is used before the last level (`a/#/b`).
    HashNotLast {
        /// The level holding the `#`, counted from 1.
        level: usize,
    },
    /// A shared subscription (`$share/{group}/{filter}`) with an empty share
    /// name (`$share//a`).
    ShareNameEmpty,
    /// A shared subscription whose share name holds a wildcard
    /// (`$share/g+/a`); MQTT 5 §4.8.2 forbids `+` and `#` there.
    ShareNameWildcard {
        /// The wildcard found.
        wildcard: char,
    },
    /// A shared subscription with no filter after its share name
    /// (`$share/group` or `$share/group/`).
    ShareFilterMissing,
}

impl fmt::Display for TopicRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TopicRule::Empty => f.write_str("it must not be empty"),
            TopicRule::TooLong { len } => {
                write!(
                    f,
                    "it is {len} bytes long, over the limit of {MAX_TOPIC_LEN}"
                )
            }
            TopicRule::Nul { offset } => {
                write!(f, "it contains the NUL character (at byte {offset})")
            }
            TopicRule::WildcardInName { offset, wildcard } => write!(
                f,
                "a topic name must not contain the wildcard `{wildcard}` (at byte {offset}); \
                 wildcards belong in subscription filters"
            ),
            TopicRule::WildcardNotWholeLevel { level, wildcard } => write!(
                f,
                "the wildcard `{wildcard}` must occupy a whole level, but level {level} holds \
                 other characters too"
            ),
            TopicRule::HashNotLast { level } => write!(
                f,
                "the multi-level wildcard `#` must be the last level, but it is level {level} \
                 and more levels follow"
            ),
            TopicRule::ShareNameEmpty => f.write_str(
                "a shared subscription needs a share name: write `$share/{group}/{filter}`",
            ),
            TopicRule::ShareNameWildcard { wildcard } => write!(
                f,
                "a share name must not contain the wildcard `{wildcard}` (MQTT 5 section 4.8.2)"
            ),
            TopicRule::ShareFilterMissing => f.write_str(
                "a shared subscription needs a filter after its share name: \
                 write `$share/{group}/{filter}`",
            ),
        }
    }
}

/// A topic name or filter that breaks a rule of MQTT section 4.7.
///
/// It quotes the input (its first 96 characters, for long ones) and says which
/// rule was broken.
///
/// ```
/// use blazesub::topic::{validate_filter, TopicRule};
///
/// let err = validate_filter("sport/tennis#").unwrap_err();
/// assert_eq!(err.input(), "sport/tennis#");
/// assert_eq!(err.rule(), &TopicRule::WildcardNotWholeLevel { level: 2, wildcard: '#' });
/// assert_eq!(
///     err.to_string(),
///     "invalid topic filter \"sport/tennis#\": the wildcard `#` must occupy a whole level, \
///      but level 2 holds other characters too"
/// );
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopicError {
    kind: TopicKind,
    input: String,
    rule: TopicRule,
}

impl TopicError {
    fn new(kind: TopicKind, input: &str, rule: TopicRule) -> Self {
        let input = match input.char_indices().nth(QUOTED_CHARS) {
            Some((cut, _)) => format!("{}…", &input[..cut]),
            None => input.to_owned(),
        };
        Self { kind, input, rule }
    }

    /// Whether the input was a topic name or a filter.
    pub fn kind(&self) -> TopicKind {
        self.kind
    }

    /// The rejected input (its first 96 characters and `…` if it was longer).
    pub fn input(&self) -> &str {
        &self.input
    }

    /// The rule the input broke.
    pub fn rule(&self) -> &TopicRule {
        &self.rule
    }
}

impl fmt::Display for TopicError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "invalid {} {:?}: {}", self.kind, self.input, self.rule)
    }
}

impl std::error::Error for TopicError {}

/// Rules shared by names and filters: non-empty, not too long, no NUL.
fn check_common(kind: TopicKind, input: &str) -> Result<(), TopicError> {
    if input.is_empty() {
        return Err(TopicError::new(kind, input, TopicRule::Empty));
    }
    if input.len() > MAX_TOPIC_LEN {
        let len = input.len();
        return Err(TopicError::new(kind, input, TopicRule::TooLong { len }));
    }
    Ok(())
}

/// Checks a topic name: what `publish` accepts.
///
/// ```
/// use blazesub::topic::validate_topic;
///
/// assert!(validate_topic("a//b").is_ok()); // empty levels are legal
/// assert!(validate_topic("/").is_ok());
/// assert!(validate_topic("$SYS/uptime").is_ok());
/// assert!(validate_topic("").is_err());
/// assert!(validate_topic("a/#").is_err());
/// ```
pub fn validate_topic(topic: &str) -> Result<(), TopicError> {
    check_common(TopicKind::Name, topic)?;
    // One pass over the bytes: this runs on every publish.
    match topic.bytes().position(|b| matches!(b, b'+' | b'#' | b'\0')) {
        None => Ok(()),
        Some(offset) => {
            let rule = match topic.as_bytes()[offset] {
                b'\0' => TopicRule::Nul { offset },
                b => TopicRule::WildcardInName {
                    offset,
                    wildcard: char::from(b),
                },
            };
            Err(TopicError::new(TopicKind::Name, topic, rule))
        }
    }
}

/// Checks a topic filter: what `subscribe` accepts.
///
/// ```
/// use blazesub::topic::validate_filter;
///
/// assert!(validate_filter("#").is_ok());
/// assert!(validate_filter("+/tennis/#").is_ok());
/// assert!(validate_filter("sport/+/player1").is_ok());
/// assert!(validate_filter("sport+").is_err());
/// assert!(validate_filter("sport/tennis/#/ranking").is_err());
/// ```
pub fn validate_filter(filter: &str) -> Result<(), TopicError> {
    check_common(TopicKind::Filter, filter)?;
    if let Some(rest) = filter.strip_prefix(SHARE_PREFIX) {
        return validate_shared(filter, rest);
    }
    validate_plain_filter(filter)
}

/// The prefix of a shared subscription's filter (MQTT 5 §4.8.2):
/// `$share/{group}/{filter}`.
pub const SHARE_PREFIX: &str = "$share/";

/// A shared subscription's share name and filter, if `filter` starts with
/// [`SHARE_PREFIX`] (it is not validated here).
pub(crate) fn split_shared(filter: &str) -> Option<(&str, &str)> {
    let rest = filter.strip_prefix(SHARE_PREFIX)?;
    Some(rest.split_once('/').unwrap_or((rest, "")))
}

/// Checks `$share/{group}/{filter}`: `rest` is what follows the prefix.
/// Errors quote the whole input; levels and offsets count in it.
fn validate_shared(whole: &str, rest: &str) -> Result<(), TopicError> {
    let fail = |rule| Err(TopicError::new(TopicKind::Filter, whole, rule));
    let Some((group, inner)) = rest.split_once('/') else {
        return if rest.is_empty() {
            fail(TopicRule::ShareNameEmpty)
        } else {
            fail(TopicRule::ShareFilterMissing)
        };
    };
    if group.is_empty() {
        return fail(TopicRule::ShareNameEmpty);
    }
    if let Some(wildcard) = group.chars().find(|c| matches!(c, '+' | '#')) {
        return fail(TopicRule::ShareNameWildcard { wildcard });
    }
    if inner.is_empty() {
        return fail(TopicRule::ShareFilterMissing);
    }
    let skipped = whole.len() - inner.len();
    validate_plain_filter(inner).map_err(|error| {
        let rule = match error.rule {
            TopicRule::Nul { offset } => TopicRule::Nul {
                offset: offset + skipped,
            },
            TopicRule::WildcardNotWholeLevel { level, wildcard } => {
                TopicRule::WildcardNotWholeLevel {
                    level: level + 2,
                    wildcard,
                }
            }
            TopicRule::HashNotLast { level } => TopicRule::HashNotLast { level: level + 2 },
            other => other,
        };
        TopicError::new(TopicKind::Filter, whole, rule)
    })
}

/// [`validate_filter`] for a filter that is not shared.
fn validate_plain_filter(filter: &str) -> Result<(), TopicError> {
    // One pass over the bytes (every subscribe runs it); the rare failure
    // path then reports what the rules put first: a NUL anywhere.
    let bytes = filter.as_bytes();
    let mut level_start = 0;
    let mut level = 1;
    for (offset, &byte) in bytes.iter().enumerate() {
        let rule = match byte {
            b'/' => {
                level_start = offset + 1;
                level += 1;
                continue;
            }
            b'\0' => TopicRule::Nul { offset },
            b'+' | b'#' => {
                let next = bytes.get(offset + 1);
                if offset != level_start || next.is_some_and(|&n| n != b'/') {
                    TopicRule::WildcardNotWholeLevel {
                        level,
                        wildcard: char::from(byte),
                    }
                } else if byte == b'#' && next.is_some() {
                    TopicRule::HashNotLast { level }
                } else {
                    continue;
                }
            }
            _ => continue,
        };
        let rule = match bytes[offset..].iter().position(|&b| b == b'\0') {
            Some(nul) => TopicRule::Nul {
                offset: offset + nul,
            },
            None => rule,
        };
        return Err(TopicError::new(TopicKind::Filter, filter, rule));
    }
    Ok(())
}

/// Whether `filter` matches `topic`.
///
/// This is a predicate, not a validator: if either input is invalid the answer
/// is `false`. Use [`validate_filter`] and [`validate_topic`] to learn why.
///
/// ```
/// use blazesub::topic::matches;
///
/// assert!(matches("sport/tennis/player1/#", "sport/tennis/player1"));
/// assert!(matches("sport/+", "sport/"));
/// assert!(!matches("sport/+", "sport"));
/// assert!(matches("+/+", "/finance"));
/// assert!(!matches("+", "/finance"));
/// assert!(!matches("+/monitor/Clients", "$SYS/monitor/Clients"));
/// assert!(matches("$SYS/monitor/+", "$SYS/monitor/Clients"));
/// ```
pub fn matches(filter: &str, topic: &str) -> bool {
    if validate_filter(filter).is_err() || validate_topic(topic).is_err() {
        return false;
    }
    let filter = split_shared(filter).map_or(filter, |(_, inner)| inner);
    matches_valid(filter, topic)
}

/// [`matches()`] for a valid, non-shared filter and a valid topic name.
pub(crate) fn matches_valid(filter: &str, topic: &str) -> bool {
    if is_system_topic(topic) && filter.starts_with(['+', '#']) {
        return false;
    }
    let mut filter_levels = filter.split('/');
    let mut topic_levels = topic.split('/');
    loop {
        match (filter_levels.next(), topic_levels.next()) {
            (Some("#"), _) => return true,
            (Some("+"), Some(_)) => {}
            (Some(f), Some(t)) if f == t => {}
            (None, None) => return true,
            _ => return false,
        }
    }
}

/// Whether two valid, non-shared filters match at least one topic name in
/// common (a request to a filter reaches the subscriptions it overlaps).
pub(crate) fn overlaps(a: &str, b: &str) -> bool {
    let mut a_levels = a.split('/');
    let mut b_levels = b.split('/');
    let mut first = true;
    loop {
        match (a_levels.next(), b_levels.next()) {
            (None, None) => return true,
            // `x/#` matches `x`.
            (Some("#"), None) | (None, Some("#")) => return true,
            (None, Some(_)) | (Some(_), None) => return false,
            (Some(x), Some(y)) => {
                let x_wild = x == "+" || x == "#";
                let y_wild = y == "+" || y == "#";
                if first && ((x_wild && y.starts_with('$')) || (y_wild && x.starts_with('$'))) {
                    // First-level wildcards never match `$` topics.
                    return false;
                }
                if x == "#" || y == "#" {
                    return true;
                }
                if !(x_wild || y_wild || x == y) {
                    return false;
                }
            }
        }
        first = false;
    }
}

/// Whether first-level wildcards must skip this topic name (it starts with `$`).
pub(crate) fn is_system_topic(topic: &str) -> bool {
    topic.starts_with('$')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The rules of a plain filter as MQTT states them, level by level: the
    /// oracle of the one-pass `validate_plain_filter`.
    #[cfg(not(loom))]
    fn plain_filter_by_levels(filter: &str) -> Result<(), TopicError> {
        let fail = |rule| Err(TopicError::new(TopicKind::Filter, filter, rule));
        if let Some(offset) = filter.bytes().position(|b| b == b'\0') {
            return fail(TopicRule::Nul { offset });
        }
        let levels: Vec<&str> = filter.split('/').collect();
        for (index, text) in levels.iter().enumerate() {
            let level = index + 1;
            match *text {
                "+" => {}
                "#" if level < levels.len() => return fail(TopicRule::HashNotLast { level }),
                "#" => {}
                _ => {
                    if let Some(wildcard) = text.chars().find(|c| matches!(c, '+' | '#')) {
                        return fail(TopicRule::WildcardNotWholeLevel { level, wildcard });
                    }
                }
            }
        }
        Ok(())
    }

    #[cfg(not(loom))]
    proptest::proptest! {
        #[test]
        fn one_pass_filter_check_agrees_with_the_level_rules(
            filter in "[a/+#\\x00é]{0,12}"
        ) {
            proptest::prop_assert_eq!(
                validate_plain_filter(&filter),
                plain_filter_by_levels(&filter)
            );
        }
    }

    #[test]
    fn overlapping_filters() {
        for (a, b, expected) in [
            ("health/+", "health/billing", true),
            ("health/+", "health/#", true),
            ("health/+", "health", false),
            ("health/#", "health", true),
            ("#", "$SYS/x", false),
            ("+/x", "$SYS/x", false),
            ("$SYS/+", "$SYS/#", true),
            ("#", "+", true),
            ("a/+/c", "a/b/+", true),
            ("a/+/c", "a/b/d", false),
            ("a/b", "a/b/c", false),
        ] {
            assert_eq!(overlaps(a, b), expected, "{a} / {b}");
            assert_eq!(overlaps(b, a), expected, "{b} / {a}");
        }
    }

    #[test]
    fn long_inputs_are_quoted_shortened() {
        let long = "x".repeat(MAX_TOPIC_LEN + 1);
        let err = validate_topic(&long).unwrap_err();
        assert_eq!(
            err.rule(),
            &TopicRule::TooLong {
                len: MAX_TOPIC_LEN + 1
            }
        );
        assert_eq!(err.input().chars().count(), QUOTED_CHARS + 1);
        assert!(err.input().ends_with('…'));
    }

    #[test]
    fn quoting_cuts_on_char_boundaries() {
        let long = format!("{}#", "é".repeat(200));
        let err = validate_topic(&long).unwrap_err();
        assert!(err.input().starts_with("éé"));
    }

    #[test]
    fn nul_is_reported_before_wildcards_in_filters() {
        let err = validate_filter("a/\0/b+").unwrap_err();
        assert_eq!(err.rule(), &TopicRule::Nul { offset: 2 });
    }
}
