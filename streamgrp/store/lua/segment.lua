-- Record one segment of a slot's generation (streamgrp.store.segments, for workers): its SlotSegment event
-- on the segments stream KEYS[2], only while the caller holds the slot's task, pending under its name in
-- the consumer group of the task queue KEYS[1]. A worker whose task was taken over (it stalled past the
-- claim time and another worker reclaimed it) is refused (TAKEN), so the segments of a slot come from one
-- holder at a time and whoever holds the task continues from them.
-- A segment is also the holder's sign of life: the task's pending entry is claimed again by its holder
-- (XAUTOCLAIM from the entry itself, JUSTID: the delivery count stays), so its idle time starts over and a
-- task whose generation keeps making segments is not taken over as one a stopped worker left idle.
-- ARGV: 1 the consumer group, 2 the task's entry id, 3 the caller's consumer name, 4 the SlotSegment
-- header, 5 its tensors. Returns the segment's entry id.
-- The whole input is checked before the first write.
if #ARGV ~= 5 or ARGV[1] == '' or ARGV[3] == '' or ARGV[4] == '' or ARGV[5] == ''
    or not string.match(ARGV[2], '^%d+%-%d+$') then
  return redis.error_reply('BAD_INPUT segment takes a consumer group, a task entry id (ms-seq), a consumer name, '
                           .. 'a segment header and its tensors, got ' .. #ARGV .. ' arguments')
end
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
if #pending == 0 then
  return redis.error_reply('TAKEN task entry ' .. ARGV[2] .. ' is not pending in group ' .. ARGV[1]
                           .. ' (done, or never delivered)')
end
if pending[1][2] ~= ARGV[3] then
  return redis.error_reply('TAKEN task entry ' .. ARGV[2] .. ' is held by ' .. pending[1][2] .. ' now, not '
                           .. ARGV[3])
end
local id = redis.call('XADD', KEYS[2], '*', 'h', ARGV[4], 'b', ARGV[5])
redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[3], 0, ARGV[2], 'COUNT', 1, 'JUSTID')
return id
