//! A three-node MariaDB Galera cluster of the test's own: `mariadbd` as user `mysql` with
//! Debian's `galera-4` provider, each node with a data directory, a client port, a group
//! communication port, an IST port and an SST port of its own, in one temporary directory.
//! The first node bootstraps the cluster (`--wsrep-new-cluster`, its data directory made by
//! `mariadb-install-db`); the others start empty and receive a full state transfer (SST, by
//! rsync) from it. A node can be killed (SIGKILL), isolated from the others and started again.
//! Dropped, the cluster kills what runs and removes the directory.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use sqlx::mysql::{MySqlConnectOptions, MySqlConnection};
use sqlx::{AssertSqlSafe, Connection as _};
use tokio::process::{Child, Command};

use crate::bouncer::free_port;

/// Where Debian's `galera-4` puts the provider.
pub const PROVIDER: &str = "/usr/lib/galera/libgalera_smm.so";

/// The number of nodes.
pub const NODES: usize = 3;

/// The database the tests use on the cluster.
const DATABASE: &str = "test";

/// How long a node may take to come up, or to join and sync (a full state transfer included).
const JOIN_WITHIN: Duration = Duration::from_secs(120);

/// One node's ports and its server process, if it runs.
struct Node {
    port: u16,
    group_port: u16,
    ist_port: u16,
    sst_port: u16,
    child: Option<Child>,
}

/// A running three-node cluster.
pub struct Cluster {
    root: PathBuf,
    nodes: Vec<Node>,
}

impl Cluster {
    /// Makes the nodes' directories, bootstraps the cluster on node 0, starts nodes 1 and 2,
    /// and waits until every node is synced in a cluster of three. Panics with what failed
    /// (and the node's error log): the tests never skip.
    pub async fn start() -> Cluster {
        assert!(
            Path::new(PROVIDER).exists(),
            "the Galera provider {PROVIDER} is missing: install Debian's `galera-4` package \
             (.ci/run does)"
        );
        assert!(
            on_path("rsync"),
            "rsync is missing: the nodes' state transfers (wsrep_sst_method = rsync) need it"
        );
        let root = std::env::temp_dir().join(format!(
            "idem-galera-{}-{}",
            std::process::id(),
            free_port()
        ));
        let nodes = (0..NODES)
            .map(|_| Node {
                port: free_port(),
                group_port: free_port(),
                ist_port: free_port(),
                sst_port: free_port(),
                child: None,
            })
            .collect();
        let mut cluster = Cluster { root, nodes };
        for i in 0..NODES {
            std::fs::create_dir_all(cluster.data(i)).expect("a directory for a node");
        }
        let chown = std::process::Command::new("chown")
            .args(["-R", "mysql"])
            .arg(&cluster.root)
            .status()
            .expect("chown");
        assert!(chown.success(), "chown mysql {}", cluster.root.display());
        let install = std::process::Command::new("mariadb-install-db")
            .arg("--no-defaults")
            .arg("--user=mysql")
            .arg(format!("--datadir={}", cluster.data(0).display()))
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
            .output()
            .expect("cannot run mariadb-install-db: install MariaDB's server");
        assert!(
            install.status.success(),
            "mariadb-install-db failed: {}{}",
            String::from_utf8_lossy(&install.stdout),
            String::from_utf8_lossy(&install.stderr)
        );
        cluster.spawn(0, true);
        cluster.wait_synced(0, 1).await;
        // Made before the others join: they receive it with the state transfer.
        let mut conn = cluster.connect(0).await.expect("connect to node 0");
        sqlx::raw_sql(AssertSqlSafe(format!(
            "CREATE DATABASE IF NOT EXISTS {DATABASE}"
        )))
        .execute(&mut conn)
        .await
        .expect("create the test database");
        drop(conn.close().await);
        for i in 1..NODES {
            cluster.spawn(i, false);
        }
        for i in 0..NODES {
            cluster.wait_synced(i, NODES).await;
        }
        cluster
    }

    /// The URL of the test database on node `i`.
    pub fn url(&self, i: usize) -> String {
        format!("mysql://root@127.0.0.1:{}/{DATABASE}", self.nodes[i].port)
    }

    /// The process ids of the nodes' servers that run: what a measurement reads their CPU
    /// time by (`/proc/PID/stat`), apart from any other `mariadbd` on the machine.
    pub fn pids(&self) -> Vec<u32> {
        self.nodes
            .iter()
            .filter_map(|n| n.child.as_ref()?.id())
            .collect()
    }

    /// SIGKILL of node `i`: it dies with whatever it had in flight.
    pub async fn kill(&mut self, i: usize) {
        let mut child = self.nodes[i].child.take().expect("the node runs");
        child.start_kill().expect("SIGKILL the node");
        child.wait().await.expect("wait for the killed node");
    }

    /// Starts node `i` again (crash recovery, then an incremental state transfer from another
    /// node, or a full one) and waits until it is synced in a cluster of three. Returns its
    /// log's line about the transfer (`Receiving IST... 100.0% (n/n events) complete.`), or
    /// its lines about a full one.
    pub async fn restart(&mut self, i: usize) -> String {
        let before = self.log(i).len();
        self.spawn(i, false);
        for j in 0..NODES {
            self.wait_synced(j, NODES).await;
        }
        let log = self.log(i);
        let new = log.get(before..).unwrap_or_default();
        let ist = new
            .lines()
            .rfind(|l| l.contains("Receiving IST") && l.contains("complete"));
        match ist {
            Some(line) => line.split("WSREP: ").last().unwrap_or(line).to_owned(),
            None => new
                .lines()
                .filter(|l| l.contains("SST"))
                .collect::<Vec<_>>()
                .join("\n"),
        }
    }

    /// Cuts node `i` off from the others (`gmcast.isolate`): it stays up, but out of the
    /// primary component, and waits until it says so (`wsrep_ready` off).
    pub async fn isolate(&self, i: usize) {
        self.set_isolated(i, true).await;
        let deadline = Instant::now() + JOIN_WITHIN;
        loop {
            let status = self.status(i).await;
            if status.get("wsrep_ready").map(String::as_str) == Some("OFF") {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node {i} still ready {JOIN_WITHIN:?} after its isolation: {status:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends `gmcast.isolate`, without waiting for the cluster to notice.
    pub async fn set_isolated(&self, i: usize, isolated: bool) {
        let mut conn = self.connect(i).await.expect("connect to the node");
        let set = format!(
            "SET GLOBAL wsrep_provider_options = 'gmcast.isolate={}'",
            u8::from(isolated)
        );
        sqlx::raw_sql(AssertSqlSafe(set))
            .execute(&mut conn)
            .await
            .expect("gmcast.isolate");
        drop(conn.close().await);
    }

    /// Lets an isolated node `i` join again, and waits until every node is synced in a
    /// cluster of three.
    pub async fn rejoin(&self, i: usize) {
        self.set_isolated(i, false).await;
        for j in 0..NODES {
            self.wait_synced(j, NODES).await;
        }
    }

    /// Node `i`'s `wsrep_%` status variables (empty if it cannot be reached).
    pub async fn status(&self, i: usize) -> HashMap<String, String> {
        let Ok(mut conn) = self.connect(i).await else {
            return HashMap::new();
        };
        let rows: Vec<(String, String)> = sqlx::query_as("SHOW GLOBAL STATUS LIKE 'wsrep_%'")
            .fetch_all(&mut conn)
            .await
            .unwrap_or_default();
        drop(conn.close().await);
        rows.into_iter().collect()
    }

    /// The sum over the nodes of a numeric `wsrep_%` status variable.
    pub async fn total(&self, variable: &str) -> u64 {
        let mut sum = 0;
        for i in 0..NODES {
            let status = self.status(i).await;
            let value = status.get(variable).unwrap_or_else(|| {
                panic!("node {i} has no status {variable} (is it up?): {status:?}")
            });
            sum += value.parse::<u64>().expect("a number");
        }
        sum
    }

    /// Node `i`'s error log, for a failure's message.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(self.root.join(format!("node{i}.err"))).unwrap_or_default()
    }

    fn data(&self, i: usize) -> PathBuf {
        self.root.join(format!("node{i}"))
    }

    async fn connect(&self, i: usize) -> Result<MySqlConnection, sqlx::Error> {
        let options = MySqlConnectOptions::new()
            .host("127.0.0.1")
            .port(self.nodes[i].port)
            .username("root");
        MySqlConnection::connect_with(&options).await
    }

    /// Polls node `i` until it runs, is synced and ready, and sees a cluster of `size`: a
    /// server's readiness, not a test's timing.
    async fn wait_synced(&self, i: usize, size: usize) {
        let deadline = Instant::now() + JOIN_WITHIN;
        let size = size.to_string();
        loop {
            let status = self.status(i).await;
            let is = |name: &str, value: &str| status.get(name).map(String::as_str) == Some(value);
            if is("wsrep_ready", "ON")
                && is("wsrep_local_state_comment", "Synced")
                && is("wsrep_cluster_size", &size)
                && is("wsrep_cluster_status", "Primary")
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "node {i} not synced in a cluster of {size} within {JOIN_WITHIN:?}: {status:?}; \
                 its log:\n{}",
                tail(&self.log(i))
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Starts node `i`'s server (`mariadbd` drops to user `mysql` itself, so that the child is
    /// the server and a SIGKILL reaches it).
    fn spawn(&mut self, i: usize, bootstrap: bool) {
        let group: Vec<String> = self
            .nodes
            .iter()
            .map(|n| format!("127.0.0.1:{}", n.group_port))
            .collect();
        let node = &self.nodes[i];
        // A node that died is noticed by the others after `evs.suspect_timeout` (5 s by
        // default), while their commits wait: 3 s keeps the kill short and still clear of a
        // busy machine's pauses. gcache holds the writes a killed node misses, for IST.
        let provider_options = format!(
            "gmcast.listen_addr=tcp://127.0.0.1:{};ist.recv_addr=127.0.0.1:{};\
             gcache.size=64M;evs.suspect_timeout=PT3S",
            node.group_port, node.ist_port
        );
        let root = &self.root;
        let mut cmd = Command::new("mariadbd");
        cmd.arg("--no-defaults")
            .arg("--user=mysql")
            .arg(format!("--datadir={}", self.data(i).display()))
            .arg(format!("--port={}", node.port))
            .arg("--bind-address=127.0.0.1")
            .arg(format!("--socket={}/node{i}.sock", root.display()))
            .arg(format!("--pid-file={}/node{i}.pid", root.display()))
            .arg(format!("--log-error={}/node{i}.err", root.display()))
            .args([
                "--innodb-buffer-pool-size=64M",
                "--performance-schema=OFF",
                "--max-connections=300",
                // Each node's log is not what keeps a commit: the cluster is (a commit is
                // certified and replicated to the others before it returns).
                "--innodb-flush-log-at-trx-commit=0",
                "--binlog-format=ROW",
                "--innodb-autoinc-lock-mode=2",
                "--default-storage-engine=InnoDB",
                "--wsrep-on=ON",
                "--wsrep-cluster-name=idem-test",
                "--wsrep-sst-method=rsync",
            ])
            .arg(format!("--wsrep-provider={PROVIDER}"))
            .arg(format!("--wsrep-node-name=node{i}"))
            .arg(format!(
                "--wsrep-node-address=127.0.0.1:{}",
                node.group_port
            ))
            .arg(format!(
                "--wsrep-cluster-address=gcomm://{}",
                group.join(",")
            ))
            .arg(format!("--wsrep-provider-options={provider_options}"))
            .arg(format!(
                "--wsrep-sst-receive-address=127.0.0.1:{}",
                node.sst_port
            ));
        if bootstrap {
            cmd.arg("--wsrep-new-cluster");
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start mariadbd: {e}"));
        self.nodes[i].child = Some(child);
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(child) = node.child.as_mut() {
                drop(child.start_kill());
            }
        }
        // Waits for the servers to die before their directory goes.
        let deadline = Instant::now() + Duration::from_secs(10);
        for node in &mut self.nodes {
            if let Some(child) = node.child.as_mut() {
                while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
        drop(std::fs::remove_dir_all(&self.root));
    }
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .into_iter()
        .flat_map(|path| std::env::split_paths(&path).collect::<Vec<_>>())
        .any(|dir| dir.join(program).exists())
}

/// The last lines of a log.
fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}
