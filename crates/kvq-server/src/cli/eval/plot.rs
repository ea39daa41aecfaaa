//! The PNG of `kvq eval --plot`: perplexity delta vs fp16 (y) against KV cache bits per element
//! (x), one numbered point per method (the numbers listed at the top right), with llama.cpp's
//! q4_0 cache at the same context as a reference line.

use super::EvalRow;
use crate::cli::bench::plot::register_font;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use std::path::Path;

/// llama.cpp's q4_0 KV cache (keys and values, 4.5 bits per element) on SmolLM2-135M and the
/// evaluation text, as a PPL change against its f16 cache at the same context: +15.6% at 512
/// (DESIGN.md "Bars"), +4.31% at 2048 (`llama-perplexity -c 2048 -ctk q4_0 -ctv q4_0 -fa on`:
/// 31.9170 against f16's 30.5973, docs/benchmarks/quality.md). None for other models and
/// contexts: the line is only drawn where it was measured.
pub fn q4_0_delta_pct(model_id: &str, ctx: usize) -> Option<f64> {
    match (model_id, ctx) {
        ("SmolLM2-135M-Instruct", 512) => Some(15.6),
        ("SmolLM2-135M-Instruct", 2048) => Some(4.31),
        _ => None,
    }
}
const Q4_0_BITS: f64 = 4.5;

const POINT: RGBColor = RGBColor(31, 119, 180);
const BASE: RGBColor = RGBColor(90, 90, 90);
const REFERENCE: RGBColor = RGBColor(214, 39, 40);

/// Bits per element over keys and values together (their mean).
pub fn total_bits(row: &EvalRow) -> f64 {
    (row.key_bits + row.value_bits) / 2.0
}

/// Approximate width in pixels of `text` at `size` px.
fn text_width(text: &str, size: u32) -> i32 {
    (text.chars().count() as f64 * f64::from(size) * 0.55) as i32
}

pub fn draw(
    rows: &[EvalRow],
    path: &Path,
    font: &Path,
    title: &str,
    model_id: &str,
    ctx: usize,
) -> anyhow::Result<()> {
    register_font(font)?;
    let xs: Vec<f64> = rows.iter().map(total_bits).collect();
    let ys: Vec<f64> = rows.iter().map(|r| r.delta_pct).collect();
    let finite = |v: &[f64]| {
        v.iter()
            .copied()
            .filter(|x| x.is_finite())
            .collect::<Vec<_>>()
    };
    let q4_0 = q4_0_delta_pct(model_id, ctx);
    let x_max = finite(&xs).into_iter().fold(Q4_0_BITS, f64::max).max(1.0) * 1.08;
    let y_lo = finite(&ys).into_iter().fold(0.0, f64::min);
    let y_hi = finite(&ys).into_iter().fold(q4_0.unwrap_or(0.0), f64::max);
    let pad = (y_hi - y_lo).max(1.0) * 0.1;
    let (y_lo, y_hi) = (y_lo - pad, y_hi + pad);

    let root = BitMapBackend::new(path, (1100, 650)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 24))
        .margin(24)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..x_max, y_lo..y_hi)?;
    chart
        .configure_mesh()
        .x_desc("KV cache bits per element (keys and values; codes, norms, window included)")
        .y_desc("perplexity vs fp16 cache (%), lower is better")
        .x_label_formatter(&|v| format!("{v:.0}"))
        .y_label_formatter(&|v| format!("{v:+.0}%"))
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 16))
        .light_line_style(WHITE)
        .draw()?;

    // fp16 level and llama.cpp's q4_0 reference.
    chart.draw_series(std::iter::once(PathElement::new(
        vec![(0.0, 0.0), (x_max, 0.0)],
        BASE.stroke_width(1),
    )))?;
    if let Some(q) = q4_0 {
        chart.draw_series(std::iter::once(DashedPathElement::new(
            vec![(0.0, q), (x_max, q)],
            10,
            6,
            REFERENCE.stroke_width(2),
        )))?;
        let reference =
            format!("llama.cpp q4_0 cache at ctx {ctx}: {q:+.2}% at {Q4_0_BITS} bits/elem");
        chart.draw_series(std::iter::once(
            EmptyElement::at((0.0, q))
                + Text::new(
                    reference,
                    (8, -22),
                    ("sans-serif", 15).into_font().color(&REFERENCE),
                ),
        ))?;
        chart.draw_series(std::iter::once(
            EmptyElement::at((Q4_0_BITS, q)) + Cross::new((0, 0), 7, REFERENCE.stroke_width(2)),
        ))?;
    }

    // One numbered point per method; the numbers are explained in a list at the top right,
    // where no point falls (labels beside crowded points would overlap).
    let mut legend = Vec::new();
    for (row, (&x, &y)) in rows.iter().zip(xs.iter().zip(&ys)) {
        if !(x.is_finite() && y.is_finite()) {
            continue;
        }
        let n = legend.len() + 1;
        legend.push(format!("{n}  {} ({x:.2} b, {y:+.2}%)", row.method));
        chart.draw_series(std::iter::once(
            EmptyElement::at((x, y))
                + Circle::new((0, 0), 6, POINT.filled())
                + Text::new(
                    n.to_string(),
                    (7, -18),
                    ("sans-serif", 14).into_font().color(&BLACK),
                ),
        ))?;
    }
    let (w, _) = root.dim_in_pixel();
    let x0 = w as i32 - 24 - legend.iter().map(|l| text_width(l, 14)).max().unwrap_or(0);
    for (i, line) in legend.iter().enumerate() {
        root.draw(&Text::new(
            line.clone(),
            (x0, 70 + 19 * i as i32),
            ("sans-serif", 14).into_font().color(&BLACK),
        ))?;
    }
    root.present()?;
    Ok(())
}
