//! `kvq generate`: one prompt (raw, or as a user message with `--chat`), streamed to stdout as
//! it is generated; token counts, speed and KV cache bytes go to stderr; with `--logprobs-out`,
//! each generated token's logprob and its top alternatives as JSON lines (to compare devices).

use super::model::{load_with_progress, resolve_model};
use anyhow::{Context, bail};
use clap::Args;
use kvq_cache::CacheSpec;
use kvq_engine::{Engine, EngineConfig, GenerationEvent, GenerationRequest, SamplingParams, Usage};
use kvq_models::ChatMessage;
use kvq_server::calibration::registry_for;
use std::io::{Read, Write};
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// The prompt; `-` reads it from stdin.
    #[arg(long)]
    pub prompt: String,
    /// Send the prompt as one user message through the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: usize,
    /// Sampling temperature, 0 (greedy) to 2.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Random seed, for reproducible sampling.
    #[arg(long)]
    pub seed: Option<u64>,
    /// A GGUF file, a Hugging Face model directory, or a Hub id (org/repo[:QUANT][@REVISION])
    /// (default: SmolLM2-135M-Instruct).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Where the model and its KV caches run: cpu, cuda, cuda:N, metal or auto (CUDA when
    /// this binary has it and a GPU answers, else the CPU).
    #[arg(long, default_value = "auto")]
    pub device: super::device::DeviceArg,
    /// Directory of cache presets [default: configs/cache when it exists].
    #[arg(long)]
    pub cache_presets: Option<PathBuf>,
    /// KV cache method or preset (default: the registry's default).
    #[arg(long)]
    pub kv_cache_method: Option<String>,
    /// Bits per element for the KV cache method, where it takes a choice.
    #[arg(long)]
    pub kv_cache_bits: Option<u8>,
    /// Write each generated token's logprob and its `--top-logprobs` most likely alternatives
    /// to this file, one JSON object per line (`i`, `id`, `token`, `logprob`, `top`).
    #[arg(long)]
    pub logprobs_out: Option<PathBuf>,
    /// Alternatives per token in `--logprobs-out`, 1 to 20.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u8).range(1..=20))]
    pub top_logprobs: u8,
}

pub async fn run(args: GenerateArgs) -> anyhow::Result<()> {
    if !(args.temperature.is_finite() && (0.0..=2.0).contains(&args.temperature)) {
        bail!(
            "--temperature must be between 0 and 2; got {}",
            args.temperature
        );
    }
    anyhow::ensure!(args.max_tokens >= 1, "--max-tokens must be at least 1");
    let prompt = if args.prompt == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("could not read the prompt from stdin")?;
        s
    } else {
        args.prompt.clone()
    };

    let choice = resolve_model(args.model.as_deref()).await?;
    // VecInfer finds (or makes, on first use) the calibration of this model on its own.
    let mut registry = registry_for(&choice.path);
    super::presets::load(&mut registry, args.cache_presets.as_deref())?;
    let spec = CacheSpec {
        method: args.kv_cache_method.clone(),
        bits: args.kv_cache_bits,
    };
    let cache = registry.resolve(&spec).context("--kv-cache-method")?;

    let model = load_with_progress(&choice, args.device).await?;
    let engine = Engine::start(
        model,
        EngineConfig {
            max_running: 1,
            max_waiting: 1,
            ..EngineConfig::default()
        },
    );
    let ids = encode(&engine, &prompt, args.chat)?;
    let request = GenerationRequest {
        prompt: ids,
        max_tokens: Some(args.max_tokens),
        sampling: SamplingParams {
            temperature: args.temperature,
            seed: args.seed,
            ..SamplingParams::default()
        },
        stop: if args.chat {
            engine.chat_template().stop_strings().to_vec()
        } else {
            Vec::new()
        },
        stop_on_eos: true,
        constraint: None,
        logprobs: args
            .logprobs_out
            .as_ref()
            .map(|_| args.top_logprobs as usize),
        cache,
    };
    let mut logprobs_out = match &args.logprobs_out {
        Some(path) => Some(std::io::BufWriter::new(
            std::fs::File::create(path)
                .with_context(|| format!("--logprobs-out {}", path.display()))?,
        )),
        None => None,
    };
    let mut rx = engine.submit(request).context("the request was refused")?;

    let mut stdout = std::io::stdout().lock();
    let mut finished = None;
    let mut generated = 0;
    while let Some(event) = rx.recv().await {
        match event {
            GenerationEvent::Delta { text, logprob, .. } => {
                if let (Some(out), Some(lp)) = (logprobs_out.as_mut(), logprob) {
                    write_logprob(out, generated, &lp)?;
                    generated += 1;
                }
                if text.is_empty() {
                    continue;
                }
                if stdout
                    .write_all(text.as_bytes())
                    .and_then(|()| stdout.flush())
                    .is_err()
                {
                    // stdout closed (e.g. piped into `head`): stop generating quietly.
                    return Ok(());
                }
            }
            GenerationEvent::Finished { reason, usage } => {
                finished = Some((reason, usage));
                break;
            }
            GenerationEvent::Error(err) => {
                let _ = writeln!(stdout);
                return Err(err).context("generation failed");
            }
        }
    }
    let _ = writeln!(stdout).and_then(|()| stdout.flush());
    drop(stdout);
    if let Some(mut out) = logprobs_out {
        out.flush().context("--logprobs-out")?;
    }
    let Some((reason, usage)) = finished else {
        bail!("the engine stopped before generation finished");
    };
    eprintln!("{}", stats_line(reason.as_str(), &usage));
    Ok(())
}

/// One `--logprobs-out` line: the token's index, id, text and logprob, and its alternatives.
fn write_logprob(
    out: &mut impl Write,
    i: usize,
    lp: &kvq_engine::LogprobInfo,
) -> anyhow::Result<()> {
    let top: Vec<_> = lp
        .top
        .iter()
        .map(|t| serde_json::json!({"id": t.id, "token": t.token, "logprob": t.logprob}))
        .collect();
    let line = serde_json::json!({
        "i": i,
        "id": lp.id,
        "token": lp.token,
        "logprob": lp.logprob,
        "top": top,
    });
    writeln!(out, "{line}").context("--logprobs-out")
}

/// Tokenizes the prompt: raw (with BOS when the tokenizer adds one), or as a chat turn.
fn encode(engine: &Engine, prompt: &str, chat: bool) -> anyhow::Result<Vec<u32>> {
    let tokenizer = engine.tokenizer();
    if chat {
        let text = engine
            .chat_template()
            .render(&[ChatMessage::new("user", prompt)], true)
            .context("rendering the chat template")?;
        let add_special = !tokenizer
            .bos_token()
            .is_some_and(|bos| !bos.is_empty() && text.starts_with(bos));
        Ok(tokenizer.encode(&text, add_special)?)
    } else {
        Ok(tokenizer.encode(prompt, true)?)
    }
}

/// `N prompt tokens, M generated in Xs (Y tok/s), first token after Zs, kv cache METHOD: B bytes`.
fn stats_line(reason: &str, u: &Usage) -> String {
    let decode = u.decode_time.as_secs_f64();
    let tps = if decode > 0.0 {
        format!("{:.1} tok/s", u.completion_tokens as f64 / decode)
    } else {
        "- tok/s".to_string()
    };
    format!(
        "[{} prompt tokens, {} generated in {:.2}s ({tps}), first token after {:.3}s, finish: {reason}, kv cache {}: {} bytes ({:.1} KiB)]",
        u.prompt_tokens,
        u.completion_tokens,
        decode,
        u.time_to_first_token.as_secs_f64(),
        u.kv_cache_method,
        u.kv_cache_bytes,
        u.kv_cache_bytes as f64 / 1024.0
    )
}
