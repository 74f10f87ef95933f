#!/usr/bin/env bash
# A PostgreSQL primary lost and its streaming replica promoted, under idem's shape of
# transaction (a marker row and an effect row, one transaction), to count the commits the
# primary had confirmed that the promoted replica lacks (docs/reliability.md, "A replica
# promoted after the primary is lost").
#
#   chaos/failover.sh async|sync PRIMARY_PORT REPLICA_PORT
#
# Runs as root (the clusters run as postgres), in /tmp/idem-failover-<mode>. The replica's
# WAL receiver is stopped (SIGSTOP) for the last 2 s before the primary is stopped with
# `pg_ctl -m immediate`, so that an asynchronous replica is behind, as one over a real network
# can be; a synchronous one makes the primary wait instead.
set -euo pipefail
mode="$1" primary="$2" replica="$3"
bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n1)
dir="/tmp/idem-failover-$mode"
as_pg() { runuser -u postgres -- "$@"; }
for d in p r; do as_pg "$bin/pg_ctl" -D "$dir/$d" -m immediate stop >/dev/null 2>&1 || true; done
rm -rf "$dir" && mkdir -p "$dir" && chown postgres "$dir"
as_pg "$bin/initdb" -D "$dir/p" -A trust -U postgres >/dev/null
cat >>"$dir/p/postgresql.conf" <<CONF
wal_level = replica
max_wal_senders = 4
listen_addresses = '127.0.0.1'
port = $primary
unix_socket_directories = '$dir'
CONF
if [ "$mode" = sync ]; then echo "synchronous_standby_names = '*'" >>"$dir/p/postgresql.conf"; fi
echo "host replication postgres 127.0.0.1/32 trust" >>"$dir/p/pg_hba.conf"
as_pg "$bin/pg_ctl" -D "$dir/p" -l "$dir/p.log" -w start >/dev/null
as_pg "$bin/pg_basebackup" -h 127.0.0.1 -p "$primary" -U postgres -D "$dir/r" -R -X stream
echo "port = $replica" >>"$dir/r/postgresql.conf"
as_pg "$bin/pg_ctl" -D "$dir/r" -l "$dir/r.log" -w start >/dev/null
psql -q -h 127.0.0.1 -p "$primary" -U postgres postgres -c "
    CREATE TABLE idem_processed (scope text, key text, state text DEFAULT 'completed',
        PRIMARY KEY (scope, key));
    CREATE TABLE effects (job text NOT NULL);
    CREATE SEQUENCE jobs;"
cat >"$dir/job.sql" <<'SQL'
BEGIN;
SELECT nextval('jobs') AS id \gset
INSERT INTO idem_processed (scope, key) VALUES ('chaos.effect', :id);
INSERT INTO effects (job) VALUES (:id);
COMMIT;
SQL
as_pg bash -c "cd $dir && $bin/pgbench -n -h 127.0.0.1 -p $primary -U postgres -c 8 -T 20 \
    -f $dir/job.sql postgres" >"$dir/bench.out" 2>&1 &
bench=$!
# The schedule of the fault (not a synchronisation): 4 s of load, then the receiver stops.
sleep 4
receiver=$(for pid in $(pgrep -f walreceiver); do
    [ "$(readlink "/proc/$pid/cwd")" = "$dir/r" ] && echo "$pid"; done)
kill -STOP "$receiver"
sleep 2
as_pg "$bin/pg_ctl" -D "$dir/p" -m immediate stop >/dev/null
# Killed, not continued: WAL the primary had written into the socket before it died would
# otherwise still reach the replica, which over a real network it may not.
kill -KILL "$receiver"
as_pg "$bin/pg_ctl" -D "$dir/r" -w promote >/dev/null
wait "$bench" || true
grep "actually processed" "$dir/bench.out"
psql -At -h 127.0.0.1 -p "$replica" -U postgres postgres -c "
    SELECT 'on the promoted replica: ' || (SELECT count(*) FROM idem_processed) || ' markers, '
        || (SELECT count(*) FROM effects) || ' effects, '
        || (SELECT count(*) FROM idem_processed m FULL JOIN effects e ON m.key = e.job
            WHERE m.key IS NULL OR e.job IS NULL) || ' without their pair'"
as_pg "$bin/pg_ctl" -D "$dir/r" -m immediate stop >/dev/null
rm -rf "$dir"
