//! `idem`: the operators' tool for the markers of idem's handlers.
//!
//! Every input is checked before the database is touched: bad input exits with code 2, a
//! database that cannot be reached or that refuses a statement with code 1, an `inspect` that
//! finds no marker with code 3. See `docs/cli.md`.

mod args;
mod bulk;
mod console;
mod doctor;
mod failed;
mod outbox;
mod render;
mod retention;
mod run;
mod sweep;
mod target;

use std::process::ExitCode;

use clap::Parser as _;

/// Why the tool stopped, and the exit code that tells scripts which kind of stop it was.
#[derive(Debug)]
pub(crate) struct Failure {
    code: u8,
    message: String,
}

impl Failure {
    /// Input that the tool refused before connecting (exit code 2, like clap's usage errors).
    pub(crate) fn input(message: impl Into<String>) -> Failure {
        Failure {
            code: 2,
            message: message.into(),
        }
    }

    /// The command ran but could not do what it was asked (exit codes 3 and up).
    pub(crate) fn refused(code: u8, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
        }
    }

    /// The database could not be reached, or refused a statement (exit code 1).
    pub(crate) fn database(message: impl Into<String>) -> Failure {
        Failure {
            code: 1,
            message: message.into(),
        }
    }

    /// What went wrong, as the tool prints it after `error: `.
    pub(crate) fn message(&self) -> &str {
        &self.message
    }

    /// Whether the database stopped the command.
    pub(crate) fn is_database(&self) -> bool {
        self.code == 1
    }
}

fn main() -> ExitCode {
    let cli = args::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run::run(cli)) {
        Ok(code) => code,
        Err(failure) => {
            eprintln!("error: {}", failure.message);
            ExitCode::from(failure.code)
        }
    }
}
