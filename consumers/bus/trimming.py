"""Safe trimming: a stream loses only entries no consumer group still needs, and a traj
stream keeps every entry that a scored entry not yet consumed names."""

from __future__ import annotations

import time
from collections.abc import Sequence

import redis.asyncio as aioredis

from rollq.consumers.bus.entries import as_text, translated_errors
from rollq.consumers.bus.orphans import dead_letter_orphans
from rollq.schemas.keys import partner_key

# KEYS[1] stream; ARGV[1] retention floor id ('' for none). Trims below the oldest entry some
# consumer group still needs: its oldest pending entry, or the first one it has not read.
# Without consumer groups nothing is trimmed: nobody has consumed anything yet.
# KEYS[2], when given, is a stream whose entries name entries of KEYS[1] in field 'traj'
# (the partition's scored stream): every entry named by one that some group of KEYS[2] has
# not consumed (all of them, before KEYS[2] has a group) is kept, and with a retention
# floor so is the trajectory of the oldest scored entry still retained (trainer replay).
# A 'traj' value that names no entry KEYS[1] can hold (malformed, before its first entry,
# after its last id) pins nothing: the ids of such scored entries that no group of KEYS[2]
# was delivered yet come back (reply: {trimmed, orphans}) for the caller to dead-letter.
_SAFE_TRIM = """
-- Entry ids stay decimal strings: Lua numbers are doubles, and an id above 2^53 turned
-- into one comes back as 1.8e+19, which XTRIM refuses (an entry naming such an id once
-- made every trim fail).
local MAX = '18446744073709551615'
local function parse(id)
  local ms, seq = string.match(id, '^(%d+)%-(%d+)$')
  if ms == nil then return nil end
  local parts = {}
  for i, part in ipairs({ms, seq}) do
    part = string.match(part, '^0*(%d-)$')  -- no leading zeros: longer means larger
    if part == '' then part = '0' end
    if #part > #MAX or (#part == #MAX and part > MAX) then return nil end
    parts[i] = part
  end
  return parts
end
local function below(a, b)  -- a < b, both decimal strings without leading zeros
  if #a ~= #b then return #a < #b end
  return a < b
end
local function less(a, b) return below(a[1], b[1]) or (a[1] == b[1] and below(a[2], b[2])) end
local function increment(digits)
  local i = #digits
  while i > 0 and string.sub(digits, i, i) == '9' do i = i - 1 end
  if i == 0 then return '1' .. string.rep('0', #digits) end
  return string.sub(digits, 1, i - 1) .. string.char(string.byte(digits, i) + 1)
    .. string.rep('0', #digits - i)
end
local function after(id)  -- the id right after id (past the last one: id itself)
  if id[2] ~= MAX then return {id[1], increment(id[2])} end
  if id[1] ~= MAX then return {increment(id[1]), '0'} end
  return id
end
local function needed(key)
  if redis.call('EXISTS', key) == 0 then return nil end
  local floor = nil
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', key)) do
    local info = {}
    for i = 1, #g, 2 do info[g[i]] = g[i + 1] end
    local candidate = after(parse(info['last-delivered-id']))
    if info['pending'] > 0 then
      local oldest = parse(redis.call('XPENDING', key, info['name'])[2])
      if less(oldest, candidate) then candidate = oldest end
    end
    if floor == nil or less(candidate, floor) then floor = candidate end
  end
  return floor
end
local function ref(fields)  -- the 'traj' value: false when absent, nil when no id
  for i = 1, #fields, 2 do
    if fields[i] == 'traj' then return parse(fields[i + 1]) end
  end
  return false
end
local function field(reply, name)  -- a value of a flat name/value reply (XINFO STREAM)
  for i = 1, #reply, 2 do
    if reply[i] == name then return reply[i + 1] end
  end
  return nil
end
local floor = needed(KEYS[1])
if floor == nil then return {0, {}} end
if ARGV[1] ~= '' then
  local retention = parse(ARGV[1])
  if less(retention, floor) then floor = retention end
end
local orphans = {}
if #KEYS > 1 then
  local stream = redis.call('XINFO', 'STREAM', KEYS[1])
  local first = field(stream, 'first-entry')
  local oldest = first and parse(first[1])  -- false when the stream is empty
  local newest = parse(field(stream, 'last-generated-id'))
  local delivered = nil  -- the last id every group of KEYS[2] was delivered, at most
  if redis.call('EXISTS', KEYS[2]) == 1 then
    for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[2])) do
      local last = parse(field(g, 'last-delivered-id'))
      if delivered == nil or less(delivered, last) then delivered = last end
    end
  end
  local unconsumed = needed(KEYS[2])
  local from = '-'
  if unconsumed ~= nil then from = unconsumed[1] .. '-' .. unconsumed[2] end
  local entries = redis.call('XRANGE', KEYS[2], from, '+')
  if ARGV[1] ~= '' then
    local kept = redis.call('XRANGE', KEYS[2], ARGV[1], '+', 'COUNT', 1)
    if #kept > 0 then table.insert(entries, kept[1]) end
  end
  for _, entry in ipairs(entries) do
    local named = ref(entry[2])
    if named == nil or (named and (not oldest or less(named, oldest) or less(newest, named)))
    then
      if delivered == nil or less(delivered, parse(entry[1])) then
        table.insert(orphans, entry[1])
      end
    elseif named and less(named, floor) then
      floor = named
    end
  end
end
return {redis.call('XTRIM', KEYS[1], 'MINID', floor[1] .. '-' .. floor[2]), orphans}
"""

async def trim_streams(redis: aioredis.Redis, streams: Sequence[str],
                       retention_ms: int | None = None) -> int:
    """Trim streams below the oldest entry some consumer group still needs.

    Safe from any process: each group's floor is its oldest pending or first unread entry,
    read in the same script as the XTRIM. ``retention_ms`` also keeps acknowledged entries
    younger than that, for replay (rescore, trainer resume). A stream without consumer
    groups is left alone. Returns the number of entries removed.

    A scored entry whose ``traj`` field names no entry the traj stream can hold, and that
    no trainer was delivered yet, is dead-lettered (``consumers.bus.orphans``) instead of
    pinning the traj stream or waiting for a trainer to fail on it.
    """
    floor = ""
    if retention_ms is not None:
        floor = f"{max(0, int(time.time() * 1000) - retention_ms)}-0"
    removed = 0
    for stream in streams:
        keys = [stream]
        if stream.endswith(":traj"):  # scored entries name traj entries: keep those
            keys.append(partner_key(stream, "scored"))
        async with translated_errors("trimming"):
            trimmed, orphans = await redis.eval(_SAFE_TRIM, len(keys), *keys, floor)
        removed += int(trimmed)
        if orphans:
            await dead_letter_orphans(redis, keys[1], [as_text(entry) for entry in orphans])
    return removed
