//! Group commit: concurrent calls of single-job handlers share one transaction, each behind a
//! savepoint of its own, and one commit, so that a worker running many jobs at once pays for
//! one commit (one fsync) per group instead of one per job. A thin mode over the claim core:
//! each call's claim is the core's (in a savepoint of the group's transaction), and its end
//! the core's one finish, whose keeping step releases the call's savepoint and waits for the
//! group's commit.

pub(crate) mod lane;
pub(crate) mod member;

use std::borrow::Cow;
use std::fmt;
use std::hash::{BuildHasher as _, BuildHasherDefault, DefaultHasher, Hash, RandomState};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use sqlx::pool::PoolOptions;

use crate::backend::Backend;
use crate::claim::{Claimed, Request, held_calls};
use crate::error::{Error, Refusal};
use crate::key::Key;
use crate::options::ClaimOptions;
use crate::scope::check_scope;
use crate::store::{Store, spared, worker_pool};

use lane::{Lane, Shared};
pub use member::GroupHeld;

/// The largest [`GroupOptions::max_size`].
pub const MAX_GROUP: usize = 1000;

/// The longest [`GroupOptions::max_delay`].
pub const MAX_GROUP_DELAY: Duration = Duration::from_secs(1);

/// The longest [`GroupOptions::max_body`].
pub const MAX_GROUP_BODY: Duration = Duration::from_secs(60);

/// The most lanes a group may have ([`GroupOptions::lanes`]).
pub const MAX_LANES: usize = 64;

/// How a [`Group`] gathers calls: how many one group holds at most, how long it stays open at
/// most, how long one call's body may hold it, and how many groups are open at once.
///
/// A group closes (and commits) at the first of: `max_size` calls kept, `max_delay` since it
/// began, or no other call waiting to join it. The last one means a lone call is never held
/// back: at one call at a time a group is one call, and commits at once. A group whose
/// `max_delay` has passed takes no new call; the one whose body is running then ends first
/// (within `max_body`), so a kept call waits at most `max_delay` plus one body's bound.
///
/// ```
/// # use idem_runtime as idem;
/// use std::time::Duration;
///
/// let options = idem::GroupOptions::new()
///     .max_size(64)
///     .max_delay(Duration::from_millis(5))
///     .lanes(2);
/// # let _ = options;
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupOptions {
    pub(crate) max_size: usize,
    pub(crate) max_delay: Duration,
    pub(crate) max_body: Duration,
    pub(crate) lanes: usize,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions::new()
    }
}

impl GroupOptions {
    /// The defaults: at most 32 calls a group, 2 ms, a body 5 s, one lane. One lane is safe
    /// whatever rows the bodies touch; more are an opt-in ([`lanes`](GroupOptions::lanes)
    /// says what they risk).
    pub const fn new() -> Self {
        GroupOptions {
            max_size: 32,
            max_delay: Duration::from_millis(2),
            max_body: Duration::from_secs(5),
            lanes: 1,
        }
    }

    /// The most calls one group keeps before it commits (1 to [`MAX_GROUP`]).
    pub const fn max_size(mut self, calls: usize) -> Self {
        self.max_size = calls;
        self
    }

    /// The longest a group stays open after it began (at most [`MAX_GROUP_DELAY`]): the
    /// most a call waits for others to join its group.
    pub const fn max_delay(mut self, delay: Duration) -> Self {
        self.max_delay = delay;
        self
    }

    /// The longest one call's body may run in a group (at most [`MAX_GROUP_BODY`]; 5 s by
    /// default). The calls kept before it cannot commit while it runs, since its work is in
    /// their transaction; a body past the bound is stopped, its savepoint rolled back, and its
    /// caller answered [`NotKept::TimedOut`](crate::NotKept::TimedOut) (nothing of it kept:
    /// its redelivery runs it again), and the others commit.
    ///
    /// The attribute's `group` handlers run under it; by hand, run the body through
    /// [`GroupGuard::body`]'s [`bounded`](crate::Body::bounded). A statement the body had
    /// already sent runs to its end before the savepoint is rolled back: bound those with the
    /// claim's `wait` or the database's statement timeout.
    pub const fn max_body(mut self, body: Duration) -> Self {
        self.max_body = body;
        self
    }

    /// How many groups are open at once, each on a connection of its own (1 to
    /// [`MAX_LANES`]; 1 by default). A call's group is chosen by its key, so the calls of one
    /// key always meet in the same group: a second delivery of a key reads the first one's
    /// marker in its own transaction instead of waiting for another group's commit. More
    /// lanes run more calls side by side, fewer make larger groups.
    ///
    /// **More than one lane deadlocks on shared rows.** Each lane's open transaction holds
    /// the rows its calls updated until its group commits; when the bodies of calls with
    /// different keys update the same rows (a few hot accounts), two lanes wait for each
    /// other. The database breaks the deadlock after its own timeout (PostgreSQL's
    /// `deadlock_timeout`, 1 s), every call queued in both lanes waits meanwhile, and the
    /// victim's calls fail (PostgreSQL: the body's statement; MariaDB rolls the whole group
    /// back). Use more lanes only where different keys' bodies touch different rows, or
    /// where each call names the rows it touches: a handler's `lane = "job.account"`, by
    /// hand [`Group::claim_in_lane`]. The calls that name the same rows then meet in one lane
    /// and never hold them in two open transactions at once, so more lanes are safe on hot
    /// rows, as long as every call of the group that touches those rows names them.
    pub const fn lanes(mut self, lanes: usize) -> Self {
        self.lanes = lanes;
        self
    }

    /// The most calls one group keeps (set with [`max_size`](GroupOptions::max_size)).
    pub const fn get_max_size(&self) -> usize {
        self.max_size
    }

    /// The longest a group stays open (set with [`max_delay`](GroupOptions::max_delay)).
    pub const fn get_max_delay(&self) -> Duration {
        self.max_delay
    }

    /// The longest a call's body may run (set with [`max_body`](GroupOptions::max_body)).
    pub const fn get_max_body(&self) -> Duration {
        self.max_body
    }

    /// How many groups are open at once (set with [`lanes`](GroupOptions::lanes)).
    pub const fn get_lanes(&self) -> usize {
        self.lanes
    }

    /// The pool options of a worker whose jobs go through a group with these options: twice
    /// the lanes (each lane holds a connection while its group is open and another while the
    /// last group commits), no ping before each acquire (as [`Store::pool_options`]), and,
    /// for `in_flight` jobs the worker also runs outside the group on transactions of their
    /// own, what [`Store::pool_options`] gives them (0 if every job goes through the group).
    ///
    /// ```
    /// # #[cfg(feature = "postgres")] {
    /// # use idem_runtime as idem;
    /// let group = idem::GroupOptions::new().lanes(2);
    /// let options = group.pool_options::<sqlx::Postgres>(0);
    /// assert_eq!(options.get_max_connections(), 4);
    /// // 8 more jobs on transactions of their own, and their spare connection.
    /// assert_eq!(group.pool_options::<sqlx::Postgres>(8).get_max_connections(), 13);
    /// # }
    /// ```
    pub fn pool_options<DB: Backend>(&self, in_flight: u32) -> PoolOptions<DB> {
        // Lanes out of bounds are `Store::group`'s to refuse; the pool only saturates.
        let lanes = u32::try_from(self.lanes).unwrap_or(u32::MAX);
        let outside = if in_flight == 0 { 0 } else { spared(in_flight) };
        worker_pool(lanes.saturating_mul(2).saturating_add(outside))
    }

    fn check(&self) -> Result<(), Error> {
        let problem = if self.max_size == 0 || self.max_size > MAX_GROUP {
            format!(
                "max_size {} is not between 1 and {MAX_GROUP}",
                self.max_size
            )
        } else if self.max_delay > MAX_GROUP_DELAY {
            format!(
                "max_delay {:?} is longer than {MAX_GROUP_DELAY:?}: every call of a group may \
                 wait that long for its commit",
                self.max_delay
            )
        } else if self.max_body.is_zero() || self.max_body > MAX_GROUP_BODY {
            format!(
                "max_body {:?} is zero or longer than {MAX_GROUP_BODY:?}: the calls kept before a \
                 body wait for it to end",
                self.max_body
            )
        } else if self.lanes == 0 || self.lanes > MAX_LANES {
            format!("lanes {} is not between 1 and {MAX_LANES}", self.lanes)
        } else {
            return Ok(());
        };
        Err(Error::Refused(Refusal::Group { reason: problem }))
    }
}

/// Group commit for single-job handlers: concurrent calls share one transaction, each behind
/// a savepoint of its own, and one commit.
///
/// Made by [`Store::group`]; cheap to clone (clones share the groups). A handler with the
/// attribute's `group` flag takes `&group` ([`GroupTarget`]) in place of `&store`; by hand,
/// claim with [`claim`](Group::claim) and end with [`GroupGuard::finish`]. Records of a Kafka partition
/// are claimed by their offsets with [`claim_offsets`](Group::claim_offsets).
///
/// What each call gets is what a call of its own would:
/// [`Outcome::Applied`](crate::Outcome::Applied) only once the group's commit is confirmed (the
/// verified commit of every mode), its own outcome (`Duplicate`, `Replayed`, its own error),
/// and a body error rolls back its savepoint only.
/// What differs:
///
/// - **A group that fails as a whole** (its connection is lost, the database rolls its
///   transaction back, its commit fails or loses its answer) fails every call whose work was in it
///   with [`NotKept::Group`](crate::NotKept::Group), which says whether the work may have been kept
///   (only when the commit's answer was lost). Nack the job: its redelivery settles it by its
///   marker.
/// - **Bodies of one group run one after another** on its connection (each call in its own
///   task: a body borrows its caller's data). A body that waits (on a lock, a slow
///   statement, anything else) delays the calls queued behind it in its group, and the
///   commit of those kept before it, for at most [`GroupOptions::max_body`]: past it the body
///   is stopped and its call fails alone ([`NotKept::TimedOut`](crate::NotKept::TimedOut)).
/// - **Cancellation**: a call dropped while it holds its group's turn (its claim or its body
///   running) leaves its savepoint to be rolled back before the group goes on; sqlx first
///   reads the answers of a statement the dropped call had sent. A call dropped while it
///   waits for the commit of a group it shares changes nothing: that commit runs in a task
///   of its own. A call alone in its group commits it in its own future, as a call of the
///   macro does: dropped during that commit, its work may or may not be kept, and its
///   redelivery settles it by its marker.
/// - `wait` bounds each call's claim inside the group (PostgreSQL: `SET LOCAL lock_timeout`
///   in the call's savepoint; MariaDB: per statement); `isolation` does not apply (the
///   group's transaction begins at the database's default level). On SQLite the group's
///   transaction holds the database's write lock until its commit.
///
/// A nested claim is refused as in every mode ([`Refusal::Nested`]).
pub struct Group<DB: Backend> {
    pub(crate) shared: Arc<Shared<DB>>,
    lanes: Arc<[Lane<DB>]>,
    /// Keyed per group, so that a sender who picks the keys cannot pick the lanes (putting
    /// every call in one) by knowing the hash.
    hasher: RandomState,
}

impl<DB: Backend> Clone for Group<DB> {
    fn clone(&self) -> Self {
        Group {
            shared: self.shared.clone(),
            lanes: self.lanes.clone(),
            hasher: self.hasher.clone(),
        }
    }
}

impl<DB: Backend> fmt::Debug for Group<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Group")
            .field("store", &self.shared.store)
            .field("options", &self.shared.options)
            .finish_non_exhaustive()
    }
}

impl<DB: Backend> Store<DB> {
    /// Group commit on this store's pool and markers (see [`Group`]). Options out of their
    /// bounds are refused with [`Refusal::Group`].
    ///
    /// Each lane holds one connection of the pool while its group is open (and another while
    /// the last group commits): size the pool for the lanes, twice over, besides the rest
    /// ([`GroupOptions::pool_options`] does). A pool with fewer connections than lanes is
    /// refused (the lanes could never run side by side); one with fewer than twice the lanes
    /// is logged as a warning.
    pub fn group(&self, options: GroupOptions) -> Result<Group<DB>, Error> {
        options.check()?;
        let connections = self.pool().options().get_max_connections() as usize;
        let lanes = options.lanes;
        if connections < lanes {
            let reason = format!(
                "the pool has at most {connections} connections and each of the group's {lanes} \
                 lanes holds one while its group is open: give the pool at least {} connections \
                 besides what the rest of the application uses, or make fewer lanes",
                2 * lanes
            );
            return Err(Error::Refused(Refusal::Group { reason }));
        }
        if connections < 2 * lanes {
            tracing::warn!(
                connections,
                lanes,
                "a group's pool is small: each lane holds a connection while its group is open \
                 and another while the last group commits, so a body that takes a second \
                 connection, or the next group, waits for the pool"
            );
        }
        let lanes: Vec<Lane<DB>> = (0..options.lanes).map(|_| Lane::new()).collect();
        Ok(Group {
            shared: Arc::new(Shared {
                store: self.clone(),
                options,
            }),
            lanes: lanes.into(),
            hasher: RandomState::new(),
        })
    }
}

/// What a `group` handler takes in place of the transaction: `&group`, where `group` is a
/// [`Group`] made once by [`Store::group`] (or a `&Group`, or an `Arc<Group>`), shared by the
/// calls whose commits it gathers.
///
/// The handler's parameter is `&dyn GroupTarget<DB>` rather than a generic one, so that a
/// wrong argument (the `Store` itself, typically) is one error at that argument, saying what
/// to pass: a generic parameter is checked again at the call and at its `.await`.
#[diagnostic::on_unimplemented(
    message = "a `group` handler takes `&idem::Group<DB>`, not `&{Self}`",
    label = "make the group once with `store.group(idem::GroupOptions::new())?` and pass `&group`",
    note = "the calls of one group share its transactions: a group is made once and shared, \
            not made per call"
)]
pub trait GroupTarget<DB: Backend>: sealed::Sealed + Sync {
    /// The group the call joins.
    fn as_group(&self) -> &Group<DB>;
}

mod sealed {
    pub trait Sealed {}
}

impl<DB: Backend> sealed::Sealed for Group<DB> {}
impl<DB: Backend> sealed::Sealed for &Group<DB> {}
impl<DB: Backend> sealed::Sealed for Arc<Group<DB>> {}

impl<DB: Backend> GroupTarget<DB> for Group<DB> {
    fn as_group(&self) -> &Group<DB> {
        self
    }
}

// `&group` where `group` is already a `&Group`, or an `Arc<Group>`: a `&Group<DB>` parameter
// took them by deref coercion, which a coercion to a trait object does not do.
impl<DB: Backend> GroupTarget<DB> for &Group<DB> {
    fn as_group(&self) -> &Group<DB> {
        self
    }
}

impl<DB: Backend> GroupTarget<DB> for Arc<Group<DB>> {
    fn as_group(&self) -> &Group<DB> {
        self
    }
}

impl<DB: Backend> Group<DB> {
    /// The store the group claims on.
    pub fn store(&self) -> &Store<DB> {
        &self.shared.store
    }

    /// The group's options.
    pub fn options(&self) -> GroupOptions {
        self.shared.options
    }

    /// How many calls hold or wait for a turn in one of the group's lanes right now (calls
    /// that kept their work and wait for its commit are not counted): how far behind the
    /// group is, for a gauge.
    pub fn queued(&self) -> usize {
        let queued = self
            .lanes
            .iter()
            .map(|lane| lane.queued.load(Ordering::SeqCst));
        queued.sum()
    }

    /// Claims `(scope, key)` in a savepoint of the open group of the key's lane.
    ///
    /// On [`Claimed::Fresh`] run the effect on [`GroupGuard::tx`] and end with
    /// [`GroupGuard::finish`], which answers once the group committed. The scope is checked
    /// and the marker decided as [`Store::claim`] does; a marker met that an earlier call of
    /// the same group wrote is answered once the group committed.
    pub async fn claim(&self, scope: &str, key: &Key) -> Result<Claimed<GroupGuard<DB>>, Error> {
        self.claim_with(scope, key, ClaimOptions::new()).await
    }

    /// [`claim`](Group::claim) with the options' `wait`, `replay` and fingerprint (see
    /// [`Store::claim_with`]); their isolation level does not apply (the group's transaction
    /// has the database's default).
    pub async fn claim_with(
        &self,
        scope: &str,
        key: &Key,
        options: ClaimOptions,
    ) -> Result<Claimed<GroupGuard<DB>>, Error> {
        self.claim_named(scope, key, options, None).await
    }

    /// [`claim_with`](Group::claim_with) in the lane of `rows` instead of the key's: the calls
    /// whose bodies update the same rows name the same `rows` (the account a top-up credits),
    /// so that they meet in one lane, one after another, and never hold those rows in two
    /// lanes' open transactions at once. With that, more [`lanes`](GroupOptions::lanes) are
    /// safe on hot rows.
    ///
    /// `rows` must be the same for every delivery of a key (read from the job's payload, not
    /// from the clock or the delivery): a second delivery in another lane would wait for the
    /// first one's marker there, and with rows held both ways the database would break the
    /// deadlock by failing one call (redelivered, and settled by its marker, so nothing is
    /// done twice; only time is lost). A body that touches rows of two values (a transfer
    /// between two accounts) has no one lane: give such a group one lane.
    ///
    /// ```no_run
    /// # use idem_runtime as idem;
    /// # #[cfg(feature = "sqlite")]
    /// async fn credit(
    ///     group: &idem::Group<sqlx::Sqlite>,
    ///     account: i64,
    ///     job_id: &str,
    /// ) -> Result<idem::Outcome<()>, idem::Error> {
    ///     let key = idem::Key::new(job_id)?;
    ///     let options = idem::ClaimOptions::new();
    ///     Ok(match group.claim_in_lane(account, "billing.top_up", &key, options).await? {
    ///         idem::Claimed::Fresh(mut guard) => {
    ///             let credited = sqlx::query("UPDATE accounts SET balance = balance + 10 WHERE id = ?")
    ///                 .bind(account)
    ///                 .execute(&mut **guard.tx())
    ///                 .await;
    ///             guard.finish(credited.map(drop).map_err(idem::Error::from)).await?
    ///         }
    ///         idem::Claimed::Duplicate | idem::Claimed::Replayed(_) => idem::Outcome::Duplicate,
    ///         idem::Claimed::Failed(failure) => idem::Outcome::Failed(failure),
    ///     })
    /// }
    /// ```
    pub async fn claim_in_lane(
        &self,
        rows: impl Hash,
        scope: &str,
        key: &Key,
        options: ClaimOptions,
    ) -> Result<Claimed<GroupGuard<DB>>, Error> {
        self.claim_named(scope, key, options, Some(rows_hash(&rows)))
            .await
    }

    /// A hand-written claim, in the lane of `rows` if the caller named them.
    async fn claim_named(
        &self,
        scope: &str,
        key: &Key,
        options: ClaimOptions,
        rows: Option<u64>,
    ) -> Result<Claimed<GroupGuard<DB>>, Error> {
        check_scope(scope)?;
        let scope = Cow::Owned(scope.to_owned());
        let what = match rows {
            Some(_) => "Group::claim_in_lane",
            None => "Group::claim",
        };
        let request = Request::new(scope, key.clone(), options, what);
        let claimed = self.claim_request(request, rows).await?;
        Ok(claimed.map(|held| GroupGuard { held }))
    }

    /// The claim of `request` in the lane of `rows` if the caller named them, else of its
    /// key.
    pub(crate) async fn claim_request(
        &self,
        request: Request,
        rows: Option<u64>,
    ) -> Result<Claimed<GroupHeld<DB>>, Error> {
        let lane = match rows {
            Some(rows) => self.lane(rows),
            None => self.lane((&*request.scope, request.key.as_str())),
        };
        member::claim(&self.shared, lane, request).await
    }

    /// The lane of the calls that name `what` (a key, a partition).
    pub(crate) fn lane(&self, what: impl Hash) -> &Lane<DB> {
        let at = self.hasher.hash_one(what) as usize;
        &self.lanes[at % self.lanes.len()]
    }
}

/// `rows` hashed with fixed keys, the same in every path (the macro's `lane = ".."` and
/// [`Group::claim_in_lane`]); [`Group::lane`] hashes it again with the group's own keys.
pub(crate) fn rows_hash(rows: &(impl Hash + ?Sized)) -> u64 {
    BuildHasherDefault::<DefaultHasher>::default().hash_one(rows)
}

/// A fresh claim in a group: the call's savepoint in the group's open transaction.
///
/// [`finish`](GroupGuard::finish) releases the savepoint on `Ok` and answers once the group
/// committed (or failed), or rolls back to it on `Err`; [`release`](GroupGuard::release), or
/// dropping the guard, rolls back to it too. While the guard lives, the group's other calls
/// wait for their turn: run the body and finish.
#[derive(Debug)]
pub struct GroupGuard<DB: Backend> {
    held: GroupHeld<DB>,
}

held_calls! {
    GroupGuard<DB>, 'static;
    /// The transaction the body must run its effect on (the group's, inside this call's
    /// savepoint).
    tx;
    /// The outbox of this call's job: its messages are written with the marker when the
    /// guard finishes with `Ok`, and commit with the group.
    outbox;
    /// The call's `idem.claim` span.
    span;
    /// The claim's body, to run in its span and marked as inside the group's transaction
    /// (see [`Guard::body`](crate::Guard::body)).
    body;
    /// Ends the call: on `Ok` releases its savepoint and answers once the group's commit is
    /// confirmed ([`Outcome::Applied`](crate::Outcome::Applied)) or failed
    /// ([`NotKept::Group`](crate::NotKept::Group)); on `Err` rolls back to the savepoint and
    /// answers at once.
    finish;
    /// [`finish`](GroupGuard::finish) that also stores the `Ok` value with the marker
    /// (`replay`).
    finish_replay;
    /// Gives up: rolls back to the call's savepoint; the group goes on.
    release;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_out_of_their_bounds_are_refused_naming_the_bound() {
        let cases = [
            (GroupOptions::new().max_size(0), "max_size 0"),
            (GroupOptions::new().max_size(MAX_GROUP + 1), "max_size 1001"),
            (
                GroupOptions::new().max_delay(Duration::from_secs(2)),
                "max_delay 2s",
            ),
            (GroupOptions::new().max_body(Duration::ZERO), "max_body 0ns"),
            (
                GroupOptions::new().max_body(Duration::from_secs(61)),
                "max_body 61s",
            ),
            (GroupOptions::new().lanes(0), "lanes 0"),
            (GroupOptions::new().lanes(MAX_LANES + 1), "lanes 65"),
        ];
        for (options, named) in cases {
            match options.check() {
                Err(Error::Refused(Refusal::Group { reason })) => {
                    assert!(reason.starts_with(named), "{reason}");
                }
                other => panic!("{options:?} gave {other:?}"),
            }
        }
        assert!(GroupOptions::new().check().is_ok());
    }

    #[cfg(feature = "sqlite")]
    #[tokio::test]
    async fn a_pool_with_fewer_connections_than_lanes_is_refused_before_any_io() {
        let pool = sqlx::sqlite::SqlitePoolOptions::new()
            .max_connections(2)
            .connect_lazy("sqlite::memory:")
            .expect("a lazy pool");
        let store = Store::new(pool);
        let refused = store.group(GroupOptions::new().lanes(3));
        match refused {
            Err(Error::Refused(Refusal::Group { reason })) => {
                assert!(reason.contains("at most 2 connections"), "{reason}");
                assert!(reason.contains("at least 6"), "{reason}");
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
        assert!(store.group(GroupOptions::new().lanes(2)).is_ok());
        // Nothing was opened: the lazy pool holds no connection.
        assert_eq!(store.pool().size(), 0);
    }
}
