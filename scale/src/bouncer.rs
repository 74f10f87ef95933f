//! A PgBouncer of the test's own, in transaction pooling mode, in front of the shared
//! PostgreSQL: its configuration, log and pid file in a directory of its own, on a port of its
//! own, killed and removed when the value is dropped.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use sqlx::postgres::PgConnectOptions;
use tokio::process::{Child, Command};

/// The server connections PgBouncer opens to PostgreSQL for the test database: fewer than
/// the clients the tests open, so that clients share them, transaction by transaction.
pub const SERVER_CONNECTIONS: u32 = 4;

/// The environment variable naming the PostgreSQL the tests reach through PgBouncer.
pub const URL_VAR: &str = "IDEM_POSTGRES_URL";

/// The shared PostgreSQL's URL: `IDEM_POSTGRES_URL`, or the local server.
pub fn postgres_url() -> String {
    std::env::var(URL_VAR).unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

/// A running PgBouncer in `pool_mode = transaction`.
pub struct Bouncer {
    dir: PathBuf,
    port: u16,
    database: String,
    user: String,
    child: Child,
}

impl Bouncer {
    /// Starts PgBouncer in front of `postgres` (a URL), as user `postgres` when this process
    /// runs as root (PgBouncer refuses to run as root), and waits until it accepts
    /// connections. Panics with what failed: the tests never skip.
    pub async fn start(postgres: &str) -> Bouncer {
        let target: PgConnectOptions = postgres
            .parse()
            .unwrap_or_else(|e| panic!("{URL_VAR}={postgres} is not a PostgreSQL URL: {e}"));
        let database = target.get_database().unwrap_or("postgres").to_owned();
        let user = target.get_username().to_owned();
        let port = free_port();
        let dir =
            std::env::temp_dir().join(format!("idem-pgbouncer-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a directory for PgBouncer");
        // `extra_float_digits`: sqlx sends it at connect, and PgBouncer refuses a startup
        // parameter it does not track unless told to ignore it.
        let ini = format!(
            "[databases]\n\
             {database} = host={host} port={pg_port} dbname={database} user={user}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir =\n\
             auth_type = trust\n\
             auth_file = {dir}/users.txt\n\
             pool_mode = transaction\n\
             default_pool_size = {SERVER_CONNECTIONS}\n\
             max_client_conn = 200\n\
             ignore_startup_parameters = extra_float_digits\n\
             logfile = {dir}/pgbouncer.log\n\
             pidfile = {dir}/pgbouncer.pid\n",
            host = target.get_host(),
            pg_port = target.get_port(),
            dir = dir.display(),
        );
        std::fs::write(dir.join("pgbouncer.ini"), ini).expect("pgbouncer.ini");
        std::fs::write(dir.join("users.txt"), format!("\"{user}\" \"\"\n")).expect("users.txt");
        let root = std::process::Command::new("id")
            .arg("-u")
            .output()
            .map(|o| o.stdout.starts_with(b"0\n"))
            .unwrap_or(false);
        let mut cmd = Command::new(binary());
        if root {
            let chown = std::process::Command::new("chown")
                .args(["-R", "postgres"])
                .arg(&dir)
                .status()
                .expect("chown");
            assert!(chown.success(), "chown postgres {} failed", dir.display());
            // `-u`: PgBouncer drops to the user itself, so that the child is PgBouncer (and
            // `kill_on_drop` reaches it), not a `runuser` that would leave it behind.
            cmd.args(["-u", "postgres"]);
        }
        let child = cmd
            .arg(dir.join("pgbouncer.ini"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "cannot start pgbouncer ({e}): install Debian's `pgbouncer` package \
                     (.ci/run does)"
                )
            });
        let bouncer = Bouncer {
            dir,
            port,
            database,
            user,
            child,
        };
        // Polling for a server that was just started: readiness, not a test's timing.
        let deadline = Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_err()
        {
            assert!(
                Instant::now() < deadline,
                "PgBouncer did not listen on port {port} within 30 s; its log: {}",
                bouncer.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        bouncer
    }

    /// The URL of the test database through PgBouncer.
    pub fn url(&self) -> String {
        format!(
            "postgres://{}@127.0.0.1:{}/{}",
            self.user, self.port, self.database
        )
    }

    /// PgBouncer's log, for a failure's message.
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("pgbouncer.log")).unwrap_or_default()
    }
}

impl Drop for Bouncer {
    fn drop(&mut self) {
        drop(self.child.start_kill());
        drop(std::fs::remove_dir_all(&self.dir));
    }
}

/// `pgbouncer` on the `PATH`, else where Debian puts it (`/usr/sbin`, which a non-login
/// shell's `PATH` may lack).
fn binary() -> PathBuf {
    let on_path = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .map(|dir| dir.join("pgbouncer"))
        .find(|bin| bin.exists());
    on_path.unwrap_or_else(|| PathBuf::from("/usr/sbin/pgbouncer"))
}

/// A port nobody listens on now (the kernel's pick; PgBouncer binds it a moment later).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}
