--[[
held_marks.lua -- the origin marks of N held clients' acknowledged copies raised in their states
(tbmq_device_persistence.held: written before the Persist batches those copies finished are answered, so a
router's replay after a crash drops them: save_messages.lua drops a copy routed again at or below its client's
mark). The marks-only part of spill_held.lua, with one key per client and two commands each: the hot path of
held forwards writes it once per acknowledgement batch.
Needs lua/packet_ids.lua prepended (the store does it; int_text is not used here).

KEYS: 1 per client: KEYS[c] = <p>{client}_state, the HASH save_messages.lua documents ("o<partition>" = the
  highest tbmq.msg.all offset of the partition applied; bytes = stored bytes, present while the state exists)
ARGV:
  ARGV[c]  client c's marks: <partition> ":" <offset> ("," <partition> ":" <offset>)*, decimal, no sign
Rules: a mark raises "o<partition>" only when it is higher. Nothing is written to a state that is gone (no
  "bytes": the client's keys expired or were cleared): a mark would make a state without a TTL.
Returns: integer, how many clients' states were written.
Cost per client: one HMGET, and one HSET when a mark is higher.
]]
if #KEYS == 0 or #ARGV ~= #KEYS then
  return redis.error_reply('ERR held_marks: one key and one marks argument per client')
end
-- parse everything first: a malformed argument fails the call before anything is written
local parsed = {}
for c = 1, #KEYS do
  local arg = ARGV[c]
  local fields, values, len = {'bytes'}, {}, -1
  for p, o in string.gmatch(arg, '(%d+):(%d+)') do
    fields[#fields + 1] = 'o' .. p
    values[#values + 1] = o
    len = len + #p + #o + 2  -- the pair, its colon and the comma before it
  end
  if #values == 0 or len ~= #arg or string.find(arg, '[^%d:,]') then
    return redis.error_reply('ERR held_marks: bad marks of client ' .. c)
  end
  parsed[c] = {fields, values}
end
local written = 0
for c = 1, #KEYS do
  local skey = KEYS[c]
  local fields, values = parsed[c][1], parsed[c][2]
  local have = redis.call('HMGET', skey, unpack(fields))
  if have[1] then
    local out = {}
    for i, o in ipairs(values) do
      local h = tonumber(have[i + 1] or '')
      if h == nil or tonumber(o) > h then
        out[#out + 1] = fields[i + 1]
        out[#out + 1] = o
      end
    end
    if #out > 0 then
      redis.call('HSET', skey, unpack(out))
      written = written + 1
    end
  end
end
return written
