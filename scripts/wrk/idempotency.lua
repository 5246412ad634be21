-- wrk script of scripts/bench-idempotency-capacity: POSTs a 64-byte JSON body with an
-- Idempotency-Key and checks every answer.
--
-- Arguments (after `--`): MODE PATH NONCE THREADS [PER_SESSION]
--   first   a new key per request ("f-NONCE-THREAD-N")
--   replay  keys cycling over 1,000 records ("r-NONCE-I", I = 0..999; the threads
--           share the cycle), each answer must be a replay
--   prefill the same keys as replay, replayed or not (completes the 1,000 records)
-- PER_SESSION (for axum-idempotent, which guards only requests of a session and keeps
-- their responses in it): a session cookie per PER_SESSION consecutive keys, as many
-- clients each sending a few requests; the same key always carries the same session.
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
  per_session = tonumber(args[5] or "0")
  -- The nonce as digits, so that a run's session ids are its own.
  run_id = 0
  for i = 1, #nonce do
    run_id = (run_id * 31 + nonce:byte(i)) % 100000000
  end
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
  if per_session > 0 then
    -- A ruts session id: 22 characters of base64url (128 bits, the last 4 zero).
    local session
    if mode == "first" then
      session = tid * 1000000000 + math.floor(n / per_session)
    else
      session = math.floor(((n * nthreads + tid) % 1000) / per_session)
    end
    wrk.headers["Cookie"] = string.format("session=%08d%013dA", run_id, session)
  end
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
