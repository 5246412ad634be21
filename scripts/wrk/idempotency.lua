-- wrk script of scripts/bench-idempotency-capacity: POSTs a 64-byte JSON body with an
-- Idempotency-Key and checks every answer.
--
-- Arguments (after `--`): MODE PATH NONCE
--   first   a new key per request ("f-NONCE-THREAD-N")
--   replay  keys cycling over 1,000 records ("r-NONCE-I", I = 0..999; the threads
--           share the cycle), each answer must be a replay
--   prefill the same keys as replay, replayed or not (completes the 1,000 records)
-- Every answer must be 201; `first` on /guarded must not be a replay. done() prints
-- one line: "check requests=N bad=M" (M answers that were not as due).

local threads = {}

function setup(thread)
  thread:set("tid", #threads)
  table.insert(threads, thread)
end

function init(args)
  mode, path, nonce = args[1], args[2], args[3]
  nthreads = tonumber(args[4] or "1")
  n, bad, seen = 0, 0, 0
  wrk.method = "POST"
  wrk.path = path
  wrk.body = '{"amount":1000,"currency":"EUR","reference":"order-00000000042"}'
  wrk.headers["Content-Type"] = "application/json"
end

function request()
  n = n + 1
  local key
  if mode == "first" then
    key = "f-" .. nonce .. "-" .. tid .. "-" .. n
  else
    key = "r-" .. nonce .. "-" .. ((n * nthreads + tid) % 1000)
  end
  wrk.headers["Idempotency-Key"] = key
  return wrk.format()
end

function response(status, headers, body)
  seen = seen + 1
  local replayed = headers["idempotent-replayed"] == "true"
  if status ~= 201 then
    bad = bad + 1
  elseif mode == "replay" and not replayed then
    bad = bad + 1
  elseif mode == "first" and replayed then
    bad = bad + 1
  end
end

function done(summary, latency, requests)
  local total_bad, total_seen = 0, 0
  for _, t in ipairs(threads) do
    total_bad = total_bad + t:get("bad")
    total_seen = total_seen + t:get("seen")
  end
  local e = summary.errors
  local errors = e.connect + e.read + e.write + e.status + e.timeout
  io.write(string.format("check requests=%d seen=%d bad=%d errors=%d\n",
    summary.requests, total_seen, total_bad, errors))
end
