--[[
fetch_undelivered.lua -- every stored (undelivered) message of ONE client, in serial order.

KEYS:
  KEYS[1]  <p>{client}_messages   ZSET of message keys (KEYS[1] .. "_" .. packet_id) scored by serial
ARGV: none
Returns: a flat array {pid_1, serial_1, value_1, ..., pid_n, serial_n, value_n} ordered by serial
  (never by packet id), value = 1 type byte ("P" PUBLISH / "R" PUBREL) + serialized tbmq.v1.PublishMsg.
  References whose message key has expired (TTL / message expiry) are removed from the ZSET (lazy
  cleanup) and not returned.
Cost: O(n) in the client's stored messages (at most the limit, <= 65535) in one atomic step.
]]
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
