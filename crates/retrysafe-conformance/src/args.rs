//! The command line.

use std::ffi::OsString;
use std::fmt;

use crate::http::{Origin, Request};

/// How the command is used.
pub const USAGE: &str = "\
usage: retrysafe-conformance --url URL [--header 'NAME: VALUE']... [--body JSON]
                             [--ledger-url URL] [--method POST|PATCH] [--json]
       retrysafe-conformance --list | --help

  --url URL          the endpoint to check (http://), a POST with an effect
  --header 'N: V'    sent with every request, and with the ledger's GET (repeatable)
  --body JSON        the request body (default {}), sent as application/json
  --ledger-url URL   a GET that counts the endpoint's effects: a JSON array, or an
                     object with a count member; without it effects are not counted
  --method M         POST (default) or PATCH
  --json             one JSON document instead of lines
  --list             the rules, one per line
Exit status: 0 when no rule failed, 1 when one did, 2 for a usage error.";

/// Headers the checker sends itself, or that would change what it checks.
const RESERVED: [&str; 10] = [
    "idempotency-key",
    "content-length",
    "transfer-encoding",
    "connection",
    "retry-attempt",
    "grpc-previous-rpc-attempts",
    "request-timeout-ms",
    "grpc-timeout",
    "retry-point",
    "expect",
];

/// What the command line asks for.
#[derive(Debug, Clone)]
pub enum Command {
    /// Check an endpoint.
    Check(Box<Options>),
    /// Print the usage.
    Help,
    /// Print the rules.
    List,
}

/// A command line that cannot be run; its message says why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UsageError(String);

impl fmt::Display for UsageError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

fn usage(message: impl Into<String>) -> UsageError {
    UsageError(message.into())
}

/// A URL of an endpoint: where to connect and what to ask for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Target {
    pub(crate) origin: Origin,
    /// Path and query.
    pub(crate) target: String,
    /// The URL as given.
    pub(crate) url: String,
}

impl Target {
    fn parse(flag: &str, url: &str) -> Result<Target, UsageError> {
        let uri: http::Uri = url
            .parse()
            .map_err(|e| usage(format!("{flag} {url:?} is not a URL: {e}")))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(usage(format!(
                    "{flag} {url}: https is not supported; point it at an http:// address \
                     (a local instance, or a port forwarded to one)"
                )));
            }
            _ => return Err(usage(format!("{flag} {url:?} must start with http://"))),
        }
        let (Some(authority), Some(host)) = (uri.authority(), uri.host()) else {
            return Err(usage(format!("{flag} {url:?} has no host")));
        };
        let port = uri.port_u16().unwrap_or(80);
        let target = uri
            .path_and_query()
            .map_or_else(|| "/".to_owned(), |p| p.as_str().to_owned());
        Ok(Target {
            origin: Origin {
                addr: format!("{host}:{port}"),
                authority: authority.as_str().to_owned(),
            },
            target: if target.is_empty() {
                "/".to_owned()
            } else {
                target
            },
            url: url.to_owned(),
        })
    }
}

/// What to check and how: the endpoint, its headers and body, and the ledger.
#[derive(Debug, Clone)]
pub struct Options {
    pub(crate) url: Target,
    pub(crate) method: String,
    pub(crate) headers: Vec<(String, Vec<u8>)>,
    pub(crate) body: serde_json::Value,
    pub(crate) ledger: Option<Target>,
    json: bool,
}

impl Options {
    /// Whether the report is asked for as JSON (`--json`).
    pub fn json(&self) -> bool {
        self.json
    }

    /// The endpoint's request without a key: method, target, the user's headers, the
    /// body as JSON.
    pub(crate) fn request(&self) -> Request {
        let mut headers = self.headers.clone();
        if !headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case("content-type"))
        {
            headers.push(("content-type".to_owned(), b"application/json".to_vec()));
        }
        Request {
            method: self.method.clone(),
            target: self.url.target.clone(),
            headers,
            body: self.body.to_string().into_bytes(),
        }
    }

    /// The ledger's GET, with the user's headers.
    pub(crate) fn ledger_request(&self) -> Option<(Origin, Request)> {
        let ledger = self.ledger.as_ref()?;
        Some((
            ledger.origin.clone(),
            Request {
                method: "GET".to_owned(),
                target: ledger.target.clone(),
                headers: self.headers.clone(),
                body: Vec::new(),
            },
        ))
    }
}

/// Parses the command line (without the program name).
pub fn parse_args(args: impl IntoIterator<Item = OsString>) -> Result<Command, UsageError> {
    let mut url = None;
    let mut ledger = None;
    let mut headers = Vec::new();
    let mut body = None;
    let mut method = "POST".to_owned();
    let mut json = false;
    let mut args = args.into_iter().map(|a| {
        a.into_string()
            .map_err(|a| usage(format!("argument {a:?} is not valid UTF-8")))
    });
    while let Some(flag) = args.next() {
        let flag = flag?;
        let mut value = || {
            args.next()
                .unwrap_or_else(|| Err(usage(format!("{flag} needs a value"))))
        };
        match flag.as_str() {
            "--url" => url = Some(Target::parse("--url", &value()?)?),
            "--ledger-url" => ledger = Some(Target::parse("--ledger-url", &value()?)?),
            "--header" | "-H" => headers.push(header(&value()?)?),
            "--body" => {
                let text = value()?;
                let parsed = serde_json::from_str(&text)
                    .map_err(|e| usage(format!("--body is not JSON ({e}): {text}")))?;
                body = Some(parsed);
            }
            "--method" | "-X" => {
                method = value()?.to_ascii_uppercase();
                if method != "POST" && method != "PATCH" {
                    return Err(usage(format!(
                        "--method {method}: POST or PATCH (the methods a server guards)"
                    )));
                }
            }
            "--json" => json = true,
            "--help" | "-h" => return Ok(Command::Help),
            "--list" => return Ok(Command::List),
            other => return Err(usage(format!("unknown argument {other:?}"))),
        }
    }
    let url = url.ok_or_else(|| usage("--url is required"))?;
    Ok(Command::Check(Box::new(Options {
        url,
        method,
        headers,
        body: body.unwrap_or_else(|| serde_json::json!({})),
        ledger,
        json,
    })))
}

/// `NAME: VALUE`.
fn header(text: &str) -> Result<(String, Vec<u8>), UsageError> {
    let Some((name, value)) = text.split_once(':') else {
        return Err(usage(format!("--header {text:?} must be 'NAME: VALUE'")));
    };
    let name = name.trim();
    let token = !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"!#$%&'*+-.^_`|~".contains(&b));
    if !token {
        return Err(usage(format!(
            "--header {text:?}: {name:?} is not a header name"
        )));
    }
    if RESERVED.iter().any(|r| name.eq_ignore_ascii_case(r)) {
        return Err(usage(format!(
            "--header {name}: the checker sets this header itself (reserved: {})",
            RESERVED.join(", ")
        )));
    }
    let value = value.trim();
    if value.bytes().any(|b| b.is_ascii_control() && b != b'\t') {
        return Err(usage(format!(
            "--header {name}: the value holds a control character"
        )));
    }
    Ok((name.to_ascii_lowercase(), value.as_bytes().to_vec()))
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Command, UsageError> {
        parse_args(args.iter().map(OsString::from))
    }

    fn options(args: &[&str]) -> Options {
        match parse(args).unwrap() {
            Command::Check(o) => *o,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_full_command_line_is_read() {
        let o = options(&[
            "--url",
            "http://127.0.0.1:8080/payments?x=1",
            "--header",
            "Authorization: Bearer t",
            "-H",
            "x-tenant:a",
            "--body",
            r#"{"a":1}"#,
            "--ledger-url",
            "http://localhost/ledger",
            "--method",
            "patch",
            "--json",
        ]);
        assert_eq!(o.url.origin.addr, "127.0.0.1:8080");
        assert_eq!(o.url.origin.authority, "127.0.0.1:8080");
        assert_eq!(o.url.target, "/payments?x=1");
        assert_eq!(
            o.headers,
            [
                ("authorization".to_owned(), b"Bearer t".to_vec()),
                ("x-tenant".to_owned(), b"a".to_vec())
            ]
        );
        assert_eq!(o.method, "PATCH");
        assert!(o.json());
        let ledger = o.ledger.as_ref().unwrap();
        assert_eq!(
            (ledger.origin.addr.as_str(), ledger.target.as_str()),
            ("localhost:80", "/ledger")
        );
        let request = o.request();
        assert_eq!(request.body, br#"{"a":1}"#);
        assert!(
            request
                .headers
                .contains(&("content-type".to_owned(), b"application/json".to_vec()))
        );
    }

    #[test]
    fn bad_command_lines_say_what_is_wrong() {
        for (args, needle) in [
            (&[][..], "--url is required"),
            (&["--url"], "--url needs a value"),
            (&["--url", "https://api/x"], "https is not supported"),
            (&["--url", "ftp://api/x"], "must start with http://"),
            (&["--url", "http://a/", "--body", "{"], "--body is not JSON"),
            (
                &["--url", "http://a/", "--header", "nocolon"],
                "must be 'NAME: VALUE'",
            ),
            (
                &["--url", "http://a/", "--header", "Idempotency-Key: k"],
                "sets this header itself",
            ),
            (&["--url", "http://a/", "--method", "GET"], "POST or PATCH"),
            (&["--url", "http://a/", "--colour"], "unknown argument"),
        ] {
            let e = parse(args).unwrap_err();
            assert!(e.to_string().contains(needle), "{args:?}: {e}");
        }
        assert!(matches!(parse(&["--help"]), Ok(Command::Help)));
        assert!(matches!(parse(&["--list"]), Ok(Command::List)));
    }
}
