//! The attribute's duration parser (`wait = "5s"`, `lease`, `timeout`): the module itself,
//! included from `idem-macros` (a proc-macro crate cannot be linked as a library).
//!
//! Checked, for any text: `parse` never panics, and agrees with a reference reading of the
//! documented grammar (ASCII digits, then exactly one of `ms`, `s`, `m`, `h`; a number whose
//! milliseconds pass `u64::MAX` is `TooLong`, anything else `Form`). An accepted value shown
//! by `show` parses back to itself; the lease bounds and the default timeout hold.
#![no_main]

#[path = "../../idem-macros/src/duration.rs"]
#[allow(dead_code)]
mod duration;

use duration::{
    MAX_LEASE_MS, MIN_LEASE_MS, Refused, default_timeout, lease_in_bounds, parse, show,
};
use libfuzzer_sys::fuzz_target;

/// The grammar, read another way: by unit suffix first, with 128-bit arithmetic.
fn reference(text: &str) -> Result<u64, Refused> {
    let (number, scale) = [("ms", 1u128), ("s", 1_000), ("m", 60_000), ("h", 3_600_000)]
        .into_iter()
        .find_map(|(unit, scale)| text.strip_suffix(unit).map(|n| (n, scale)))
        .ok_or(Refused::Form)?;
    // `5ms` ends in `s` too, but its number `5m` is not all digits: only one split can be.
    if number.is_empty() || !number.bytes().all(|b| b.is_ascii_digit()) {
        return Err(Refused::Form);
    }
    let significant = number.trim_start_matches('0');
    if significant.len() > 20 {
        return Err(Refused::TooLong);
    }
    let n: u128 = if significant.is_empty() {
        0
    } else {
        significant.parse().expect("at most 20 digits")
    };
    u64::try_from(n * scale).map_err(|_| Refused::TooLong)
}

fn check_ms(ms: u64) {
    let shown = show(ms);
    assert_eq!(parse(&shown), Ok(ms), "show({ms}) = {shown:?}");
    assert_eq!(
        lease_in_bounds(ms),
        (MIN_LEASE_MS..=MAX_LEASE_MS).contains(&ms)
    );
    let timeout = default_timeout(ms);
    assert!(timeout <= ms, "default_timeout({ms}) = {timeout}");
    assert!(ms - timeout <= 5_000);
    if lease_in_bounds(ms) {
        // The attribute's own check (`timeout` shorter than the lease) holds for its default.
        assert!(
            timeout > 0 && timeout < ms,
            "default_timeout({ms}) = {timeout}"
        );
    }
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let got = parse(&text);
    assert_eq!(got, reference(&text), "{text:?}");
    if let Ok(ms) = got {
        check_ms(ms);
    }
    if let Ok(bytes) = <[u8; 8]>::try_from(data.get(..8).unwrap_or_default()) {
        check_ms(u64::from_le_bytes(bytes));
    }
});
