//! The `idem` command line: `src/bin/idem/args.rs`, included as it is, with a stand-in for the
//! binary's `Failure`.
//!
//! The input is the argument list, split at NUL bytes (non-UTF-8 bytes are kept: arguments
//! are `OsString`s). Checked: `Cli::try_parse_from` gives a command or an error, never a
//! panic, and the error renders; a parsed `inspect` or `forget` gives its key (plain, or the
//! tuple its `--part`s make) or an input error as `Key::new` would (so do `requeue` and
//! `steps`); every parsed age (`purge`, `retention set`, `doctor`) holds the seconds its text
//! says; a parsed `stuck`, `failed` or `retention` a valid scope; a parsed `outbox list` at
//! most one of `--parked` and `--pending`; a parsed `outbox requeue` or `outbox show` an id of
//! 1 to 255 bytes without NUL (`--all` instead: a filter of a valid destination, error text
//! and age); a parsed `forget --stuck-older-than` an age and a valid scope, and no key.
#![no_main]
#![allow(dead_code)]

#[path = "../../src/bin/idem/args.rs"]
mod args;

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt as _;

use args::{
    Age, Cli, Command, ForgetArgs, OutboxCommand, OutboxRequeueArgs, RequeueArgs, RetentionCommand,
    Target,
};
use clap::Parser as _;
use idem::{GROUP_ID_LEN, Key, MAX_KEY_LEN};
use libfuzzer_sys::fuzz_target;

/// The binary's `Failure`, as `args.rs` uses it (exit code 2 for input).
#[derive(Debug)]
pub(crate) struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    pub(crate) fn input(message: impl Into<String>) -> Failure {
        Failure {
            code: 2,
            message: message.into(),
        }
    }
}

fn scope_ok(scope: &str) -> bool {
    !scope.is_empty() && scope.len() <= MAX_KEY_LEN && !scope.contains('\0')
}

fn check_target(target: &Target) {
    assert!(scope_ok(&target.scope), "{:?}", target.scope);
    // `-` reads the key from standard input: not here.
    if target.key.as_deref() == Some("-") {
        return;
    }
    match target.key() {
        Ok(key) => {
            let s = key.as_str();
            assert!(!s.is_empty() && s.len() <= MAX_KEY_LEN && !s.contains('\0'));
            match &target.key {
                Some(written) => assert_eq!(s, written),
                None => assert_eq!(s, parts_key(&target.parts), "{:?}", target.parts),
            }
        }
        Err(failure) => {
            assert_eq!(failure.code, 2);
            if let Some(written) = &target.key {
                assert!(Key::new(written).is_err(), "{written:?} refused");
            }
        }
    }
}

/// The key that `--part`s name, as the documentation says: one part as written, several as
/// the tuple of them (`4:acme|2:17`).
fn parts_key(parts: &[String]) -> String {
    match parts {
        [one] => one.clone(),
        several => several
            .iter()
            .map(|p| format!("{}:{p}", p.len()))
            .collect::<Vec<_>>()
            .join("|"),
    }
}

/// The age's seconds, read from its text another way.
fn age_secs(text: &str) -> Option<u64> {
    let unit = text.chars().last()?;
    let digits = &text[..text.len() - unit.len_utf8()];
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let scale = match unit {
        'w' => 7 * 86_400,
        'd' => 86_400,
        'h' => 3_600,
        'm' => 60,
        's' => 1,
        _ => return None,
    };
    let significant = digits.trim_start_matches('0');
    if significant.len() > 20 {
        return None;
    }
    let n: u128 = significant.parse().unwrap_or(0);
    u64::try_from(n * scale).ok().filter(|&s| s > 0)
}

/// A parsed age holds the seconds its text says.
fn check_age(age: &Age) {
    assert_eq!(
        Some(age.duration.as_secs()),
        age_secs(&age.text),
        "{:?}",
        age.text
    );
}

fn check_scope(scope: &Option<String>) {
    if let Some(scope) = scope {
        assert!(scope_ok(scope));
    }
}

/// One job by its scope and key, or with `--all` every failed job a filter takes, never both.
fn check_requeue(requeue: &RequeueArgs) {
    if !requeue.all {
        let scope = requeue.scope.as_deref().expect("a scope without --all");
        assert!(scope_ok(scope), "{scope:?}");
        // `--dry-run` and `--yes` without `--all` parse (clap lets them through): the binary
        // refuses them before connecting (`run.rs`).
        return;
    }
    assert!(requeue.scope.is_none() && requeue.key.is_none() && requeue.parts.is_empty());
    check_scope(&requeue.only_scope);
    if let Some(id) = &requeue.group {
        let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
        assert!(id.len() == GROUP_ID_LEN && id.bytes().all(hex), "{id:?}");
    }
    requeue.failed_before.iter().for_each(check_age);
}

/// One marker by its scope and key, or with `--stuck-older-than` every stuck lease of a
/// scope, never both (`--dry-run` and `--yes` without it are refused by the binary).
fn check_forget(forget: &ForgetArgs) {
    let Some(age) = &forget.stuck_older_than else {
        let scope = forget
            .scope
            .clone()
            .expect("a scope without --stuck-older-than");
        check_target(&Target {
            scope,
            key: forget.key.clone(),
            parts: forget.parts.clone(),
        });
        return;
    };
    assert!(forget.scope.is_none() && forget.key.is_none() && forget.parts.is_empty());
    check_scope(&forget.only_scope);
    check_age(age);
}

/// One message by its id, or with `--all` every parked message a filter takes, never both.
fn check_outbox_requeue(requeue: &OutboxRequeueArgs) {
    if !requeue.all {
        let id = requeue.id.as_deref().expect("an id without --all");
        assert!(scope_ok(id), "{id:?}");
        return;
    }
    assert!(requeue.id.is_none());
    if let Some(destination) = &requeue.destination {
        assert!(scope_ok(destination), "{destination:?}");
    }
    if let Some(error) = &requeue.error {
        assert!(!error.is_empty() && error.len() <= 2000);
    }
    requeue.parked_before.iter().for_each(check_age);
}

fuzz_target!(|data: &[u8]| {
    let argv = std::iter::once(OsString::from("idem")).chain(
        data.split(|&b| b == 0)
            .map(|a| OsString::from_vec(a.to_vec())),
    );
    match Cli::try_parse_from(argv) {
        Ok(cli) => match &cli.command {
            Command::Inspect(target) | Command::Steps(target) => check_target(target),
            Command::Forget(forget) => check_forget(forget),
            Command::Requeue(requeue) => check_requeue(requeue),
            Command::Audit { limit } => assert!(*limit >= 1),
            Command::Purge { older_than } => older_than.iter().for_each(check_age),
            Command::Retention(RetentionCommand::Set { scope, keep }) => {
                assert!(scope_ok(scope));
                check_age(keep);
            }
            Command::Retention(RetentionCommand::Clear { scope }) => assert!(scope_ok(scope)),
            Command::Retention(RetentionCommand::List) => {}
            Command::Doctor(doctor) => {
                check_age(&doctor.stuck_after);
                let ages = [
                    &doctor.retention,
                    &doctor.wait,
                    &doctor.lease,
                    &doctor.ack_timeout,
                ];
                ages.into_iter().flatten().for_each(check_age);
                assert!(doctor.concurrency.is_none_or(|n| n >= 1));
                assert!(doctor.pool_size.is_none_or(|n| n >= 1));
            }
            Command::Stuck { scope, limit } | Command::Failed { scope, limit, .. } => {
                assert!(*limit >= 1);
                check_scope(scope);
            }
            Command::Outbox(OutboxCommand::List {
                parked,
                pending,
                limit,
            }) => {
                assert!(*limit >= 1);
                assert!(!(*parked && *pending), "--parked and --pending conflict");
            }
            // A message id is a `job_id`: what a scope may be.
            Command::Outbox(OutboxCommand::Requeue(requeue)) => check_outbox_requeue(requeue),
            Command::Outbox(OutboxCommand::Show { id }) => assert!(scope_ok(id), "{id:?}"),
            // What clap parsed is an address that reads back as itself.
            Command::Console { listen, .. } => {
                assert_eq!(
                    listen.to_string().parse::<std::net::SocketAddr>().ok(),
                    Some(*listen)
                );
            }
        },
        Err(e) => {
            let _ = e.to_string();
            let _ = e.render().ansi().to_string();
        }
    }
});
