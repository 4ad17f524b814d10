//! Line charts for `flint bench throughput --sweep`, drawn with `plotters` as SVG.
//!
//! SVG, not PNG: plotters' SVG backend writes text as `<text>` elements for the viewer to set, so it
//! needs no font file, no rasteriser and no image encoder (three small crates in all, no system font
//! lookup). A PNG would need the bitmap backend, an image encoder and a committed TTF for the text.

use anyhow::{anyhow, Result};
use plotters::coord::ranged1d::{DefaultFormatting, KeyPointHint, Ranged};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;

/// One line on the chart.
pub struct Series {
    pub label: String,
    pub points: Vec<(f64, f64)>,
}

/// A line chart; `log2_x` puts x on a log2 scale with ticks at the data x values.
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log2_x: bool,
    pub series: Vec<Series>,
}

const SIZE: (u32, u32) = (800, 500);
const FONT: &str = "sans-serif";
/// Matplotlib's "tab10" colours.
const PALETTE: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Render `chart` as an 800x500 SVG document.
pub fn render_svg(chart: &Chart) -> Result<String> {
    let mut svg = String::new();
    draw(chart, SVGBackend::with_string(&mut svg, SIZE).into_drawing_area())
        .map_err(|e| anyhow!("drawing the chart: {e}"))?;
    Ok(svg)
}

/// Points with non-finite (or absurdly large) coordinates, or x <= 0 on a log2 axis, are skipped.
fn valid(p: &(f64, f64), log2_x: bool) -> bool {
    let ok = |v: f64| v.is_finite() && v.abs() < 1e12;
    ok(p.0) && ok(p.1) && (!log2_x || p.0 > 0.0)
}

/// `lo..hi` widened by `pad` of its span each side, or by 1 each side when it is empty.
fn padded((lo, hi): (f64, f64), pad: f64) -> (f64, f64) {
    if hi - lo < 1e-9 {
        (lo - 1.0, hi + 1.0)
    } else {
        (lo - (hi - lo) * pad, hi + (hi - lo) * pad)
    }
}

/// A linear f64 axis with ticks at `ticks` if given, else where plotters puts them.
struct XAxis {
    inner: RangedCoordf64,
    ticks: Option<Vec<f64>>,
}

impl Ranged for XAxis {
    type FormatOption = DefaultFormatting;
    type ValueType = f64;
    fn map(&self, v: &f64, limit: (i32, i32)) -> i32 {
        self.inner.map(v, limit)
    }
    fn key_points<H: KeyPointHint>(&self, hint: H) -> Vec<f64> {
        self.ticks.clone().unwrap_or_else(|| self.inner.key_points(hint))
    }
    fn range(&self) -> std::ops::Range<f64> {
        self.inner.range()
    }
}

/// A tick label: at most three decimals, trailing zeros dropped.
fn num(v: f64) -> String {
    let s = format!("{:.3}", if v.abs() < 1e-9 { 0.0 } else { v });
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

fn draw(
    chart: &Chart,
    root: DrawingArea<SVGBackend, plotters::coord::Shift>,
) -> Result<(), Box<dyn std::error::Error>> {
    root.fill(&WHITE)?;
    let root = root.titled(&chart.title, (FONT, 24))?;

    // The legend goes in rows above the plot, so it never hides a line.
    let font: TextStyle = (FONT, 18).into();
    let mut entries = Vec::new();
    let (mut x, mut y) = (70, 0);
    for (i, s) in chart.series.iter().enumerate() {
        let w = 40 + root.estimate_text_size(&s.label, &font)?.0 as i32;
        if x + w > SIZE.0 as i32 - 20 && x > 70 {
            (x, y) = (70, y + 22);
        }
        entries.push((i, s, (x, y)));
        x += w + 20;
    }
    let (legend, area) = root.split_vertically(if entries.is_empty() { 0 } else { y + 30 });
    for (i, s, (x, y)) in entries {
        let colour = PALETTE[i % PALETTE.len()];
        legend.draw(&PathElement::new([(x, y + 9), (x + 30, y + 9)], colour.stroke_width(2)))?;
        legend.draw(&Circle::new((x + 15, y + 9), 3, colour.filled()))?;
        legend.draw(&Text::new(s.label.as_str(), (x + 38, y), font.clone()))?;
    }

    // x is plotted as log2(x) on a log2 axis, and the tick labels map back.
    let log2 = chart.log2_x;
    let fx = move |x: f64| if log2 { x.log2() } else { x };
    let lines: Vec<Vec<(f64, f64)>> = chart
        .series
        .iter()
        .map(|s| s.points.iter().filter(|p| valid(p, log2)).map(|&(x, y)| (fx(x), y)).collect())
        .collect();
    let all = || lines.iter().flatten();
    let xs = all().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    let xs = if xs.0 > xs.1 { (0.0, 1.0) } else { xs };
    let ys = all().fold((0.0f64, 0.0f64), |(a, b), p| (a.min(p.1), b.max(p.1)));
    let (x0, x1) = padded(xs, 0.05);
    let (y0, y1) = if ys.1 - ys.0 < 1e-9 { (ys.0, ys.0 + 1.0) } else { (ys.0, ys.1 + (ys.1 - ys.0) * 0.1) };
    let mut ticks: Vec<f64> = all().map(|p| p.0).collect();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    let x_axis = XAxis { inner: (x0..x1).into(), ticks: (log2 && !ticks.is_empty()).then_some(ticks) };
    let x_fmt = |x: &f64| num(if log2 { x.exp2() } else { *x });

    let mut ctx = ChartBuilder::on(&area)
        .margin(10)
        .margin_right(30)
        .x_label_area_size(50)
        .y_label_area_size(80)
        .build_cartesian_2d(x_axis, y0..y1)?;
    ctx.configure_mesh()
        .disable_x_mesh()
        .light_line_style(TRANSPARENT)
        .bold_line_style(RGBColor(225, 225, 225))
        .x_desc(&chart.x_label)
        .y_desc(&chart.y_label)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&|y| num(*y))
        .label_style((FONT, 16))
        .axis_desc_style((FONT, 18))
        .draw()?;
    for (i, pts) in lines.into_iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        ctx.draw_series(LineSeries::new(pts, colour.filled().stroke_width(2)).point_size(3))?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Chart {
        let pts = |k: f64| [1.0, 2.0, 4.0, 8.0, 16.0, 32.0].iter().map(|&c: &f64| (c, k * c.sqrt())).collect();
        Chart {
            title: "Throughput vs concurrency".into(),
            x_label: "concurrency (log2)".into(),
            y_label: "tokens/s".into(),
            log2_x: true,
            series: vec![
                Series { label: "decode".into(), points: pts(100.0) },
                Series { label: "prefill+decode".into(), points: pts(400.0) },
            ],
        }
    }

    /// The SVG has the title, axis labels, both legend entries, the log2 ticks and one polyline per series.
    #[test]
    fn renders_two_series_as_svg() {
        let svg = render_svg(&sample()).unwrap();
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{svg}");
        assert!(svg.contains(r#"width="800" height="500""#), "{svg}");
        let texts: Vec<&str> = svg.split("</text>").filter_map(|t| Some(t.rsplit_once('>')?.1.trim())).collect();
        for text in ["Throughput vs concurrency", "concurrency (log2)", "tokens/s", "decode", "prefill+decode"] {
            assert!(texts.contains(&text), "no {text:?} in {texts:?}");
        }
        let at = |t: &str| texts.iter().position(|s| *s == t).unwrap_or_else(|| panic!("no tick {t:?} in {texts:?}"));
        let ticks: Vec<usize> = ["1", "2", "4", "8", "16", "32"].iter().map(|t| at(t)).collect();
        assert!(ticks.windows(2).all(|w| w[0] < w[1]), "x ticks out of order: {texts:?}");
        assert!(!texts.iter().any(|t| t.contains(".0")), "tick labels with a .0: {texts:?}");
        let lines: Vec<&str> = svg.split("<polyline").skip(1).collect();
        assert!(lines.len() >= 2, "{svg}");
        for (colour, l) in [("#1F77B4", lines[lines.len() - 2]), ("#FF7F0E", lines[lines.len() - 1])] {
            assert!(l.contains(colour), "{l}");
            let pts = l.split("points=\"").nth(1).unwrap().split('"').next().unwrap();
            assert_eq!(pts.split_whitespace().count(), 6, "{l}");
        }
    }

    /// Nothing to plot (no series, or only unplottable points) still gives a chart, not an error.
    #[test]
    fn renders_degenerate_charts() {
        let mut c = sample();
        c.series[0].points = vec![(0.0, 1.0), (f64::NAN, 2.0), (4.0, f64::INFINITY)];
        c.series[1].points = vec![(8.0, 5.0)];
        assert!(render_svg(&c).unwrap().contains("\n8\n</text>"));
        c.series.clear();
        c.log2_x = false;
        assert!(render_svg(&c).unwrap().contains("</svg>"));
    }
}
