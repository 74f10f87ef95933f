//! `--group --standby`: the group rows where a commit costs what it costs in production, on a
//! PostgreSQL primary of the bench's own whose synchronous standby streams through a delaying
//! proxy (`idem_scale::delay`), at 0, 0.5, 1 and 2 ms each way. A commit returns once the
//! standby has flushed it: a round trip to the standby, as in another zone.
//!
//! At each delay: the proxy's own round trip measured (how exact the delay is), the rows of
//! `group.rs` (hand-written, macro, group commit with 1, 2 and 4 lanes, batches of 100; 1, 8
//! and 32 workers) and pgbench on each group design's statements (`group_floor.rs`), on the
//! same servers. Then the targets' ratios, and a plot of jobs/s against the delay.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use idem_scale::delay::DelayProxy;
use idem_scale::standby::Pair;

use crate::group::{MEDIANS, Rows};
use crate::report::median;
use crate::variants::Kind;
use crate::{Res, config, group, group_floor};

/// The delays each way, in microseconds.
const DELAYS_US: [u64; 4] = [0, 500, 1000, 2000];

/// Runs every delay; the Markdown report. The plot goes to `plot`.
pub(crate) async fn run(rounds: usize, dur: Duration, plot: &Path) -> Res<String> {
    eprintln!("starting a primary and a synchronous standby behind a delaying proxy");
    let pair = Pair::start_delayed(Duration::ZERO).await;
    let url = Pair::url(pair.primary_port);
    config::use_postgres(url.clone());
    let admin = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&url)
        .await?;
    pair.wait_for_standby(&admin, "sync").await;
    admin.close().await;
    let rows = Rows {
        lanes: vec![1, 2, 4],
        by_account: Vec::new(),
        batch: Some(100),
        each: false,
    };
    let mut out = format!(
        "## Group commit with a synchronous standby (PostgreSQL, {rounds} rounds of {} ms, \
         medians)\n\n\
         | delay each way ms | proxy round trip p50 / p99 ms | over two delays p50 ms |\n\
         |---:|---:|---:|\n",
        dur.as_millis()
    );
    let mut sections = String::new();
    let mut curve: Vec<(f64, usize, String, f64)> = Vec::new();
    for us in DELAYS_US {
        let delay = Duration::from_micros(us);
        pair.set_delay(delay);
        let ms = us as f64 / 1e3;
        let trips = DelayProxy::round_trip(delay, 500);
        let at = |q: f64| trips[((trips.len() - 1) as f64 * q) as usize].as_secs_f64() * 1e3;
        writeln!(
            out,
            "| {ms} | {:.3} / {:.3} | {:.3} |",
            at(0.5),
            at(0.99),
            at(0.5) - 2.0 * ms
        )?;
        eprintln!("delay {ms} ms each way: round trip {:.3} ms", at(0.5));
        MEDIANS.lock().expect("not poisoned").clear();
        let rows_report =
            group::bench_with(Some(Kind::Postgres), rounds, dur, false, &rows).await?;
        curve.extend(
            MEDIANS
                .lock()
                .expect("not poisoned")
                .drain(..)
                .map(|(w, v, r)| (ms, w, v, r)),
        );
        let floor = group_floor::run(rounds, dur).await?;
        writeln!(
            sections,
            "\n### {ms} ms each way\n{rows_report}\n{}",
            floor.replacen("## ", "#### ", 1)
        )?;
    }
    out.push_str(&targets(&curve));
    out.push_str(&sections);
    match draw(plot, &curve) {
        Ok(()) => eprintln!("plot: {}", plot.display()),
        Err(e) => eprintln!("no plot: {e}"),
    }
    Ok(out)
}

/// The median rate of `variant` at `workers` and `ms`.
fn rate(curve: &[(f64, usize, String, f64)], ms: f64, workers: usize, variant: &str) -> f64 {
    let rates: Vec<f64> = curve
        .iter()
        .filter(|(d, w, v, _)| *d == ms && *w == workers && v == variant)
        .map(|c| c.3)
        .collect();
    median(&rates)
}

/// The ratios the targets name: the best group (of its lanes) over the macro and over the
/// hand-written code, at each delay and worker count.
fn targets(curve: &[(f64, usize, String, f64)]) -> String {
    let mut out = String::from(
        "\n| delay each way ms | workers | best group | group / macro | group / handwritten \
         | batch of 100 / macro |\n|---:|---:|---|---:|---:|---:|\n",
    );
    for us in DELAYS_US {
        let ms = us as f64 / 1e3;
        for workers in [1, 8, 32] {
            let (best, rate_g) = [1, 2, 4]
                .iter()
                .map(|l| {
                    let name = format!("group, {l} lanes");
                    let r = rate(curve, ms, workers, &name);
                    (name, r)
                })
                .fold((String::new(), 0.0), |a, b| if b.1 > a.1 { b } else { a });
            let (m, h, b) = (
                rate(curve, ms, workers, "macro"),
                rate(curve, ms, workers, "handwritten"),
                rate(curve, ms, workers, "batch of 100"),
            );
            let _ = writeln!(
                out,
                "| {ms} | {workers} | {best} | {:.2} | {:.2} | {:.2} |",
                rate_g / m,
                rate_g / h,
                b / m
            );
        }
    }
    out
}

/// jobs/s against the delay each way, one panel per worker count, one line per variant.
fn draw(path: &Path, curve: &[(f64, usize, String, f64)]) -> Res<()> {
    use plotters::prelude::*;

    crate::plot::register_font()?;
    let (width, height) = (1500_u32, 520_u32);
    let mut buf = vec![255_u8; (width * height * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (width, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let (title, body) = root.split_vertically(40);
        title.draw(&Text::new(
            "idem on PostgreSQL with a synchronous standby: jobs/s by the delay each way",
            (20, 10),
            ("sans-serif", 22).into_font(),
        ))?;
        let styles: [(&str, RGBColor); 6] = [
            ("handwritten", RGBColor(31, 119, 180)),
            ("macro", RGBColor(214, 39, 40)),
            ("group, 1 lanes", RGBColor(44, 160, 44)),
            ("group, 2 lanes", RGBColor(148, 103, 189)),
            ("group, 4 lanes", RGBColor(140, 86, 75)),
            ("batch of 100", RGBColor(255, 127, 14)),
        ];
        for (panel, workers) in body.split_evenly((1, 3)).iter().zip([1, 8, 32]) {
            let ymax = curve
                .iter()
                .filter(|c| c.1 == workers)
                .map(|c| c.3)
                .fold(1.0, f64::max)
                * 1.1;
            let mut chart = ChartBuilder::on(panel)
                .caption(format!("{workers} workers"), ("sans-serif", 20))
                .margin(15)
                .x_label_area_size(45)
                .y_label_area_size(70)
                .build_cartesian_2d(-0.1_f64..2.1_f64, (1.0..ymax).log_scale())?;
            chart
                .configure_mesh()
                .light_line_style(WHITE)
                .x_desc("delay each way, ms")
                .y_desc("jobs/s (log scale)")
                .y_label_formatter(&|y| format!("{y:.0}"))
                .label_style(("sans-serif", 14))
                .draw()?;
            for (variant, color) in styles {
                let points: Vec<(f64, f64)> = DELAYS_US
                    .iter()
                    .map(|&us| us as f64 / 1e3)
                    .map(|ms| (ms, rate(curve, ms, workers, variant)))
                    .filter(|p| p.1 > 0.0)
                    .collect();
                chart
                    .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
                    .label(variant)
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 22, y)], color.stroke_width(3))
                    });
                chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::LowerLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 13))
                .draw()?;
        }
        root.present()?;
    }
    crate::plot::save_png(path, &buf, (width, height))
}
