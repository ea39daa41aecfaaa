//! The PNG bar charts of `kvq bench` (plotters, with a TrueType font found on the system): speed
//! (prompt and decode tokens/s) and memory (KV cache MiB and peak RSS MiB), each two panels of
//! bars grouped by ctx, one series per engine and method.

use super::{BenchRow, Stats, memory::mib};
use anyhow::{Context, bail};
use plotters::coord::Shift;
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

/// Registers `font` as plotters' "sans-serif" (shared with `kvq eval --plot`).
pub fn register_font(font: &Path) -> anyhow::Result<()> {
    let bytes = std::fs::read(font)
        .with_context(|| format!("could not read the font {}", font.display()))?;
    // plotters keeps registered fonts for the life of the process.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_err() {
        bail!("{} is not a usable TrueType font", font.display());
    }
    Ok(())
}

/// One bar series: a label, a color and its value per ctx in each of the two panels.
struct Series {
    label: String,
    color: RGBColor,
    values: [Vec<Option<f64>>; 2],
}

/// The tab20 palette without the oranges and reds kept for llama.cpp: sixteen distinct colors,
/// so a run of every method and preset repeats none.
const COLORS: &[RGBColor] = &[
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
    RGBColor(174, 199, 232),
    RGBColor(152, 223, 138),
    RGBColor(197, 176, 213),
    RGBColor(196, 156, 148),
    RGBColor(247, 182, 210),
    RGBColor(199, 199, 199),
    RGBColor(219, 219, 141),
    RGBColor(158, 218, 229),
];
const LLAMA_COLORS: &[RGBColor] = &[
    RGBColor(255, 127, 14),
    RGBColor(214, 39, 40),
    RGBColor(255, 187, 120),
    RGBColor(255, 152, 150),
];

/// (method, threads) of the kvq rows in order of first appearance, and the distinct thread counts.
fn keys(rows: &[BenchRow]) -> (Vec<(&str, usize)>, Vec<usize>) {
    let mut keys: Vec<(&str, usize)> = Vec::new();
    for r in rows {
        if !keys.contains(&(r.method.as_str(), r.threads)) {
            keys.push((&r.method, r.threads));
        }
    }
    let mut threads: Vec<usize> = keys.iter().map(|k| k.1).collect();
    threads.sort_unstable();
    threads.dedup();
    (keys, threads)
}

fn label(name: String, t: usize, threads: &[usize]) -> String {
    if threads.len() > 1 {
        format!("{name}, {t} thread{}", if t == 1 { "" } else { "s" })
    } else {
        name
    }
}

/// One kvq series per (method, threads) with `f`'s two values of a row per ctx.
fn kvq_series(
    rows: &[BenchRow],
    lengths: &[usize],
    f: &dyn Fn(&BenchRow) -> [Option<f64>; 2],
) -> Vec<Series> {
    let (keys, threads) = keys(rows);
    let pick = |(method, t): (&str, usize), n: usize| {
        rows.iter()
            .find(|r| r.method == method && r.threads == t && r.prompt_tokens == n)
    };
    keys.iter()
        .enumerate()
        .map(|(i, &k)| {
            let at = |p: usize| {
                lengths
                    .iter()
                    .map(|&n| pick(k, n).and_then(|r| f(r)[p]))
                    .collect()
            };
            Series {
                label: label(format!("kvq {}", k.0), k.1, &threads),
                color: COLORS[i % COLORS.len()],
                values: [at(0), at(1)],
            }
        })
        .collect()
}

fn speed_series(rows: &[BenchRow], lengths: &[usize]) -> Vec<Series> {
    let mut out = kvq_series(rows, lengths, &|r| {
        [Some(r.pp_tps.median), Some(r.tg_tps.median)]
    });
    let med = |s: &Option<Stats>| s.as_ref().map(|s| s.median);
    out.extend(llama_series(rows, lengths, &|l| {
        [med(&l.pp_tps), med(&l.tg_tps)]
    }));
    out
}

/// One llama.cpp series per (KV cache type, thread count), `f`'s two values per ctx.
fn llama_series(
    rows: &[BenchRow],
    lengths: &[usize],
    f: &dyn Fn(&super::LlamaCpp) -> [Option<f64>; 2],
) -> Vec<Series> {
    let (_, threads) = keys(rows);
    let mut types: Vec<&str> = Vec::new();
    for l in rows.iter().filter_map(|r| r.llama_cpp.as_ref()) {
        if !types.contains(&l.cache_type.as_str()) {
            types.push(&l.cache_type);
        }
    }
    let pairs = types
        .iter()
        .flat_map(|&c| threads.iter().map(move |&t| (c, t)));
    let mut out = Vec::new();
    for (i, (c, t)) in pairs.enumerate() {
        let at = |n: usize| {
            rows.iter()
                .filter(|r| r.prompt_tokens == n && r.threads == t)
                .filter_map(|r| r.llama_cpp.as_ref())
                .find(|l| l.cache_type == c)
                .map_or([None, None], f)
        };
        let values: Vec<[Option<f64>; 2]> = lengths.iter().map(|&n| at(n)).collect();
        let panel = |p: usize| values.iter().map(|v| v[p]).collect::<Vec<_>>();
        let (first, second) = (panel(0), panel(1));
        if first.iter().chain(&second).any(Option::is_some) {
            out.push(Series {
                label: label(format!("llama.cpp {c}"), t, &threads),
                color: LLAMA_COLORS[i % LLAMA_COLORS.len()],
                values: [first, second],
            });
        }
    }
    out
}

/// The distinct ctx values, ascending.
fn lengths(rows: &[BenchRow]) -> Vec<usize> {
    let mut lengths: Vec<usize> = rows.iter().map(|r| r.prompt_tokens).collect();
    lengths.sort_unstable();
    lengths.dedup();
    lengths
}

/// The speed chart (the font must be registered: `register_font`).
pub fn draw(rows: &[BenchRow], path: &Path) -> anyhow::Result<()> {
    let lengths = lengths(rows);
    let gen_tokens = rows.first().map_or(0, |r| r.gen_tokens);
    let model = rows.first().map_or("", |r| r.model.as_str());
    chart(
        path,
        &format!("{model}: tokens/s (median), higher is better"),
        &lengths,
        &speed_series(rows, &lengths),
        [
            ("prompt processing (prefill)".into(), "tokens/s"),
            (
                format!("decode, {gen_tokens} tokens after the prompt"),
                "tokens/s",
            ),
        ],
    )
}

/// The memory chart: KV cache MiB and peak RSS MiB per method (the font must be registered).
pub fn draw_memory(rows: &[BenchRow], path: &Path) -> anyhow::Result<()> {
    let lengths = lengths(rows);
    let model = rows.first().map_or("", |r| r.model.as_str());
    let mut gens: Vec<usize> = rows.iter().map(|r| r.gen_tokens).collect();
    gens.sort_unstable();
    gens.dedup();
    let generated = match gens.as_slice() {
        [one] => format!("{one} tokens"),
        _ => "the generated tokens".into(),
    };
    let rows: Vec<BenchRow> = rows.iter().filter(|r| r.engine == "kvq").cloned().collect();
    let mut series = kvq_series(&rows, &lengths, &|r| {
        [
            Some(mib(r.kv_resident_bytes as f64)),
            r.peak_rss_bytes.map(|b| mib(b as f64)),
        ]
    });
    // llama.cpp's peak RSS where it was recorded (its KV bytes are not in llama-bench's output).
    series.extend(llama_series(&rows, &lengths, &|l| {
        [None, l.peak_rss_bytes.map(|b| mib(b as f64))]
    }));
    let peak = if rows.iter().all(|r| r.isolated) {
        "peak RSS of the process (model + cache)"
    } else {
        "peak RSS, one process for all rows (cumulative)"
    };
    chart(
        path,
        &format!("{model}: memory, MiB, lower is better"),
        &lengths,
        &series,
        [
            (format!("KV cache resident after ctx + {generated}"), "MiB"),
            (peak.into(), "MiB"),
        ],
    )
}

/// The legend's entries as (x, line) positions, wrapped at `width`.
fn legend_layout(series: &[Series], width: i32) -> Vec<(i32, i32)> {
    let (mut x, mut line) = (20, 0);
    series
        .iter()
        .map(|s| {
            let w = 40 + 9 * s.label.chars().count() as i32;
            if x > 20 && x + w > width - 20 {
                (x, line) = (20, line + 1);
            }
            let at = (x, line);
            x += w;
            at
        })
        .collect()
}

/// Two panels side by side under a title and a legend; wide enough that every bar keeps room
/// for its value label.
fn chart(
    path: &Path,
    title: &str,
    lengths: &[usize],
    series: &[Series],
    panels: [(String, &str); 2],
) -> anyhow::Result<()> {
    let bars = (lengths.len() * series.len().max(1)) as u32;
    let width = 1200.max(2 * (bars * 40 * 4 / 3 + 100));
    let legend = legend_layout(series, width as i32);
    let lines = legend.iter().map(|p| p.1).max().unwrap_or(0) + 1;
    let head = 40 + 22 * lines as u32;
    let root = BitMapBackend::new(path, (width, head + 500)).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, body) = root.split_vertically(head);
    top.draw_text(
        title,
        &("sans-serif", 24).into_font().color(&BLACK),
        (20, 12),
    )?;
    for (s, &(x, line)) in series.iter().zip(&legend) {
        let y = 42 + 22 * line;
        top.draw(&Rectangle::new(
            [(x, y), (x + 14, y + 14)],
            s.color.filled(),
        ))?;
        top.draw_text(
            &s.label,
            &("sans-serif", 16).into_font().color(&BLACK),
            (x + 20, y - 2),
        )?;
    }
    let areas = body.split_evenly((1, 2));
    for (i, (area, (caption, y_desc))) in areas.iter().zip(&panels).enumerate() {
        let values: Vec<&[Option<f64>]> = series.iter().map(|s| &s.values[i][..]).collect();
        panel_chart(&root, area, caption, y_desc, lengths, series, &values)?;
    }
    root.present()?;
    Ok(())
}

/// A bar's value label: no decimals from 100, one below, two below 1.
fn value_label(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.2}")
    }
}

fn panel_chart(
    root: &DrawingArea<BitMapBackend<'_>, Shift>,
    panel: &DrawingArea<BitMapBackend<'_>, Shift>,
    caption: &str,
    y_desc: &str,
    lengths: &[usize],
    series: &[Series],
    values: &[&[Option<f64>]],
) -> anyhow::Result<()> {
    let top = values
        .iter()
        .flat_map(|v| v.iter())
        .flatten()
        .fold(1.0f64, |a, &b| a.max(b));
    // A plain x range, one unit per ctx group: the ctx labels are drawn under each group's
    // center by hand (a segmented range of one group has no width).
    let groups = lengths.len() as i32;
    let mut chart = ChartBuilder::on(panel)
        .caption(caption, ("sans-serif", 20))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(0.0..f64::from(groups.max(1)), 0.0..top * 1.15)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(WHITE)
        .x_labels(0)
        .x_desc("ctx (prompt tokens)")
        .y_desc(y_desc)
        .y_label_formatter(&|v| format!("{v:.0}"))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 15))
        .draw()?;
    let axis = ("sans-serif", 15).into_font().color(&BLACK);
    for (g, n) in lengths.iter().enumerate() {
        let (cx, base) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        let text = n.to_string();
        root.draw_text(&text, &axis, (cx - 4 * text.len() as i32, base + 6))?;
    }
    let k = series.len().max(1) as i32;
    for g in 0..groups {
        let (x0, base) = chart.backend_coord(&(f64::from(g), 0.0));
        let (x1, _) = chart.backend_coord(&(f64::from(g + 1), 0.0));
        let pad = (x1 - x0) / 8;
        let w = ((x1 - x0) - 2 * pad) / k;
        for (si, s) in series.iter().enumerate() {
            let Some(v) = values[si].get(g as usize).copied().flatten() else {
                continue;
            };
            let (_, y) = chart.backend_coord(&(f64::from(g), v));
            let bx = x0 + pad + si as i32 * w;
            root.draw(&Rectangle::new(
                [(bx + 2, y), (bx + w - 2, base)],
                s.color.filled(),
            ))?;
            let label = value_label(v);
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
