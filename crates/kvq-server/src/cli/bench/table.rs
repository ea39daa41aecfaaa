//! The rows as text: a line saying what was measured, then a Markdown-compatible table of speed
//! and memory per (method, ctx), with llama.cpp's columns when compared.

use super::BenchRow;
use super::memory::mib;
use super::{Stats, rows::BASELINE};
use comfy_table::{Cell, CellAlignment, Table, presets::ASCII_MARKDOWN};

fn fmt_stats(s: &Stats) -> String {
    format!("{:.1} ({:.1}–{:.1})", s.median, s.min, s.max)
}

fn fmt_opt(s: &Option<Stats>) -> String {
    s.as_ref().map_or_else(|| "-".into(), fmt_stats)
}

pub(super) fn fmt_ratio(r: Option<f64>) -> String {
    r.map_or_else(|| "-".into(), |r| format!("{r:.2}×"))
}

fn fmt_mib(b: Option<u64>) -> String {
    b.map_or_else(|| "-".into(), |b| format!("{:.1}", mib(b as f64)))
}

/// Distinct values of `f` over the rows, in order of first appearance.
fn distinct<T: PartialEq>(rows: &[BenchRow], f: impl Fn(&BenchRow) -> T) -> Vec<T> {
    let mut out = Vec::new();
    for r in rows {
        let v = f(r);
        if !out.contains(&v) {
            out.push(v);
        }
    }
    out
}

fn join<T: ToString>(v: &[T]) -> String {
    v.iter().map(T::to_string).collect::<Vec<_>>().join("/")
}

/// One line: the model, the lengths, the threads, the prefill chunk, the RSS after load and
/// whether the RSS columns are per row or accumulated in one process.
pub(super) fn summary(rows: &[BenchRow]) -> String {
    let models = distinct(rows, |r| r.model.clone());
    let gens = distinct(rows, |r| r.gen_tokens);
    let threads = distinct(rows, |r| r.threads);
    let chunks = distinct(rows, |r| r.prefill_chunk);
    let mut s = format!(
        "model {}; {} tokens decoded after each ctx; {} thread(s); prefill chunk {}",
        models.join(", "),
        join(&gens),
        join(&threads),
        if chunks == [0] {
            "-".into()
        } else {
            join(&chunks)
        }
    );
    let loaded: Vec<u64> = rows.iter().filter_map(|r| r.rss_loaded_bytes).collect();
    if let (Some(lo), Some(hi)) = (loaded.iter().min(), loaded.iter().max()) {
        s += &format!(
            "; RSS after model load {:.1}–{:.1} MiB",
            mib(*lo as f64),
            mib(*hi as f64)
        );
    }
    s += if rows.iter().all(|r| r.isolated) {
        "; each row measured in its own process"
    } else {
        "; rows measured in one process: RSS at end and peak RSS accumulate down the table"
    };
    s
}

/// The summary line and the table.
pub(super) fn render_table(rows: &[BenchRow]) -> String {
    let compared = rows.iter().any(|r| r.llama_cpp.is_some());
    let many_threads = distinct(rows, |r| r.threads).len() > 1;
    let mut header = vec!["method"];
    if many_threads {
        header.push("threads");
    }
    header.extend(["ctx", "pp tok/s"]);
    if compared {
        header.extend(["llama.cpp KV", "llama.cpp pp tok/s", "pp ratio"]);
    }
    header.push("tg tok/s");
    if compared {
        header.extend(["llama.cpp tg tok/s", "tg ratio"]);
    }
    let tg_vs = format!("tg vs {BASELINE}");
    let kv_vs = format!("KV vs {BASELINE} (× smaller)");
    header.extend([
        tg_vs.as_str(),
        "KV MiB",
        "KV bytes/token",
        kv_vs.as_str(),
        "RSS at end MiB",
        "peak RSS MiB",
    ]);
    // GPU rows: the memory in use on the card (weights, caches, workspace).
    let device_mem = rows.iter().any(|r| r.device_used_bytes.is_some());
    if device_mem {
        header.push("GPU used MiB");
    }
    let llama_rss = rows.iter().any(|r| {
        r.llama_cpp
            .as_ref()
            .is_some_and(|l| l.peak_rss_bytes.is_some())
    });
    if llama_rss {
        header.extend(["llama.cpp peak RSS MiB", "RSS ratio"]);
    }
    let mut table = Table::new();
    table.load_style(ASCII_MARKDOWN).set_header(header);
    for r in rows {
        let mut label = r.method.clone();
        if r.sequences > 1 {
            label += &format!(" x{}", r.sequences);
            if r.shared_prompt {
                label += " shared";
            }
        }
        if r.device != "cpu" {
            label += &format!(" ({})", r.device);
        }
        let mut cells = vec![Cell::new(label)];
        if many_threads {
            cells.push(Cell::new(r.threads));
        }
        cells.push(Cell::new(r.prompt_tokens));
        cells.push(Cell::new(fmt_stats(&r.pp_tps)));
        let l = r.llama_cpp.as_ref();
        if compared {
            cells.push(Cell::new(l.map_or("-", |l| l.cache_type.as_str())));
            cells.push(Cell::new(l.map_or("-".into(), |l| fmt_opt(&l.pp_tps))));
            cells.push(Cell::new(fmt_ratio(l.and_then(|l| l.pp_ratio))));
        }
        cells.push(Cell::new(fmt_stats(&r.tg_tps)));
        if compared {
            cells.push(Cell::new(l.map_or("-".into(), |l| {
                format!("{} @ d{}", fmt_opt(&l.tg_tps), l.tg_depth)
            })));
            cells.push(Cell::new(fmt_ratio(l.and_then(|l| l.tg_ratio))));
        }
        cells.extend([
            Cell::new(fmt_ratio(r.tg_vs_fp16)),
            Cell::new(format!("{:.2}", mib(r.kv_resident_bytes as f64))),
            Cell::new(format!("{:.0}", r.kv_bytes_per_token)),
            Cell::new(fmt_ratio(r.kv_vs_fp16)),
            Cell::new(fmt_mib(r.rss_end_bytes)),
            Cell::new(fmt_mib(r.peak_rss_bytes)),
        ]);
        if device_mem {
            cells.push(Cell::new(fmt_mib(r.device_used_bytes)));
        }
        if llama_rss {
            cells.push(Cell::new(fmt_mib(l.and_then(|l| l.peak_rss_bytes))));
            cells.push(Cell::new(fmt_ratio(l.and_then(|l| l.rss_ratio))));
        }
        table.add_row(cells);
    }
    for i in 1..table.column_count() {
        if let Some(c) = table.column_mut(i) {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    format!("{}\n\n{table}", summary(rows))
}
