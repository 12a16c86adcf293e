//! What a caught panic said, for a log line or an error: the payload of
//! `panic!("...")` is a `&str` or a `String`; anything else (a
//! `std::panic::panic_any` of another type) has no message to show.

use std::any::Any;

/// The message a caught panic carried, or a placeholder naming its absence.
pub(crate) fn panic_message(panic: &(dyn Any + Send)) -> &str {
    panic
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| panic.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("(non-string panic payload)")
}

#[cfg(test)]
mod tests {
    use super::panic_message;

    #[test]
    fn each_payload_kind_gives_its_message() {
        let literal = std::panic::catch_unwind(|| panic!("plain")).unwrap_err();
        let formatted = std::panic::catch_unwind(|| panic!("{}", 7)).unwrap_err();
        let other = std::panic::catch_unwind(|| std::panic::panic_any(7_u8)).unwrap_err();
        assert_eq!(panic_message(&*literal), "plain");
        assert_eq!(panic_message(&*formatted), "7");
        assert_eq!(panic_message(&*other), "(non-string panic payload)");
    }
}
