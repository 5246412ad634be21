//! The rules: ids, sections and titles, in the order they run.

use crate::Rule;

/// Every rule, in the order they run.
pub static RULES: &[&Rule] = &[
    &SETUP_FIRST_REQUEST,
    &LEDGER_COUNTS_EFFECTS,
    &REPLAY_SAME_ANSWER,
    &REPLAY_MARKED,
    &REPLAY_HEADERS,
    &KEY_FORMS,
    &KEY_ESCAPES,
    &KEY_QUOTE_PREFIX,
    &KEY_MAX_LENGTH,
    &KEY_TOO_LONG,
    &KEY_EMPTY,
    &KEY_INVALID_CHARACTERS,
    &KEY_CONTROL_CHARACTERS,
    &KEY_TWICE,
    &KEY_MISSING,
    &MISMATCH_BODY,
    &MISMATCH_QUERY,
    &MISMATCH_CONCURRENT,
    &CONCURRENT_COPIES,
    &LOST_REPLY_AFTER_ANSWER,
    &LOST_REPLY_MID_REQUEST,
    &SAME_REQUEST_PER_ATTEMPT_HEADERS,
    &RETRY_ATTEMPT_PARSING,
    &REQUEST_TIMEOUT_MS_MALFORMED,
    &REQUEST_TIMEOUT_MS_ZERO,
    &REQUEST_TIMEOUT_MS_VALID,
    &PROBLEM_DOCUMENTS,
    &RETRY_AFTER_SYNTAX,
];

pub(super) static SETUP_FIRST_REQUEST: Rule = rule(
    "setup.first-request",
    "idempotency-key",
    "a request with a new key runs",
);
pub(super) static LEDGER_COUNTS_EFFECTS: Rule = rule(
    "ledger.counts-effects",
    "idempotency-key",
    "the ledger counts the effect of one new request",
);
pub(super) static REPLAY_SAME_ANSWER: Rule = rule(
    "replay.same-answer",
    "idempotent-replayed",
    "copies after the first get its status and body, one effect",
);
pub(super) static REPLAY_MARKED: Rule = rule(
    "replay.marked",
    "idempotent-replayed",
    "replays carry idempotent-replayed: true, first answers do not",
);
pub(super) static REPLAY_HEADERS: Rule = rule(
    "replay.headers",
    "idempotent-replayed",
    "replays keep the stable headers and never replay set-cookie",
);
pub(super) static KEY_FORMS: Rule = rule(
    "key.forms",
    "idempotency-key",
    "\"k\" and k are the same key",
);
pub(super) static KEY_ESCAPES: Rule = rule(
    "key.escapes",
    "idempotency-key",
    "sf-string keys with \\\" and \\\\ escapes are keys",
);
pub(super) static KEY_QUOTE_PREFIX: Rule = rule(
    "key.quote-prefix",
    "idempotency-key",
    "a bare key may start with a quote (\"abc is a key)",
);
pub(super) static KEY_MAX_LENGTH: Rule = rule(
    "key.max-length",
    "idempotency-key",
    "keys of 255 characters are accepted",
);
pub(super) static KEY_TOO_LONG: Rule = rule(
    "key.too-long",
    "idempotency-key",
    "keys of 256 characters get 400 key-invalid",
);
pub(super) static KEY_EMPTY: Rule = rule(
    "key.empty",
    "idempotency-key",
    "empty keys get 400 key-invalid",
);
pub(super) static KEY_INVALID_CHARACTERS: Rule = rule(
    "key.invalid-characters",
    "idempotency-key",
    "keys outside the grammar get 400 key-invalid",
);
pub(super) static KEY_CONTROL_CHARACTERS: Rule = rule(
    "key.control-characters",
    "control-characters",
    "keys holding control characters get 400",
);
pub(super) static KEY_TWICE: Rule = rule(
    "key.twice",
    "idempotency-key",
    "a key header sent twice gets 400 key-invalid",
);
pub(super) static KEY_MISSING: Rule = rule(
    "key.missing",
    "which-requests-are-guarded",
    "no key: 400 key-missing, or the request is not guarded",
);
pub(super) static MISMATCH_BODY: Rule = rule(
    "mismatch.body",
    "the-same-request",
    "the key with another body gets 422 key-mismatch, do-not-retry",
);
pub(super) static MISMATCH_QUERY: Rule = rule(
    "mismatch.query",
    "the-same-request",
    "the key with another query gets 422 key-mismatch, do-not-retry",
);
pub(super) static MISMATCH_CONCURRENT: Rule = rule(
    "mismatch.concurrent",
    "the-same-request",
    "the key with two bodies at once: one runs, the other gets 422",
);
pub(super) static CONCURRENT_COPIES: Rule = rule(
    "concurrent.copies",
    "idempotency-key",
    "copies at once: one effect, the others replay or get 409 request-in-flight",
);
pub(super) static LOST_REPLY_AFTER_ANSWER: Rule = rule(
    "lost-reply.after-answer",
    "idempotency-key",
    "a reply lost unread, then a retry: a replay, one effect",
);
pub(super) static LOST_REPLY_MID_REQUEST: Rule = rule(
    "lost-reply.mid-request",
    "idempotency-key",
    "a connection closed before the answer, then a retry: one effect",
);
pub(super) static SAME_REQUEST_PER_ATTEMPT_HEADERS: Rule = rule(
    "same-request.per-attempt-headers",
    "the-same-request",
    "the per-attempt headers of the convention do not change the request",
);
pub(super) static RETRY_ATTEMPT_PARSING: Rule = rule(
    "retry-attempt.parsing",
    "retry-attempt-and-grpc-previous-rpc-attempts",
    "malformed retry-attempt values are ignored",
);
pub(super) static REQUEST_TIMEOUT_MS_MALFORMED: Rule = rule(
    "request-timeout-ms.malformed",
    "request-timeout-ms",
    "malformed values get 400 timeout-invalid and record nothing",
);
pub(super) static REQUEST_TIMEOUT_MS_ZERO: Rule = rule(
    "request-timeout-ms.zero",
    "request-timeout-ms",
    "0 gets 504 deadline-exceeded, do-not-retry, and records nothing",
);
pub(super) static REQUEST_TIMEOUT_MS_VALID: Rule = rule(
    "request-timeout-ms.valid",
    "request-timeout-ms",
    "valid values (leading zeros, huge ones) are accepted",
);
pub(super) static PROBLEM_DOCUMENTS: Rule = rule(
    "problem.documents",
    "problem-documents-applicationproblemjson",
    "problem answers are RFC 9457 documents of the convention's form",
);
pub(super) static RETRY_AFTER_SYNTAX: Rule = rule(
    "retry-after.syntax",
    "retry-after",
    "retry-after is delay-seconds (at most 86400) or an HTTP-date",
);

const fn rule(id: &'static str, section: &'static str, title: &'static str) -> Rule {
    Rule { id, section, title }
}
