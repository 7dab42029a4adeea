-- Prepended to every commit script that counts (streamgrp.store.scripts): counter changes go through
-- incr(), so the script can return exactly what it applied and the caller mirrors it in metrics.
local applied, order = {}, {}
-- Writes wait for with_counts: a round that counts one field once per decision costs one HINCRBY per
-- field, not one per decision (each redis.call from Lua is a command's worth of server work).
local owed, owed_order = {}, {}

local function incr(hash, field, amount)
  local fields = owed[hash]
  if fields == nil then fields = {}; owed[hash] = fields; owed_order[#owed_order + 1] = hash end
  if fields[field] == nil then fields[#fields + 1] = field; fields[field] = 0 end
  fields[field] = fields[field] + amount
  if applied[field] == nil then order[#order + 1] = field; applied[field] = 0 end
  applied[field] = applied[field] + amount
end

-- Write the owed counter changes, then the reply: the script's own leading values; the applied
-- (field, amount) pairs follow them. Every script that counts returns through here.
local function with_counts(reply)
  for _, hash in ipairs(owed_order) do
    local fields = owed[hash]
    for _, field in ipairs(fields) do redis.call('HINCRBY', hash, field, fields[field]) end
  end
  for _, field in ipairs(order) do
    reply[#reply + 1] = field
    reply[#reply + 1] = applied[field]
  end
  return reply
end
