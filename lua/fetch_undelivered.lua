--[[
fetch_undelivered.lua -- every stored (undelivered) message of ONE client, in serial order.

KEYS:
  KEYS[1]  <p>{client}_messages   ZSET of message keys (KEYS[1] .. "_" .. packet_id) scored by serial
  KEYS[2]  <p>{client}_attached   (optional) STRING "<service_id>|<session_id>": the connection the
           client's new messages are forwarded to
ARGV:
  ARGV[1]  (with KEYS[2]) the attachment value "<service_id>|<session_id>"
  ARGV[2]  (optional) "check": do not attach; read only when KEYS[2] already holds ARGV[1], else
           return -1 (a re-sync of a connection must never take the attachment back from a newer one)
Returns: a flat array {pid_1, serial_1, value_1, ..., pid_n, serial_n, value_n} ordered by serial
  (never by packet id), value = 1 type byte ("P" PUBLISH / "R" PUBREL) + serialized tbmq.v1.PublishMsg.
  References whose message key has expired (TTL / message expiry) are removed from the ZSET (lazy
  cleanup) and not returned.
  With KEYS[2], the client is ATTACHED in the same atomic step: KEYS[2] is set to ARGV[1] (no TTL;
  removed by detach.lua / clear_all.lua, replaced by the next fetch). Every save_messages.lua call
  runs entirely before or entirely after this script (same slot, scripts are atomic), so a message
  saved before it is in this answer and a message saved after it sees the new attachment and is
  forwarded to that connection: none is stranded while the client reconnects.
  With ARGV[2] = "check", nothing is written except the lazy cleanup; -1 = not attached to ARGV[1].
Cost: O(n) in the client's stored messages (at most the limit, <= 65535) in one atomic step.
]]
if KEYS[2] then
  if ARGV[2] == 'check' then
    if redis.call('GET', KEYS[2]) ~= ARGV[1] then
      return -1
    end
  else
    redis.call('SET', KEYS[2], ARGV[1])
  end
end
local zkey = KEYS[1]
local plen = #zkey + 2
local members = redis.call('ZRANGE', zkey, 0, -1, 'WITHSCORES')
local out = {}
for i = 1, #members, 2 do
  local mkey = members[i]
  local value = redis.call('GET', mkey)
  if value then
    out[#out + 1] = tonumber(string.sub(mkey, plen))
    out[#out + 1] = tonumber(members[i + 1])
    out[#out + 1] = value
  else
    redis.call('ZREM', zkey, mkey)
  end
end
return out
