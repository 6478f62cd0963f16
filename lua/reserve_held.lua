--[[
reserve_held.lua -- a block of serials and packet ids for each of N live clients whose stores are empty, so
device-persistence may hand their next QoS 1 copies out from memory ("held forwards",
tbmq_device_persistence.held). Needs lua/packet_ids.lua prepended (the store does it).

KEYS: 1 per client: KEYS[c] = <p>{client}_state, the HASH save_messages.lua documents (pid = last packet id
  handed out, serial = last serial, bytes = stored bytes, live = the attachment new messages are forwarded to)
ARGV:
  ARGV[1]    block size: how many serials (and as many packet ids) to reserve, 1..65534
  ARGV[1+c]  the attachment "<service_id>|<session_id>" client c is expected to be live on
Returns: a flat array of 3 integers per client, in KEYS order: {serial, pid, serial_end}: the client's last
  serial and packet id before the block, and the block's last serial; the state's serial is serial_end now and
  its pid the block's last id (pid + size, wrapping 65535 -> 1), so whatever a script hands out next (after a
  crash of the caller too) comes after every id and serial of the block. {-1, -1, -1} for a client that is not
  eligible, nothing written: its state is missing, it stores anything (state.bytes is not "0"), or it is not
  live on that attachment (paging, paused, detached, or attached elsewhere): it stays with save_messages.lua.
Cost per client: one HMGET, and one HSET when eligible.
]]
local size = tonumber(ARGV[1])
if size == nil or size < 1 or size > 65534 or size % 1 ~= 0 then
  return redis.error_reply('ERR reserve_held: the block size must be 1..65534')
end
if #KEYS == 0 or #ARGV ~= #KEYS + 1 then
  return redis.error_reply('ERR reserve_held: one key and one attachment per client')
end
local reply = {}
for c = 1, #KEYS do
  local skey = KEYS[c]
  local state = redis.call('HMGET', skey, 'pid', 'serial', 'bytes', 'live')
  if state[3] == '0' and state[4] and state[4] == ARGV[c + 1] then
    local pid = tonumber(state[1] or '0')
    local serial = tonumber(state[2] or '0')
    redis.call('HSET', skey, 'pid', int_text((pid + size - 1) % 65535 + 1), 'serial', int_text(serial + size))
    reply[#reply + 1] = serial
    reply[#reply + 1] = pid
    reply[#reply + 1] = serial + size
  else
    reply[#reply + 1] = -1
    reply[#reply + 1] = -1
    reply[#reply + 1] = -1
  end
end
return reply
