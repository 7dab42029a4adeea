"""Where the log lives: key names, stream helpers, the Lua scripts (`lua/`), leases, runs, the archive's
segment files and the entry sources that read either. Talks to Redis; knows no role's loop.
"""
