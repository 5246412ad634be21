//! `retrysafe-conformance`: checks an HTTP endpoint that honours `Idempotency-Key`
//! against the retrysafe wire convention. `retrysafe-conformance --help` for usage.
#![allow(clippy::print_stdout, reason = "a command that prints its report")]

use std::process::ExitCode;

use retrysafe_conformance::{Command, RULES, USAGE, check, parse_args};

fn main() -> ExitCode {
    let options = match parse_args(std::env::args_os().skip(1)) {
        Ok(Command::Check(options)) => options,
        Ok(Command::Help) => {
            println!("{USAGE}");
            return ExitCode::SUCCESS;
        }
        Ok(Command::List) => {
            for rule in RULES {
                println!("{} {} [{}]", rule.id, rule.title, rule.section_ref());
            }
            return ExitCode::SUCCESS;
        }
        Err(e) => {
            eprintln!("error: {e}");
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let report = runtime.block_on(check(&options));
    if options.json() {
        println!("{}", report.to_json());
    } else {
        print!("{}", report.to_text());
    }
    if report.failed() == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
