--[[
save_messages.lua -- store a batch of messages for each of N persistent DEVICE clients, atomically
(one call for many clients: the cost of a script call is paid per batch, not per client). Needs
lua/packet_ids.lua prepended (the store does it).

KEYS: 4 per client, client c (1..N) at KEYS[4c-3 .. 4c] (each client's keys share its hash tag; in
  Redis Cluster the caller groups clients by hash slot, so one call touches one slot):
  KEYS[1]  <p>{client}_messages   ZSET member "<serial>:<size>", score = serial; the value of a message
                                  is at KEYS[1] .. "_" .. serial (same slot; not listed: its serial is
                                  only known inside the script)
  KEYS[2]  <p>{client}_pids       HASH packet id -> member: handed out and not acknowledged
  KEYS[3]  <p>{client}_state      HASH pid (last handed out), serial (last), bytes (stored), live,
                                  exp (Redis TIME in ms until which the client's keys were last given a TTL)
  KEYS[4]  <p>{client}_attached   STRING "<service_id>|<session_id>" set by fetch_undelivered.lua; not
                                  read: state.live is only ever equal to it (detach.lua removes both)
ARGV:
  ARGV[1]  count limit: most messages kept per client, 1..1000000
  ARGV[2]  byte limit: most bytes of stored values kept per client, >= 1
  ARGV[3]  handed-out limit: most packet ids in use per client, 1..65534
  ARGV[3+c] client c's batch, oldest first, as concatenated records (one argument instead of 2 per
           message: much less client-side encoding work), optionally after a source header:
               ["@" <partition> ":" <offset> ("," <offset>)* ";"] (<ttl_ms> "," <length> ":" <value>)*
           source  the tbmq.msg.persisted partition and the offsets of the batch's records, one per
                   record, ascending: records at or below the client's last applied offset of the same
                   partition (state.srcp / state.srco) are a replay and are not stored again
           then, optionally, an origin header: "#" (<partition> ":" <offset> | "-") ("," ...)* ";"
           origin  one entry per record: the tbmq.msg.all partition and offset the router read it from
                   ("-": unknown); a record at or below the highest origin offset already applied for the
                   client from that partition (state field "o<partition>") is a copy routed again and is
                   not stored
           ttl_ms  TTL in milliseconds: 1 to 15 decimal digits, no sign, no leading zero (> 0); passed to
                   SET PX as written
           length  decimal byte length of value (>= 3)
           value   1 type byte ("P" = PUBLISH, "R" = PUBREL) + "\0\0" (no packet id yet) + a
                   serialized tbmq.v1.PublishMsg
           e.g. "604800000,6:P\0\0abc1000,4:P\0\0x" (two messages)
Returns: a flat array of 8 elements per client, in KEYS order: {trimmed, skipped, first_serial,
  pids, attached, paused, replayed, routed_again} of client 1, then of client 2, ...
  trimmed       previously stored messages dropped (oldest first) to respect the count and byte limits
  skipped       how many of the batch's OLDEST messages were not stored because the batch alone held
                more than a limit allows: messages skipped+1 .. n are stored
  first_serial  serial of message skipped+1; the stored messages get consecutive serials
  pids          2-byte big-endian packet ids of the stored messages FORWARDED, in batch order: the
                first #pids/2 stored messages are to be forwarded to `attached`, the rest wait in Redis
  attached      KEYS[4c] when the client is LIVE on it (state.live, which equals it: its last fetched
                page reached the end), read atomically with the save; "" otherwise (nothing to forward: the
                client is not connected, or it is still paging and gets these messages in a later page)
  paused        1 when this save stopped forwarding because the handed-out limit was reached (the
                client is paging again: its connection fetches the rest when it has room), else 0
  replayed      how many of the batch's OLDEST records were already applied (source header): messages
                replayed+1 .. n are new; `skipped` counts among those
  routed_again  "" without an origin header; else one byte per record after the replayed ones, "1" for a
                record whose origin was applied before (not stored), "0" for the others, in batch order;
                `skipped` counts among the "0" ones

Cost per client: a fixed handful of calls (HMGET of the state, ZADD, HSET; unless state.bytes is 0 (every
  earlier message acknowledged: the usual save of a live client) ZCARD and, when live, HLEN and one HMGET
  finding the packet ids; when live one HSET recording them; a PEXPIREAT only for a key this call created
  or when the keys' deadline moves) plus one SET per message, the forwarded ones SET with their packet id
  already in the value; one TIME per call. The attachment is not read (state.live).

Rules (per client; a bad record or limit fails the whole call before anything is written):
  * A batch with a source header is applied once: device-persistence replays the records it saved but
    had not committed after a crash, and retries a save whose reply it did not get; the client's state
    keeps the partition and the last offset applied (state.srcp, state.srco, written with the state), so
    the replayed records (a prefix of the batch: one client's records come from one partition, in
    offset order) are skipped and the rest is stored as usual. Another partition (the topic's partition
    count changed) is not compared: its records are stored.
  * A record with an origin is applied once per origin: a router that crashed routes its uncommitted
    tbmq.msg.all records again, as new tbmq.msg.persisted records. The state keeps, per tbmq.msg.all
    partition, the highest origin offset applied for the client ("o<partition>"); a record at or below
    it is dropped wherever it is in the batch. Sound because a client's records from one tbmq.msg.all
    partition arrive in origin order, each router session's as a gap-free run from where it started
    reading (the idempotent producer writes nothing of a partition after a batch it failed to write,
    and a failed send stops the router), and every session starts at or below the first record the
    previous ones had not stored (offsets are committed only after the produce was acknowledged).
  * Messages are keyed by serial; the serial grows forever, so order never depends on packet ids
    (TBMQ #207). A message gets a packet id only when handed out (lua/packet_ids.lua): here, when the
    client is live and fewer than the handed-out limit ids are in use; else in a fetched page. So the
    65535 packet ids bound only what is in flight, never the backlog.
  * Before inserting, the oldest messages are trimmed (ZPOPMIN + DEL, their packet ids freed) until
    the count and byte limits hold with the new ones.
  * The client keys get a TTL of at least the longest message TTL saved so far, so a client that never
    comes back leaves nothing behind once all its messages have expired. They share one deadline,
    state.exp: a save whose messages would outlive it moves it to now + TTL + slack (slack = TTL / 8, at
    most an hour) and sets it on all three keys; other saves set it only on a ZSET or HASH this call
    created (Redis deletes one that was emptied by acknowledgements, and a new key has no TTL). So the
    keys outlive their last message by at most the slack, and a steady stream of saves to a client
    costs no PTTL and no PEXPIRE of keys that still have theirs. Except: the state of a LIVE client has
    no TTL (packet_ids.lua, state_lifetime: a client connected longer than the TTL with nothing saved
    keeps its attachment and serial cursor); it gets state.exp once it is not live (a save paused here,
    a page that does not reach the end, detach.lua).
]]
local limit, blimit, hlimit = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
if limit == nil or limit < 1 or limit > 1000000 or blimit == nil or blimit < 1
    or hlimit == nil or hlimit < 1 or hlimit > 65534 then
  return redis.error_reply('ERR save_messages: limits must be 1..1000000 messages, >= 1 byte, 1..65534 ids')
end
local nkeys = #KEYS
if nkeys == 0 or nkeys % 4 ~= 0 or #ARGV ~= nkeys / 4 + 3 then
  return redis.error_reply('ERR save_messages: 4 keys per client and one batch argument each')
end
local clients = nkeys / 4

-- parse every batch first: a malformed one fails the call before anything is written
local batches = {}
for c = 1, clients do
  local blob = ARGV[c + 3] or ''
  local ttls, values = {}, {}
  local pos, size = 1, #blob
  local src_part, offsets = nil, nil
  if string.sub(blob, 1, 1) == '@' then
    local colon = string.find(blob, ':', 2, true)
    local semi = colon and string.find(blob, ';', colon + 1, true)
    src_part = colon and string.sub(blob, 2, colon - 1)
    if not (semi and src_part ~= '' and tonumber(src_part)) then
      return redis.error_reply('ERR save_messages: bad source header of batch ' .. c)
    end
    offsets = {}
    for o in string.gmatch(string.sub(blob, colon + 1, semi - 1), '[^,]+') do
      local v = tonumber(o)
      if v == nil or (#offsets > 0 and v <= offsets[#offsets]) then
        return redis.error_reply('ERR save_messages: source offsets of batch ' .. c .. ' must ascend')
      end
      offsets[#offsets + 1] = v
    end
    pos = semi + 1
  end
  local origins = nil
  if string.sub(blob, pos, pos) == '#' then
    local semi = string.find(blob, ';', pos + 1, true)
    if not semi then
      return redis.error_reply('ERR save_messages: bad origin header of batch ' .. c)
    end
    origins = {}
    local no = 0
    for entry in string.gmatch(string.sub(blob, pos + 1, semi - 1), '[^,]+') do
      no = no + 1
      if entry == '-' then
        origins[no] = false
      else
        local p, o = string.match(entry, '^(%d+):(%d+)$')
        if not p then
          return redis.error_reply('ERR save_messages: bad origin header of batch ' .. c)
        end
        origins[no] = {p, tonumber(o), o, 'o' .. p}  -- the digits kept: written back as they came; the mark's field
      end
    end
    pos = semi + 1
  end
  while pos <= size do
    local comma = string.find(blob, ',', pos, true)
    local colon = comma and string.find(blob, ':', comma + 1, true)
    -- the TTL stays text: SET gets it as written (a Lua number would be formatted by "%.17g"; int_text)
    local ttl = comma and string.sub(blob, pos, comma - 1)
    local len = colon and tonumber(string.sub(blob, comma + 1, colon - 1))
    if not (ttl and len) or #ttl > 15 or not string.find(ttl, '^[1-9]%d*$') or len < 3 or len % 1 ~= 0
        or colon + len > size then
      return redis.error_reply('ERR save_messages: bad record at byte ' .. pos .. ' of batch ' .. c)
    end
    ttls[#ttls + 1] = ttl
    values[#values + 1] = string.sub(blob, colon + 1, colon + len)
    pos = colon + len + 1
  end
  if offsets and #offsets ~= #values then
    return redis.error_reply('ERR save_messages: ' .. #offsets .. ' source offsets for ' .. #values
                             .. ' records in batch ' .. c)
  end
  if origins and #origins ~= #values then
    return redis.error_reply('ERR save_messages: ' .. #origins .. ' origins for ' .. #values
                             .. ' records in batch ' .. c)
  end
  batches[c] = {ttls, values, src_part, offsets, origins}
end

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)

local reply = {}
for c = 1, clients do
  local base = (c - 1) * 4
  local zkey, pkey, skey = KEYS[base + 1], KEYS[base + 2], KEYS[base + 3]  -- KEYS[base + 4]: not read (state.live)
  local ttls, values, src_part, offsets = batches[c][1], batches[c][2], batches[c][3], batches[c][4]
  local origins = batches[c][5]
  local n = #values
  local prefix = zkey .. '_'

  -- the state, with the origin marks of the partitions this batch's records come from (one HMGET)
  local mark_at = {}  -- origin partition -> its field's index in the HMGET reply
  local state
  local one = n == 1 and origins and origins[1]
  if one then  -- the usual batch of a client: one record, with its origin
    mark_at[one[1]] = 8
    state = redis.call('HMGET', skey, 'pid', 'serial', 'bytes', 'live', 'exp', 'srcp', 'srco', one[4])
  else
    local fields = {'pid', 'serial', 'bytes', 'live', 'exp', 'srcp', 'srco'}
    if origins then
      for k = 1, n do
        local o = origins[k]
        if o and not mark_at[o[1]] then
          fields[#fields + 1] = o[4]
          mark_at[o[1]] = #fields
        end
      end
    end
    state = redis.call('HMGET', skey, unpack(fields))
  end
  local last = tonumber(state[1] or '0')
  local serial_text = state[2] or '0'  -- written back as it is when no message is stored (a trim only)
  local serial = tonumber(serial_text)
  local bytes = tonumber(state[3] or '0')
  local live = state[4]
  -- state.bytes is the sum of the sizes (>= 3 each) of the ZSET's members, kept by every script that adds
  -- or removes one (this one's saves and trims, remove_message.lua, fetch_undelivered.lua's cleanup of
  -- expired references): "0" means nothing is stored, so no ZCARD and no look at the packet ids in use
  local empty = state[3] == '0'
  local exp_text = state[5]  -- the keys' deadline, passed to PEXPIREAT as it is while it does not move
  local exp = tonumber(exp_text or '')
  local first_serial = serial + 1

  -- a replay (records already applied, same partition) is dropped from the front of the batch
  local replayed = 0
  local applied = src_part and state[6] == src_part and tonumber(state[7] or '')
  if applied then
    while replayed < n and offsets[replayed + 1] <= applied do replayed = replayed + 1 end
    if replayed > 0 then
      local t2, v2 = {}, {}
      for k = replayed + 1, n do
        t2[#t2 + 1] = ttls[k]
        v2[#v2 + 1] = values[k]
      end
      ttls, values, n = t2, v2, n - replayed
    end
  end
  -- the state fields that record the source, written with the state
  local src_fields = {}
  if src_part and n > 0 then src_fields = {'srcp', src_part, 'srco', offsets[#offsets]} end

  -- records routed again (an origin already applied) are dropped wherever they are in the batch
  local routed_again = ''
  if origins and n == 1 then  -- one record (the usual batch): the rule below without its tables
    local o = origins[replayed + 1]
    routed_again = '0'
    if o then
      local h = tonumber(state[mark_at[o[1]]] or '')
      if h and o[2] <= h then
        routed_again, n = '1', 0
      else
        src_fields[#src_fields + 1] = o[4]
        src_fields[#src_fields + 1] = o[3]
      end
    end
  elseif origins and n > 0 then
    local high, high_text = {}, {}
    for p, at in pairs(mark_at) do high[p] = tonumber(state[at] or '') end
    local t2, v2, marks = {}, {}, {}
    local kept = 0
    for k = 1, n do
      local o = origins[replayed + k]
      local again = false
      if o then
        local h = high[o[1]]
        if h and o[2] <= h then
          again = true
        else
          high[o[1]] = o[2]
          high_text[o[1]] = o[3]  -- set only for the marks this batch moves: they are written back
        end
      end
      if again then
        marks[k] = '1'
      else
        marks[k] = '0'
        kept = kept + 1
        t2[kept] = ttls[k]
        v2[kept] = values[k]
      end
    end
    routed_again = table.concat(marks)
    ttls, values, n = t2, v2, kept
    for p, text in pairs(high_text) do
      src_fields[#src_fields + 1] = 'o' .. p
      src_fields[#src_fields + 1] = text
    end
  end

  -- the batch alone beyond a limit: its oldest messages are not stored
  local skipped = 0
  if n > limit then skipped = n - limit end
  local batch_bytes = 0
  for k = skipped + 1, n do batch_bytes = batch_bytes + #values[k] end
  while skipped < n and batch_bytes > blimit do
    skipped = skipped + 1
    batch_bytes = batch_bytes - #values[skipped]
  end
  local m = n - skipped

  -- make room: oldest first, until both limits hold with the m new messages
  local trimmed = 0
  local members = 0  -- left in the ZSET before the ZADD (0: the ZADD creates it)
  if m > 0 then
    if not empty then members = redis.call('ZCARD', zkey) end
    local excess = members + m - limit
    while excess > 0 or bytes + batch_bytes > blimit do
      local popped = redis.call('ZPOPMIN', zkey, math.max(excess, 1))
      if #popped == 0 then break end
      for i = 1, #popped, 2 do
        local member = popped[i]
        local serial, size = member_parts(member)
        local mkey = prefix .. serial
        local head = redis.call('GETRANGE', mkey, 1, 2)
        if #head == 2 then
          local pid = string.byte(head, 1) * 256 + string.byte(head, 2)
          if pid > 0 and redis.call('HGET', pkey, pid) == member then redis.call('HDEL', pkey, pid) end
        end
        redis.call('DEL', mkey)
        bytes = bytes - size
        excess = excess - 1
        trimmed = trimmed + 1
        members = members - 1
      end
    end
    if bytes < 0 then bytes = 0 end
  end

  -- state.live is only ever the attachment itself (detach.lua removes both; fetch_undelivered.lua sets it to
  -- the attachment it holds): no GET of KEYS[4]
  local attached = live or ''
  local forwarding = attached ~= ''
  -- the packet ids of the messages forwarded, found at once (packet_ids.lua free_pids: one HMGET, none when
  -- no id is in use) and written into their values as they are SET (no SETRANGE); the ids recorded with one
  -- HSET
  local ids = {}
  local paused = 0
  local new_pids = false  -- the HSET of the ids creates the HASH
  if forwarding and m > 0 then
    -- nothing stored (state.bytes "0"): every id the HASH may still hold names a message that is gone, so
    -- none is in use and the next ones are free (no HLEN, no HMGET)
    local in_use = empty and 0 or handed_out(pkey, prefix, hlimit)
    local forwarded = math.min(m, math.max(hlimit - in_use, 0))
    new_pids = in_use == 0 and forwarded > 0
    if forwarded > 0 then ids, last = free_pids(pkey, last, forwarded, prefix, in_use == 0) end
    if forwarded < m then
      paused = 1
      redis.call('HDEL', skey, 'live')
    end
  end
  local zargs = {}
  local pids = {}
  local hargs = {}
  local max_ttl = 0
  for k = skipped + 1, n do
    local ttl = ttls[k]
    local value = values[k]
    serial = serial + 1
    local digits = int_text(serial)  -- converted once: the member, the value's key, the ZADD score, the state
    serial_text = digits
    local member = digits .. ':' .. int_text(#value)
    local pid = ids[k - skipped]
    if pid then
      local pb = pid_bytes(pid)
      value = string.sub(value, 1, 1) .. pb .. string.sub(value, 4)
      pids[#pids + 1] = pb
      hargs[#hargs + 1] = int_text(pid)
      hargs[#hargs + 1] = member
    end
    redis.call('SET', prefix .. digits, value, 'PX', ttl)
    zargs[#zargs + 1] = digits
    zargs[#zargs + 1] = member
    bytes = bytes + #value
    local ttl_ms = tonumber(ttl)
    if ttl_ms > max_ttl then max_ttl = ttl_ms end
  end
  if #hargs > 0 then record_pids(pkey, hargs) end

  if m > 0 or trimmed > 0 then
    -- chunked: Lua's unpack() is limited by the C stack (LUAI_MAXCSTACK = 8000)
    for i = 1, #zargs, 7000 do
      redis.call('ZADD', zkey, unpack(zargs, i, math.min(i + 6999, #zargs)))
    end
    local moved = moved_exp(exp, now, max_ttl)
    if moved then  -- the deadline moves: all three keys
      exp_text = int_text(moved)
      redis.call('HSET', skey, 'pid', int_text(last), 'serial', serial_text, 'bytes', int_text(bytes),
                 'exp', exp_text, unpack(src_fields))
      redis.call('PEXPIREAT', zkey, exp_text)
      redis.call('PEXPIREAT', pkey, exp_text)
      -- a live state has no TTL (packet_ids.lua, state_lifetime); one paused here is not live any more
      if not live or paused == 1 then redis.call('PEXPIREAT', skey, exp_text) end
    else  -- the state keeps its TTL; only a ZSET or HASH created by this call needs one
      redis.call('HSET', skey, 'pid', int_text(last), 'serial', serial_text, 'bytes', int_text(bytes),
                 unpack(src_fields))
      if members == 0 then redis.call('PEXPIREAT', zkey, exp_text) end
      if new_pids then redis.call('PEXPIREAT', pkey, exp_text) end
      if live and paused == 1 then redis.call('PEXPIREAT', skey, exp_text) end  -- not live any more
    end
  end
  reply[#reply + 1] = trimmed
  reply[#reply + 1] = skipped
  reply[#reply + 1] = first_serial
  reply[#reply + 1] = table.concat(pids)
  reply[#reply + 1] = attached
  reply[#reply + 1] = paused
  reply[#reply + 1] = replayed
  reply[#reply + 1] = routed_again
end
return reply
