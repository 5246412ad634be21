//! What the measurement examples (`hedging`, `throttle`, `retry_storm`) share: their
//! command line of `--flag N` options, their `main` (a usage error exits 2, a failed
//! run 1, and the run's last stdout line is its JSON), and the loopback servers they
//! measure.

use std::future::Future;
use std::net::SocketAddr;
use std::process::ExitCode;

use axum::Router;

/// The error of a run.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The `--flag VALUE` pairs of the command line, in order. An argument that is not
/// UTF-8, or a flag without a value, is an error that names it.
pub fn flags() -> Result<Vec<(String, String)>, String> {
    let mut args = std::env::args_os()
        .skip(1)
        .map(|a| {
            a.into_string()
                .map_err(|a| format!("argument {a:?} is not valid UTF-8"))
        })
        .collect::<Result<Vec<String>, String>>()?
        .into_iter();
    let mut pairs = Vec::new();
    while let Some(flag) = args.next() {
        let value = args.next().ok_or_else(|| format!("{flag} needs a value"))?;
        pairs.push((flag, value));
    }
    Ok(pairs)
}

/// `value` of `flag` as a whole number.
pub fn number(flag: &str, value: &str) -> Result<u64, String> {
    value
        .parse::<u64>()
        .map_err(|_| format!("{flag}: not a number: {value}"))
}

/// `value` of `flag` as a count in `1..=max`.
pub fn count(flag: &str, value: &str, max: u32) -> Result<u32, String> {
    u32::try_from(number(flag, value)?)
        .ok()
        .filter(|n| (1..=max).contains(n))
        .ok_or_else(|| format!("{flag}: out of range: {value}"))
}

/// The `main` of a measurement: options from `parse` (on an error, the error and
/// `usage` on stderr, exit code 2), then `run`, whose answer is printed as the last
/// stdout line (on an error, the error on stderr, exit code 1).
#[allow(
    clippy::print_stdout,
    reason = "the answer of a run is its last stdout line"
)]
pub async fn main<O, F>(
    usage: &str,
    parse: impl FnOnce() -> Result<O, String>,
    run: impl FnOnce(O) -> F,
) -> ExitCode
where
    F: Future<Output = Result<String, BoxError>>,
{
    let options = match parse() {
        Ok(o) => o,
        Err(e) => {
            eprintln!("error: {e}");
            eprintln!("usage: {usage}");
            return ExitCode::from(2);
        }
    };
    match run(options).await {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Serves `router` on a fresh loopback port, in a task of its own (an error of the
/// server is printed, not returned); its address.
pub async fn serve(router: Router) -> Result<SocketAddr, BoxError> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            eprintln!("server error: {e}");
        }
    });
    Ok(addr)
}
