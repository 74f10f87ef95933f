//! Durations written in attribute arguments (`wait = "5s"`), checked at compile time so that a
//! typo is an error on the literal rather than a surprise on the database.

/// What the error on a refused duration says is accepted.
pub(crate) const FORMS: &str = "a whole number followed by `ms`, `s`, `m` or `h`, \
                                like \"500ms\", \"30s\" or \"2m\"";

/// Milliseconds of `500ms`, `30s`, `2m`, `1h`; `None` for anything else, overflow included.
///
/// Deliberately strict: no spaces, fractions or signs, so that every accepted spelling reads
/// the same to the next person.
pub(crate) fn millis(text: &str) -> Option<u64> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = text.split_at(digits);
    if number.is_empty() {
        return None;
    }
    let scale: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return None,
    };
    number.parse::<u64>().ok()?.checked_mul(scale)
}

#[cfg(test)]
mod tests {
    use super::millis;

    #[test]
    fn accepts_each_unit() {
        assert_eq!(millis("500ms"), Some(500));
        assert_eq!(millis("30s"), Some(30_000));
        assert_eq!(millis("2m"), Some(120_000));
        assert_eq!(millis("1h"), Some(3_600_000));
        assert_eq!(millis("0s"), Some(0));
        assert_eq!(millis("007s"), Some(7_000));
    }

    #[test]
    fn refuses_other_spellings() {
        for text in [
            "",
            "5",
            "s",
            "ms",
            "30 seconds",
            "30 s",
            " 30s",
            "30s ",
            "-1s",
            "+1s",
            "1.5s",
            "1_000ms",
            "5S",
            "5sec",
            "5min",
            "1d",
            "5us",
            "1h30m",
        ] {
            assert_eq!(millis(text), None, "{text:?}");
        }
    }

    #[test]
    fn refuses_overflow() {
        assert_eq!(millis("18446744073709551615ms"), Some(u64::MAX));
        assert_eq!(millis("18446744073709551616ms"), None);
        assert_eq!(millis("18446744073709551615s"), None);
        assert_eq!(millis("5124095576030432h"), None);
    }
}
