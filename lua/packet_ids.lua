--[[
packet_ids.lua -- NOT a script: the shared part the store prepends to save_messages.lua and
fetch_undelivered.lua (the one home of packet-id hand-out and of the layout of stored members/values).

Layout (per client, all keys share the client's hash tag):
  <zkey>            ZSET   member "<serial>:<size>" (size = bytes of the stored value), score = serial
  <zkey>_<serial>   STRING value = 1 type byte ("P" PUBLISH / "R" PUBREL) + 2-byte big-endian packet id
                           (0 = not handed out yet) + serialized tbmq.v1.PublishMsg; TTL = the message's
  <pids>            HASH   packet id -> member: the ids HANDED OUT and not acknowledged, nothing else
  <state>           HASH   pid = last packet id handed out, serial = last serial, bytes = stored bytes,
                           live = the attachment value new messages are forwarded to (see save_messages.lua)

A packet id is given to a message when it is first handed to a connection (a fetched page, or a forward
of a live client) and kept with it until it is acknowledged or trimmed, so a re-sent message keeps its
packet id [MQTT-4.4.0-1]. Ids go 1..65535 and wrap to 1; an id is free when the hash has no entry for it
or its entry names a message that no longer exists (expired). Callers keep at most the handed-out limit
(<= 65534) ids in use, so a free id is always found.
]]
local function member_serial(member)
  return string.match(member, '^(%d+)')
end

-- serial (string) and size (number) of a member, one match for both
local function member_parts(member)
  local serial, size = string.match(member, '^(%d+):(%d+)$')
  return serial, tonumber(size) or 0
end

-- a whole number as the decimal text Redis reads. Every number a script hands to redis.call is formatted by
-- Redis 7.0 with "%.17g" (glibc's floating-point path, about 0.56 µs each on the bench's host) and every
-- `n .. ''` by Lua's "%.14g" (0.37 µs); "%d" takes the integer path (0.20 µs). Exact below 2^53, as
-- every serial, packet id, size and deadline here is.
local function int_text(n)
  return string.format('%d', n)
end

local function pid_bytes(pid)
  return string.char(math.floor(pid / 256), pid % 256)
end

-- the next `n` free packet ids after `last`, in hand-out order, and the new last id: one HMGET per round
-- (not one HGET per id). The caller records them (record_pids) and writes them into the values. n + the
-- ids in use <= 65534 (the callers' handed-out limit), so one turn of the id space finds them.
-- `none_in_use`: the caller knows no id is in use (HLEN 0, or nothing stored: an entry left in `pids_key`
-- then names a message that is gone; a live client whose messages were all acknowledged, the usual save),
-- so the next `n` ids are free and no HMGET is needed: the same ids (recording them overwrites such entries).
local function free_pids(pids_key, last, n, msg_prefix, none_in_use)
  local ids = {}
  if none_in_use then
    for i = 1, n do
      last = (last % 65535) + 1
      ids[i] = last
    end
    return ids, last
  end
  local got, tried = 0, 0
  while got < n do
    local want = math.min(n - got, 4000)  -- unpack() below is limited by the C stack (LUAI_MAXCSTACK = 8000)
    local cand = {}
    for i = 1, want do
      last = (last % 65535) + 1
      cand[i] = last
    end
    tried = tried + want
    local owners = redis.call('HMGET', pids_key, unpack(cand))
    for i = 1, want do
      local owner = owners[i]
      if not owner or redis.call('EXISTS', msg_prefix .. member_serial(owner)) == 0 then
        got = got + 1
        ids[got] = cand[i]
      end
    end
    if got < n and tried >= 65535 then
      error('no free packet id')
    end
  end
  return ids, last
end

-- record handed-out ids: `args` = {id_1, member_1, id_2, member_2, ...}, one HSET per 3500 ids (Lua's
-- unpack() is limited by the C stack, LUAI_MAXCSTACK = 8000)
local function record_pids(pids_key, args)
  for i = 1, #args, 7000 do
    redis.call('HSET', pids_key, unpack(args, i, math.min(i + 6999, #args)))
  end
end

-- packet ids in use: HLEN of `pids_key`, after dropping (once per call, and only when `hlimit` is reached)
-- the entries of messages that expired unacknowledged (their value is gone, so nothing else frees them)
local function handed_out(pids_key, msg_prefix, hlimit)
  local n = redis.call('HLEN', pids_key)
  if n < hlimit then return n end
  local entries = redis.call('HGETALL', pids_key)
  for i = 1, #entries, 2 do
    if redis.call('EXISTS', msg_prefix .. member_serial(entries[i + 1])) == 0 then
      redis.call('HDEL', pids_key, entries[i])
      n = n - 1
    end
  end
  return n
end

-- the keys' shared deadline (state.exp, save_messages.lua's header) once messages of `ttl_ms` are saved at `now`:
-- the new deadline, now + TTL + a slack of TTL / 8 (at most an hour), when they would outlive `exp` (nil: none yet);
-- else nil (the deadline stays)
local function moved_exp(exp, now, ttl_ms)
  if exp == nil or now + ttl_ms > exp then
    return now + ttl_ms + math.min(math.floor(ttl_ms / 8), 3600000)
  end
  return nil
end

-- The state's lifetime: a LIVE client's state (state.live set: connected, at the end of its store) has no TTL, so a
-- client connected for longer than the TTL with nothing saved keeps its attachment and serial cursor; any other
-- state expires at state.exp with its messages (or, without one yet, after `default_ms`). Called where state.live
-- is set or removed; the scripts that move the deadline leave a live state's TTL alone.
local function state_lifetime(skey, live, default_ms)
  if live then
    redis.call('PERSIST', skey)
  else
    local exp = redis.call('HGET', skey, 'exp')
    if exp then
      redis.call('PEXPIREAT', skey, exp)
    elseif redis.call('PTTL', skey) == -1 then
      redis.call('PEXPIRE', skey, default_ms)
    end
  end
end

-- bookkeeping keys created here (a new hash has no TTL) get the messages' TTL, or `default_ms`
local function keep_ttl(keys, zkey, default_ms)
  local ttl = redis.call('PTTL', zkey)
  if ttl < 0 then ttl = default_ms end
  for _, key in ipairs(keys) do
    if redis.call('PTTL', key) == -1 then redis.call('PEXPIRE', key, ttl) end
  end
end
