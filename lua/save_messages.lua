--[[
save_messages.lua -- store a batch of messages for each of N persistent DEVICE clients, atomically
(one call for many clients: the cost of a script call is paid per batch, not per client).

KEYS: 4 per client, client c (1..N) at KEYS[4c-3 .. 4c] (each client's keys share its hash tag; in
  Redis Cluster the caller groups clients by hash slot, so one call touches one slot):
  KEYS[1]  <p>{client}_messages        ZSET: member = message key, score = serial
  KEYS[2]  <p>{client}_last_packet_id  STRING: last packet id handed out (1..65535)
  KEYS[3]  <p>{client}_serial          STRING: last serial handed out (never goes back)
  KEYS[4]  <p>{client}_attached        STRING "<service_id>|<session_id>" set by
           fetch_undelivered.lua: where the client is connected (read only here); may be left out
           only when N = 1 (3 keys)
  A message key is KEYS[1] .. "_" .. packet_id (same slot as KEYS[1]; not listed in KEYS because
  its packet id is only known inside the script).
ARGV:
  ARGV[1]  limit: most messages kept per client, 1..65535
  ARGV[1+c] client c's batch, oldest first, as concatenated records (one argument instead of 2 per
           message: much less client-side encoding work):
               <ttl_ms> "," <length> ":" <value>
           ttl_ms  decimal TTL in milliseconds (> 0)
           length  decimal byte length of value
           value   1 type byte ("P" = PUBLISH, "R" = PUBREL) + a serialized tbmq.v1.PublishMsg
           e.g. "604800000,4:Pabc1000,2:Px" (two messages)
Returns: a flat array of 5 elements per client, in KEYS order: {trimmed, skipped, first_serial,
  pids, attached} of client 1, then of client 2, ... (N = 1: exactly one such group)
  trimmed       previously stored references dropped (oldest first) to respect the limit
  skipped       how many of the batch's OLDEST messages were not stored because the batch alone held
                more than `limit` messages (the limit would trim them at once anyway): messages
                skipped+1 .. n are stored
  first_serial  serial (ZSET score) of message skipped+1; the stored messages get consecutive serials
  pids          a string of 2-byte big-endian packet ids, one per stored message, in batch order
  attached      the client's KEYS[4c] read atomically with its save ("" when absent or no KEYS[4]):
                the stored messages are to be forwarded to that connection (they were saved after
                its fetch_undelivered.lua, so they are not in that fetch's answer)

Rules (per client; a bad record or limit fails the whole call before anything is written):
  * Packet ids go 1..65535 and wrap to 1; an id whose message key still exists (undelivered, not
    expired) is SKIPPED (SET ... NX fails and the next id is tried).
  * Before inserting m messages the ZSET is trimmed (ZPOPMIN + DEL, oldest first) to limit - m
    references, so at most 65535 - 1 ids are ever in use while an id is being looked for.
    (A reused id whose old payload had expired -- a stale reference -- keeps its ZSET member and just
    gets the new score, so in that rare case the ZSET ends a little below the limit.)
  * The serial grows forever, so order survives packet-id wrap-around and an emptied ZSET (ordering is
    never by packet id: TBMQ #207). If the serial key is missing (e.g. data from an older layout) the
    highest score in the ZSET is used as the base.
  * The three client keys get a TTL of at least the longest message TTL saved so far, so a client that
    never comes back leaves nothing behind once all its messages have expired.
]]
local limit = tonumber(ARGV[1])
if limit == nil or limit < 1 or limit > 65535 then
  return redis.error_reply('ERR save_messages: limit must be 1..65535')
end
local nkeys = #KEYS
local clients
if nkeys == 3 then
  clients = 1
elseif nkeys % 4 == 0 and nkeys > 0 and #ARGV == nkeys / 4 + 1 then
  clients = nkeys / 4
else
  return redis.error_reply('ERR save_messages: 4 keys per client and one batch argument each')
end

-- parse every batch first: a malformed one fails the call before anything is written
local batches = {}
for c = 1, clients do
  local blob = ARGV[c + 1] or ''
  local ttls, values = {}, {}
  local pos, size = 1, #blob
  while pos <= size do
    local comma = string.find(blob, ',', pos, true)
    local colon = comma and string.find(blob, ':', comma + 1, true)
    local ttl = comma and tonumber(string.sub(blob, pos, comma - 1))
    local len = colon and tonumber(string.sub(blob, comma + 1, colon - 1))
    if not (ttl and len) or ttl <= 0 or colon + len > size then
      return redis.error_reply('ERR save_messages: bad record at byte ' .. pos .. ' of batch ' .. c)
    end
    ttls[#ttls + 1] = ttl
    values[#values + 1] = string.sub(blob, colon + 1, colon + len)
    pos = colon + len + 1
  end
  batches[c] = {ttls, values}
end

local reply = {}
for c = 1, clients do
  local base = (c - 1) * 4
  local zkey, kpid, kserial, kattached = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3], KEYS[base + 4]
  local ttls, values = batches[c][1], batches[c][2]
  local n = #values
  local prefix = zkey .. '_'

  local state = redis.call('MGET', kpid, kserial)
  local last = tonumber(state[1] or '0')
  local serial = tonumber(state[2])
  if serial == nil then
    serial = 0
    local top = redis.call('ZRANGE', zkey, -1, -1, 'WITHSCORES')
    if top[2] ~= nil then serial = tonumber(top[2]) end
  end
  local first_serial = serial + 1

  local skipped = 0
  if n > limit then skipped = n - limit end
  local m = n - skipped

  -- make room for m new references
  local trimmed = 0
  local excess = redis.call('ZCARD', zkey) + m - limit
  if excess > 0 then
    local popped = redis.call('ZPOPMIN', zkey, excess)
    for i = 1, #popped, 2 do
      redis.call('DEL', popped[i])
    end
    trimmed = #popped / 2
  end

  local zargs = {}
  local pids = {}
  local max_ttl = 0
  for k = skipped + 1, n do
    local ttl = ttls[k]
    local value = values[k]
    local tries = 0
    repeat
      last = (last % 65535) + 1
      tries = tries + 1
      if tries > 65535 then
        return redis.error_reply('ERR save_messages: no free packet id')
      end
    until redis.call('SET', prefix .. last, value, 'PX', ttl, 'NX')
    serial = serial + 1
    zargs[#zargs + 1] = serial
    zargs[#zargs + 1] = prefix .. last
    pids[#pids + 1] = string.char(math.floor(last / 256), last % 256)
    if ttl > max_ttl then max_ttl = ttl end
  end

  if m > 0 then
    -- chunked: Lua's unpack() is limited by the C stack (LUAI_MAXCSTACK = 8000)
    for i = 1, #zargs, 7000 do
      redis.call('ZADD', zkey, unpack(zargs, i, math.min(i + 6999, #zargs)))
    end
    redis.call('SET', kpid, last, 'KEEPTTL')
    redis.call('SET', kserial, serial, 'KEEPTTL')
    local pttl = redis.call('PTTL', zkey)
    if pttl < max_ttl then  -- -1 (new key, no TTL) or shorter than this batch's longest TTL
      for _, key in ipairs({zkey, kpid, kserial}) do
        local cur = redis.call('PTTL', key)
        if cur < max_ttl then redis.call('PEXPIRE', key, max_ttl) end
      end
    end
  end
  local attached = ''
  if kattached then attached = redis.call('GET', kattached) or '' end
  reply[#reply + 1] = trimmed
  reply[#reply + 1] = skipped
  reply[#reply + 1] = first_serial
  reply[#reply + 1] = table.concat(pids)
  reply[#reply + 1] = attached
end
return reply
