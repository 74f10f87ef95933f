//! A PostgreSQL primary and a streaming standby of the test's own (Debian's server binaries,
//! run as user `postgres`, in a temporary directory, on ports of their own): `initdb`,
//! `pg_basebackup`, a SIGKILL of the primary and `pg_ctl promote`. Dropped, it stops what is
//! left and removes the directory. [`Server`] is one such server alone, with settings of the
//! caller's.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use crate::bouncer::free_port;
use crate::delay::DelayProxy;

/// PostgreSQL's binaries, the newest version's: Debian keeps them in
/// `/usr/lib/postgresql/<version>/bin`. `None` where there is no `pg_ctl` there, so that a
/// caller can say what is missing before it starts anything.
pub fn find_pg_bin() -> Option<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| {
            let e = e.ok()?;
            let v = e.file_name().to_str()?.parse().ok()?;
            Some((v, e.path().join("bin")))
        })
        .filter(|(_, bin)| bin.join("pg_ctl").exists())
        .collect();
    versions.sort();
    versions.pop().map(|(_, bin)| bin)
}

fn pg_bin() -> PathBuf {
    find_pg_bin().expect("PostgreSQL's server binaries: pg_ctl under /usr/lib/postgresql/*/bin")
}

/// A directory of this process's own under the temporary directory, owned by `postgres`, whose
/// servers' data directories it will hold.
fn owned_root(name: &str) -> PathBuf {
    let root = std::env::temp_dir().join(format!(
        "idem-{name}-{}-{}",
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
    root
}

/// `initdb` of `dir`, then `conf` after the configuration it wrote, with the lines every
/// server here needs: TCP on loopback alone, and the sockets in `root` rather than in
/// `/var/run/postgresql`, which a system's own server may hold.
fn initdb(bin: &Path, root: &Path, dir: &str, conf: &str) {
    run(
        bin,
        "initdb",
        &["-A", "trust", "-U", "postgres", "--no-sync", "-D", dir],
    );
    let local = format!(
        "listen_addresses = '127.0.0.1'\nunix_socket_directories = '{}'\n",
        root.display()
    );
    append(&format!("{dir}/postgresql.conf"), &(local + conf));
}

/// `pg_ctl start` of the data directory `root/name` on `port`, its log `root/name.log`.
fn pg_ctl_start(bin: &Path, root: &Path, name: &str, port: u16) {
    let dir = root.join(name).display().to_string();
    let log = root.join(format!("{name}.log")).display().to_string();
    run(
        bin,
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
            &dir,
            "start",
        ],
    );
}

fn postmaster_pid(root: &Path, name: &str) -> Option<String> {
    let pid = std::fs::read_to_string(root.join(name).join("postmaster.pid")).ok()?;
    pid.lines().next().map(str::to_owned)
}

/// Stops the server `root/name` if it runs (at once: what it held is thrown away with it).
fn stop(bin: &Path, root: &Path, name: &str) {
    if postmaster_pid(root, name).is_some() {
        let _ = Command::new("runuser")
            .args(["-u", "postgres", "--"])
            .arg(bin.join("pg_ctl"))
            .args(["-w", "-m", "immediate", "-D"])
            .arg(root.join(name))
            .arg("stop")
            .output();
    }
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
        let mut pair = Pair {
            bin: pg_bin(),
            primary_port: free_port(),
            standby_port: free_port(),
            root: owned_root("standby"),
            proxy: None,
        };
        let primary = pair.dir("primary");
        // `fsync = off` for the tests: they kill processes, never the machine, so what a
        // server wrote is in the page cache all the same; it only makes the run shorter. A
        // delayed pair is a benchmark's, which measures what a commit costs.
        let conf = format!(
            "fsync = {fsync}\n\
             synchronous_standby_names = '{names}'\n\
             synchronous_commit = on\n",
            fsync = if delay.is_some() { "on" } else { "off" },
            names = if synchronous { "standby" } else { "" },
        );
        initdb(&pair.bin, &pair.root, &primary, &conf);
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
        pg_ctl_start(&self.bin, &self.root, name, port);
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
        postmaster_pid(&self.root, name)
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        for name in ["standby", "primary"] {
            stop(&self.bin, &self.root, name);
        }
        drop(std::fs::remove_dir_all(&self.root));
    }
}

/// One PostgreSQL server of the caller's own, flushing as a production server does (`fsync`
/// and `synchronous_commit` on), with the caller's settings after those (`wal_level =
/// logical`, say). Dropped, it stops and its directory is removed.
pub struct Server {
    root: PathBuf,
    bin: PathBuf,
    pub port: u16,
}

impl Server {
    /// Creates and starts the server, `conf` (lines of `postgresql.conf`) in its configuration.
    ///
    /// # Panics
    ///
    /// When PostgreSQL's binaries are missing or `initdb` or `pg_ctl` fails, with their output.
    pub fn start(conf: &str) -> Server {
        let server = Server {
            bin: pg_bin(),
            root: owned_root("server"),
            port: free_port(),
        };
        let dir = server.root.join("data").display().to_string();
        let conf = format!("fsync = on\nsynchronous_commit = on\n{conf}");
        initdb(&server.bin, &server.root, &dir, &conf);
        pg_ctl_start(&server.bin, &server.root, "data", server.port);
        server
    }

    /// The URL of its `postgres` database.
    pub fn url(&self) -> String {
        Pair::url(self.port)
    }

    /// The directory of the binaries it runs, for their clients of the same version
    /// (`pg_recvlogical`, say).
    pub fn bin(&self) -> &Path {
        &self.bin
    }

    /// Its log, for an error's message.
    pub fn log(&self) -> PathBuf {
        self.root.join("data.log")
    }

    /// Stops it at once (`immediate`: as a crash, its clients' connections cut) and starts it
    /// again on the same port; returns once it accepts connections.
    pub fn restart(&self) {
        stop(&self.bin, &self.root, "data");
        pg_ctl_start(&self.bin, &self.root, "data", self.port);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        stop(&self.bin, &self.root, "data");
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
