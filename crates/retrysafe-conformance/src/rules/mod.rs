//! The rules, what they share, and the order they run in.

mod copies;
mod documents;
mod headers;
mod keys;
mod replay;
mod table;

use std::future::Future;
use std::pin::Pin;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use crate::check::{describe, describe_exchange, retry_after_delay, slug};
use crate::http::{self, Answer, Exchange, Origin, Request};
use crate::report::{Report, Verdict};
use crate::{Options, Rule};

pub use table::RULES;
use table::*;

/// A rule that sends requests.
type Check = for<'c> fn(&'c Ctx<'_>) -> Pin<Box<dyn Future<Output = Finding> + Send + 'c>>;

/// The rules that send requests, after the replay rules, in the order they run.
const CHECKS: [(&Rule, Check); 21] = [
    (&KEY_FORMS, |c| Box::pin(keys::forms(c))),
    (&KEY_ESCAPES, |c| Box::pin(keys::escapes(c))),
    (&KEY_QUOTE_PREFIX, |c| Box::pin(keys::quote_prefix(c))),
    (&KEY_MAX_LENGTH, |c| Box::pin(keys::max_length(c))),
    (&KEY_TOO_LONG, |c| Box::pin(keys::too_long(c))),
    (&KEY_EMPTY, |c| Box::pin(keys::empty(c))),
    (&KEY_INVALID_CHARACTERS, |c| {
        Box::pin(keys::invalid_characters(c))
    }),
    (&KEY_CONTROL_CHARACTERS, |c| {
        Box::pin(keys::control_characters(c))
    }),
    (&KEY_TWICE, |c| Box::pin(keys::twice(c))),
    (&KEY_MISSING, |c| Box::pin(keys::missing(c))),
    (&MISMATCH_BODY, |c| Box::pin(replay::mismatch_body(c))),
    (&MISMATCH_QUERY, |c| Box::pin(replay::mismatch_query(c))),
    (&MISMATCH_CONCURRENT, |c| {
        Box::pin(copies::mismatch_concurrent(c))
    }),
    (&CONCURRENT_COPIES, |c| Box::pin(copies::concurrent(c))),
    (&LOST_REPLY_AFTER_ANSWER, |c| {
        Box::pin(copies::lost_after_answer(c))
    }),
    (&LOST_REPLY_MID_REQUEST, |c| {
        Box::pin(copies::lost_mid_request(c))
    }),
    (&SAME_REQUEST_PER_ATTEMPT_HEADERS, |c| {
        Box::pin(headers::per_attempt(c))
    }),
    (&RETRY_ATTEMPT_PARSING, |c| {
        Box::pin(headers::retry_attempt(c))
    }),
    (&REQUEST_TIMEOUT_MS_MALFORMED, |c| {
        Box::pin(headers::timeout_malformed(c))
    }),
    (&REQUEST_TIMEOUT_MS_ZERO, |c| {
        Box::pin(headers::timeout_zero(c))
    }),
    (&REQUEST_TIMEOUT_MS_VALID, |c| {
        Box::pin(headers::timeout_valid(c))
    }),
];

/// A verdict and its detail.
pub(crate) type Finding = (Verdict, String);

pub(crate) fn pass(detail: impl Into<String>) -> Finding {
    (Verdict::Pass, detail.into())
}

pub(crate) fn fail(detail: impl Into<String>) -> Finding {
    (Verdict::Fail, detail.into())
}

pub(crate) fn skip(detail: impl Into<String>) -> Finding {
    (Verdict::Skip, detail.into())
}

/// How many copies the concurrency rule sends at once.
pub(crate) const COPIES: usize = 8;
/// The longest wait a `retry-after` is followed for.
const MAX_WAIT: Duration = Duration::from_secs(5);
/// The wait after a 409 or 503 without a usable `retry-after`.
const DEFAULT_WAIT: Duration = Duration::from_millis(500);
/// How many times a copy is sent again while the first is in flight.
const MAX_SETTLE_ATTEMPTS: usize = 20;
/// How long after sending a request its connection is closed, when no answer came.
const MID_REQUEST: Duration = Duration::from_millis(25);
/// How long effects of copies that lost their reply get to show in the ledger.
const SETTLE: Duration = Duration::from_millis(300);

/// Whether and how effects are counted.
#[derive(Debug, Clone)]
enum Counting {
    On(Origin, Request),
    Off(String),
}

/// What the rules share: the endpoint, the ledger, fresh keys, every answer seen.
pub(crate) struct Ctx<'a> {
    options: &'a Options,
    counting: Mutex<Counting>,
    run: String,
    next: AtomicU32,
    seen: Mutex<Vec<Answer>>,
}

impl<'a> Ctx<'a> {
    fn new(options: &'a Options) -> Self {
        let counting = match options.ledger_request() {
            Some((origin, request)) => Counting::On(origin, request),
            None => Counting::Off("no --ledger-url".to_owned()),
        };
        Ctx {
            options,
            counting: Mutex::new(counting),
            run: format!("{:012x}", rand::random::<u64>() >> 16),
            next: AtomicU32::new(0),
            seen: Mutex::new(Vec::new()),
        }
    }

    /// A key no request of any run has used.
    pub(crate) fn key(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("rsc-{}-{n:03}", self.run)
    }

    /// The endpoint's request, without a key.
    pub(crate) fn base(&self) -> Request {
        self.options.request()
    }

    /// The endpoint's request with this `idempotency-key` value.
    pub(crate) fn keyed(&self, key: impl Into<Vec<u8>>) -> Request {
        self.base().header("idempotency-key", key)
    }

    /// The endpoint's request with another body: a JSON value of the same kind that
    /// differs from the configured one.
    pub(crate) fn other_body(&self, request: Request) -> Request {
        let mut body = self.options.body.clone();
        match &mut body {
            serde_json::Value::Object(members) => {
                members.insert(
                    "retrysafe_conformance_variant".to_owned(),
                    serde_json::Value::from(self.key()),
                );
            }
            serde_json::Value::Array(items) => items.push(serde_json::Value::from(self.key())),
            serde_json::Value::String(text) => text.push_str("-variant"),
            serde_json::Value::Number(n) => {
                body = serde_json::Value::from(n.as_f64().unwrap_or_default() + 1.0);
            }
            serde_json::Value::Bool(b) => *b = !*b,
            serde_json::Value::Null => body = serde_json::json!({}),
        }
        Request {
            body: body.to_string().into_bytes(),
            ..request
        }
    }

    /// The endpoint's request with another query: a parameter added.
    pub(crate) fn other_query(&self, request: Request) -> Request {
        let sep = if request.target.contains('?') {
            '&'
        } else {
            '?'
        };
        let target = format!("{}{sep}retrysafe-conformance-variant=1", request.target);
        Request { target, ..request }
    }

    fn origin(&self) -> &Origin {
        &self.options.url.origin
    }

    fn note(&self, exchange: &Exchange) {
        if let Ok(answer) = exchange {
            self.seen
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .push(answer.clone());
        }
    }

    /// Every answer seen so far.
    pub(crate) fn seen(&self) -> Vec<Answer> {
        self.seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// Sends `request` once.
    pub(crate) async fn send(&self, request: &Request) -> Exchange {
        let exchange = http::send(self.origin(), request).await;
        self.note(&exchange);
        exchange
    }

    /// Sends every request at once, each on its own connection.
    pub(crate) async fn together(&self, requests: &[Request]) -> Vec<Exchange> {
        let exchanges = http::send_together(self.origin(), requests).await;
        for exchange in &exchanges {
            self.note(exchange);
        }
        exchanges
    }

    /// Sends `request` and closes the connection while the server works on it.
    pub(crate) async fn close_early(&self, request: &Request) -> Result<(), String> {
        http::send_and_close(self.origin(), request, MID_REQUEST)
            .await
            .map_err(|e| e.to_string())
    }

    /// Sends `request` and closes the connection once the answer arrives, unread.
    pub(crate) async fn drop_answer(&self, request: &Request) -> Result<(), String> {
        http::send_and_drop_answer(self.origin(), request)
            .await
            .map_err(|e| e.to_string())
    }

    /// Sends `request` as a client that follows the convention does: again after the
    /// `retry-after` of a 409 (a copy in flight) or a 503 `outcome-pending`, until
    /// another answer comes.
    pub(crate) async fn settled(&self, request: &Request) -> Exchange {
        let mut exchange = self.send(request).await;
        for _ in 1..MAX_SETTLE_ATTEMPTS {
            let wait = match &exchange {
                Ok(a) if a.status == 409 || slug(a).as_deref() == Some("outcome-pending") => {
                    retry_after_delay(a).unwrap_or(DEFAULT_WAIT).min(MAX_WAIT)
                }
                _ => break,
            };
            tokio::time::sleep(wait).await;
            exchange = self.send(request).await;
        }
        exchange
    }

    /// The effects the ledger counts now; `None` when they are not counted.
    pub(crate) async fn effects(&self) -> Option<Result<u64, String>> {
        let counting = self
            .counting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let Counting::On(origin, request) = counting else {
            return None;
        };
        Some(read_ledger(&origin, &request).await)
    }

    fn stop_counting(&self, why: String) {
        *self
            .counting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Counting::Off(why);
    }

    fn not_counted(&self) -> String {
        match &*self
            .counting
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
        {
            Counting::Off(why) => why.clone(),
            Counting::On(..) => String::new(),
        }
    }

    /// The verdict of a rule whose requests were judged `judged` and should have made
    /// `expected` effects since `before` (read at the start of the rule).
    pub(crate) async fn effects_since(
        &self,
        before: Option<Result<u64, String>>,
        expected: u64,
        judged: Result<String, String>,
    ) -> Finding {
        let detail = match judged {
            Ok(detail) => detail,
            Err(detail) => return fail(detail),
        };
        let after = self.effects().await;
        match (before, after) {
            (Some(Ok(before)), Some(Ok(after))) => {
                let made = after.saturating_sub(before);
                if made == expected && after >= before {
                    pass(format!("{detail}; {}", effects(made)))
                } else {
                    fail(format!(
                        "{detail}; but the ledger went from {before} to {after}: expected {}",
                        effects(expected)
                    ))
                }
            }
            (Some(Err(e)), _) | (_, Some(Err(e))) => {
                fail(format!("{detail}; but the ledger could not be read: {e}"))
            }
            _ => pass(format!(
                "{detail}; effects not counted ({})",
                self.not_counted()
            )),
        }
    }

    /// Like [`effects_since`](Self::effects_since), after a pause that lets a copy
    /// whose reply was lost finish its effect.
    pub(crate) async fn effects_settled(
        &self,
        before: Option<Result<u64, String>>,
        expected: u64,
        judged: Result<String, String>,
    ) -> Finding {
        if judged.is_ok() && before.is_some() {
            tokio::time::sleep(SETTLE).await;
        }
        self.effects_since(before, expected, judged).await
    }

    /// Checks that nothing happened since `before`, after a pause that lets a refused
    /// request that ran anyway show its effect.
    pub(crate) async fn nothing_since(
        &self,
        before: &Option<Result<u64, String>>,
    ) -> Result<(), String> {
        let Some(Ok(before)) = before else {
            return Ok(());
        };
        tokio::time::sleep(SETTLE).await;
        match self.effects().await {
            Some(Ok(after)) if after == *before => Ok(()),
            Some(Ok(after)) => Err(format!(
                "but the ledger went from {before} to {after}: a refused request must have no \
                 effect"
            )),
            Some(Err(e)) => Err(format!("but the ledger could not be read: {e}")),
            None => Ok(()),
        }
    }

    /// Whether effects are counted.
    pub(crate) fn counting(&self) -> bool {
        matches!(
            *self
                .counting
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
            Counting::On(..)
        )
    }

    /// Why effects are not counted.
    pub(crate) fn why_not_counted(&self) -> String {
        self.not_counted()
    }
}

fn effects(n: u64) -> String {
    if n == 1 {
        "1 effect".to_owned()
    } else {
        format!("{n} effects")
    }
}

/// Reads the ledger: a JSON array (its length) or an object's `count`.
async fn read_ledger(origin: &Origin, request: &Request) -> Result<u64, String> {
    let answer = http::send(origin, request)
        .await
        .map_err(|e| format!("GET {}: {e}", request.target))?;
    if answer.status != 200 {
        return Err(format!(
            "GET {} answered {}",
            request.target,
            describe(&answer)
        ));
    }
    let json: serde_json::Value = serde_json::from_slice(&answer.body).map_err(|e| {
        format!(
            "GET {} answered a body that is not JSON ({e})",
            request.target
        )
    })?;
    match &json {
        serde_json::Value::Array(items) => Ok(items.len() as u64),
        serde_json::Value::Object(members) => members
            .get("count")
            .and_then(serde_json::Value::as_u64)
            .ok_or_else(|| {
                format!(
                    "GET {} answered an object without a count member of a whole number",
                    request.target
                )
            }),
        _ => Err(format!(
            "GET {} answered neither a JSON array nor an object with a count member",
            request.target
        )),
    }
}

/// Runs every rule.
pub(crate) async fn run(options: &Options) -> Report {
    let ctx = Ctx::new(options);
    let mut report = Report::default();
    let ok = setup(&ctx, &mut report).await;
    if !ok {
        for rule in RULES.iter().skip(2) {
            report.push(
                rule,
                Verdict::Skip,
                "needs an endpoint that runs the request (setup.first-request failed)",
            );
        }
        return report;
    }
    let [same, marked, headers] = replay::replay(&ctx).await;
    push(&mut report, &REPLAY_SAME_ANSWER, same);
    push(&mut report, &REPLAY_MARKED, marked);
    push(&mut report, &REPLAY_HEADERS, headers);
    for (rule, check) in CHECKS {
        push(&mut report, rule, check(&ctx).await);
    }
    push(&mut report, &PROBLEM_DOCUMENTS, documents::problems(&ctx));
    push(
        &mut report,
        &RETRY_AFTER_SYNTAX,
        documents::retry_after(&ctx),
    );
    report
}

fn push(report: &mut Report, rule: &'static Rule, (verdict, detail): Finding) {
    report.push(rule, verdict, &detail);
}

/// The first request, and whether the ledger counts its effect. `false` when the
/// endpoint does not run it: nothing else can be checked then.
async fn setup(ctx: &Ctx<'_>, report: &mut Report) -> bool {
    let before = ctx.effects().await;
    let key = ctx.key();
    let request = ctx.keyed(key.as_str());
    let answer = ctx.send(&request).await;
    let ok = matches!(&answer, Ok(a) if a.is_success());
    let sent = format!("sent {} with idempotency-key: {key}", request.line());
    let first = if ok {
        pass(format!("{sent}: {}", describe_exchange(&answer)))
    } else {
        fail(format!(
            "{sent}; expected a 2xx answer, got {} (check --url, --header and --body)",
            describe_exchange(&answer)
        ))
    };
    push(report, &SETUP_FIRST_REQUEST, first);
    let ledger = match before {
        None => skip(format!(
            "effects are not counted ({}); give --ledger-url to check that copies make one effect",
            ctx.why_not_counted()
        )),
        Some(Err(e)) => {
            ctx.stop_counting("the ledger could not be read: see ledger.counts-effects".to_owned());
            fail(format!("the ledger could not be read: {e}"))
        }
        Some(Ok(_)) if !ok => {
            ctx.stop_counting("the first request failed".to_owned());
            skip("the first request did not run (see setup.first-request)")
        }
        Some(Ok(before)) => match ctx.effects().await {
            Some(Ok(after)) if after == before + 1 => pass(format!(
                "the ledger went from {before} to {after} for one new request"
            )),
            Some(Ok(after)) => {
                ctx.stop_counting(
                    "the ledger does not count this endpoint's effects: see ledger.counts-effects"
                        .to_owned(),
                );
                fail(format!(
                    "the ledger went from {before} to {after} for one new request, not by 1: \
                     does --ledger-url count what --url does (the same account, the same \
                     --header credentials)?"
                ))
            }
            Some(Err(e)) => {
                ctx.stop_counting(
                    "the ledger could not be read: see ledger.counts-effects".to_owned(),
                );
                fail(format!("the ledger could not be read: {e}"))
            }
            None => skip("effects are not counted"),
        },
    };
    push(report, &LEDGER_COUNTS_EFFECTS, ledger);
    ok
}

/// An answer judged against the first answer of its key: the same status and body.
pub(crate) fn same_answer(first: &Answer, exchange: &Exchange, what: &str) -> Result<(), String> {
    match exchange {
        Ok(a) if a.status == first.status && a.body == first.body => Ok(()),
        Ok(a) if a.status == first.status => Err(format!(
            "{what}: expected the first answer again ({}), got the same status with another \
             body: {} (the request ran again?)",
            describe(first),
            describe(a)
        )),
        other => Err(format!(
            "{what}: expected the first answer again ({}), got {}",
            describe(first),
            describe_exchange(other)
        )),
    }
}

/// The first answer of a key, which must be a 2xx.
pub(crate) fn first_success<'e>(exchange: &'e Exchange, what: &str) -> Result<&'e Answer, String> {
    match exchange {
        Ok(a) if a.is_success() => Ok(a),
        other => Err(format!(
            "{what}: expected a 2xx answer, got {}",
            describe_exchange(other)
        )),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::panic, clippy::indexing_slicing)]
mod tests {
    use super::*;

    #[test]
    fn the_rules_run_in_the_order_of_the_table() {
        let mut order: Vec<&Rule> = vec![
            &SETUP_FIRST_REQUEST,
            &LEDGER_COUNTS_EFFECTS,
            &REPLAY_SAME_ANSWER,
            &REPLAY_MARKED,
            &REPLAY_HEADERS,
        ];
        order.extend(CHECKS.iter().map(|(rule, _)| *rule));
        order.extend([&PROBLEM_DOCUMENTS, &RETRY_AFTER_SYNTAX]);
        assert_eq!(order, RULES);
    }

    #[test]
    fn rule_ids_are_unique() {
        let mut ids: Vec<&str> = RULES.iter().map(|r| r.id).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), RULES.len());
    }

    #[test]
    fn every_section_is_a_heading_of_the_wire_convention() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/wire-convention.md");
        let doc = std::fs::read_to_string(path).unwrap();
        let anchors: Vec<String> = doc
            .lines()
            .filter_map(|l| l.strip_prefix("## ").or_else(|| l.strip_prefix("### ")))
            .map(|h| {
                h.to_lowercase()
                    .chars()
                    .filter(|c| c.is_alphanumeric() || *c == '-' || *c == ' ')
                    .collect::<String>()
                    .replace(' ', "-")
            })
            .collect();
        for rule in RULES {
            assert!(
                anchors.iter().any(|a| a == rule.section),
                "{}: no heading #{} in docs/wire-convention.md ({anchors:?})",
                rule.id,
                rule.section
            );
        }
    }
}
