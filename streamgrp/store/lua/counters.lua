-- Prepended to every commit script that counts (streamgrp.store.scripts): counter changes go through
-- incr(), so the script can return exactly what it applied and the caller mirrors it in metrics.
local applied, order = {}, {}

local function incr(hash, field, amount)
  redis.call('HINCRBY', hash, field, amount)
  if applied[field] == nil then order[#order + 1] = field; applied[field] = 0 end
  applied[field] = applied[field] + amount
end

-- reply: the script's own leading values; the applied (field, amount) pairs follow them
local function with_counts(reply)
  for _, field in ipairs(order) do
    reply[#reply + 1] = field
    reply[#reply + 1] = applied[field]
  end
  return reply
end
