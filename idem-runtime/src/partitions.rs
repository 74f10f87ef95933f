//! Billions of markers on PostgreSQL: a marker table partitioned by day, by the time its keys
//! carry, so that old markers go by dropping a day's partition instead of deleting its rows
//! (no vacuum behind them).
//!
//! Sound only because the partition is a function of the key. A unique key on a partitioned
//! table is enforced only if it holds the partition column; partitioned by the time a marker
//! was written, two deliveries of one key on either side of midnight would land in two
//! partitions, and both would apply. Partitioned by range of the key itself, every delivery
//! of a key lands in the same partition, whatever its time, and `(scope, key)` stays unique
//! across the table. A key that carries its time (a UUIDv7, a ULID) sorts among the keys of
//! its day, so a day's partition holds that day's jobs.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use sqlx::Postgres;

use crate::backend::postgres::partitions::{self as pg, Range, Refused};
use crate::error::{Error, Refusal};
use crate::retention::MIN_RETENTION;
use crate::store::{MAX_RETENTION, Store};

/// The most days one call creates: ten years.
pub const MAX_PARTITION_DAYS: u32 = 3660;

/// How long a drop waits for the tables' lock: a drop queued behind a long transaction would
/// hold every claim behind it.
const DROP_LOCK_MS: u64 = 2_000;

const DAY_MS: u64 = 24 * 3600 * 1000;

/// How the keys of a partitioned marker table carry the time their jobs were made. One table
/// takes one kind: their day ranges would overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeyTime {
    /// A UUIDv7 in its canonical text form, lowercase (`019ae4a1-0c2f-7...`): its first 48
    /// bits are milliseconds since 1970.
    UuidV7,
    /// A ULID in its canonical form, uppercase Crockford base32 (`01KBJ...`): its first ten
    /// characters are milliseconds since 1970.
    Ulid,
}

impl KeyTime {
    /// The text every key made at `ms` or later sorts at or after, and every key made earlier
    /// sorts before.
    fn bound(self, ms: u64) -> String {
        match self {
            KeyTime::UuidV7 => format!("{:08x}-{:04x}", ms >> 16, ms & 0xffff),
            KeyTime::Ulid => {
                const CROCKFORD: &[u8; 32] = b"0123456789ABCDEFGHJKMNPQRSTVWXYZ";
                (0..10)
                    .rev()
                    .map(|i| CROCKFORD[((ms >> (5 * i)) & 31) as usize] as char)
                    .collect()
            }
        }
    }

    fn range(self, day: u64) -> Range {
        Range {
            suffix: suffix(day),
            from: self.bound(day * DAY_MS),
            to: self.bound((day + 1) * DAY_MS),
        }
    }
}

/// One day's partition of the marker table (and of its lease steps' table).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Partition {
    /// The marker table's partition: the table's name, `_d` and the day, `YYYYMMDD` (UTC).
    pub name: String,
    /// The start of its day (UTC).
    pub from: SystemTime,
    /// The end of its day: its keys were made before it.
    pub to: SystemTime,
}

/// The partitions of a store's marker table, made by [`Store::partitions`].
#[derive(Debug, Clone, Copy)]
pub struct Partitions<'s> {
    store: &'s Store<Postgres>,
    keys: KeyTime,
}

impl Store<Postgres> {
    /// The marker table partitioned by day, by the time its keys carry (PostgreSQL only;
    /// MySQL/MariaDB and SQLite keep one table, which [`purge`](Store::purge) trims).
    ///
    /// For stores whose keys are UUIDv7s or ULIDs made when the job was (by the producer, kept
    /// on every redelivery): a day's markers then go at once, by dropping the day's partition,
    /// with no vacuum behind them. Every mode, the relay and the operators work on it as on
    /// one table. Keys that carry no time (or another kind's) land in a default partition,
    /// which [`purge`](Store::purge) trims row by row.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # async fn f(store: idem::Store<sqlx::Postgres>) -> Result<(), idem::Error> {
    /// use std::time::Duration;
    /// use idem::partitions::KeyTime;
    ///
    /// let days = store.partitions(KeyTime::UuidV7);
    /// days.migrate(7).await?; // at start-up: the tables, and a week of days ahead
    /// // Daily, from cron or a timer:
    /// days.ensure(7).await?;
    /// days.drop_older_than(Duration::from_secs(30 * 24 * 3600)).await?;
    /// # Ok(()) }
    /// ```
    pub fn partitions(&self, keys: KeyTime) -> Partitions<'_> {
        Partitions { store: self, keys }
    }
}

impl Partitions<'_> {
    /// Creates the marker table (and its lease steps' table) partitioned, with a default
    /// partition, then what [`Store::migrate`] creates, then the days from today (UTC) to
    /// `days_ahead` days later; returns the partitions it made. Safe to call from every
    /// worker at once, and again: what exists is kept.
    ///
    /// A marker table that exists and is not partitioned is refused with
    /// [`Refusal::Partitions`]: PostgreSQL cannot partition a table in place. Migrate a table
    /// of a new name ([`Store::with_table`]) and move the workers to it once the old one's
    /// markers have outlived their retention.
    pub async fn migrate(&self, days_ahead: u32) -> Result<Vec<Partition>, Error> {
        check_days(self.store, days_ahead)?;
        match pg::create_parents(self.store.pool(), self.store.sql()).await {
            Ok(()) => {}
            Err(Refused::NotPartitioned(name)) => {
                return Err(refused(
                    self.store,
                    format!(
                        "`{name}` exists and is not partitioned, and PostgreSQL cannot \
                         partition a table in place: migrate a table of a new name \
                         (`Store::with_table`) and move the workers to it"
                    ),
                ));
            }
            Err(Refused::Database(e)) => return Err(e.into()),
        }
        self.store.migrate().await?;
        self.ensure(days_ahead).await
    }

    /// Creates the partitions missing from today (UTC) to `days_ahead` days later; returns
    /// those it made. Call it more often than `days_ahead` days apart (daily, say): a key of a
    /// day that has no partition lands in the default one, and that day then keeps the
    /// default partition (its partition cannot be split off it).
    pub async fn ensure(&self, days_ahead: u32) -> Result<Vec<Partition>, Error> {
        check_days(self.store, days_ahead)?;
        let today = now_ms() / DAY_MS;
        self.create(today, today + u64::from(days_ahead)).await
    }

    /// Creates the partitions missing for the days from `from` to `to` (both included, UTC);
    /// returns those it made. For keys made before today (a backlog, a replay): a day whose
    /// keys already landed in the default partition is left there.
    pub async fn add(&self, from: SystemTime, to: SystemTime) -> Result<Vec<Partition>, Error> {
        let (Some(first), Some(last)) = (ms_of(from), ms_of(to)) else {
            return Err(refused(self.store, "a day before 1970".to_owned()));
        };
        let (first, last) = (first / DAY_MS, last / DAY_MS);
        if last < first || last - first >= u64::from(MAX_PARTITION_DAYS) {
            return Err(refused(
                self.store,
                format!(
                    "days from {from:?} to {to:?}: give at most {MAX_PARTITION_DAYS} days, in order"
                ),
            ));
        }
        self.create(first, last).await
    }

    async fn create(&self, first: u64, last: u64) -> Result<Vec<Partition>, Error> {
        let days: Vec<Range> = (first..=last).map(|d| self.keys.range(d)).collect();
        let (made, skipped) = pg::create(self.store.pool(), self.store.sql(), &days).await?;
        for suffix in &skipped {
            tracing::warn!(
                table = self.store.table(),
                day = suffix.as_str(),
                "the default partition holds keys of this day already: they stay there, and \
                 purge trims them row by row"
            );
        }
        Ok(made.iter().filter_map(|s| self.partition(s)).collect())
    }

    /// The day partitions, oldest first (not the default partition).
    pub async fn list(&self) -> Result<Vec<Partition>, Error> {
        let suffixes = pg::list(self.store.pool(), self.store.sql()).await?;
        Ok(suffixes.iter().filter_map(|s| self.partition(s)).collect())
    }

    /// Drops the day partitions whose day ended more than `keep` ago, or more than the
    /// longest retention a scope has ([`Store::set_retention`]) if that is longer; returns
    /// those it dropped. A redelivery of a job whose marker went runs again, as after
    /// [`Store::purge`]: choose `keep` longer than the time the broker may still redeliver a
    /// job, counted from when its key was made.
    ///
    /// A drop takes the tables' exclusive lock for a moment; it waits at most 2 s for it
    /// (then fails, and the next call drops them), so that no claim queues behind it for
    /// longer. `keep` under [`MIN_RETENTION`] or of a century or more is refused with
    /// [`Refusal::Retention`] before any I/O.
    pub async fn drop_older_than(&self, keep: Duration) -> Result<Vec<Partition>, Error> {
        if keep < MIN_RETENTION || keep >= MAX_RETENTION {
            return Err(Error::Refused(Refusal::Retention { retention: keep }));
        }
        let longest = self
            .store
            .retentions()
            .await?
            .into_iter()
            .map(|r| r.keep)
            .max();
        let keep = longest.map_or(keep, |l| l.max(keep));
        let cutoff = SystemTime::now() - keep;
        let old: Vec<Partition> = self
            .list()
            .await?
            .into_iter()
            .filter(|p| p.to <= cutoff)
            .collect();
        let suffixes: Vec<String> = old.iter().map(|p| suffix_of(&p.name)).collect();
        pg::drop(self.store.pool(), self.store.sql(), &suffixes, DROP_LOCK_MS).await?;
        Ok(old)
    }

    /// The day partition that keys made at `at` belong in, whether it exists or not (`None`
    /// before 1970).
    pub fn day(&self, at: SystemTime) -> Option<Partition> {
        self.partition(&suffix(ms_of(at)? / DAY_MS))
    }

    /// The partition named by `suffix`, if it is one of days (`dYYYYMMDD`).
    fn partition(&self, suffix: &str) -> Option<Partition> {
        let day = day_of(suffix)?;
        Some(Partition {
            name: format!("{}_{suffix}", self.store.table()),
            from: UNIX_EPOCH + Duration::from_millis(day * DAY_MS),
            to: UNIX_EPOCH + Duration::from_millis((day + 1) * DAY_MS),
        })
    }
}

fn suffix_of(name: &str) -> String {
    name.rsplit('_').next().unwrap_or_default().to_owned()
}

fn refused(store: &Store<Postgres>, problem: String) -> Error {
    Error::Refused(Refusal::Partitions {
        table: store.table().to_owned(),
        problem,
    })
}

fn check_days(store: &Store<Postgres>, days_ahead: u32) -> Result<(), Error> {
    if days_ahead >= MAX_PARTITION_DAYS {
        return Err(refused(
            store,
            format!("{days_ahead} days ahead: give fewer than {MAX_PARTITION_DAYS}"),
        ));
    }
    Ok(())
}

fn ms_of(t: SystemTime) -> Option<u64> {
    t.duration_since(UNIX_EPOCH)
        .ok()
        .map(|d| d.as_millis() as u64)
}

fn now_ms() -> u64 {
    ms_of(SystemTime::now()).unwrap_or(0)
}

/// `dYYYYMMDD` of a day counted from 1970-01-01 (the civil calendar, as in Howard Hinnant's
/// `civil_from_days`).
fn suffix(day: u64) -> String {
    let z = day as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("d{y:04}{m:02}{d:02}")
}

/// The day of `dYYYYMMDD`, if the text is one (`days_from_civil`).
fn day_of(suffix: &str) -> Option<u64> {
    let digits = suffix.strip_prefix('d')?;
    if digits.len() != 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let (y, m, d): (i64, i64, i64) = (
        digits[..4].parse().ok()?,
        digits[4..6].parse().ok()?,
        digits[6..].parse().ok()?,
    );
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    u64::try_from(era * 146_097 + doe - 719_468).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn days_are_named_by_their_utc_date_and_read_back() {
        assert_eq!(suffix(0), "d19700101");
        // 2026-12-03 is day 20_790.
        assert_eq!(suffix(20_790), "d20261203");
        assert_eq!(suffix(20_878), "d20270301");
        assert_eq!(suffix(11_016), "d20000229");
        for day in [0, 59, 60, 11_016, 20_790, 20_878, 2_932_896] {
            assert_eq!(day_of(&suffix(day)), Some(day), "{}", suffix(day));
        }
        assert_eq!(day_of("default"), None);
        assert_eq!(day_of("d2026120"), None);
    }

    #[test]
    fn a_key_sorts_within_the_bounds_of_its_day() {
        // A UUIDv7 made at 2026-12-03 10:00:00.123 UTC, and a ULID of the same instant.
        let ms: u64 = 20_790 * DAY_MS + 10 * 3_600_000 + 123;
        let uuid = format!(
            "{:08x}-{:04x}-7abc-8def-0123456789ab",
            ms >> 16,
            ms & 0xffff
        );
        let ulid = format!("{}7ZZZZZZZZZZZZZZZ", KeyTime::Ulid.bound(ms));
        for (keys, key) in [(KeyTime::UuidV7, uuid), (KeyTime::Ulid, ulid)] {
            let day = keys.range(20_790);
            assert!(
                day.from.as_str() <= key.as_str() && key.as_str() < day.to.as_str(),
                "{key}"
            );
            assert!(key.as_str() >= keys.range(20_789).to.as_str());
            assert!(key.as_str() < keys.range(20_791).from.as_str());
        }
        // The first and the last millisecond of a day.
        let first = KeyTime::UuidV7.bound(20_790 * DAY_MS);
        let last = KeyTime::UuidV7.bound(20_791 * DAY_MS - 1);
        let day = KeyTime::UuidV7.range(20_790);
        assert!(day.from <= first && last < day.to);
        assert_eq!(KeyTime::Ulid.bound(0), "0000000000");
    }
}
