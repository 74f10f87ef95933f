//! Where the bench connects and what it calls its tables, fixed once per run.
//!
//! The servers come from the variables the tests read (`IDEM_POSTGRES_URL`, `IDEM_MYSQL_URL`),
//! so that the bench can point at the same servers as `cargo test`. The tables carry a suffix
//! of this process's id: two runs at once against the same server (two worktrees, say) would
//! otherwise drop and fill each other's tables in the middle of a measurement.

use std::sync::OnceLock;

const PG_DEFAULT: &str = "postgres://postgres@127.0.0.1:5432/test";
const MY_DEFAULT: &str = "mysql://root@127.0.0.1:3306/test";

pub(crate) struct Config {
    /// What every table's name ends with: `p` and this process's id.
    pub(crate) suffix: String,
    pub(crate) pg_url: String,
    pub(crate) my_url: String,
    pub(crate) accounts: String,
    /// The macro's marker table.
    pub(crate) markers: String,
    /// The hand-written claim's marker table.
    pub(crate) hand: String,
    pub(crate) pgbench: String,
    /// The growth measurement's tables, for 0, 1M and 10M markers.
    pub(crate) growth: [String; 3],
    /// `--http`: its accounts, and the layer's and the hand-written claim's markers.
    pub(crate) http_accounts: String,
    pub(crate) http_layer: String,
    pub(crate) http_hand: String,
    /// `IDEM_BENCH_HAND_COMMIT=verified`: the hand-written claim on PostgreSQL and MariaDB
    /// commits with idem's verified commit message instead of a plain `COMMIT`, to show what
    /// that message costs.
    pub(crate) hand_commit_verified: bool,
    /// `IDEM_BENCH_HAND_CLAIM=idem`: PostgreSQL's hand-written claim runs idem's claim
    /// statement instead of its plain `INSERT`, to show what that statement costs.
    pub(crate) hand_claim_idem: bool,
    /// `IDEM_BENCH_DUPLICATE=handwritten`: the `duplicate` rows redeliver the hand-written
    /// claim's keys to it instead of the macro's to the macro, to show what a duplicate costs
    /// against a fresh job without idem.
    pub(crate) duplicate_of_hand: bool,
    /// `--scale --galera`: the scaling curve on a three-node Galera cluster the bench starts,
    /// instead of the curve on the local servers.
    pub(crate) galera: bool,
}

impl Config {
    fn from_env() -> Config {
        let url = |var: &str, default: &str| {
            std::env::var(var)
                .ok()
                .filter(|u| !u.is_empty())
                .unwrap_or_else(|| default.to_owned())
        };
        // `_p` and at most 7 digits (Linux's largest pid is 4194304): the longest name,
        // `idem_bench_growth_10m_p4194304`, stays within idem's MAX_TABLE_LEN (47).
        // `--scale`'s worker processes use their parent's tables: it passes its suffix on.
        let suffix = std::env::var("IDEM_BENCH_SUFFIX")
            .ok()
            .filter(|s| s.len() <= 8 && s.bytes().all(|b| b.is_ascii_alphanumeric()))
            .unwrap_or_else(|| format!("p{}", std::process::id()));
        let name = |base: &str| format!("idem_bench_{base}_{suffix}");
        Config {
            suffix: suffix.clone(),
            pg_url: PG_URL
                .get()
                .cloned()
                .unwrap_or_else(|| url("IDEM_POSTGRES_URL", PG_DEFAULT)),
            my_url: url("IDEM_MYSQL_URL", MY_DEFAULT),
            accounts: name("accounts"),
            markers: name("markers"),
            hand: name("hand"),
            pgbench: name("pgbench"),
            growth: [name("growth_0"), name("growth_1m"), name("growth_10m")],
            http_accounts: name("http_accounts"),
            http_layer: name("http_layer"),
            http_hand: name("http_hand"),
            hand_commit_verified: std::env::var("IDEM_BENCH_HAND_COMMIT")
                .is_ok_and(|v| v == "verified"),
            hand_claim_idem: std::env::var("IDEM_BENCH_HAND_CLAIM").is_ok_and(|v| v == "idem"),
            duplicate_of_hand: std::env::var("IDEM_BENCH_DUPLICATE")
                .is_ok_and(|v| v == "handwritten"),
            galera: std::env::args().any(|a| a == "--galera"),
        }
    }

    /// Every table of this run, for `DROP TABLE IF EXISTS` at the start and at the end.
    pub(crate) fn all_tables(&self) -> String {
        [&self.accounts, &self.markers, &self.hand, &self.pgbench]
            .into_iter()
            .chain(&self.growth)
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// A PostgreSQL of the bench's own (`--group --standby`'s primary), in place of
/// `IDEM_POSTGRES_URL`.
static PG_URL: OnceLock<String> = OnceLock::new();
static CONFIG: OnceLock<Config> = OnceLock::new();

/// Points this run's PostgreSQL rows at `url`; the configuration must not have been read yet.
pub(crate) fn use_postgres(url: String) {
    assert!(
        CONFIG.get().is_none() && PG_URL.set(url).is_ok(),
        "the bench's PostgreSQL is set once, before the configuration is read"
    );
}

/// This run's configuration, read from the environment on first use.
pub(crate) fn config() -> &'static Config {
    CONFIG.get_or_init(Config::from_env)
}
