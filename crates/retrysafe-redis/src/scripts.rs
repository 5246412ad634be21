//! The Lua scripts that make each store call one atomic round trip.
//!
//! Records are stored as their [`Record::encode`] blob. The scripts read and rewrite
//! only the fixed layout of an `in_progress` record:
//!
//! | bytes (1-based, as in Lua) | field |
//! |---|---|
//! | 1 | version |
//! | 2 | state tag |
//! | 3–34 | fingerprint |
//! | 35–50 | token |
//! | 51–58 | `lease_until_ms`, big-endian |
//! | 59 | commit point |
//!
//! The version and tag bytes, the commit-point bytes and the head of an
//! `outcome_unknown` record are not written here: they are taken from core's encoder
//! when the scripts are built, so the scripts follow the record format of this release.
//! Anything a script does not recognise as this release's `in_progress` record is
//! returned as it is (claim) or refused as not held (token calls).
//!
//! Each token call is idempotent (a client library may send it again after a lost
//! reply): `complete` finding exactly its completed record succeeds; `release` and
//! `mark_unknown` write their token to a second key, `KEYS[2]` (the record's key with
//! `:last` appended, in the same hash slot), for [`RESEND_WINDOW`], and the same call
//! finding the record absent (release) or `outcome_unknown` (mark) with that token
//! there succeeds.
//!
//! [`RESEND_WINDOW`]: retrysafe_core::store::RESEND_WINDOW

use std::sync::LazyLock;

use bytes::Bytes;
use redis::Script;
use retrysafe_core::idempotency::{
    CommitPoint, Fingerprint, InProgress, OutcomeUnknown, Record, Token,
};

/// Offset (0-based) of the commit-point byte in an encoded `in_progress` record.
pub(crate) const COMMIT_POINT_OFFSET: usize = 58;

/// Status codes of the claim script's reply.
pub(crate) const CLAIMED: i64 = 0;
pub(crate) const TAKEN_OVER: i64 = 1;
pub(crate) const EXISTING: i64 = 2;
pub(crate) const BECAME_UNKNOWN: i64 = 3;

/// Every script, built once.
pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(Scripts::new);

/// The compiled scripts (each carries its SHA-1 for `EVALSHA`).
pub(crate) struct Scripts {
    /// `KEYS[1]`; `ARGV`: in-progress template (lease 0), lease ms, retention ms, the
    /// `outcome_unknown` record of the claim's fingerprint. Replies `{status, record}`.
    pub(crate) claim: Script,
    /// `ARGV`: token, completed record, retention ms. Replies 1 (also when the same
    /// record is already stored), or 0 when not held.
    pub(crate) complete: Script,
    /// `KEYS[2]` the last token; `ARGV`: token, resend window ms. Replies 1 (also when
    /// this token released it already), or 0 when not held.
    pub(crate) release: Script,
    /// `ARGV`: token, lease ms. Replies 1, or 0 when not held.
    pub(crate) renew: Script,
    /// `ARGV`: token. Replies 1, or 0 when not held.
    pub(crate) commit_point: Script,
    /// `KEYS[2]` the last token; `ARGV`: token, retention ms, resend window ms. Replies
    /// 1 (also when this token marked it already), or 0 when not held.
    pub(crate) mark_unknown: Script,
    /// No `ARGV`. Replies 1 while the record is `in_progress` with a live lease.
    pub(crate) live: Script,
}

/// The bytes the scripts compare with, taken from core's encoder.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) in_progress_head: [u8; 2],
    pub(crate) in_progress_len: usize,
    pub(crate) before: u8,
    pub(crate) passed: u8,
    pub(crate) unknown_head: [u8; 2],
}

impl Layout {
    pub(crate) fn from_core() -> Self {
        let sample = |commit_point| {
            Record::InProgress(InProgress::new(
                0,
                Token::from_bytes([0; 16]),
                Fingerprint::from_bytes([0; 32]),
                commit_point,
            ))
            .encode()
        };
        let before = sample(CommitPoint::Before);
        let passed = sample(CommitPoint::Passed);
        let unknown =
            Record::OutcomeUnknown(OutcomeUnknown::new(Fingerprint::from_bytes([0; 32]))).encode();
        Layout {
            in_progress_head: head(&before),
            in_progress_len: before.len(),
            before: byte(&before, COMMIT_POINT_OFFSET),
            passed: byte(&passed, COMMIT_POINT_OFFSET),
            unknown_head: head(&unknown),
        }
    }
}

fn head(b: &Bytes) -> [u8; 2] {
    [byte(b, 0), byte(b, 1)]
}

fn byte(b: &Bytes, at: usize) -> u8 {
    b.get(at).copied().unwrap_or_default()
}

/// Helpers every script starts with.
fn preamble(l: &Layout) -> String {
    let [v, ip] = l.in_progress_head;
    let [uv, ut] = l.unknown_head;
    format!(
        r"
-- Writes after TIME need effects replication (the default from Redis 5 on).
if redis.replicate_commands then redis.replicate_commands() end
local IP_HEAD = string.char({v}, {ip})
local IP_LEN = {len}
local CP_BEFORE = string.char({before})
local CP_PASSED = string.char({passed})
local UNKNOWN_HEAD = string.char({uv}, {ut})

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function in_progress(v)
  return v and #v == IP_LEN and string.sub(v, 1, 2) == IP_HEAD
end

local function holds(v, token)
  return in_progress(v) and string.sub(v, 35, 50) == token
end

local function lease_until(v)
  local n = 0
  for i = 51, 58 do n = n * 256 + string.byte(v, i) end
  return n
end

local function be64(n)
  local t = {{}}
  for i = 8, 1, -1 do
    t[i] = string.char(n % 256)
    n = math.floor(n / 256)
  end
  return table.concat(t)
end
",
        len = l.in_progress_len,
        before = l.before,
        passed = l.passed,
    )
}

const CLAIM: &str = r"
local key = KEYS[1]
local tpl, lease, retention = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local cur = redis.call('GET', key)
local now = now_ms()
local function put_claim()
  -- The key outlives the lease by the retention, so that an expired lease can still be
  -- resolved (taken over, or turned into outcome_unknown) by the next copy.
  local blob = string.sub(tpl, 1, 50) .. be64(now + lease) .. string.sub(tpl, 59)
  redis.call('SET', key, blob, 'PX', lease + retention)
end
if not cur then
  put_claim()
  return {0, ''}
end
if not in_progress(cur) or now < lease_until(cur) then
  return {2, cur}
end
if string.sub(cur, 3, 34) ~= string.sub(tpl, 3, 34) then
  -- Not this request's record: left for the rightful copy.
  return {2, cur}
end
if string.sub(cur, 59, 59) == CP_BEFORE then
  -- The holder stopped before its effect: this copy takes over.
  put_claim()
  return {1, ''}
end
-- Past (or without) a commit point: the outcome cannot be known.
redis.call('SET', key, ARGV[4], 'PX', retention)
return {3, ARGV[4]}
";

const COMPLETE: &str = r"
local cur = redis.call('GET', KEYS[1])
if holds(cur, ARGV[1]) then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', tonumber(ARGV[3]))
  return 1
end
-- The same completion sent again (its reply was lost): already stored.
if cur == ARGV[2] then return 1 end
return 0
";

const RELEASE: &str = r"
local cur = redis.call('GET', KEYS[1])
if holds(cur, ARGV[1]) then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], ARGV[1], 'PX', tonumber(ARGV[2]))
  return 1
end
-- The same release sent again (its reply was lost): still absent.
if not cur and redis.call('GET', KEYS[2]) == ARGV[1] then return 1 end
return 0
";

const RENEW: &str = r"
local key = KEYS[1]
local cur = redis.call('GET', key)
if not holds(cur, ARGV[1]) then return 0 end
local lease = tonumber(ARGV[2])
local now = now_ms()
-- Keep the time the key outlives its lease (the claim's retention).
local grace = 0
local pttl = redis.call('PTTL', key)
if pttl >= 0 then
  grace = math.max(pttl - math.max(lease_until(cur) - now, 0), 0)
end
redis.call('SETRANGE', key, 50, be64(now + lease))
if pttl >= 0 then
  redis.call('PEXPIRE', key, math.max(lease + grace, 1))
end
return 1
";

const COMMIT_POINT: &str = r"
local cur = redis.call('GET', KEYS[1])
if not holds(cur, ARGV[1]) then return 0 end
redis.call('SETRANGE', KEYS[1], 58, CP_PASSED)
return 1
";

const MARK_UNKNOWN: &str = r"
local cur = redis.call('GET', KEYS[1])
if holds(cur, ARGV[1]) then
  redis.call('SET', KEYS[1], UNKNOWN_HEAD .. string.sub(cur, 3, 34), 'PX', tonumber(ARGV[2]))
  redis.call('SET', KEYS[2], ARGV[1], 'PX', tonumber(ARGV[3]))
  return 1
end
-- The same mark sent again (its reply was lost): still unknown.
if cur and string.sub(cur, 1, 2) == UNKNOWN_HEAD
   and redis.call('GET', KEYS[2]) == ARGV[1] then
  return 1
end
return 0
";

const LIVE: &str = r"
local cur = redis.call('GET', KEYS[1])
if in_progress(cur) and now_ms() < lease_until(cur) then return 1 end
return 0
";

impl Scripts {
    fn new() -> Self {
        let pre = preamble(&Layout::from_core());
        let script = |body: &str| Script::new(&format!("{pre}{body}"));
        Scripts {
            claim: script(CLAIM),
            complete: script(COMPLETE),
            release: script(RELEASE),
            renew: script(RENEW),
            commit_point: script(COMMIT_POINT),
            mark_unknown: script(MARK_UNKNOWN),
            live: script(LIVE),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::indexing_slicing)]

    use super::*;

    const LEASE_OFFSET: usize = 50;

    /// The offsets the scripts hard-code match core's encoding.
    #[test]
    fn offsets_match_core_encoding() {
        let fingerprint = Fingerprint::from_bytes([0xAB; 32]);
        let token = Token::from_bytes([0xCD; 16]);
        let lease_until_ms = 0x0102_0304_0506_0708;
        let bytes = Record::InProgress(InProgress::new(
            lease_until_ms,
            token,
            fingerprint,
            CommitPoint::Passed,
        ))
        .encode();
        let l = Layout::from_core();
        assert_eq!(bytes.len(), l.in_progress_len);
        assert_eq!(l.in_progress_len, 59);
        assert_eq!(&bytes[0..2], &l.in_progress_head);
        assert_eq!(&bytes[2..34], fingerprint.as_bytes());
        assert_eq!(&bytes[34..50], &token.to_bytes());
        assert_eq!(
            &bytes[LEASE_OFFSET..LEASE_OFFSET + 8],
            &lease_until_ms.to_be_bytes()
        );
        assert_eq!(bytes[COMMIT_POINT_OFFSET], l.passed);
        assert_ne!(l.before, l.passed);
        assert_ne!(l.in_progress_head, l.unknown_head);
        let unknown = Record::OutcomeUnknown(OutcomeUnknown::new(fingerprint)).encode();
        assert_eq!(&unknown[0..2], &l.unknown_head);
        assert_eq!(&unknown[2..], fingerprint.as_bytes());
    }

    #[test]
    fn scripts_build() {
        assert_ne!(SCRIPTS.claim.get_hash(), SCRIPTS.complete.get_hash());
        assert_eq!(SCRIPTS.claim.get_hash().len(), 40);
    }
}
