//! `kvq serve`: read the optional config file, load the model, start the engine, bind, print
//! `kvq listening on http://ADDR` and serve until ctrl-c. Flags win over the config file, which
//! wins over the defaults.

use super::model::{load_with_progress, resolve_model};
use anyhow::Context;
use clap::Args;
use kvq_engine::{Engine, EngineConfig};
use kvq_server::auth::ApiKeys;
use kvq_server::calibration::registry_for;
use kvq_server::{
    AppState, DEFAULT_MAX_BODY_BYTES, ServeOptions, ServerLimits, install_metrics, serve,
};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A TOML file with any of the settings below (see configs/server.toml); flags win over it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Address to listen on [default: 127.0.0.1].
    #[arg(long)]
    pub host: Option<String>,
    /// Port to listen on; 0 picks a free one (the bound address is printed) [default: 8080].
    #[arg(long)]
    pub port: Option<u16>,
    /// A GGUF file, a Hugging Face model directory, or a Hub id downloaded into the hub cache:
    /// org/repo, org/repo:QUANT (a GGUF quantization), org/repo@REVISION (default:
    /// SmolLM2-135M-Instruct from models/).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Where the model and its KV caches run: cpu, cuda, cuda:N, metal or auto (CUDA when
    /// this binary has it and a GPU answers, else the CPU) [default: auto].
    #[arg(long)]
    pub device: Option<super::device::DeviceArg>,
    /// Sequences generating at once [default: 16].
    #[arg(long)]
    pub max_running: Option<usize>,
    /// Requests allowed to wait; past that requests get 429 with Retry-After [default: 256].
    #[arg(long)]
    pub max_waiting: Option<usize>,
    /// Bytes the KV caches of running sequences may reserve together: 8GiB, 512MiB, 2e9, a
    /// share of the memory free once the model is loaded (60%: RAM for a CPU model, GPU memory
    /// for a GPU one), or none. A request reserves its worst case under its own method (prompt
    /// plus max_tokens) and waits until that fits; one that never fits is a 400 naming the
    /// methods that would [default: 60%].
    #[arg(long)]
    pub kv_budget: Option<super::budget::KvBudget>,
    /// Bytes the prefix cache may hold (2GiB, 512MiB) or off: ended requests' KV caches,
    /// compressed ones as their codes, from which a later prompt that starts with the same
    /// tokens under the same cache method continues (a chat's next turn prefills only the new
    /// messages; `usage.prompt_tokens_details.cached_tokens` says how many were reused). They
    /// live inside --kv-budget and are evicted, least recently used first, before a request
    /// would wait [default: 1GiB, at most the KV budget].
    #[arg(long)]
    pub prefix_cache: Option<super::budget::PrefixCacheSize>,
    /// A directory where held prefixes are saved, compressed ones as their codes, when the
    /// prefix cache evicts them and at shutdown, and restored from when a prompt starts with
    /// their tokens: a restarted server continues a conversation warm. Files of another model,
    /// kvq version or cache configuration are skipped, damaged ones removed [default: off].
    #[arg(long)]
    pub kv_store: Option<PathBuf>,
    /// Bytes the --kv-store files may take (20GiB, 512MiB); the least recently used go first
    /// [default: 10GiB].
    #[arg(long, requires = "kv_store")]
    pub kv_store_max: Option<super::budget::StoreSize>,
    /// Largest request body accepted, in bytes (413 past it) [default: 4194304].
    #[arg(long)]
    pub max_body_bytes: Option<usize>,
    /// Largest `n` (choices per request) accepted [default: 1].
    #[arg(long)]
    pub max_n: Option<usize>,
    /// KV cache method for requests that name none [default: fp16].
    #[arg(long)]
    pub default_kv_cache_method: Option<String>,
    /// Directory of cache presets (`<name>.toml`, see configs/cache/) [default: configs/cache
    /// when it exists].
    #[arg(long)]
    pub cache_presets: Option<PathBuf>,
    /// Require `Authorization: Bearer <key>` on every /v1 route with this key (also
    /// `KVQ_API_KEY`); without a key the API is open.
    #[arg(long, env = "KVQ_API_KEY", hide_env_values = true)]
    pub api_key: Option<kvq_server::auth::SecretKey>,
    /// A file of accepted keys, one per line (`#` comments), besides or instead of --api-key.
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Put /metrics behind the API key too (it is open by default, like /health).
    #[arg(long)]
    pub metrics_need_key: bool,
    /// Seconds open requests may run on after SIGTERM / ctrl-c (new ones get 503 meanwhile);
    /// then open streams end with an error event [default: 30].
    #[arg(long)]
    pub shutdown_grace: Option<f64>,
    /// Seconds one request may run; then a stream ends with an error event and a plain
    /// request gets 408, and its sequence is freed [default: no limit].
    #[arg(long)]
    pub request_timeout: Option<f64>,
    /// Seconds a client may take to send a request's headers; slower connections are closed
    /// [default: 10].
    #[arg(long)]
    pub header_timeout: Option<f64>,
    /// Largest request line plus headers, in bytes (431 past it) [default: 65536].
    #[arg(long)]
    pub max_header_bytes: Option<usize>,
    /// Most connections open at once; more wait to be accepted [default: 1024].
    #[arg(long)]
    pub max_connections: Option<usize>,
}

/// The config file: every field optional, unknown fields rejected.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    host: Option<String>,
    port: Option<u16>,
    model: Option<PathBuf>,
    max_running: Option<usize>,
    max_waiting: Option<usize>,
    kv_budget: Option<String>,
    prefix_cache: Option<String>,
    kv_store: Option<PathBuf>,
    kv_store_max: Option<String>,
    max_body_bytes: Option<usize>,
    max_n: Option<usize>,
    default_kv_cache_method: Option<String>,
    cache_presets: Option<PathBuf>,
    device: Option<String>,
    api_key_file: Option<PathBuf>,
    metrics_need_key: Option<bool>,
    shutdown_grace: Option<f64>,
    request_timeout: Option<f64>,
    header_timeout: Option<f64>,
    max_header_bytes: Option<usize>,
    max_connections: Option<usize>,
}

/// The settings after merging flags, file and defaults.
struct Settings {
    host: String,
    port: u16,
    model: Option<PathBuf>,
    device: super::device::DeviceArg,
    max_running: usize,
    max_waiting: usize,
    /// The budget and whether it was given (a default that cannot be measured is dropped).
    kv_budget: (super::budget::KvBudget, bool),
    /// Bytes the prefix cache may hold (`None`: off).
    prefix_cache: Option<usize>,
    /// The KV store's directory and byte limit.
    kv_store: Option<(PathBuf, u64)>,
    max_body_bytes: usize,
    max_n: usize,
    default_method: Option<String>,
    cache_presets: Option<PathBuf>,
    access: kvq_server::Access,
    request_timeout: Option<std::time::Duration>,
    serve: ServeOptions,
}

fn settings(args: ServeArgs) -> anyhow::Result<Settings> {
    let file = match &args.config {
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .with_context(|| format!("could not read {}", p.display()))?;
            toml::from_str::<FileConfig>(&text)
                .with_context(|| format!("invalid config file {}", p.display()))?
        }
        None => FileConfig::default(),
    };
    let engine = EngineConfig::default();
    Ok(Settings {
        host: args
            .host
            .or(file.host)
            .unwrap_or_else(|| "127.0.0.1".into()),
        port: args.port.or(file.port).unwrap_or(8080),
        model: args.model.or(file.model),
        device: match (args.device, file.device) {
            (Some(d), _) => d,
            (None, Some(d)) => d
                .parse()
                .map_err(|e: String| anyhow::anyhow!("device in the config file: {e}"))?,
            (None, None) => super::device::DeviceArg::Auto,
        },
        max_running: args
            .max_running
            .or(file.max_running)
            .unwrap_or(engine.max_running),
        max_waiting: args
            .max_waiting
            .or(file.max_waiting)
            .unwrap_or(engine.max_waiting),
        kv_budget: match (args.kv_budget, file.kv_budget) {
            (Some(b), _) => (b, true),
            (None, Some(b)) => (
                b.parse()
                    .map_err(|e: String| anyhow::anyhow!("kv_budget in the config file: {e}"))?,
                true,
            ),
            (None, None) => (super::budget::DEFAULT, false),
        },
        prefix_cache: match (args.prefix_cache, file.prefix_cache) {
            (Some(p), _) => p.0,
            (None, Some(p)) => super::budget::parse_prefix_cache(&p)
                .map_err(|e| anyhow::anyhow!("prefix_cache in the config file: {e}"))?,
            (None, None) => engine.prefix_cache,
        },
        kv_store: match args.kv_store.or(file.kv_store) {
            Some(dir) => Some((
                dir,
                match (args.kv_store_max, file.kv_store_max) {
                    (Some(m), _) => m.0,
                    (None, Some(m)) => {
                        m.parse::<super::budget::StoreSize>()
                            .map_err(|e| anyhow::anyhow!("kv_store_max in the config file: {e}"))?
                            .0
                    }
                    (None, None) => super::budget::DEFAULT_STORE_MAX,
                },
            )),
            None => None,
        },
        max_body_bytes: args
            .max_body_bytes
            .or(file.max_body_bytes)
            .unwrap_or(DEFAULT_MAX_BODY_BYTES),
        max_n: args.max_n.or(file.max_n).unwrap_or(1),
        default_method: args
            .default_kv_cache_method
            .or(file.default_kv_cache_method),
        cache_presets: args.cache_presets.or(file.cache_presets),
        access: kvq_server::Access {
            keys: ApiKeys::from_flags(
                args.api_key.as_ref().map(|k| k.0.as_str()),
                args.api_key_file.or(file.api_key_file).as_deref(),
            )?
            .map(Arc::new),
            metrics_need_key: args.metrics_need_key || file.metrics_need_key.unwrap_or(false),
        },
        serve: {
            let d = ServeOptions::default();
            ServeOptions {
                grace: match args.shutdown_grace.or(file.shutdown_grace) {
                    Some(s) => seconds("--shutdown-grace", s)?,
                    None => d.grace,
                },
                header_timeout: match args.header_timeout.or(file.header_timeout) {
                    Some(s) => seconds("--header-timeout", s)?,
                    None => d.header_timeout,
                },
                max_header_bytes: args
                    .max_header_bytes
                    .or(file.max_header_bytes)
                    .unwrap_or(d.max_header_bytes),
                max_connections: args
                    .max_connections
                    .or(file.max_connections)
                    .unwrap_or(d.max_connections),
            }
        },
        request_timeout: args
            .request_timeout
            .or(file.request_timeout)
            .map(|s| seconds("--request-timeout", s))
            .transpose()?,
    })
}

/// `s` seconds as a duration; negative, NaN or infinite is an error naming `flag`.
fn seconds(flag: &str, s: f64) -> anyhow::Result<std::time::Duration> {
    std::time::Duration::try_from_secs_f64(s)
        .map_err(|_| anyhow::anyhow!("{flag} must be a number of seconds, 0 or more; got {s}"))
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let args = settings(args)?;
    anyhow::ensure!(args.max_running >= 1, "--max-running must be at least 1");
    anyhow::ensure!(args.max_n >= 1, "--max-n must be at least 1");
    anyhow::ensure!(
        args.serve.max_connections >= 1,
        "--max-connections must be at least 1"
    );
    anyhow::ensure!(
        args.serve.max_header_bytes >= 8192,
        "--max-header-bytes must be at least 8192"
    );
    let choice = resolve_model(args.model.as_deref()).await?;
    let model = load_with_progress(&choice, args.device).await?;
    let (budget, given) = args.kv_budget;
    let kv_budget = match budget.resolve(model.model.device()) {
        Ok((bytes, how)) => {
            let shown = bytes.map_or("none".into(), kvq_engine::error::human_bytes);
            eprintln!("kvq KV budget: {shown} ({how}; --kv-budget)");
            bytes
        }
        Err(e) if !given => {
            tracing::warn!("no KV budget: {e:#}");
            None
        }
        Err(e) => return Err(e),
    };
    match args.prefix_cache {
        Some(b) => eprintln!(
            "kvq prefix cache: up to {} of ended requests' caches, inside the KV budget (--prefix-cache)",
            kvq_engine::error::human_bytes(b)
        ),
        None => eprintln!("kvq prefix cache: off (--prefix-cache)"),
    }
    let defaults = EngineConfig::default();
    let kv_store = match &args.kv_store {
        Some((dir, max)) => Some(Arc::new(open_store(
            dir,
            *max,
            &choice.path,
            &args,
            defaults.prefill_chunk,
            model.model.cache_geometries().len(),
        )?)),
        None => None,
    };
    let config = EngineConfig {
        max_running: args.max_running,
        max_waiting: args.max_waiting,
        kv_budget,
        prefix_cache: args.prefix_cache,
        kv_store,
        ..defaults
    };
    let engine = Engine::start(model, config);
    // VecInfer finds (or makes, on first use) the calibration of this model on its own.
    let mut registry = registry_for(&choice.path);
    super::presets::load(&mut registry, args.cache_presets.as_deref())?;
    if let Some(m) = &args.default_method {
        registry.set_default(m)?;
    }
    let registry = Arc::new(registry);
    tracing::info!(methods = %registry.names().join(", "), default = registry.default_method(), "kv cache methods");
    let state = AppState {
        engine,
        registry,
        metrics: install_metrics(),
        limits: ServerLimits {
            max_body_bytes: args.max_body_bytes,
            max_n: args.max_n,
            request_timeout: args.request_timeout,
        },
        access: args.access.clone(),
        lifecycle: Default::default(),
    };
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .with_context(|| format!("could not listen on {}:{}", args.host, args.port))?;
    let addr = listener
        .local_addr()
        .context("could not read the bound address")?;
    match &args.access.keys {
        Some(keys) => tracing::info!(keys = keys.len(), "API keys required on /v1"),
        None if !addr.ip().is_loopback() => tracing::warn!(
            %addr,
            "listening beyond this machine without an API key: anyone who can reach it may use \
             it (set --api-key or KVQ_API_KEY)"
        ),
        None => {}
    }
    eprintln!("kvq listening on http://{addr}");
    let engine = state.engine.clone();
    let served = serve(listener, state, args.serve).await;
    if args.kv_store.is_some() {
        // The open requests are done: what the prefix cache holds goes to disk.
        let started = std::time::Instant::now();
        let saved = tokio::task::spawn_blocking(move || engine.persist())
            .await
            .unwrap_or(0);
        eprintln!(
            "kvq kv store: saved {saved} held prefixes in {:.2} s",
            started.elapsed().as_secs_f64()
        );
    }
    served.context("the server failed")?;
    tracing::info!("stopped");
    Ok(())
}

/// Opens the KV store in `dir` (at most `max` bytes) for the model at `model_path`, printing
/// what it holds.
fn open_store(
    dir: &std::path::Path,
    max: u64,
    model_path: &std::path::Path,
    args: &Settings,
    chunk: usize,
    n_layers: usize,
) -> anyhow::Result<kvq_engine::KvStore> {
    anyhow::ensure!(
        args.prefix_cache.is_some(),
        "--kv-store saves the prefix cache's entries: it needs --prefix-cache on"
    );
    let started = std::time::Instant::now();
    let model_hash = kvq_server::calibration::model_hash(model_path)
        .map_err(|e| anyhow::anyhow!("--kv-store needs the model's identity: {e}"))?;
    let config = kvq_engine::KvStoreConfig {
        dir: dir.to_path_buf(),
        max_bytes: max,
        model_hash,
    };
    let store = kvq_engine::KvStore::open(config, chunk, n_layers)?;
    let st = store.stats();
    eprintln!(
        "kvq kv store: {} holds {} prefixes ({} of at most {}; read in {:.2} s) (--kv-store)",
        dir.display(),
        st.files,
        kvq_engine::error::human_bytes(st.bytes as usize),
        kvq_engine::error::human_bytes(max as usize),
        started.elapsed().as_secs_f64()
    );
    Ok(store)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_cache_flag_parses() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            serve: ServeArgs,
        }
        use clap::Parser;
        for (arg, want) in [("512MiB", Some(512 << 20)), ("off", None)] {
            let cli = Cli::try_parse_from(["kvq", "--prefix-cache", arg]).expect("parses");
            let s = settings(cli.serve).expect("settings");
            assert_eq!(s.prefix_cache, want, "{arg}");
        }
        assert!(Cli::try_parse_from(["kvq", "--prefix-cache", "lots"]).is_err());
        let s = settings(Cli::try_parse_from(["kvq"]).expect("parses").serve).expect("settings");
        assert_eq!(s.prefix_cache, EngineConfig::default().prefix_cache);
    }

    fn args(config: Option<PathBuf>, port: Option<u16>) -> ServeArgs {
        ServeArgs {
            config,
            host: None,
            port,
            model: None,
            device: None,
            max_running: None,
            max_waiting: None,
            kv_budget: None,
            prefix_cache: None,
            kv_store: None,
            kv_store_max: None,
            max_body_bytes: None,
            max_n: None,
            default_kv_cache_method: None,
            cache_presets: None,
            api_key: None,
            api_key_file: None,
            metrics_need_key: false,
            shutdown_grace: None,
            request_timeout: None,
            header_timeout: None,
            max_header_bytes: None,
            max_connections: None,
        }
    }

    #[test]
    fn device_comes_from_the_flag_then_the_file_and_a_bad_one_is_an_error() {
        use super::super::device::DeviceArg;
        let dir = std::env::temp_dir().join(format!("kvq-serve-device-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("server.toml");
        std::fs::write(&file, "device = \"cpu\"\n").unwrap();
        assert_eq!(settings(args(None, None)).unwrap().device, DeviceArg::Auto);
        assert_eq!(
            settings(args(Some(file.clone()), None)).unwrap().device,
            DeviceArg::Cpu
        );
        let mut a = args(Some(file.clone()), None);
        a.device = Some(DeviceArg::Cuda(1));
        assert_eq!(settings(a).unwrap().device, DeviceArg::Cuda(1));
        std::fs::write(&file, "device = \"tpu\"\n").unwrap();
        let err = format!("{:#}", settings(args(Some(file), None)).err().unwrap());
        assert!(err.contains("unknown device 'tpu'"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn the_shipped_config_parses_and_flags_win() {
        let shipped = PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../configs/server.toml"
        ));
        let s = settings(args(Some(shipped.clone()), None)).unwrap();
        assert_eq!((s.host.as_str(), s.port), ("127.0.0.1", 8080));
        assert_eq!(s.default_method.as_deref(), Some("fp16"));
        let s = settings(args(Some(shipped), Some(9000))).unwrap();
        assert_eq!(s.port, 9000);
        let s = settings(args(None, None)).unwrap();
        assert_eq!(
            (s.max_running, s.max_body_bytes),
            (16, DEFAULT_MAX_BODY_BYTES)
        );
    }

    #[test]
    fn unknown_config_keys_are_rejected() {
        let p = std::env::temp_dir().join(format!("kvq-serve-{}.toml", std::process::id()));
        std::fs::write(&p, "prot = 1\n").unwrap();
        let err = settings(args(Some(p.clone()), None)).err().unwrap();
        assert!(format!("{err:#}").contains("prot"), "{err:#}");
        let _ = std::fs::remove_file(p);
    }
}
