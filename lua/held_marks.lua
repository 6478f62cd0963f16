--[[
held_marks.lua -- the origin marks of N held clients' acknowledged copies raised in their states, and the states'
deadline (state.exp) moved as a save's would move it (tbmq_device_persistence.held). Written before the Persist batches those copies
finished are answered, so a router's replay after a crash drops them: save_messages.lua drops a copy routed again
at or below its client's mark. The marks-only part of spill_held.lua, with one key per client and two commands
each: the hot path of held forwards writes it once per acknowledgement batch.
Needs lua/packet_ids.lua prepended (the store does it: int_text, moved_exp).

KEYS: 1 per client: KEYS[c] = <p>{client}_state, the HASH save_messages.lua documents ("o<partition>" = the
  highest tbmq.msg.all offset of the partition applied; bytes = stored bytes, present while the state exists;
  exp = the keys' shared deadline, ms since the epoch)
ARGV:
  ARGV[1]    the default message TTL in ms (1 to 15 decimal digits, > 0): what a save of these copies would have
             given them
  ARGV[1+c]  client c's marks: <partition> ":" <offset> ("," <partition> ":" <offset>)*, decimal, no sign
Rules: a mark raises "o<partition>" only when it is higher. Nothing is written to a state that is gone (no
  "bytes": the client's keys were cleared): a mark would make a state without a TTL. state.exp moves as
  save_messages.lua moves it for a save of messages of that TTL (when now + TTL passes it: to now + TTL + slack,
  slack = TTL / 8, at most an hour): a held client is saved nothing, and its state, which has no TTL while the
  client is live (packet_ids.lua, state_lifetime), gets state.exp back when it is not live any more: the state
  then outlives the client's last message, held or saved, by the TTL and the slack, as without held forwards.
Returns: integer, how many clients' states were written.
Cost per client: one HMGET, and one HSET when a mark is higher (and at most once per slack for state.exp).
]]
local ttl = ARGV[1] and string.find(ARGV[1], '^[1-9]%d*$') and #ARGV[1] <= 15 and tonumber(ARGV[1])
if not ttl then
  return redis.error_reply('ERR held_marks: the TTL must be 1 to 15 digits, > 0')
end
if #KEYS == 0 or #ARGV ~= #KEYS + 1 then
  return redis.error_reply('ERR held_marks: one key and one marks argument per client, after the TTL')
end
-- parse everything first: a malformed argument fails the call before anything is written
local parsed = {}
for c = 1, #KEYS do
  local arg = ARGV[c + 1]
  local fields, values, len = {'bytes', 'exp'}, {}, -1
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
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local written = 0
for c = 1, #KEYS do
  local skey = KEYS[c]
  local fields, values = parsed[c][1], parsed[c][2]
  local have = redis.call('HMGET', skey, unpack(fields))
  if have[1] then
    local out = {}
    for i, o in ipairs(values) do
      local h = tonumber(have[i + 2] or '')
      if h == nil or tonumber(o) > h then
        out[#out + 1] = fields[i + 2]
        out[#out + 1] = o
      end
    end
    local moved = moved_exp(tonumber(have[2] or ''), now, ttl)
    if moved then  -- the field only: the state of a live client has no TTL (state_lifetime)
      out[#out + 1] = 'exp'
      out[#out + 1] = int_text(moved)
    end
    if #out > 0 then
      redis.call('HSET', skey, unpack(out))
      written = written + 1
    end
  end
end
return written
