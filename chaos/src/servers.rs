//! The servers the harness owns, each in a directory of its own under the run's temporary
//! directory and on ports of its own, so that it can kill and restart them without touching
//! the shared servers other tests use: a PostgreSQL cluster (`initdb`, `pg_ctl`, as user
//! `postgres`), a MariaDB datadir (`mariadbd` as user `mysql`), a RabbitMQ node, and a
//! three-node JetStream cluster.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokio::process::{Child, Command};
use tokio::sync::Mutex;

pub type Res<T> = Result<T, String>;

/// A port nobody listens on now (the kernel's pick; the server binds it a moment later).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// Polls `ready` until it holds or `limit` passed; the error names `what`.
pub async fn until<F, Fut>(limit: Duration, what: &str, mut ready: F) -> Res<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + limit;
    loop {
        // Each probe is bounded too: a connect that a server half up accepts and never
        // answers (RabbitMQ's listener before its boot ends) would otherwise wait for ever,
        // past the limit, and the next probe may well succeed.
        let left = deadline.saturating_duration_since(Instant::now());
        let probe = left.min(Duration::from_secs(5));
        if tokio::time::timeout(probe, ready()).await == Ok(true) {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("{what}: not ready within {limit:?}"));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn run(cmd: &mut Command, what: &str) -> Res<()> {
    let out = cmd
        .output()
        .await
        .map_err(|e| format!("{what}: cannot run: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{what} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn owned_dir(path: &Path, user: &str) -> Res<()> {
    std::fs::create_dir_all(path).map_err(|e| format!("mkdir {}: {e}", path.display()))?;
    let status = std::process::Command::new("chown")
        .args(["-R", user])
        .arg(path)
        .status()
        .map_err(|e| format!("chown: {e}"))?;
    status
        .success()
        .then_some(())
        .ok_or_else(|| format!("chown {user} {} failed", path.display()))
}

fn log_file(path: &Path) -> Stdio {
    std::fs::File::create(path).map_or_else(|_| Stdio::null(), Stdio::from)
}

async fn tcp_open(port: u16) -> bool {
    tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .is_ok()
}

/// PostgreSQL's binaries: Debian keeps them in `/usr/lib/postgresql/<version>/bin`.
fn pg_bin() -> Res<PathBuf> {
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| format!("no PostgreSQL server binaries in /usr/lib/postgresql: {e}"))?
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
        .map(|(_, bin)| bin)
        .ok_or_else(|| "no pg_ctl under /usr/lib/postgresql/*/bin".to_owned())
}

pub struct Pg {
    dir: PathBuf,
    bin: PathBuf,
    pub port: u16,
}

impl Pg {
    pub async fn create(root: &Path) -> Res<Pg> {
        let top = root.join("pg");
        owned_dir(&top, "postgres")?;
        let pg = Pg {
            dir: top.join("data"),
            bin: pg_bin()?,
            port: free_port(),
        };
        run(
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(pg.bin.join("initdb"))
                .args(["-A", "trust", "-U", "postgres", "--no-sync", "-D"])
                .arg(&pg.dir),
            "initdb",
        )
        .await?;
        pg.start().await?;
        Ok(pg)
    }

    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    pub async fn start(&self) -> Res<()> {
        let options = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c max_connections=300",
            self.port,
            self.dir.parent().expect("a parent").display()
        );
        run(
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(self.bin.join("pg_ctl"))
                .args(["-w", "-t", "60", "-o", &options, "-l"])
                .arg(self.dir.parent().expect("a parent").join("server.log"))
                .arg("-D")
                .arg(&self.dir)
                .arg("start"),
            "pg_ctl start",
        )
        .await
    }

    /// `pg_ctl stop -m immediate`: every backend killed at once, crash recovery at the next
    /// start.
    pub async fn stop_immediate(&self) -> Res<()> {
        run(
            Command::new("runuser")
                .args(["-u", "postgres", "--"])
                .arg(self.bin.join("pg_ctl"))
                .args(["-w", "-m", "immediate", "-D"])
                .arg(&self.dir)
                .arg("stop"),
            "pg_ctl stop",
        )
        .await
    }
}

pub struct My {
    dir: PathBuf,
    pub port: u16,
    child: Mutex<Option<Child>>,
}

impl My {
    pub async fn create(root: &Path) -> Res<My> {
        let top = root.join("mariadb");
        owned_dir(&top, "mysql")?;
        let my = My {
            dir: top,
            port: free_port(),
            child: Mutex::new(None),
        };
        run(
            Command::new("mariadb-install-db")
                .arg("--no-defaults")
                .arg("--user=mysql")
                .arg(format!("--datadir={}", my.dir.join("data").display()))
                .args(["--auth-root-authentication-method=normal", "--skip-test-db"]),
            "mariadb-install-db",
        )
        .await?;
        my.start().await?;
        Ok(my)
    }

    pub fn url(&self, user: &str) -> String {
        format!("mysql://{user}@127.0.0.1:{}/chaos", self.port)
    }

    pub async fn start(&self) -> Res<()> {
        let child = Command::new("mariadbd")
            .arg("--no-defaults")
            .arg("--user=mysql")
            .arg(format!("--datadir={}", self.dir.join("data").display()))
            .arg(format!("--port={}", self.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}", self.dir.join("sock").display()))
            .arg(format!("--pid-file={}", self.dir.join("pid").display()))
            .arg(format!(
                "--log-error={}",
                self.dir.join("error.log").display()
            ))
            .args(["--innodb-buffer-pool-size=64M", "--max-connections=300"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start mariadbd: {e}"))?;
        *self.child.lock().await = Some(child);
        let port = self.port;
        // Crash recovery runs before the port opens.
        until(Duration::from_secs(90), "the owned MariaDB", || {
            tcp_open(port)
        })
        .await
    }

    /// SIGKILL: the server dies with whatever it had in flight.
    pub async fn kill(&self) {
        if let Some(mut child) = self.child.lock().await.take() {
            drop(child.kill().await);
        }
    }
}

pub struct Rabbit {
    dir: PathBuf,
    pub port: u16,
    dist_port: u16,
    child: Mutex<Option<Child>>,
}

impl Rabbit {
    pub async fn create(root: &Path) -> Res<Rabbit> {
        let dir = root.join("rabbitmq");
        std::fs::create_dir_all(dir.join("mnesia")).map_err(|e| e.to_string())?;
        std::fs::create_dir_all(dir.join("log")).map_err(|e| e.to_string())?;
        let rabbit = Rabbit {
            dir,
            port: free_port(),
            dist_port: free_port(),
            child: Mutex::new(None),
        };
        // A configuration of its own: the system's may bind the shared node's port.
        std::fs::write(
            rabbit.dir.join("node.conf"),
            format!("listeners.tcp.default = {}\n", rabbit.port),
        )
        .map_err(|e| e.to_string())?;
        std::fs::write(rabbit.dir.join("plugins"), "[].\n").map_err(|e| e.to_string())?;
        owned_dir(&rabbit.dir, "rabbitmq")?;
        rabbit.start().await?;
        Ok(rabbit)
    }

    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    fn node(&self) -> String {
        format!("idem-chaos-{}@localhost", std::process::id())
    }

    pub async fn start(&self) -> Res<()> {
        let d = &self.dir;
        let child = Command::new("rabbitmq-server")
            .env("RABBITMQ_NODENAME", self.node())
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_DIST_PORT", self.dist_port.to_string())
            .env("RABBITMQ_MNESIA_BASE", d.join("mnesia"))
            .env("RABBITMQ_LOG_BASE", d.join("log"))
            .env("RABBITMQ_CONFIG_FILE", d.join("node.conf"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", d.join("plugins"))
            .env("RABBITMQ_FEATURE_FLAGS_FILE", d.join("feature_flags"))
            .env("RABBITMQ_PID_FILE", d.join("pid"))
            .stdout(log_file(&d.join("stdout.log")))
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start rabbitmq-server: {e}"))?;
        *self.child.lock().await = Some(child);
        let url = self.url();
        until(Duration::from_secs(120), "the owned RabbitMQ node", || {
            let url = url.clone();
            async move {
                lapin::Connection::connect(&url, lapin::ConnectionProperties::default())
                    .await
                    .is_ok()
            }
        })
        .await
    }

    /// SIGKILL of the node's Erlang VM (its pid file), then of the script that started it.
    pub async fn kill(&self) {
        if let Ok(pid) = std::fs::read_to_string(self.dir.join("pid")) {
            signal("KILL", pid.trim()).await;
        }
        if let Some(mut child) = self.child.lock().await.take() {
            drop(child.kill().await);
        }
        let port = self.port;
        drop(
            until(
                Duration::from_secs(30),
                "the node's port to close",
                || async move { !tcp_open(port).await },
            )
            .await,
        );
        let _ = std::fs::remove_file(self.dir.join("pid"));
    }
}

/// `kill -SIG pid`: real signals, sent the way an operator (or the OOM killer) would.
pub async fn signal(sig: &str, pid: &str) {
    drop(
        Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(pid)
            .status()
            .await,
    );
}

struct NatsNode {
    name: String,
    port: u16,
    cluster_port: u16,
    child: Mutex<Option<Child>>,
}

pub struct Nats {
    dir: PathBuf,
    nodes: Vec<NatsNode>,
}

impl Nats {
    pub async fn create(root: &Path) -> Res<Nats> {
        let nats = Nats {
            dir: root.join("nats"),
            nodes: (1..=3)
                .map(|i| NatsNode {
                    name: format!("n{i}"),
                    port: free_port(),
                    cluster_port: free_port(),
                    child: Mutex::new(None),
                })
                .collect(),
        };
        for i in 0..3 {
            nats.start(i).await?;
        }
        Ok(nats)
    }

    pub fn urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .map(|n| format!("nats://127.0.0.1:{}", n.port))
            .collect()
    }

    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == name)
    }

    pub async fn start(&self, i: usize) -> Res<()> {
        let node = &self.nodes[i];
        let routes: Vec<String> = self
            .nodes
            .iter()
            .filter(|n| n.name != node.name)
            .map(|n| format!("nats://127.0.0.1:{}", n.cluster_port))
            .collect();
        let store = self.dir.join(&node.name);
        std::fs::create_dir_all(&store).map_err(|e| e.to_string())?;
        let child = Command::new("nats-server")
            .args([
                "-n",
                &node.name,
                "-a",
                "127.0.0.1",
                "-p",
                &node.port.to_string(),
            ])
            .args(["-js", "-sd"])
            .arg(&store)
            .args(["--cluster_name", "idem-chaos"])
            .arg("--cluster")
            .arg(format!("nats://127.0.0.1:{}", node.cluster_port))
            .arg("--routes")
            .arg(routes.join(","))
            .stdout(Stdio::null())
            .stderr(log_file(&self.dir.join(format!("{}.log", node.name))))
            .kill_on_drop(true)
            .spawn()
            .map_err(|e| format!("cannot start nats-server: {e}"))?;
        *node.child.lock().await = Some(child);
        let port = node.port;
        until(Duration::from_secs(30), "a JetStream node", || {
            tcp_open(port)
        })
        .await
    }

    pub async fn kill(&self, i: usize) {
        if let Some(mut child) = self.nodes[i].child.lock().await.take() {
            drop(child.kill().await);
        }
    }
}
