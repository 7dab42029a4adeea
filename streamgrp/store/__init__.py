"""Where the log lives: key names, stream helpers, the Lua scripts (`lua/`) and the store adapters that
call them for a role (`assembler_store`, `batcher_store`: typed records in, function arguments out),
leases, runs, the archive's segment files and the entry sources that read either. Talks to Redis;
knows no role's loop.
"""
