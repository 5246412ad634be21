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
//! A record at least as long as this release's layout is accepted (a later release may
//! append fields). Anything a script does not recognise as an `in_progress` record is
//! returned as it is (claim) or refused as not held (token calls).
//!
//! Beside the record, in the same hash slot, the scripts keep:
//!
//! - `KEYS[…]` *meta*: the record's key with `:meta` appended, a hash that lives as long
//!   as the record: `at` (claim time, ms of Redis `TIME`), `req` (the encoded
//!   `RequestInfo`), `note` (the resolution note), `reason` (the unknown reason code),
//!   `notified` (`0`/`1`), `atok` and `auntil` (the adoption: token, end in ms), `next`
//!   (the next reconcile pass of an unknown record, ms), `ended` (for an unknown record
//!   made from a claim whose lease ended: when it ended, ms; a reconciler considers it
//!   only `stale` after that, as it would the claim).
//! - the record's key with `:last` appended: the token of the last release,
//!   `mark_unknown` or settlement, for [`RESEND_WINDOW`].
//!
//! and, in the in-flight *index* (a sorted set named by the store, see
//! `RedisStore::index_key`), the record id in hex scored by when the record becomes due
//! for a reconciler: a claim at its lease end, an unknown record at its next pass. The
//! index is written by the same scripts that change the record, so the request path
//! pays no extra round trip for it.
//!
//! While an adoption is live (`auntil` after now), the record is *resolving*: the claim
//! script answers with it, and every token call of the record's holder is refused. The
//! record itself is never rewritten by an adoption, so a lapsed adoption leaves it
//! exactly as it was.
//!
//! Each token call is idempotent (a client library may send it again after a lost
//! reply): `complete` finding exactly its completed record succeeds; `release`,
//! `mark_unknown` and `settle` write their token to the `:last` key, and the same call
//! finding that token there (and, for release and mark, the record absent or
//! `outcome_unknown`) succeeds.
//!
//! [`RESEND_WINDOW`]: retrysafe_core::store::RESEND_WINDOW

use std::sync::LazyLock;

use bytes::Bytes;
use redis::Script;
use retrysafe_core::idempotency::{
    CommitPoint, Fingerprint, InProgress, OutcomeUnknown, Record, Token, UnknownReason,
};

/// Offset (0-based) of the commit-point byte in an encoded `in_progress` record.
pub(crate) const COMMIT_POINT_OFFSET: usize = 58;

/// Status codes of the claim script's reply.
pub(crate) const CLAIMED: i64 = 0;
pub(crate) const TAKEN_OVER: i64 = 1;
pub(crate) const EXISTING: i64 = 2;
pub(crate) const BECAME_UNKNOWN: i64 = 3;
pub(crate) const RESOLVING: i64 = 4;

/// Every script, built once.
pub(crate) static SCRIPTS: LazyLock<Scripts> = LazyLock::new(Scripts::new);

/// The compiled scripts (each carries its SHA-1 for `EVALSHA`). Keys are the record,
/// then (where named) `:last`, meta, index.
pub(crate) struct Scripts {
    /// `KEYS` record, meta, index; `ARGV`: in-progress template (lease 0), lease ms,
    /// retention ms, the `outcome_unknown` record of the claim's fingerprint, the
    /// encoded request (or empty), the record id in hex. Replies
    /// `{status, record, adoption end ms}`.
    pub(crate) claim: Script,
    /// `KEYS` record, meta, index; `ARGV`: token, completed record, retention ms, id.
    /// Replies 1 (also when the same record is already stored), or 0 when not held.
    pub(crate) complete: Script,
    /// `KEYS` record, last, meta, index; `ARGV`: token, resend window ms, id. Replies 1
    /// (also when this token released it already), or 0 when not held.
    pub(crate) release: Script,
    /// `KEYS` record, meta, index; `ARGV`: token, lease ms, id. Replies 1, or 0 when
    /// not held.
    pub(crate) renew: Script,
    /// `KEYS` record, meta; `ARGV`: token, and the note if there is one. Replies 1, or 0
    /// when not held.
    pub(crate) commit_point: Script,
    /// `KEYS` record, last, meta, index; `ARGV`: token, retention ms, resend window ms,
    /// reason code, id. Replies 1 (also when this token marked it already), or 0 when
    /// not held.
    pub(crate) mark_unknown: Script,
    /// `KEYS` record, meta. Sets the notified flag of an existing record. Replies 1.
    pub(crate) mark_notified: Script,
    /// `KEYS` record, meta. Replies 1 while the record is `in_progress` with a live
    /// lease and not adopted.
    pub(crate) live: Script,
    /// `KEYS` record, meta. Replies `{exists, record, adoption end ms or 0}`.
    pub(crate) read: Script,
    /// `KEYS` record, meta, index; `ARGV`: token, hold ms, stale ms (-1: any claim), id.
    /// Replies the pending record (see `pending` in the preamble), or `{}`.
    pub(crate) adopt: Script,
    /// `KEYS` record, meta. Replies the pending record, or `{}`.
    pub(crate) peek: Script,
    /// `KEYS` record, last, meta, index; `ARGV`: token, kind (`complete`, `release`,
    /// `later`), id, resend window ms, then for `complete` the completed record (its
    /// fingerprint is replaced by the record's) and the retention ms, for `later` the
    /// wait ms and the notified flag. Replies 1, or 0 when not adopted by `token`.
    pub(crate) settle: Script,
    /// `KEYS` index; `ARGV`: key prefix, stale ms, limit, scan bound. Replies the ids
    /// (hex) of due records, and drops index entries of records no longer pending.
    pub(crate) due: Script,
    /// `KEYS` index; `ARGV`: key prefix, limit, scan bound. Replies the ids (hex) of
    /// every pending record the index lists, due or not: claims whose lease ended, and
    /// unknown records.
    pub(crate) list: Script,
    /// `KEYS` scan lease; `ARGV`: owner token, hold ms. Takes or renews the lease;
    /// replies 1 when the owner holds it, 0 when another does.
    pub(crate) scan_lease: Script,
}

/// The bytes the scripts compare with, taken from core's encoder.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Layout {
    pub(crate) in_progress_head: [u8; 2],
    pub(crate) in_progress_len: usize,
    pub(crate) before: u8,
    pub(crate) passed: u8,
    pub(crate) unknown_head: [u8; 2],
    pub(crate) unknown_len: usize,
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
            unknown_len: unknown.len(),
        }
    }
}

fn head(b: &Bytes) -> [u8; 2] {
    [byte(b, 0), byte(b, 1)]
}

fn byte(b: &Bytes, at: usize) -> u8 {
    b.get(at).copied().unwrap_or_default()
}

/// Helpers every script starts with: the layout constants taken from core's encoder,
/// then [`HELPERS`].
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
local UNKNOWN_LEN = {unknown_len}
local LEASE_EXPIRED = '{lease_expired}'
{HELPERS}",
        len = l.in_progress_len,
        before = l.before,
        passed = l.passed,
        unknown_len = l.unknown_len,
        lease_expired = UnknownReason::LeaseExpired.to_code(),
    )
}

/// The Lua functions every script may use (after the constants of [`preamble`]).
const HELPERS: &str = r"
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function in_progress(v)
  return v and #v >= IP_LEN and string.sub(v, 1, 2) == IP_HEAD
end

local function unknown(v)
  return v and #v >= UNKNOWN_LEN and string.sub(v, 1, 2) == UNKNOWN_HEAD
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
  local t = {}
  for i = 8, 1, -1 do
    t[i] = string.char(n % 256)
    n = math.floor(n / 256)
  end
  return table.concat(t)
end

-- The end and token of a live adoption, or nil.
local function adopted(meta, now)
  local a = redis.call('HMGET', meta, 'atok', 'auntil')
  if a[1] and a[2] and tonumber(a[2]) > now then return tonumber(a[2]), a[1] end
  return nil
end

-- Whether `token` holds the record and no reconciler has adopted it.
local function free_holder(v, meta, token, now)
  return holds(v, token) and not adopted(meta, now)
end

-- The in-flight index is the last key; a store that keeps none passes none.
local function index_at(idx, score, member)
  if idx then redis.call('ZADD', idx, score, member) end
end

local function unindex(idx, member)
  if idx then redis.call('ZREM', idx, member) end
end

-- The meta hash lives exactly as long as its record.
local function follow_ttl(key, meta)
  local pttl = redis.call('PTTL', key)
  if pttl > 0 then redis.call('PEXPIRE', meta, pttl) end
end

-- What a resolver sees: the record, the request, whether there is a note, the note,
-- the reason code, the notified flag, the claim time, and now.
local function pending(v, meta, now)
  local f = redis.call('HMGET', meta, 'req', 'note', 'reason', 'notified', 'at')
  local has_note = 0
  if f[2] then has_note = 1 end
  return {v, f[1] or '', has_note, f[2] or '', f[3] or '', f[4] or '0', f[5] or '', now}
end
";

const CLAIM: &str = r"
local key, meta, idx = KEYS[1], KEYS[2], KEYS[3]
local tpl, lease, retention = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local request, member = ARGV[5], ARGV[6]
local cur = redis.call('GET', key)
local now = now_ms()
local function put_claim()
  -- The key outlives the lease by the retention, so that an expired lease can still be
  -- resolved (taken over, or turned into outcome_unknown) by the next copy.
  local blob = string.sub(tpl, 1, 50) .. be64(now + lease) .. string.sub(tpl, 59)
  redis.call('SET', key, blob, 'PX', lease + retention)
  -- Nothing of an earlier record (expired, or taken over) carries over.
  redis.call('DEL', meta)
  if request ~= '' then
    redis.call('HSET', meta, 'at', now, 'req', request)
  else
    redis.call('HSET', meta, 'at', now)
  end
  redis.call('PEXPIRE', meta, lease + retention)
  index_at(idx, now + lease, member)
end
if not cur then
  put_claim()
  return {0, '', 0}
end
local until_ms = adopted(meta, now)
if until_ms then
  -- A reconciler is finding out what became of it: copies come back later.
  return {4, cur, until_ms}
end
if not in_progress(cur) or now < lease_until(cur) then
  return {2, cur, 0}
end
if string.sub(cur, 3, 34) ~= string.sub(tpl, 3, 34) then
  -- Not this request's record: left for the rightful copy.
  return {2, cur, 0}
end
if string.sub(cur, 59, 59) == CP_BEFORE then
  -- The holder stopped before its effect: this copy takes over.
  put_claim()
  return {1, '', 0}
end
-- Past (or without) a commit point: the outcome cannot be known.
local ended = lease_until(cur)
redis.call('SET', key, ARGV[4], 'PX', retention)
redis.call('HSET', meta, 'reason', LEASE_EXPIRED, 'notified', '0', 'ended', ended)
redis.call('PEXPIRE', meta, retention)
index_at(idx, ended, member)
return {3, ARGV[4], 0}
";

const COMPLETE: &str = r"
local cur = redis.call('GET', KEYS[1])
if free_holder(cur, KEYS[2], ARGV[1], now_ms()) then
  redis.call('SET', KEYS[1], ARGV[2], 'PX', tonumber(ARGV[3]))
  redis.call('DEL', KEYS[2])
  unindex(KEYS[3], ARGV[4])
  return 1
end
-- The same completion sent again (its reply was lost): already stored.
if cur == ARGV[2] then return 1 end
return 0
";

const RELEASE: &str = r"
local cur = redis.call('GET', KEYS[1])
if free_holder(cur, KEYS[3], ARGV[1], now_ms()) then
  redis.call('DEL', KEYS[1], KEYS[3])
  unindex(KEYS[4], ARGV[3])
  redis.call('SET', KEYS[2], ARGV[1], 'PX', tonumber(ARGV[2]))
  return 1
end
-- The same release sent again (its reply was lost): still absent.
if not cur and redis.call('GET', KEYS[2]) == ARGV[1] then return 1 end
return 0
";

const RENEW: &str = r"
local key, meta = KEYS[1], KEYS[2]
local cur = redis.call('GET', key)
local now = now_ms()
if not free_holder(cur, meta, ARGV[1], now) then return 0 end
local lease = tonumber(ARGV[2])
-- Keep the time the key outlives its lease (the claim's retention).
local grace = 0
local pttl = redis.call('PTTL', key)
if pttl >= 0 then
  grace = math.max(pttl - math.max(lease_until(cur) - now, 0), 0)
end
redis.call('SETRANGE', key, 50, be64(now + lease))
if pttl >= 0 then
  redis.call('PEXPIRE', key, math.max(lease + grace, 1))
  redis.call('PEXPIRE', meta, math.max(lease + grace, 1))
end
index_at(KEYS[3], now + lease, ARGV[3])
return 1
";

const COMMIT_POINT: &str = r"
local cur = redis.call('GET', KEYS[1])
if not free_holder(cur, KEYS[2], ARGV[1], now_ms()) then return 0 end
redis.call('SETRANGE', KEYS[1], 58, CP_PASSED)
if ARGV[2] then
  redis.call('HSET', KEYS[2], 'note', ARGV[2])
  follow_ttl(KEYS[1], KEYS[2])
end
return 1
";

const MARK_UNKNOWN: &str = r"
local key, last, meta, idx = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local cur = redis.call('GET', key)
local now = now_ms()
if free_holder(cur, meta, ARGV[1], now) then
  local retention = tonumber(ARGV[2])
  redis.call('SET', key, UNKNOWN_HEAD .. string.sub(cur, 3, 34), 'PX', retention)
  redis.call('SET', last, ARGV[1], 'PX', tonumber(ARGV[3]))
  redis.call('HSET', meta, 'reason', ARGV[4], 'notified', '0')
  redis.call('PEXPIRE', meta, retention)
  index_at(idx, now, ARGV[5])
  return 1
end
-- The same mark sent again (its reply was lost): still unknown.
if unknown(cur) and redis.call('GET', last) == ARGV[1] then
  return 1
end
return 0
";

const MARK_NOTIFIED: &str = r"
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[2], 'notified', '1')
  follow_ttl(KEYS[1], KEYS[2])
end
return 1
";

const LIVE: &str = r"
local cur = redis.call('GET', KEYS[1])
local now = now_ms()
if in_progress(cur) and now < lease_until(cur) and not adopted(KEYS[2], now) then
  return 1
end
return 0
";

const READ: &str = r"
local cur = redis.call('GET', KEYS[1])
if not cur then return {0, '', 0} end
return {1, cur, adopted(KEYS[2], now_ms()) or 0}
";

const ADOPT: &str = r"
local key, meta, idx = KEYS[1], KEYS[2], KEYS[3]
local token, hold, stale, member = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local cur = redis.call('GET', key)
local now = now_ms()
if not cur then
  unindex(idx, member)
  return {}
end
local until_ms, holder = adopted(meta, now)
if until_ms and holder ~= token then return {} end
-- Due again when the adoption lapses (a claim: once `stale` has passed since).
local due_at
if in_progress(cur) then
  if stale >= 0 and now < lease_until(cur) + stale then return {} end
  due_at = now + hold - math.max(stale, 0)
elseif unknown(cur) then
  local ended = tonumber(redis.call('HGET', meta, 'ended'))
  if stale >= 0 and ended and now < ended + stale then return {} end
  due_at = now + hold
else
  return {}
end
redis.call('HSET', meta, 'atok', token, 'auntil', now + hold)
follow_ttl(key, meta)
index_at(idx, due_at, member)
return pending(cur, meta, now)
";

const PEEK: &str = r"
local cur = redis.call('GET', KEYS[1])
if not (in_progress(cur) or unknown(cur)) then return {} end
return pending(cur, KEYS[2], now_ms())
";

const SETTLE: &str = r"
local key, last, meta, idx = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local token, kind, member, window = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local cur = redis.call('GET', key)
local now = now_ms()
local until_ms, holder = adopted(meta, now)
if not (cur and until_ms and holder == token) then
  -- The same settlement sent again (its reply was lost): already applied.
  if redis.call('GET', last) == token then return 1 end
  return 0
end
if kind == 'complete' then
  local tpl = ARGV[5]
  local blob = string.sub(tpl, 1, 2) .. string.sub(cur, 3, 34) .. string.sub(tpl, 35)
  redis.call('SET', key, blob, 'PX', tonumber(ARGV[6]))
  redis.call('DEL', meta)
  unindex(idx, member)
elseif kind == 'release' then
  redis.call('DEL', key, meta)
  unindex(idx, member)
else
  local next_ms = now + tonumber(ARGV[5])
  if in_progress(cur) then
    -- Unknown until the claim's own retention ends.
    redis.call('HSET', meta, 'ended', lease_until(cur))
    local v = UNKNOWN_HEAD .. string.sub(cur, 3, 34)
    local pttl = redis.call('PTTL', key)
    if pttl > 0 then
      redis.call('SET', key, v, 'PX', pttl)
    else
      redis.call('SET', key, v)
    end
    redis.call('HSETNX', meta, 'reason', LEASE_EXPIRED)
  end
  redis.call('HSET', meta, 'notified', ARGV[6], 'next', next_ms)
  redis.call('HDEL', meta, 'atok', 'auntil')
  follow_ttl(key, meta)
  index_at(idx, next_ms, member)
end
redis.call('SET', last, token, 'PX', window)
return 1
";

// Reads the records of the ids it finds, by name: on one server any key may be read;
// on a cluster the index of a slot lists only records of that slot.
const DUE: &str = r"
local idx = KEYS[1]
local prefix, stale = ARGV[1], tonumber(ARGV[2])
local limit, scan = tonumber(ARGV[3]), tonumber(ARGV[4])
local now = now_ms()
local out = {}
local found = redis.call('ZRANGEBYSCORE', idx, '-inf', now, 'WITHSCORES', 'LIMIT', 0, scan)
for i = 1, #found, 2 do
  local member, score = found[i], tonumber(found[i + 1])
  local key = prefix .. '{' .. member .. '}'
  local cur = redis.call('GET', key)
  if in_progress(cur) then
    if score <= now - stale then out[#out + 1] = member end
  elseif unknown(cur) then
    local ended = tonumber(redis.call('HGET', key .. ':meta', 'ended'))
    if not ended or ended <= now - stale then out[#out + 1] = member end
  else
    -- Expired, or no longer pending.
    redis.call('ZREM', idx, member)
  end
  if #out >= limit then break end
end
return out
";

const LIST: &str = r"
local idx = KEYS[1]
local prefix, limit, scan = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local now = now_ms()
local out = {}
local found = redis.call('ZRANGE', idx, 0, scan - 1)
for i = 1, #found do
  local member = found[i]
  local cur = redis.call('GET', prefix .. '{' .. member .. '}')
  if unknown(cur) or (in_progress(cur) and lease_until(cur) <= now) then
    out[#out + 1] = member
  end
  if #out >= limit then break end
end
return out
";

const SCAN_LEASE: &str = r"
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', tonumber(ARGV[2]))
return 1
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
            mark_notified: script(MARK_NOTIFIED),
            live: script(LIVE),
            read: script(READ),
            adopt: script(ADOPT),
            peek: script(PEEK),
            settle: script(SETTLE),
            due: script(DUE),
            list: script(LIST),
            scan_lease: Script::new(SCAN_LEASE),
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
