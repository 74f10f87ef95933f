//! The PNG plot of jobs/s by workers (plotters, no system font library). Optional: a missing
//! font skips it with a message and leaves the report alone.

use std::path::Path;

use crate::measure::Results;
use crate::report::{median, rate};
use crate::variants::{KINDS, Variant};
use crate::{Res, WORKERS};

/// A font for the plot's text: plotters' `ab_glyph` feature needs no system font library, only
/// the bytes of a TrueType font (Debian's fonts-dejavu-core).
pub(crate) fn register_font() -> Res<()> {
    const FONTS: [&str; 2] = [
        "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
        "/usr/share/fonts/TTF/DejaVuSans.ttf",
    ];
    let bytes = FONTS
        .iter()
        .find_map(|p| std::fs::read(p).ok())
        .ok_or("no DejaVuSans.ttf found (apt-get install fonts-dejavu-core)")?;
    plotters::style::register_font(
        "sans-serif",
        plotters::style::FontStyle::Normal,
        Box::leak(bytes.into_boxed_slice()),
    )
    .map_err(|_| "DejaVuSans.ttf is not a usable font")?;
    Ok(())
}

/// jobs/s by workers, one panel per database, one line per variant.
pub(crate) fn draw(path: &Path, results: &Results) -> Res<()> {
    use plotters::prelude::*;

    register_font()?;
    let (width, height) = (1500_u32, 520_u32);
    let mut buf = vec![255_u8; (width * height * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (width, height)).into_drawing_area();
        root.fill(&WHITE)?;
        let (title, body) = root.split_vertically(40);
        title.draw(&Text::new(
            "idem: top-up jobs/s by concurrent workers (median of the runs)",
            (20, 10),
            ("sans-serif", 22).into_font(),
        ))?;
        let styles: [(Variant, RGBColor, bool); 5] = [
            (Variant::Plain, RGBColor(120, 120, 120), false),
            (Variant::Handwritten, RGBColor(31, 119, 180), true),
            (Variant::Macro, RGBColor(214, 39, 40), false),
            (Variant::Duplicate, RGBColor(44, 160, 44), false),
            (Variant::Pgbench, RGBColor(255, 127, 14), false),
        ];
        for (panel, kind) in body.split_evenly((1, 3)).iter().zip(KINDS) {
            let ymax = results
                .iter()
                .filter(|((k, _, _), _)| *k == kind)
                .map(|(_, a)| median(&a.rates))
                .fold(1.0, f64::max)
                * 1.45; // headroom for the legend
            let mut chart = ChartBuilder::on(panel)
                .caption(kind.name(), ("sans-serif", 20))
                .margin(15)
                .x_label_area_size(45)
                .y_label_area_size(70)
                .build_cartesian_2d(-0.4_f64..5.4_f64, 0.0..ymax)?;
            chart
                .configure_mesh()
                .light_line_style(WHITE)
                .x_labels(6)
                .x_label_formatter(&|x| match x.round() as i64 {
                    0 => "1".to_owned(),
                    3 => "8".to_owned(),
                    5 => "32".to_owned(),
                    _ => String::new(),
                })
                .y_label_formatter(&|y| format!("{y:.0}"))
                .x_desc("workers (log scale)")
                .y_desc("jobs/s")
                .label_style(("sans-serif", 14))
                .draw()?;
            for (variant, color, dashed) in styles {
                let points: Vec<(f64, f64)> = WORKERS
                    .iter()
                    .filter_map(|&w| {
                        rate(results, kind, w, variant).map(|r| ((w as f64).log2(), r))
                    })
                    .collect();
                if points.is_empty() {
                    continue;
                }
                let style = color.stroke_width(if dashed { 4 } else { 2 });
                let series = if dashed {
                    chart.draw_series(DashedLineSeries::new(points.clone(), 10, 6, style))?
                } else {
                    chart.draw_series(LineSeries::new(points.clone(), style))?
                };
                series.label(variant.name()).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 22, y)], color.stroke_width(3))
                });
                chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 14))
                .draw()?;
        }
        root.present()?;
    }
    crate::plot::save_png(path, &buf, (width, height))
}

/// Writes an RGB buffer of `size` pixels to `path` as a PNG, making its directory.
pub(crate) fn save_png(path: &Path, buf: &[u8], (width, height): (u32, u32)) -> Res<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    let file = std::io::BufWriter::new(std::fs::File::create(path)?);
    let mut encoder = png::Encoder::new(file, width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.write_header()?.write_image_data(buf)?;
    Ok(())
}
