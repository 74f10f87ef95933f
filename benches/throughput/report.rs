//! The Markdown report on stdout: the tables, the ratios, the targets, and the last line
//! (`ratio macro/handwritten: X.XX`) that scripts read. Only reads the results.

use std::fmt::Write as _;

use crate::batch::{BATCH_WORKERS, BatchResults, BatchVariant, SIZES};
use crate::growth::Growth;
use crate::measure::Results;
use crate::variants::{KINDS, Kind, Variant};
use crate::{Settings, WORKERS};

pub(crate) fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// Nearest-rank percentile of latencies in nanoseconds, in milliseconds.
pub(crate) fn percentile_ms(lat_ns: &[u64], p: f64) -> f64 {
    let mut v = lat_ns.to_vec();
    v.sort_unstable();
    if v.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
    v[rank.clamp(1, v.len()) - 1] as f64 / 1e6
}

pub(crate) fn rate(results: &Results, kind: Kind, workers: usize, v: Variant) -> Option<f64> {
    results.get(&(kind, workers, v)).map(|a| median(&a.rates))
}

pub(crate) fn ratio(
    results: &Results,
    kind: Kind,
    workers: usize,
    a: Variant,
    b: Variant,
) -> Option<f64> {
    Some(rate(results, kind, workers, a)? / rate(results, kind, workers, b)?)
}

/// macro / handwritten round by round (each pair ran back to back): median, min and max.
pub(crate) fn paired(results: &Results, kind: Kind, workers: usize) -> Option<(f64, f64, f64)> {
    let m = &results.get(&(kind, workers, Variant::Macro))?.rates;
    let h = &results.get(&(kind, workers, Variant::Handwritten))?.rates;
    let r: Vec<f64> = m.iter().zip(h).map(|(m, h)| m / h).collect();
    let min = r.iter().copied().fold(f64::INFINITY, f64::min);
    let max = r.iter().copied().fold(0.0, f64::max);
    Some((median(&r), min, max))
}

pub(crate) fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "–".to_owned(), |r| format!("{r:.2}"))
}

pub(crate) fn report(
    set: Settings,
    results: &Results,
    batches: &BatchResults,
    growth: Option<&Growth>,
) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "## Throughput\n\n\
         jobs/s: median of {} runs of {:.1} s each (min–max beside it); latency: p50 and p99 of \
         every job of those runs; client CPU: CPU time of the bench process per job (for SQLite \
         it includes the database engine, which runs in the process). Variants interleaved run \
         by run, every other round in reverse order. Pools: `{}` (`--pool`).\n",
        set.rounds,
        set.run.as_secs_f64(),
        crate::measure::POOL
            .get()
            .map_or("lean", |mode| mode.name())
    );
    out.push_str(
        "| database | workers | variant | jobs/s | min–max | p50 ms | p99 ms | client CPU µs/job |\n\
         |---|---:|---|---:|---:|---:|---:|---:|\n",
    );
    for ((kind, workers, v), agg) in results {
        let min = agg.rates.iter().copied().fold(f64::INFINITY, f64::min);
        let max = agg.rates.iter().copied().fold(0.0, f64::max);
        let cpu = if agg.cpu_per_job_us.is_empty() {
            "–".to_owned()
        } else {
            format!("{:.0}", median(&agg.cpu_per_job_us))
        };
        let _ = writeln!(
            out,
            "| {} | {workers} | {} | {:.0} | {min:.0}–{max:.0} | {:.3} | {:.3} | {cpu} |",
            kind.name(),
            v.name(),
            median(&agg.rates),
            percentile_ms(&agg.lat_ns, 50.0),
            percentile_ms(&agg.lat_ns, 99.0),
        );
    }

    out.push_str(
        "\n## Ratios of the medians\n\n\
         | database | workers | macro / handwritten | same, per round: median (min–max) | \
         handwritten / plain | duplicate / macro | macro / pgbench |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
    );
    for kind in KINDS {
        for workers in WORKERS {
            let r = |a, b| fmt_ratio(ratio(results, kind, workers, a, b));
            let per_round = paired(results, kind, workers).map_or_else(
                || "–".to_owned(),
                |(med, min, max)| format!("{med:.2} ({min:.2}–{max:.2})"),
            );
            let _ = writeln!(
                out,
                "| {} | {workers} | {} | {per_round} | {} | {} | {} |",
                kind.name(),
                r(Variant::Macro, Variant::Handwritten),
                r(Variant::Handwritten, Variant::Plain),
                r(Variant::Duplicate, Variant::Macro),
                r(Variant::Macro, Variant::Pgbench),
            );
        }
    }

    if let Some(g) = growth {
        out.push_str(
            "\n## Growth (PostgreSQL, 1 worker, fresh random keys, tables interleaved)\n\n\
             | markers in the table | claim p50 ms | claim p99 ms | job p50 ms | job p99 ms | \
             claim p50 / empty table |\n|---:|---:|---:|---:|---:|---:|\n",
        );
        let base = percentile_ms(&g.claims[0].1, 50.0);
        for (n, claim, job) in &g.claims {
            let p50 = percentile_ms(claim, 50.0);
            let _ = writeln!(
                out,
                "| {n} | {p50:.3} | {:.3} | {:.3} | {:.3} | {:.2} |",
                percentile_ms(claim, 99.0),
                percentile_ms(job, 50.0),
                percentile_ms(job, 99.0),
                p50 / base
            );
        }
        out.push_str(
            "\n| `Store::purge` on a table of | rows deleted | seconds | rows/s |\n\
             |---:|---:|---:|---:|\n",
        );
        for (n, deleted, secs) in &g.purges {
            let _ = writeln!(
                out,
                "| {n} | {deleted} | {secs:.1} | {:.0} |",
                *deleted as f64 / secs
            );
        }
    }

    batch_tables(&mut out, batches);

    out.push_str("\n## Targets\n\n| target | measured | met |\n|---|---|---|\n");
    let mut target = |name: &str, values: Vec<(String, Option<f64>)>, ok: &dyn Fn(f64) -> bool| {
        let measured: Vec<String> = values
            .iter()
            .map(|(label, v)| format!("{label} {}", fmt_ratio(*v)))
            .collect();
        let met = values.iter().all(|(_, v)| v.is_some_and(ok));
        let _ = writeln!(
            out,
            "| {name} | {} | {} |",
            measured.join(", "),
            if met { "yes" } else { "**no**" }
        );
    };
    for kind in KINDS {
        target(
            &format!("{}: macro / handwritten ≥ 0.98", kind.name()),
            WORKERS
                .iter()
                .map(|&w| {
                    let r = ratio(results, kind, w, Variant::Macro, Variant::Handwritten);
                    (format!("{w}w"), r)
                })
                .collect(),
            &|r| r >= 0.98,
        );
    }
    for kind in KINDS {
        target(
            &format!("{}: duplicate / macro ≥ 3", kind.name()),
            WORKERS
                .iter()
                .map(|&w| {
                    let r = ratio(results, kind, w, Variant::Duplicate, Variant::Macro);
                    (format!("{w}w"), r)
                })
                .collect(),
            &|r| r >= 3.0,
        );
    }
    target(
        "PostgreSQL: macro / pgbench ≥ 1.0",
        WORKERS
            .iter()
            .map(|&w| {
                let r = ratio(results, Kind::Postgres, w, Variant::Macro, Variant::Pgbench);
                (format!("{w}w"), r)
            })
            .collect(),
        &|r| r >= 1.0,
    );
    target(
        "PostgreSQL: macro batch of 100 / single macro jobs ≥ 10 at 8 workers",
        vec![(
            "8w".to_owned(),
            batch_rate(batches, Kind::Postgres, 8, 100, BatchVariant::Macro)
                .zip(rate(results, Kind::Postgres, 8, Variant::Macro))
                .map(|(b, s)| b / s),
        )],
        &|r| r >= 10.0,
    );
    for kind in KINDS {
        target(
            &format!("{}: macro batch / hand batch ≥ 0.95", kind.name()),
            BATCH_WORKERS
                .iter()
                .flat_map(|&w| SIZES.iter().map(move |&n| (w, n)))
                .map(|(w, n)| {
                    let r = batch_rate(batches, kind, w, n, BatchVariant::Macro)
                        .zip(batch_rate(batches, kind, w, n, BatchVariant::Hand))
                        .map(|(m, h)| m / h);
                    (format!("{w}w×{n}"), r)
                })
                .collect(),
            &|r| r >= 0.95,
        );
    }
    if let Some(g) = growth {
        let at = |i: usize| percentile_ms(&g.claims[i].1, 50.0);
        target(
            "PostgreSQL: claim p50 at 10M markers / at 0 ≤ 1.2",
            vec![("".to_owned(), Some(at(2) / at(0)))],
            &|r| r <= 1.2,
        );
    }

    let _ = writeln!(
        out,
        "\nratio macro/handwritten: {}",
        fmt_ratio(ratio(
            results,
            Kind::Postgres,
            8,
            Variant::Macro,
            Variant::Handwritten
        ))
    );
    out
}

fn batch_rate(
    batches: &BatchResults,
    kind: Kind,
    workers: usize,
    size: usize,
    v: BatchVariant,
) -> Option<f64> {
    batches
        .get(&(kind, workers, size, v))
        .map(|a| median(&a.rates))
}

/// Jobs/s of every batch run, and each size against single jobs and against the hand-written
/// batch.
fn batch_tables(out: &mut String, batches: &BatchResults) {
    if batches.is_empty() {
        return;
    }
    out.push_str(
        "\n## Batches\n\njobs/s (not batches/s): median of the rounds (min–max); latency of a \
         whole batch.\n\n\
         | database | workers | batch | variant | jobs/s | min–max | batch p50 ms | batch p99 ms |\n\
         |---|---:|---:|---|---:|---:|---:|---:|\n",
    );
    for ((kind, workers, size, v), agg) in batches {
        let min = agg.rates.iter().copied().fold(f64::INFINITY, f64::min);
        let max = agg.rates.iter().copied().fold(0.0, f64::max);
        let (p50, p99) = if agg.lat_ns.is_empty() {
            ("–".to_owned(), "–".to_owned())
        } else {
            (
                format!("{:.3}", percentile_ms(&agg.lat_ns, 50.0)),
                format!("{:.3}", percentile_ms(&agg.lat_ns, 99.0)),
            )
        };
        let _ = writeln!(
            out,
            "| {} | {workers} | {size} | {} | {:.0} | {min:.0}–{max:.0} | {p50} | {p99} |",
            kind.name(),
            v.name(),
            median(&agg.rates),
        );
    }
    out.push_str(
        "\n| database | workers | batch | macro / hand batch | macro batch / batch of 1 | \
         macro / pgbench batch |\n|---|---:|---:|---:|---:|---:|\n",
    );
    for kind in KINDS {
        for workers in BATCH_WORKERS {
            for size in SIZES {
                let r = |a, wa, b, wb| {
                    fmt_ratio(
                        batch_rate(batches, kind, workers, wa, a)
                            .zip(batch_rate(batches, kind, workers, wb, b))
                            .map(|(x, y)| x / y),
                    )
                };
                use BatchVariant::{Hand, Macro, Pgbench};
                let _ = writeln!(
                    out,
                    "| {} | {workers} | {size} | {} | {} | {} |",
                    kind.name(),
                    r(Macro, size, Hand, size),
                    r(Macro, size, Macro, 1),
                    r(Macro, size, Pgbench, size),
                );
            }
        }
    }
}
