//! The command line, and the checks that need no database: durations, scopes and keys.

use std::io::Read as _;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use idem::{IntoKey, Key, KeyWriter};

use crate::Failure;

/// Look at and tidy the markers that idem's idempotent handlers keep.
///
/// Exit codes: 0 done; 1 the database could not be reached or refused a statement; 2 bad
/// input (nothing was sent to the database); 3 `inspect` or `requeue` found no marker, or
/// `outbox requeue` no message of that id; 4 `outbox requeue` of a message that is not parked,
/// or `requeue` of a job that did not fail; 5 `forget` of a marker whose lease a delivery still
/// holds, or `forget --stuck-older-than` of leases one of which a delivery still holds (nothing
/// was changed: see `--force`); 6 `doctor` found warnings (and no problem); 7
/// `doctor` found a problem; 8 `requeue --all`, `outbox requeue --all` or `forget
/// --stuck-older-than` of more rows than it takes unconfirmed, without `--yes` (nothing was
/// changed).
#[derive(Debug, Parser)]
#[command(name = "idem", version)]
pub(crate) struct Cli {
    /// The database: postgres://USER@HOST/DB, mysql:// or mariadb://USER@HOST/DB, sqlite:PATH.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, global = true)]
    pub(crate) database_url: Option<String>,

    /// The marker table (what the handlers' store was given with `Store::with_table`).
    #[arg(long, env = "IDEM_TABLE", default_value = idem::DEFAULT_TABLE, global = true)]
    pub(crate) table: String,

    /// Print one JSON document instead of text.
    #[arg(long, global = true)]
    pub(crate) json: bool,

    /// Who acts, as the audit log records it (default: the USER or USERNAME variable, else
    /// "unknown").
    #[arg(long, global = true, value_name = "NAME", value_parser = parse_actor)]
    pub(crate) actor: Option<String>,

    #[command(subcommand)]
    pub(crate) command: Command,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Show the marker of one job: state, attempts, lease, times (exit 3 if there is none).
    Inspect(Target),
    /// Let the next delivery of one job run again: a completed marker is deleted, one in
    /// progress let go of (exit 5, nothing changed, if a delivery still holds its lease: see
    /// `--force`); with `--stuck-older-than`, every stuck lease older than AGE.
    Forget(ForgetArgs),
    /// Delete the markers of jobs completed longer ago than their scope's retention window
    /// (`retention set`), and of the other scopes longer ago than AGE; prints how many.
    Purge {
        /// The retention of the scopes without a window: a whole number and one unit, w
        /// (weeks), d (days), h, m or s, as 2w, 7d, 12h, 30m or 90s. It must outlast the time
        /// the broker may still redeliver a job. Without it, only the scopes with a window
        /// are purged.
        #[arg(long, value_name = "AGE", value_parser = parse_age)]
        older_than: Option<Age>,
    },
    /// Each scope's retention window, kept in the database, which `purge` (here and in the
    /// workers' code) honours.
    #[command(subcommand)]
    Retention(RetentionCommand),
    /// Check the deployment and say what is wrong and what to do: the schema and its
    /// indexes, dead space, markers older than their retention, stuck leases, parked outbox
    /// messages, the pool, the ack timeout, a pooler, the clock. Exit 0 healthy, 6 warnings,
    /// 7 a problem.
    Doctor(DoctorArgs),
    /// List markers still in progress (lease mode): run-out and released leases first.
    Stuck {
        /// Only this handler's scope (default: every scope).
        #[arg(long, value_parser = parse_scope)]
        scope: Option<String>,
        /// At most this many markers.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
    },
    /// List the jobs that failed for good (a lease-mode body's permanent error), newest first,
    /// with their errors.
    Failed {
        /// Only this handler's scope (default: every scope).
        #[arg(long, value_parser = parse_scope)]
        scope: Option<String>,
        /// At most this many markers (groups, with `--group-by`).
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
        /// Count them by scope and error instead, the largest groups first, each with its id
        /// (for `requeue --all --group ID`) and when its first and last job failed.
        #[arg(long, value_enum, value_name = "WHAT")]
        group_by: Option<GroupBy>,
    },
    /// Let the next delivery of a job that failed for good run it again, after the steps its
    /// lease recorded (exit 3 if there is no marker, 4 if the job did not fail); with `--all`,
    /// every failed job the filter takes.
    Requeue(RequeueArgs),
    /// The operators' audit log, newest first: who requeued or forgot what, when, and how
    /// many rows it changed.
    Audit {
        /// At most this many rows.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
    },
    /// Show the steps a job's lease recorded, in their body's order, with their values.
    Steps(Target),
    /// The outbox's messages: list the parked and pending ones, show one, requeue a parked one.
    #[command(subcommand)]
    Outbox(OutboxCommand),
    /// Serve the web console (failures grouped by error, stuck leases, the outbox, a job's
    /// story, the audit log) until Ctrl-C: read-only unless `--admin`.
    Console {
        /// Where to listen.
        #[arg(long, default_value = "127.0.0.1:8080", value_name = "ADDRESS")]
        listen: std::net::SocketAddr,
        /// Grant every visitor the console's actions (requeue), audited as `--actor`: only on
        /// an address that no one else reaches. To grant some users only, mount
        /// `idem::console` in an application behind its own login.
        #[arg(long)]
        admin: bool,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum RetentionCommand {
    /// Keep the completed markers of SCOPE for AGE (set again to change it).
    Set {
        /// The handler's scope.
        #[arg(value_parser = parse_scope)]
        scope: String,
        /// How long: a whole number and one unit, w, d, h, m or s (30d, 72h). It must outlast
        /// the time the scope's broker may still redeliver a job.
        #[arg(value_name = "AGE", value_parser = parse_age)]
        keep: Age,
    },
    /// List every scope's window.
    List,
    /// Remove SCOPE's window: `purge --older-than` decides for it again.
    Clear {
        /// The handler's scope.
        #[arg(value_parser = parse_scope)]
        scope: String,
    },
}

/// What `doctor` is told of the deployment; a check whose setting is not given is skipped.
#[derive(Debug, Args)]
pub(crate) struct DoctorArgs {
    /// The age `purge --older-than` runs with: older markers mean purge is not running.
    #[arg(long, value_name = "AGE", value_parser = parse_age)]
    pub(crate) retention: Option<Age>,
    /// How long after its lease ran out a marker still in progress counts as stuck.
    #[arg(long, value_name = "AGE", value_parser = parse_age, default_value = "1h")]
    pub(crate) stuck_after: Age,
    /// The jobs one worker runs at once.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) concurrency: Option<u32>,
    /// The workers' pool size (max connections).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) pool_size: Option<u32>,
    /// The handlers' `wait`.
    #[arg(long, value_name = "AGE", value_parser = parse_age)]
    pub(crate) wait: Option<Age>,
    /// The handlers' lease (lease mode).
    #[arg(long, value_name = "AGE", value_parser = parse_age)]
    pub(crate) lease: Option<Age>,
    /// The broker's ack timeout: SQS's visibility timeout, RabbitMQ's consumer_timeout,
    /// JetStream's ack_wait, Kafka's max.poll.interval.ms.
    #[arg(long, value_name = "AGE", value_parser = parse_age)]
    pub(crate) ack_timeout: Option<Age>,
}

#[derive(Debug, Subcommand)]
pub(crate) enum OutboxCommand {
    /// List unsent messages, parked ones first, then oldest first: id, destination, ordering
    /// key, state, attempts, age, last error (`--json` adds each one's headers).
    List {
        /// Only the parked messages (those the relay gave up on).
        #[arg(long, conflicts_with = "pending")]
        parked: bool,
        /// Only the pending messages (waiting for the relay, or for a retry).
        #[arg(long)]
        pending: bool,
        /// At most this many messages.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..))]
        limit: u32,
    },
    /// Make a parked message pending again, due at once with no failed attempts: the relay
    /// publishes it at its next round (exit 3 if there is no such message, 4 if it is not
    /// parked); with `--all`, every parked message the filter takes.
    Requeue(OutboxRequeueArgs),
    /// Show one message, sent or not: where it stands, its ordering key and its headers
    /// (exit 3 if there is no such message).
    Show {
        /// The message's id, as `outbox list` prints it.
        #[arg(value_parser = parse_message_id, allow_hyphen_values = true)]
        id: String,
    },
}

/// `outbox requeue ID`, or `outbox requeue --all` and its filter.
#[derive(Debug, Args)]
pub(crate) struct OutboxRequeueArgs {
    /// The message's id, as `outbox list` prints it.
    #[arg(value_parser = parse_message_id, allow_hyphen_values = true,
          required_unless_present = "all", conflicts_with = "all")]
    pub(crate) id: Option<String>,

    /// Every parked message the filter takes (`--destination`, `--error`, `--parked-before`;
    /// none: every one), requeued in pages of 500, each key's messages in the order the relay
    /// publishes them.
    #[arg(long)]
    pub(crate) all: bool,

    /// With `--all`: only the messages to this destination (queue, routing key, subject), as
    /// `outbox list` prints it.
    #[arg(long, value_name = "DESTINATION", requires = "all", value_parser = parse_message_id)]
    pub(crate) destination: Option<String>,

    /// With `--all`: only the messages whose last error contains TEXT (byte for byte).
    #[arg(long, value_name = "TEXT", requires = "all", value_parser = parse_error_text)]
    pub(crate) error: Option<String>,

    /// With `--all`: only the messages parked longer ago than AGE (30m, 12h, 7d).
    #[arg(long, value_name = "AGE", requires = "all", value_parser = parse_age)]
    pub(crate) parked_before: Option<Age>,

    /// With `--all`: print how many messages (and which, the first 20) it would requeue, and
    /// change nothing.
    #[arg(long, requires = "all")]
    pub(crate) dry_run: bool,

    /// With `--all`: requeue more than 100 messages (without it, exit 8 and nothing changed).
    #[arg(long, requires = "all")]
    pub(crate) yes: bool,
}

/// `forget SCOPE KEY`, or `forget --stuck-older-than AGE` and its scope.
#[derive(Debug, Args)]
pub(crate) struct ForgetArgs {
    /// The handler's scope (its `scope = "..."`).
    #[arg(value_parser = parse_scope, required_unless_present = "stuck_older_than",
          conflicts_with = "stuck_older_than")]
    pub(crate) scope: Option<String>,

    /// The key as stored, as `inspect` and `stuck` print it (`-`: read from standard input).
    #[arg(allow_hyphen_values = true, conflicts_with = "stuck_older_than")]
    pub(crate) key: Option<String>,

    /// A tuple key given part by part, in order.
    #[arg(long = "part", value_name = "PART",
          conflicts_with_all = ["key", "stuck_older_than"])]
    pub(crate) parts: Vec<String>,

    /// Forget it even if a delivery still holds its lease. That delivery may still be
    /// calling the outside system: the next delivery runs the job again beside it (with
    /// the same idempotency key, which a provider that honours it deduplicates), and the
    /// old holder can no longer complete or release the key (its token is fenced out).
    /// Use it when the holder is known to be gone and its lease is too long to wait out.
    /// With `--stuck-older-than`, the same for every marker it takes: a holder still alive
    /// is fenced out and its job may run twice.
    #[arg(long)]
    pub(crate) force: bool,

    /// Every stuck lease older than AGE (30m, 12h, 7d): a marker in progress (as `stuck`
    /// lists it) created longer ago than AGE and not let go yet, forgotten in pages of 500.
    /// Without `--force`, exit 5 and nothing changed if a delivery still holds any of them.
    #[arg(long, value_name = "AGE", value_parser = parse_age)]
    pub(crate) stuck_older_than: Option<Age>,

    /// With `--stuck-older-than`: only this handler's scope.
    #[arg(long = "scope", id = "only_scope", value_name = "SCOPE",
          requires = "stuck_older_than", value_parser = parse_scope)]
    pub(crate) only_scope: Option<String>,

    /// With `--stuck-older-than`: print how many markers (and which, the first 20) it would
    /// forget, and change nothing.
    #[arg(long, requires = "stuck_older_than")]
    pub(crate) dry_run: bool,

    /// With `--stuck-older-than`: forget more than 100 markers (without it, exit 8 and
    /// nothing changed).
    #[arg(long, requires = "stuck_older_than")]
    pub(crate) yes: bool,
}

/// What `failed --group-by` counts by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum GroupBy {
    /// The scope and the error text.
    Error,
}

/// `requeue SCOPE KEY`, or `requeue --all` and its filter.
#[derive(Debug, Args)]
pub(crate) struct RequeueArgs {
    /// The handler's scope (its `scope = "..."`).
    #[arg(value_parser = parse_scope, required_unless_present = "all", conflicts_with = "all")]
    pub(crate) scope: Option<String>,

    /// The key as stored, as `inspect` and `failed` print it (`-`: read from standard input).
    #[arg(allow_hyphen_values = true, conflicts_with = "all")]
    pub(crate) key: Option<String>,

    /// A tuple key given part by part, in order.
    #[arg(long = "part", value_name = "PART", conflicts_with_all = ["key", "all"])]
    pub(crate) parts: Vec<String>,

    /// Every job that failed for good and that the filter takes (`--scope`, `--group`,
    /// `--failed-before`; none: every one), requeued in pages of 500.
    #[arg(long)]
    pub(crate) all: bool,

    /// With `--all`: only this handler's scope.
    #[arg(long = "scope", id = "only_scope", value_name = "SCOPE", requires = "all",
          value_parser = parse_scope)]
    pub(crate) only_scope: Option<String>,

    /// With `--all`: only this group's jobs (its id, as `failed --group-by error` prints it:
    /// 12 hex digits).
    #[arg(long, value_name = "ID", requires = "all", value_parser = parse_group_id)]
    pub(crate) group: Option<String>,

    /// With `--all`: only the jobs that failed longer ago than AGE (30m, 12h, 7d).
    #[arg(long, value_name = "AGE", requires = "all", value_parser = parse_age)]
    pub(crate) failed_before: Option<Age>,

    /// With `--all`: print how many jobs (and which, the first 20) it would requeue, and
    /// change nothing.
    #[arg(long, requires = "all")]
    pub(crate) dry_run: bool,

    /// With `--all`: requeue more than 100 jobs (without it, exit 8 and nothing changed).
    #[arg(long, requires = "all")]
    pub(crate) yes: bool,
}

/// One job's marker: its handler's scope and its key.
#[derive(Debug, Args)]
pub(crate) struct Target {
    /// The handler's scope (its `scope = "..."`).
    #[arg(value_parser = parse_scope)]
    pub(crate) scope: String,

    /// The key as stored, as `inspect` and `stuck` print it: a string or integer id as
    /// written (`order-7`, `42`), a tuple key in its encoded form (`4:acme|2:17`). `-` reads
    /// it from standard input (one trailing newline dropped).
    #[arg(required_unless_present = "parts", allow_hyphen_values = true)]
    pub(crate) key: Option<String>,

    /// A tuple key given part by part, in order (`--part acme --part 17` is `4:acme|2:17`),
    /// encoded as the handler's tuple key expression encodes it.
    #[arg(long = "part", value_name = "PART", conflicts_with = "key")]
    pub(crate) parts: Vec<String>,
}

impl Target {
    /// The stored key this target names, refused (exit 2) if no handler could have stored it.
    pub(crate) fn key(&self) -> Result<Key, Failure> {
        let key = match &self.key {
            Some(dash) if dash == "-" => Key::new(&read_stdin()?),
            Some(key) => Key::new(key),
            None => Key::new(&Parts(&self.parts)),
        };
        key.map_err(|e| {
            Failure::input(format!(
                "{e}; give the key as `inspect` or `stuck` prints it (1 to {} bytes)",
                idem::MAX_KEY_LEN
            ))
        })
    }
}

/// Several parts write a tuple key, as `(a, b)` in a handler's key expression does; one part
/// is the plain key.
struct Parts<'a>(&'a [String]);

impl IntoKey for Parts<'_> {
    fn write_key(&self, key: &mut KeyWriter) {
        for part in self.0 {
            key.part(part);
        }
    }
}

fn read_stdin() -> Result<String, Failure> {
    let mut key = String::new();
    std::io::stdin()
        .read_to_string(&mut key)
        .map_err(|e| Failure::input(format!("cannot read the key from standard input: {e}")))?;
    if key.ends_with('\n') {
        key.pop();
        if key.ends_with('\r') {
            key.pop();
        }
    }
    Ok(key)
}

/// A purge's retention, kept with the text it was written as.
#[derive(Debug, Clone)]
pub(crate) struct Age {
    pub(crate) text: String,
    pub(crate) duration: Duration,
}

fn parse_age(text: &str) -> Result<Age, String> {
    const HOW: &str = "write a whole number and one unit, w (weeks), d (days), h (hours), \
                       m (minutes) or s (seconds): 2w, 7d, 12h, 30m or 90s";
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("no unit: {HOW}"))?;
    let (digits, unit) = text.split_at(split);
    let unit_secs: u64 = match unit {
        "w" => 7 * 86_400,
        "d" => 86_400,
        "h" => 3_600,
        "m" => 60,
        "s" => 1,
        _ => return Err(format!("unknown unit `{unit}`: {HOW}")),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("no number before the unit: {HOW}"))?;
    if n == 0 {
        return Err(
            "a retention of zero would delete every completed marker, letting any \
                    redelivery run again: give the time the broker may still redeliver a job"
                .to_owned(),
        );
    }
    let secs = n
        .checked_mul(unit_secs)
        .ok_or_else(|| format!("{text} is too long a retention: {HOW}"))?;
    Ok(Age {
        text: text.to_owned(),
        duration: Duration::from_secs(secs),
    })
}

/// An outbox message's id is a `job_id`: 1 to 255 bytes without NUL.
fn parse_message_id(id: &str) -> Result<String, String> {
    if id.is_empty() || id.len() > idem::MAX_KEY_LEN || id.contains('\0') {
        return Err(format!(
            "not an outbox message id: an id is 1 to {} bytes without NUL, as `idem outbox \
             list` prints it",
            idem::MAX_KEY_LEN
        ));
    }
    Ok(id.to_owned())
}

/// An error text to look for: not empty, and no longer than the 2000 bytes the relay keeps of
/// an error (a longer one could match nothing).
fn parse_error_text(text: &str) -> Result<String, String> {
    if text.is_empty() || text.len() > 2000 {
        return Err("give 1 to 2000 bytes of the error, as `outbox list` prints it".to_owned());
    }
    Ok(text.to_owned())
}

/// A group id is what `failed --group-by error` prints: [`idem::GROUP_ID_LEN`] lower-case hex
/// digits.
fn parse_group_id(id: &str) -> Result<String, String> {
    if !idem::FailureGroup::is_id(id) {
        return Err(format!(
            "not a group id: a group id is {} lower-case hex digits, as `idem failed \
             --group-by error` prints it",
            idem::GROUP_ID_LEN
        ));
    }
    Ok(id.to_owned())
}

/// An actor is a name of 1 to 255 bytes (the audit log's column).
fn parse_actor(name: &str) -> Result<String, String> {
    if name.trim().is_empty() || name.len() > 255 {
        return Err(
            "an actor is a name of 1 to 255 bytes: who acts, as the audit log \
                    records it"
                .to_owned(),
        );
    }
    Ok(name.to_owned())
}

/// The runtime's rule for scopes, checked here so that a bad one never reaches a connection.
fn parse_scope(scope: &str) -> Result<String, String> {
    if scope.is_empty() || scope.len() > idem::MAX_KEY_LEN || scope.contains('\0') {
        return Err(idem::Error::Refused(idem::Refusal::Scope {
            scope: scope.to_owned(),
        })
        .to_string());
    }
    Ok(scope.to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_take_one_number_and_one_unit() {
        let secs = |t: &str| parse_age(t).map(|a| a.duration.as_secs());
        assert_eq!(secs("2w"), Ok(14 * 86_400));
        assert_eq!(secs("7d"), Ok(7 * 86_400));
        assert_eq!(secs("12h"), Ok(12 * 3_600));
        assert_eq!(secs("30m"), Ok(1_800));
        assert_eq!(secs("90s"), Ok(90));
        for bad in [
            "",
            "7",
            "d",
            "7x",
            "7 d",
            "-7d",
            "1h30m",
            "0s",
            "99999999999999999d",
        ] {
            assert!(parse_age(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn parts_encode_like_a_tuple_key() {
        let parts = |p: &[&str]| {
            let owned: Vec<String> = p.iter().map(|s| (*s).to_owned()).collect();
            Key::new(&Parts(&owned)).map(|k| k.as_str().to_owned())
        };
        assert_eq!(
            parts(&["acme", "17"]).unwrap(),
            Key::new(&("acme", 17)).unwrap().as_str()
        );
        assert_eq!(parts(&["order-7"]).unwrap(), "order-7");
        assert!(parts(&[]).is_err());
    }
}
