"""Pure rules: policy, decisions, events and their codec, the group and batch folds, the rank split, the stall bound.

Standard library, msgspec, pydantic (a group policy) and orjson only: no clock, no logging, no I/O (the import-rule
test holds it).
The same events in the same order give the same outputs in any process, which replay and verify rely on.
"""
