--[[
detach.lua -- the connection of one session of ONE client ended: stop forwarding its new messages.
Needs lua/packet_ids.lua prepended (the store does it: state_lifetime).

KEYS (one client's, sharing its hash tag: one slot in Redis Cluster):
  KEYS[1]  <p>{client}_attached   STRING "<service_id>|<session_id>" (set by fetch_undelivered.lua)
  KEYS[2]  <p>{client}_state      HASH; its `live` field (the attachment saves forward to) is removed with
                                  the attachment, and the state, which had no TTL while live, expires again at
                                  state.exp (packet_ids.lua, state_lifetime)
ARGV:
  ARGV[1]  session id of the connection that ended
  ARGV[2]  TTL (ms) for a state that has no state.exp yet (nothing was ever saved; absent: 7 days)
Returns: integer 1 when the attachment belonged to that session and was deleted, 0 otherwise (no
  attachment, or another session attached since: a late Detach of an old connection must not cut off
  the new one). The session id is what follows the FIRST "|" (service ids never contain "|").

Invariant kept with fetch_undelivered.lua (which sets state.live only to the attachment it holds or has
just set, and removes it when it sets another) and clear_all.lua (which deletes both): state.live, when
present, equals KEYS[1]. save_messages.lua relies on it to forward without reading KEYS[1].
]]
local value = redis.call('GET', KEYS[1])
if not value then
  return 0
end
local bar = string.find(value, '|', 1, true)
if bar and string.sub(value, bar + 1) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if redis.call('HDEL', KEYS[2], 'live') == 1 then
    state_lifetime(KEYS[2], false, tonumber(ARGV[2] or '') or 604800000)
  end
  return 1
end
return 0
