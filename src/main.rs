//! The `titan` binary.

use clap::Parser;

fn main() {
    // A worker of titan's launcher ends with it, whatever it is doing (no-op otherwise).
    titan::launch::orphan::exit_with_launcher();
    // Flags and `--section.key VALUE` overrides in any order (see `overrides_last`).
    let args = titan::cli::overrides_last(
        std::env::args_os()
            .map(|a| a.to_string_lossy().into_owned())
            .collect(),
    );
    let cli = titan::cli::Cli::parse_from(args);
    let outcome = titan::cli::run(cli);
    // A rank leaves no socket of its own behind, nor its job's empty socket folder.
    titan::comm::conn::remove_own_sockets();
    if let Err(e) = outcome {
        // A rank of a job with the flight recorder on leaves its dump (no-op otherwise).
        titan::comm::flight_recorder::dump_once(&format!("this rank failed: {e:#}"));
        titan::errln!("error: {e:#}");
        std::process::exit(1);
    }
}
