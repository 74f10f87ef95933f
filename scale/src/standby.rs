//! A PostgreSQL primary and a streaming standby of the test's own (Debian's server binaries,
//! run as user `postgres`, in a temporary directory, on ports of their own): `initdb`,
//! `pg_basebackup`, a SIGKILL of the primary and `pg_ctl promote`. Dropped, it stops what is
//! left and removes the directory.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::bouncer::free_port;
use crate::delay::DelayProxy;

/// PostgreSQL's binaries: Debian keeps them in `/usr/lib/postgresql/<version>/bin`.
fn pg_bin() -> PathBuf {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL's server binaries in /usr/lib/postgresql")
        .filter_map(|e| {
            let e = e.ok()?;
            let v = e.file_name().to_str()?.parse().ok()?;
            Some((v, e.path().join("bin")))
        })
        .filter(|(_, bin)| bin.join("pg_ctl").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .expect("pg_ctl under /usr/lib/postgresql/*/bin")
        .1
}

/// Runs `program` of PostgreSQL's as user `postgres`; panics with its output when it fails.
fn run(bin: &Path, program: &str, args: &[&str]) {
    let out = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .arg(bin.join(program))
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"));
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A primary with one streaming standby: named `standby` in the primary's
/// `synchronous_standby_names` (a commit returns once the standby flushed it), or
/// asynchronous (a commit returns once the primary flushed it).
pub struct Pair {
    root: PathBuf,
    bin: PathBuf,
    pub primary_port: u16,
    pub standby_port: u16,
    /// The standby's replication connection's way to the primary, when it is delayed.
    proxy: Option<DelayProxy>,
}

impl Pair {
    /// Creates and starts both servers, the standby synchronous or not.
    pub async fn start(synchronous: bool) -> Pair {
        Pair::start_with(synchronous, None).await
    }

    /// A synchronous standby whose replication connection passes through a [`DelayProxy`]
    /// of `delay` each way (changed later with [`Pair::set_delay`]): a commit waits for a
    /// round trip to the standby, as it does with a standby in another zone. Both servers
    /// flush their writes (`fsync` on): what a commit costs is the question.
    pub async fn start_delayed(delay: Duration) -> Pair {
        Pair::start_with(true, Some(delay)).await
    }

    /// Changes the delay each way between the standby and the primary.
    ///
    /// # Panics
    ///
    /// If the pair was not started by [`Pair::start_delayed`].
    pub fn set_delay(&self, delay: Duration) {
        self.proxy
            .as_ref()
            .expect("a pair started with a delay")
            .set_delay(delay);
    }

    async fn start_with(synchronous: bool, delay: Option<Duration>) -> Pair {
        let root = std::env::temp_dir().join(format!(
            "idem-standby-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&root).expect("a directory for the servers");
        let chown = Command::new("chown")
            .args(["-R", "postgres"])
            .arg(&root)
            .status()
            .expect("chown");
        assert!(chown.success(), "chown postgres {}", root.display());
        let mut pair = Pair {
            bin: pg_bin(),
            primary_port: free_port(),
            standby_port: free_port(),
            root,
            proxy: None,
        };
        let primary = pair.dir("primary");
        run(
            &pair.bin,
            "initdb",
            &["-A", "trust", "-U", "postgres", "--no-sync", "-D", &primary],
        );
        // `fsync = off` for the tests: they kill processes, never the machine, so what a
        // server wrote is in the page cache all the same; it only makes the run shorter. A
        // delayed pair is a benchmark's, which measures what a commit costs.
        let conf = format!(
            "listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{root}'\n\
             fsync = {fsync}\n\
             synchronous_standby_names = '{names}'\n\
             synchronous_commit = on\n",
            root = pair.root.display(),
            fsync = if delay.is_some() { "on" } else { "off" },
            names = if synchronous { "standby" } else { "" },
        );
        append(&format!("{primary}/postgresql.conf"), &conf);
        pair.pg_ctl_start("primary", pair.primary_port);
        let standby = pair.dir("standby");
        run(
            &pair.bin,
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &pair.primary_port.to_string(),
                "-U",
                "postgres",
                "-D",
                &standby,
                "-X",
                "stream",
                "-R",
                "--no-sync",
            ],
        );
        // The standby streams through the proxy when there is one (pg_basebackup went
        // direct: the copy is setup, not the measured path).
        let upstream = match delay {
            Some(delay) => {
                let proxy = DelayProxy::start(
                    std::net::SocketAddr::from(([127, 0, 0, 1], pair.primary_port)),
                    delay,
                );
                let port = proxy.port();
                pair.proxy = Some(proxy);
                port
            }
            None => pair.primary_port,
        };
        // The standby's name in the primary's list; once promoted, it waits for no standby
        // of its own.
        append(
            &format!("{standby}/postgresql.auto.conf"),
            &format!(
                "primary_conninfo = 'host=127.0.0.1 port={} user=postgres \
                 application_name=standby'\nsynchronous_standby_names = ''\n",
                upstream
            ),
        );
        pair.pg_ctl_start("standby", pair.standby_port);
        pair
    }

    fn dir(&self, name: &str) -> String {
        self.root.join(name).display().to_string()
    }

    fn pg_ctl_start(&self, name: &str, port: u16) {
        let log = self.dir(&format!("{name}.log"));
        run(
            &self.bin,
            "pg_ctl",
            &[
                "-w",
                "-t",
                "60",
                "-o",
                &format!("-p {port}"),
                "-l",
                &log,
                "-D",
                &self.dir(name),
                "start",
            ],
        );
    }

    /// The URL of the `postgres` database on `port`.
    pub fn url(port: u16) -> String {
        format!("postgres://postgres@127.0.0.1:{port}/postgres")
    }

    /// Waits until the primary reports the standby streaming, in `state` (`sync`, `async`).
    pub async fn wait_for_standby(&self, primary: &sqlx::PgPool, state: &str) {
        // Polling a server's state while it comes up: readiness, not a test's timing.
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let found: Option<String> = sqlx::query_scalar(
                "SELECT sync_state FROM pg_stat_replication WHERE application_name = 'standby' \
                 AND state = 'streaming'",
            )
            .fetch_optional(primary)
            .await
            .expect("read pg_stat_replication");
            if found.as_deref() == Some(state) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the standby did not stream ({state}) within 60 s (found {found:?})"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL of the primary's postmaster and every process it started, at once: the
    /// primary dies with whatever it had in flight.
    pub fn kill_primary(&self) {
        let pid = self.postmaster_pid("primary").expect("the primary runs");
        let children = Command::new("ps")
            .args(["-o", "pid=", "--ppid", &pid])
            .output()
            .expect("ps");
        let mut pids = vec![pid.clone()];
        pids.extend(
            String::from_utf8_lossy(&children.stdout)
                .split_whitespace()
                .map(str::to_owned),
        );
        // Its status is not checked: a child that ended since `ps` (an autovacuum worker)
        // makes `kill` fail for that pid alone. The postmaster must be gone.
        drop(Command::new("kill").arg("-KILL").args(&pids).status());
        let deadline = Instant::now() + Duration::from_secs(10);
        while Path::new(&format!("/proc/{pid}")).exists() {
            assert!(
                Instant::now() < deadline,
                "the primary ({pid}) survived SIGKILL"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// `pg_ctl promote`, waiting until the standby accepts writes.
    pub fn promote(&self) {
        run(
            &self.bin,
            "pg_ctl",
            &["-w", "-t", "60", "-D", &self.dir("standby"), "promote"],
        );
    }

    fn postmaster_pid(&self, name: &str) -> Option<String> {
        let pid = std::fs::read_to_string(self.root.join(name).join("postmaster.pid")).ok()?;
        pid.lines().next().map(str::to_owned)
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for name in ["standby", "primary"] {
            if self.postmaster_pid(name).is_some() {
                let _ = Command::new("runuser")
                    .args(["-u", "postgres", "--"])
                    .arg(self.bin.join("pg_ctl"))
                    .args(["-w", "-m", "immediate", "-D", &self.dir(name), "stop"])
                    .output();
            }
        }
        drop(std::fs::remove_dir_all(&self.root));
    }
}

fn append(path: &str, text: &str) {
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {path}: {e}"));
    file.write_all(text.as_bytes())
        .unwrap_or_else(|e| panic!("write {path}: {e}"));
}
