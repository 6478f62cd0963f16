--[[
fetch_undelivered.lua -- one PAGE of the stored (undelivered) messages of ONE client, in serial order,
handing out packet ids (needs lua/packet_ids.lua prepended; the store does it).

KEYS:
  KEYS[1]  <p>{client}_messages   ZSET "<serial>:<size>" scored by serial; value at KEYS[1] .. "_" .. serial
  KEYS[2]  <p>{client}_pids       HASH packet id -> member: handed out, not acknowledged
  KEYS[3]  <p>{client}_state      HASH pid, serial, bytes, live
  KEYS[4]  <p>{client}_attached   STRING "<service_id>|<session_id>": the connection of the client
ARGV:
  ARGV[1]  the attachment value "<service_id>|<session_id>" ("" with "peek")
  ARGV[2]  "attach": set KEYS[4] to ARGV[1] (the first page of a connection; the client stops being
           live: the previous connection gets no more forwards) | "check": read only while KEYS[4] holds
           ARGV[1], else return -1 (later pages and re-syncs must never take the attachment back from a
           newer connection) | "peek": read only, no packet id handed out, attachment untouched
  ARGV[3]  after: only messages with serial > after (0 = from the start)
  ARGV[4]  most messages in the page (0 = no bound)
  ARGV[5]  most bytes in the page (0 = no bound; the first message always fits)
  ARGV[6]  handed-out limit: a message without a packet id is handed out only while fewer ids are in use
  ARGV[7]  TTL (ms) for the client's bookkeeping keys when its messages have none left to inherit
  ARGV[8]  "1": ARGV[5] binds the first message too (a later part of a page the store reads in several
           calls: the page as a whole stays within its bytes); absent or "0": the first message always fits
Returns: {more, pid_1, serial_1, value_1, ..., pid_n, serial_n, value_n} in serial order, value = the
  stored value (type byte + 2 bytes + PublishMsg; its packet id bytes may predate this call: use pid_i).
  more = 1 when messages beyond the page remain (a bound, or the handed-out limit, was reached).
  A message already handed out keeps its packet id (a re-send after a reconnect); others get one now.
  When the page reaches the end (more = 0) with "attach"/"check", the client becomes LIVE for ARGV[1]
  (state.live = ARGV[1]): save_messages.lua forwards the messages saved from now on to that connection,
  with packet ids. A page that does not reach the end makes it not live (state.live removed, also in
  "check" mode): saves wait for the pages instead of being forwarded ahead of the backlog. Every save_messages.lua call runs wholly before or after this script (same slot), so
  a message saved before it is in this or a later page, and one saved after the last page is forwarded:
  none is stranded, and order by serial holds (a message saved while the client pages comes in a later
  page, after the backlog).
  References whose value expired are removed (lazy cleanup; their bytes leave state.bytes).
  The state of a LIVE client has no TTL (packet_ids.lua, state_lifetime): made live, it is PERSISTed; made not
  live, it gets state.exp back (or ARGV[7] without one).
Cost: O(page) (plus the expired references skipped), never the whole backlog; per chunk of up to 256
  members one ZRANGEBYSCORE, one MGET of the values, one HMGET and one HSET for the packet ids handed out,
  and a SETRANGE per message handed out: no per-message GET/HGET/HSET.
]]
local zkey, pkey, skey, akey = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local value_of, mode = ARGV[1], ARGV[2]
if mode == 'check' then
  if redis.call('GET', akey) ~= value_of then
    return -1
  end
elseif mode == 'attach' then
  redis.call('SET', akey, value_of)
  redis.call('HDEL', skey, 'live')
elseif mode ~= 'peek' then
  return redis.error_reply('ERR fetch_undelivered: mode must be attach, check or peek')
end
local max_count, max_bytes = tonumber(ARGV[4]) or 0, tonumber(ARGV[5]) or 0
local strict = ARGV[8] == '1'
local hlimit = tonumber(ARGV[6]) or 0
local hand = mode ~= 'peek'
local prefix = zkey .. '_'
local last = tonumber(redis.call('HGET', skey, 'pid') or '0')
local handed = handed_out(pkey, prefix, hlimit)
local last0 = last
local out = {0}
local count, bytes, gone = 0, 0, 0
local cursor = '(' .. (ARGV[3] or '0')
local more = 0
local chunk = 256
if max_count > 0 and max_count < chunk then chunk = max_count + 1 end
-- per chunk of members: one MGET of the values, one HMGET for the packet ids handed out (free_pids), one
-- HSET recording them, a SETRANGE per newly handed-out value; never a call per message for the rest.
-- Tables grow through explicit counters, not `t[#t + 1]` (Lua's # searches for the border, O(log n) per
-- append), and each member is parsed once (member_parts): the script is per-message Lua work.
while true do
  local members = redis.call('ZRANGEBYSCORE', zkey, cursor, '+inf', 'LIMIT', 0, chunk)
  -- the members that fit the page's bounds (their sizes are in the members)
  local take, serials, sizes, mkeys = {}, {}, {}, {}
  local n_take = 0
  local n_count, n_bytes = count, bytes
  local stop = false
  for i = 1, #members do
    local member = members[i]
    local serial, size = member_parts(member)
    if (max_count > 0 and n_count >= max_count) or (max_bytes > 0 and (n_count > 0 or strict) and n_bytes + size > max_bytes) then
      more, stop = 1, true
      break
    end
    n_take = n_take + 1
    take[n_take] = member
    serials[n_take] = serial
    sizes[n_take] = size
    mkeys[n_take] = prefix .. serial
    n_count = n_count + 1
    n_bytes = n_bytes + size
  end
  local chunk_gone = false
  if n_take > 0 then
    local values = redis.call('MGET', unpack(mkeys))
    local r_pid, fresh = {}, {}
    local n_fresh = 0
    for i = 1, n_take do
      local value = values[i]
      if not value then
        redis.call('ZREM', zkey, take[i])
        gone = gone + sizes[i]
        chunk_gone = true
      else
        local hi, lo = string.byte(value, 2, 3)
        local pid = hi * 256 + lo
        if pid == 0 and hand then
          if handed >= hlimit then
            more, stop, chunk_gone = 1, true, false
            break
          end
          handed = handed + 1
          n_fresh = n_fresh + 1
          fresh[n_fresh] = i
        end
        r_pid[i] = pid
        count = count + 1
        bytes = bytes + sizes[i]
      end
      cursor = '(' .. serials[i]
    end
    if n_fresh > 0 then
      local ids
      ids, last = free_pids(pkey, last, n_fresh, prefix)
      local hargs = {}
      for j = 1, n_fresh do
        local i, id = fresh[j], ids[j]
        r_pid[i] = id
        hargs[2 * j - 1] = id
        hargs[2 * j] = take[i]
        redis.call('SETRANGE', mkeys[i], 1, pid_bytes(id))
      end
      record_pids(pkey, hargs)
    end
    local n_out = #out
    for i = 1, n_take do
      local pid = r_pid[i]
      if pid then
        out[n_out + 1] = pid
        out[n_out + 2] = tonumber(serials[i])
        out[n_out + 3] = values[i]
        n_out = n_out + 3
      end
    end
  end
  -- a chunk cut short by the bounds but with expired references in it: the page has room left, go on
  if (stop and not chunk_gone) or #members < chunk then break end
  if stop then more, stop = 0, false end
end
out[1] = more
if last ~= last0 then redis.call('HSET', skey, 'pid', last) end
if gone > 0 and redis.call('EXISTS', skey) == 1 then
  if redis.call('HINCRBY', skey, 'bytes', -gone) < 0 then redis.call('HSET', skey, 'bytes', 0) end
end
if hand then
  if more == 0 then
    redis.call('HSET', skey, 'live', value_of)
  else
    -- not at the end: the client pages. Were it left live (a "check" page after the client was live
    -- before, e.g. the re-sync after a device-persistence restart), new saves would be forwarded ahead
    -- of the backlog still in the store; they wait for the pages instead.
    redis.call('HDEL', skey, 'live')
  end
end
if hand then
  local default_ms = tonumber(ARGV[7]) or 604800000
  keep_ttl({pkey}, zkey, default_ms)
  state_lifetime(skey, more == 0, default_ms)
end
return out
