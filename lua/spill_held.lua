--[[
spill_held.lua -- held forwards of N clients written to their stores as handed-out messages, with the serials
and packet ids they were handed out with, and their origin marks raised (tbmq_device_persistence.held: a held
copy not acknowledged in time, or a client leaving held mode). With no records it raises the marks alone; the
service writes the marks of acknowledged copies with held_marks.lua, one key and two commands a client.
Needs lua/packet_ids.lua prepended (the store does it).

KEYS: 3 per client, client c (1..N) at KEYS[3c-2 .. 3c] (one hash slot per call in Redis Cluster, as
  save_messages.lua):
  KEYS[1]  <p>{client}_messages   ZSET member "<serial>:<size>", score = serial; value at KEYS[1] .. "_" .. serial
  KEYS[2]  <p>{client}_pids       HASH packet id -> member (handed out, not acknowledged)
  KEYS[3]  <p>{client}_state      HASH (save_messages.lua): bytes, exp and the origin marks "o<partition>" are
                                  written; serial and pid only from the cursor header, when the state lacks them
                                  or its serial is lower (reserve_held.lua put them past the block; a state that
                                  Redis lost while the client was held (a live client's state has no TTL:
                                  packet_ids.lua, state_lifetime) comes back with them, so the serials a
                                  later save hands out stay above every one the connection was given)
ARGV:
  ARGV[c]  client c: an optional cursor header, "!" <serial> ":" <packet id> ";" (the end of the block
           reserve_held.lua reserved, and the last packet id handed out), then an optional marks header,
           "#" <partition> ":" <offset> ("," <partition> ":" <offset>)* ";",
           then its records, oldest first: (<ttl_ms> "," <serial> "," <length> ":" <value>)*
           ttl_ms  1 to 15 decimal digits, no leading zero (> 0), passed to SET PX as written
           serial  the serial it was handed out with (ascending)
           value   1 type byte ("P") + the 2-byte big-endian packet id it was handed out with (not 0) + a
                   serialized tbmq.v1.PublishMsg: the value save_messages.lua stores for a forwarded message
Rules: a mark raises "o<partition>" only when it is higher (and is not written without records to a state that is gone) (save_messages.lua then drops a copy routed again at
  or below it). A record whose serial is stored already is skipped (a spill retried after a lost reply stores
  nothing twice). The packet id is recorded as handed out to the record's member. The keys' deadline moves as in
  save_messages.lua when a record outlives it; the ZSET and the HASH get it in any case (an emptied one was deleted).
Returns: integer, how many records were stored, all clients together.
]]
if #KEYS == 0 or #KEYS % 3 ~= 0 or #ARGV ~= #KEYS / 3 then
  return redis.error_reply('ERR spill_held: 3 keys per client and one argument each')
end
-- parse everything first: a malformed argument fails the call before anything is written
local parsed = {}
for c = 1, #KEYS / 3 do
  local blob = ARGV[c]
  local pos, size = 1, #blob
  local cursor = nil
  if string.sub(blob, 1, 1) == '!' then
    local semi = string.find(blob, ';', 2, true)
    local serial, pid
    if semi then serial, pid = string.match(string.sub(blob, 2, semi - 1), '^(%d+):(%d+)$') end
    if not serial or tonumber(pid) > 65535 then
      return redis.error_reply('ERR spill_held: bad cursor header of client ' .. c)
    end
    cursor = {serial, pid}
    pos = semi + 1
  end
  local marks = {}
  if string.sub(blob, pos, pos) == '#' then
    local semi = string.find(blob, ';', pos + 1, true)
    if not semi then return redis.error_reply('ERR spill_held: bad marks header of client ' .. c) end
    for entry in string.gmatch(string.sub(blob, pos + 1, semi - 1), '[^,]+') do
      local p, o = string.match(entry, '^(%d+):(%d+)$')
      if not p then return redis.error_reply('ERR spill_held: bad marks header of client ' .. c) end
      marks[#marks + 1] = {'o' .. p, tonumber(o), o}
    end
    pos = semi + 1
  end
  local records = {}
  local last = -1
  while pos <= size do
    local c1 = string.find(blob, ',', pos, true)
    local c2 = c1 and string.find(blob, ',', c1 + 1, true)
    local colon = c2 and string.find(blob, ':', c2 + 1, true)
    local ttl = c1 and string.sub(blob, pos, c1 - 1)
    local serial = c2 and string.sub(blob, c1 + 1, c2 - 1)
    local len = colon and tonumber(string.sub(blob, c2 + 1, colon - 1))
    if not (ttl and serial and len) or #ttl > 15 or not string.find(ttl, '^[1-9]%d*$')
        or not string.find(serial, '^%d+$') or tonumber(serial) <= last or len < 3 or colon + len > size then
      return redis.error_reply('ERR spill_held: bad record at byte ' .. pos .. ' of client ' .. c)
    end
    local value = string.sub(blob, colon + 1, colon + len)
    local pid = string.byte(value, 2) * 256 + string.byte(value, 3)
    if pid == 0 then return redis.error_reply('ERR spill_held: a record without a packet id, client ' .. c) end
    last = tonumber(serial)
    records[#records + 1] = {ttl, serial, value, pid}
    pos = colon + len + 1
  end
  parsed[c] = {marks, records, cursor}
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
local stored = 0
for c = 1, #KEYS / 3 do
  local zkey, pkey, skey = KEYS[3 * c - 2], KEYS[3 * c - 1], KEYS[3 * c]
  local marks, records, cursor = parsed[c][1], parsed[c][2], parsed[c][3]
  local fields = {}
  -- marks alone are not written to a state that is gone (the client's keys expired or were cleared): they
  -- would make a state without a TTL
  if #records == 0 and redis.call('EXISTS', skey) == 0 then marks = {} end
  for _, m in ipairs(marks) do
    local h = tonumber(redis.call('HGET', skey, m[1]) or '')
    if h == nil or m[2] > h then
      fields[#fields + 1] = m[1]
      fields[#fields + 1] = m[3]
    end
  end
  local added, max_ttl = 0, 0
  for _, r in ipairs(records) do
    local ttl, serial, value, pid = r[1], r[2], r[3], r[4]
    local member = serial .. ':' .. int_text(#value)
    if redis.call('ZADD', zkey, 'NX', serial, member) == 1 then
      redis.call('SET', zkey .. '_' .. serial, value, 'PX', ttl)
      redis.call('HSET', pkey, int_text(pid), member)
      added = added + #value
      stored = stored + 1
      local ttl_ms = tonumber(ttl)
      if ttl_ms > max_ttl then max_ttl = ttl_ms end
    end
  end
  if added > 0 then
    redis.call('HINCRBY', skey, 'bytes', int_text(added))
    local st = redis.call('HMGET', skey, 'exp', 'live')
    local exp = tonumber(st[1] or '')
    local moved = moved_exp(exp, now, max_ttl)
    if moved then
      exp = moved
      fields[#fields + 1] = 'exp'
      fields[#fields + 1] = int_text(exp)
      if not st[2] then redis.call('PEXPIREAT', skey, int_text(exp)) end  -- a live state has none
    end
    redis.call('PEXPIREAT', zkey, int_text(exp))
    redis.call('PEXPIREAT', pkey, int_text(exp))
  end
  if cursor and (#records > 0 or redis.call('EXISTS', skey) == 1) then
    local st = redis.call('HMGET', skey, 'serial', 'pid')
    if st[1] == false or tonumber(st[1]) < tonumber(cursor[1]) then
      fields[#fields + 1] = 'serial'
      fields[#fields + 1] = cursor[1]
    end
    if st[2] == false then
      fields[#fields + 1] = 'pid'
      fields[#fields + 1] = cursor[2]
    end
  end
  if #fields > 0 then redis.call('HSET', skey, unpack(fields)) end
end
return stored
