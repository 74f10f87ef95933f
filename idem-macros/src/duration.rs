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

/// `ms` in the largest unit that divides it, in the accepted spelling: `25000` gives `25s`.
pub(crate) fn show(ms: u64) -> String {
    match ms {
        0 => "0s".to_owned(),
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1_000 == 0 => format!("{}s", ms / 1_000),
        ms => format!("{ms}ms"),
    }
}

/// What `LeaseOptions::default_timeout` gives: the lease minus a fifth of it, at most 5 s.
pub(crate) fn default_timeout(lease_ms: u64) -> u64 {
    lease_ms - (lease_ms / 5).min(5_000)
}

#[cfg(test)]
mod tests {
    use super::{default_timeout, millis, show};

    #[test]
    fn shows_in_the_largest_exact_unit() {
        assert_eq!(show(25_000), "25s");
        assert_eq!(show(1_600), "1600ms");
        assert_eq!(show(120_000), "2m");
        assert_eq!(show(7_200_000), "2h");
        assert_eq!(show(90_000), "90s");
        assert_eq!(show(0), "0s");
    }

    #[test]
    fn default_timeout_matches_the_runtime() {
        assert_eq!(default_timeout(30_000), 25_000);
        assert_eq!(default_timeout(2_000), 1_600);
        assert_eq!(default_timeout(1), 1);
        assert_eq!(default_timeout(3_600_000), 3_595_000);
    }

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
