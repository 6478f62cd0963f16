--[[
fetch_undelivered.lua -- every stored (undelivered) message of ONE client, in serial order, already
encoded as the `messages` field of a tbmq.v1.FetchUndeliveredResponse (so the service does no work
per message: one bulk reply, parsed by protobuf's C code).

KEYS:
  KEYS[1]  <p>{client}_messages   ZSET of message keys (KEYS[1] .. "_" .. packet_id) scored by serial
  KEYS[2]  <p>{client}_attached   (optional) STRING "<service_id>|<session_id>": the connection the
           client's new messages are forwarded to
ARGV:
  ARGV[1]  the encoded client_id field of DevicePublishMsg (field 1: tag byte 10, varint length, UTF-8
           client id), copied into every message
  ARGV[2]  (with KEYS[2]) the attachment value "<service_id>|<session_id>"
  ARGV[3]  (optional) "check": do not attach; read only when KEYS[2] already holds ARGV[2], else
           return -1 (a re-sync of a connection must never take the attachment back from a newer one)
Returns: one string, the concatenation for every stored message, ordered by serial (never by packet
  id), of a FetchUndeliveredResponse field 1 (tag byte 10, varint length) holding a DevicePublishMsg:
      ARGV[1]                          client_id
      tag 16, varint packet_id         packet_id  (the message key's suffix)
      tag 24, varint serial            serial     (the ZSET score)
      tag 32, 1                        packet_type PUBREL, only when the type byte is "R" (PUBLISH = 0
                                       is proto3's default and not encoded)
      tag 42, varint length, PublishMsg msg       (the stored value without its type byte)
  (the stored value = 1 type byte "P" PUBLISH / "R" PUBREL + serialized tbmq.v1.PublishMsg).
  References whose message key has expired (TTL / message expiry) are removed from the ZSET (lazy
  cleanup) and not returned.
  With KEYS[2], the client is ATTACHED in the same atomic step: KEYS[2] is set to ARGV[2] (no TTL;
  removed by detach.lua / clear_all.lua, replaced by the next fetch). Every save_messages.lua call
  runs entirely before or entirely after this script (same slot, scripts are atomic), so a message
  saved before it is in this answer and a message saved after it sees the new attachment and is
  forwarded to that connection: none is stranded while the client reconnects.
  With ARGV[3] = "check", nothing is written except the lazy cleanup; -1 = not attached to ARGV[2].
Cost: O(n) in the client's stored messages (at most the limit, <= 65535) in one atomic step.
]]
if KEYS[2] then
  if ARGV[3] == 'check' then
    if redis.call('GET', KEYS[2]) ~= ARGV[2] then
      return -1
    end
  else
    redis.call('SET', KEYS[2], ARGV[2])
  end
end

local char, floor = string.char, math.floor
local function varint(n)
  if n < 128 then return char(n) end
  local bytes = {}
  while n >= 128 do
    bytes[#bytes + 1] = char(n % 128 + 128)
    n = floor(n / 128)
  end
  bytes[#bytes + 1] = char(n)
  return table.concat(bytes)
end

local cid = ARGV[1] or ''
local zkey = KEYS[1]
local plen = #zkey + 2
local members = redis.call('ZRANGE', zkey, 0, -1, 'WITHSCORES')
local out = {}
for i = 1, #members, 2 do
  local mkey = members[i]
  local value = redis.call('GET', mkey)
  if value then
    local body = string.sub(value, 2)
    local entry = cid .. '\16' .. varint(tonumber(string.sub(mkey, plen))) .. '\24' ..
        varint(tonumber(members[i + 1])) .. (string.byte(value, 1) == 82 and '\32\1' or '') ..
        '\42' .. varint(#body) .. body
    out[#out + 1] = '\10' .. varint(#entry) .. entry
  else
    redis.call('ZREM', zkey, mkey)
  end
end
return table.concat(out)
