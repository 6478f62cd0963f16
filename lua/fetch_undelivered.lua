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
Cost: O(page) (plus the expired references skipped), never the whole backlog.
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
while true do
  local members = redis.call('ZRANGEBYSCORE', zkey, cursor, '+inf', 'LIMIT', 0, chunk)
  local stop = false
  for i = 1, #members do
    local member = members[i]
    local serial = member_serial(member)
    local size = member_size(member)
    if (max_count > 0 and count >= max_count) or (max_bytes > 0 and count > 0 and bytes + size > max_bytes) then
      more, stop = 1, true
      break
    end
    local mkey = prefix .. serial
    local value = redis.call('GET', mkey)
    if not value then
      redis.call('ZREM', zkey, member)
      gone = gone + size
    else
      local pid = string.byte(value, 2) * 256 + string.byte(value, 3)
      if pid == 0 and hand then
        if handed >= hlimit then
          more, stop = 1, true
          break
        end
        pid = hand_out(pkey, last, member, prefix, mkey)
        last = pid
        handed = handed + 1
      end
      out[#out + 1] = pid
      out[#out + 1] = tonumber(serial)
      out[#out + 1] = value
      count = count + 1
      bytes = bytes + size
    end
    cursor = '(' .. serial
  end
  if stop or #members < chunk then break end
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
if hand then keep_ttl({pkey, skey}, zkey, tonumber(ARGV[7]) or 604800000) end
return out
