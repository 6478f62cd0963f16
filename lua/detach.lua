--[[
detach.lua -- the connection of one session of ONE client ended: stop forwarding its new messages.

KEYS:
  KEYS[1]  <p>{client}_attached   STRING "<service_id>|<session_id>" (set by fetch_undelivered.lua)
ARGV:
  ARGV[1]  session id of the connection that ended
Returns: integer 1 when the attachment belonged to that session and was deleted, 0 otherwise (no
  attachment, or another session attached since: a late Detach of an old connection must not cut off
  the new one). The session id is what follows the FIRST "|" (service ids never contain "|").
]]
local value = redis.call('GET', KEYS[1])
if not value then
  return 0
end
local bar = string.find(value, '|', 1, true)
if bar and string.sub(value, bar + 1) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
