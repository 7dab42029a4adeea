-- Prepended to the commit scripts (streamgrp.store.scripts): acknowledging and checking input without
-- ever unpacking a list whose length comes from the caller. Lua's unpack fails past about 8,000
-- values, and a script that fails after it has written leaves half a commit behind, so every
-- acknowledgement goes in chunks of at most ACK_CHUNK ids.

-- XACK ARGV[first .. first + n - 1] on stream under group; returns how many were acknowledged.
local function ack_range(stream, group, first, n)
  local acked = 0
  local a = first
  local last = first + n - 1
  while a <= last do
    local b = math.min(a + ACK_CHUNK - 1, last)
    acked = acked + redis.call('XACK', stream, group, unpack(ARGV, a, b))
    a = b + 1
  end
  return acked
end

-- XACK the ids of the list ids (any length) on stream under group, in the same bounded chunks.
local function ack_list(stream, group, ids)
  local acked = 0
  for a = 1, #ids, ACK_CHUNK do
    acked = acked + redis.call('XACK', stream, group, unpack(ids, a, math.min(a + ACK_CHUNK - 1, #ids)))
  end
  return acked
end

-- A count read from ARGV: a non-negative integer that leaves `need` more arguments in range.
local function count_at(index, need_per_item, what)
  local n = tonumber(ARGV[index])
  if n == nil or n < 0 or n ~= math.floor(n) then
    error('BAD_INPUT ' .. what .. ' at argument ' .. index .. ' is not a count: ' .. tostring(ARGV[index]))
  end
  if index + n * need_per_item > #ARGV then
    error('BAD_INPUT ' .. what .. ' at argument ' .. index .. ' runs past the end of the input')
  end
  return n
end
