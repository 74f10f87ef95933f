//! `idem-chaos group-restart`: the database restarted while calls are known to be inside a
//! group, on servers of its own (the soak's PostgreSQL cluster and MariaDB datadir). Four
//! calls share one group's transaction: three have kept their work and wait for the commit,
//! the fourth is parked in its body. PostgreSQL is stopped with `-m immediate` and started,
//! MariaDB killed with SIGKILL and started; then the fourth call goes on. No call may get `Applied`
//! (the group's work was lost), the three kept ones get `NotKept::Group` saying nothing was kept,
//! the database holds neither effect nor marker of them, and a redelivery of each applies it
//! exactly once (effects counted in the database).

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem::{Backend, Claimed, Group, GroupOptions, Key, Outcome, Store};
use sqlx::mysql::MySqlPoolOptions;
use sqlx::postgres::PgPoolOptions;
use sqlx::{MySql, Pool, Postgres, Transaction};
use tokio::sync::Notify;

use crate::harness::prepare_databases;
use crate::servers::{My, Pg, Res, until};

const SCOPE: &str = "chaos.restart";
/// The calls of the group: the first parks in its body while the others queue behind it, the
/// last one to enter its body parks there while the database restarts.
const CALLS: usize = 4;

/// The statements a call's body and the checks run, per database.
trait Effects: Backend {
    fn insert<'t>(
        tx: &'t mut Transaction<'static, Self>,
        job: &'t str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 't;

    /// Effect rows per job, and markers in all.
    fn counts(
        pool: &Pool<Self>,
    ) -> impl Future<Output = Result<(HashMap<String, i64>, i64), sqlx::Error>> + Send + '_;
}

impl Effects for Postgres {
    async fn insert(tx: &mut Transaction<'static, Self>, job: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO chaos_effects (job, via) VALUES ($1, 'restart')")
            .bind(job)
            .execute(&mut **tx)
            .await
            .map(drop)
    }

    async fn counts(pool: &Pool<Self>) -> Result<(HashMap<String, i64>, i64), sqlx::Error> {
        let effects: Vec<(String, i64)> =
            sqlx::query_as("SELECT job, count(*) FROM chaos_effects GROUP BY job")
                .fetch_all(pool)
                .await?;
        let markers: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_processed")
            .fetch_one(pool)
            .await?;
        Ok((effects.into_iter().collect(), markers))
    }
}

impl Effects for MySql {
    async fn insert(tx: &mut Transaction<'static, Self>, job: &str) -> Result<(), sqlx::Error> {
        sqlx::query("INSERT INTO chaos_effects (job, via) VALUES (?, 'restart')")
            .bind(job)
            .execute(&mut **tx)
            .await
            .map(drop)
    }

    async fn counts(pool: &Pool<Self>) -> Result<(HashMap<String, i64>, i64), sqlx::Error> {
        let effects: Vec<(String, i64)> =
            sqlx::query_as("SELECT job, count(*) FROM chaos_effects GROUP BY job")
                .fetch_all(pool)
                .await?;
        let markers: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_processed")
            .fetch_one(pool)
            .await?;
        Ok((effects.into_iter().collect(), markers))
    }
}

/// Where bodies park: the first body to enter until `first` is released, the `CALLS`-th
/// until `last` is; the others pass.
#[derive(Default)]
struct Bodies {
    entered: AtomicUsize,
    first: Park,
    last: Park,
}

#[derive(Default)]
struct Park {
    entered: Notify,
    release: Notify,
}

impl Park {
    async fn park(&self) {
        self.entered.notify_one();
        self.release.notified().await;
    }
}

impl Bodies {
    async fn enter(&self) {
        match self.entered.fetch_add(1, Ordering::SeqCst) + 1 {
            1 => self.first.park().await,
            CALLS => self.last.park().await,
            _ => {}
        }
    }
}

/// One delivery, by hand on the group: the effect, the park, the end.
async fn call<D: Effects>(
    group: Group<D>,
    job: String,
    bodies: Option<Arc<Bodies>>,
) -> Result<Outcome<()>, idem::Error> {
    let key = Key::new(&job)?;
    match group.claim(SCOPE, &key).await? {
        Claimed::Fresh(mut guard) => {
            let result = D::insert(guard.tx(), &job).await.map_err(idem::Error::from);
            if let Some(bodies) = bodies {
                bodies.enter().await;
            }
            guard.finish(result).await
        }
        Claimed::Duplicate | Claimed::Replayed(_) => Ok(Outcome::Duplicate),
        Claimed::Failed(failure) => Ok(Outcome::Failed(failure)),
    }
}

async fn within<T>(what: &str, f: impl Future<Output = T>) -> Res<T> {
    tokio::time::timeout(Duration::from_secs(120), f)
        .await
        .map_err(|_| format!("{what}: no answer within 120 s"))
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Res<()> {
    if ok { Ok(()) } else { Err(what()) }
}

/// The scenario on one database; `restart` takes the server down and up again.
async fn restart_in_a_group<D: Effects>(
    name: &str,
    pool: Pool<D>,
    restart: impl Future<Output = Res<()>>,
) -> Res<()> {
    let group = Store::new(pool.clone())
        .group(
            GroupOptions::new()
                .lanes(1)
                .max_delay(idem::MAX_GROUP_DELAY),
        )
        .map_err(|e| e.to_string())?;
    let jobs: Vec<String> = (1..=CALLS).map(|i| format!("{name}-{i}")).collect();
    let bodies = Arc::new(Bodies::default());
    let spawn = |job: &String| {
        let (group, job, bodies) = (group.clone(), job.clone(), bodies.clone());
        tokio::spawn(call(group, job, Some(bodies)))
    };
    // The first call holds the lane in its body while the others queue for it; then each is
    // kept in turn, and the last to enter its body parks there, with the group still open.
    let mut calls = vec![spawn(&jobs[0])];
    within("the first body", bodies.first.entered.notified()).await?;
    calls.extend(jobs[1..].iter().map(spawn));
    until(Duration::from_secs(60), "the calls queuing", || async {
        group.queued() == CALLS
    })
    .await?;
    bodies.first.release.notify_one();
    within("the last body", bodies.last.entered.notified()).await?;
    let waiting = calls.iter().filter(|c| !c.is_finished()).count();
    check(group.queued() == 1 && waiting == CALLS, || {
        format!(
            "{name}: expected {} calls kept and waiting for the commit and one in its body, \
             found {} queued and {waiting} unanswered",
            CALLS - 1,
            group.queued()
        )
    })?;
    println!(
        "{name}: {} calls kept in the open group, one in its body: restarting",
        CALLS - 1
    );
    restart.await?;
    bodies.last.release.notify_one();
    let mut failed = 0;
    for (job, task) in jobs.iter().zip(calls) {
        let answer = within("a member's answer", task)
            .await?
            .map_err(|e| e.to_string())?;
        match answer {
            Err(idem::Error::NotKept(idem::NotKept::Group {
                may_be_kept: false, ..
            })) => failed += 1,
            Err(_) => {}
            Ok(outcome) => {
                return Err(format!(
                    "{name}: {job} answered {outcome:?} for work the restart lost"
                ));
            }
        }
    }
    check(failed == CALLS - 1, || {
        format!(
            "{name}: {failed} calls got NotKept::Group (nothing kept), expected {}",
            CALLS - 1
        )
    })?;
    let (effects, markers) = D::counts(&pool).await.map_err(|e| e.to_string())?;
    check(effects.is_empty() && markers == 0, || {
        format!("{name}: the lost group left {effects:?} effects and {markers} markers")
    })?;
    for job in &jobs {
        let again = within("a redelivery", call(group.clone(), job.clone(), None)).await?;
        check(matches!(again, Ok(Outcome::Applied(()))), || {
            format!("{name}: the redelivery of {job} answered {again:?}, expected Applied")
        })?;
        let more = within(
            "a second redelivery",
            call(group.clone(), job.clone(), None),
        )
        .await?;
        check(matches!(more, Ok(Outcome::Duplicate)), || {
            format!("{name}: the second redelivery of {job} answered {more:?}")
        })?;
    }
    let (effects, markers) = D::counts(&pool).await.map_err(|e| e.to_string())?;
    let once = jobs.iter().all(|j| effects.get(j) == Some(&1));
    check(
        once && effects.len() == CALLS && markers == CALLS as i64,
        || format!("{name}: after redelivery {effects:?} effects and {markers} markers"),
    )?;
    println!(
        "{name}: {failed} kept calls got NotKept::Group (not kept), none Applied; after the \
         restart no effect or marker; redelivery applied each job once"
    );
    Ok(())
}

/// Runs the scenario on a PostgreSQL cluster and a MariaDB datadir of its own.
pub async fn run() -> Res<()> {
    let root = std::env::temp_dir().join(format!("idem-chaos-restart-{}", std::process::id()));
    drop(std::fs::remove_dir_all(&root));
    std::fs::create_dir_all(&root).map_err(|e| e.to_string())?;
    let (pg, my) = tokio::try_join!(Pg::create(&root), My::create(&root))?;
    let result = async {
        let (pg_admin, my_admin) = prepare_databases(&pg, &my).await?;
        pg_admin.close().await;
        my_admin.close().await;
        let pg_pool = PgPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&pg.url())
            .await
            .map_err(|e| e.to_string())?;
        let restart = async {
            pg.stop_immediate().await?;
            pg.start().await
        };
        restart_in_a_group("postgres", pg_pool, restart).await?;
        let my_pool = MySqlPoolOptions::new()
            .max_connections(4)
            .acquire_timeout(Duration::from_secs(60))
            .connect(&my.url("root"))
            .await
            .map_err(|e| e.to_string())?;
        let restart = async {
            my.kill().await;
            my.start().await
        };
        restart_in_a_group("mariadb", my_pool, restart).await
    }
    .await;
    drop(pg.stop_immediate().await);
    my.kill().await;
    match &result {
        Ok(()) => drop(std::fs::remove_dir_all(&root)),
        Err(_) => println!("server logs kept in {}", root.display()),
    }
    result
}
