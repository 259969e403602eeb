//! The `titan` binary.

use clap::Parser;

fn main() {
    let cli = titan::cli::Cli::parse();
    if let Err(e) = titan::cli::run(cli) {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
