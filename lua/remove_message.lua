--[[
remove_message.lua -- remove delivered messages of N clients by packet id (PUBACK, PUBCOMP, or PUBREC
when no PUBREL must be kept): one call for the acknowledgements of many clients. Needs lua/packet_ids.lua
prepended (the store does it).

KEYS: 3 per client, client c (1..N) at KEYS[3c-2 .. 3c] (in Redis Cluster the caller groups clients by
  hash slot, so one call touches one slot):
  KEYS[1]  <p>{client}_messages   ZSET "<serial>:<size>"; value at KEYS[1] .. "_" .. serial
  KEYS[2]  <p>{client}_pids       HASH packet id -> member (handed out, not acknowledged)
  KEYS[3]  <p>{client}_state      HASH; its `bytes` drops by the removed messages' sizes
ARGV:
  ARGV[c]  client c's acknowledgements, comma-separated: a packet id (1..65535) in decimal, or "<id>:<serial>"
           ("7", "7:1042,8:1043,12"). With a serial the id is applied only while it still names the message of
           that serial: an acknowledgement retried from an earlier connection finds the id handed to a newer
           message (freed meanwhile and handed out again) and leaves it alone (not removed, the id stays
           handed out). Without one, whatever message holds the id is removed.
Cost: per client and chunk of up to 4000 ids one HMGET, HDEL, ZMSCORE, ZREM and DEL (Redis >= 6.2), never a
  call per id, and one HINCRBY of the state; for a client with one id (the usual batch of a live client) an
  HGET instead of the HMGET and no ZMSCORE (ZREM's count says whether it was still stored), without the
  tables of the general case. An id listed twice counts once.
Returns: integer, how many of them named a message that still existed (not expired, not already
  removed), all clients together. For one packet id: 1 = removed, 0 = unknown/expired/another serial. The
  packet id is free again unless it names another serial (only handed-out ids are in KEYS[2]: an id never
  handed out finds nothing).
]]
if #KEYS % 3 ~= 0 or #ARGV ~= #KEYS / 3 then
  return redis.error_reply('ERR remove_message: 3 keys per client and one id list each')
end
local removed = 0
for c = 1, #KEYS / 3 do
  local zkey, pkey, skey = KEYS[3 * c - 2], KEYS[3 * c - 1], KEYS[3 * c]
  local prefix = zkey .. '_'
  local freed = 0
  local one_pid, one_serial = string.match(ARGV[c] or '', '^(%d+):?(%d*)$')
  if one_pid then  -- one id (the usual batch of a live client): the rule below without its tables
    local member = redis.call('HGET', pkey, one_pid)
    if member then
      local serial, size = member_parts(member)
      if one_serial == '' or one_serial == serial then
        redis.call('HDEL', pkey, one_pid)
        if redis.call('ZREM', zkey, member) == 1 then freed = size end
        removed = removed + redis.call('DEL', prefix .. serial)
      end
    end
  else
    local pids, serials, seen = {}, {}, {}
    local n_pids = 0
    for item, pid, serial in string.gmatch(ARGV[c] or '', '((%d+):?(%d*))') do
      if not seen[item] then
        seen[item] = true
        n_pids = n_pids + 1
        pids[n_pids] = pid
        serials[n_pids] = serial  -- '' = any
      end
    end
    -- a few calls per chunk of ids (HMGET, HDEL, ZMSCORE, ZREM, DEL), never a call per id; chunked because
    -- Lua's unpack() is limited by the C stack (LUAI_MAXCSTACK = 8000)
    for s = 1, #pids, 4000 do
      local part = {unpack(pids, s, math.min(s + 3999, #pids))}
      local members = redis.call('HMGET', pkey, unpack(part))
      local found, found_members, sizes, mkeys, taken = {}, {}, {}, {}, {}
      local n = 0
      for i = 1, #part do
        local member = members[i]
        local serial, size
        if member then serial, size = member_parts(member) end
        local want = serials[s + i - 1]
        if member and (want == '' or want == serial) and not taken[member] then  -- "7" and "7:<serial>": once
          taken[member] = true
          n = n + 1
          found[n] = part[i]
          found_members[n] = member
          sizes[n] = size
          mkeys[n] = prefix .. serial
        end
      end
      if n > 0 then
        redis.call('HDEL', pkey, unpack(found))
        if n == 1 then
          if redis.call('ZREM', zkey, found_members[1]) == 1 then freed = freed + sizes[1] end
        else
          local scores = redis.call('ZMSCORE', zkey, unpack(found_members))
          for i = 1, n do
            if scores[i] then freed = freed + sizes[i] end
          end
          redis.call('ZREM', zkey, unpack(found_members))
        end
        removed = removed + redis.call('DEL', unpack(mkeys))
      end
    end
  end
  if freed > 0 and redis.call('HINCRBY', skey, 'bytes', int_text(-freed)) < 0 then
    -- below 0: either the state was gone (cleared; HINCRBY just made one holding only `bytes`: delete it
    -- again, nothing may outlive the client without a TTL) or the count drifted (clamp to 0)
    if redis.call('HLEN', skey) == 1 then redis.call('DEL', skey) else redis.call('HSET', skey, 'bytes', '0') end
  end
end
return removed
