//! One command, from checked input to printed output: everything that needs no database is
//! refused before the first connection.

use std::process::ExitCode;
use std::str::FromStr as _;
use std::time::Duration;

use idem::{Backend, Key, Store};
use serde_json::json;
use sqlx::pool::PoolOptions;
use sqlx::{ConnectOptions as _, Connection as _};

use crate::Failure;
use crate::args::{
    Age, Cli, Command, DoctorArgs, ForgetArgs, GroupBy, OutboxCommand, OutboxRequeueArgs,
    RequeueArgs, RetentionCommand, Target,
};
use crate::bulk::{self, BulkRequeue};
use crate::console::{self, Serve};
use crate::failed;
use crate::outbox::{self, Filter};
use crate::render;
use crate::sweep::{self, BulkForget, BulkOutbox};
use crate::target::{DatabaseUrl, Scheme};
use crate::{doctor, retention};

/// How long the tool waits for the database to accept a connection.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Exit code of an `inspect` that found no marker, or an `outbox requeue` no message.
const NOT_FOUND: u8 = 3;

/// Exit code of an `outbox requeue` of a message that is pending or sent.
const NOT_PARKED: u8 = 4;

/// Exit code of a `forget` refused because a delivery still holds the marker's lease.
const HELD: u8 = 5;

/// A command whose input has been checked.
enum Request {
    Inspect {
        scope: String,
        key: Key,
    },
    Forget {
        scope: String,
        key: Key,
        force: bool,
    },
    ForgetStuck(BulkForget),
    Purge(Option<Age>),
    RetentionSet {
        scope: String,
        keep: Age,
    },
    RetentionList,
    RetentionClear {
        scope: String,
    },
    Doctor(DoctorArgs),
    Stuck {
        scope: Option<String>,
        limit: u32,
    },
    OutboxList {
        filter: Filter,
        limit: u32,
    },
    // Jobs that failed for good, and the steps of a lease (`failed.rs`).
    Failed {
        scope: Option<String>,
        limit: u32,
        group_by: Option<GroupBy>,
    },
    RequeueAll(BulkRequeue),
    Audit {
        limit: u32,
    },
    RequeueJob {
        scope: String,
        key: Key,
    },
    Steps {
        scope: String,
        key: Key,
    },
    Requeue {
        id: String,
    },
    OutboxRequeueAll(BulkOutbox),
    OutboxShow {
        id: String,
    },
    Console(Serve),
}

/// Where the command runs and how it prints.
struct Context {
    db: DatabaseUrl,
    table: String,
    json: bool,
    /// Who acts, for the audit log.
    actor: String,
}

pub(crate) async fn run(cli: Cli) -> Result<ExitCode, Failure> {
    let request = match cli.command {
        Command::Inspect(target) => Request::Inspect {
            key: target.key()?,
            scope: target.scope,
        },
        Command::Forget(args) => forget_request(args)?,
        Command::Purge { older_than } => Request::Purge(older_than),
        Command::Retention(RetentionCommand::Set { scope, keep }) => {
            Request::RetentionSet { scope, keep }
        }
        Command::Retention(RetentionCommand::List) => Request::RetentionList,
        Command::Retention(RetentionCommand::Clear { scope }) => Request::RetentionClear { scope },
        Command::Doctor(args) => Request::Doctor(args),
        Command::Stuck { scope, limit } => Request::Stuck { scope, limit },
        Command::Outbox(OutboxCommand::List {
            parked,
            pending,
            limit,
        }) => Request::OutboxList {
            filter: Filter::of(parked, pending),
            limit,
        },
        Command::Outbox(OutboxCommand::Requeue(args)) => outbox_requeue_request(args)?,
        Command::Outbox(OutboxCommand::Show { id }) => Request::OutboxShow { id },
        Command::Failed {
            scope,
            limit,
            group_by,
        } => Request::Failed {
            scope,
            limit,
            group_by,
        },
        Command::Requeue(args) => requeue_request(args)?,
        Command::Audit { limit } => Request::Audit { limit },
        Command::Steps(target) => Request::Steps {
            key: target.key()?,
            scope: target.scope,
        },
        Command::Console { listen, admin } => Request::Console(Serve { listen, admin }),
    };
    let cx = Context {
        db: DatabaseUrl::parse(cli.database_url)?,
        table: cli.table,
        json: cli.json,
        actor: actor(cli.actor),
    };
    let url = cx.db.url.as_str();
    match cx.db.scheme {
        Scheme::Postgres => {
            let options = sqlx::postgres::PgConnectOptions::from_str(url);
            execute::<sqlx::Postgres>(options.map_err(|e| bad_url(&cx, e))?, &cx, request).await
        }
        Scheme::MySql => {
            let options = sqlx::mysql::MySqlConnectOptions::from_str(url);
            execute::<sqlx::MySql>(options.map_err(|e| bad_url(&cx, e))?, &cx, request).await
        }
        Scheme::Sqlite => {
            // Never `create_if_missing`: a mistyped path must not leave an empty database.
            let options = sqlx::sqlite::SqliteConnectOptions::from_str(url);
            execute::<sqlx::Sqlite>(options.map_err(|e| bad_url(&cx, e))?, &cx, request).await
        }
    }
}

/// `requeue SCOPE KEY`, or `requeue --all` with its filter (clap requires one or the other).
fn requeue_request(args: RequeueArgs) -> Result<Request, Failure> {
    if args.all {
        return Ok(Request::RequeueAll(BulkRequeue {
            scope: args.only_scope,
            group: args.group,
            failed_before: args.failed_before,
            dry_run: args.dry_run,
            yes: args.yes,
        }));
    }
    let (scope, key) = one_job(
        "requeue",
        "--all",
        (args.scope, args.key, args.parts),
        args.dry_run || args.yes,
    )?;
    Ok(Request::RequeueJob { key, scope })
}

/// The one job a verb's single form names (`SCOPE KEY`, or `SCOPE --part ..`), refused when
/// `bulk_only` (a flag of the bulk form, `--dry-run` or `--yes`) was given with it: clap does
/// not hold a flag to its `requires`.
fn one_job(
    verb: &str,
    bulk: &str,
    (scope, key, parts): (Option<String>, Option<String>, Vec<String>),
    bulk_only: bool,
) -> Result<(String, Key), Failure> {
    if bulk_only {
        return Err(Failure::input(format!(
            "--dry-run and --yes go with {bulk}: a single {verb} changes one job"
        )));
    }
    let Some(scope) = scope else {
        return Err(Failure::input(format!(
            "{verb} needs a SCOPE and a KEY, or {bulk} (with its filter)"
        )));
    };
    let target = Target { scope, key, parts };
    if target.key.is_none() && target.parts.is_empty() {
        return Err(Failure::input(format!(
            "{verb} needs the job's KEY after its SCOPE (or --part), or {bulk}"
        )));
    }
    Ok((target.scope.clone(), target.key()?))
}

/// `forget SCOPE KEY`, or `forget --stuck-older-than AGE` (clap requires one or the other).
fn forget_request(args: ForgetArgs) -> Result<Request, Failure> {
    if let Some(older_than) = args.stuck_older_than {
        return Ok(Request::ForgetStuck(BulkForget {
            older_than,
            scope: args.only_scope,
            force: args.force,
            dry_run: args.dry_run,
            yes: args.yes,
        }));
    }
    let (scope, key) = one_job(
        "forget",
        "--stuck-older-than AGE",
        (args.scope, args.key, args.parts),
        args.dry_run || args.yes,
    )?;
    Ok(Request::Forget {
        key,
        scope,
        force: args.force,
    })
}

/// `outbox requeue ID`, or `outbox requeue --all` with its filter.
fn outbox_requeue_request(args: OutboxRequeueArgs) -> Result<Request, Failure> {
    if args.all {
        return Ok(Request::OutboxRequeueAll(BulkOutbox {
            destination: args.destination,
            error: args.error,
            parked_before: args.parked_before,
            dry_run: args.dry_run,
            yes: args.yes,
        }));
    }
    if args.dry_run || args.yes {
        return Err(Failure::input(
            "--dry-run and --yes go with --all: a single outbox requeue changes one message",
        ));
    }
    match args.id {
        Some(id) => Ok(Request::Requeue { id }),
        None => Err(Failure::input(
            "outbox requeue needs a message ID, or --all (with its filter)",
        )),
    }
}

/// Who acts: `--actor`, else the operating system's user, else "unknown".
fn actor(given: Option<String>) -> String {
    given
        .or_else(|| std::env::var("USER").ok())
        .or_else(|| std::env::var("USERNAME").ok())
        .filter(|name| !name.trim().is_empty())
        .unwrap_or_else(|| "unknown".to_owned())
}

fn bad_url(cx: &Context, e: sqlx::Error) -> Failure {
    Failure::input(format!(
        "cannot read the database URL {}: {e}; check its syntax",
        cx.db.shown
    ))
}

async fn execute<DB: Backend>(
    options: <DB::Connection as sqlx::Connection>::Options,
    cx: &Context,
    request: Request,
) -> Result<ExitCode, Failure> {
    // A lazy pool connects at its first statement: the table name is checked before that.
    // The console serves pages side by side; every other command runs one statement at a time.
    let connections = match request {
        Request::Console(_) => 4,
        _ => 1,
    };
    let pool = PoolOptions::<DB>::new()
        .max_connections(connections)
        .acquire_timeout(CONNECT_TIMEOUT)
        .connect_lazy_with(options.clone());
    let store = Store::new(pool)
        .with_table(&cx.table)
        .map_err(|e| Failure::input(format!("{e} (--table)")))?;
    // One attempt of our own: the pool retries a refused connection until its timeout and
    // then reports only that it timed out, not why.
    match tokio::time::timeout(CONNECT_TIMEOUT, options.connect()).await {
        Ok(Ok(conn)) => drop(conn.close().await),
        Ok(Err(e)) if cx.db.scheme == Scheme::Sqlite => {
            return Err(Failure::database(format!(
                "cannot open the SQLite database at {}: {e}; check the path: the file must \
                 exist (the tool never creates one) and be readable and writable by this user",
                cx.db.shown
            )));
        }
        Ok(Err(e)) => {
            return Err(Failure::database(format!(
                "cannot reach the database at {}: {e}; check the URL and that the server is \
                 running",
                cx.db.shown
            )));
        }
        Err(_) => {
            return Err(Failure::database(format!(
                "the database at {} did not accept a connection within {} s; check the URL \
                 and that the server is running",
                cx.db.shown,
                CONNECT_TIMEOUT.as_secs()
            )));
        }
    }
    match command(&store, cx, request).await {
        Err(failure) if failure.is_database() => Err(missing_table(&store, cx, failure).await),
        done => done,
    }
}

/// A statement the database refused because the marker table is not there: say so, and
/// which tables there hold markers, rather than advise a migration (the operator more likely
/// mistyped `--table`).
async fn missing_table<DB: Backend>(store: &Store<DB>, cx: &Context, failure: Failure) -> Failure {
    let tables = match store.marker_tables().await {
        Ok(tables) if !tables.iter().any(|t| t.eq_ignore_ascii_case(store.table())) => tables,
        _ => return failure,
    };
    const SHOWN: usize = 10;
    let there = match tables.as_slice() {
        [] => "it holds no marker table".to_owned(),
        some if some.len() <= SHOWN => format!("its marker tables: {}", some.join(", ")),
        some => format!(
            "its marker tables: {} and {} more",
            some[..SHOWN].join(", "),
            some.len() - SHOWN
        ),
    };
    Failure::database(format!(
        "no table {} in the database at {} ({there}): pass the table your handlers' store \
         was given with `Store::with_table` as --table (or IDEM_TABLE); without either the \
         tool reads {}",
        store.table(),
        cx.db.shown,
        idem::DEFAULT_TABLE
    ))
}

async fn command<DB: Backend>(
    store: &Store<DB>,
    cx: &Context,
    request: Request,
) -> Result<ExitCode, Failure> {
    let refused = |e: idem::Error| {
        Failure::database(format!(
            "the database at {} (table {}): {e}",
            cx.db.shown, cx.table
        ))
    };
    let (text, code) = match request {
        Request::Inspect { scope, key } => {
            let marker = store.inspect(&scope, &key).await.map_err(refused)?;
            let code = if marker.is_some() { 0 } else { NOT_FOUND };
            (
                render::inspect(store.table(), &scope, &key, marker.as_ref(), cx.json),
                code,
            )
        }
        Request::Forget { scope, key, force } => {
            let forgot = match force {
                true => store.forget_forced(&scope, &key).await,
                false => store.forget(&scope, &key).await,
            };
            let gone = match forgot {
                Ok(gone) => gone,
                Err(e @ idem::Error::Lease(idem::LeaseError::Held { .. })) => {
                    return Err(Failure::refused(HELD, format!("{e}; nothing was changed")));
                }
                Err(e) => return Err(refused(e)),
            };
            let target = json!({ "scope": scope, "key": key.as_str(), "force": force });
            bulk::record(
                store,
                &cx.actor,
                "forget",
                &target,
                u64::from(gone),
                refused,
            )
            .await?;
            (
                render::forget(store.table(), &scope, &key, gone, cx.json),
                0,
            )
        }
        Request::ForgetStuck(all) => {
            let text = sweep::forget_stuck(store, &all, &cx.actor, cx.json, refused).await;
            store.pool().close().await;
            print!("{}", text?);
            return Ok(ExitCode::SUCCESS);
        }
        Request::OutboxRequeueAll(all) => {
            let text = sweep::outbox_requeue_all(store, &all, &cx.actor, cx.json, refused).await;
            store.pool().close().await;
            print!("{}", text?);
            return Ok(ExitCode::SUCCESS);
        }
        Request::Purge(age) => {
            let deleted = match &age {
                Some(age) => store.purge(age.duration).await,
                None => store.purge_by_retention().await,
            };
            let deleted = deleted.map_err(refused)?;
            (
                render::purge(age.as_ref(), store.table(), deleted, cx.json),
                0,
            )
        }
        Request::RetentionSet { scope, keep } => {
            store
                .set_retention(&scope, keep.duration)
                .await
                .map_err(refused)?;
            (retention::set(store.table(), &scope, &keep, cx.json), 0)
        }
        Request::RetentionList => {
            let windows = store.retentions().await.map_err(refused)?;
            (retention::list(store.table(), &windows, cx.json), 0)
        }
        Request::RetentionClear { scope } => {
            let had = store.clear_retention(&scope).await.map_err(refused)?;
            (retention::clear(store.table(), &scope, had, cx.json), 0)
        }
        Request::Doctor(args) => {
            let diagnosis = store
                .doctor(&doctor::checkup(&args))
                .await
                .map_err(refused)?;
            let code = doctor::exit_code(&diagnosis);
            (doctor::render(&diagnosis, &cx.db.shown, cx.json), code)
        }
        Request::Stuck { scope, limit } => {
            let markers = match &scope {
                Some(scope) => store.list_in_progress(scope, limit).await,
                None => store.list_all_in_progress(limit).await,
            };
            let markers = markers.map_err(refused)?;
            let text = render::stuck(store.table(), scope.as_deref(), limit, &markers, cx.json);
            (text, 0)
        }
        Request::OutboxList { filter, limit } => {
            let (parked, pending) = filter.shows();
            let messages = store
                .list_outbox(parked, pending, limit)
                .await
                .map_err(refused)?;
            let table = format!("{}_outbox", store.table());
            (outbox::list(&table, filter, limit, &messages, cx.json), 0)
        }
        Request::Failed {
            scope,
            limit,
            group_by: Some(GroupBy::Error),
        } => {
            let groups = store.failure_groups(scope.as_deref(), limit).await;
            let groups = groups.map_err(refused)?;
            let text = bulk::groups(store.table(), scope.as_deref(), limit, &groups, cx.json);
            (text, 0)
        }
        Request::Failed {
            scope,
            limit,
            group_by: None,
        } => {
            let markers = store.list_failed(scope.as_deref(), limit).await;
            let markers = markers.map_err(refused)?;
            let text = failed::list(store.table(), scope.as_deref(), limit, &markers, cx.json);
            (text, 0)
        }
        Request::RequeueJob { scope, key } => {
            let text = failed::requeue(store, &scope, &key, cx.json, refused).await?;
            let target = json!({ "scope": scope, "key": key.as_str() });
            bulk::record(store, &cx.actor, "requeue", &target, 1, refused).await?;
            store.pool().close().await;
            print!("{text}");
            return Ok(ExitCode::SUCCESS);
        }
        Request::RequeueAll(all) => {
            let text = bulk::requeue_all(store, &all, &cx.actor, cx.json, refused).await;
            store.pool().close().await;
            print!("{}", text?);
            return Ok(ExitCode::SUCCESS);
        }
        Request::Console(serve) => {
            console::serve(store.clone(), &serve, &cx.actor).await?;
            store.pool().close().await;
            return Ok(ExitCode::SUCCESS);
        }
        Request::Audit { limit } => {
            let entries = store.audit_log(limit).await.map_err(refused)?;
            (bulk::audit(store.table(), limit, &entries, cx.json), 0)
        }
        Request::Steps { scope, key } => {
            let steps = store.steps(&scope, &key).await.map_err(refused)?;
            (
                failed::steps(store.table(), &scope, &key, &steps, cx.json),
                0,
            )
        }
        Request::OutboxShow { id } => {
            let table = format!("{}_outbox", store.table());
            let message = store.outbox_message(&id).await.map_err(refused)?;
            store.pool().close().await;
            let Some(m) = message else {
                return Err(Failure::refused(
                    NOT_FOUND,
                    format!(
                        "no outbox message with id {id:?} in table {table}: check the id \
                         (`idem outbox list` prints them) and --table; a sent message may \
                         have been purged"
                    ),
                ));
            };
            print!("{}", outbox::show(&table, &m, cx.json));
            return Ok(ExitCode::SUCCESS);
        }
        Request::Requeue { id } => {
            let table = format!("{}_outbox", store.table());
            let done = store.requeue_outbox(&id).await.map_err(refused)?;
            let message = store.outbox_message(&id).await.map_err(refused)?;
            if done {
                let target = json!({ "id": id });
                bulk::record(store, &cx.actor, "outbox requeue", &target, 1, refused).await?;
            }
            store.pool().close().await;
            return match (done, message) {
                (true, Some(m)) => {
                    print!("{}", outbox::requeued(&table, &m, cx.json));
                    Ok(ExitCode::SUCCESS)
                }
                (_, None) => Err(Failure::refused(
                    NOT_FOUND,
                    format!(
                        "no outbox message with id {id:?} in table {table}: check the id \
                         (`idem outbox list` prints them) and --table; a sent message may \
                         have been purged"
                    ),
                )),
                (false, Some(m)) => Err(Failure::refused(
                    NOT_PARKED,
                    format!(
                        "message {id:?} in table {table} is {}, not parked: nothing to \
                         requeue{}",
                        outbox::state_name(m.state),
                        if m.state == idem::outbox::OutboxState::Sent {
                            " (the broker confirmed it)"
                        } else {
                            " (the relay publishes it when it is due)"
                        }
                    ),
                )),
            };
        }
    };
    store.pool().close().await;
    print!("{text}");
    Ok(ExitCode::from(code))
}
