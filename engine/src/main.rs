use anyhow::Result;
use clap::{Parser, Subcommand};
use engine::runtime;

/// An LLM engine on MLX.
#[derive(Parser)]
#[command(name = "engine", disable_version_flag = true)]
struct Cli {
    /// Print the engine version, the MLX runtime version, the backend and the default device.
    #[arg(short = 'V', long)]
    version: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Check the MLX runtime: versions, where libmlx came from, memory counters, a self-check.
    Doctor,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::Doctor) => doctor(),
        None if cli.version => {
            print_version();
            Ok(())
        }
        None => {
            use clap::CommandFactory;
            Cli::command().print_help()?;
            Ok(())
        }
    }
}

fn print_version() {
    println!("engine {}", engine::VERSION);
    println!("MLX {}", runtime::mlx_version());
    println!("backend {}", runtime::backend());
    println!("device {}", runtime::default_device());
}

fn doctor() -> Result<()> {
    print_version();
    println!(
        "accelerator available: {}",
        if runtime::accelerator_available() {
            "yes"
        } else {
            "no"
        }
    );
    println!(
        "libmlx built against: MLX {} from {}",
        runtime::BUILD_MLX_VERSION,
        runtime::BUILD_MLX_SOURCE
    );
    match runtime::loaded_library_path() {
        Some(path) => println!("libmlx loaded from: {}", path.display()),
        None => println!(
            "libmlx loaded from: (not reported by this OS; rpath {})",
            runtime::BUILD_MLX_LIB_DIR
        ),
    }
    let version = runtime::mlx_version();
    if version != runtime::BUILD_MLX_VERSION {
        anyhow::bail!(
            "the loaded libmlx is MLX {version} but this binary was built for {}: rebuild, \
             or remove the stray libmlx from LD_LIBRARY_PATH",
            runtime::BUILD_MLX_VERSION
        );
    }
    runtime::reset_peak_memory()?;
    runtime::self_check()?;
    let mem = runtime::memory()?;
    println!(
        "memory: active {} B, peak {} B, cache {} B",
        mem.active, mem.peak, mem.cache
    );
    println!("self-check: ok (matmul, add, sum)");
    Ok(())
}
