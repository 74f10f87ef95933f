//! Durations written in attribute arguments (`wait = "5s"`), checked at compile time so that a
//! typo is an error on the literal rather than a surprise on the database.

/// What the error on a refused duration says is accepted.
pub(crate) const FORMS: &str = "a whole number followed by `ms`, `s`, `m` or `h`, \
                                like \"500ms\", \"30s\" or \"2m\"";

/// The shortest lease, in milliseconds: a shorter one may run out before the claim's answer
/// is back.
pub(crate) const MIN_LEASE_MS: u64 = 1_000;

/// The longest lease, in milliseconds: a body that runs longer renews its lease rather than
/// taking one that keeps the key from every other delivery for days if the worker dies (and
/// that no database's date arithmetic need ever overflow on).
pub(crate) const MAX_LEASE_MS: u64 = 24 * 3_600_000;

/// What the error on a lease out of bounds says (the runtime says the same).
pub(crate) const LEASE_BOUNDS: &str = "a lease must be at least 1s and at most 24h (a job that \
                                       runs longer renews its lease with `Lease::renew`)";

/// Why a duration was refused.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Refused {
    /// Not one of the accepted spellings.
    Form,
    /// Spelt right, but more milliseconds than a `u64` holds.
    TooLong,
}

/// Milliseconds of `500ms`, `30s`, `2m`, `1h`.
///
/// Deliberately strict: no spaces, fractions or signs, so that every accepted spelling reads
/// the same to the next person. A number too large is told apart from a wrong spelling, so
/// that its error can say what is wrong with it.
pub(crate) fn parse(text: &str) -> Result<u64, Refused> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = text.split_at(digits);
    if number.is_empty() {
        return Err(Refused::Form);
    }
    let scale: u64 = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(Refused::Form),
    };
    // Only ASCII digits: the one way to fail is a number over `u64::MAX`.
    let number: u64 = number.parse().map_err(|_| Refused::TooLong)?;
    number.checked_mul(scale).ok_or(Refused::TooLong)
}

/// Milliseconds of an accepted spelling; `None` for anything else, overflow included.
#[cfg(test)]
fn millis(text: &str) -> Option<u64> {
    parse(text).ok()
}

/// Whether a lease of `ms` is within [`MIN_LEASE_MS`] and [`MAX_LEASE_MS`].
pub(crate) fn lease_in_bounds(ms: u64) -> bool {
    (MIN_LEASE_MS..=MAX_LEASE_MS).contains(&ms)
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
    use super::{
        MAX_LEASE_MS, MIN_LEASE_MS, Refused, default_timeout, lease_in_bounds, millis, parse, show,
    };

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

    #[test]
    fn tells_overflow_from_a_wrong_spelling() {
        assert_eq!(parse("99999999999999999999h"), Err(Refused::TooLong));
        assert_eq!(parse("99999999999999999999ms"), Err(Refused::TooLong));
        assert_eq!(
            parse("100000000000000000000000000000000000000s"),
            Err(Refused::TooLong)
        );
        assert_eq!(parse("5124095576030432h"), Err(Refused::TooLong));
        assert_eq!(parse("18446744073709551615ms"), Ok(u64::MAX));
        assert_eq!(parse("00000000000000000000000000001s"), Ok(1_000));
        assert_eq!(parse("99999999999999999999"), Err(Refused::Form));
        assert_eq!(parse("1.5h"), Err(Refused::Form));
    }

    #[test]
    fn bounds_a_lease_to_one_second_through_a_day() {
        assert_eq!(MIN_LEASE_MS, 1_000);
        assert_eq!(MAX_LEASE_MS, parse("24h").unwrap());
        for ok in ["1s", "1000ms", "30s", "24h", "1440m", "86400000ms"] {
            assert!(lease_in_bounds(parse(ok).unwrap()), "{ok}");
        }
        for out in ["0s", "999ms", "500ms", "25h", "86400001ms", "100000000h"] {
            assert!(!lease_in_bounds(parse(out).unwrap()), "{out}");
        }
        assert!(!lease_in_bounds(u64::MAX));
    }
}
