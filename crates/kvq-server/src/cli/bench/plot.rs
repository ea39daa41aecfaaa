//! The PNG bar charts of `kvq bench` (plotters, with a TrueType font found on the system).

use super::{BenchRow, Stats};
use anyhow::{Context, bail};
use plotters::prelude::*;
use std::path::{Path, PathBuf};

const FONTS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
];

/// `--plot-font`, else the first known system font present.
pub fn find_font(given: Option<&Path>) -> anyhow::Result<PathBuf> {
    if let Some(p) = given {
        return Ok(p.to_path_buf());
    }
    match FONTS.iter().map(PathBuf::from).find(|p| p.is_file()) {
        Some(p) => Ok(p),
        None => bail!(
            "--plot needs a TrueType font: install one (Debian: apt-get install -y \
             fonts-dejavu-core) or pass --plot-font PATH"
        ),
    }
}

/// One bar series: a label, a color and its value per prompt length.
struct Series {
    label: String,
    color: RGBColor,
    pp: Vec<Option<f64>>,
    tg: Vec<Option<f64>>,
}

const COLORS: &[RGBColor] = &[
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];
const LLAMA_COLORS: &[RGBColor] = &[RGBColor(255, 127, 14), RGBColor(214, 39, 40)];

fn series(rows: &[BenchRow], lengths: &[usize]) -> Vec<Series> {
    // One kvq series per (method, threads), then one llama.cpp series per thread count.
    let mut keys: Vec<(&str, usize)> = Vec::new();
    for r in rows {
        if !keys.contains(&(r.method.as_str(), r.threads)) {
            keys.push((&r.method, r.threads));
        }
    }
    let mut threads: Vec<usize> = keys.iter().map(|k| k.1).collect();
    threads.sort_unstable();
    threads.dedup();
    let label = |name: String, t: usize| {
        if threads.len() > 1 {
            format!("{name}, {t} thread{}", if t == 1 { "" } else { "s" })
        } else {
            name
        }
    };
    let pick = |(method, t): (&str, usize), n: usize| {
        rows.iter()
            .find(|r| r.method == method && r.threads == t && r.prompt_tokens == n)
    };
    let mut out: Vec<Series> = keys
        .iter()
        .enumerate()
        .map(|(i, &k)| Series {
            label: label(format!("kvq {}", k.0), k.1),
            color: COLORS[i % COLORS.len()],
            pp: lengths
                .iter()
                .map(|&n| pick(k, n).map(|r| r.pp_tps.median))
                .collect(),
            tg: lengths
                .iter()
                .map(|&n| pick(k, n).map(|r| r.tg_tps.median))
                .collect(),
        })
        .collect();
    let med = |s: &Option<Stats>| s.as_ref().map(|s| s.median);
    for (i, &t) in threads.iter().enumerate() {
        let llama = |n: usize, f: &dyn Fn(&super::LlamaCpp) -> Option<f64>| {
            rows.iter()
                .filter(|r| r.prompt_tokens == n && r.threads == t)
                .find_map(|r| r.llama_cpp.as_ref().and_then(f))
        };
        let pp: Vec<Option<f64>> = lengths
            .iter()
            .map(|&n| llama(n, &|l| med(&l.pp_tps)))
            .collect();
        let tg: Vec<Option<f64>> = lengths
            .iter()
            .map(|&n| llama(n, &|l| med(&l.tg_tps)))
            .collect();
        if pp.iter().chain(&tg).any(Option::is_some) {
            out.push(Series {
                label: label("llama.cpp".into(), t),
                color: LLAMA_COLORS[i % LLAMA_COLORS.len()],
                pp,
                tg,
            });
        }
    }
    out
}

pub fn draw(rows: &[BenchRow], path: &Path, font: &Path) -> anyhow::Result<()> {
    let bytes = std::fs::read(font)
        .with_context(|| format!("could not read the font {}", font.display()))?;
    // plotters keeps registered fonts for the life of the process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_err() {
        bail!("{} is not a usable TrueType font", font.display());
    }
    let mut lengths: Vec<usize> = rows.iter().map(|r| r.prompt_tokens).collect();
    lengths.sort_unstable();
    lengths.dedup();
    let series = series(rows, &lengths);
    let model = rows.first().map_or("", |r| r.model.as_str());
    let gen_tokens = rows.first().map_or(0, |r| r.gen_tokens);

    let root = BitMapBackend::new(path, (1200, 560)).into_drawing_area();
    root.fill(&WHITE)?;
    let (title, body) = root.split_vertically(60);
    title.draw_text(
        &format!("{model}: tokens/s (median), higher is better"),
        &("sans-serif", 24).into_font().color(&BLACK),
        (20, 12),
    )?;
    // Legend, on the title strip.
    let mut x = 20;
    for s in &series {
        title.draw(&Rectangle::new([(x, 42), (x + 14, 56)], s.color.filled()))?;
        title.draw_text(
            &s.label,
            &("sans-serif", 16).into_font().color(&BLACK),
            (x + 20, 40),
        )?;
        x += 40 + 9 * s.label.len() as i32;
    }
    let panels = body.split_evenly((1, 2));
    let captions = [
        "prompt processing (prefill)".to_string(),
        format!("decode, {gen_tokens} tokens after the prompt"),
    ];
    for (i, (panel, caption)) in panels.iter().zip(&captions).enumerate() {
        let values: Vec<Vec<Option<f64>>> = series
            .iter()
            .map(|s| if i == 0 { s.pp.clone() } else { s.tg.clone() })
            .collect();
        panel_chart(&root, panel, caption, &lengths, &series, &values)?;
    }
    root.present()?;
    Ok(())
}

fn panel_chart(
    root: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    panel: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    caption: &str,
    lengths: &[usize],
    series: &[Series],
    values: &[Vec<Option<f64>>],
) -> anyhow::Result<()> {
    let top = values
        .iter()
        .flatten()
        .flatten()
        .fold(1.0f64, |a, &b| a.max(b));
    let groups = lengths.len() as i32;
    let mut chart = ChartBuilder::on(panel)
        .caption(caption, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d((0..groups - 1).into_segmented(), 0.0..top * 1.15)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(WHITE)
        .x_labels(lengths.len())
        .x_desc("prompt tokens")
        .y_desc("tokens/s")
        .x_label_formatter(&|v| match v {
            SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => lengths
                .get(*i as usize)
                .map_or_else(String::new, |n| n.to_string()),
            SegmentValue::Last => String::new(),
        })
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 15))
        .draw()?;
    let k = series.len().max(1) as i32;
    for g in 0..groups {
        let (x0, base) = chart.backend_coord(&(SegmentValue::Exact(g), 0.0));
        let (x1, _) = chart.backend_coord(&(SegmentValue::Exact(g + 1), 0.0));
        let pad = (x1 - x0) / 8;
        let w = ((x1 - x0) - 2 * pad) / k;
        for (si, s) in series.iter().enumerate() {
            let Some(v) = values[si].get(g as usize).copied().flatten() else {
                continue;
            };
            let (_, y) = chart.backend_coord(&(SegmentValue::Exact(g), v));
            let bx = x0 + pad + si as i32 * w;
            root.draw(&Rectangle::new(
                [(bx + 2, y), (bx + w - 2, base)],
                s.color.filled(),
            ))?;
            let label = format!("{v:.0}");
            let tx = bx + w / 2 - 4 * label.len() as i32;
            root.draw_text(
                &label,
                &("sans-serif", 14).into_font().color(&BLACK),
                (tx, y - 18),
            )?;
        }
    }
    Ok(())
}
