//! A curl-like client over reqwest-middleware with retrysafe's middleware:
//!
//! ```text
//! cargo run --example fetch -- URL [-X METHOD] [-d DATA] [-H 'K: V']... \
//!     [--deadline-ms N] [--max-attempts N] [--idempotency-key auto|none|KEY]
//! ```
//!
//! The request goes through `DeadlineMiddleware` (with `--deadline-ms`; it bounds the
//! whole call, response body included) → `RetryMiddleware` (the standard strategy,
//! `--max-attempts` attempts, default 3) → `CircuitBreakerMiddleware` → reqwest. The
//! retry middleware retries only what is safe to retry: GET, HEAD, PUT, DELETE… and a
//! request carrying an `Idempotency-Key`. A POST is retried only when you vouch for the
//! server: `--idempotency-key auto` generates a key (the same on every attempt),
//! `--idempotency-key KEY` sends `Idempotency-Key: KEY`; the default, `none`, sends a
//! POST once (unless nothing was sent at all, such as a refused connection).
//!
//! `-d DATA` sends DATA as the body, with `content-type:
//! application/x-www-form-urlencoded` unless a `-H` sets one, and makes the method POST
//! unless `-X` says otherwise (as curl does). `-H` may be repeated. Long forms
//! `--request`, `--data` and `--header`, and `--option=value`, work too.
//!
//! The response body is written to stdout, and one JSON line to stderr:
//! `{"status": integer|null, "attempts": integer, "idempotency_key": string|null,
//! "elapsed_ms": integer, "error": string|null}` — `attempts` counts the requests
//! actually sent, `idempotency_key` is the key they carried. The exit code is 0 when a
//! response arrived (whatever its status) and its body was read, 1 on a transport or
//! deadline failure, and 2 (with the usage on stderr) for bad arguments.
//!
//! ```text
//! $ cargo run --example fetch -- http://127.0.0.1:8080/payments -d '{"account":"a","amount_cents":5}' \
//!       -H 'content-type: application/json' --idempotency-key auto --deadline-ms 2000
//! ```

use std::error::Error as StdError;
use std::io::Write;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use http::{Extensions, HeaderMap, HeaderName, HeaderValue, Method};
use reqwest::Url;
use reqwest_middleware::{ClientBuilder, ClientWithMiddleware, Middleware, Next};
use retrysafe::reqwest::{CircuitBreakerMiddleware, DeadlineMiddleware, RetryMiddleware};
use retrysafe::retry::StandardRetryStrategy;
use retrysafe::wire::IdempotencyKey;
use serde_json::json;
use tokio::time::Instant;

/// The future a reqwest-middleware `Middleware` function returns.
type BoxFuture<'a, T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send + 'a>>;

const USAGE: &str = "usage: fetch URL [-X METHOD] [-d DATA] [-H 'K: V']... [--deadline-ms N] \
                     [--max-attempts N] [--idempotency-key auto|none|KEY]";

/// What `--idempotency-key` asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
enum KeyChoice {
    /// No key: a POST is sent once.
    None,
    /// A generated key for POST and PATCH.
    Auto,
    /// This key, as the `Idempotency-Key` header.
    Given(String),
}

/// The parsed command line.
#[derive(Debug)]
struct Options {
    url: Url,
    method: Method,
    data: Option<String>,
    headers: HeaderMap,
    deadline: Option<Duration>,
    max_attempts: u32,
    key: KeyChoice,
}

/// What the command line asks for.
enum Command {
    Fetch(Box<Options>),
    Help,
}

fn parse(args: &[String]) -> Result<Command, String> {
    let mut url = None;
    let mut method = None;
    let mut data = None;
    let mut headers = HeaderMap::new();
    let mut deadline = None;
    let mut max_attempts = None;
    let mut key = None;

    let mut args = args.iter();
    while let Some(arg) = args.next() {
        // `--name=value` or `--name value`.
        let (name, inline) = match arg.split_once('=') {
            Some((name, value)) if name.starts_with("--") => (name, Some(value.to_owned())),
            _ => (arg.as_str(), None),
        };
        let mut value = |what: &str| -> Result<String, String> {
            inline
                .clone()
                .or_else(|| args.next().cloned())
                .ok_or_else(|| format!("{name} needs {what}"))
        };
        match name {
            "-h" | "--help" => return Ok(Command::Help),
            "-X" | "--request" => {
                let m = value("a method")?;
                let m = Method::from_bytes(m.as_bytes())
                    .map_err(|_| format!("invalid method {m:?}"))?;
                once(&mut method, m, name)?;
            }
            "-d" | "--data" => once(&mut data, value("data")?, name)?,
            "-H" | "--header" => {
                let h = value("a header 'K: V'")?;
                let (k, v) = h
                    .split_once(':')
                    .ok_or_else(|| format!("header {h:?} is not 'K: V'"))?;
                let k = HeaderName::from_bytes(k.trim().as_bytes())
                    .map_err(|_| format!("invalid header name in {h:?}"))?;
                let v = HeaderValue::from_str(v.trim())
                    .map_err(|_| format!("invalid header value in {h:?}"))?;
                headers.append(k, v);
            }
            "--deadline-ms" => {
                let n = value("a number of milliseconds")?;
                let ms: u64 =
                    n.parse().ok().filter(|ms| *ms > 0).ok_or_else(|| {
                        format!("--deadline-ms {n:?}: expected a positive integer")
                    })?;
                once(&mut deadline, Duration::from_millis(ms), name)?;
            }
            "--max-attempts" => {
                let n = value("a number")?;
                let attempts: u32 = n
                    .parse()
                    .ok()
                    .filter(|n| (1..=100).contains(n))
                    .ok_or_else(|| format!("--max-attempts {n:?}: expected 1 to 100"))?;
                once(&mut max_attempts, attempts, name)?;
            }
            "--idempotency-key" => {
                let k = value("auto, none or a key")?;
                let choice = match k.as_str() {
                    "auto" => KeyChoice::Auto,
                    "none" => KeyChoice::None,
                    _ => {
                        IdempotencyKey::parse(k.as_bytes())
                            .map_err(|e| format!("--idempotency-key {k:?}: {e}"))?;
                        KeyChoice::Given(k)
                    }
                };
                once(&mut key, choice, name)?;
            }
            _ if name.starts_with('-') && name.len() > 1 => {
                return Err(format!("unknown option {name}"));
            }
            _ => {
                let parsed = Url::parse(arg).map_err(|e| format!("invalid URL {arg:?}: {e}"))?;
                if !matches!(parsed.scheme(), "http" | "https") {
                    return Err(format!("invalid URL {arg:?}: not http or https"));
                }
                once(&mut url, parsed, "URL")?;
            }
        }
    }

    let url = url.ok_or("no URL")?;
    let method = method.unwrap_or(if data.is_some() {
        Method::POST
    } else {
        Method::GET
    });
    Ok(Command::Fetch(Box::new(Options {
        url,
        method,
        data,
        headers,
        deadline,
        max_attempts: max_attempts.unwrap_or(3),
        key: key.unwrap_or(KeyChoice::None),
    })))
}

/// Sets an option given at most once.
fn once<T>(slot: &mut Option<T>, value: T, name: &str) -> Result<(), String> {
    if slot.replace(value).is_some() {
        return Err(format!("{name} given twice"));
    }
    Ok(())
}

/// What the lowest middleware saw: the requests actually handed to reqwest, and the
/// idempotency key they carried.
#[derive(Clone, Default)]
struct Sent {
    attempts: Arc<AtomicU32>,
    key: Arc<Mutex<Option<String>>>,
}

impl Sent {
    /// The middleware counting into `self` (a closure: reqwest-middleware implements
    /// `Middleware` for functions of this shape).
    fn middleware(&self) -> impl Middleware {
        let sent = self.clone();
        as_middleware(move |request, extensions, next| {
            sent.attempts.fetch_add(1, Ordering::SeqCst);
            if let Some(key) = request.headers().get("idempotency-key")
                && let Ok(mut slot) = sent.key.lock()
            {
                *slot = Some(String::from_utf8_lossy(key.as_bytes()).into_owned());
            }
            next.run(request, extensions)
        })
    }
}

/// Gives a closure the signature (for every lifetime) that makes it a `Middleware`.
fn as_middleware<F>(f: F) -> F
where
    F: for<'a> Fn(
            reqwest::Request,
            &'a mut Extensions,
            Next<'a>,
        ) -> BoxFuture<'a, reqwest_middleware::Result<reqwest::Response>>
        + Send
        + Sync
        + 'static,
{
    f
}

fn client(options: &Options, sent: &Sent) -> Result<ClientWithMiddleware, String> {
    let strategy = StandardRetryStrategy::new()
        .max_attempts(options.max_attempts)
        .build()
        .map_err(|e| e.to_string())?;
    let mut retry = RetryMiddleware::new().strategy(strategy);
    if options.key == KeyChoice::Auto {
        retry = retry.generate_idempotency_keys();
    }
    let mut builder = ClientBuilder::new(reqwest::Client::new());
    if let Some(deadline) = options.deadline {
        let deadline = DeadlineMiddleware::new(deadline)
            .build()
            .map_err(|e| e.to_string())?;
        builder = builder.with(deadline.bound_body());
    }
    Ok(builder
        .with(retry)
        .with(CircuitBreakerMiddleware::default())
        .with(sent.middleware())
        .build())
}

/// What came of the call: the status, if a response arrived, and the error, if any.
async fn fetch(client: &ClientWithMiddleware, options: Options) -> (Option<u16>, Option<String>) {
    let mut request = client.request(options.method, options.url);
    let mut headers = options.headers;
    if let KeyChoice::Given(key) = &options.key
        && let Ok(value) = HeaderValue::from_str(key)
    {
        headers.insert("idempotency-key", value);
    }
    if let Some(data) = options.data {
        if !headers.contains_key(http::header::CONTENT_TYPE) {
            headers.insert(
                http::header::CONTENT_TYPE,
                HeaderValue::from_static("application/x-www-form-urlencoded"),
            );
        }
        request = request.body(data);
    }
    let mut response = match request.headers(headers).send().await {
        Ok(response) => response,
        Err(error) => return (None, Some(describe(root(&error)))),
    };
    let status = Some(response.status().as_u16());
    let mut stdout = std::io::stdout().lock();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => {
                if let Err(error) = stdout.write_all(&chunk) {
                    return (status, Some(format!("writing the body: {error}")));
                }
            }
            Ok(None) => break,
            Err(error) => return (status, Some(describe(&error))),
        }
    }
    match stdout.flush() {
        Ok(()) => (status, None),
        Err(error) => (status, Some(format!("writing the body: {error}"))),
    }
}

/// The error a `reqwest_middleware::Error` stands for (its `source()` skips it).
fn root(error: &reqwest_middleware::Error) -> &(dyn StdError + 'static) {
    match error {
        reqwest_middleware::Error::Middleware(payload) => &**payload,
        reqwest_middleware::Error::Reqwest(error) => error,
    }
}

/// An error and its sources, `: `-separated.
fn describe(error: &(dyn StdError + 'static)) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut current = Some(error);
    while let Some(e) = current {
        let text = e.to_string();
        if parts.last() != Some(&text) {
            parts.push(text);
        }
        current = e.source();
    }
    parts.join(": ")
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let options = match std::env::args_os()
        .skip(1)
        .map(|a| {
            a.into_string()
                .map_err(|a| format!("argument {a:?} is not valid UTF-8"))
        })
        .collect::<Result<Vec<String>, String>>()
        .and_then(|args| parse(&args))
    {
        Ok(Command::Fetch(options)) => *options,
        Ok(Command::Help) => {
            let _ = writeln!(std::io::stdout(), "{USAGE}");
            return ExitCode::SUCCESS;
        }
        Err(message) => {
            eprintln!("fetch: {message}");
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };
    let sent = Sent::default();
    let client = match client(&options, &sent) {
        Ok(client) => client,
        Err(message) => {
            eprintln!("fetch: {message}");
            eprintln!("{USAGE}");
            return ExitCode::from(2);
        }
    };

    let started = Instant::now();
    let (status, error) = fetch(&client, options).await;
    let elapsed_ms = u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX);
    let key = sent.key.lock().ok().and_then(|key| key.clone());
    // The fields in the documented order (a `json!` map would sort them).
    let report = format!(
        r#"{{"status": {}, "attempts": {}, "idempotency_key": {}, "elapsed_ms": {}, "error": {}}}"#,
        json!(status),
        sent.attempts.load(Ordering::SeqCst),
        json!(key),
        elapsed_ms,
        json!(error),
    );
    eprintln!("{report}");
    if status.is_some() && error.is_none() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
